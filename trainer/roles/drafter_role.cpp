// The drafter side (roles.h): DrafterTrainer, the drafter loop and the colocated loop.
#include <algorithm>
#include <cmath>
#include <deque>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/preempt.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/identity.h"
#include "core/files.h"
#include "trainer/model/export.h"
#include "trainer/metrics/profile.h"
#include "trainer/model/target.h"
#include "trainer/roles/eval_hooks.h"
#include "trainer/roles/grad_reduce.h"
#include "trainer/roles/preempt.h"
#include "trainer/roles/roles.h"
#include "trainer/roles/run_info.h"


namespace dflash::roles {
namespace {

// Per-step sums, all-reduced (Sum) over the drafter group.
enum Stat {
  kLossSum,      // Σ per-batch loss
  kCorrect,      // Σ argmax == label (w > 0)
  kCount,        // Σ positions with w > 0
  kTauSum,       // Σ 1 + accepted over the measured blocks (loss.h)
  kTauInvSum,    // Σ 1 / (1 + accepted)
  kTauBlocks,
  kTokens,       // tokens of the batches trained
  kTargetBusy,   // Σ target busy seconds of those batches
  kTargetWait,   // Σ target wait seconds reported with them
  kDrafterWait,  // Σ seconds drafters waited for them (timeline: end of previous work -> start)
  kCompute,      // Σ drafter forward+backward seconds (timeline)
  kBatches,
  kFlops,
  kStop,         // Σ stop flags (signalled ranks, preempt.h)
  kNumStats      // then per block offset k = 1..bs-1: correct, count (2 x (bs-1) entries)
};
using Stats = std::vector<double>;

// Peak bf16 dense matmul FLOP/s of one GPU for MFU (H200/H100 SXM: 989.4 TFLOP/s).
constexpr double kPeakFlops = 989.4e12;

std::vector<int64_t> to_vector(const at::Tensor& t) {
  at::Tensor c = t.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// The packed stream of a batch as drafter rows: documents in order, a new row whenever the next
// document would push the row past max_seq_len tokens; rows are right-padded (id 0, mask 0,
// features 0) to the longest. Each block then attends only to its own row's keys, so the cost of
// the drafter's attention grows with the row length, not with the whole batch (DFLASH.md trains
// on rows of one sequence each). The split is a pure function of the batch, so it is the same
// in every layout. A single-row batch is passed through without copies.
model::DrafterBatch make_rows(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& cu_seqlens,
                              const at::Tensor& features, int64_t max_seq_len) {
  const std::vector<int64_t> cu = to_vector(cu_seqlens);
  const int64_t n_docs = static_cast<int64_t>(cu.size()) - 1;
  std::vector<std::pair<int64_t, int64_t>> rows;  // [first doc, end doc)
  int64_t first = 0;
  for (int64_t d = 0; d < n_docs; ++d) {
    if (d > first && cu[d + 1] - cu[first] > max_seq_len) {
      rows.emplace_back(first, d);
      first = d;
    }
  }
  rows.emplace_back(first, n_docs);
  model::DrafterBatch db;
  if (rows.size() == 1) {
    db.ids = ids.reshape({1, -1});
    db.loss_mask = loss_mask.reshape({1, -1});
    db.features = features.unsqueeze(0);
    db.docs = {cu};
    return db;
  }
  int64_t S = 0;
  for (auto [a, b] : rows) S = std::max(S, cu[b] - cu[a]);
  const int64_t B = static_cast<int64_t>(rows.size());
  db.ids = at::zeros({B, S}, ids.options());
  db.loss_mask = at::zeros({B, S}, loss_mask.options());
  db.features = at::zeros({B, S, features.size(1)}, features.options());
  for (int64_t r = 0; r < B; ++r) {
    const auto [a, b] = rows[static_cast<size_t>(r)];
    const int64_t begin = cu[a], len = cu[b] - cu[a];
    db.ids[r].narrow(0, 0, len).copy_(ids.narrow(0, begin, len));
    db.loss_mask[r].narrow(0, 0, len).copy_(loss_mask.narrow(0, begin, len));
    db.features[r].narrow(0, 0, len).copy_(features.narrow(0, begin, len));
    model::DocBounds bounds;
    for (int64_t d = a; d <= b; ++d) bounds.push_back(cu[d] - begin);
    db.docs.push_back(std::move(bounds));
  }
  return db;
}

}  // namespace

struct DrafterTrainer::Impl {
  const RoleContext& ctx;
  const RunPlan& p;
  const Config& cfg;
  int64_t j;
  int world_rank;
  model::TargetEmbeddings emb;
  std::unique_ptr<model::Drafter> drafter;
  std::unique_ptr<optim::AdamW> opt;
  std::unique_ptr<GradReducer> reducer;  // comm.grad_bucket_mb > 0 and D > 1 (grad_reduce.h)
  optim::LrSchedule sched;
  model::StepOptions sopt;
  std::unique_ptr<metrics::MetricsLog> mlog;

  Stats step;
  Stats interval;
  double interval_loss = 0;  // Σ over steps of the step's mean loss
  int64_t interval_steps = 0;
  double interval_start = 0, run_start = 0;
  int64_t last_state = -1;
  double last_lr = 0, last_gnorm = 0;
  int64_t lag = 1, stop_after = -1;  // preempt.h
  struct ControlSend {
    comm::HandlePtr handle;
    comm::Message msg;  // keeps the tensor alive until the send completes
  };
  std::deque<ControlSend> controls;
  double eval_tau = -1, eval_s = 0;  // latest evaluation during training (eval_hooks.h)
  int64_t eval_step = 0;
  // Times (metrics/timeline.h): this step's batches as marks, resolved when the step closes.
  metrics::Timeline tl;
  struct BatchMarks {
    int64_t ready, start, stop;
    int64_t target_began;  // colocated: the target's capture of this batch, target_began -> ready; else -1
  };
  std::vector<BatchMarks> marks;
  int64_t idle_since = -1;    // mark: end of this drafter's previous work
  double interval_opt_s = 0;  // this rank's reduction + AdamW seconds in the interval
  double run_tokens = 0, run_target_busy = 0, run_drafter_busy = 0;  // after the first step: split.json
  // Time to first step (seconds; metrics.h).
  double startup_s = -1, load_s = -1, first_step_s = -1, first_wait_s = -1;

  Impl(const RoleContext& c, int64_t jj, int wr)
      : ctx(c), p(c.plan), cfg(c.cfg), j(jj), world_rank(wr),
        step(kNumStats + 2 * (c.plan.spec.block_size - 1), 0.0), interval(step.size(), 0.0), tl(c.plan.device) {}
  bool leader() const { return j == 0; }
  // The time-to-first-step fields (metrics.h), < 0 where not known yet.
  metrics::StepMetrics first_step() const {
    metrics::StepMetrics f;
    f.startup_s = startup_s < 0 ? -1 : startup_s;  // process_age_s < 0: unknown
    f.load_s = load_s;
    f.first_step_s = first_step_s;
    f.first_wait_s = first_wait_s;
    return f;
  }
};

namespace {

// The recommended split (metrics/split.h) from tokens and the busy seconds summed over the
// batches' target ranks and over the drafter ranks: per-rank rates tokens / busy seconds.
// N: the run's GPUs (a colocated run: what 2 GPUs would do).
// A drafter rank's one-time set-up (core/device.h) with the drafter's own first ops, started
// before its load so that it runs under it.
device::WarmUp drafter_warm_up(const RunPlan& p) {
  return device::WarmUp(p.device, [&p] { model::Drafter::warm_up_kernels(p.device, p.drafter_dtype); });
}

metrics::SplitAdvice split_of(const RunPlan& p, double tokens, double target_busy, double drafter_busy) {
  const int64_t gpus = p.colocated ? 2 : p.target_ranks + p.drafter_ranks;
  return metrics::recommend_split(gpus, target_busy > 0 ? tokens / target_busy : 0.0,
                                  drafter_busy > 0 ? tokens / drafter_busy : 0.0);
}

}  // namespace

DrafterTrainer::DrafterTrainer(const RoleContext& ctx, int64_t drafter_index, int world_rank, double load_began)
    : impl_(std::make_unique<Impl>(ctx, drafter_index, world_rank)) {
  Impl& m = *impl_;
  const RunPlan& p = m.p;
  const double t0 = now_s();
  const double load_t0 = load_began >= 0 ? load_began : t0;
  m.emb = model::load_target_embeddings(m.cfg.target.model_dir, p.drafter_dtype, p.device);
  m.drafter = std::make_unique<model::Drafter>(p.spec, p.device, p.drafter_dtype);
  if (!m.cfg.drafter.init_from.empty()) {
    model::load_drafter_weights(*m.drafter, m.cfg.drafter.init_from);
  } else {
    m.drafter->init_random(static_cast<uint64_t>(m.cfg.run.seed));
  }
  m.drafter->set_target_weights(m.emb.embed_tokens, m.emb.lm_head);
  optim::AdamWOptions oo{m.cfg.train.beta1, m.cfg.train.beta2, m.cfg.train.eps, m.cfg.train.weight_decay};
  m.opt = std::make_unique<optim::AdamW>(m.drafter->named_parameters(), oo);
  m.sched = optim::LrSchedule::cosine(m.cfg.train.lr, m.cfg.train.warmup_ratio, p.total_steps);
  if (p.resume) {
    ckpt::load_rank_state(p.resume_dir, world_rank, m.opt.get(), p.resume->step);
    log::info("drafter {}: resumed from {} (step {}, batch {})", m.j, p.resume_dir, p.resume->step,
              p.resume->next_batch);
  }
  m.sopt.attention = p.attention.backend;  // drafter.attention, resolved in the plan (attention_choice.h)
  attention::set_fused_backward(p.attention.fused_backward);  // drafter.attention_backward, likewise
  m.sopt.num_anchors = m.cfg.drafter.num_anchors;
  m.sopt.seed = static_cast<uint64_t>(m.cfg.run.seed);
  m.sopt.gamma = p.gamma;
  m.sopt.loss_chunk = m.cfg.drafter.loss_chunk;
  m.sopt.defer_metrics = true;  // read after the backward is queued (train_batch)
  const bool console_elsewhere = m.cfg.log.console_rank >= 0 && m.cfg.log.console_rank != world_rank;
  m.mlog = std::make_unique<metrics::MetricsLog>(m.cfg.run.dir, m.leader(), console_elsewhere);
  if (m.ctx.comm && p.drafter_ranks > 1) {
    const double mb = m.cfg.comm.grad_bucket_mb;
    if (mb > 0) {
      m.reducer = std::make_unique<GradReducer>(m.drafter->named_parameters(), *m.ctx.comm, *m.ctx.drafter_group,
                                                bucket_cap_bytes(mb));
      const size_t nb = m.reducer->num_buckets();
      m.mlog->announce(fmt::format("drafter 0: gradients all-reduced in {} bucket{} of <= {:g} MiB during the backward "
                                   "(comm.grad_bucket_mb)", nb, nb == 1 ? "" : "s", mb));
    } else {
      m.mlog->announce("drafter 0: gradients all-reduced in one call after the backward (comm.grad_bucket_mb=0)");
    }
  }
  int64_t n_params = 0;
  for (const auto& [n, t] : m.drafter->named_parameters()) n_params += t.numel();
  log::info("drafter {}: {} parameters ({} layers, block {}, target layers [{}]) ready in {:.1f} s; steps {}..{} of {}",
            m.j, n_params, p.spec.num_layers, p.spec.block_size, fmt::join(p.layer_ids, ", "), now_s() - t0,
            p.start_step, p.total_steps, p.total_steps);
  device::sync(p.device);  // loaded means on the device (once, not per step)
  m.lag = stop_lag(m.cfg, p);
  m.run_start = m.interval_start = now_s();
  m.load_s = m.run_start - load_t0;
  m.startup_s = metrics::process_age_s() - m.load_s;  // process start -> loading began
  m.idle_since = m.tl.mark();
}

DrafterTrainer::~DrafterTrainer() = default;

void DrafterTrainer::train_batch(const BatchMessage& b, int64_t ready, int64_t target_began) {
  Impl& m = *impl_;
  const int64_t start = m.tl.mark();
  const int64_t k = b.batch;
  const at::Tensor& ids = b.ids;
  const TargetStats& ts = b.stats;
  model::DrafterBatch db = make_rows(ids, b.loss_mask, b.cu_seqlens, b.features, m.cfg.data.max_seq_len);
  db.global_batch_index = k;
  model::StepOutput out = m.drafter->forward(db, m.sopt);
  const Schedule& walk = m.ctx.rank.schedule;
  if (m.reducer && walk.closes_step(k, m.p.grad_accum))  // its hooks post the buckets during this backward
    m.reducer->arm(walk.step_of(k, m.p.grad_accum) * m.p.batches_per_step);
  (out.loss / static_cast<double>(m.p.grad_accum)).backward();
  // The loss and metrics come back once the backward is queued (the device stays busy meanwhile);
  // a non-finite loss still stops the run before the optimizer touches the weights.
  out.finish();
  if (!std::isfinite(out.loss_value)) {
    const int64_t s = k / m.p.batches_per_step;
    throw_user("drafter {}: the loss is {} at step {} (batch {}); likely causes: train.lr {:g} too high (this "
               "step's rate {:g}), bad data in batch {}, or NaN weights in the target or drafter.init_from; the "
               "run stops: resume from the last state with a lower train.lr",
               m.j, out.loss_value, s + 1, k, m.cfg.train.lr, m.sched.at(s), k);
  }
  Stats& s = m.step;
  s[kLossSum] += out.loss_value;
  const size_t npos = (s.size() - kNumStats) / 2;
  for (size_t i = 0; i < out.correct_per_pos.size(); ++i) {
    s[kCorrect] += out.correct_per_pos[i];
    s[kCount] += out.count_per_pos[i];
    if (i >= 1 && i <= npos) {  // entry k of the output is block offset k (offset 0 has no label)
      s[kNumStats + 2 * (i - 1)] += out.correct_per_pos[i];
      s[kNumStats + 2 * (i - 1) + 1] += out.count_per_pos[i];
    }
  }
  s[kTauSum] += out.tau_sum;
  s[kTauInvSum] += out.tau_inv_sum;
  s[kTauBlocks] += static_cast<double>(out.tau_blocks);
  s[kTokens] += static_cast<double>(ids.numel());
  if (target_began < 0) s[kTargetBusy] += ts.busy_s;  // else read from the marks when the step closes
  s[kTargetWait] += ts.wait_s;
  s[kBatches] += 1;
  s[kStop] += ts.stop;
  // Useful FLOPs: per row, with the draft positions shared out in proportion to row lengths.
  const double q_per_token = static_cast<double>(out.n_blocks * m.p.spec.block_size) / std::max<int64_t>(1, ids.numel());
  for (const auto& bounds : db.docs) {
    const int64_t len = bounds.back();
    s[kFlops] += drafter_step_flops(m.p.spec, len, static_cast<int64_t>(q_per_token * static_cast<double>(len)));
  }
  // No sync: the marks are read when the step closes (finish_step), when this work is done.
  const int64_t stop = m.tl.mark();
  m.marks.push_back({ready >= 0 ? ready : m.idle_since, start, stop, target_began});
  m.idle_since = stop;
}

bool DrafterTrainer::finish_step(int64_t s) {
  Impl& m = *impl_;
  const RunPlan& p = m.p;
  // The step's batch times from the timeline (reading waits only for work the gradient
  // reduction and AdamW below wait for anyway).
  for (const auto& bm : m.marks) {
    m.step[kCompute] += m.tl.seconds(bm.start, bm.stop);
    m.step[kDrafterWait] += m.tl.seconds(bm.ready, bm.start);
    if (bm.target_began >= 0) m.step[kTargetBusy] += m.tl.seconds(bm.target_began, bm.ready);
  }
  const bool first = s == p.start_step;
  if (first && !m.marks.empty()) m.first_wait_s = m.tl.seconds(m.marks.front().ready, m.marks.front().start);
  const int64_t opt_begin = m.marks.empty() ? m.tl.mark() : m.marks.back().stop;
  m.marks.clear();
  if (comm::preemption_requested()) m.step[kStop] += 1;
  // Gradients: average over the drafter group (each rank's are already the mean over its
  // grad_accum batches, so the result is the mean over the step's G batches). Bucketed: most
  // buckets were posted by the backward's hooks; the rest now, then every one is waited for
  // (grad_reduce.h). comm.grad_bucket_mb = 0: one all-reduce of every gradient here.
  if (m.ctx.comm && p.drafter_ranks > 1) {
    if (m.reducer) {
      m.reducer->finish();  // armed by train_batch for the batch that closed this step
    } else {
      std::vector<at::Tensor> grads;
      for (const auto& [n, t] : m.drafter->named_parameters()) {
        if (!t.grad().defined()) t.mutable_grad() = at::zeros_like(t);
        grads.push_back(t.grad());
      }
      m.ctx.comm->all_reduce(*m.ctx.drafter_group, grads, comm::ReduceOp::Average, s * p.batches_per_step);
    }
    const int64_t n_stats = static_cast<int64_t>(m.step.size());
    at::Tensor st = at::from_blob(m.step.data(), {n_stats}, at::kDouble).clone().to(m.ctx.comm->device());
    std::vector<at::Tensor> v = {st};
    m.ctx.comm->all_reduce(*m.ctx.drafter_group, v, comm::ReduceOp::Sum, s * p.batches_per_step);
    at::Tensor back = v[0].to(at::kCPU).contiguous();
    std::copy(back.data_ptr<double>(), back.data_ptr<double>() + n_stats, m.step.begin());
  }
  m.last_lr = m.sched.at(s);
  m.last_gnorm = m.opt->step(m.last_lr, m.cfg.train.grad_clip);
  if (!std::isfinite(m.last_gnorm))
    throw_user("drafter {}: the gradient norm is {} at step {} (batches {}..{}); likely causes: train.lr {:g} too "
               "high (this step's rate {:g}) or bad data; the run stops: resume from the last state with a lower "
               "train.lr",
               m.j, m.last_gnorm, s + 1, s * p.batches_per_step, (s + 1) * p.batches_per_step - 1, m.cfg.train.lr,
               m.last_lr);
  m.opt->zero_grad();
  const double opt_s = m.tl.seconds(opt_begin, m.tl.mark());  // gradient reduction + stats + AdamW
  m.interval_opt_s += opt_s;
  if (first) {  // gnorm came back to the host: the step is done
    m.first_step_s = now_s() - m.run_start;
    m.mlog->announce(metrics::format_first_step(m.first_step()));
  }
  if (!first || p.total_steps - p.start_step == 1) {  // the run's rates without the first (warm-up) step
    m.run_tokens += m.step[kTokens];
    m.run_target_busy += m.step[kTargetBusy];
    m.run_drafter_busy += m.step[kCompute] + static_cast<double>(p.drafter_ranks) * opt_s;
  }
  const int64_t done = s + 1;
  if (s == p.start_step && m.ctx.comm) m.ctx.comm->set_timeout(m.cfg.comm.timeout_s);

  // Preemption (preempt.h): every drafter saw the same sum of stop flags.
  const bool last = done == p.total_steps;
  if (m.step[kStop] > 0 && m.stop_after < 0) {
    m.stop_after = std::min(p.total_steps - 1, s + m.lag - 1);
    if (m.leader())
      log::warn("preemption: a rank was signalled; stopping after step {} (the batches in flight are trained), "
                "then writing a state and exiting with code {}",
                m.stop_after + 1, comm::kExitPreempted);
  }
  if (m.leader() && m.ctx.comm && !p.colocated) {
    while (!m.controls.empty() && m.controls.front().handle->test()) m.controls.pop_front();
    comm::Message cm;  // header only (preempt.h)
    cm.kind = m.stop_after >= 0 ? kControlStop : kControlContinue;
    cm.batch = s;
    for (int64_t i = 0; i < p.target_ranks; ++i) {
      const int t = m.ctx.rank.schedule.target_rank(i);
      m.controls.push_back({m.ctx.comm->isend(t, cm), cm});
    }
  }
  const bool stopping = m.stop_after == s && !last;

  for (size_t i = 0; i < m.step.size(); ++i) m.interval[i] += m.step[i];
  m.interval_loss += m.step[kLossSum] / std::max(1.0, m.step[kBatches]);
  ++m.interval_steps;
  std::fill(m.step.begin(), m.step.end(), 0.0);

  if (m.cfg.log.interval > 0 && (done % m.cfg.log.interval == 0 || last || stopping)) {
    const double t = now_s(), wall = std::max(1e-9, t - m.interval_start);
    const Stats& a = m.interval;
    metrics::StepMetrics mm;
    mm.step = done;
    mm.total_steps = p.total_steps;
    mm.batch = done * p.batches_per_step;
    mm.epoch = p.data->locate(std::max<int64_t>(0, mm.batch - 1)).first;
    mm.loss = m.interval_loss / static_cast<double>(m.interval_steps);
    mm.accuracy = a[kCount] > 0 ? a[kCorrect] / a[kCount] : 0.0;
    mm.tau = a[kTauInvSum] > 0 ? a[kTauBlocks] / a[kTauInvSum] : 1.0;
    mm.tau_block_mean = a[kTauBlocks] > 0 ? a[kTauSum] / a[kTauBlocks] : 1.0;
    mm.eval_tau = m.eval_tau, mm.eval_step = m.eval_step, mm.eval_s = m.eval_s;
    mm.lr = m.last_lr;
    mm.grad_norm = m.last_gnorm;
    mm.target_tok_s = a[kTargetBusy] > 0 ? static_cast<double>(p.target_ranks) * a[kTokens] / a[kTargetBusy] : 0.0;
    mm.drafter_tok_s = a[kTokens] / wall;
    mm.target_wait_s = a[kBatches] > 0 ? a[kTargetWait] / a[kBatches] : 0.0;
    mm.drafter_wait_s = a[kDrafterWait] / (static_cast<double>(m.interval_steps) * static_cast<double>(p.drafter_ranks));
    const double D = static_cast<double>(p.drafter_ranks), steps = static_cast<double>(m.interval_steps);
    mm.target_busy_s = a[kBatches] > 0 ? a[kTargetBusy] / a[kBatches] : 0.0;
    mm.drafter_busy_s = (a[kCompute] / D + m.interval_opt_s) / steps;
    mm.interval_s = wall;
    mm.split = split_of(p, a[kTokens], a[kTargetBusy], a[kCompute] + D * m.interval_opt_s);
    const metrics::StepMetrics fs = m.first_step();
    mm.startup_s = fs.startup_s, mm.load_s = fs.load_s, mm.first_step_s = fs.first_step_s, mm.first_wait_s = fs.first_wait_s;
    mm.mfu = p.device.is_cuda() ? a[kFlops] / (wall * static_cast<double>(p.drafter_ranks) * kPeakFlops) : -1.0;
    mm.mem_gb = device::peak_memory_gib(p.device);
    mm.elapsed_s = t - m.run_start;
    mm.percent = 100.0 * static_cast<double>(done) / static_cast<double>(std::max<int64_t>(1, p.total_steps));
    mm.eta_s = mm.elapsed_s / static_cast<double>(done - p.start_step) * static_cast<double>(p.total_steps - done);
    mm.total_epochs = p.data->locate(std::max<int64_t>(0, p.total_batches - 1)).first + 1;
    for (size_t i = kNumStats; i + 1 < a.size(); i += 2) mm.accuracy_per_pos.push_back(a[i + 1] > 0 ? a[i] / a[i + 1] : 0.0);
    m.mlog->write(mm);
    std::fill(m.interval.begin(), m.interval.end(), 0.0);
    m.interval_opt_s = 0;
    m.interval_loss = 0;
    m.interval_steps = 0;
    m.interval_start = t;
  }

  const auto& ck = m.cfg.checkpoint;
  if ((ck.state_every > 0 && (done % ck.state_every == 0 || last)) || stopping) {
    const std::string tmp = ckpt::state_tmp_dir(m.cfg.run.dir, done);
    ckpt::write_rank_state(tmp, m.world_rank, done, m.leader() ? m.opt.get() : nullptr);
    if (m.ctx.comm && p.drafter_ranks > 1) m.ctx.comm->barrier(m.ctx.drafter_group.get());
    if (m.leader()) {
      ckpt::StateMeta meta;
      meta.step = done;
      meta.next_batch = done * p.batches_per_step;
      meta.total_steps = p.total_steps;
      meta.sig = p.signature;
      meta.config_hash = identity_hash(m.cfg);
      for (int64_t jj = 0; jj < p.drafter_ranks; ++jj)
        meta.files.push_back(ckpt::rank_file(m.ctx.rank.schedule.drafter_rank(jj)));
      meta.files.push_back(ckpt::kOptimizerFile);
      meta.files.push_back(ckpt::kConfigFile);
      ckpt::commit_state(m.cfg.run.dir, meta, to_yaml(m.cfg), ck.keep_last);
      m.mlog->announce(fmt::format("step {}: training state written to {}", done, ckpt::state_dir(m.cfg.run.dir, done)));
    }
    m.last_state = done;
  }
  if (m.leader() && ck.export_every > 0 && done % ck.export_every == 0 && !last) {
    files::make_dirs(m.cfg.run.dir + "/exports");
    model::export_drafter(*m.drafter, ckpt::export_dir(m.cfg.run.dir, done), export_record(m.cfg, p));
    m.mlog->announce(fmt::format("step {}: drafter exported to {}", done, ckpt::export_dir(m.cfg.run.dir, done)));
  }
  m.idle_since = m.tl.mark();  // from here the drafter waits for its next batch
  m.tl.drop_before(m.idle_since);
  return stopping;
}

int64_t DrafterTrainer::stop_after() const { return impl_->stop_after; }

void DrafterTrainer::finish_controls() {
  Impl& m = *impl_;
  while (!m.controls.empty()) {
    m.controls.front().handle->wait();
    m.controls.pop_front();
  }
}

void DrafterTrainer::finish_run() {
  Impl& m = *impl_;
  if (!m.leader()) return;
  files::make_dirs(m.cfg.run.dir + "/exports");
  const std::string dir = ckpt::final_export_dir(m.cfg.run.dir);
  model::export_drafter(*m.drafter, dir, export_record(m.cfg, m.p));
  m.mlog->announce(fmt::format("training done: {} steps in {}; drafter exported to {}", m.p.total_steps,
                               metrics::format_duration(now_s() - m.run_start), dir));
  for (const auto& line : finish_lines(m.cfg, m.p, dir)) m.mlog->announce(line);
  const metrics::SplitAdvice a = split_of(m.p, m.run_tokens, m.run_target_busy, m.run_drafter_busy);
  const std::string path = files::join(m.cfg.run.dir, "split.json");
  files::write_file_atomic(path, metrics::split_json(a) + "\n");
  m.mlog->announce(fmt::format("split: {} (from steps {}..{}; {})", metrics::format_split(a),
                               m.p.total_steps - m.p.start_step == 1 ? m.p.start_step + 1 : m.p.start_step + 2, m.p.total_steps, path));
}

const model::Drafter& DrafterTrainer::drafter() const { return *impl_->drafter; }

metrics::Timeline& DrafterTrainer::timeline() { return impl_->tl; }

void DrafterTrainer::set_eval(int64_t step, double tau, double seconds, bool final_eval) {
  Impl& m = *impl_;
  m.eval_tau = tau, m.eval_step = step, m.eval_s = seconds;
  if (final_eval)
    m.mlog->announce(fmt::format("eval of the final drafter (step {}): tau {:.3f} on the held-out prompts ({:.1f} s; "
                                 "training estimate above: tau_est)", step, tau, seconds));
}

void run_drafter_role(const RoleContext& ctx) {
  const RunPlan& p = ctx.plan;
  const Schedule& sched = ctx.rank.schedule;
  const int rank = ctx.rank.id.rank;
  const int64_t j = sched.drafter_index(rank);
  device::WarmUp warm = drafter_warm_up(p);  // under the load of the embeddings and the drafter
  DrafterTrainer trainer(ctx, j, rank);
  warm.wait();
  std::unique_ptr<EvalLeader> evl;
  if (ctx.eval_group && j == 0) evl = std::make_unique<EvalLeader>(ctx);
  const std::vector<int64_t> mine = sched.drafter_batches(j, p.start_batch, p.total_batches);
  const size_t depth = static_cast<size_t>(std::max<int64_t>(1, ctx.cfg.data.prefetch));
  struct Pending {
    int64_t k;
    comm::HandlePtr handle;
  };
  std::deque<Pending> pending;
  size_t next = 0;
  auto post = [&] {
    // never past the last step of a signalled run: those batches are not produced (preempt.h)
    const int64_t end = trainer.stop_after() < 0 ? p.total_batches : (trainer.stop_after() + 1) * p.batches_per_step;
    while (pending.size() < depth && next < mine.size() && mine[next] < end) {
      const int64_t k = mine[next++];
      pending.push_back({k, ctx.comm->irecv(sched.target_of(k), k)});
    }
  };
  post();
  metrics::StepProfiler profiler = step_profiler(ctx, "drafter");
  for (const int64_t k : mine) {
    DFLASH_CHECK(!pending.empty() && pending.front().k == k, "drafter {}: batch {} was not posted", j, k);
    announce_profile(profiler.begin(sched.step_of(k, p.grad_accum) + 1));
    comm::Message msg = pending.front().handle->take();  // the wait is timed by the trainer's timeline
    pending.pop_front();
    post();
    trainer.train_batch(unpack(std::move(msg), k, comm::name_rank(sched.target_of(k))));
    if (sched.closes_step(k, p.grad_accum)) {
      const int64_t s = sched.step_of(k, p.grad_accum);
      // A preemption stop skips the evaluation of the stop step: the eval rank (a target) meets
      // only before producing a later step, which it no longer does (preempt.h).
      const bool stopping = trainer.finish_step(s);
      announce_profile(stopping ? profiler.finish() : profiler.end(s + 1));
      if (stopping) {
        DFLASH_CHECK(pending.empty(), "drafter {}: {} receives pending at the stop after step {}", j, pending.size(),
                     s + 1);
        trainer.finish_controls();
        comm::mark_preempted(s + 1);
        return;
      }
      if (evl)
        if (auto r = evl->after_step(s + 1, trainer.drafter())) trainer.set_eval(r->step, r->tau, r->wall_s, false);
    }
  }
  announce_profile(profiler.finish());
  trainer.finish_controls();
  trainer.finish_run();
  if (evl)
    if (auto r = evl->finish()) trainer.set_eval(r->step, r->tau, r->wall_s, true);
}

void run_colocated(const RoleContext& ctx) {
  const RunPlan& p = ctx.plan;
  const int64_t last_layer = *std::max_element(p.layer_ids.begin(), p.layer_ids.end());
  model::TargetLoadOptions lo;
  lo.num_layers = last_layer + 1;
  lo.lm_head = false;
  lo = target_load_options(ctx, lo);  // with eval: the full model, shared with the eval (eval_hooks.h)
  const double load_began = now_s();
  device::WarmUp warm = drafter_warm_up(p);  // under the load
  model::TargetModel target = model::TargetModel::load(ctx.cfg.target.model_dir, p.target_dtype, p.device, lo);
  warm.wait();
  ColocatedEval evc(ctx, target);  // before the trainer: its warm-up is not in the timed steps
  DrafterTrainer trainer(ctx, 0, ctx.rank.id.rank, load_began);
  metrics::Timeline& tl = trainer.timeline();
  const Schedule& sched = ctx.rank.schedule;
  const std::vector<int64_t> mine = sched.drafter_batches(0, p.start_batch, p.total_batches);
  metrics::StepProfiler profiler = step_profiler(ctx, "colocated");
  for (const int64_t k : mine) {
    announce_profile(profiler.begin(sched.step_of(k, p.grad_accum) + 1));
    const int64_t t0 = tl.mark();
    data::Batch b = p.data->batch(k);
    BatchMessage bm;
    bm.batch = k;
    {
      c10::InferenceMode guard;
      bm.features = target.capture(b.ids.to(p.device), b.cu_seqlens.to(p.device), p.layer_ids);
    }
    bm.features = bm.features.clone();  // a normal tensor: the drafter's autograd saves it
    // ids, mask and cu_seqlens stay on the host, where the drafter's step reads them (as unpack
    // delivers them in the T + D layout)
    bm.ids = b.ids;
    bm.cu_seqlens = b.cu_seqlens;
    bm.loss_mask = b.loss_mask;
    const int64_t t1 = tl.mark();
    // The target's busy time t0 -> t1 is read when the step closes: reading it here would wait
    // for the capture and leave the device idle while the host prepares the drafter's step
    // (blocks sampled on the host: ~30 ms at 1 x 40000, bench/RESULTS.md).
    bm.stats = TargetStats{static_cast<double>(b.num_tokens()), 0.0, 0.0};
    trainer.train_batch(bm, t1, t0);  // the drafter waited for nothing: its batch was ready at t1
    if (sched.closes_step(k, p.grad_accum)) {
      const int64_t s = sched.step_of(k, p.grad_accum);
      const bool stopping = trainer.finish_step(s);
      announce_profile(stopping ? profiler.finish() : profiler.end(s + 1));
      if (stopping) {
        comm::mark_preempted(s + 1);
        return;
      }
      if (auto r = evc.after_step(s + 1, trainer.drafter()))
        trainer.set_eval(r->step, r->tau, r->wall_s, s + 1 == p.total_steps);
    }
  }
  announce_profile(profiler.finish());
  trainer.finish_run();
}

}  // namespace dflash::roles
