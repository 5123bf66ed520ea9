// CUDA kernels of the chunked LM head + cross-entropy (see ce_kernels.h).
#include "trainer/model/ce_kernels.h"

#include <cfloat>
#include <climits>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math_constants.h>

#include "core/launch_check.h"
#include "core/kernel_types.cuh"

namespace dflash::model::kernels {

using ::dflash::kernels::from_f;
using ::dflash::kernels::to_f;

namespace {

// Four consecutive logits as floats (p aligned to 4 elements).
template <typename TL>
__device__ __forceinline__ float4 load4(const TL* p) {
  if constexpr (sizeof(TL) == 4) {
    return *reinterpret_cast<const float4*>(p);
  } else {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    const TL* e = reinterpret_cast<const TL*>(&u);
    return make_float4(to_f(e[0]), to_f(e[1]), to_f(e[2]), to_f(e[3]));
  }
}

// ---- ce_stats ---------------------------------------------------------------------------------
// One block of kStatsThreads per row. When the row starts 16-byte aligned, thread t reads float4
// t, t + 256, ... (coalesced 16-byte loads, four in flight per thread), then the V % 4 tail
// elements; otherwise elements t, t + 256, ... one by one. Each thread keeps an online
// (max m, Σ exp(x - m), argmax); a larger value rescales the sum by exp(m_old - m_new). Every
// thread visits its indices in increasing order and moves its argmax only on a strictly larger
// value, so it holds its first maximum; the merges prefer the smaller index on equal values, so
// the block's argmax is the row's smallest index of the maximum.
constexpr int kStatsThreads = 256;
constexpr int kStatsWarps = kStatsThreads / 32;

struct Online {
  float m = -FLT_MAX;  // a finite start: exp(x - m) never sees inf - inf for finite or -inf x
  float s = 0.f;       // Σ exp(x - m) over the elements seen
  int i = INT_MAX;     // argmax; INT_MAX: none seen (loses every tie)
};

__device__ __forceinline__ void visit1(Online& o, float x, int j) {
  if (x > o.m) {  // false for NaN: the argmax skips it, the sum below turns NaN
    o.s *= expf(o.m - x);
    o.m = x;
    o.i = j;
  }
  o.s += expf(x - o.m);
}

// Elements j .. j + 3: their maximum first, so that the sum is rescaled at most once.
__device__ __forceinline__ void visit4(Online& o, const float4 v, int j) {
  float lm = o.m;
  int li = o.i;
  if (v.x > lm) lm = v.x, li = j;
  if (v.y > lm) lm = v.y, li = j + 1;
  if (v.z > lm) lm = v.z, li = j + 2;
  if (v.w > lm) lm = v.w, li = j + 3;
  if (lm > o.m) {
    o.s *= expf(o.m - lm);
    o.m = lm;
    o.i = li;
  }
  o.s += (expf(v.x - o.m) + expf(v.y - o.m)) + (expf(v.z - o.m) + expf(v.w - o.m));
}

// a <- a combined with the partial (m, s, i): the sums rescaled to the common maximum.
__device__ __forceinline__ void merge(Online& a, float m, float s, int i) {
  const float mm = fmaxf(a.m, m);
  a.s = a.s * expf(a.m - mm) + s * expf(m - mm);
  if (m > a.m || (m == a.m && i < a.i)) a.i = i;
  a.m = mm;
}

// Butterfly over the warp: every lane ends with the warp's combined partial.
__device__ __forceinline__ void warp_merge(Online& o) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m = __shfl_xor_sync(0xffffffffu, o.m, off);
    const float s = __shfl_xor_sync(0xffffffffu, o.s, off);
    const int i = __shfl_xor_sync(0xffffffffu, o.i, off);
    merge(o, m, s, i);
  }
}

template <typename TL>
__global__ void __launch_bounds__(kStatsThreads)
    ce_stats_kernel(const TL* __restrict__ logits, int V, int64_t ld, const int64_t* __restrict__ labels,
                    const float* __restrict__ coef, float* __restrict__ lse, float* __restrict__ wce,
                    bool* __restrict__ correct) {
  const int64_t r = blockIdx.x;
  const TL* row = logits + r * ld;
  const int t = threadIdx.x;
  Online o;
  int j0 = 0;  // first element of the scalar loop
  if ((reinterpret_cast<uintptr_t>(row) & (4 * sizeof(TL) - 1)) == 0) {
    const int nv = V / 4;
    int k = t;
    for (; k + 3 * kStatsThreads < nv; k += 4 * kStatsThreads) {
      const float4 a = load4(row + 4 * k), b = load4(row + 4 * (k + kStatsThreads)),
                   c = load4(row + 4 * (k + 2 * kStatsThreads)), d = load4(row + 4 * (k + 3 * kStatsThreads));
      visit4(o, a, 4 * k);
      visit4(o, b, 4 * (k + kStatsThreads));
      visit4(o, c, 4 * (k + 2 * kStatsThreads));
      visit4(o, d, 4 * (k + 3 * kStatsThreads));
    }
    for (; k < nv; k += kStatsThreads) visit4(o, load4(row + 4 * k), 4 * k);
    j0 = 4 * nv;
  }
  for (int j = j0 + t; j < V; j += kStatsThreads) visit1(o, to_f(row[j]), j);

  warp_merge(o);
  __shared__ float sh_m[kStatsWarps], sh_s[kStatsWarps];
  __shared__ int sh_i[kStatsWarps];
  const int warp = t / 32, lane = t % 32;
  if (lane == 0) sh_m[warp] = o.m, sh_s[warp] = o.s, sh_i[warp] = o.i;
  __syncthreads();
  if (warp != 0) return;
  Online b;  // lanes >= kStatsWarps stay empty partials
  if (lane < kStatsWarps) b.m = sh_m[lane], b.s = sh_s[lane], b.i = sh_i[lane];
  warp_merge(b);
  if (lane != 0) return;
  const float L = b.m + logf(b.s);
  lse[r] = L;
  const int64_t lab = labels[r];
  const bool in_range = lab >= 0 && lab < V;
  wce[r] = in_range ? (L - to_f(row[lab])) * coef[r] : CUDART_NAN_F;
  correct[r] = in_range && int64_t(b.i) == lab;
}

// ---- ce_grad ----------------------------------------------------------------------------------
// Grid (row, tile of kGradTile columns), kGradThreads per block. When the input row starts
// 16-byte aligned and the output row 4-element aligned, thread t reads float4 t, t + 256, ... of
// its tile (all four loads issued before the first store) and writes 4 elements at once (8 bytes
// of bf16/fp16, 16 of float32), then the tile's V % 4 tail (last tile only); otherwise element by
// element. Tiles start at multiples of 4096 columns, so they keep the row's alignment.
constexpr int kGradThreads = 256;
constexpr int kGradVecs = 4;  // float4 per thread per tile
constexpr int kGradTile = kGradThreads * kGradVecs * 4;

__device__ __forceinline__ float grad1(float x, int j, float L, int label, float c) {
  return (expf(x - L) - (j == label ? 1.f : 0.f)) * c;
}

template <typename T>
__device__ __forceinline__ void store4(T* p, float a, float b, float c, float d) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
  } else {
    uint2 u;
    T* e = reinterpret_cast<T*>(&u);
    e[0] = from_f<T>(a);
    e[1] = from_f<T>(b);
    e[2] = from_f<T>(c);
    e[3] = from_f<T>(d);
    *reinterpret_cast<uint2*>(p) = u;
  }
}

template <typename TL, typename T>
__global__ void __launch_bounds__(kGradThreads)
    ce_grad_kernel(const TL* __restrict__ logits, int V, int64_t ld, const int64_t* __restrict__ labels,
                   const float* __restrict__ lse, const float* __restrict__ coef, T* __restrict__ g) {
  const int64_t r = blockIdx.x;
  const int c0 = int(blockIdx.y) * kGradTile, c1 = min(c0 + kGradTile, V);
  const TL* row = logits + r * ld;
  T* out = g + r * int64_t(V);
  const float L = lse[r], c = coef[r];
  const int64_t lab = labels[r];
  const int label = lab >= 0 && lab < V ? int(lab) : -1;  // -1: no column gets the one-hot
  const int t = threadIdx.x;
  int j0 = c0;  // first element of the scalar loop
  const uintptr_t misaligned =
      (reinterpret_cast<uintptr_t>(row) & (4 * sizeof(TL) - 1)) | (reinterpret_cast<uintptr_t>(out) & (4 * sizeof(T) - 1));
  if (misaligned == 0) {
    const int nv = (c1 - c0) / 4;
    float4 x[kGradVecs];
#pragma unroll
    for (int u = 0; u < kGradVecs; ++u) {
      const int k = t + u * kGradThreads;
      x[u] = k < nv ? load4(row + c0 + 4 * k) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < kGradVecs; ++u) {
      const int k = t + u * kGradThreads;
      if (k < nv) {
        const int j = c0 + 4 * k;
        store4(out + j, grad1(x[u].x, j, L, label, c), grad1(x[u].y, j + 1, L, label, c),
               grad1(x[u].z, j + 2, L, label, c), grad1(x[u].w, j + 3, L, label, c));
      }
    }
    j0 = c0 + 4 * nv;
  }
  for (int j = j0 + t; j < c1; j += kGradThreads) out[j] = from_f<T>(grad1(to_f(row[j]), j, L, label, c));
}

template <typename TL, typename T>
void launch_grad(const void* logits, int64_t n, int64_t V, int64_t ld, const int64_t* labels, const float* lse,
                 const float* coef, void* g, cudaStream_t st) {
  const dim3 grid(unsigned(n), unsigned((V + kGradTile - 1) / kGradTile));
  ce_grad_kernel<TL, T><<<grid, kGradThreads, 0, st>>>(static_cast<const TL*>(logits), int(V), ld, labels, lse, coef,
                                                       static_cast<T*>(g));
}

template <typename TL>
void launch_grad_out(const void* logits, int64_t n, int64_t V, int64_t ld, const int64_t* labels, const float* lse,
                     const float* coef, void* g, DType dtype, cudaStream_t st) {
  switch (dtype) {
    case DType::BF16: launch_grad<TL, __nv_bfloat16>(logits, n, V, ld, labels, lse, coef, g, st); break;
    case DType::F16: launch_grad<TL, __half>(logits, n, V, ld, labels, lse, coef, g, st); break;
    case DType::F32: launch_grad<TL, float>(logits, n, V, ld, labels, lse, coef, g, st); break;
  }
}

}  // namespace

void ce_stats(const void* logits, DType logits_dtype, int64_t n, int64_t V, int64_t ld, const int64_t* labels,
              const float* coef, float* lse, float* wce, bool* correct, cudaStream_t stream) {
  if (n <= 0) return;
  switch (logits_dtype) {
    case DType::F32:
      ce_stats_kernel<<<unsigned(n), kStatsThreads, 0, stream>>>(static_cast<const float*>(logits), int(V), ld, labels,
                                                                 coef, lse, wce, correct);
      break;
    case DType::BF16:
      ce_stats_kernel<<<unsigned(n), kStatsThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(logits), int(V),
                                                                 ld, labels, coef, lse, wce, correct);
      break;
    case DType::F16:
      ce_stats_kernel<<<unsigned(n), kStatsThreads, 0, stream>>>(static_cast<const __half*>(logits), int(V), ld,
                                                                 labels, coef, lse, wce, correct);
      break;
  }
  DFLASH_CHECK_LAUNCH("CE row statistics");
}

void ce_grad(const void* logits, DType logits_dtype, int64_t n, int64_t V, int64_t ld, const int64_t* labels,
             const float* lse, const float* coef, void* g, DType dtype, cudaStream_t stream) {
  if (n <= 0) return;
  switch (logits_dtype) {
    case DType::F32: launch_grad_out<float>(logits, n, V, ld, labels, lse, coef, g, dtype, stream); break;
    case DType::BF16: launch_grad_out<__nv_bfloat16>(logits, n, V, ld, labels, lse, coef, g, dtype, stream); break;
    case DType::F16: launch_grad_out<__half>(logits, n, V, ld, labels, lse, coef, g, dtype, stream); break;
  }
  DFLASH_CHECK_LAUNCH("CE logit gradient");
}

}  // namespace dflash::model::kernels
