// Hopper (sm_90a) tensor-memory-accelerator tile loads, mbarriers, shared atomics and named barriers for the
// two-head DFlash attention kernels (ws_sm90.cu). Compiled to nothing on other
// architectures (callers must not reach them there).
//
// A [64 rows][D] bf16 tile arrives as D/64 boxes of 64 columns x 64 rows in the 128-byte swizzle,
// which is the swz_w layout of wgmma.cuh (column block c at byte c * 8192 of the tile, 1024-byte
// aligned); rows outside the tensor arrive as zeros.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attention/kernel.h"
#include "attention/kernel/wgmma.cuh"

namespace dflash::attention {

// ws_sm90.cu: [B, H, rows, D] bf16 with element strides (sb, sh, sr) as a 4-d TMA map (D, rows, H, B) with 64 x 64
// boxes in the 128-byte swizzle; false where TMA cannot describe the tensor.
bool tile_map(CUtensorMap* m, const void* ptr, int64_t B, int64_t H, int64_t rows, int D, int64_t sb, int64_t sh,
              int64_t sr);

// A backward pass's Q and dO tiles by TMA (the split dK/dV pass, bwd_sm90.cu, and the fused pass, bwd_fused_sm90.cu).
struct QdoMaps {
  CUtensorMap q, dout;  // [B, Hq, q_len, D] as tile_map's 4-d maps
};
// Both maps of p's q and dout (ws_sm90.cu); false where TMA cannot describe either (the caller then runs its
// cp.async kernel).
bool qdo_maps(const AttnParams& p, QdoMaps* maps);

}  // namespace dflash::attention

namespace dflash::attention::dev {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef DFLASH_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
// After the inits, before the block barrier that publishes them (to the TMA unit too).
__device__ __forceinline__ void fence_mbar_init() {
#ifdef DFLASH_WGMMA
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// This thread's arrival, with `bytes` more expected from asynchronous copies in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
#ifdef DFLASH_WGMMA
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}
// Whether the phase of parity `parity` has completed. The wait loops in C++, not inside the asm:
// a branch hidden in asm leaves the compiler unaware that lanes may leave the loop at different
// times, and the warp must be converged again at the next .aligned wgmma instruction.
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
#ifdef DFLASH_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
#endif
  return done != 0;
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// 4-d tensor-map box (c0 innermost) into this CTA's shared memory at `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                            uint32_t bar) {
#ifdef DFLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
#endif
}
// Rows [r0, r0 + R) of matrix (c2, c3) of a (D, rows, c2, c3) map into an R-row swz_w tile (R a
// multiple of 64: the map's boxes are 64 x 64; box h of column block c lands at c * R * 128 + h * 8192,
// where swz_w<R> puts row 64h, and the 128-byte swizzle repeats every 8 rows).
template <int D, int R = 64>
__device__ __forceinline__ void tma_tile(uint32_t dst, const CUtensorMap* map, int r0, int c2, int c3, uint32_t bar) {
#pragma unroll
  for (int c = 0; c < D / 64; ++c)
#pragma unroll
    for (int h = 0; h < R / 64; ++h)
      tma_load_4d(dst + c * (R * 128) + h * (64 * 128), map, c * 64, r0 + 64 * h, c2, c3, bar);
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
// Atomic add on a shared-memory word with acquire-release semantics at CTA scope; the old value.
__device__ __forceinline__ uint32_t atom_add_acq_rel_shared(uint32_t addr, uint32_t v) {
  uint32_t old = 0;
#ifdef DFLASH_WGMMA
  asm volatile("atom.acq_rel.cta.shared::cta.add.u32 %0, [%1], %2;" : "=r"(old) : "r"(addr), "r"(v) : "memory");
#endif
  return old;
}
// Named barrier `id` (1..15) over `threads` threads: wait for them, or only count this warp in.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace dflash::attention::dev
