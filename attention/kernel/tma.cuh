// Hopper (sm_90a) tensor-memory-accelerator loads, mbarriers and thread-block-cluster helpers for
// the DFlash attention kernels. Compiled to nothing on other architectures (callers must not reach
// them there).
//
// A K or V tile of 64 rows is loaded by the two CTAs of a cluster together: each loads 32 rows
// (D/64 boxes of 32 x 64 bf16, 128-byte swizzle, the same layout as swz_w) and multicasts them
// into both CTAs' shared memory; each CTA's "full" mbarrier expects the whole tile's bytes.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "attention/kernel/wgmma.cuh"

namespace dflash::attention::dev {

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r = 0;
#ifdef DFLASH_WGMMA
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return r;
}
// Every thread of both CTAs: arrive and wait (release / acquire at cluster scope).
__device__ __forceinline__ void cluster_sync() {
#ifdef DFLASH_WGMMA
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#ifdef DFLASH_WGMMA
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}
// After the inits, before the cluster barrier that publishes them to the peer.
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
// Arrival on the mbarrier at the same offset in CTA `rank` of the cluster (this one included).
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, uint32_t rank) {
#ifdef DFLASH_WGMMA
  asm volatile(
      "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar), "r"(rank)
      : "memory");
#endif
}
// Whether the phase of parity `parity` has completed (acquire: CTA scope for data written by the
// tensor memory accelerator, cluster scope for the peer CTA's arrivals). The waits loop in C++, not
// inside the asm: a branch hidden in asm leaves the compiler unaware that lanes may leave the loop
// at different times, and the warp must be converged again at the next .aligned wgmma instruction.
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
__device__ __forceinline__ bool mbar_try_wait_cluster(uint32_t bar, uint32_t parity) {
  uint32_t done = 1;
#ifdef DFLASH_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
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
__device__ __forceinline__ void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
  while (!mbar_try_wait_cluster(bar, parity)) {
  }
}
// 4-d tensor-map box (c0 innermost) into `dst` of every CTA in `mask`, completing on the mbarrier
// at `bar`'s offset in each of them.
__device__ __forceinline__ void tma_load_4d_mc(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2,
                                               int c3, uint32_t bar, uint16_t mask) {
#ifdef DFLASH_WGMMA
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
      " [%0], [%1, {%2, %3, %4, %5}], [%6], %7;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
      : "memory");
#endif
}

}  // namespace dflash::attention::dev
