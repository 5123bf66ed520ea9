// CUDA kernels of the target model's forward: per-head q/k RMSNorm + RoPE in place on the fused
// qkv GEMM output, and SiLU gating. Plain pointers and sizes only (no LibTorch here): the
// tensor checks live in target_ops.cpp, the one caller.
//
// Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace dflash::model::kernels {

enum class DType { BF16, F16, F32 };

// qkv: [T, ld] rows; heads 0..nq-1 are q, nq..nq+nkv-1 are k (each hd wide, contiguous from
// column 0). For every q/k head of every token: optional RMSNorm over hd (weights q_norm /
// k_norm, nullptr = none), then rotate-half RoPE with cos/sin [T, hd/2] float32. In place.
// Arithmetic in float32. hd must be even and <= 256.
void qk_norm_rope(void* qkv, int64_t T, int64_t ld, int nq, int nkv, int hd, const void* q_norm,
                  const void* k_norm, float eps, const float* cos, const float* sin, DType dtype,
                  cudaStream_t stream);

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu [T, 2I] contiguous, out [T, I] contiguous.
void silu_mul(const void* gu, void* out, int64_t T, int64_t I, DType dtype, cudaStream_t stream);

}  // namespace dflash::model::kernels
