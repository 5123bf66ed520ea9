#include "comm/identity.h"

#include <mpi.h>
#include <unistd.h>

#include <atomic>
#include <charconv>
#include <cstdlib>

#include "comm/check.h"
#include "comm/progress.h"
#include "comm/startup_watchdog.h"
#include "core/error.h"
#include "core/log.h"

#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::comm {
namespace {

std::atomic<bool> g_mpi_ours{false};
std::atomic<bool> g_mpi_multiple{false};

// A strictly parsed integer environment variable (whole string, no sign games beyond '-').
std::optional<int> get_int(const EnvLookup& env, const std::string& name) {
  std::optional<std::string> v = env(name);
  if (!v) return std::nullopt;
  const std::string& s = *v;
  int out = 0;
  auto r = std::from_chars(s.data(), s.data() + s.size(), out);
  if (s.empty() || r.ec != std::errc() || r.ptr != s.data() + s.size())
    throw_user("environment variable {}='{}' is not an integer", name, s);
  return out;
}

int require_int(const EnvLookup& env, const std::string& name, const char* launcher) {
  std::optional<int> v = get_int(env, name);
  if (!v) throw_user("environment variable {} is not set, but the environment looks like {}", name, launcher);
  return *v;
}

// SLURM_STEP_TASKS_PER_NODE looks like "4" or "4(x2)" or "3,2": the first count is ours only
// when the step is uniform; return it when the form is simple.
std::optional<int> first_count(const std::optional<std::string>& v) {
  if (!v || v->empty()) return std::nullopt;
  int out = 0;
  auto r = std::from_chars(v->data(), v->data() + v->size(), out);
  if (r.ec != std::errc()) return std::nullopt;
  std::string rest(r.ptr, v->data() + v->size());
  if (!rest.empty() && rest.rfind("(x", 0) != 0) return std::nullopt;
  return out;
}

void check_ranks(const Identity& id, const char* rank_var, const char* size_var, const char* local_var) {
  if (id.world_size < 1) throw_user("environment variable {}={} must be at least 1", size_var, id.world_size);
  if (id.rank < 0 || id.rank >= id.world_size)
    throw_user("environment variable {}={} is not a rank of a world of {}={}", rank_var, id.rank,
               size_var, id.world_size);
  if (id.local_rank < 0 || id.local_rank >= id.world_size)
    throw_user("environment variable {}={} is not a local rank of a world of {}", local_var,
               id.local_rank, id.world_size);
}

std::string hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "?";
  return buf;
}

}  // namespace

const char* source_name(Source s) {
  switch (s) {
    case Source::Single: return "single";
    case Source::Mpi: return "mpi";
    case Source::Torchrun: return "torchrun";
    case Source::Slurm: return "slurm";
  }
  return "?";
}

std::string Identity::describe() const {
  return fmt::format("rank {}/{} (local {}/{}, {}, gpu {}, host {})", rank, world_size, local_rank,
                     local_world_size, source_name(source), gpu < 0 ? std::string("none") : std::to_string(gpu),
                     host);
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

Identity parse_env(const EnvLookup& env) {
  Identity id;
  bool mpi = env("OMPI_COMM_WORLD_SIZE") || env("PMIX_RANK") || env("PMI_RANK");
  if (mpi) {
    id.source = Source::Mpi;
    // Hints only: detect() asks MPI. Never SLURM_* here (mpirun inside sbatch: all 0).
    if (env("OMPI_COMM_WORLD_SIZE")) {
      id.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", "mpirun");
      id.rank = require_int(env, "OMPI_COMM_WORLD_RANK", "mpirun");
      id.local_rank = get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(0);
      id.local_world_size = get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE").value_or(id.world_size);
      check_ranks(id, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK");
    } else {
      const char* var = env("PMIX_RANK") ? "PMIX_RANK" : "PMI_RANK";
      id.rank = require_int(env, var, "a PMI launch");
      id.world_size = id.rank + 1;  // unknown until MPI answers
    }
    id.master_addr = env("MASTER_ADDR").value_or("");
    id.master_port = get_int(env, "MASTER_PORT").value_or(0);
    return id;
  }
  if (env("RANK") || env("WORLD_SIZE") || env("LOCAL_RANK")) {
    id.source = Source::Torchrun;
    id.rank = require_int(env, "RANK", "torchrun (RANK/WORLD_SIZE/LOCAL_RANK)");
    id.world_size = require_int(env, "WORLD_SIZE", "torchrun (RANK/WORLD_SIZE/LOCAL_RANK)");
    id.local_rank = require_int(env, "LOCAL_RANK", "torchrun (RANK/WORLD_SIZE/LOCAL_RANK)");
    id.local_world_size = get_int(env, "LOCAL_WORLD_SIZE").value_or(id.world_size);
    check_ranks(id, "RANK", "WORLD_SIZE", "LOCAL_RANK");
    if (id.local_world_size < 1 || id.local_rank >= id.local_world_size)
      throw_user("environment variable LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}", id.local_rank,
                 id.local_world_size);
    id.master_addr = env("MASTER_ADDR").value_or("");
    std::optional<int> port = get_int(env, "MASTER_PORT");
    if (id.world_size > 1 && id.master_addr.empty())
      throw_user("environment variable MASTER_ADDR is not set, but WORLD_SIZE={} needs a rendezvous "
                 "address", id.world_size);
    if (id.world_size > 1 && !port)
      throw_user("environment variable MASTER_PORT is not set, but WORLD_SIZE={} needs a rendezvous "
                 "port", id.world_size);
    if (port && (*port <= 0 || *port > 65535))
      throw_user("environment variable MASTER_PORT={} is not a TCP port (1..65535)", *port);
    id.master_port = port.value_or(0);
    id.agent_store = env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";
    id.restart_count = get_int(env, "TORCHELASTIC_RESTART_COUNT").value_or(0);
    return id;
  }
  if (env("SLURM_PROCID")) {
    id.source = Source::Slurm;
    id.rank = require_int(env, "SLURM_PROCID", "srun");
    id.world_size = env("SLURM_NTASKS") ? require_int(env, "SLURM_NTASKS", "srun")
                                        : require_int(env, "SLURM_NPROCS", "srun");
    id.local_rank = get_int(env, "SLURM_LOCALID").value_or(0);
    check_ranks(id, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID");
    id.local_world_size = first_count(env("SLURM_STEP_TASKS_PER_NODE"))
                              .value_or(first_count(env("SLURM_NTASKS_PER_NODE")).value_or(id.world_size));
    if (id.local_rank >= id.local_world_size) id.local_world_size = id.local_rank + 1;
    id.master_addr = env("MASTER_ADDR").value_or("");
    id.master_port = get_int(env, "MASTER_PORT").value_or(0);
    return id;
  }
  return id;  // single process
}

bool mpi_active() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

bool mpi_thread_multiple() { return g_mpi_multiple.load(); }

void ensure_mpi() {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return;
  int provided = 0;
  DFLASH_CHECK_MPI(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  g_mpi_ours = true;
  g_mpi_multiple = provided >= MPI_THREAD_MULTIPLE;
  if (provided < MPI_THREAD_SERIALIZED)
    throw CommError(fmt::format("MPI offers thread level {} only; dflash needs at least "
                                "MPI_THREAD_SERIALIZED", provided));
  // Errors come back as codes so that DFLASH_CHECK_MPI can name the call.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

void finalize_mpi() {
  if (g_mpi_ours && mpi_active()) {
    // MPI_Finalize waits for every rank (a PMIx fence): a rank that is stopped or hangs would hold
    // the others here forever; the start-up deadline bounds it too
    StartupPhase phase("MPI_Finalize (every rank meets at the end of the run)");
    MPI_Finalize();
  }
  progress::close();
}

Identity detect() {
  EnvLookup env = process_env();
  Identity id = parse_env(env);
  id.host = hostname();
  if (id.source == Source::Mpi) {
    {
      // bounded by comm.startup_timeout_s (comm/startup_watchdog.h): a rank that never starts
      // or is stopped holds every other rank here
      StartupPhase phase("MPI_Init");
      ensure_mpi();
    }
    DFLASH_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &id.rank));
    DFLASH_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &id.world_size));
    MPI_Comm node = MPI_COMM_NULL;
    StartupPhase phase("the identity exchange (MPI_Comm_split_type)");
    DFLASH_CHECK_MPI(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, id.rank, MPI_INFO_NULL, &node));
    DFLASH_CHECK_MPI(MPI_Comm_rank(node, &id.local_rank));
    DFLASH_CHECK_MPI(MPI_Comm_size(node, &id.local_world_size));
    MPI_Comm_free(&node);
  }
#ifdef DFLASH_CUDA
  int devices = static_cast<int>(c10::cuda::device_count());
  if (devices > 0) {
    id.gpu = id.local_rank % devices;
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(id.gpu));  // the default device of this rank
  }
#endif
  return id;
}

}  // namespace dflash::comm
