// The rate of Hopper's warpgroup MMA by product shape, operands in shared memory: what the attention
// kernels' products can reach at best, to price a tile shape before a kernel is built on it
// (attention/kernel/NOTES.md v13: the fused backward's tensor pipe sits at 49% of its cycles with its
// warpgroups in lock-step or decoupled alike; is that the m64n64 products' own ceiling?).
//
// One CTA per SM (the dynamic shared memory asked for leaves room for one), W warpgroups per CTA, each
// issuing its own chain of products on its own tiles: groups of G wgmmas (one k-step each) committed together,
// two groups in flight (wait<1>), as the kernels issue them. Printed: TFLOP/s over every SM, the cycles (at the
// maximum clock) of one warpgroup's k-step while the other runs the same, and from those the products alone of
// one fused-backward item, to set beside the pass's ~5200 cycles per item (NOTES.md v12, v13).
//   nvcc -O3 -std=c++17 -I. --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     bench/micro/wgmma_bench.cu -o wgmma_bench && ./wgmma_bench        (bash bench/gpu/micro.sh)
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "attention/kernel/wgmma.cuh"

using namespace dflash::attention::dev;

namespace {

enum Shape { kSS64, kSS128, kRS64, kRS128 };
constexpr int kTileBytes = 128 * 128 * 2;  // room for a [128][128] bf16 tile per operand
constexpr int kSmem = 2 * 2 * kTileBytes + 1024;  // two warpgroups' A and B tiles (and alignment)

template <Shape S, int G>
__global__ void __launch_bounds__(256, 1) wgmma_kernel(int iters, float* sink) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) + 1023) & ~1023u;
  const int wg = threadIdx.x / 128;
  for (int i = threadIdx.x; i < 2 * 2 * kTileBytes / 16; i += blockDim.x)
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(base + 16 * i), "r"(0));
  fence_proxy_async();
  __syncthreads();
  const uint32_t sA = base + wg * 2 * kTileBytes, sB = sA + kTileBytes;
  constexpr int N = (S == kSS64 || S == kRS64) ? 64 : 128;
  // two accumulators, one per group in flight, each product starting anew (its first k-step overwrites),
  // as the kernels' products do: no group waits on the previous one's accumulator
  float d0[N / 8][4], d1[N / 8][4];
  uint32_t a[4] = {0, 0, 0, 0};
  auto group = [&](float (&d)[N / 8][4]) {
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < G; ++ks) {
      if constexpr (S == kSS64) wgmma_ss_n64(d, desc_k<64>(sA, ks), desc_k<64>(sB, ks), ks > 0);
      if constexpr (S == kSS128) wgmma_ss_n128(d, desc_k<64>(sA, ks), desc_k<128>(sB, ks), ks > 0);
      if constexpr (S == kRS64) wgmma_rs_n64_kb(d, a, desc_k<64>(sB, ks), ks > 0);
      if constexpr (S == kRS128) wgmma_rs_n128_kb(d, a, desc_k<128>(sB, ks), ks > 0);
    }
    wg_commit();
  };
  for (int it = 0; it < iters; it += 2) {
    group(d0);
    wg_wait<1>();  // the previous group (d1) done
    reg_fence(d1);
    group(d1);
    wg_wait<1>();  // d0 done
    reg_fence(d0);
  }
  wg_wait<0>();
  reg_fence(d1);
  const float s = d0[0][0] + d1[0][0];
  if (s != 0.f) sink[blockIdx.x] = s;  // never true (zero tiles); keeps the products alive
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "wgmma_bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <Shape S, int G>
double run(const char* name, int sms, double clock_ghz, float* sink) {  // returns cycles per k-step
  constexpr int N = (S == kSS64 || S == kRS64) ? 64 : 128;
  auto k = wgmma_kernel<S, G>;
  check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem), "smem attribute");
  const int iters = 20000;
  k<<<sms, 256, kSmem>>>(100, sink);  // warm-up
  check(cudaGetLastError(), name);
  check(cudaDeviceSynchronize(), name);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaEventRecord(e0);
  k<<<sms, 256, kSmem>>>(iters, sink);
  check(cudaGetLastError(), name);
  cudaEventRecord(e1);
  check(cudaEventSynchronize(e1), name);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, e0, e1);
  const double flop_wg = 2.0 * 64 * N * 16 * G * (double)iters;  // one warpgroup's products
  const double tflops = flop_wg * 2 * sms / (ms * 1e-3) / 1e12;
  // one warpgroup's k-step (64 x N x 16) while the other warpgroup runs the same: elapsed cycles / steps
  const double cyc = ms * 1e-3 * clock_ghz * 1e9 / ((double)G * iters);
  std::printf("| %s | %d | %.3f | %.0f | %.1f |\n", name, G, ms, tflops, cyc);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return cyc;
}

}  // namespace

int main() {
  int dev = 0, sms = 0, clock_khz = 0;
  check(cudaGetDevice(&dev), "device");
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev);
  const double ghz = clock_khz / 1e6;
  float* sink = nullptr;
  check(cudaMalloc(&sink, sms * sizeof(float)), "cudaMalloc");
  std::printf("wgmma_bench: %d SMs, one CTA of two warpgroups each, max clock %.3f GHz (cycles at that clock)\n",
              sms, ghz);
  std::printf("| product (m64, bf16 -> f32) | k-steps per group | ms | TFLOP/s | cycles per k-step of one warpgroup |\n");
  std::printf("|---|---|---|---|---|\n");
  const double ss64 = run<kSS64, 8>("n64, A and B in shared memory (S^T, dP^T, dQ)", sms, ghz, sink);
  run<kSS128, 8>("n128, A and B in shared memory", sms, ghz, sink);
  run<kRS64, 8>("n64, A in registers", sms, ghz, sink);
  const double rs128 = run<kRS128, 8>("n128, A in registers (dK, dV)", sms, ghz, sink);
  // the fused backward's item, per warpgroup: S^T, dP^T, dQ (8 n64 k-steps each), dV, dK (4 n128 k-steps each).
  // (Groups of 4 k-steps are not measured: on an H100 they read 2-3x the tensor cores' peak, i.e. the timing of
  // such a chain is not what this loop measures; unexplained.)
  std::printf("products alone of one fused-backward item (24 n64 + 8 n128 k-steps per warpgroup, both warpgroups "
              "at once): %.0f cycles\n", 24 * ss64 + 8 * rs128);
  cudaFree(sink);
  return 0;
}
