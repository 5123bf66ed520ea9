// Start-up of a rank (identity, logging, watchdog) and the communication self-test that
// dflash_rank runs with --comm-check / --whoami.
//
// Owns: start_rank(), which every mode of dflash_rank calls first, and run_comm_check(): with
// the config's layout it moves N batches of several random tensors (seeded by the batch index,
// so the receiver verifies them bit-exactly) from the targets to the drafters by the schedule
// (batch k: target k mod T -> drafter k mod D), all-reduces over the drafter group after every
// round and checks the exact result, then logs one summary line (MB/s).
// comm/ knows nothing of trainer/: main maps its Config onto LaunchOptions.
// Thread-safety: call from main's thread only.
#pragma once

#include <cstdint>
#include <string>

#include "comm/communicator.h"
#include "comm/identity.h"
#include "comm/schedule.h"

namespace dflash::comm {

struct LaunchOptions {
  CommOptions comm;
  int64_t target_ranks = 1;
  int64_t drafter_ranks = 1;
  bool colocated = false;
  std::string log_level = "info";
  int64_t console_rank = 0;
  bool per_rank_files = false;
  std::string run_dir = "runs/dflash";
  int64_t seed = 42;
};

struct RankContext {
  Identity id;
  Schedule schedule;
};

// Detects the identity, checks the world size against the layout (UserError naming
// layout.target_ranks/drafter_ranks), sets the log prefix "[dflash r5/8 drafter]", the console
// rank and per-rank files (<run_dir>/logs/rank<N>.log), installs the watchdog and signal
// handlers. check_layout=false (--whoami) accepts any world size.
RankContext start_rank(const LaunchOptions& opt, bool check_layout = true);

// The tensors of self-test batch k (deterministic in seed and k), on the CPU.
Message make_check_batch(int64_t seed, int64_t k);

// --comm-check N. Returns the process exit code (0). Throws on any failure.
int run_comm_check(const RankContext& ctx, const LaunchOptions& opt, int64_t batches);

// --whoami: every rank logs its identity; ranks then meet (an MPI barrier under MPI, the TCP
// store rendezvous otherwise) and rank 0 logs the list of all ranks.
int run_whoami(const RankContext& ctx, const LaunchOptions& opt);

}  // namespace dflash::comm
