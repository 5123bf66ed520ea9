// Fused backward of the DFlash attention (dK/dV variant 7, Hopper wgmma, d = 128): one pass computes
// dK, dV and dQ with 5 matmuls per visible pair instead of the split backward's 7 (no dQ pass).
//
// One CTA = two warpgroups = 128 keys of one (batch row, KV head); warpgroup w owns keys
// [n0 + 64 w, +64) and runs the dK/dV pass's per-item work (bwd_sm90.cu) on them, both walking the
// same items (query head of the GQA group, 64-row query tile that sees either half). Per item:
//   S^T, dP^T, P^T, dV += P^T dO, dS^T, dK += dS^T Q      as in bwd_sm90.cu (per warpgroup)
//   dS^T -> shared memory (bf16, each warpgroup its 64 keys), one block barrier
//   dQ(item)[:, 64 w .. +64] = dS (64 rows x 128 keys) K (128 keys x 64 columns)
//                                     A = both dS^T tiles, B = both K tiles (smem, MN-major), m64n64k16 x 8
//   the 64 x 128 fp32 partial -> shared memory -> one TMA bulk reduce-add (cp.reduce.async.bulk .add.f32,
//   32 KB) into p.dq_accum (zeroed before), issued by thread 0 at the next item's barrier
// 128 keys per CTA make the partial 4 bytes per visible pair (half of a 64-key CTA's); the bulk add is
// one instruction per item where per-element reductions were 8192 (kernel/NOTES.md "v10").
// p.dq_accum holds each (b, h, query tile)'s 64 x 128 partial in the accumulators' fragment order, so
// that the shared-memory writes are conflict-free float4s: float index ((w * 8 + j) * 128 + t) * 4 + e
// for thread t of warpgroup w and its fragment j, e (row 16 (t / 32) + (t % 32) / 4 + 8 (e / 2), column
// 64 w + 8 j + 2 (t % 4) + e % 2); bwd.cu's conversion kernel reads it back (dq_accum_index()). dK and dV equal the
// split backward's bitwise.
//
// The sum (DFLASH_ATTN_FUSED_DET): 1 (default): int32 fixed point, the same bits in every run. Each partial element is
// rounded to an integer at its query row's power-of-two scale s_i (p.dq_row_scale, written by bwd.cu's delta kernel
// from ||dO_i|| and the K/V maxima: s_i times a bound on sum_k |dS_ik| |K_kj| stays below 2^30, so no partial sum
// leaves int32) and added by a bulk .add.u32; integer addition does not depend on the order in which the CTAs add.
// Each rounding is at most 2^-30 of the row's bound (s_i bound >= 2^29), ~300 of them per element at the long shape:
// below dQ's own bf16 rounding (2^-9 of the element) unless the element is under ~2^-13 of its row's bound and
// the roundings all go one way. The conversion divides by s_i. 0: fp32 bulk adds (the first
// version): the order the CTAs reach a tile decides the sum's last bits, which vary from run to run. A fixed order of
// fp32 adds (a turn counter per tile) was measured ~14 ms slower at the long shape (kernel/NOTES.md v17).
//
// Loads (DFLASH_ATTN_FUSED_TMA): 1 (default where TMA can describe q and dO): thread 0 loads each item's
// Q and dO tiles by TMA onto a "full" mbarrier per stage buffer, so the item starts on that barrier's wait
// instead of a block barrier (two block barriers per item instead of three, and no per-thread address
// arithmetic for 32 KB of cp.async); the row records, LSE and delta (1.5 KB) stay cp.async, waited at the
// barrier that already follows S^T. 0: every thread loads by cp.async (the first version, the A/B oracle).
// Both add the same products in the same order: dK, dV and the dQ partials are the same bits.
#include <atomic>

#include <cuda.h>
#include <cuda_runtime.h>

#include "attention/kernel.h"
#include "core/launch_check.h"
#include "attention/kernel/common.cuh"
#include "attention/kernel/wgmma.cuh"
#include "attention/kernel/bwd_item.cuh"
#include "attention/kernel/tma.cuh"

namespace dflash::attention {

namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kFThreads = 256;  // two warpgroups
constexpr int kFD = 128;        // head dim (d = 64 runs the split backward)

struct FusedSmem {
  static constexpr int kTile = kTileQ * kFD * 2;                            // a 64-row bf16 tile: 16 KB
  static constexpr int kStage = 2 * kTile + kTileQ * 16 + 3 * kTileQ * 4;   // Q, dO, row records, LSE, delta, scale
  static constexpr int kStageAligned = (kStage + 1023) / 1024 * 1024;
  static constexpr int kDs = kTileK * kTileQ * 2;                           // one warpgroup's dS^T: 8 KB
  static constexpr int kDq = kTileQ * kFD * 4;                              // an item's dQ partial: 32 KB
  static constexpr int kK = 0, kV = 2 * kTile, kStage0 = 4 * kTile;        // K, V: one tile per warpgroup
  static constexpr int kDs0 = kStage0 + 2 * kStageAligned, kDq0 = kDs0 + 2 * kDs;
  static constexpr int kBar = kDq0 + 2 * kDq;                               // full[2] (TMA loads)
  static constexpr int kBytes = 1024 + kBar + 16;                           // +1024: base alignment
};
static_assert(FusedSmem::kBytes <= 227 * 1024, "fused backward: shared memory");
static_assert(FusedSmem::kK == 0 && FusedSmem::kV == 2 * FusedSmem::kTile, "fused backward: K, V tiles first");

// kFix: the partial is int32 (fixed point), added as .u32 (two's complement: the same bits as a signed add).
template <bool kFix>
[[maybe_unused]] __device__ __forceinline__ void bulk_add(float* gdst, uint32_t ssrc, int bytes) {
  if constexpr (kFix)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.u32 [%0], [%1], %2;" ::"l"(gdst), "r"(ssrc),
                 "r"(bytes)
                 : "memory");
  else
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gdst), "r"(ssrc),
                 "r"(bytes)
                 : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

template <bool kTma, bool kFix>
__global__ void __launch_bounds__(kFThreads, 1)
    attn_bwd_fused_kernel(const AttnParams p, const __grid_constant__ QdoMaps maps) {
#ifdef DFLASH_WGMMA
  constexpr int D = kFD;
  using S = FusedSmem;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gbase = smem_raw + (base - raw);
  const int tid = threadIdx.x, wg = tid >> 7, wt = tid & 127, lane = tid & 31, warp = wt >> 5;
  const int nqt = p.meta.nqt, nkt = p.meta.nkt;
  const int kt = 2 * (int)blockIdx.x;  // key tiles kt (warpgroup 0) and kt + 1 (warpgroup 1)
  const int hk = blockIdx.y, b = blockIdx.z;
  const int G = p.Hq / p.Hkv;
  const int n0 = kt * kTileK, nw = n0 + wg * kTileK;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  // The query tiles that see either key tile: the union of their two ranges (empty = (0, 0)).
  const int2* ktr = reinterpret_cast<const int2*>(p.meta.ktiles) + (int64_t)b * nkt;
  int2 kr = ktr[kt];
  if (kt + 1 < nkt) {
    const int2 k1 = ktr[kt + 1];
    if (k1.y > k1.x) kr = kr.y > kr.x ? make_int2(min(kr.x, k1.x), max(kr.y, k1.y)) : k1;
  }
  const int4* qtiles = reinterpret_cast<const int4*>(p.meta.qtiles) + (int64_t)b * nqt;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int nitems = (kr.y - kr.x) * G;
  // item i: query tile qt_of(i) (ascending from kr.x, or descending from kr.y - 1), query head hk G + i % G
  const int qt0 = p.bwd_descend ? kr.y - 1 : kr.x, qdir = p.bwd_descend ? -1 : 1;
  const ItemDiv div_g(G);
  auto qt_of = [&](int i) { return qt0 + qdir * div_g(i); };
  auto valid_tq = [&](const int4 tq) {  // does query tile record tq see this CTA's 128 keys?
    return (tq.x < n0 + 2 * kTileK && tq.y > n0 && tq.y > tq.x) ||
           (tq.z < n0 + 2 * kTileK && tq.w > n0 && tq.w > tq.z);
  };
  auto valid = [&](int i) { return valid_tq(qtiles[qt_of(i)]); };
  auto next_item = [&](int i) {
    while (i < nitems && !valid(i)) ++i;
    return i;
  };
  auto dq_tile = [&](int i) {  // item i's 64 x 128 fp32 partial in p.dq_accum
    const auto [gi, hi] = div_g.divmod(i);
    const int qt = qt0 + qdir * gi, h = hk * G + hi;
    return p.dq_accum + (((int64_t)b * p.Hq + h) * nqt + qt) * (kTileQ * D);
  };

  const uint32_t sK0 = base + S::kK, sK = sK0 + wg * S::kTile, sV = base + S::kV + wg * S::kTile;
  const uint32_t sStage0 = base + S::kStage0, sDs0 = base + S::kDs0, sDq0 = base + S::kDq0;
  const uint32_t sBar0 = base + S::kBar;  // full[buf] at sBar0 + 8 buf
  unsigned char* stage_ptr0 = gbase + S::kStage0;

  auto load_item = [&](int i, int buf) {
    const auto [gi, hi] = div_g.divmod(i);
    const int h = hk * G + hi, m0 = (qt0 + qdir * gi) * kTileQ;
    const uint32_t st = sStage0 + buf * S::kStageAligned;
    bwd_load_item<D, kFThreads, kTma>(p, maps, rows, st, sBar0 + 8 * buf, b, h, m0, tid);
    if constexpr (kFix) {  // the rows' fixed-point scales after delta (threads 128..191; the loader uses 0..127)
      const int r = tid - 2 * kTileQ;
      if (r >= 0 && r < kTileQ) {
        const bool ok = m0 + r < p.q_len;
        const int64_t lo = ((int64_t)b * p.Hq + h) * p.q_len;
        cp_async4(st + 2 * S::kTile + kTileQ * 16 + 2 * kTileQ * 4 + r * 4, p.dq_row_scale + (ok ? lo + m0 + r : 0), ok);
      }
    }
  };

  bwd_init_full_bars<kTma>(sBar0, tid);
  load_tile_w<kTileK, D, 128>(sK, k, p.k_sr, nw, p.kv_len, wt);
  load_tile_w<kTileK, D, 128>(sV, v, p.v_sr, nw, p.kv_len, wt);
  int item = next_item(0);
  if (item < nitems) load_item(item, 0);
  cp_async_commit();
  if constexpr (kTma) {  // K, V and the first item's row records in shared memory; the barriers initialised
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  }

  const int g = lane >> 2, t4 = lane & 3;
  const int keyA = nw + warp * 16 + g, keyB = keyA + 8;
  const float sl2 = p.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

  // The order of waits is bwd_sm90.cu's; the dQ product joins dK's group position:
  //   ... dS^T(i) -> shared memory -> barrier -> dQ(i) issued, dK(i) issued -> wait<1>: dV(i) and
  //   dQ(i) done -> dQ(i) -> shared memory [buf]; at the next item's first barrier thread 0 issues
  //   its bulk add, and before that barrier waits until the add of item i-1 (issued one item ago,
  //   from the other buffer) has read its buffer, which item i+1 then overwrites.
  // kTma: the first block barrier below is replaced by the wait on full[buf], and the bulk add's
  // bookkeeping moves to the barrier after S^T (where every thread has written item i-1's partial).
  int buf = 0, prev = -1;  // prev: the item whose partial waits in the dQ buffer buf ^ 1
  uint32_t phase = 0;      // kTma: parity of full[buf]'s next phase, bit buf
  uint32_t da[4][4];        // dS^T(i-1): A operand of dK(i-1), in flight into item i
  while (item < nitems) {
    const int cand = item + 1;
    const int4 tq_cand = cand < nitems ? qtiles[qt_of(cand)] : make_int4(0, 0, 0, 0);
    if constexpr (kTma) {
      mbar_wait(sBar0 + 8 * buf, (phase >> buf) & 1);  // Q, dO of this item have landed
      phase ^= 1u << buf;
    } else {
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
      if (tid == 0 && prev >= 0) bulk_add<kFix>(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    }
    const uint32_t sQ = sStage0 + buf * S::kStageAligned, sdO = sQ + S::kTile;
    const unsigned char* stp = stage_ptr0 + buf * S::kStageAligned + 2 * S::kTile;
    const int4* sRows = reinterpret_cast<const int4*>(stp);
    const float* sL = reinterpret_cast<const float*>(stp + kTileQ * 16);
    const float* sD = sL + kTileQ;

    float st[8][4], dpt[8][4];
    bwd_issue_st_dpt<D>(st, dpt, sK, sV, sQ, sdO);
    wg_wait<1>();  // S^T(i) done, and before it dK(i-1)
    reg_fence(st);
    reg_fence(dk);
    reg_fence_a(da);
    if constexpr (kTma) {
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // item i-2's add read buf
      cp_async_wait<0>();  // this item's row records, LSE, delta
    }
    __syncthreads();  // every warp is past dK(i-1): item i-1's stage buffer may be refilled
    const int nxt = cand >= nitems ? nitems : valid_tq(tq_cand) ? cand : next_item(cand + 1);
    if (nxt < nitems) load_item(nxt, buf ^ 1);
    cp_async_commit();
    if constexpr (kTma) {  // after the next item's loads: they wait on nothing, the add only on its own reads (NOTES v15)
      if (tid == 0 && prev >= 0) bulk_add<kFix>(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    }

    // P^T (0 where masked) as bf16 A fragments (bwd_item.cuh)
    bwd_mask_st(st, sRows, nw + warp * 16, lane, t4, keyA, keyB);
    uint32_t pa[4][4];
    bwd_p_from_st(st, sL, t4, sl2, pa);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dv, pa[kk], desc_mn<kTileQ>(sdO, kk));
    wg_commit();
    wg_wait<1>();
    reg_fence(dpt);

    // dS^T = P^T * (dP^T - delta) as bf16 A fragments (bwd_item.cuh)
    bwd_ds_from_dpt(dpt, sD, t4, pa, da);

    // dS^T -> this warpgroup's swizzled [64][64] tile (bwd_item.cuh)
    bwd_store_dst(sDs0 + wg * S::kDs, da, warp, g, t4);
    fence_proxy_async();
    __syncthreads();  // both warpgroups' dS^T tiles in shared memory, visible to the tensor cores

    // dQ(i)[:, 64 wg .. +64]: k-steps over key tile t (16 keys each); B = key tile t's column block wg.
    float dq[8][4];
    wg_fence();
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_ss_n64_tt(dq, desc_mn<kTileK>(sDs0 + t * S::kDs, kk),
                        desc_mn<kTileK>(sK0 + t * S::kTile + wg * (kTileK * 128), kk), (t | kk) > 0);
    wg_commit();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dk, da[kk], desc_mn<kTileQ>(sQ, kk));
    wg_commit();
    wg_wait<1>();  // dV(i) and dQ(i) done (pa free); dK(i) runs on under the next item's S^T, dP^T
    reg_fence(dv);
    reg_fence(dq);
    reg_fence_a(pa);
    if constexpr (kFix) {  // rows 16 warp + g and + 8 of the item, each at its fixed-point scale
      const float sa = sD[kTileQ + warp * 16 + g], sb = sD[kTileQ + warp * 16 + g + 8];  // after delta
      int4* dst = reinterpret_cast<int4*>(gbase + S::kDq0 + buf * S::kDq) + wg * 8 * 128 + wt;
#pragma unroll
      for (int j = 0; j < 8; ++j)
        dst[j * 128] = make_int4(__float2int_rn(dq[j][0] * sa), __float2int_rn(dq[j][1] * sa),
                                 __float2int_rn(dq[j][2] * sb), __float2int_rn(dq[j][3] * sb));
    } else {
      float4* dst = reinterpret_cast<float4*>(gbase + S::kDq0 + buf * S::kDq) + wg * 8 * 128 + wt;
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
    }
    fence_proxy_async();  // the partial, seen by the bulk copy thread 0 issues after the next barrier
    prev = item;
    item = nxt;
    buf ^= 1;
  }
  wg_wait<0>();
  reg_fence(dk);
  reg_fence_a(da);
  cp_async_wait<0>();
  __syncthreads();  // every thread's last partial written
  if (tid == 0) {
    if (prev >= 0) bulk_add<kFix>(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // done before the CTA's memory goes
  }

  bf16* dko = static_cast<bf16*>(p.dk) + b * p.dk_sb + hk * p.dk_sh;
  bf16* dvo = static_cast<bf16*>(p.dv) + b * p.dv_sb + hk * p.dv_sh;
  if (keyA < p.kv_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      store_bf16x2(dko + (int64_t)keyA * p.dk_sr + i * 8 + 2 * t4, dk[i][0] * p.scale, dk[i][1] * p.scale);
      store_bf16x2(dvo + (int64_t)keyA * p.dv_sr + i * 8 + 2 * t4, dv[i][0], dv[i][1]);
    }
  }
  if (keyB < p.kv_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      store_bf16x2(dko + (int64_t)keyB * p.dk_sr + i * 8 + 2 * t4, dk[i][2] * p.scale, dk[i][3] * p.scale);
      store_bf16x2(dvo + (int64_t)keyB * p.dv_sr + i * 8 + 2 * t4, dv[i][2], dv[i][3]);
    }
  }
#endif
}

}  // namespace

// Launches the fused pass (d = 128 only; bwd.cu checks). p.dq_accum must be zeroed.
namespace {
std::atomic<int64_t> g_fused_tma_launches{0};
}  // namespace

// tma: load Q and dO by TMA where the tensors allow it (DFLASH_ATTN_FUSED_TMA, read in bwd.cu); p.dq_row_scale set:
// the fixed-point sum.
void launch_bwd_fused(const AttnParams& p, bool tma, void* stream) {
  constexpr int smem = FusedSmem::kBytes;
  QdoMaps maps{};
  tma = tma && qdo_maps(p, &maps);
  const bool fix = p.dq_row_scale != nullptr;
  auto kern = tma ? (fix ? attn_bwd_fused_kernel<true, true> : attn_bwd_fused_kernel<true, false>)
                  : (fix ? attn_bwd_fused_kernel<false, true> : attn_bwd_fused_kernel<false, false>);
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kern<<<dim3((p.meta.nkt + 1) / 2, p.Hkv, p.B), kFThreads, smem, static_cast<cudaStream_t>(stream)>>>(p, maps);
  DFLASH_CHECK_LAUNCH(tma ? "attention backward fused dk/dv/dq (wgmma, TMA loads)"
                          : "attention backward fused dk/dv/dq (wgmma)");
  if (tma) g_fused_tma_launches.fetch_add(1, std::memory_order_relaxed);
}

int64_t fused_tma_launch_count() { return g_fused_tma_launches.load(std::memory_order_relaxed); }

}  // namespace dflash::attention
