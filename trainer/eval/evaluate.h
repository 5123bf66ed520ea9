// An evaluation of a drafter: speculative decoding of a prompt set (speculative.h) against plain
// decoding of the same target in the same process, the numbers of docs/eval.md, and the
// `dflash_rank eval` command around it.
//
//   dflash_rank eval --config FILE.yaml [eval.drafter_dir=DIR eval.prompts=FILE.jsonl ...]
// loads target.model_dir (full model) and the drafter export, checks that they fit, decodes
// eval.prompts in batches of eval.batch_size, prints a progress line per batch and a summary,
// and writes the JSON report atomically to eval.out (default <run.dir>/eval.json).
//
// Owns: the report (plain value) and its JSON/console forms. Thread-safety: none needed; one
// call runs on the caller's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "trainer/config.h"
#include "trainer/eval/draft.h"
#include "trainer/eval/prompts.h"
#include "trainer/eval/speculative.h"

namespace dflash::eval {

struct EvalSettings {
  int64_t block_size = 16;
  int64_t max_new_tokens = 256;
  int64_t batch_size = 16;
  double temperature = 0;
  uint64_t seed = 0;
  std::vector<int64_t> stop_ids;
  bool baseline = true;   // also run plain decoding
  bool warmup = true;     // one short untimed run of both decoders first (allocators, kernels)
  bool progress = true;   // a log line per batch
};

struct PromptReport {
  std::string label;
  int64_t prompt_tokens = 0;
  RowResult spec;
  std::vector<int64_t> baseline_tokens;  // empty without baseline
  bool equal = false;                    // spec.tokens == baseline_tokens
};

// Environment knob: the engine of the speculative pass. "cache" (default): SpeculativeDecoder on
// TargetCache; "fixed": FixedSpeculativeDecoder (speculative_fixed.h) where it serves (greedy,
// dense target, the DFlash proposer), else the cache engine. Read once per process.
constexpr const char* kEvalEngineEnv = "DFLASH_EVAL_ENGINE";

struct EvalReport {
  EvalSettings settings;
  std::string engine = "cache";  // the speculative pass's engine: "cache" or "fixed"
  int64_t graphs = 0;            // CUDA graphs the fixed engine captured (all batches)
  std::vector<PromptReport> prompts;
  // Aggregates (docs/eval.md defines each).
  int64_t steps = 0;                        // speculative steps over all prompts
  double tau = 0;                           // mean over steps of accepted + 1
  std::vector<int64_t> histogram;           // [bs]: steps that accepted 0 .. bs-1 drafts
  std::vector<double> accept_rate;          // [bs - 1]: share of steps accepting draft k = 1 .. bs-1
  int64_t spec_tokens = 0, base_tokens = 0; // generated tokens
  int64_t spec_forwards = 0, base_forwards = 0;
  double spec_wall_s = 0, base_wall_s = 0;
  int64_t equal = 0;                        // prompts whose output equals plain decoding
  double spec_tokens_per_s() const { return spec_wall_s > 0 ? double(spec_tokens) / spec_wall_s : 0; }
  double base_tokens_per_s() const { return base_wall_s > 0 ? double(base_tokens) / base_wall_s : 0; }
  double speedup() const;  // spec tokens/s over plain tokens/s (= plain TPOT / spec TPOT); 0 without baseline

  std::string to_json(const std::string& extra_fields = "") const;  // extra: `"key": value, ` text
  std::vector<std::string> summary_lines() const;
};

// The aggregates of `r` (steps, tau, histogram, rates, tokens, forwards, equal) from
// r.prompts and r.settings (block size, baseline); walls are left as they are.
void summarize(EvalReport& r);

// Decodes `prompts` both ways (see above). `proposer` must fit `target`.
EvalReport evaluate(const model::TargetModel& target, DraftProposer& proposer, const std::vector<Prompt>& prompts,
                    const EvalSettings& settings);

// The stop ids of a run: eval.stop_token_ids, plus (eval.stop_at_eos) the target's eos ids from
// config.json and, if present, generation_config.json.
std::vector<int64_t> resolve_stop_ids(const EvalConfig& cfg, const model::HfConfig& target_cfg,
                                      const std::string& target_dir);

// EvalSettings from the eval section (block size 0 -> `drafter_block_size`; seed -1 -> run.seed);
// UserErrors name the key.
EvalSettings make_settings(const Config& cfg, int64_t drafter_block_size, std::vector<int64_t> stop_ids);

// `dflash_rank eval`: returns the exit code.
int run_eval_command(const Config& cfg);

}  // namespace dflash::eval
