// The target loop (roles.h) and the target-side pieces the colocated loop shares.
#include <algorithm>
#include <deque>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "comm/preempt.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "trainer/metrics/profile.h"
#include "trainer/model/target.h"
#include "trainer/roles/eval_hooks.h"
#include "trainer/roles/preempt.h"
#include "trainer/roles/roles.h"

namespace dflash::roles {
void run_target_role(const RoleContext& ctx) {
  const RunPlan& p = ctx.plan;
  const Schedule& sched = ctx.rank.schedule;
  const int64_t i = sched.target_index(ctx.rank.id.rank);
  const int64_t last_layer = *std::max_element(p.layer_ids.begin(), p.layer_ids.end());
  model::TargetLoadOptions lo;
  lo.num_layers = last_layer + 1;  // capture stops after the last captured layer
  lo.lm_head = false;
  lo = target_load_options(ctx, lo);  // the eval rank: the full model, shared with the eval (eval_hooks.h)
  const double t_load = now_s();
  device::WarmUp warm(p.device);  // under the load (core/device.h)
  model::TargetModel target = model::TargetModel::load(ctx.cfg.target.model_dir, p.target_dtype, p.device, lo);
  warm.wait();
  const std::vector<int64_t> mine = sched.target_batches(i, p.start_batch, p.total_batches);
  log::info("target {}: loaded {} layers of {} in {:.1f} s; {} batches to produce", i, target.num_layers_loaded(),
            ctx.cfg.target.model_dir, now_s() - t_load, mine.size());

  const size_t depth = static_cast<size_t>(std::max<int64_t>(1, ctx.cfg.data.prefetch));
  struct InFlight {
    comm::HandlePtr handle;
    comm::Message msg;  // keeps the tensors alive until the send completes
  };
  std::unique_ptr<EvalWorker> evw;  // the eval rank (eval_hooks.h)
  if (ctx.eval_group && ctx.eval_group->contains(ctx.rank.id.rank)) evw = std::make_unique<EvalWorker>(ctx, target);
  std::deque<InFlight> inflight;
  metrics::Timeline tl(p.device);
  double wait_acc = 0;
  size_t sent = 0;
  // Preemption (preempt.h): drafter 0's control messages tell where a signalled run stops.
  ControlReader control(*ctx.comm, sched.drafter_rank(0), p, stop_lag(ctx.cfg, p));
  metrics::StepProfiler profiler = step_profiler(ctx, "target");
  for (const int64_t k : mine) {
    control.before_step(k / p.batches_per_step);
    if (control.stop_after() >= 0 && k >= (control.stop_after() + 1) * p.batches_per_step) break;
    announce_profile(profiler.begin(k / p.batches_per_step + 1));  // closed by a later step's batch or below
    if (evw) evw->before_batch(k);
    const int64_t t0 = tl.mark();
    data::Batch b = p.data->batch(k);
    BatchMessage bm;
    bm.batch = k;
    {
      c10::InferenceMode guard;
      bm.ids = b.ids.to(p.device);
      bm.cu_seqlens = b.cu_seqlens.to(p.device);
      bm.features = target.capture(bm.ids, bm.cu_seqlens, p.layer_ids);
      bm.loss_mask = b.loss_mask.to(p.device);
    }
    // Waits for this stream's work only: a device sync would also wait for the NCCL stream, where
    // earlier sends sit blocked on a slow drafter, and count that back-pressure as busy time.
    const int64_t t1 = tl.mark();
    const double busy = tl.seconds(t0, t1);
    tl.drop_before(t1);
    while (inflight.size() >= depth) {
      const double tw = now_s();
      const double ev = evw ? evw->use_slack(*inflight.front().handle) : 0.0;  // eval steps while the drafters are behind
      inflight.front().handle->wait();
      inflight.pop_front();
      wait_acc += now_s() - tw - ev;
    }
    // Complete sends that are already done (frees memory early; no waiting).
    while (!inflight.empty() && inflight.front().handle->test()) inflight.pop_front();
    const double stop = comm::preemption_requested() ? 1.0 : 0.0;  // this target was signalled (preempt.h)
    bm.stats = TargetStats{static_cast<double>(b.num_tokens()), busy, wait_acc, stop};
    wait_acc = 0;
    comm::Message msg = pack(bm, p.device);
    inflight.push_back({ctx.comm->isend(sched.drafter_of(k), msg), msg});
    // Start-up is over once the drafter has taken more than the first `depth` batches.
    if (++sent == depth + 1) ctx.comm->set_timeout(ctx.cfg.comm.timeout_s);
  }
  while (!inflight.empty()) {
    if (evw) evw->use_slack(*inflight.front().handle);
    inflight.front().handle->wait();
    inflight.pop_front();
  }
  announce_profile(profiler.finish());
  control.drain();
  if (control.stop_after() >= 0 && control.stop_after() + 1 < p.total_steps) {
    // no evw->finish(): the drafters skipped the evaluations from the stop step on (preempt.h)
    comm::mark_preempted(control.stop_after() + 1);
    log::info("target {}: stopped after step {} (preemption)", i, control.stop_after() + 1);
    return;
  }
  if (evw) evw->finish();
  log::info("target {}: all batches sent", i);
}

}  // namespace dflash::roles
