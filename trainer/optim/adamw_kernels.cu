// CUDA kernels of the AdamW step (see adamw_kernels.h).
#include "trainer/optim/adamw_kernels.h"

#include <climits>
#include <cmath>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "core/launch_check.h"
#include "core/kernel_types.cuh"

namespace dflash::optim::kernels {

namespace {

using ::dflash::kernels::from_f;
using ::dflash::kernels::to_f;

constexpr int kThreads = 512;  // per block; a chunk is kChunk / (kThreads * kV) = 32 vector steps per thread
constexpr int kV = 4;          // elements per vector access: 16 bytes of fp32, 8 of a 16-bit type
constexpr int kIlp = 2;        // vector accesses a thread has in flight per array
static_assert(kChunk % (kThreads * kV) == 0, "a chunk is whole vector steps of a block");

template <typename T, int V> struct alignas(sizeof(T) * V) Wide {
  T e[V];
};
template <typename T> using Vec = Wide<T, kV>;

template <typename T> __device__ __forceinline__ bool aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kV) == 0;
}

// The tensors of one launch, by value. chunk_end: running sum of the tensors' chunk counts; block b
// works on tensor t = the first with chunk_end[t] > b, chunk b - chunk_end[t - 1] of it.
struct GradList {
  const void* data[kMaxTensors];
  int64_t numel[kMaxTensors];
  int chunk_end[kMaxTensors];
  int n;
};

struct UpdateList {
  const void* grad[kMaxTensors];
  float* master[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  void* param[kMaxTensors];
  int64_t numel[kMaxTensors];
  int chunk_end[kMaxTensors];
  int n;
};
static_assert(sizeof(UpdateList) < 3000, "kernel argument: keep it well inside 4 KB");

// The update's scalars, float64 on the host rounded to fp32 (as ATen passes its Scalar arguments
// to fp32 kernels).
struct Scalars {
  float decay;     // 1 - lr*wd
  float w1;        // 1 - beta1 (lerp weight)
  float w1c;       // 1 - w1 in fp32 (ATen's lerp form for weights >= 0.5)
  bool lerp_small; // |w1| < 0.5: ATen's lerp is m + w1 (g - m), else g - (g - m)(1 - w1)
  float b2;        // beta2
  float omb2;      // 1 - beta2
  float neg_step;  // -lr / (1 - beta1^t)
  float bc2_sqrt;  // sqrt(1 - beta2^t)
  float eps;
};

template <typename L> __device__ __forceinline__ int find_tensor(const L& l, int b) {
  int lo = 0, hi = l.n - 1;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (l.chunk_end[mid] > b) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

// ---- gradient sum of squares -------------------------------------------------------------------

// Sum over the block in a fixed order: warp butterflies, then warp 0 adds the warps' sums in order.
template <typename T> __device__ __forceinline__ T block_sum(T v) {
  __shared__ T warp_part[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int lane = threadIdx.x % 32, wid = threadIdx.x / 32;
  if (lane == 0) warp_part[wid] = v;
  __syncthreads();
  T s = 0;
  if (threadIdx.x == 0)
    for (int w = 0; w < int(blockDim.x / 32); ++w) s += warp_part[w];
  return s;  // valid in thread 0
}

// 16 bytes per access (8 elements of a 16-bit gradient), 4 accesses unrolled per thread: only
// loads in the loop, so they are all in flight together.
template <typename G>
__global__ void __launch_bounds__(kThreads) sumsq_kernel(const GradList l, float* __restrict__ partials) {
  constexpr int V = 16 / sizeof(G);
  using W = Wide<G, V>;
  const int b = blockIdx.x;
  const int t = find_tensor(l, b);
  const int64_t begin = int64_t(b - (t ? l.chunk_end[t - 1] : 0)) * kChunk;
  const int64_t left = l.numel[t] - begin;
  const int n = int(left < kChunk ? left : kChunk);
  const G* g = static_cast<const G*>(l.data[t]) + begin;
  float acc = 0.f;
  int done = 0;
  if (reinterpret_cast<uintptr_t>(l.data[t]) % 16 == 0) {
    const int nv = n / V;
    constexpr int U = 4;
    for (int i0 = threadIdx.x; i0 < nv; i0 += kThreads * U) {
      W x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int i = i0 + u * kThreads;
        if (i < nv) x[u] = reinterpret_cast<const W*>(g)[i];
        else
#pragma unroll
          for (int k = 0; k < V; ++k) x[u].e[k] = from_f<G>(0.f);  // zeros: add nothing
      }
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const float f = to_f(x[u].e[k]);
          acc += f * f;
        }
    }
    done = nv * V;
  }
  for (int i = done + threadIdx.x; i < n; i += kThreads) {
    const float f = to_f(g[i]);
    acc += f * f;
  }
  const float s = block_sum(acc);
  if (threadIdx.x == 0) partials[b] = s;
}

constexpr int kFinalThreads = 1024;

__global__ void __launch_bounds__(kFinalThreads)
    norm_clip_kernel(const float* __restrict__ partials, int64_t n, float max_norm, float* __restrict__ out) {
  double acc = 0;
  for (int64_t i = threadIdx.x; i < n; i += kFinalThreads) acc += double(partials[i]);
  const double total = block_sum(acc);
  if (threadIdx.x == 0) {
    const float norm = float(sqrt(total));
    // torch.nn.utils.clip_grad_norm_: clamp(max_norm / (norm + 1e-6), max=1) in fp32
    const float coef = max_norm > 0.f ? fminf(1.f, __fdiv_rn(max_norm, __fadd_rn(norm, 1e-6f))) : 1.f;
    out[0] = norm;
    out[1] = coef;
  }
}

// ---- the update --------------------------------------------------------------------------------

// One element: the ATen ops of the single-tensor update (adamw.cpp update_single), each result
// rounded to fp32 where ATen stores it; inside one op the multiply-add is an fma as in ATen's CUDA
// kernels (addcmul/addcdiv: fma(alpha, b op c, a); lerp: fma(w, end - self, self)). g is the
// clipped gradient (grad * coef, rounded). sqrt(v) / sqrt(bc2) is a true division, as on the CPU and
// in _fused_adamw_ (ATen's CUDA div by a host scalar multiplies by its reciprocal: <= 1 ulp apart).
__device__ __forceinline__ void adam(float g, float& p, float& m, float& v, const Scalars& s) {
  p = __fmul_rn(p, s.decay);                                                       // mul_(1 - lr*wd)
  m = s.lerp_small ? fmaf(s.w1, g - m, m) : fmaf(-(g - m), s.w1c, g);              // lerp_(g, 1-b1)
  v = fmaf(s.omb2, __fmul_rn(g, g), __fmul_rn(v, s.b2));                           // mul_(b2).addcmul_(g, g, 1-b2)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bc2_sqrt), s.eps);     // sqrt(v) / sqrt(bc2) + eps
  p = fmaf(s.neg_step, __fdiv_rn(m, denom), p);                                    // addcdiv_(m, denom, -lr/bc1)
}

// P = float: the master is the parameter (nothing more to write).
template <typename G, typename P>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(const UpdateList l, const Scalars s, const float* __restrict__ coef_ptr) {
  constexpr bool kParam = !std::is_same_v<P, float>;
  const int b = blockIdx.x;
  const int t = find_tensor(l, b);
  const int64_t begin = int64_t(b - (t ? l.chunk_end[t - 1] : 0)) * kChunk;
  const int64_t left = l.numel[t] - begin;
  const int n = int(left < kChunk ? left : kChunk);
  const G* __restrict__ g = static_cast<const G*>(l.grad[t]) + begin;
  float* __restrict__ pm = l.master[t] + begin;
  float* __restrict__ m1 = l.exp_avg[t] + begin;
  float* __restrict__ m2 = l.exp_avg_sq[t] + begin;
  P* __restrict__ q = kParam ? static_cast<P*>(l.param[t]) + begin : nullptr;
  const float coef = coef_ptr ? *coef_ptr : 1.f;
  int done = 0;
  if (aligned<G>(l.grad[t]) && aligned<float>(l.master[t]) && aligned<float>(l.exp_avg[t]) &&
      aligned<float>(l.exp_avg_sq[t]) && (!kParam || aligned<P>(l.param[t]))) {
    const int nv = n / kV;
    for (int i0 = threadIdx.x; i0 < nv; i0 += kThreads * kIlp) {
      Vec<G> gv[kIlp];
      Vec<float> pv[kIlp], av[kIlp], sv[kIlp];
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
        const int i = i0 + u * kThreads;
        if (i < nv) {
          gv[u] = reinterpret_cast<const Vec<G>*>(g)[i];
          pv[u] = reinterpret_cast<const Vec<float>*>(pm)[i];
          av[u] = reinterpret_cast<const Vec<float>*>(m1)[i];
          sv[u] = reinterpret_cast<const Vec<float>*>(m2)[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kIlp; ++u) {
        const int i = i0 + u * kThreads;
        if (i >= nv) continue;
        Vec<P> out;
#pragma unroll
        for (int k = 0; k < kV; ++k) {
          adam(__fmul_rn(to_f(gv[u].e[k]), coef), pv[u].e[k], av[u].e[k], sv[u].e[k], s);
          if constexpr (kParam) out.e[k] = from_f<P>(pv[u].e[k]);
        }
        reinterpret_cast<Vec<float>*>(pm)[i] = pv[u];
        reinterpret_cast<Vec<float>*>(m1)[i] = av[u];
        reinterpret_cast<Vec<float>*>(m2)[i] = sv[u];
        if constexpr (kParam) reinterpret_cast<Vec<P>*>(q)[i] = out;
      }
    }
    done = nv * kV;
  }
  for (int i = done + threadIdx.x; i < n; i += kThreads) {
    float p = pm[i], a = m1[i], v = m2[i];
    adam(__fmul_rn(to_f(g[i]), coef), p, a, v, s);
    pm[i] = p;
    m1[i] = a;
    m2[i] = v;
    if constexpr (kParam) q[i] = from_f<P>(p);
  }
}

// Adds tensors to a list and launches it when full (kMaxTensors) or when its block count would
// leave int range; flush() launches the rest.
template <typename List, typename Launch> struct Batcher {
  List l{};
  int blocks = 0;
  Launch launch;
  explicit Batcher(Launch f) : launch(f) {}
  template <typename Fill> void add(int64_t numel, Fill fill) {
    const int64_t c = chunks(numel);
    if (c == 0) return;
    if (l.n == kMaxTensors || int64_t(blocks) + c > INT_MAX) flush();
    fill(l, l.n);
    l.numel[l.n] = numel;
    blocks += int(c);
    l.chunk_end[l.n] = blocks;
    ++l.n;
  }
  void flush() {
    if (l.n > 0) launch(l, blocks);
    l.n = 0;
    blocks = 0;
  }
};
template <typename List, typename Launch> Batcher<List, Launch> batcher(Launch f) { return Batcher<List, Launch>(f); }

template <typename G> void sumsq_of(const GradRef* grads, int n, DType dt, float* partials, int64_t& base,
                                    cudaStream_t st) {
  auto b = batcher<GradList>([&](const GradList& l, int blocks) {
    sumsq_kernel<G><<<blocks, kThreads, 0, st>>>(l, partials + base);
    DFLASH_CHECK_LAUNCH("AdamW gradient sum of squares");
    base += blocks;
  });
  for (int i = 0; i < n; ++i)
    if (grads[i].dtype == dt) b.add(grads[i].numel, [&](GradList& l, int k) { l.data[k] = grads[i].data; });
  b.flush();
}

template <typename G, typename P>
void update_of(const AdamWRef* t, int n, DType gdt, DType pdt, const Scalars& s, const float* coef, cudaStream_t st) {
  auto b = batcher<UpdateList>([&](const UpdateList& l, int blocks) {
    adamw_kernel<G, P><<<blocks, kThreads, 0, st>>>(l, s, coef);
    DFLASH_CHECK_LAUNCH("AdamW update");
  });
  for (int i = 0; i < n; ++i) {
    // P = float: the tensors without a separate parameter (fp32 ones); else those of P's dtype
    const bool no_param = t[i].param == nullptr;
    if (t[i].grad_dtype != gdt || no_param != std::is_same_v<P, float> || (!no_param && t[i].param_dtype != pdt))
      continue;
    b.add(t[i].numel, [&](UpdateList& l, int k) {
      l.grad[k] = t[i].grad;
      l.master[k] = t[i].master;
      l.exp_avg[k] = t[i].exp_avg;
      l.exp_avg_sq[k] = t[i].exp_avg_sq;
      l.param[k] = t[i].param;
    });
  }
  b.flush();
}

template <typename G>
void update_grad_type(const AdamWRef* t, int n, DType gdt, const Scalars& s, const float* coef, cudaStream_t st) {
  update_of<G, float>(t, n, gdt, DType::F32, s, coef, st);
  update_of<G, __nv_bfloat16>(t, n, gdt, DType::BF16, s, coef, st);
  update_of<G, __half>(t, n, gdt, DType::F16, s, coef, st);
}

}  // namespace

void grad_sumsq(const GradRef* grads, int n, float* partials, cudaStream_t stream) {
  int64_t base = 0;
  sumsq_of<__nv_bfloat16>(grads, n, DType::BF16, partials, base, stream);
  sumsq_of<__half>(grads, n, DType::F16, partials, base, stream);
  sumsq_of<float>(grads, n, DType::F32, partials, base, stream);
}

void grad_norm_clip(const float* partials, int64_t n_partials, double max_norm, float* out, cudaStream_t stream) {
  norm_clip_kernel<<<1, kFinalThreads, 0, stream>>>(partials, n_partials, max_norm > 0 ? float(max_norm) : 0.f, out);
  DFLASH_CHECK_LAUNCH("AdamW gradient norm");
}

void adamw_update(const AdamWRef* t, int n, const AdamWHyper& h, const float* coef, cudaStream_t stream) {
  const double step = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, step), bc2 = 1.0 - std::pow(h.beta2, step);
  Scalars s;
  s.decay = float(1.0 - h.lr * h.weight_decay);
  s.w1 = float(1.0 - h.beta1);
  s.w1c = 1.f - s.w1;
  s.lerp_small = std::fabs(s.w1) < 0.5f;
  s.b2 = float(h.beta2);
  s.omb2 = float(1.0 - h.beta2);
  s.neg_step = float(-(h.lr / bc1));
  s.bc2_sqrt = float(std::sqrt(bc2));
  s.eps = float(h.eps);
  update_grad_type<__nv_bfloat16>(t, n, DType::BF16, s, coef, stream);
  update_grad_type<__half>(t, n, DType::F16, s, coef, stream);
  update_grad_type<float>(t, n, DType::F32, s, coef, stream);
}

}  // namespace dflash::optim::kernels
