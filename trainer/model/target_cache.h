// The target model's KV cache for a batch of independent rows, and greedy decoding on it. One
// API serves plain greedy decoding (extend by 1), speculative verification (extend by the block
// size, then crop to the accepted length) and batched regeneration: per-row lengths, a prefill
// of prompts of unequal lengths, extend by any number of tokens per row (0: the row sits out),
// crop each row back to a given length.
//
// Invariant (what makes junk impossible): every slot at or past a row's length holds zeros.
// The cache is zero-initialised, extend writes only the slots of the tokens it runs, and crop
// zeroes what it drops. Attention additionally masks by per-row length, so a stale or unwritten
// slot never gets weight; and since masked slots hold zeros (never NaN/Inf), a zero weight
// times a masked value is an exact 0 in every backend.
//
// Arithmetic: prefill of empty rows runs the packed varlen causal attention of the plain
// forward (ops::varlen_causal_attention) and stores K/V; extend of non-empty rows attends the
// new queries of each row to its cached prefix plus its own new tokens (causal among them)
// with one scaled_dot_product_attention over all rows, GQA folded into the query axis.
// Tokens of the rows that run are packed ([T] = Σ n_b), so rows that sit out cost no GEMMs.
//
// Targets with linear_attention layers (qwen3_5 families, target_qwen35.h): their recurrent
// state is the cache of those layers (HybridRecurrentCache, snapshotted before every extend).
// A crop to a length inside the last extend restores the snapshot and replays the kept tokens
// (one extra pass over them); a crop to before the last extend's start is supported only to 0.
//
// Reuse (the evaluation during training, trainer/eval/live.h): reset() empties the cache for a
// new batch of up to the allocated rows x capacity without allocating (the K/V buffers are kept
// and the part in use is zeroed, which restores the invariant); allocations() counts the times
// the buffers were allocated, so a caller can check that repeated evaluations reuse them. (The
// recurrent state of linear_attention layers, small, is made anew by each reset.)
//
// Owns: K/V buffers per layer [rows, capacity, nkv, head_dim] in the model's dtype on its
// device (keys()/values() are views of the rows x capacity in use), and the host copy of the
// lengths. Lifetime: references the TargetModel (must outlive
// the cache). Thread-safety: none; one thread drives a cache.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/target.h"

namespace dflash::model {

class HybridRecurrentCache;

// The shapes of a cached attention during decoding (TargetCache::extend; the eval's draft cache,
// trainer/eval/draft.h). Each new shape may cost SDPA's backend a plan the first time (the first
// eval during training on an H200 took 13.7 s against 2.4 s for the second: bench/RESULTS.md), so
// both caches read few of them; the extra slots and rows are masked or dropped and hold zeros
// (the invariant below).
//   cached_keys: `n` keys rounded up to a multiple of 64, at most `capacity`;
//   attended_rows: the rows in `active` (rows of 0 .. rows - 1, none twice) with the first idle
//     rows added up to a power of two (at most `rows`), ascending: log2(rows) + 1 batch sizes as
//     rows finish instead of one per count of active rows.
int64_t cached_keys(int64_t n, int64_t capacity);
std::vector<int64_t> attended_rows(const std::vector<int64_t>& active, int64_t rows);

class TargetCache {
 public:
  // `rows` independent sequences of up to `capacity` tokens each; `capture_ids`: the decoder
  // layers whose outputs every prefill/extend returns (empty: none; validated by the model).
  TargetCache(const TargetModel& model, int64_t rows, int64_t capacity,
              std::vector<int64_t> capture_ids = {});

  // Which logits a step returns.
  enum class Logits { All, Last, None };

  // The result of one prefill/extend over the rows that ran. Row b's tokens are
  // [offsets[b], offsets[b + 1]) of `captured` (and of `logits` with Logits::All; with
  // Logits::Last, logits row j is the last token of the j-th row that ran, in row order).
  struct Step {
    at::Tensor logits;    // [T or rows that ran, vocab] float32 (undefined with Logits::None)
    at::Tensor captured;  // [T, K * H] model dtype (undefined without capture ids)
    std::vector<int64_t> offsets;  // [rows + 1]
  };

  // Appends tokens[b] to row b at positions length(b), length(b) + 1, ... (tokens.size() must
  // be rows(); an empty list leaves the row untouched). Exceeding the capacity or a token
  // outside the vocabulary is a UserError.
  Step extend(const std::vector<std::vector<int64_t>>& tokens, Logits logits = Logits::All);
  // extend() for rows that are all empty (a batch of prompts): same result, requires
  // length(b) == 0 for every row with tokens.
  Step prefill(const std::vector<std::vector<int64_t>>& prompts, Logits logits = Logits::Last);

  // Empties the cache for `rows` rows of up to `capacity` tokens each (capture ids unchanged):
  // no allocation when both fit the buffers allocated so far, else new buffers of that size.
  void reset(int64_t rows, int64_t capacity);
  // Times the K/V buffers were allocated (1 after construction).
  int64_t allocations() const { return allocations_; }

  // Drops row b's tokens at positions >= len (len <= length(b)); their slots are zeroed.
  void crop(int64_t row, int64_t len);
  // crop(b, lens[b]) for every row.
  void crop(const std::vector<int64_t>& lens);

  int64_t rows() const { return rows_; }
  int64_t capacity() const { return capacity_; }
  int64_t length(int64_t row) const { return len_.at(row); }
  const std::vector<int64_t>& lengths() const { return len_; }
  const std::vector<int64_t>& capture_ids() const { return capture_ids_; }
  const TargetModel& model() const { return model_; }
  // Layer l's keys / values [rows, capacity, nkv, head_dim] (tests check the zero invariant).
  const at::Tensor& keys(int64_t layer) const { return k_.at(layer); }
  const at::Tensor& values(int64_t layer) const { return v_.at(layer); }

 private:
  const TargetModel& model_;
  int64_t rows_, capacity_;
  std::vector<int64_t> capture_ids_;
  std::vector<int64_t> len_;
  std::vector<at::Tensor> k_, v_;        // views [rows_, capacity_] of the buffers
  std::vector<at::Tensor> kbuf_, vbuf_;  // [rows, capacity] as allocated
  int64_t allocations_ = 0;
  void allocate(int64_t rows, int64_t capacity);
  // linear_attention layers: their states, and what the last extend started from and ran.
  std::shared_ptr<HybridRecurrentCache> rec_;
  std::vector<int64_t> base_;
  std::vector<std::vector<int64_t>> last_;
};

// Greedy decoding of a batch of prompts on a TargetCache: up to `max_new_tokens` new tokens per
// prompt; a row stops after the first token in `stop_ids` it produces (included). Rows are
// independent: a row's output does not depend on the other prompts. Returns the new tokens.
std::vector<std::vector<int64_t>> greedy_generate(const TargetModel& model,
                                                  const std::vector<std::vector<int64_t>>& prompts,
                                                  int64_t max_new_tokens,
                                                  const std::vector<int64_t>& stop_ids);

}  // namespace dflash::model
