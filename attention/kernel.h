// Block-sparse DFlash attention kernel: the plain parameter structs the CUDA kernels see, their
// launch functions, and (outside nvcc) the LibTorch-facing entry points the dispatcher calls.
//
// Owns: the kernel's mask metadata ("kernel_meta") and the forward/backward launches. Built only
// with CUDA (attention/kernel_cuda.cpp, attention/kernel/*.cu). Without CUDA none of these
// symbols exist: callers guard with `#if DFLASH_ATTENTION_KERNEL` (defined by attention/CMake),
// and `kernel_available()` (declared in dflash_attention.h) is defined in kernel_cuda.cpp when
// the kernel is built and must be defined `return false` by dflash_attention.cpp otherwise.
//
// Mask (DFLASH.md §2.3, dflash_attention.h): query row r of batch row b belongs to block
// j = r / bs and sees context keys [ctx_begin, min(ctx_end, C)) of that block and the keys
// [C + j*bs, C + (j+1)*bs) of its own block; a block with keep=false sees nothing (output 0,
// LSE = -inf, zero gradients). Any block order is correct; blocks sorted by (ctx_begin, ctx_end)
// make the per-tile key ranges tight (the speed of the kernel depends on it).
//
// Metadata (one int32 CUDA tensor, built on the GPU without a host sync by kernel_prepare_meta):
//   rows   [B, nqt*kTileQ, 4]  per query row: ctx_lo, ctx_hi, blk_lo, blk_hi (empty = lo == hi)
//   qtiles [B, nqt, 4]         per 64-row query tile: union key ranges ctx [lo,hi), blk [lo,hi)
//   ktiles [B, nkt, 2]         per 64-key tile: first and one-past-last query tile that sees it
// Numerics: bf16 inputs, fp32 accumulation; LSE in natural log; scale = d^-0.5.
// Kernels: on sm_90 with the sm_90a code built in (DFLASH_CUDA_ARCHS contains 90a) the three
// matmul stages use Hopper wgmma, software-pipelined so that each warpgroup's softmax / P / dS
// work overlaps its own products (kernel/fwd_sm90.cu, kernel/bwd_sm90.cu), the forward with two
// query heads per CTA sharing a TMA ring of K/V tiles (kernel/ws_sm90.cu); elsewhere mma.sync
// (kernel/fwd.cu, kernel/bwd.cu, sm_80+). The backward is deterministic: delta, a dQ pass over query
// tiles (no atomics), a dK/dV pass over key tiles (GQA groups reduced inside the CTA); or the fused pass
// (Hopper, d = 128; kernel/bwd_fused_sm90.cu), whose dQ partials are added as int32 fixed point. The
// wgmma dK/dV pass forms dS from P as rounded to bf16 (registers; see kernel/NOTES.md).
// Measurements and design notes: attention/kernel/NOTES.md.
// Thread-safety: launches are stream-ordered on the current CUDA stream; no global state but a
// launch counter (ws_launch_count).
#pragma once

#include <cstdint>

namespace dflash::attention {

constexpr int kTileQ = 64;   // query rows per tile (metadata granularity)
constexpr int kTileK = 64;   // keys per tile

// Pointers to one metadata tensor's three parts, and the sizes they were built for.
struct KernelMeta {
  const int32_t* rows = nullptr;    // [B, nqt*kTileQ, 4]
  const int32_t* qtiles = nullptr;  // [B, nqt, 4]
  const int32_t* ktiles = nullptr;  // [B, nkt, 2]
  int nqt = 0, nkt = 0;
};

// Number of int32 elements of a metadata tensor for B rows, q_len queries and kv_len keys.
inline int64_t kernel_meta_numel(int64_t B, int64_t q_len, int64_t kv_len) {
  const int64_t nqt = (q_len + kTileQ - 1) / kTileQ, nkt = (kv_len + kTileK - 1) / kTileK;
  return B * (nqt * kTileQ * 4 + nqt * 4 + nkt * 2);
}

// The forward's default rescale slack (AttnParams::rescale_slack, DFLASH_ATTN_RESCALE_SLACK).
constexpr int kRescaleSlackDefault = 8;

// Strides are in elements; the last dimension (head dim) is contiguous; row strides are
// multiples of 8 and base pointers 16-byte aligned (checked by kernel_cuda.cpp).
struct AttnParams {
  const void* q = nullptr;   // bf16 [B, Hq, q_len, d]
  const void* k = nullptr;   // bf16 [B, Hkv, kv_len, d]
  const void* v = nullptr;   // bf16 [B, Hkv, kv_len, d]
  void* o = nullptr;         // bf16 [B, Hq, q_len, d]   (forward output, backward input)
  float* lse = nullptr;      // fp32 [B, Hq, q_len] contiguous, natural log (-inf: no key)
  // backward only
  const void* dout = nullptr;  // bf16 [B, Hq, q_len, d]
  float* delta = nullptr;      // fp32 [B, Hq, q_len] contiguous: rowsum(dO * O)
  void* dq = nullptr;          // bf16 [B, Hq, q_len, d]
  void* dk = nullptr;          // bf16 [B, Hkv, kv_len, d]
  void* dv = nullptr;          // bf16 [B, Hkv, kv_len, d]
  // fp32, dq_accum_numel() elements: needed (and zeroed by the backward) only when
  // backward_accumulates_dq(d); the fused backward adds dQ into it (layout: kernel/bwd_fused_sm90.cu).
  float* dq_accum = nullptr;
  // The fused backward's fixed-point dQ (DFLASH_ATTN_FUSED_DET=1; kernel/bwd_fused_sm90.cu): a power-of-two scale
  // per query row ([B, Hq, q_len], in dq_accum after the sum) and max |K| and max ||V_k|| (two floats after those).
  // launch_attn_bwd sets them; null: the fp32 sum.
  float* dq_row_scale = nullptr;
  float* kv_max = nullptr;
  int64_t q_sb = 0, q_sh = 0, q_sr = 0;
  int64_t k_sb = 0, k_sh = 0, k_sr = 0;
  int64_t v_sb = 0, v_sh = 0, v_sr = 0;
  int64_t o_sb = 0, o_sh = 0, o_sr = 0;
  int64_t do_sb = 0, do_sh = 0, do_sr = 0;
  int64_t dq_sb = 0, dq_sh = 0, dq_sr = 0;
  int64_t dk_sb = 0, dk_sh = 0, dk_sr = 0;
  int64_t dv_sb = 0, dv_sh = 0, dv_sr = 0;
  int B = 0, Hq = 0, Hkv = 0, q_len = 0, kv_len = 0, d = 0;
  float scale = 0.f;
  // forward: how far (log2 units) a row's running maximum may lag its true maximum before O is
  // rescaled (kernel/tile_math.cuh softmax_step); 0 = rescale whenever a maximum grows.
  // launch_attn_fwd sets it from DFLASH_ATTN_RESCALE_SLACK = 0 or kRescaleSlackDefault.
  float rescale_slack = float(kRescaleSlackDefault);
  // backward (dK/dV pass and fused pass): 1 = each key tile walks its query tiles from the last one
  // down, 0 = from the first one up. Descending, the key tiles of one KV head (whose ranges share their
  // end: every anchor after a key sees it) visit the same query tiles at the same time, so their Q/dO
  // loads and dQ partials meet in L2. launch_attn_bwd sets it from DFLASH_ATTN_BWD_DESCEND (default 1).
  int bwd_descend = 1;
  KernelMeta meta;
};

// Inputs of the metadata builder. ctx_begin/ctx_end int32 [B, N], keep uint8 [B, N], on the GPU.
struct MetaParams {
  const int32_t* ctx_begin = nullptr;
  const int32_t* ctx_end = nullptr;
  const uint8_t* keep = nullptr;
  int32_t* out = nullptr;  // kernel_meta_numel(B, N*bs, C + N*bs) int32
  int B = 0, N = 0, block_size = 0, ctx_len = 0;
};

// Inputs of the causal metadata builder (packed documents, queries = keys = the T tokens):
// document offsets cu [n_docs + 1] int32 on the GPU (0 = cu[0] < cu[1] < ... < cu[n_docs] = T).
// Query row r of document j (cu[j] <= r < cu[j+1]) sees keys [cu[j], r]. A 64-row query tile's
// rows of its first document use the record's ctx range, those of later documents (a tile
// straddling a boundary) the blk range, so that the tile walks [start of its first document, its
// end) and [start of its second document, its last row] rather than one union over both.
struct CausalMetaParams {
  const int32_t* cu = nullptr;
  int32_t* out = nullptr;  // kernel_meta_numel(1, T, T) int32
  int n_docs = 0, T = 0;
};

// Launches on `stream` (a cudaStream_t). They throw std::runtime_error on a launch error.
void launch_build_meta(const MetaParams& p, void* stream);
void launch_build_causal_meta(const CausalMetaParams& p, void* stream);
// Whether the forward runs its Hopper (wgmma) kernel on the current device (sm_90 with sm_90a
// code built in); elsewhere it runs the mma.sync kernel.
bool forward_is_wgmma();
KernelMeta meta_view(const int32_t* meta, int B, int q_len, int kv_len);
void launch_attn_fwd(const AttnParams& p, void* stream);
void launch_attn_bwd(const AttnParams& p, void* stream);  // delta, then dQ, then dK/dV
// One stage of the backward (0: delta, 1: dQ, 2: dK/dV), for benchmarks. Tile variants can be
// chosen with DFLASH_ATTN_FWD_VARIANT / DFLASH_ATTN_DQ_VARIANT / DFLASH_ATTN_DKV_VARIANT
// (benchmarks only; the defaults are the measured best, see attention/kernel/NOTES.md).
void launch_attn_bwd_stage(const AttnParams& p, int stage, void* stream);
// Whether the backward at head dim d on the current device is the fused one (DFLASH_ATTN_DKV_VARIANT=7:
// dQ summed in fp32 in the dK/dV pass, AttnParams::dq_accum of dq_accum_numel() floats needed).
bool backward_accumulates_dq(int d);
// fused_backward_available and set_fused_backward (the trainer's face: dflash_attention.h) are defined
// in kernel/bwd.cu: the latter makes the fused backward (dK/dV variant 7) the default of
// dkv_variant() where DFLASH_ATTN_DKV_VARIANT is unset.
bool fused_backward_available(int64_t d);
void set_fused_backward(bool on);
int64_t dq_accum_numel(int64_t B, int64_t Hq, int64_t q_len, int64_t d);
// The tile variant named by environment variable `name` (a benchmark knob, attention/kernel/NOTES.md):
// `fallback` where it is unset or empty; anything but one of the `n` values in `allowed` is a
// UserError naming the variable, the value and the allowed ones (a typo must not silently run
// another kernel). kernel_variant.cpp; read at each launch.
int kernel_variant_from_env(const char* name, const int* allowed, int n, int fallback);
// Launches of the TMA-ring kernels (kernel/ws_sm90.cu: forward variants 7/8, dQ variants 7/8) so far
// in this process: how a test tells them from the one-warpgroup kernels they fall back to where the
// heads cannot be paired or TMA cannot describe a tensor.
int64_t ws_launch_count();
// Launches of the fused backward pass with its Q/dO loads by TMA (tests: it ran, not its cp.async fallback).
int64_t fused_tma_launch_count();
// Launches of the split backward's dK/dV pass with its Q/dO loads by TMA (bwd_sm90.cu; tests: it ran, not its
// cp.async fallback).
int64_t dkv_tma_launch_count();

}  // namespace dflash::attention

#ifndef __CUDACC__
#include <ATen/core/Tensor.h>

#include "attention/dflash_attention.h"

namespace dflash::attention {

// Builds the kernel metadata of `spec` on `device` (a CUDA device): int32 [kernel_meta_numel].
// Validates the spec's shapes (throws dflash::UserError naming the field). No host sync.
at::Tensor kernel_prepare_meta(const MaskSpec& spec, at::Device device);

// out [B, Hq, N*bs, d] bf16; differentiable in q, k, v (an autograd Function whose backward
// runs the kernel's backward). q, k, v: bf16 CUDA tensors with a contiguous last dimension,
// d in {64, 128}; p.kernel_meta from kernel_prepare_meta of p.spec.
at::Tensor kernel_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const Prepared& p);

// The forward alone, for tests and benchmarks: returns {out, lse [B, Hq, q_len] fp32}.
std::tuple<at::Tensor, at::Tensor> kernel_forward(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const Prepared& p);

// Causal attention inside each document of a packed stream (a target model's prefill), forward
// only: q [T, Hq, d], k/v [T, Hkv, d] bf16 CUDA tensors (last dimension contiguous; row and head
// strides multiples of 8 elements, e.g. views of a fused qkv projection), cu_dev int32
// [n_docs + 1] document offsets on q's device (checked by the caller: 0, strictly increasing,
// T), d in {64, 128}. `meta` caches the tile metadata across the layers of one pass: built
// from cu_dev when undefined (no host sync). Returns [T, Hq, d] contiguous.
at::Tensor kernel_causal_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_dev, double scale, at::Tensor& meta);

}  // namespace dflash::attention
#endif
