// CUDA kernels of the drafter's training step: rotate-half RoPE (forward and its transpose for the
// backward) and the SwiGLU gate silu(g) * u (forward, and both input gradients in one pass).
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

// out = silu(g) * u over n elements (g, u, out contiguous, out may alias neither).
void swiglu_fwd(const void* g, const void* u, void* out, int64_t n, DType dtype, cudaStream_t stream);

// dg = go * u * silu'(g), du = go * silu(g), silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
void swiglu_bwd(const void* g, const void* u, const void* go, void* dg, void* du, int64_t n, DType dtype,
                cudaStream_t stream);

}  // namespace dflash::model::kernels
