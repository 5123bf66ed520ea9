// trainer/eval/live.h: the evaluation during training.
#include "trainer/eval/live.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/device.h"
#include "core/error.h"
#include "core/files.h"
#include "core/log.h"
#include "trainer/model/hf_config.h"

namespace dflash::eval {
namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

std::vector<int64_t> LiveEval::eval_steps(const Config& cfg, int64_t start, int64_t total) {
  const int64_t every = cfg.eval.every;
  if (every < 0) throw_user("eval.every must be >= 0 (0: no evaluation during training), got {}", every);
  if (every == 0) return {};
  if (cfg.eval.prompts.empty())
    throw_user("eval.every is {} but eval.prompts is not set (a held-out prompts JSONL, docs/eval.md)", every);
  std::vector<int64_t> v;
  for (int64_t d = (start / every + 1) * every; d < total; d += every) v.push_back(d);
  if (total > start) v.push_back(total);
  return v;
}

int64_t LiveEval::flat_size(const model::DrafterSpec& spec) {
  int64_t n = 0;
  for (const auto& [name, shape] : spec.param_shapes()) {
    int64_t e = 1;
    for (auto d : shape) e *= d;
    n += e;
  }
  return n;
}

at::Tensor LiveEval::flatten(const model::Drafter& d) {
  at::NoGradGuard ng;
  std::vector<at::Tensor> parts;
  for (const auto& [name, t] : d.named_parameters()) parts.push_back(t.detach().reshape({-1}));
  return at::cat(parts);
}

model::TargetLoadOptions LiveEval::target_load_options(model::TargetLoadOptions lo) {
  lo.num_layers = -1;
  lo.lm_head = true;
  return lo;
}

LiveEval::LiveEval(const Config& cfg, const model::DrafterSpec& spec, const model::TargetModel& target)
    : cfg_(cfg), target_(target) {
  const double t0 = now_s();
  const model::HfConfig& tc = target_.config();
  if (!target_.has_lm_head() || target_.num_layers_loaded() != tc.num_hidden_layers)
    throw std::logic_error("eval during training: the rank's target was loaded without all layers or the LM head "
                           "(load it with LiveEval::target_load_options)");
  settings_ = make_settings(cfg, spec.block_size, resolve_stop_ids(cfg.eval, tc, cfg.target.model_dir));
  settings_.baseline = false;
  settings_.progress = false;
  settings_.warmup = false;  // done here, once
  PromptLimits lim;
  lim.vocab_size = tc.vocab_size;
  lim.max_positions = tc.max_position_embeddings;
  lim.max_new_tokens = settings_.max_new_tokens;
  lim.context_source = "max_position_embeddings of " + tc.path;
  lim.target_dir = cfg.target.model_dir;
  prompts_ = read_prompts(cfg.eval.prompts, lim, cfg.eval.max_prompts);
  if (prompts_.empty()) throw_user("eval.prompts: {} holds no prompts", cfg.eval.prompts);
  opt_.block_size = settings_.block_size;
  opt_.max_new_tokens = settings_.max_new_tokens;
  opt_.temperature = settings_.temperature;
  opt_.seed = settings_.seed;
  opt_.stop_ids = settings_.stop_ids;
  // The drafter copy (zeros until the first weights arrive) and both caches, for the largest batch.
  drafter_ = std::make_unique<model::Drafter>(spec, target_.device(), target_.dtype());
  proposer_ = std::make_unique<DFlashProposer>(*drafter_, target_);
  const int64_t rows = std::min<int64_t>(settings_.batch_size, int64_t(prompts_.size()));
  int64_t longest = 0;
  for (const auto& p : prompts_) longest = std::max<int64_t>(longest, int64_t(p.ids.size()));
  const int64_t capacity = longest + opt_.max_new_tokens + opt_.block_size;
  cache_ = std::make_unique<model::TargetCache>(target_, rows, capacity, proposer_->capture_ids());
  proposer_->reset(rows, capacity);
  const double t_alloc = now_s() - t0;
  // Warm-up: the first batch to the full length, results dropped. The drafter is still zeros, so
  // every step accepts nothing and the caches pass through every key length (in buckets of 64) an
  // eval can reach: each one's first use (allocator blocks, SDPA plans) is paid here, before
  // training, not in the first eval (13.7 s against 2.4 s for the second on an H200 when the
  // warm-up stopped at 2 blocks: bench/RESULTS.md).
  const double t1 = now_s();
  {
    c10::InferenceMode guard;
    std::vector<std::vector<int64_t>> batch;
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < rows; ++i) batch.push_back(prompts_[i].ids), ids.push_back(i);
    DecodeOptions w = opt_;
    w.stop_ids.clear();  // to the full length, whatever the prompts generate
    SpeculativeDecoder(*cache_, *proposer_, batch, ids, w).run();
    device::sync(target_.device());
  }
  warmup_s_ = now_s() - t1;
  log::info("eval during training: {} held-out prompts from {}, <= {} new tokens, batch {}, block {}, every {} steps; "
            "uses this rank's target ({} layers + LM head, no second copy); caches for {} x {} positions allocated "
            "in {:.2f} s, warm-up {:.2f} s (before training)",
            prompts_.size(), cfg.eval.prompts, settings_.max_new_tokens, settings_.batch_size, settings_.block_size,
            cfg.eval.every, target_.num_layers_loaded(), rows, capacity, t_alloc, warmup_s_);
}

LiveEval::~LiveEval() = default;

int64_t LiveEval::cache_allocations() const { return cache_->allocations() + proposer_->allocations(); }

void LiveEval::begin(const at::Tensor& flat, int64_t step) {
  DFLASH_CHECK(!busy_, "eval: begin of step {} while step {} is in progress", step, step_);
  const double t0 = now_s();
  {
    at::NoGradGuard ng;
    at::Tensor w = flat.to(drafter_->device(), drafter_->dtype());
    int64_t off = 0;
    for (const auto& [name, t] : drafter_->named_parameters()) {
      const int64_t n = t.numel();
      const_cast<at::Tensor&>(t).copy_(w.narrow(0, off, n).view(t.sizes()));
      off += n;
    }
    DFLASH_CHECK(off == w.numel(), "eval weights: {} values for {} parameters", w.numel(), off);
  }
  busy_ = true;
  step_ = step;
  b0_ = 0;
  dec_.reset();
  report_ = EvalReport();
  report_.settings = settings_;
  report_.prompts.resize(prompts_.size());
  for (size_t i = 0; i < prompts_.size(); ++i)
    report_.prompts[i].label = prompts_[i].label, report_.prompts[i].prompt_tokens = int64_t(prompts_[i].ids.size());
  begin_t_ = t0;
  spent_s_ = now_s() - t0;
}

void LiveEval::start_batch() {
  const int64_t N = int64_t(prompts_.size()), n = std::min(settings_.batch_size, N - b0_);
  std::vector<std::vector<int64_t>> batch;
  std::vector<int64_t> ids;
  for (int64_t i = b0_; i < b0_ + n; ++i) batch.push_back(prompts_[i].ids), ids.push_back(i);
  dec_ = std::make_unique<SpeculativeDecoder>(*cache_, *proposer_, batch, ids, opt_);  // prefill
}

double LiveEval::advance() {
  if (!busy_) return 0;
  c10::InferenceMode guard;
  const double t0 = now_s();
  if (!dec_) {
    start_batch();
  } else if (!dec_->step()) {
    const auto& res = dec_->results();
    for (size_t j = 0; j < res.size(); ++j) report_.prompts[b0_ + int64_t(j)].spec = res[j];
    dec_.reset();
    b0_ += settings_.batch_size;
    if (b0_ >= int64_t(prompts_.size())) finish();
  }
  device::sync(target_.device());
  const double dt = now_s() - t0;
  spent_s_ += dt;
  if (!busy_) last_.wall_s = spent_s_, log_result();
  return dt;
}

double LiveEval::complete() {
  double s = 0;
  while (busy_) s += advance();
  return s;
}

LiveResult LiveEval::run(const at::Tensor& flat, int64_t step) {
  begin(flat, step);
  complete();
  return last_;
}

void LiveEval::finish() {
  summarize(report_);
  const EvalReport& r = report_;
  const std::string dir = files::join(cfg_.run.dir, "eval");
  files::make_dirs(dir);
  files::write_file_atomic(files::join(dir, fmt::format("step_{:06d}.json", step_)),
                           r.to_json(fmt::format("\"step\": {}, ", step_)));
  busy_ = false;
  last_ = LiveResult{step_, r.tau, 0};
}

void LiveEval::log_result() {
  const EvalReport& r = report_;
  const double span = now_s() - begin_t_;
  const std::string line = fmt::format(
      "{{\"step\": {}, \"tau\": {:.6g}, \"steps\": {}, \"generated_tokens\": {}, \"eval_s\": {:.4g}, "
      "\"eval_span_s\": {:.4g}, \"acceptance_rate_per_position\": [{}]}}\n",
      step_, r.tau, r.steps, r.spec_tokens, last_.wall_s, span, fmt::join(r.accept_rate, ", "));
  std::FILE* f = std::fopen(files::join(cfg_.run.dir, "eval.jsonl").c_str(), "a");
  if (f) std::fputs(line.c_str(), f), std::fclose(f);
  log::info("eval at step {}: tau {:.3f} on {} held-out prompts ({} steps, {} tokens) in {:.2f} s{}; caches "
            "allocated {}x in all", step_, r.tau, prompts_.size(), r.steps, r.spec_tokens, last_.wall_s,
            span > last_.wall_s * 1.05 + 0.01 ? fmt::format(" (spread over {:.2f} s of training)", span) : "",
            cache_allocations());
}

}  // namespace dflash::eval
