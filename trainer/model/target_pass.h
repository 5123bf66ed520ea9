// One pass of a target model over a set of tokens, as TargetModel (target.cpp: dense families)
// and HybridTarget (target_qwen35.cpp: qwen3_moe, qwen3_5) both run it: the input checks, the
// tokens with their RoPE tables and (packed mode) document offsets, the capture buffer, and the
// attention of one layer (the caller's, e.g. a KV cache, or causal inside each packed document).
//
// Owns: the pass's tensors. Thread-safety: one pass, one thread.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/target.h"

namespace dflash::model {

// `ids` a non-empty 1-D int64 tensor of ids in [0, vocab); else a user error.
void check_target_ids(const at::Tensor& ids, int64_t vocab);
// Capture layer ids strictly increasing and each in [0, loaded); else a user error.
void check_capture_layer_ids(const std::vector<int64_t>& ids, int64_t loaded);
// Host copy of cu_seqlens [n_docs + 1] (int32/int64, 0 .. T, strictly increasing); else a user error.
std::vector<int64_t> check_cu_seqlens(const at::Tensor& cu_seqlens, int64_t T);

struct TargetPass {
  at::Tensor ids;        // [T] int64 on device
  at::Tensor cos, sin;   // [T, rotary dims / 2] float32 on device
  int64_t run_layers = 0;
  std::vector<int64_t> capture_ids;
  at::Tensor captured;   // [T, K * H]
  size_t next_capture = 0;  // the capture_ids entry after_layer fills next
  // packed mode
  std::vector<int64_t> cu;  // host copy
  at::Tensor cu_dev;        // int32 on device
  int64_t max_len = 0;      // the longest document
  mutable at::Tensor kernel_meta;  // the attention kernel's tile metadata of cu, built by the first layer
  const TargetModel::Attention* attend = nullptr;  // set: every layer's attention (forward_with)

  // Packed mode: documents given by cu_seqlens (checked here; the ids are not).
  void pack(const at::Tensor& ids_in, const at::Tensor& cu_seqlens, const at::Tensor& inv_freq,
            at::Device device);
  // Tokens at `positions` (RoPE), attended by `attention` (forward_with).
  void at_positions(const at::Tensor& ids_in, const at::Tensor& positions, const at::Tensor& inv_freq,
                    at::Device device, const TargetModel::Attention& attention);
  // Captures the outputs of `layer_ids` (none: nothing) into a new [T, K * H] tensor, returned.
  at::Tensor capture_into(const std::vector<int64_t>& layer_ids, int64_t hidden, const at::TensorOptions& opt);
  // After layer l: x [T, H] (the residual stream) into `captured` when l is a capture layer.
  void after_layer(int64_t l, const at::Tensor& x);
  // Layer l's attention: q [T, nq, hd], k/v [T, nkv, hd] -> [T, nq, hd].
  at::Tensor attention(int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const;
};

}  // namespace dflash::model
