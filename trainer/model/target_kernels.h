// CUDA kernels of the target model's forward: per-head q/k RMSNorm + RoPE in place on the fused
// qkv GEMM output, SiLU gating, and the Gated DeltaNet's data movement around its rule and the rule itself in its recurrent form. Plain pointers and sizes only (no LibTorch here): the
// tensor checks live in target_ops.cpp, the one caller.
//
// Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/kernel_dtype.h"

namespace dflash::model::kernels {

using ::dflash::kernels::DType;

// qkv: [T, ld] rows; heads 0..nq-1 are q, nq..nq+nkv-1 are k (each hd wide, contiguous from
// column 0). For every q/k head of every token: optional RMSNorm over hd (weights q_norm /
// k_norm, nullptr = none), then rotate-half RoPE with cos/sin [T, hd/2] float32. In place.
// Arithmetic in float32. hd must be even and <= 256.
void qk_norm_rope(void* qkv, int64_t T, int64_t ld, int nq, int nkv, int hd, const void* q_norm,
                  const void* k_norm, float eps, const float* cos, const float* sin, DType dtype,
                  cudaStream_t stream);

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I] contiguous, out [T, I] contiguous.
void silu_mul(const void* gu, void* out, int64_t T, int64_t I, DType dtype, cudaStream_t stream);

// Gated DeltaNet (target_deltanet.cpp): the data movement around the chunked rule, fused.
// conv [D, Cd, Lmax] (the causal conv's output before SiLU, contiguous, channels q | k | v as in
// DeltaNetSpec) -> SiLU (rounded to `dtype`, as at::silu), q and k L2-normalised per head
// (x * rsqrt(sum x^2 + 1e-6)), q also times `scale`, key head j expanded to value heads
// j * nv / nk ..., v as is: float32 in the heads-first padded grid q, k [D, nv, Lp, dk],
// v [D, nv, Lp, dv]; positions p >= lens[d] (lens on the device) are written as zeros.
// dk, dv <= 256; nv a multiple of nk.
void deltanet_qkv_grid(const void* conv, int64_t D, int64_t Cd, int64_t Lmax, int64_t Lp, const int64_t* lens,
                       int nk, int nv, int dk, int dv, float scale, float* q, float* k, float* v, DType dtype,
                       cudaStream_t stream);

// The gated RMSNorm of every token t and value head h, read from the grid slot dest[t] =
// d * Lmax + p of o_grid [D, nv, Lp, dv] (float32): o = round(o_grid[d, h, p, :]) to `dtype`,
// n = round(o * rsqrt(mean(o^2) + eps)), y[t, h * dv + c] = round(round(w[c] * n[c]) * silu(z[t, h * dv + c]))
// (z rows of stride ldz; w [dv]; z, w, y in `dtype`; y [T, nv * dv] contiguous). dv <= 256.
void deltanet_gated_out(const float* o_grid, const int64_t* dest, int64_t T, int nv, int dv, int64_t Lp,
                        int64_t Lmax, const void* z, int64_t ldz, const void* w, float eps, void* y, DType dtype,
                        cudaStream_t stream);

// The gated delta rule token by token (target_deltanet.h gated_delta_rule_recurrent), per
// document d and value head h from the state initial[d, h] (nullptr: zeros):
//     S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// q, k [D, nv, Lp, dk], v and o [D, nv, Lp, dv], g, beta [D, nv, Lp], states [D, nv, dk, dv], all
// float32 contiguous; document d runs positions 0 .. lens[d] - 1 (lens on the device, <= Lp), o
// is written as zeros past them; final_state nullptr: not written. One thread block per
// (32-column slice of dv, head, document) holds that slice of S in registers. dk <= 256.
void deltanet_recurrent(const float* q, const float* k, const float* v, const float* g, const float* beta,
                        const int64_t* lens, int64_t D, int nv, int64_t Lp, int dk, int dv, const float* initial,
                        float* o, float* final_state, cudaStream_t stream);

}  // namespace dflash::model::kernels
