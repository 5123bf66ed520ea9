// trainer/roles/eval_hooks.h: the evaluation during training, per role.
#include "trainer/roles/eval_hooks.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "core/log.h"

namespace dflash::roles {
namespace {

// The exchange of one eval step: {weights [N] (drafter dtype), result [3] float64:
// step, tau, seconds} on the communicator's device.
std::vector<at::Tensor> exchange(const RoleContext& ctx, const at::Tensor& weights, const eval::LiveResult& r,
                                 int64_t batch) {
  const at::Device dev = ctx.comm->device();
  std::vector<at::Tensor> v;
  if (weights.defined()) v.push_back(weights.to(dev).contiguous());
  v.push_back(at::tensor({double(r.step), r.tau, r.wall_s}, at::kDouble).to(dev));
  ctx.comm->all_reduce(*ctx.eval_group, v, comm::ReduceOp::Sum, batch);
  return v;
}

std::optional<eval::LiveResult> result_of(const at::Tensor& t) {
  at::Tensor h = t.to(at::kCPU).contiguous();
  const double* p = h.data_ptr<double>();
  if (p[0] <= 0) return std::nullopt;
  return eval::LiveResult{int64_t(p[0]), p[1], p[2]};
}

}  // namespace

int eval_rank(const Config& cfg, const Schedule& s, int world_size) {
  if (cfg.eval.every <= 0) return -1;
  eval::LiveEval::eval_steps(cfg, 0, 1);  // the key checks, on every rank
  if (cfg.layout.colocated) return 0;
  if (cfg.eval.rank < 0) return s.target_rank(0);
  if (cfg.eval.rank >= world_size || !s.is_target(int(cfg.eval.rank)))
    throw_user("eval.rank {} must be a target rank (0 .. {}) or -1 (target rank 0)", cfg.eval.rank,
               cfg.layout.target_ranks - 1);
  return int(cfg.eval.rank);
}

EvalLeader::EvalLeader(const RoleContext& ctx)
    : ctx_(ctx), steps_(eval::LiveEval::eval_steps(ctx.cfg, ctx.plan.start_step, ctx.plan.total_steps)) {}

std::optional<eval::LiveResult> EvalLeader::after_step(int64_t done, const model::Drafter& drafter) {
  if (next_ >= steps_.size() || steps_[next_] != done) return std::nullopt;
  ++next_;
  // A normal tensor (not an inference tensor): the all-reduce writes into it in place.
  at::Tensor w = eval::LiveEval::flatten(drafter);
  return result_of(exchange(ctx_, w, {}, done * ctx_.plan.batches_per_step).back());
}

std::optional<eval::LiveResult> EvalLeader::finish() {
  if (steps_.empty()) return std::nullopt;
  return result_of(exchange(ctx_, at::Tensor(), {}, ctx_.plan.total_batches).back());
}

EvalWorker::EvalWorker(const RoleContext& ctx)
    : ctx_(ctx), steps_(eval::LiveEval::eval_steps(ctx.cfg, ctx.plan.start_step, ctx.plan.total_steps)) {
  if (!steps_.empty()) live_ = std::make_unique<eval::LiveEval>(ctx.cfg, ctx.plan.spec, ctx.plan.device, ctx.plan.target_dtype);
}

EvalWorker::~EvalWorker() = default;

void EvalWorker::meet(int64_t step) {
  at::Tensor zeros = at::zeros({eval::LiveEval::flat_size(ctx_.plan.spec)},
                               at::TensorOptions().dtype(ctx_.plan.drafter_dtype).device(ctx_.comm->device()));
  auto v = exchange(ctx_, zeros, last_, step * ctx_.plan.batches_per_step);
  last_ = live_->run(v.front(), step);
}

void EvalWorker::before_batch(int64_t k) {
  const int64_t s = ctx_.rank.schedule.step_of(k, ctx_.plan.grad_accum);  // k belongs to step s (0-based)
  while (next_ < steps_.size() && steps_[next_] <= s) meet(steps_[next_++]);
}

void EvalWorker::finish() {
  while (next_ < steps_.size()) meet(steps_[next_++]);
  if (!steps_.empty()) exchange(ctx_, at::Tensor(), last_, ctx_.plan.total_batches);
}

ColocatedEval::ColocatedEval(const RoleContext& ctx)
    : steps_(eval::LiveEval::eval_steps(ctx.cfg, ctx.plan.start_step, ctx.plan.total_steps)) {
  if (!steps_.empty()) live_ = std::make_unique<eval::LiveEval>(ctx.cfg, ctx.plan.spec, ctx.plan.device, ctx.plan.target_dtype);
}

ColocatedEval::~ColocatedEval() = default;

std::optional<eval::LiveResult> ColocatedEval::after_step(int64_t done, const model::Drafter& drafter) {
  if (next_ >= steps_.size() || steps_[next_] != done) return std::nullopt;
  ++next_;
  // A normal tensor (not an inference tensor): the all-reduce writes into it in place.
  at::Tensor w = eval::LiveEval::flatten(drafter);
  return live_->run(w, done);
}

}  // namespace dflash::roles
