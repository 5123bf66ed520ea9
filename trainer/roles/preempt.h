// Preemption in the training roles (docs/training.md "Preemption"): how the ranks agree on the
// step after which a signalled run stops, so that every rank ends at the same step boundary with
// nothing in flight, the drafters' state of that step written, and exit code 4.
//
// The protocol (comm/preempt.h holds the flag a SIGTERM/SIGUSR1 sets):
//   - A target rank puts its flag into every batch it sends (stats[3]); a drafter rank adds its
//     own flag and those of the step's batches into the step's statistics, which the drafter
//     group all-reduces anyway: every drafter sees the same sum at the end of step s.
//   - The first step s whose sum is non-zero fixes stop_after = min(s + L - 1, last step), with
//     the lag L = data.prefetch + 2 (1 in a colocated run): the targets may already have
//     produced batches up to step s + L - 1, and these are trained, not dropped.
//   - After every step s, drafter 0 sends each target a control message (continue / stop). A
//     target takes control s before it produces a batch of step s + L (so it learns a stop
//     before producing anything past it), then stops after the batches of stop_after, and at
//     the end takes the remaining controls so that every send completes. The lag also keeps
//     NCCL's per-peer stream order safe: drafter 0's pending receives (data.prefetch batches)
//     are all of steps before s + L, which the target sends before it waits for control s.
//   - At stop_after the drafters write a state (whatever checkpoint.state_every says) and no
//     export; every rank then returns kExitPreempted. A stop that falls on the last step is a
//     normal end (exit 0, final export).
// Thread-safety: call from the rank's main thread.
#pragma once

#include <cstdint>

#include "comm/communicator.h"
#include "trainer/config.h"
#include "trainer/roles/plan.h"

namespace dflash::roles {

// Kinds of drafter 0 -> target control messages: header only (no tensors), batch = the step s.
// kControlStop: a stop was decided at step s, so stop_after = min(s + L - 1, last step).
// Header-only keeps them inside NCCL's send buffers: at most L of them are outstanding per
// target (it takes control s before step s + L), so drafter 0's p2p stream never blocks on
// a control send behind which its batch receives would wait (docs/comm.md "Preemption").
constexpr int32_t kControlContinue = 2;
constexpr int32_t kControlStop = 3;

int64_t stop_lag(const Config& cfg, const RunPlan& p);

// The target side: takes drafter 0's control messages in order.
class ControlReader {
 public:
  ControlReader(comm::Communicator& c, int leader_rank, const RunPlan& p, int64_t lag);
  // Before producing a batch of step t: takes every control up to step t - lag.
  void before_step(int64_t t);
  // -1, or the last step to produce (every batch of later steps is dropped from the plan).
  int64_t stop_after() const { return stop_after_; }
  // After the last batch: takes the remaining controls (through stop_after or the last step).
  void drain();

 private:
  void take_next();
  comm::Communicator& comm_;
  int leader_;
  const RunPlan& p_;
  int64_t lag_;
  int64_t next_ = 0;  // the next control step to take
  int64_t stop_after_ = -1;
};

}  // namespace dflash::roles
