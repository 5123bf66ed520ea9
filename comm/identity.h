// Who this process is: rank, local rank, world size, the launcher that started it, and its GPU.
//
// Owns: the rules that read the launcher's environment (docs/comm.md "Identity"), in this
// order of trust:
//   1. an MPI launcher (OMPI_COMM_WORLD_SIZE, PMIX_RANK or PMI_RANK is set): MPI is
//      initialised (MPI_THREAD_MULTIPLE when offered) and rank/size come from MPI itself, the
//      local rank from MPI_Comm_split_type(MPI_COMM_TYPE_SHARED). SLURM_* is never read then:
//      under `mpirun` inside `sbatch` every rank sees SLURM_PROCID=0.
//   2. a torchrun-style environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
//      MASTER_ADDR, MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE: the agent serves the store).
//   3. SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS (srun without MPI).
//   4. otherwise a single process.
// The GPU is local_rank % visible devices (only when CUDA is available, else -1).
// An inconsistent environment is a UserError naming the variable.
//
// Thread-safety: detect() is called once from main before any other thread starts; the MPI
// state functions below are safe to call from any thread after that.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace dflash::comm {

enum class Source { Single, Mpi, Torchrun, Slurm };
const char* source_name(Source s);

struct Identity {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  Source source = Source::Single;
  std::string master_addr;   // empty when the launcher gave none
  int master_port = 0;       // 0 when the launcher gave none
  bool agent_store = false;  // torchrun's agent already serves the store: every rank is a client
  int restart_count = 0;     // TORCHELASTIC_RESTART_COUNT (store key prefix per attempt)
  int gpu = -1;              // CUDA device of this rank, -1 without CUDA
  std::string host;          // hostname, for messages

  // "rank 3/8 (local 3/8, mpi, gpu 3, host h1)"
  std::string describe() const;
};

// Looks up one environment variable (tests pass fakes).
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
EnvLookup process_env();

// Applies the rules above to `env` without touching MPI: for an MPI launch it returns
// source=Mpi with the launcher's hints (OMPI_COMM_WORLD_*, else PMIX_RANK/PMI_RANK), which
// detect() then replaces by MPI's own answers. Throws UserError on an inconsistent environment.
Identity parse_env(const EnvLookup& env);

// The identity of this process (initialises MPI under an MPI launcher). Call once.
Identity detect();

// ---- MPI state (initialised by detect() under an MPI launcher, or lazily by ensure_mpi) --
bool mpi_active();              // MPI_Init done and MPI_Finalize not yet
bool mpi_thread_multiple();     // MPI_THREAD_MULTIPLE was granted (else callers serialise)
void ensure_mpi();              // MPI_Init_thread if not done yet (singleton runs)
void finalize_mpi();            // MPI_Finalize if we initialised it (success path only)

}  // namespace dflash::comm
