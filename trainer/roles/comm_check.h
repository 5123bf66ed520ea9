// The communication self-test that dflash_rank runs with --comm-check [N].
//
// Owns: run_comm_check(): with the config's layout it moves N batches of several random
// tensors (seeded by the batch index, so the receiver verifies them bit-exactly) from the
// targets to the drafters along the run's schedule (trainer/roles/schedule.h: the same walks
// the training loops use), all-reduces over the drafter group after every round and checks
// the exact result, then logs one summary line (MB/s).
// Thread-safety: call from main's thread only.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "trainer/config.h"
#include "trainer/roles/startup.h"

namespace dflash::roles {

// The tensors of self-test batch k (deterministic in seed and k), on the CPU.
comm::Message make_check_batch(int64_t seed, int64_t k);

// --comm-check N. Returns the process exit code (0). Throws on any failure.
int run_comm_check(const RankContext& ctx, const Config& cfg, int64_t batches);

}  // namespace dflash::roles
