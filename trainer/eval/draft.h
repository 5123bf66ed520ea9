// The draft side of DFlash speculative decoding (DFLASH.md §6 step 2): what proposes the block's
// bs - 1 tokens. `DraftProposer` is the interface the decoding loop (speculative.h) drives;
// `DFlashProposer` is the real one: a DFlash drafter with its own KV cache that holds ONLY
// context K/V, never block K/V.
//
// DFlashProposer, per step and active row b (cache length = start_b = the position of the
// block's first token):
//   add_context: the new target features of positions [len_b, len_b + n) go through
//     fc -> hidden_norm -> each layer's k_proj (+ k_norm, RoPE at their positions) / v_proj and
//     are written into the draft cache (zero-initialised; slots past a row's length stay zero:
//     the invariant of model/target_cache.h).
//   propose: one non-causal forward over [last token, MASK x (bs - 1)] at positions
//     start_b .. start_b + bs - 1; every layer's keys/values = [cached context ; the block's own
//     k/v], the context masked by per-row length; the block's k/v are computed, used and dropped
//     (never written), so after a step the cache holds exactly the context (the "crop back to
//     start" of the reference loop is structural). norm, then the TARGET's lm_head on offsets
//     1 .. bs - 1, argmax.
//
// Owns: the draft cache [rows, capacity, nkv, head_dim] per draft layer (the drafter's weights
// are referenced, not copied: copying new values into the drafter's parameters is seen by the
// next propose). reset() keeps the buffers when the new rows x capacity fit them (zeroing the
// part in use), so repeated evaluations allocate once (allocations()).
// Lifetime: the Drafter and the TargetModel (embedding, lm_head) must outlive the proposer.
// Thread-safety: none; one thread drives it.
#pragma once

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/drafter.h"
#include "trainer/model/target.h"

namespace dflash::eval {

class DraftProposer {
 public:
  virtual ~DraftProposer() = default;
  // A new batch of `rows` rows of up to `capacity` positions each (all rows empty).
  virtual void reset(int64_t rows, int64_t capacity) = 0;
  // New context of row b: the target's captured features rows [offsets[b], offsets[b + 1]) of
  // `features` [T, K * H], for the row's next positions (offsets.size() == rows + 1).
  virtual void add_context(const at::Tensor& features, const std::vector<int64_t>& offsets) = 0;
  // For each row in `rows`: the block's first token `last[j]` sits at position `start[j]` (the
  // row's context holds positions < start[j]); returns bs - 1 proposed tokens per row.
  virtual std::vector<std::vector<int64_t>> propose(const std::vector<int64_t>& rows,
                                                    const std::vector<int64_t>& last,
                                                    const std::vector<int64_t>& start, int64_t bs) = 0;
  // The capture ids the proposer needs from the target (empty: no features).
  virtual std::vector<int64_t> capture_ids() const = 0;
  // Largest block size it can propose for.
  virtual int64_t max_block_size() const = 0;
};

class DFlashProposer : public DraftProposer {
 public:
  // `drafter` must already be on `target`'s device in its dtype (DrafterSpec::check_fits done).
  DFlashProposer(const model::Drafter& drafter, const model::TargetModel& target);

  void reset(int64_t rows, int64_t capacity) override;
  void add_context(const at::Tensor& features, const std::vector<int64_t>& offsets) override;
  std::vector<std::vector<int64_t>> propose(const std::vector<int64_t>& rows, const std::vector<int64_t>& last,
                                            const std::vector<int64_t>& start, int64_t bs) override;
  std::vector<int64_t> capture_ids() const override { return drafter_.spec().target_layer_ids; }
  int64_t max_block_size() const override { return drafter_.spec().block_size; }

  // Fixed-shape forms for a decoder that keeps its lengths on the device (speculative_fixed.h);
  // they neither read nor change the host lengths() (the caller tracks the context length).
  // add_context_rows: features [rows, n, K * H] of positions start[b] .. start[b] + n - 1 of
  // every row (start [rows] int64 on the device; start + n <= capacity) into the draft cache.
  void add_context_rows(const at::Tensor& features, const at::Tensor& start);
  // propose_rows: for every row the block [last[b], MASK x (bs - 1)] at positions start[b] ..,
  // attending context slots [0, start[b]) (window: a host bound >= every start, <= capacity)
  // -> the proposed tokens [rows, bs - 1] int64 on the device. No host reads.
  at::Tensor propose_rows(const at::Tensor& last, const at::Tensor& start, int64_t window, int64_t bs);

  // Inspection (tests): context positions held per row, and layer l's cached keys/values
  // [rows, capacity, nkv, head_dim] (RoPE applied to keys).
  const std::vector<int64_t>& lengths() const { return len_; }
  const at::Tensor& keys(int64_t layer) const { return k_.at(layer); }
  const at::Tensor& values(int64_t layer) const { return v_.at(layer); }
  // Times reset() allocated new cache buffers.
  int64_t allocations() const { return allocations_; }

 private:
  struct Layer {
    at::Tensor in_norm, post_norm, q, k, v, o, q_norm, k_norm, gate, up, down;
  };
  // Context K/V of features [T, K * H] at positions pos [T] into rows row_of [T] (device).
  void write_context(const at::Tensor& features, const at::Tensor& row_of, const at::Tensor& pos);
  // The block forward: ids, pos [A, bs] (device), mask [A, 1, g * bs, ctx + bs], context K/V of
  // layer l [A, ctx, nkv, d] from `context(l)` -> argmax tokens of offsets 1 .. bs - 1 [A, bs - 1].
  at::Tensor block_tokens(const at::Tensor& ids, const at::Tensor& pos, const at::Tensor& mask,
                          const std::function<std::pair<at::Tensor, at::Tensor>(size_t)>& context);
  // The block [last[j], MASK x (bs - 1)] at positions start[j] .. of each row j (device tensors
  // [A]) attending context slots [0, start[j]) of `ctx` and the whole block -> block_tokens.
  at::Tensor propose_block(const at::Tensor& last, const at::Tensor& start, int64_t ctx, int64_t bs,
                           const std::function<std::pair<at::Tensor, at::Tensor>(size_t)>& context);
  const model::Drafter& drafter_;
  const model::TargetModel& target_;
  at::Tensor fc_, hidden_norm_, norm_, inv_freq_;
  std::vector<Layer> layers_;
  std::vector<int64_t> len_;
  int64_t capacity_ = 0;
  std::vector<at::Tensor> k_, v_;        // views [rows, capacity] of the buffers
  std::vector<at::Tensor> kbuf_, vbuf_;  // as allocated
  int64_t allocations_ = 0;
};

}  // namespace dflash::eval
