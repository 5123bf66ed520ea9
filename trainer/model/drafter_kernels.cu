// CUDA kernels of the drafter's training step (see drafter_kernels.h).
#include "trainer/model/drafter_kernels.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/launch_check.h"

namespace dflash::model::kernels {

namespace {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f(float v) { return v; }
template <> __device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f(float v) { return __float2bfloat16(v); }
template <> __device__ __forceinline__ __half from_f(float v) { return __float2half(v); }

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
