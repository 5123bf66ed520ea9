// How fast can an attention backward add its dQ partials into an fp32 buffer with global
// reductions (red.global.add.f32 / .v2.f32, sm_90)? Each CTA of 128 threads stands for one dK/dV
// warpgroup: per item it adds a 64-row x 128-column fp32 tile in the wgmma accumulator layout
// (warp w: rows 16w + g and 16w + g + 8, g = lane / 4; columns 8j + 2(lane % 4) + {0, 1}).
// Patterns: "spread" (each CTA walks its own tiles), "shared" (all CTAs of a group walk the same
// tiles in the same order, as the key tiles of one KV head do over their query tiles).
// Printed: payload bytes per second, against a plain store of the same tiles.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/micro/red_bench.cu -o red_bench
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kRows = 64, kCols = 128, kTile = kRows * kCols;

template <int MODE>  // 0: store, 1: red.f32, 2: red.v2.f32
__global__ void __launch_bounds__(128) add_tiles(float* buf, int ntiles, int items, int group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int cta = blockIdx.x;
  for (int it = 0; it < items; ++it) {
    // group == 0: spread; else the CTAs cta / group share one walk (offset by the group index)
    const int tile = group ? ((cta / group) * 97 + it) % ntiles : (cta * 131 + it * 7919) % ntiles;
    float* t = buf + (size_t)tile * kTile;
    const float v = 1.0f + it;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float* row = t + (size_t)(warp * 16 + g + half * 8) * kCols + 2 * t4;
#pragma unroll
      for (int j = 0; j < kCols / 8; ++j) {
        float* a = row + 8 * j;
        if constexpr (MODE == 0) {
          *reinterpret_cast<float2*>(a) = make_float2(v, v);
        } else if constexpr (MODE == 1) {
          asm volatile("red.global.add.f32 [%0], %1;" ::"l"(a), "f"(v) : "memory");
          asm volatile("red.global.add.f32 [%0], %1;" ::"l"(a + 1), "f"(v) : "memory");
        } else {
          asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(a), "f"(v), "f"(v) : "memory");
        }
      }
    }
  }
}

template <int MODE>
double run(float* buf, int ntiles, int ctas, int items, int group) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  add_tiles<MODE><<<ctas, 128>>>(buf, ntiles, items, group);  // warm-up
  cudaEventRecord(a);
  for (int r = 0; r < 3; ++r) add_tiles<MODE><<<ctas, 128>>>(buf, ntiles, items, group);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  const double bytes = 3.0 * ctas * items * kTile * sizeof(float);
  return bytes / (ms * 1e-3) / 1e9;  // GB/s
}

}  // namespace

int main() {
  const int ntiles = 32768 * 32 / kRows;  // the long shape's dQ: 32768 rows x 32 heads x 128
  float* buf = nullptr;
  if (cudaMalloc(&buf, (size_t)ntiles * kTile * sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 1;
  }
  cudaMemset(buf, 0, (size_t)ntiles * kTile * sizeof(float));
  const int ctas = 132 * 8, items = 64;
  std::printf("| pattern | store GB/s | red.f32 GB/s | red.v2.f32 GB/s |\n|---|---|---|---|\n");
  for (int group : {0, 8, 64, 264}) {
    const double s = run<0>(buf, ntiles, ctas, items, group);
    const double r1 = run<1>(buf, ntiles, ctas, items, group);
    const double r2 = run<2>(buf, ntiles, ctas, items, group);
    if (group) std::printf("| %d CTAs share each walk | %.0f | %.0f | %.0f |\n", group, s, r1, r2);
    else std::printf("| spread | %.0f | %.0f | %.0f |\n", s, r1, r2);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
