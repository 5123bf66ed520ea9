// trainer/eval/speculative_fixed.h: speculative decoding with the rows' state on the device.
#include "trainer/eval/speculative_fixed.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "core/parse.h"
#include "trainer/eval/regenerate_graph.h"
#include "trainer/model/target_cache_static.h"

namespace dflash::eval {

bool FixedSpeculativeDecoder::graphs_enabled() {
  static const bool on = env_choice(kFixedGraphsEnv, "1", {"0", "1"}) == "1";
  return on;
}

bool FixedSpeculativeDecoder::supports(const model::TargetModel& target, const DecodeOptions& opt) {
  return opt.temperature == 0 && target.hybrid() == nullptr;
}

FixedSpeculativeDecoder::FixedSpeculativeDecoder(const model::TargetModel& target, DFlashProposer& proposer,
                                                 const std::vector<std::vector<int64_t>>& prompts,
                                                 const DecodeOptions& opt)
    : target_(target), proposer_(proposer), prompts_(prompts), opt_(opt) {
  if (opt.temperature != 0)
    throw_user("the fixed-shape decoder is greedy only (eval.temperature {}); use the cache engine", opt.temperature);
  if (target.hybrid())
    throw_user("the fixed-shape decoder serves dense targets; {} has linear_attention or expert layers",
               target.config().model_type);
  if (prompts.empty()) throw_user("decode: no prompts");
  check_speculative_options(opt, proposer.max_block_size());
  SpeculativeDecoder::capacity_for(prompts, opt);  // UserError for an empty prompt
}

void FixedSpeculativeDecoder::run() {
  c10::InferenceMode guard;
  const int64_t B = int64_t(prompts_.size()), bs = opt_.block_size, max_new = opt_.max_new_tokens;
  const int64_t capacity = SpeculativeDecoder::capacity_for(prompts_, opt_);
  const std::vector<int64_t> capture = proposer_.capture_ids();
  const at::Device dev = target_.device();
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(dev);
  StepGraphs graphs(graphs_enabled(), dev);  // first: on CUDA the loop's work runs on its stream
  model::StaticKVCache cache(target_, B, capacity);
  proposer_.reset(B, capacity);

  // Prefill: the prompts' features are the first context, argmax of the last logits the first token.
  std::vector<int64_t> rows(B), offsets = {0}, lens(B);
  for (int64_t b = 0; b < B; ++b) {
    rows[b] = b;
    lens[b] = int64_t(prompts_[b].size());
    offsets.push_back(offsets.back() + lens[b]);
  }
  model::TargetModel::Output pre = cache.prefill_capture(rows, prompts_, capture);
  proposer_.add_context(pre.captured, offsets);
  // The rows' state: static buffers, updated in place by the step (a CUDA graph replays it).
  at::Tensor start = at::tensor(lens, at::kLong).to(dev);  // position of the block's first token
  at::Tensor last = pre.logits.argmax(-1);                  // [B], the block's first token
  at::Tensor stop = at::tensor(opt_.stop_ids, at::kLong).to(dev);
  auto is_stop = [&](const at::Tensor& tok) {  // elementwise: tok is a stop id (no host read, unlike isin)
    return (tok.unsqueeze(-1) == stop).any(-1);
  };
  at::Tensor out = at::zeros({B, max_new + bs}, lopt);
  out.select(1, 0).copy_(last);
  at::Tensor out_len = at::ones({B}, lopt);
  at::Tensor done = is_stop(last);
  if (max_new <= 1) done.fill_(true);
  at::Tensor acc = at::zeros({B, max_new + 1}, lopt), nsteps = at::zeros({B}, lopt);
  at::Tensor flags = at::zeros({2}, lopt);  // all rows done, the longest start: the step's one read
  const at::Tensor cols = at::arange(bs, lopt).view({1, bs});
  int64_t max_start = *std::max_element(lens.begin(), lens.end());
  bool all_done = done.all().item<bool>();

  // One step over all rows with attention windows of W context slots (W >= every start).
  auto step = [&](int64_t W) {
    // 1. draft, 2. verify (the target's lengths are the starts)
    at::Tensor drafts = proposer_.propose_rows(last, start, W, bs);  // [B, bs - 1]
    cache.lengths().copy_(start);
    model::TargetModel::Output v = cache.verify(at::cat({last.view({B, 1}), drafts}, 1), W + bs, capture);
    at::Tensor post = v.logits.argmax(-1).view({B, bs});
    // 3. accept: a drafts, the commit post[0..a], cut at the first stop token and at max_new.
    at::Tensor a = drafts.eq(post.narrow(1, 0, bs - 1)).to(at::kLong).cumprod(1).sum(1);  // [B]
    at::Tensor hit = is_stop(post).logical_and(cols <= a.view({B, 1}));
    at::Tensor any_stop = hit.any(1);
    at::Tensor n_commit = at::where(any_stop, hit.to(at::kLong).argmax(1) + 1, a + 1);
    const at::Tensor running = done.logical_not();
    out.scatter_(1, out_len.view({B, 1}) + cols, post);  // past a row's end nothing is read
    acc.scatter_(1, nsteps.view({B, 1}), a.view({B, 1}));
    nsteps.add_(running.to(at::kLong));
    at::Tensor ended = any_stop.logical_or(out_len + a + 1 >= max_new);
    out_len.copy_(at::where(running, at::clamp_max(out_len + n_commit, max_new), out_len));
    // The features of the block's positions go into the draft cache at the old starts.
    proposer_.add_context_rows(v.captured.view({B, bs, -1}), start);
    const at::Tensor advance = running.logical_and(ended.logical_not());
    last.copy_(at::where(advance, post.gather(1, a.view({B, 1})).view({B}), last));
    start.copy_(at::where(advance, start + a + 1, start));
    done.logical_or_(ended);
    flags.select(0, 0).copy_(done.all());
    flags.select(0, 1).copy_(start.max());
  };

  while (!all_done) {
    // The window: a multiple of kWindowBucket above the longest start (a graph per window).
    const int64_t W = std::min(capacity - bs, (max_start + kWindowBucket) / kWindowBucket * kWindowBucket);
    graphs.run(W, [&] { step(W); });
    ++steps_;
    at::Tensor h = flags.to(at::kCPU);
    all_done = h[0].item<int64_t>() != 0;
    max_start = h[1].item<int64_t>();
  }
  graphs_ = graphs.captured();

  // Results to the host.
  at::Tensor out_h = out.to(at::kCPU), len_h = out_len.to(at::kCPU), acc_h = acc.to(at::kCPU), ns_h = nsteps.to(at::kCPU);
  res_.assign(B, {});
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = len_h[b].item<int64_t>(), s = ns_h[b].item<int64_t>();
    const int64_t* o = out_h[b].data_ptr<int64_t>();
    const int64_t* ac = acc_h[b].data_ptr<int64_t>();
    res_[b].tokens.assign(o, o + n);
    res_[b].accepted.assign(ac, ac + s);
    res_[b].target_forwards = 1 + s;
  }
}

}  // namespace dflash::eval
