// The evaluation that runs during training (docs/eval.md "During training"): one instance on the
// rank that evaluates (a target rank, or the colocated process). It uses that rank's own target
// model (loaded once, with all layers and the LM head: target_load_options) — never a second
// copy — plus the held-out prompts (eval.prompts) and a drafter of the run's spec whose weights
// are replaced before each evaluation from one flat tensor (what drafter rank 0 sends; flatten()
// builds it).
//
// Costs paid once, before training (the constructor): the target and draft KV caches for the
// largest batch (eval.batch_size rows x the longest prompt + eval.max_new_tokens + block) are
// allocated, and one untimed warm-up decode of the first batch (2 blocks of new tokens) takes the
// first-call costs (allocator, kernels, BLAS handles). Every evaluation after that reuses the
// caches (cache_allocations() stays 2: one target, one draft cache) and pays only its decoding.
//
// An evaluation runs whole (run(): the colocated process, which pauses training for it) or in
// pieces (begin(), then advance() one decode unit — a batch's prefill or one draft + verify step
// — at a time until busy() is false: a target rank does this while its sends wait for the
// drafters, eval_hooks.h). Either way it decodes the prompts speculatively (no plain-decoding
// baseline: the cost during training is the speculative pass only), then writes
// <run.dir>/eval/step_<N>.json (the report of evaluate.h), appends one line to
// <run.dir>/eval.jsonl and logs one console line. Its cost (eval_s) is the time spent in its
// pieces, device-synchronised; eval_span_s (eval.jsonl) the wall time from begin() to the end.
// Owns: the caches, the drafter copy and the prompts; references the target. Thread-safety: one
// thread.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/config.h"
#include "trainer/eval/draft.h"
#include "trainer/eval/evaluate.h"
#include "trainer/eval/speculative.h"
#include "trainer/model/drafter.h"
#include "trainer/model/target.h"
#include "trainer/model/target_cache.h"

namespace dflash::eval {

struct LiveResult {
  int64_t step = 0;  // optimizer step whose weights were evaluated (0: none yet)
  double tau = 0;
  double wall_s = 0;  // cost of the evaluation: time spent decoding + writing the report
};

class LiveEval {
 public:
  // `target`: the rank's target, loaded with target_load_options (all layers, LM head) on the
  // device and in the dtype of the evaluation; it must outlive this. Reads the prompts, checks
  // the settings, allocates the caches and warms up (see above).
  LiveEval(const Config& cfg, const model::DrafterSpec& spec, const model::TargetModel& target);
  ~LiveEval();

  // A whole evaluation of `flat_weights` (the weights after optimizer step `step`).
  LiveResult run(const at::Tensor& flat_weights, int64_t step);
  // The same in pieces: begin copies the weights in (the caller may reuse flat_weights after).
  void begin(const at::Tensor& flat_weights, int64_t step);
  bool busy() const { return busy_; }
  // One decode unit of the evaluation begun last; the last one writes the report. Returns the
  // seconds it took (0 when not busy).
  double advance();
  // Advances until done; returns the seconds.
  double complete();
  // The last finished evaluation (step 0: none yet).
  const LiveResult& result() const { return last_; }

  const model::TargetModel& target() const { return target_; }
  const DFlashProposer& proposer() const { return *proposer_; }
  // Cache buffer allocations so far (target + draft cache): 2 after the constructor, and 2 as
  // long as every batch fits them.
  int64_t cache_allocations() const;
  double warmup_s() const { return warmup_s_; }

  // Numel of the flat weights of `spec` (every parameter in export order).
  static int64_t flat_size(const model::DrafterSpec& spec);
  static at::Tensor flatten(const model::Drafter& drafter);
  // Optimizer steps (values of "steps done") after which to evaluate: multiples of eval.every in
  // (start_step, total_steps], plus total_steps. Empty when eval.every == 0. UserError naming the
  // key when eval.every > 0 without eval.prompts.
  static std::vector<int64_t> eval_steps(const Config& cfg, int64_t start_step, int64_t total_steps);
  // How the evaluating rank loads its one target: `training` (what training needs: layers up to
  // the last captured one, no LM head) widened to all layers and the LM head. Capture stops at
  // the last captured layer either way, so training computes exactly what it computes without
  // evaluation.
  static model::TargetLoadOptions target_load_options(model::TargetLoadOptions training);

 private:
  void start_batch();
  void finish();
  void log_result();
  const Config& cfg_;
  const model::TargetModel& target_;
  std::unique_ptr<model::Drafter> drafter_;
  std::unique_ptr<DFlashProposer> proposer_;
  std::unique_ptr<model::TargetCache> cache_;
  std::vector<Prompt> prompts_;
  EvalSettings settings_;
  DecodeOptions opt_;
  double warmup_s_ = 0;
  // The evaluation in progress.
  bool busy_ = false;
  int64_t step_ = 0, b0_ = 0;
  double spent_s_ = 0, begin_t_ = 0;
  std::unique_ptr<SpeculativeDecoder> dec_;
  EvalReport report_;
  LiveResult last_;
};

}  // namespace dflash::eval
