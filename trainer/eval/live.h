// The evaluation that runs during training (docs/eval.md "During training"): one instance on the
// rank that evaluates (a target rank, or the colocated process), holding the full target model
// (with LM head; the target role's own copy stops at the last captured layer), the held-out
// prompts (eval.prompts) and a drafter of the run's spec whose weights are replaced before each
// evaluation from one flat tensor (what drafter rank 0 sends; flatten() builds it).
//
// Each run(step) decodes the prompts speculatively (no plain-decoding baseline: the cost during
// training is the speculative pass only), writes <run.dir>/eval/step_<N>.json (the report of
// evaluate.h), appends one line to <run.dir>/eval.jsonl and logs one console line.
// Owns: the models and prompts. Thread-safety: one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/config.h"
#include "trainer/eval/evaluate.h"
#include "trainer/model/drafter.h"
#include "trainer/model/target.h"

namespace dflash::eval {

struct LiveResult {
  int64_t step = 0;  // optimizer step whose weights were evaluated (0: none yet)
  double tau = 0;
  double wall_s = 0;  // cost of the evaluation (decoding + report)
};

class LiveEval {
 public:
  // Loads the target (cfg.target.model_dir, `dtype`, `device`) and the prompts; checks settings.
  LiveEval(const Config& cfg, const model::DrafterSpec& spec, at::Device device, at::ScalarType dtype);
  LiveResult run(const at::Tensor& flat_weights, int64_t step);
  // Numel of the flat weights of `spec` (every parameter in export order).
  static int64_t flat_size(const model::DrafterSpec& spec);
  static at::Tensor flatten(const model::Drafter& drafter);
  // Optimizer steps (values of "steps done") after which to evaluate: multiples of eval.every in
  // (start_step, total_steps], plus total_steps. Empty when eval.every == 0. UserError naming the
  // key when eval.every > 0 without eval.prompts.
  static std::vector<int64_t> eval_steps(const Config& cfg, int64_t start_step, int64_t total_steps);

 private:
  const Config& cfg_;
  model::TargetModel target_;
  std::unique_ptr<model::Drafter> drafter_;
  std::vector<Prompt> prompts_;
  EvalSettings settings_;
};

}  // namespace dflash::eval
