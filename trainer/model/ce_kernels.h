// CUDA kernels of the chunked LM head + cross-entropy (loss.cpp): the two passes over one chunk's
// float32 logits that replace ATen's gather / max / sub / exp / sum / log / mul / scatter / cast
// sequence. The logits GEMM before them and the hidden-gradient GEMM after them stay cuBLAS.
// Plain pointers and sizes only (no LibTorch here): the tensor checks live in loss.cpp, the one
// caller.
//
// Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "trainer/model/target_kernels.h"  // DType

namespace dflash::model::kernels {

// Per row r < n of logits [n, V] (`logits_dtype`: float32, or bf16/fp16 when the LM head's GEMM
// writes its own dtype; row stride ld elements, contiguous along V), in one read of the row (one
// thread block per row), in float32:
//   lse[r]     = m + log Σ_j exp(l[r, j] - m),  m = max_j l[r, j]
//   wce[r]     = (lse[r] - l[r, labels[r]]) * coef[r]           (the row's weighted CE)
//   correct[r] = (argmax_j l[r, j] == labels[r])
// The argmax is the smallest index of the maximum (as torch.max). A NaN logit makes the row's lse
// and wce NaN (the argmax skips it); a label outside [0, V) gives wce NaN and correct false.
// labels int64, coef, lse, wce float32, correct bool: [n] each, on the device. 1 <= V <= 2^27.
void ce_stats(const void* logits, DType logits_dtype, int64_t n, int64_t V, int64_t ld, const int64_t* labels,
              const float* coef, float* lse, float* wce, bool* correct, cudaStream_t stream);

// The gradient of Σ_r coef[r] * CE_r with respect to the logits, in `dtype`:
//   g[r, j] = (exp(l[r, j] - lse[r]) - (j == labels[r])) * coef[r]
// computed in float32 and rounded once (round to nearest even). logits as for ce_stats, lse from
// it (or saved from the forward); g [n, V] contiguous. 1 <= V <= 2^27.
void ce_grad(const void* logits, DType logits_dtype, int64_t n, int64_t V, int64_t ld, const int64_t* labels,
             const float* lse, const float* coef, void* g, DType dtype, cudaStream_t stream);

}  // namespace dflash::model::kernels
