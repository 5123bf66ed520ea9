// The roles of a rank (internal to trainer/roles/): the target loop, the drafter loop and the
// colocated loop, and the drafter-side trainer they share.
//
// The batch walks come from the schedule (trainer/roles/schedule.h), nothing else.
// Target loop (target index i of T): for its batches k = i, i+T, ... from the plan's start
//   batch: read batch k, forward with capture, isend its BatchMessage (batch_message.h) to
//   drafter k mod D. Up to data.prefetch sends stay in flight, so the next batch is computed
//   while the previous ones travel; the time spent waiting for a free slot is the target's
//   wait time (the drafters are the bottleneck). Its busy time is taken with timeline marks
//   (metrics/timeline.h) around read + forward + capture: a sync of its own stream, never of
//   the device (which would also wait for the NCCL sends blocked on a slow drafter).
// Drafter loop (drafter index j of D): irecvs for its next data.prefetch batches are always
//   posted; per optimizer step it trains its grad_accum batches (k = s*G + a*D + j), averages
//   gradients over the drafter group (in buckets, during the backward of the step's last batch:
//   grad_reduce.h), clips, steps AdamW, logs, writes states and exports. The
//   time spent waiting for a batch is the drafter's wait time (the targets are the bottleneck).
//   Its times come from timeline marks on its stream, read when the step closes (no sync per
//   batch): busy = forward + backward of each batch, then reduction + AdamW; wait = the gap
//   from the end of its previous work to the start of the batch.
// Colocated loop: target forward and drafter step of each batch in turn; both timed on the
//   drafter's timeline (the drafter does not wait: its batch is ready when the target is done).
// Profiling (log.profile_start > 0): each loop opens its rank's StepProfiler before the work of
//   a step and closes it after the window's last step (targets: at the first batch of a later
//   step, or when their batches are sent).
// Both sides know the exact batch count (plan.total_batches), so nobody waits for a batch that
//   will never come; a failure on any rank ends every rank through comm's fail_fast.
// Thread-safety: each function runs on main's thread of its rank (the gradient hooks of
// grad_reduce.h on the autograd engine's thread, while main's thread is blocked in backward()).
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"
#include "trainer/config.h"
#include "trainer/metrics/metrics.h"
#include "trainer/metrics/profile.h"
#include "trainer/metrics/timeline.h"
#include "trainer/model/drafter.h"
#include "trainer/optim/adamw.h"
#include "trainer/roles/batch_message.h"
#include "trainer/roles/plan.h"
#include "trainer/roles/startup.h"

namespace dflash::roles {

struct RoleContext {
  const Config& cfg;
  const RankContext& rank;
  const RunPlan& plan;
  comm::Communicator* comm = nullptr;          // null in a colocated run
  std::shared_ptr<comm::Group> drafter_group;  // null in a colocated run
  std::shared_ptr<comm::Group> eval_group;     // {drafter rank 0, eval rank} (eval_hooks.h); null when off
};

// Seconds since an arbitrary origin (steady clock).
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// The drafter side of training: model, optimizer, per-step reduction, metrics, checkpoints.
class DrafterTrainer {
 public:
  // drafter_index j in [0, D); world_rank names the rank file of its state. load_began: now_s()
  // when this rank began loading weights (< 0: now; the colocated loop loads the target first).
  DrafterTrainer(const RoleContext& ctx, int64_t drafter_index, int world_rank, double load_began = -1);
  ~DrafterTrainer();

  // Forward + backward of batch b.batch (gradients accumulate, scaled by 1/grad_accum).
  // ready: the timeline mark from which the drafter waited for this batch (-1: the end of its
  // previous work); its wait is the time from there to the start of this batch's work.
  // target_began (the colocated loop, with ready): the mark before its capture of this batch; the
  // target's busy time is then target_began -> ready, read when the step closes (b.stats.busy_s
  // is not used), so that the host need not wait for the capture before queueing the drafter.
  void train_batch(const BatchMessage& b, int64_t ready = -1, int64_t target_began = -1);
  // Closes optimizer step s (0-based): reduce over the drafter group, clip, AdamW, metrics,
  // state and export when due; drafter 0 sends the step's control message to the targets
  // (preempt.h). Returns true if the run stops after this step (preemption: state written).
  bool finish_step(int64_t s);
  // -1, or the last step (0-based) of a signalled run (preempt.h).
  int64_t stop_after() const;
  // Waits for drafter 0's control sends (call once, after the last step).
  void finish_controls();
  // The final export (exports/final) and, if not just written, the final state.
  void finish_run();
  // Evaluation during training (eval_hooks.h): the live drafter, and the latest real tau for
  // the metrics line.
  const model::Drafter& drafter() const;
  // The timeline of this drafter's stream (the colocated loop marks its target work on it).
  metrics::Timeline& timeline();
  void set_eval(int64_t step, double tau, double seconds, bool final_eval);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The profiled window of log.profile_start / log.profile_steps (trainer/metrics/profile.h) for
// this rank's loop: <run.dir>/profile/rank<N>.{trace.json,md}; announce_profile logs the line a
// closing call returns (nothing for "").
metrics::StepProfiler step_profiler(const RoleContext& ctx, const char* role);
void announce_profile(const std::string& line);

void run_target_role(const RoleContext& ctx);
void run_drafter_role(const RoleContext& ctx);
void run_colocated(const RoleContext& ctx);

}  // namespace dflash::roles
