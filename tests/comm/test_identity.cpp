// Identity rules (comm/identity.h) on fake environments: precedence MPI > torchrun > SLURM >
// single, the mpirun-inside-sbatch trap, and a UserError naming the variable on bad input.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "comm/identity.h"

using namespace dflash::comm;

namespace {
EnvLookup fake(std::map<std::string, std::string> m) {
  return [m](const std::string& k) -> std::optional<std::string> {
    auto it = m.find(k);
    if (it == m.end()) return std::nullopt;
    return it->second;
  };
}
std::string user_error(std::map<std::string, std::string> m) {
  try {
    parse_env(fake(m));
  } catch (const dflash::UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Identity, SingleProcess) {
  Identity id = parse_env(fake({{"HOME", "/root"}}));
  EXPECT_EQ(id.source, Source::Single);
  EXPECT_EQ(id.rank, 0);
  EXPECT_EQ(id.world_size, 1);
  EXPECT_EQ(id.local_rank, 0);
}

TEST(Identity, Torchrun) {
  Identity id = parse_env(fake({{"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"},
                                {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "10.0.0.1"},
                                {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  EXPECT_EQ(id.source, Source::Torchrun);
  EXPECT_EQ(id.rank, 5);
  EXPECT_EQ(id.local_rank, 1);
  EXPECT_EQ(id.world_size, 8);
  EXPECT_EQ(id.local_world_size, 4);
  EXPECT_EQ(id.master_addr, "10.0.0.1");
  EXPECT_EQ(id.master_port, 29500);
  EXPECT_TRUE(id.agent_store);
  EXPECT_EQ(id.restart_count, 2);
}

TEST(Identity, Slurm) {
  Identity id = parse_env(fake({{"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "2"}, {"SLURM_NTASKS", "8"},
                                {"SLURM_STEP_TASKS_PER_NODE", "4(x2)"}}));
  EXPECT_EQ(id.source, Source::Slurm);
  EXPECT_EQ(id.rank, 6);
  EXPECT_EQ(id.local_rank, 2);
  EXPECT_EQ(id.world_size, 8);
  EXPECT_EQ(id.local_world_size, 4);
}

// mpirun inside sbatch: every rank inherits SLURM_PROCID=0 from the batch step.
TEST(Identity, MpirunInsideSbatchIgnoresSlurm) {
  Identity id = parse_env(fake({{"SLURM_PROCID", "0"}, {"SLURM_LOCALID", "0"}, {"SLURM_NTASKS", "1"},
                                {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_RANK", "3"},
                                {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "8"}}));
  EXPECT_EQ(id.source, Source::Mpi);
  EXPECT_EQ(id.rank, 3);
  EXPECT_EQ(id.world_size, 8);
  EXPECT_EQ(id.local_rank, 3);
}

// srun --mpi=pmix: PMIX_RANK marks an MPI launch even though OMPI_COMM_WORLD_* is absent.
TEST(Identity, SrunPmixIsMpi) {
  Identity id = parse_env(fake({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "4"}, {"PMIX_RANK", "2"}}));
  EXPECT_EQ(id.source, Source::Mpi);
  EXPECT_EQ(id.rank, 2);
}

// MPI wins over a stray torchrun environment.
TEST(Identity, MpiBeatsTorchrun) {
  Identity id = parse_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"},
                                {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"}}));
  EXPECT_EQ(id.source, Source::Mpi);
  EXPECT_EQ(id.rank, 1);
}

TEST(Identity, BadEnvironmentNamesTheVariable) {
  EXPECT_NE(user_error({{"RANK", "x1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}}).find("RANK='x1'"),
            std::string::npos);
  EXPECT_NE(user_error({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "1"}})
                .find("RANK=4 is not a rank of a world of WORLD_SIZE=4"),
            std::string::npos);
  EXPECT_NE(user_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_PORT", "29500"}})
                .find("MASTER_ADDR is not set"),
            std::string::npos);
  EXPECT_NE(user_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"}})
                .find("MASTER_PORT is not set"),
            std::string::npos);
  EXPECT_NE(user_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "h"},
                        {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT=70000"),
            std::string::npos);
  EXPECT_NE(user_error({{"RANK", "1"}, {"WORLD_SIZE", "2"}}).find("LOCAL_RANK is not set"), std::string::npos);
  EXPECT_NE(user_error({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "8"}}).find("SLURM_PROCID=9"), std::string::npos);
  EXPECT_NE(user_error({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2.5"}}).find("SLURM_NTASKS='2.5'"),
            std::string::npos);
  EXPECT_NE(user_error({{"OMPI_COMM_WORLD_SIZE", "2"}}).find("OMPI_COMM_WORLD_RANK is not set"),
            std::string::npos);
}

// A world of 1 under torchrun needs no rendezvous address.
TEST(Identity, TorchrunWorldOfOneNeedsNoMaster) {
  Identity id = parse_env(fake({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}}));
  EXPECT_EQ(id.world_size, 1);
  EXPECT_TRUE(id.master_addr.empty());
}
