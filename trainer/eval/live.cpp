// trainer/eval/live.h: the evaluation during training.
#include "trainer/eval/live.h"

#include <chrono>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

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

LiveEval::LiveEval(const Config& cfg, const model::DrafterSpec& spec, at::Device device, at::ScalarType dtype)
    : cfg_(cfg), target_(model::TargetModel::load(cfg.target.model_dir, dtype, device)) {
  const model::HfConfig& tc = target_.config();
  settings_ = make_settings(cfg, spec.block_size, resolve_stop_ids(cfg.eval, tc, cfg.target.model_dir));
  settings_.baseline = false;
  settings_.progress = false;
  PromptLimits lim;
  lim.vocab_size = tc.vocab_size;
  lim.max_positions = tc.max_position_embeddings;
  lim.max_new_tokens = settings_.max_new_tokens;
  lim.context_source = "max_position_embeddings of " + tc.path;
  lim.target_dir = cfg.target.model_dir;
  prompts_ = read_prompts(cfg.eval.prompts, lim, cfg.eval.max_prompts);
  drafter_ = std::make_unique<model::Drafter>(spec, device, dtype);
  log::info("eval during training: {} held-out prompts from {}, <= {} new tokens, block {}, every {} steps",
            prompts_.size(), cfg.eval.prompts, settings_.max_new_tokens, settings_.block_size, cfg.eval.every);
}

LiveResult LiveEval::run(const at::Tensor& flat, int64_t step) {
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
  DFlashProposer proposer(*drafter_, target_);
  EvalReport r = evaluate(target_, proposer, prompts_, settings_);
  settings_.warmup = false;  // once is enough
  LiveResult res{step, r.tau, 0};
  const std::string dir = files::join(cfg_.run.dir, "eval");
  files::make_dirs(dir);
  files::write_file_atomic(files::join(dir, fmt::format("step_{:06d}.json", step)),
                           r.to_json(fmt::format("\"step\": {}, ", step)));
  res.wall_s = now_s() - t0;
  const std::string line = fmt::format(
      "{{\"step\": {}, \"tau\": {:.6g}, \"steps\": {}, \"generated_tokens\": {}, \"eval_s\": {:.4g}, "
      "\"acceptance_rate_per_position\": [{}]}}\n",
      step, r.tau, r.steps, r.spec_tokens, res.wall_s, fmt::join(r.accept_rate, ", "));
  std::FILE* f = std::fopen(files::join(cfg_.run.dir, "eval.jsonl").c_str(), "a");
  if (f) std::fputs(line.c_str(), f), std::fclose(f);
  log::info("eval at step {}: tau {:.3f} on {} held-out prompts ({} steps, {} tokens) in {:.2f} s", step, r.tau,
            prompts_.size(), r.steps, r.spec_tokens, res.wall_s);
  return res;
}

}  // namespace dflash::eval
