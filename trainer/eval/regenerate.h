// Regeneration: the target's own responses to a list of tokenised prompts, the data step before
// training (DFLASH.md §3 trains on the target's outputs). tools/regenerate.py renders chat
// prompts to ids, runs `dflash_rank regenerate` on them and turns the new tokens back into chat.
//
// The loop (continuous batching on `batch_size` rows): prompts are prefilled into free rows,
// every step extends each active row by its last token, and a row that stops (a stop id,
// included, or max_new_tokens) hands its result to the sink and makes room for the next
// prompt. Refills wait until `refill_rows` rows are free (or none is active) so that prefills,
// which run a whole forward each, stay rare. Greedy (temperature 0) or sampled:
// softmax(logits / T), the top-p nucleus (smallest set of most probable tokens with mass >=
// top_p), one draw by inverse CDF from a uniform that is a pure function of (item seed, step):
// a row's output does not depend on which other rows share its batch, so a resumed run gives
// the same samples.
//
// Two engines with the same results (tests/eval/test_regenerate_static.cpp):
// - static (dense targets, the default): a StaticKVCache (target_cache_static.h) and per-row
//   state on the device (last token, tokens so far, alive, the output tokens, the uniforms):
//   a step is the same kernels on the same buffers each time, with no host tensor and no host
//   read; the host reads the rows' state every `check_every` steps (sooner when a row reaches
//   max_new_tokens, which the host can count), so a row that stopped on a stop id may run up to
//   check_every - 1 dead steps (its extra tokens are never read). On CUDA the step is a CUDA
//   graph per attention window (regenerate_graph.h; `cuda_graphs`, on by default), the window
//   being a multiple of `window_bucket` above the longest row.
// - cache (targets with recurrent or expert layers, or on request): TargetCache, one host
//   read per step (the tokens), only the active rows run.
// Owns: the cache and the per-row state during a call. Thread-safety: one call at a time per
// model (the cache is per call).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "trainer/model/target.h"

namespace dflash::eval {

struct RegenOptions {
  int64_t batch_size = 64;       // rows decoded together
  int64_t max_new_tokens = 512;  // per item
  double temperature = 0;        // 0: greedy
  double top_p = 1.0;            // nucleus mass when sampling (1: the whole distribution)
  std::vector<int64_t> stop_ids; // a row ends after producing one of these
  int64_t refill_rows = 0;       // free rows that trigger a refill (0: max(1, batch_size / 16))
  double progress_s = 10;        // seconds between progress lines (<= 0: none)
  enum class Engine { Auto, Static, Cache };
  Engine engine = Engine::Auto;  // Auto: static for dense targets, else cache
  int64_t check_every = 8;       // static: decode steps between host reads of the rows' state
  bool cuda_graphs = true;       // static on CUDA: the decode step as CUDA graphs (CPU: eager)
  int64_t window_bucket = 256;   // static: the attention window is a multiple of this (<= capacity)
};

struct RegenItem {
  std::string key;           // caller's label (e.g. "17:0" = prompt 17, sample 0)
  std::vector<int64_t> ids;  // the rendered prompt
  uint64_t seed = 0;         // sampling stream of this item
};

struct RegenResult {
  const RegenItem* item = nullptr;
  std::vector<int64_t> tokens;  // new tokens (the stop id included when it stopped)
  bool stopped = false;         // ended on a stop id (else: max_new_tokens)
};

struct RegenStats {
  int64_t items = 0;
  int64_t new_tokens = 0;
  int64_t prompt_tokens = 0;
  int64_t steps = 0;     // decode steps (extend calls)
  int64_t prefills = 0;  // refill forwards
  double prefill_s = 0;    // seconds in refills (prefill forward and first tokens, synced)
  int64_t host_reads = 0;  // device -> host reads of the rows' state (static: every check)
  int64_t graphs = 0;      // CUDA graphs captured (static on CUDA)
  std::string engine;      // "static" or "cache"
  double seconds = 0;
  double tokens_per_s() const { return seconds > 0 ? double(new_tokens) / seconds : 0; }
};

// Runs every item through `model`; `sink` receives each result as its row finishes (in finish
// order). Progress lines go to stderr. UserError on an empty prompt or an id outside the
// vocabulary (naming the item's key).
RegenStats regenerate(const model::TargetModel& model, const std::vector<RegenItem>& items,
                      const RegenOptions& opts, const std::function<void(const RegenResult&)>& sink);

// The next token of each logits row: argmax when temperature is 0, else a draw as described
// above with uniforms `u` (one per row, in [0, 1)). `logits` [n, V] float32. -> [n] int64 on CPU.
std::vector<int64_t> sample_rows(const at::Tensor& logits, double temperature, double top_p,
                                 const std::vector<double>& u);

// sample_rows on the device: `u` [n] float32 on logits' device (undefined when greedy) -> [n]
// int64 on logits' device. No host reads (safe inside a CUDA graph).
at::Tensor sample_tokens(const at::Tensor& logits, double temperature, double top_p, const at::Tensor& u);

// The uniform in [0, 1) of (seed, step): splitmix64 of the pair, top 53 bits.
double counter_uniform(uint64_t seed, uint64_t step);

// `dflash_rank regenerate ...` (argv[0] = "regenerate"); usage in regenerate.cpp. Returns the
// exit code; UserError propagates (main prints it, exit 2).
int regenerate_command(int argc, char** argv);

}  // namespace dflash::eval
