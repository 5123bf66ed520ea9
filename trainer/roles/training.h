// The training run of one rank: the entry point main calls once the rank has started.
//
// Owns nothing beyond the call: it resolves the run plan (trainer/roles/plan.h) on every rank
// (so bad data, a target that does not fit the drafter config, or a state of another layout is
// reported by every rank before anything is written), creates the communicator and the drafter
// group, then runs this rank's role: the target loop, the drafter loop, or both in turn in a
// colocated (single-process) run. Returns the process exit code; throws on failure (main's
// fail_fast ends every rank). docs/training.md describes the run as a user sees it.
// Thread-safety: call once, from main's thread.
#pragma once

#include "trainer/config.h"
#include "trainer/roles/startup.h"

namespace dflash {

int run_training(const Config& cfg, const roles::RankContext& ctx, bool resume);

}  // namespace dflash
