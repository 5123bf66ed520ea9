// How fast can an attention backward add its dQ partials into an fp32 buffer with global
// reductions (red.global.add.f32 / .v2.f32, sm_90)? Each CTA of 128 threads stands for one dK/dV
// warpgroup: per item it adds a 64-row x 128-column fp32 tile in the wgmma accumulator layout
// (warp w: rows 16w + g and 16w + g + 8, g = lane / 4; columns 8j + 2(lane % 4) + {0, 1}).
// Patterns: "spread" (each CTA walks its own tiles), "shared" (all CTAs of a group walk the same
// tiles in the same order, as the key tiles of one KV head do over their query tiles).
// Printed: payload bytes per second, against a plain store of the same tiles. A fourth column adds
// each tile the way FlashAttention-3's backward adds dQ: every thread stores its accumulators into
// shared memory (a 32 KB tile, two buffers), and one thread hands the tile to the TMA unit as one
// bulk reduce-add (cp.reduce.async.bulk .add.f32, sm_90), so the SM issues one instruction per tile
// instead of 4096 reductions. The global tile then holds the accumulators in the order the threads
// wrote them (float2 of thread t, step i at [i][t]: conflict-free stores); a dQ pass built on it
// would undo that order in its final conversion to bf16. A fifth column adds the same tiles as int32 by the bulk
// .add.u32 (the fused backward's fixed-point dQ, attention/kernel/NOTES.md v17/v18): whether the L2's integer
// reduction is slower per byte than its float one.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/micro/red_bench.cu -o red_bench
//   (bash bench/gpu/run_all.sh micro)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kRows = 64, kCols = 128, kTile = kRows * kCols;

constexpr int kBulkSmem = 2 * kTile * sizeof(float);  // mode 3: two tile buffers

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int MODE>  // 0: store, 1: red.f32, 2: red.v2.f32, 3: smem + one bulk reduce-add per tile, 4: as 3, .add.u32
__global__ void __launch_bounds__(128) add_tiles(float* buf, int ntiles, int items, int group) {
  extern __shared__ __align__(128) float stage[];  // modes 3 and 4 only
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int cta = blockIdx.x;
  for (int it = 0; it < items; ++it) {
    // group == 0: spread; else the CTAs cta / group share one walk (offset by the group index)
    const int tile = group ? ((cta / group) * 97 + it) % ntiles : (cta * 131 + it * 7919) % ntiles;
    float* t = buf + (size_t)tile * kTile;
    const float v = 1.0f + it;
    if constexpr (MODE >= 3) {
      float* sb = stage + (it & 1) * kTile;
      // the buffer's previous bulk reduce (item it - 2) has read it: at most one group in flight
      if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kTile / 256; ++i) {
        if constexpr (MODE == 3)
          *reinterpret_cast<float2*>(sb + 2 * (i * 128 + threadIdx.x)) = make_float2(v, v);
        else
          *reinterpret_cast<int2*>(sb + 2 * (i * 128 + threadIdx.x)) = make_int2(1 + it, 1 + it);
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the stores, seen by the TMA unit
      __syncthreads();
      if (threadIdx.x == 0) {
        if constexpr (MODE == 3)
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(t),
                       "r"(smem_addr(sb)), "r"((int)(kTile * sizeof(float)))
                       : "memory");
        else
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;" ::"l"(t),
                       "r"(smem_addr(sb)), "r"((int)(kTile * sizeof(float)))
                       : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      }
    } else {
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
  if constexpr (MODE >= 3)
    if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <int MODE>
double run(float* buf, int ntiles, int ctas, int items, int group) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  const int smem = MODE >= 3 ? kBulkSmem : 0;
  if (MODE >= 3) cudaFuncSetAttribute(add_tiles<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  add_tiles<MODE><<<ctas, 128, smem>>>(buf, ntiles, items, group);  // warm-up
  cudaEventRecord(a);
  for (int r = 0; r < 3; ++r) add_tiles<MODE><<<ctas, 128, smem>>>(buf, ntiles, items, group);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  const double bytes = 3.0 * ctas * items * kTile * sizeof(float);
  return bytes / (ms * 1e-3) / 1e9;  // GB/s
}

// Runs add_tiles<MODE> twice with one CTA and two items on a zeroed buffer: tile 0 must hold 2 and tile 7919 4 (as T).
template <int MODE, class T>
bool check_bulk_adds(float* buf, int ntiles, const char* what) {
  cudaMemset(buf, 0, (size_t)ntiles * kTile * sizeof(float));
  cudaFuncSetAttribute(add_tiles<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, kBulkSmem);
  for (int r = 0; r < 2; ++r) add_tiles<MODE><<<1, 128, kBulkSmem>>>(buf, ntiles, 2, 0);
  static T h[2][kTile];
  cudaMemcpy(h[0], buf, sizeof(h[0]), cudaMemcpyDeviceToHost);
  cudaMemcpy(h[1], buf + (size_t)(7919 % ntiles) * kTile, sizeof(h[1]), cudaMemcpyDeviceToHost);
  for (int i = 0; i < kTile; ++i)
    if (h[0][i] != T(2) || h[1][i] != T(4)) {
      std::fprintf(stderr, "%s check failed at element %d: %g and %g, expected 2 and 4\n", what, i, (double)h[0][i],
                   (double)h[1][i]);
      return false;
    }
  std::printf("%s check: tiles added, not stored (2 and 4 after two runs)\n", what);
  return true;
}

}  // namespace

int main() {
  const int ntiles = 32768 * 32 / kRows;  // the long shape's dQ: 32768 rows x 32 heads x 128
  float* buf = nullptr;
  if (cudaMalloc(&buf, (size_t)ntiles * kTile * sizeof(float)) != cudaSuccess) {
    std::fprintf(stderr, "cudaMalloc failed\n");
    return 1;
  }
  // The bulk reduce adds (not stores), as fp32 and as int32: one CTA, two items (tile 0 gets 1, tile 7919 gets 2),
  // twice.
  if (!check_bulk_adds<3, float>(buf, ntiles, "bulk reduce-add") ||
      !check_bulk_adds<4, int>(buf, ntiles, "bulk .add.u32"))
    return 1;
  cudaMemset(buf, 0, (size_t)ntiles * kTile * sizeof(float));
  const int ctas = 132 * 8, items = 64;
  std::printf("| pattern | store GB/s | red.f32 GB/s | red.v2.f32 GB/s | bulk reduce-add GB/s | bulk .add.u32 GB/s |\n"
              "|---|---|---|---|---|---|\n");
  for (int group : {0, 8, 64, 264}) {
    const double s = run<0>(buf, ntiles, ctas, items, group);
    const double r1 = run<1>(buf, ntiles, ctas, items, group);
    const double r2 = run<2>(buf, ntiles, ctas, items, group);
    const double r3 = run<3>(buf, ntiles, ctas, items, group);
    const double r4 = run<4>(buf, ntiles, ctas, items, group);
    if (group) std::printf("| %d CTAs share each walk | %.0f | %.0f | %.0f | %.0f | %.0f |\n", group, s, r1, r2, r3, r4);
    else std::printf("| spread | %.0f | %.0f | %.0f | %.0f | %.0f |\n", s, r1, r2, r3, r4);
  }
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
