// DFlash speculative decoding for a batch of prompts (DFLASH.md §6), and the plain decoding it is
// measured against, both on the target KV cache of model/target_cache.h.
//
// One step, for every row still running (rows advance independently; a row that produced a
// stop token or max_new_tokens tokens stops):
//   1. draft: the proposer gets the row's new context features and proposes bs - 1 tokens for
//      the block [last committed token, MASK x (bs - 1)] (draft.h);
//   2. verify: the target extends the row by the bs block tokens (one forward for all rows),
//      posterior[i] = the target's choice at block offset i (argmax, or the seeded sample below);
//   3. accept the longest prefix with draft[i] == posterior[i] (a drafts) and commit them plus
//      the bonus posterior[a]; crop the target cache to the a + 1 verified positions; their
//      captured features are the draft's next new context.
// Before the first step a prefill of all prompts gives the first token and the prompts' features.
// τ of a row = mean over its steps of (a + 1) (counted as the reference loop does, also on the
// last step, whose commit may pass max_new_tokens and is then truncated).
//
// Sampling (temperature > 0), the target-only rule of §6: the token at position p of prompt r
// is the inverse-CDF sample of softmax(logits / T) at u = uniform(seed, r, p) (a counter-based
// hash, docs/eval.md), so a draft token is accepted iff it equals the target's own sample there,
// and speculative decoding emits exactly what plain sampling with the same seed emits. Greedy
// (T = 0) is argmax. The same rule picks the plain decoder's tokens.
//
// Thread-safety: none; a decoder and its caches belong to one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/eval/draft.h"
#include "trainer/model/target_cache.h"

namespace dflash::eval {

struct DecodeOptions {
  int64_t block_size = 16;       // tokens per verify block (>= 2; <= the proposer's)
  int64_t max_new_tokens = 256;  // per prompt
  double temperature = 0;        // 0: greedy
  uint64_t seed = 0;             // of the sampler (temperature > 0)
  std::vector<int64_t> stop_ids;  // a row ends after the first of these it produces
};

struct RowResult {
  std::vector<int64_t> tokens;    // new tokens (truncated after a stop token / at max_new_tokens)
  std::vector<int64_t> accepted;  // per speculative step: accepted drafts, 0 .. bs - 1
  int64_t target_forwards = 0;    // target passes this row took part in (prefill + verifies)
  double tau() const;             // mean of accepted + 1 (0 without steps)
};

// The uniform in [0, 1) of (seed, prompt, position): splitmix64 chained over the three
// (docs/eval.md gives the formula; tests/eval/spec_ref.py implements it independently).
double sample_uniform(uint64_t seed, int64_t prompt, int64_t position);

// The tokens chosen from logits [R, V] (float32) at rows' (prompt, position) pairs: argmax if
// temperature == 0, else the seeded inverse-CDF sample.
std::vector<int64_t> choose_tokens(const at::Tensor& logits, const std::vector<int64_t>& prompt,
                                   const std::vector<int64_t>& position, double temperature, uint64_t seed);

// The checks of a speculative decode's options (UserError naming the eval key): max_new_tokens
// >= 1, temperature >= 0, block_size in [2, max_block_size] (the proposer's).
void check_speculative_options(const DecodeOptions& opt, int64_t max_block_size);

class SpeculativeDecoder {
 public:
  // `prompt_ids[b]`: the global index of prompts[b] (seeds the sampler; results do not depend on
  // the batch a prompt runs in). prompts must be non-empty; token ids are checked by the target.
  SpeculativeDecoder(const model::TargetModel& target, DraftProposer& proposer,
                     const std::vector<std::vector<int64_t>>& prompts, const std::vector<int64_t>& prompt_ids,
                     const DecodeOptions& opt);
  // The same on a caller's cache (reused between batches: reset() to this batch, no allocation
  // when it fits); its capture ids must be the proposer's. `cache` must outlive the decoder.
  SpeculativeDecoder(model::TargetCache& cache, DraftProposer& proposer,
                     const std::vector<std::vector<int64_t>>& prompts, const std::vector<int64_t>& prompt_ids,
                     const DecodeOptions& opt);
  // Rows x capacity of the target cache a batch of `prompts` needs.
  static int64_t capacity_for(const std::vector<std::vector<int64_t>>& prompts, const DecodeOptions& opt);
  // One draft + verify step for the running rows; false when every row is done.
  bool step();
  void run() { while (step()) {} }

  const std::vector<RowResult>& results() const { return res_; }
  const model::TargetCache& target_cache() const { return cache_; }
  // Position of row b's last committed token (its draft context holds positions below).
  int64_t start(int64_t b) const { return start_.at(b); }
  bool done(int64_t b) const { return done_.at(b); }

 private:
  void begin_batch(const std::vector<std::vector<int64_t>>& prompts);
  void commit(int64_t b, const std::vector<int64_t>& toks);
  DraftProposer& proposer_;
  DecodeOptions opt_;
  std::vector<int64_t> ids_;
  std::unique_ptr<model::TargetCache> own_;  // the cache when the decoder made it
  model::TargetCache& cache_;
  std::vector<RowResult> res_;
  std::vector<int64_t> start_, last_;
  std::vector<bool> done_;
};

// Plain decoding of the same batch (block size 1): one target forward per new token, tokens by
// the same rule (greedy or seeded sample). The speedup baseline.
std::vector<RowResult> plain_decode(const model::TargetModel& target, const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<int64_t>& prompt_ids, const DecodeOptions& opt);

}  // namespace dflash::eval
