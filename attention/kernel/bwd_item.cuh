// The per-item arithmetic of the Hopper dK/dV pass (bwd_sm90.cu) and the fused pass (bwd_fused_sm90.cu),
// one warpgroup's 64 keys against one 64-row query tile, on the m64n64 accumulators of S^T and dP^T
// (thread: keys 16 warp + g and + 8, query rows 8 j + 2 t4 + e). Shared so that the two passes stay
// the same products in the same order (the fused pass's dK and dV are bit-identical to the split's).
#pragma once

#include <cuda_bf16.h>

#include "attention/kernel.h"
#include "attention/kernel/common.cuh"
#include "attention/kernel/item_div.h"
#include "attention/kernel/tma.cuh"
#include "attention/kernel/wgmma.cuh"

namespace dflash::attention::dev {

// kTma: thread 0 initialises the two stage buffers' "full" mbarriers at bar and bar + 8 (one arrival each: the
// loader's expect_tx); a block barrier must follow before any thread waits on them.
template <bool kTma>
__device__ __forceinline__ void bwd_init_full_bars(uint32_t bar, int tid) {
  if constexpr (kTma) {
    if (tid == 0) {
      mbar_init(bar, 1);
      mbar_init(bar + 8, 1);
      fence_mbar_init();
    }
  }
}

// One item's loads into stage buffer st: the Q and dO tiles of query head h, rows [m0, m0 + 64) of batch row b
// (at st and st + 64 D 2), then the row records, LSE and delta (at st + 2 tiles). kTma: thread 0 issues the two
// tiles as TMA loads onto mbarrier `full` (its expect_tx, the tiles' bytes), the row data goes by cp.async; else all
// NT threads load everything by cp.async. The caller commits the cp.async group.
template <int D, int NT, bool kTma>
__device__ __forceinline__ void bwd_load_item(const AttnParams& p, const QdoMaps& maps, const int4* rows, uint32_t st,
                                              uint32_t full, int b, int h, int m0, int tid) {
  constexpr int kTile = kTileQ * D * 2;
  if constexpr (kTma) {
    if (tid == 0) {
      mbar_arrive_expect_tx(full, 2 * kTile);
      tma_tile<D>(st, &maps.q, m0, h, b, full);
      tma_tile<D>(st + kTile, &maps.dout, m0, h, b, full);
    }
  } else {
    load_tile_w<kTileQ, D, NT>(st, static_cast<const __nv_bfloat16*>(p.q) + b * p.q_sb + h * p.q_sh, p.q_sr, m0,
                               p.q_len, tid);
    load_tile_w<kTileQ, D, NT>(st + kTile, static_cast<const __nv_bfloat16*>(p.dout) + b * p.do_sb + h * p.do_sh,
                               p.do_sr, m0, p.q_len, tid);
  }
  const int64_t lo = ((int64_t)b * p.Hq + h) * p.q_len;
  load_row_stats<kTileQ, NT>(st + 2 * kTile, rows, p.lse, p.delta, lo, m0, p.q_len, tid);
}

// dS^T (the A fragments da: keys 16 warp + g (+8), query rows 16 kk + 2 t4 (+8)) -> the swizzled [64][64] bf16
// tile at sDs by 4-byte stores; 8 rows x 4 words per instruction hit 32 distinct banks.
__device__ __forceinline__ void bwd_store_dst(uint32_t sDs, const uint32_t (&da)[4][4], int warp, int g, int t4) {
  const int ra = warp * 16 + g, rb = ra + 8;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk) + 4 * t4), "r"(da[kk][0]));
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk) + 4 * t4), "r"(da[kk][1]));
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk + 1) + 4 * t4), "r"(da[kk][2]));
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk + 1) + 4 * t4), "r"(da[kk][3]));
  }
}

// S^T = K Q^T and dP^T = V dO^T of this warpgroup's 64 keys against the item's 64 query rows, issued as two
// wgmma groups, S^T's first (a wait<1> then finds S^T done while dP^T runs on).
template <int D>
__device__ __forceinline__ void bwd_issue_st_dpt(float (&st)[8][4], float (&dpt)[8][4], uint32_t sK, uint32_t sV,
                                                 uint32_t sQ, uint32_t sdO) {
  wg_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_ss_n64(st, desc_k<kTileK>(sK, ks), desc_k<kTileQ>(sQ, ks), ks > 0);
  wg_commit();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks)
    wgmma_ss_n64(dpt, desc_k<kTileK>(sV, ks), desc_k<kTileQ>(sdO, ks), ks > 0);
  wg_commit();
}

// S^T := -inf where key keyA / keyB is not visible to the query row (row records sRows: two key ranges
// [x, y), [z, w) per row). Skipped when every row of the tile sees all 16 keys of the warp (kw: its first).
__device__ __forceinline__ void bwd_mask_st(float (&st)[8][4], const int4* sRows, int kw, int lane, int t4, int keyA,
                                            int keyB) {
  const int4 r0 = sRows[lane], r1 = sRows[lane + 32];
  const bool wfull = __all_sync(0xffffffffu, kw >= r0.x && kw + 16 <= r0.y && kw >= r1.x && kw + 16 <= r1.y);
  if (!wfull) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        // The test of visible() (common.cuh), written with bitwise operators: visible()'s
        // short-circuit form compiles to branches here (61 against 29 in the dK/dV kernel) and
        // 14 more registers; made bitwise there, it spills more in the sm_80 dK/dV kernel.
        const int4 rm = sRows[j * 8 + 2 * t4 + e];
        const bool va = ((keyA >= rm.x) & (keyA < rm.y)) | ((keyA >= rm.z) & (keyA < rm.w));
        const bool vb = ((keyB >= rm.x) & (keyB < rm.y)) | ((keyB >= rm.z) & (keyB < rm.w));
        st[j][e] = va ? st[j][e] : -INFINITY;
        st[j][2 + e] = vb ? st[j][2 + e] : -INFINITY;
      }
    }
  }
}

// P^T = exp2(S^T * scale*log2e - lse*log2e) into st, then as bf16 A fragments (pa). A row that sees no key
// has lse = -inf; its l2 is taken as +inf so that P = 0 without NaN.
__device__ __forceinline__ void bwd_p_from_st(float (&st)[8][4], const float* sL, int t4, float sl2,
                                              uint32_t (&pa)[4][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 lv = *reinterpret_cast<const float2*>(sL + j * 8 + 2 * t4);
    const float l0 = lv.x == -INFINITY ? INFINITY : lv.x * kLog2e;
    const float l1 = lv.y == -INFINITY ? INFINITY : lv.y * kLog2e;
    st[j][0] = ex2(fmaf(st[j][0], sl2, -l0));
    st[j][1] = ex2(fmaf(st[j][1], sl2, -l1));
    st[j][2] = ex2(fmaf(st[j][2], sl2, -l0));
    st[j][3] = ex2(fmaf(st[j][3], sl2, -l1));
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) acc_to_a(st[2 * kk], st[2 * kk + 1], pa[kk]);
}

// dS^T = P^T * (dP^T - delta) into dpt, then as bf16 A fragments (da), with P as rounded to bf16 for the
// dV product (pa): holding the fp32 P as well would not fit in the registers next to dK, dV and the
// in-flight pa.
__device__ __forceinline__ void bwd_ds_from_dpt(float (&dpt)[8][4], const float* sD, int t4, const uint32_t (&pa)[4][4],
                                                uint32_t (&da)[4][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float2 dl = *reinterpret_cast<const float2*>(sD + j * 8 + 2 * t4);
    const float2 pA = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(pa[j / 2][(j & 1) * 2]));
    const float2 pB = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162&>(pa[j / 2][(j & 1) * 2 + 1]));
    dpt[j][0] = pA.x * (dpt[j][0] - dl.x);
    dpt[j][1] = pA.y * (dpt[j][1] - dl.y);
    dpt[j][2] = pB.x * (dpt[j][2] - dl.x);
    dpt[j][3] = pB.y * (dpt[j][3] - dl.y);
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) acc_to_a(dpt[2 * kk], dpt[2 * kk + 1], da[kk]);
}

}  // namespace dflash::attention::dev
