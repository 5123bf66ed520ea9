// CUDA kernels of the AdamW step (trainer/optim/adamw.h, DFLASH_OPTIM_FUSED=auto|1 on CUDA): the
// global gradient norm with its clip coefficient, and the update itself, each one multi-tensor
// launch over every parameter (more launches only past kMaxTensors tensors or where dtypes differ).
// They replace ATen's fused path (_foreach_copy_ of the 16-bit gradients into fp32 buffers,
// _foreach_norm, _fused_adamw_, _foreach_copy_ into the 16-bit parameters: ~44 bytes moved per
// bf16 parameter) by ~30 bytes per parameter: the norm reads the gradient (2), the update reads
// gradient, master, exp_avg, exp_avg_sq (2 + 12) and writes master, exp_avg, exp_avg_sq and the
// bf16 parameter (12 + 2).
//
// Work division: every tensor is cut into chunks of kChunk elements; one CUDA block (kThreads
// threads) per chunk. A launch passes the tensors' pointers and sizes by value (a struct of at
// most kMaxTensors entries) with the running sum of their chunk counts; a block finds its tensor
// by binary search over that sum. Inside a chunk the update's threads take 4 consecutive elements at
// a time (16-byte fp32 loads, 8-byte 16-bit loads; two such groups in flight per thread), the sum
// of squares' threads 16 bytes at a time (four in flight), when every pointer of the tensor is
// aligned to that, else one element at a time; a chunk's tail goes element by element.
//
// Plain pointers and sizes only (no LibTorch here): the tensor checks live in adamw.cpp, the one
// caller. Owns nothing. Launches are asynchronous on the given stream. Thread-safety: stateless.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "core/kernel_dtype.h"

namespace dflash::optim::kernels {

using ::dflash::kernels::DType;

inline constexpr int64_t kChunk = 65536;  // elements per CUDA block
inline constexpr int kMaxTensors = 48;    // tensors per launch (the by-value argument stays < 4 KB)

// CUDA blocks (and so partial sums) for a tensor of `numel` elements.
inline int64_t chunks(int64_t numel) { return (numel + kChunk - 1) / kChunk; }

struct GradRef {
  const void* data;  // contiguous, numel elements of dtype
  int64_t numel;
  DType dtype;
};

// Per chunk of every gradient: the sum of its elements' squares (fp32 accumulation), one float each
// in partials[0 .. sum of chunks(numel)) (grouped by dtype, then in the order of `grads`).
void grad_sumsq(const GradRef* grads, int n, float* partials, cudaStream_t stream);

// One block: total = the sum of partials[0 .. n_partials) in a fixed order (float64), then
// out[0] = norm = sqrt(total) (fp32), out[1] = clip coefficient: min(1, max_norm / (norm + 1e-6))
// in fp32 when max_norm > 0, else 1 (torch.nn.utils.clip_grad_norm_). Deterministic: no atomics.
void grad_norm_clip(const float* partials, int64_t n_partials, double max_norm, float* out, cudaStream_t stream);

struct AdamWRef {
  const void* grad;  // contiguous, numel elements of grad_dtype
  float* master;     // fp32 master weights (the parameter itself when it is fp32)
  float* exp_avg;
  float* exp_avg_sq;
  void* param;       // the 16-bit parameter the rounded master is written to; nullptr: none (fp32)
  int64_t numel;
  DType grad_dtype;
  DType param_dtype;  // of `param` (BF16 or F16); ignored when param is nullptr
};

struct AdamWHyper {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1-based, for the bias corrections 1 - beta^step
};

// torch.optim.AdamW's single-tensor update of every tensor, per element in fp32:
//   g = grad * coef;  p *= 1 - lr*wd;  m += (1-b1) * (g - m);  v = b2*v + (1-b2)*g*g;
//   p += -(lr/bc1) * (m / (sqrt(v) / sqrt(bc2) + eps));  param = round(p)
// with the scalars computed in float64 on the host and rounded to fp32 (as ATen's scalar
// arguments are), coef read from the device (nullptr: 1).
void adamw_update(const AdamWRef* t, int n, const AdamWHyper& h, const float* coef, cudaStream_t stream);

}  // namespace dflash::optim::kernels
