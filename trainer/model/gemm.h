// The models' large GEMMs on CUDA with a cuBLASLt algorithm chosen per shape by timing.
//
// at::mm runs the algorithm cuBLAS's heuristic ranks first; on an H200 another of the heuristic's
// candidates is up to 19% faster for some of the drafter's and the target's shapes, slower for
// others (bench/gemm_bench.cpp, bench/RESULTS.md). The first product of each shape class on a
// device times at::mm and the heuristic's candidates on the real operands (a few runs each; the
// stream is synchronised then, once), keeps the fastest, and every later product of that class
// runs it directly. A shape class is (m rounded up to a multiple of 1024, n, k, the operands'
// layouts, leading dimensions and alignments, dtypes, accumulate); a class whose kept algorithm
// does not support the actual m falls back to at::mm.
//
// Where nothing is timed: CPU tensors, other dtypes than bf16/fp16, products smaller than
// kMinTuned in any dimension, views whose strides cuBLASLt cannot take, during CUDA graph
// capture (a class tuned before capture is used), once kMaxClasses classes exist, and with
// DFLASH_GEMM_TUNE=0 (at::mm everywhere: the A/B and the oracle). All of these run at::mm.
//
// Thread-safety: the class table is shared by all threads (a mutex); products run on the
// caller's current stream. Results differ from at::mm's by the rounding order of another
// algorithm (fp32 accumulation either way).
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dflash::model::gemm {

inline constexpr const char* kGemmTuneEnv = "DFLASH_GEMM_TUNE";
inline constexpr int64_t kMinTuned = 256;   // m, n and k at least this to be tuned
inline constexpr int64_t kMaxClasses = 256;  // shape classes timed per process, at most

// c = a @ b, or c += a @ b when `accumulate`. a [m, k], b [k, n], c [m, n]; 2-D, same device;
// c of the operands' dtype.
void mm_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate = false);

// a @ b as a new tensor of the operands' dtype.
at::Tensor mm(const at::Tensor& a, const at::Tensor& b);

// x @ w^T with autograd (x [..., K], w [N, K]: at::linear without bias); the backward's two
// products (dx = dy w, dw = dy^T x) go through mm as well, each only when its input needs it.
at::Tensor linear(const at::Tensor& x, const at::Tensor& w);

// Whether timing is enabled (DFLASH_GEMM_TUNE: "auto" (default) or "1": on; "0": off), read once.
bool tuning_enabled();

// What the table holds now: classes timed, of which running a cuBLASLt algorithm (the rest
// at::mm), and the seconds spent timing.
struct TuneStats {
  int64_t classes = 0;
  int64_t lt_classes = 0;
  double seconds = 0;
};
TuneStats tune_stats();

}  // namespace dflash::model::gemm
