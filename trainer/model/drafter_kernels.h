// CUDA kernels of the drafter's training step: rotate-half RoPE (forward and its transpose for the
// backward), the per-head RMSNorm + RoPE of q and k (forward, backward with the weight's
// gradient), and the SwiGLU gate silu(g) * u (forward, and both input gradients in one pass).
// Each replaces a chain of ATen elementwise kernels (RoPE: two broadcast products, a negation, a
// concatenation and a sum per call; the SwiGLU backward: nine passes over [tokens, intermediate])
// by one pass that reads each input once and writes each output once, arithmetic in float32.
// Plain pointers and sizes only (no LibTorch here): the tensor checks live in drafter.cpp, the one
// caller.
//
// Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "trainer/model/target_kernels.h"  // DType

namespace dflash::model::kernels {

// x, y: [R, heads, hd] contiguous (R = batch x positions), cos/sin: [R, hd] contiguous in the same
// dtype (the two halves of a row equal, as rope_tables builds them; only the first hd/2 are read).
// transpose = false: y = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1];
// transpose = true (the backward, RoPE being linear in x): y = x * cos + [x2, -x1] * sin.
// y may alias x. hd even, <= 512.
void rope(const void* x, void* y, int64_t R, int heads, int hd, const void* cos, const void* sin, bool transpose,
          DType dtype, cudaStream_t stream);

// Per-head RMSNorm then RoPE, head_dim 128 (the drafter's q_norm/k_norm before rotate-half RoPE),
// one warp per (row, head), each lane four consecutive elements (its rotation partners are in
// lane ^ 16). x, y: [R, heads, 128] contiguous; w [128]; cos/sin [R, 128] as for rope(); every
// pointer aligned to 4 elements (the caller checks 16 bytes); rstd
// [R * heads] float32 out (saved for the backward). y = rope(w * x * rstd), rstd =
// 1/sqrt(mean(x^2) + eps), float32 inside, rounded once.
void head_norm_rope_fwd(const void* x, void* y, float* rstd, int64_t R, int heads, const void* w, float eps,
                        const void* cos, const void* sin, DType dtype, cudaStream_t stream);

// Its backward from gy: dx [R, heads, 128] (w, x, rstd as in the forward), and the weight's
// gradient as float32 partial sums dw_partial [head_norm_rope_bwd_blocks(R * heads), 128] (the
// caller sums them over dim 0).
void head_norm_rope_bwd(const void* x, const void* gy, const float* rstd, void* dx, float* dw_partial, int64_t R,
                        int heads, const void* w, const void* cos, const void* sin, DType dtype, cudaStream_t stream);
int head_norm_rope_bwd_blocks(int64_t rows);

// out = silu(g) * u over n elements (g, u, out contiguous, out may alias neither).
void swiglu_fwd(const void* g, const void* u, void* out, int64_t n, DType dtype, cudaStream_t stream);

// dg = go * u * silu'(g), du = go * silu(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
void swiglu_bwd(const void* g, const void* u, const void* go, void* dg, void* du, int64_t n, DType dtype,
                cudaStream_t stream);

}  // namespace dflash::model::kernels
