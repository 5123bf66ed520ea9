// DFlash attention: the public entry point of attention/ (LibTorch tensors in, tensors out).
//
// Owns: the description of the DFlash mask (DFLASH.md §2.3) for a batch of rows, and the choice
// between the reference path (LibTorch SDPA with one additive mask built once per step and
// shared by all layers) and the block-sparse CUDA kernel. Knows nothing of comm/ or configs.
//
// Layout, per row b of a batch of B rows:
//   Q  [B, Hq,  N*bs, d]          N blocks of bs queries, block j = rows [j*bs, (j+1)*bs)
//   K,V[B, Hkv, C + N*bs, d]      keys [0, C) are context, keys C + j*bs + i belong to block j
// A query of block j sees context keys c with ctx_begin[b,j] <= c < ctx_end[b,j] (ctx_end is
// the anchor: STRICT), and every key of its own block; nothing else. A block with keep=false
// sees nothing and its rows yield zeros (never NaN). Blocks should be sorted by (ctx_begin,
// ctx_end) for the kernel's tile skipping; the reference path accepts any order.
// Hq must be a multiple of Hkv (GQA). C may include padding keys that no block sees.
// Thread-safety: functions are reentrant; a Prepared mask is immutable once built.
#pragma once

#include <ATen/core/Tensor.h>

namespace dflash::attention {

struct MaskSpec {
  at::Tensor ctx_begin;  // [B, N] int64: first visible context key of each block (its document start)
  at::Tensor ctx_end;    // [B, N] int64: one past the last visible context key (the anchor)
  at::Tensor keep;       // [B, N] bool
  int64_t ctx_len = 0;   // C
  int64_t block_size = 0;
};

enum class Backend { Reference, Kernel };

// Everything built once per step and shared by all layers.
struct Prepared {
  MaskSpec spec;
  Backend backend = Backend::Reference;
  at::Tensor dense_mask;  // reference path: additive [B*ng, 1, G*bs, KV_pad] in the query dtype
                          // (ng groups of G blocks per row, attention/reference.h; ng = 1: [B, 1, N*bs, KV_pad])
  int64_t kv_len = 0;     // C + N*bs
  int64_t kv_pad = 0;     // reference path: keys per SDPA entry (C + G*bs) rounded up to a multiple of 128 (masked keys)
  at::Tensor kernel_meta; // kernel path: tile lists (attention/kernel.h)
};

// Validates the spec (shapes, ranges, dtypes) with messages naming the field.
Prepared prepare(const MaskSpec& spec, Backend backend, at::ScalarType dtype, at::Device device);

// out [B, Hq, N*bs, d]; differentiable in q, k, v (autograd). scale = d^-0.5.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Prepared& p);

// The dense boolean mask [B, N*bs, C + N*bs] of the spec (true = visible). For tests and the
// reference path.
at::Tensor dense_bool_mask(const MaskSpec& spec);

// True when the CUDA kernel was built into this binary.
bool kernel_available();

// Whether the kernel's fused backward (one pass for dQ, dK, dV; attention/kernel/bwd_fused_sm90.cu)
// runs for head dim d on this process's current CUDA device: an sm_90 GPU, the sm_90a code built in,
// d = 128. False without CUDA.
bool fused_backward_available(int64_t d);
// The kernel's backward in this process from now on: false (the default) = the split backward (a dQ
// pass and a dK/dV pass); true = the fused one where fused_backward_available (dK and dV bit-identical
// to the split's, dQ summed in int32 fixed point: the same bits in every run, kernel/bwd_fused_sm90.cu;
// DFLASH_ATTN_FUSED_DET=0: by fp32 adds in a run-dependent order). Set once by the
// drafter from drafter.attention_backward (trainer/roles/attention_choice.h); the benchmark knob
// DFLASH_ATTN_DKV_VARIANT, when set, overrides it. A no-op without CUDA.
void set_fused_backward(bool on);

}  // namespace dflash::attention
