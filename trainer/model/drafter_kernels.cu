// CUDA kernels of the drafter's training step (see drafter_kernels.h).
#include "trainer/model/drafter_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/launch_check.h"
#include "core/kernel_types.cuh"

namespace dflash::model::kernels {

using ::dflash::kernels::from_f;
using ::dflash::kernels::to_f;

namespace {


// V consecutive elements of T as one load/store (16 bytes for V = 8 half-width elements).
template <typename T, int V> struct alignas(sizeof(T) * V) Pack {
  T e[V];
};
template <typename T, int V> __device__ __forceinline__ Pack<T, V> load(const T* p) {
  return *reinterpret_cast<const Pack<T, V>*>(p);
}
template <typename T, int V> __device__ __forceinline__ void store(T* p, const Pack<T, V>& v) {
  *reinterpret_cast<Pack<T, V>*>(p) = v;
}

// One thread per V consecutive rotation pairs p .. p + V - 1 of one (row, head): it reads x1 =
// x[p..], x2 = x[half + p..] and cos/sin[p..] and writes both halves.
template <typename T, int V>
__global__ void rope_kernel(const T* __restrict__ x, T* y, int64_t R, int heads, int hd, const T* __restrict__ cos,
                            const T* __restrict__ sin, bool transpose) {
  const int half = hd / 2, per_head = half / V;
  const int64_t n = R * heads * per_head;
  // y may alias x (each thread reads its elements before it writes them), hence no __restrict__ on y.
  const float sgn = transpose ? -1.f : 1.f;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / (int64_t(heads) * per_head);
    const int rem = int(i % (int64_t(heads) * per_head));
    const int h = rem / per_head, p = (rem % per_head) * V;
    const T* xr = x + (row * heads + h) * hd;
    T* yr = y + (row * heads + h) * hd;
    const Pack<T, V> a = load<T, V>(xr + p), b = load<T, V>(xr + half + p);
    const Pack<T, V> c = load<T, V>(cos + row * hd + p), s = load<T, V>(sin + row * hd + p);
    Pack<T, V> o1, o2;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float x1 = to_f(a.e[k]), x2 = to_f(b.e[k]), cc = to_f(c.e[k]), ss = sgn * to_f(s.e[k]);
      // forward: [x1 c - x2 s, x2 c + x1 s]; transpose: the same with s -> -s
      o1.e[k] = from_f<T>(x1 * cc - x2 * ss);
      o2.e[k] = from_f<T>(x2 * cc + x1 * ss);
    }
    store<T, V>(yr + p, o1);
    store<T, V>(yr + half + p, o2);
  }
}

__device__ __forceinline__ float sigmoid_f(float g) { return 1.f / (1.f + expf(-g)); }

template <typename T, int V>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ out, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    const Pack<T, V> gv = load<T, V>(g + i), uv = load<T, V>(u + i);
    Pack<T, V> o;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float x = to_f(gv.e[k]);
      o.e[k] = from_f<T>(x * sigmoid_f(x) * to_f(uv.e[k]));
    }
    store<T, V>(out + i, o);
  }
}

template <typename T, int V>
__global__ void swiglu_bwd_kernel(const T* __restrict__ g, const T* __restrict__ u, const T* __restrict__ go,
                                  T* __restrict__ dg, T* __restrict__ du, int64_t n) {
  for (int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * V; i < n;
       i += int64_t(gridDim.x) * blockDim.x * V) {
    const Pack<T, V> gv = load<T, V>(g + i), uv = load<T, V>(u + i), ov = load<T, V>(go + i);
    Pack<T, V> a, b;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float x = to_f(gv.e[k]), s = sigmoid_f(x), o = to_f(ov.e[k]);
      a.e[k] = from_f<T>(o * to_f(uv.e[k]) * (s * (1.f + x * (1.f - s))));
      b.e[k] = from_f<T>(o * x * s);
    }
    store<T, V>(dg + i, a);
    store<T, V>(du + i, b);
  }
}

// ---- per-head RMSNorm + RoPE, head_dim 128 ----------------------------------------------------
// A warp per (row, head) of 128 elements: lane l holds elements 4l .. 4l+3 (one 8-byte load for
// 16-bit types); rotate-half pairs element e < 64 with e + 64, i.e. lane l with lane l ^ 16.
constexpr int kHd = 128;

template <typename T> struct alignas(4 * sizeof(T)) Quad {  // one 8-byte (16-bit T) or 16-byte access
  T e[4];
};
template <typename T> __device__ __forceinline__ void load4(const T* p, float v[4]) {
  const Quad<T> q = *reinterpret_cast<const Quad<T>*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = to_f(q.e[i]);
}
template <typename T> __device__ __forceinline__ void store4(T* p, const float v[4]) {
  Quad<T> q;
#pragma unroll
  for (int i = 0; i < 4; ++i) q.e[i] = from_f<T>(v[i]);
  *reinterpret_cast<Quad<T>*>(p) = q;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <typename T>
__global__ void head_norm_rope_fwd_kernel(const T* __restrict__ x, T* __restrict__ y, float* __restrict__ rstd_out,
                                          int64_t rows, int heads, const T* __restrict__ w, float eps,
                                          const T* __restrict__ cos, const T* __restrict__ sin) {
  const int lane = threadIdx.x % 32;
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // whole warps leave together: the shuffles below see full warps
  const int64_t pos = row / heads;
  const int e0 = lane * 4, c0 = (lane & 15) * 4;  // this lane's elements; its cos/sin columns (first half)
  float v[4], wv[4], c[4], s[4];
  load4(x + row * kHd + e0, v);
  load4(w + e0, wv);
  load4(cos + pos * kHd + c0, c);
  load4(sin + pos * kHd + c0, s);
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) ss += v[i] * v[i];
  const float r = rsqrtf(warp_sum(ss) / float(kHd) + eps);
  if (lane == 0) rstd_out[row] = r;
  float a[4], o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = v[i] * r * wv[i];
  const bool first = lane < 16;  // holds x1 (elements < 64); the partner holds x2
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float b = __shfl_xor_sync(0xffffffffu, a[i], 16);
    o[i] = first ? a[i] * c[i] - b * s[i] : a[i] * c[i] + b * s[i];  // [x1 c - x2 s, x2 c + x1 s]
  }
  store4(y + row * kHd + e0, o);
}

constexpr int kNormBwdWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kNormBwdWarps * 32)
    head_norm_rope_bwd_kernel(const T* __restrict__ x, const T* __restrict__ gy, const float* __restrict__ rstd,
                              T* __restrict__ dx, float* __restrict__ dw_partial, int64_t rows, int heads,
                              const T* __restrict__ w, const T* __restrict__ cos, const T* __restrict__ sin) {
  __shared__ float sdw[kNormBwdWarps][kHd];
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32;
  const int e0 = lane * 4, c0 = (lane & 15) * 4;
  const bool first = lane < 16;
  float wv[4], dw[4] = {0.f, 0.f, 0.f, 0.f};
  load4(w + e0, wv);
  // grid-stride over rows, a warp at a time (the loop bound is the same for all lanes of a warp)
  for (int64_t row = int64_t(blockIdx.x) * kNormBwdWarps + wid; row < rows; row += int64_t(gridDim.x) * kNormBwdWarps) {
    const int64_t pos = row / heads;
    float v[4], g[4], c[4], s[4];
    load4(x + row * kHd + e0, v);
    load4(gy + row * kHd + e0, g);
    load4(cos + pos * kHd + c0, c);
    load4(sin + pos * kHd + c0, s);
    const float r = rstd[row];
    float gn[4], n[4], dot = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // RoPE's transpose: d/da1 = g1 c + g2 s, d/da2 = g2 c - g1 s (a the normed, weighted x)
      const float p = __shfl_xor_sync(0xffffffffu, g[i], 16);
      const float ga = first ? g[i] * c[i] + p * s[i] : g[i] * c[i] - p * s[i];
      n[i] = v[i] * r;
      dw[i] += ga * n[i];
      gn[i] = ga * wv[i];
      dot += gn[i] * n[i];
    }
    dot = warp_sum(dot) / float(kHd);
    float o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = r * (gn[i] - n[i] * dot);
    store4(dx + row * kHd + e0, o);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) sdw[wid][e0 + i] = dw[i];
  __syncthreads();
  for (int col = threadIdx.x; col < kHd; col += blockDim.x) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < kNormBwdWarps; ++k) t += sdw[k][col];
    dw_partial[int64_t(blockIdx.x) * kHd + col] = t;
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A grid-stride launch over `work` items: at most 32 blocks of 256 threads per SM of an H200.
unsigned grid_for(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  return unsigned(blocks > 132 * 32 ? 132 * 32 : blocks);
}

template <typename T>
void launch_rope(const void* x, void* y, int64_t R, int heads, int hd, const void* cos, const void* sin,
                 bool transpose, cudaStream_t st) {
  constexpr int V = 16 / sizeof(T);
  const int half = hd / 2, threads = 256;
  const bool vec = half % V == 0 && aligned16(x) && aligned16(y) && aligned16(cos) && aligned16(sin) &&
                   (hd * sizeof(T)) % 16 == 0;
  const int64_t work = R * heads * (vec ? half / V : half);
  if (work == 0) return;
  auto xt = static_cast<const T*>(x);
  auto yt = static_cast<T*>(y);
  auto ct = static_cast<const T*>(cos), stab = static_cast<const T*>(sin);
  if (vec)
    rope_kernel<T, V><<<grid_for(work, threads), threads, 0, st>>>(xt, yt, R, heads, hd, ct, stab, transpose);
  else
    rope_kernel<T, 1><<<grid_for(work, threads), threads, 0, st>>>(xt, yt, R, heads, hd, ct, stab, transpose);
  DFLASH_CHECK_LAUNCH("drafter RoPE");
}

template <typename T>
void launch_swiglu(const void* g, const void* u, const void* go, void* dg, void* du, void* out, int64_t n,
                   cudaStream_t st) {
  constexpr int V = 16 / sizeof(T);
  const int threads = 256;
  bool vec = n % V == 0 && aligned16(g) && aligned16(u);
  if (go) vec = vec && aligned16(go) && aligned16(dg) && aligned16(du);
  else vec = vec && aligned16(out);
  const int64_t work = vec ? n / V : n;
  if (work == 0) return;
  auto gt = static_cast<const T*>(g), ut = static_cast<const T*>(u);
  if (go) {
    auto ot = static_cast<const T*>(go);
    auto a = static_cast<T*>(dg), b = static_cast<T*>(du);
    if (vec) swiglu_bwd_kernel<T, V><<<grid_for(work, threads), threads, 0, st>>>(gt, ut, ot, a, b, n);
    else swiglu_bwd_kernel<T, 1><<<grid_for(work, threads), threads, 0, st>>>(gt, ut, ot, a, b, n);
    DFLASH_CHECK_LAUNCH("drafter SwiGLU backward");
  } else {
    auto o = static_cast<T*>(out);
    if (vec) swiglu_fwd_kernel<T, V><<<grid_for(work, threads), threads, 0, st>>>(gt, ut, o, n);
    else swiglu_fwd_kernel<T, 1><<<grid_for(work, threads), threads, 0, st>>>(gt, ut, o, n);
    DFLASH_CHECK_LAUNCH("drafter SwiGLU");
  }
}

}  // namespace

int head_norm_rope_bwd_blocks(int64_t rows) {
  const int64_t need = (rows + kNormBwdWarps - 1) / kNormBwdWarps;
  return int(need < 132 * 8 ? (need > 0 ? need : 1) : 132 * 8);  // 8 blocks of 8 warps per SM of an H200
}

void head_norm_rope_fwd(const void* x, void* y, float* rstd, int64_t R, int heads, const void* w, float eps,
                        const void* cos, const void* sin, DType dtype, cudaStream_t stream) {
  const int64_t rows = R * heads;
  if (rows == 0) return;
  const int warps = 8;
  const unsigned blocks = unsigned((rows + warps - 1) / warps);
  switch (dtype) {
#define DFLASH_HNR_FWD(TT)                                                                                     \
  head_norm_rope_fwd_kernel<TT><<<blocks, warps * 32, 0, stream>>>(                                           \
      static_cast<const TT*>(x), static_cast<TT*>(y), rstd, rows, heads, static_cast<const TT*>(w), eps,       \
      static_cast<const TT*>(cos), static_cast<const TT*>(sin))
    case DType::BF16: DFLASH_HNR_FWD(__nv_bfloat16); break;
    case DType::F16: DFLASH_HNR_FWD(__half); break;
    case DType::F32: DFLASH_HNR_FWD(float); break;
#undef DFLASH_HNR_FWD
  }
  DFLASH_CHECK_LAUNCH("drafter q/k RMSNorm + RoPE");
}

void head_norm_rope_bwd(const void* x, const void* gy, const float* rstd, void* dx, float* dw_partial, int64_t R,
                        int heads, const void* w, const void* cos, const void* sin, DType dtype, cudaStream_t stream) {
  const int64_t rows = R * heads;
  const unsigned blocks = unsigned(head_norm_rope_bwd_blocks(rows));
  switch (dtype) {
#define DFLASH_HNR_BWD(TT)                                                                                     \
  head_norm_rope_bwd_kernel<TT><<<blocks, kNormBwdWarps * 32, 0, stream>>>(                                   \
      static_cast<const TT*>(x), static_cast<const TT*>(gy), rstd, static_cast<TT*>(dx), dw_partial, rows, heads, \
      static_cast<const TT*>(w), static_cast<const TT*>(cos), static_cast<const TT*>(sin))
    case DType::BF16: DFLASH_HNR_BWD(__nv_bfloat16); break;
    case DType::F16: DFLASH_HNR_BWD(__half); break;
    case DType::F32: DFLASH_HNR_BWD(float); break;
#undef DFLASH_HNR_BWD
  }
  DFLASH_CHECK_LAUNCH("drafter q/k RMSNorm + RoPE backward");
}

void rope(const void* x, void* y, int64_t R, int heads, int hd, const void* cos, const void* sin, bool transpose,
          DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::BF16: launch_rope<__nv_bfloat16>(x, y, R, heads, hd, cos, sin, transpose, stream); break;
    case DType::F16: launch_rope<__half>(x, y, R, heads, hd, cos, sin, transpose, stream); break;
    case DType::F32: launch_rope<float>(x, y, R, heads, hd, cos, sin, transpose, stream); break;
  }
}

void swiglu_fwd(const void* g, const void* u, void* out, int64_t n, DType dtype, cudaStream_t stream) {
  switch (dtype) {
    case DType::BF16: launch_swiglu<__nv_bfloat16>(g, u, nullptr, nullptr, nullptr, out, n, stream); break;
    case DType::F16: launch_swiglu<__half>(g, u, nullptr, nullptr, nullptr, out, n, stream); break;
    case DType::F32: launch_swiglu<float>(g, u, nullptr, nullptr, nullptr, out, n, stream); break;
  }
}

void swiglu_bwd(const void* g, const void* u, const void* go, void* dg, void* du, int64_t n, DType dtype,
                cudaStream_t stream) {
  switch (dtype) {
    case DType::BF16: launch_swiglu<__nv_bfloat16>(g, u, go, dg, du, nullptr, n, stream); break;
    case DType::F16: launch_swiglu<__half>(g, u, go, dg, du, nullptr, n, stream); break;
    case DType::F32: launch_swiglu<float>(g, u, go, dg, du, nullptr, n, stream); break;
  }
}

}  // namespace dflash::model::kernels
