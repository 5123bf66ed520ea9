// Gated DeltaNet token mixer of the qwen3_5 targets' linear_attention layers, in LibTorch.
//
// Per layer: one fused projection x -> [qkv (conv_dim) | z (value_dim) | b (nv) | a (nv)]; a
// causal depthwise conv (kernel K, no bias; one grouped at::conv1d in the model dtype) + SiLU over qkv; q and k L2-normalised per head
// (eps 1e-6), q scaled by dk^-1/2, each k head shared by nv / nk consecutive value heads;
// beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule per value
// head with state S [dk, dv]:
//     S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// then a gated RMSNorm over dv (norm(o) * w * silu(z)) and out_proj.
//
// Packed streams: every document starts from a zero conv window and a zero state (positions
// restart, nothing leaks), or, for a cache, from the cached state of its row. The packed forward computes the rule chunkwise (chunks of 64 inside
// each document (fewer for short extends: a decode step is one chunk of one token), the
// UT-transform form: intra-chunk work as batched matmuls, the unit lower triangular system of
// the chunk inverted once by blocks (unit_lower_inverse) and applied to both right-hand sides,
// one sequential step per chunk) in float32. DFLASH_TARGET_DELTANET=trsm solves the two systems
// with at::linalg_solve_triangular instead (the oracle; cuBLAS' batched trsm is slow on these
// many small systems).
//
// Owns: nothing but the per-layer weights struct. Thread-safety: stateless functions.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model {

struct DeltaNetSpec {
  int64_t nk = 0, nv = 0, dk = 0, dv = 0, kernel = 4;
  double eps = 1e-6;  // of the gated RMSNorm
  int64_t conv_dim() const { return 2 * nk * dk + nv * dv; }
  int64_t value_dim() const { return nv * dv; }
};

struct DeltaNetWeights {
  at::Tensor w_in;     // [conv_dim + value_dim + 2 nv, H]  (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
  at::Tensor conv;     // [conv_dim, K]
  at::Tensor A_log;    // [nv] float32 (the stored value, converted)
  at::Tensor dt_bias;  // [nv] float32
  at::Tensor norm;     // [dv]
  at::Tensor w_out;    // [H, value_dim]
};

// The cache of one layer for B sequences (HybridRecurrentCache).
struct DeltaNetState {
  at::Tensor conv;  // [B, conv_dim, K - 1], model dtype: the last K - 1 conv inputs
  at::Tensor rec;   // [B, nv, dk, dv] float32
};

// x [T, H] (packed documents `cu`, host offsets) -> [T, H]. Without `state` every document
// starts from zeros. With `state`, document d continues row rows[d] of it (rows undefined:
// row d): it starts from that row's conv window and recurrent state and leaves its final ones
// there (a fresh sequence is a zeroed row).
at::Tensor deltanet_forward(const at::Tensor& x, const std::vector<int64_t>& cu, const DeltaNetWeights& w,
                            const DeltaNetSpec& s, DeltaNetState* state = nullptr,
                            const at::Tensor& rows = {});

// Environment knob: how the rule runs. "inverse" and "trsm": the chunked form above;
// "recurrent": token by token (gated_delta_rule_recurrent below: on CUDA one kernel holding the
// state in registers, no float32 intermediates in memory); "auto" (default): recurrent on CUDA
// (the Qwen3.5-9B capture forward at 8 x 2048 on an H200: 639 against 724 ms unfused, 527 against
// 600 ms with the fused kernels: bench/RESULTS.md, 2026-12-01 22:30 UTC), inverse on CPU.
// Read on first use; set_deltanet_rule overrides it (tests, benchmarks), reset_deltanet_knobs
// returns every knob here to its environment value.
constexpr const char* kDeltaNetSolveEnv = "DFLASH_TARGET_DELTANET";
enum class DeltaNetRule { Inverse, Trsm, Recurrent };
DeltaNetRule deltanet_rule(const at::Device& device);
void set_deltanet_rule(DeltaNetRule rule);
void reset_deltanet_knobs();

// DFLASH_TARGET_DELTANET_TF32=1 (or set_deltanet_tf32(true)) runs the float32 products of the
// chunked rule (intra-chunk matmuls, the inverse, the per-chunk state updates) on TF32 tensor
// cores on CUDA. Off by default: on an H200 at Qwen3.5-9B shapes with random weights it saved 4%
// of the capture forward (714 -> 685 ms at 8 x 2048) but moved the captured states by 4.6% mean
// relative (bench/RESULTS.md, 2026-12-01); target_family_bench reports both settings. No effect
// on CPU.
constexpr const char* kDeltaNetTf32Env = "DFLASH_TARGET_DELTANET_TF32";
bool deltanet_tf32();
void set_deltanet_tf32(bool on);

// Environment knob: the chunk length of the packed forward, 16, 32, 64 (default) or 128 (fewer
// sequential steps, more intra-chunk work). Read once per process.
constexpr const char* kDeltaNetChunkEnv = "DFLASH_TARGET_DELTANET_CHUNK";

// DFLASH_TARGET_DELTANET_FUSED=1 (or set_deltanet_fused(true)): two kernels (target_kernels.h:
// deltanet_qkv_grid, deltanet_gated_out; on CPU the same arithmetic in ATen, which tests the
// path's glue) replace the ATen data movement between the conv and the rule and between the rule
// and out_proj. "auto" (default): on for CUDA (tests/model/test_deltanet_gpu; 1.21x the unfused
// path with the chunked rule on an H200, bench/RESULTS.md), off on CPU; 0: off everywhere.
constexpr const char* kDeltaNetFusedEnv = "DFLASH_TARGET_DELTANET_FUSED";
bool deltanet_fused(const at::Device& device);
void set_deltanet_fused(bool on);

// Profiling hook (benchmarks: target_family_bench --profile): when set, deltanet_forward calls it
// at the start of each of its sections ("in_proj", "conv", "qkv_gates", "to_grid", the rule's
// "chunk_intra", "chunk_inverse", "chunk_loop", "chunk_out" (or "rule" for the recurrent form),
// "out": the un-grid, gated norm and out_proj) and with nullptr at its end. Process-wide; nullptr: off (the default, one relaxed load per section).
using DeltaNetSectionHook = void (*)(const char* section);
void set_deltanet_section_hook(DeltaNetSectionHook hook);

// (I + strictly_lower(t))^-1 for t [..., n, n] (its diagonal and upper part are not read), by
// recursive 2x2 blocking, all blocks of a level in one batched product; any n (padded to a power
// of two). Same dtype and shape as t.
at::Tensor unit_lower_inverse(const at::Tensor& t);

// The gated delta rule alone, chunkwise, for a batch of zero-initialised sequences of equal
// (padded) length: q, k [B, L, nv, dk] (already normalised, scaled, head-expanded), v
// [B, L, nv, dv], g, beta [B, L, nv], all float32; padded positions must have k = v = beta =
// g = 0. `initial` [B, nv, dk, dv] (undefined: zeros). Returns o [B, L, nv, dv] and the final
// state [B, nv, dk, dv].
std::pair<at::Tensor, at::Tensor> gated_delta_rule_chunked(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const at::Tensor& g,
                                                           const at::Tensor& beta, int64_t chunk = 64,
                                                           const at::Tensor& initial = {});

// The gated delta rule token by token on heads-first grids: q, k [D, nv, Lp, dk], v [D, nv, Lp,
// dv], g, beta [D, nv, Lp], float32; document d runs positions 0 .. lens[d] - 1 (lens [D] int64 on
// the same device, <= Lp) from initial[d] ([D, nv, dk, dv]; undefined: zeros). Returns o [D, nv,
// Lp, dv] (zeros past each document) and the final states [D, nv, dk, dv]. CUDA: the kernel
// target_kernels.h deltanet_recurrent (dk <= 256); CPU: the same recurrence in ATen, one position
// at a time (for tests: slow).
std::pair<at::Tensor, at::Tensor> gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& g,
                                                             const at::Tensor& beta, const at::Tensor& lens,
                                                             const at::Tensor& initial = {});

}  // namespace dflash::model
