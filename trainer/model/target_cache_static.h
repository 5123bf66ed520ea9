// A static KV cache for launch-lean decoding (batched regeneration, trainer/eval/regenerate.h):
// every tensor is allocated once, a decode step runs every row with one token at the row's
// length (read from a device tensor, never from the host) and writes its K/V in place there,
// so a step issues the same kernels on the same buffers each time and can be captured in a
// CUDA graph. TargetCache (target_cache.h) is the general cache (unequal extends, crops,
// recurrent layers); this one serves only prefill-into-empty-rows and one-token steps of dense
// targets.
//
// Rows are independent sequences of up to `capacity` tokens. lengths() [rows] int64 lives on the
// model's device; the caller advances it after a step (rows that are finished or free keep
// their length and their step's writes land past their end, where nothing reads them).
// Attention of a step covers slots [0, window) of every row, masked per row to slots <= its
// length, so the window (a host number, e.g. a bucket above the longest row) only has to bound
// the lengths; slots past a row's length may hold stale keys of an earlier sequence: finite
// values that the mask gives an exact zero weight (the cache starts as zeros, never junk).
//
// Owns: K/V per layer [rows, capacity, nkv, head_dim] in the model's dtype on its device, the
// lengths. Lifetime: references the TargetModel. Thread-safety: none; one thread drives it.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/target.h"

namespace dflash::model {

class StaticKVCache {
 public:
  // UserError for a target with linear_attention / MoE layers (use TargetCache) or no lm_head.
  StaticKVCache(const TargetModel& model, int64_t rows, int64_t capacity);

  // Prompts into rows `which` (any rows: they restart at 0): K/V of their tokens at slots
  // [0, n), lengths set to n. Packed causal attention over the prompts only. Returns the
  // logits of each prompt's last token [which.size(), vocab] float32 (on the device).
  at::Tensor prefill(const std::vector<int64_t>& which, const std::vector<std::vector<int64_t>>& prompts);
  // The same, also capturing the outputs of decoder layers `layer_ids` for every prompt token:
  // logits of each prompt's last token and captured [sum of lengths, K * H] (prompts packed in
  // order).
  TargetModel::Output prefill_capture(const std::vector<int64_t>& which,
                                      const std::vector<std::vector<int64_t>>& prompts,
                                      const std::vector<int64_t>& layer_ids);

  // One token per row (verify below with n = 1): ids [rows] int64 on the device (trusted: the
  // model's own samples), at positions lengths(); writes K/V at (b, length(b)); attends slots
  // [0, window) masked to <= length(b). Lengths are not changed. window must exceed every length
  // (the caller's bound) and be <= capacity. -> logits [rows, vocab] float32. No host reads.
  at::Tensor step(const at::Tensor& ids, int64_t window);

  // n tokens per row (a speculative verify block): ids [rows, n] int64 on the device (trusted)
  // at positions length(b) .. length(b) + n - 1; writes their K/V there; token i of row b attends
  // slots [0, window) masked to <= length(b) + i (causal within the block). Lengths are not
  // changed. window must exceed every length + n - 1 and be <= capacity. -> logits
  // [rows * n, vocab] float32 and the outputs of layers `layer_ids` [rows * n, K * H]. No host
  // reads.
  TargetModel::Output verify(const at::Tensor& ids, int64_t window, const std::vector<int64_t>& layer_ids);

  at::Tensor& lengths() { return len_; }
  int64_t rows() const { return rows_; }
  int64_t capacity() const { return capacity_; }
  const TargetModel& model() const { return model_; }

 private:
  const TargetModel& model_;
  int64_t rows_, capacity_;
  at::Tensor len_;                  // [rows] int64 on the device
  at::Tensor row_ids_;              // [rows] int64 0..rows-1 on the device
  std::vector<at::Tensor> k_, v_;   // per layer [rows, capacity, nkv, head_dim]
};

}  // namespace dflash::model
