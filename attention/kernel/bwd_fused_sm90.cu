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
// 64 w + 8 j + 2 (t % 4) + e % 2); bwd.cu's conversion kernel reads it back (dq_accum_index()). The sum's
// order, and so dQ's last bits, varies from run to run; dK and dV equal the split backward's bitwise.
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

// ws_sm90.cu: [B, H, rows, D] bf16 as a 4-d TMA map with 64 x 64 boxes in the 128-byte swizzle; false
// where TMA cannot describe the tensor.
bool tile_map(CUtensorMap* m, const void* ptr, int64_t B, int64_t H, int64_t rows, int D, int64_t sb, int64_t sh,
              int64_t sr);

namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kFThreads = 256;  // two warpgroups
constexpr int kFD = 128;        // head dim (d = 64 runs the split backward)

struct FusedSmem {
  static constexpr int kTile = kTileQ * kFD * 2;                            // a 64-row bf16 tile: 16 KB
  static constexpr int kStage = 2 * kTile + kTileQ * 16 + 2 * kTileQ * 4;   // Q, dO, row records, LSE, delta
  static constexpr int kStageAligned = (kStage + 1023) / 1024 * 1024;
  static constexpr int kDs = kTileK * kTileQ * 2;                           // one warpgroup's dS^T: 8 KB
  static constexpr int kDq = kTileQ * kFD * 4;                              // an item's dQ partial: 32 KB
  static constexpr int kK = 0, kV = 2 * kTile, kStage0 = 4 * kTile;        // K, V: one tile per warpgroup
  static constexpr int kDs0 = kStage0 + 2 * kStageAligned, kDq0 = kDs0 + 2 * kDs;
  static constexpr int kBar = kDq0 + 2 * kDq;                               // full[2] (TMA loads)
  static constexpr int kBytes = 1024 + kBar + 16;                           // +1024: base alignment
  // Decoupled warpgroups (mode 2): dS^T tiles [buffer][warpgroup] (kDs0 + (2 b + w) kDs), each warpgroup's
  // 16 KB half of the partial (kDqD0 + w kDqHalf), then ten mbarriers: full[2], empty[2],
  // dsfull[w][b] (at 4 w + 2 b... see kBarDsFull), dsfree[2].
  static constexpr int kDqHalf = kDq / 2;
  static constexpr int kDqD0 = kDs0 + 4 * kDs;
  static constexpr int kBarD = kDqD0 + 2 * kDqHalf;
  static constexpr int kBytesD = 1024 + kBarD + 10 * 8;
};
static_assert(FusedSmem::kBytes <= 227 * 1024, "fused backward: shared memory");
static_assert(FusedSmem::kBytesD <= 227 * 1024, "fused backward (decoupled): shared memory");
static_assert(FusedSmem::kK == 0 && FusedSmem::kV == 2 * FusedSmem::kTile, "fused backward: K, V tiles first");

[[maybe_unused]] __device__ __forceinline__ void bulk_add_f32(float* gdst, uint32_t ssrc, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gdst), "r"(ssrc),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

struct FusedMaps {
  CUtensorMap q, dout;  // [B, Hq, q_len, D] as 4-d (D, rows, H, B), boxes of 64 x 64 (kTma only)
};

// kMode 0: cp.async loads; 1: TMA loads; 2: TMA loads and decoupled warpgroups (see the loop below); 3: 2, with
// warpgroup 1 starting each item after warpgroup 0 has issued its dV; 4: 3, and warpgroup 0 starting each item
// after warpgroup 1 has issued the previous item's dV (the two alternate).
template <int kMode>
__global__ void __launch_bounds__(kFThreads, 1)
    attn_bwd_fused_kernel(const AttnParams p, const __grid_constant__ FusedMaps maps) {
#ifdef DFLASH_WGMMA
  constexpr int D = kFD;
  constexpr bool kTma = kMode >= 1;
  constexpr bool kDec = kMode >= 2;  // decoupled warpgroups (modes 3, 4: with an imposed order, see the loop)
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
  auto qt_of = [&](int i) { return qt0 + qdir * (i / G); };
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
    const int qt = qt_of(i), h = hk * G + i % G;
    return p.dq_accum + (((int64_t)b * p.Hq + h) * nqt + qt) * (kTileQ * D);
  };

  const uint32_t sK0 = base + S::kK, sK = sK0 + wg * S::kTile, sV = base + S::kV + wg * S::kTile;
  const uint32_t sStage0 = base + S::kStage0, sDs0 = base + S::kDs0, sDq0 = base + S::kDq0;
  const uint32_t sBar0 = base + (kDec ? S::kBarD : S::kBar);  // full[buf] at sBar0 + 8 buf
  unsigned char* stage_ptr0 = gbase + S::kStage0;

  auto load_item = [&](int i, int buf) {
    const int qt = qt_of(i), h = hk * G + i % G;
    const int m0 = qt * kTileQ;
    const uint32_t st = sStage0 + buf * S::kStageAligned;
    if constexpr (kTma) {
      if (tid == (kDec ? 128 : 0)) {  // mode 2: warpgroup 1 loads
        const uint32_t full = sBar0 + 8 * buf;
        mbar_arrive_expect_tx(full, 2 * S::kTile);
        tma_tile<D>(st, &maps.q, m0, h, b, full);
        tma_tile<D>(st + S::kTile, &maps.dout, m0, h, b, full);
      }
    } else {
      load_tile_w<kTileQ, D, kFThreads>(st, static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh, p.q_sr, m0,
                                        p.q_len, tid);
      load_tile_w<kTileQ, D, kFThreads>(st + S::kTile,
                                        static_cast<const bf16*>(p.dout) + b * p.do_sb + h * p.do_sh, p.do_sr, m0,
                                        p.q_len, tid);
    }
    const uint32_t sRows = st + 2 * S::kTile, sL = sRows + kTileQ * 16, sD = sL + kTileQ * 4;
    const int64_t lo = ((int64_t)b * p.Hq + h) * p.q_len;
    const int li = kDec ? wt : tid;  // mode 2: warpgroup 1's threads, each arriving on full[buf] below
    if (li < kTileQ) {
      cp_async16(sRows + li * 16, rows + m0 + li, true);
      const bool ok = m0 + li < p.q_len;
      cp_async4(sL + li * 4, p.lse + (ok ? lo + m0 + li : 0), ok);
    } else if (li < 2 * kTileQ) {
      const int r = li - kTileQ;
      const bool ok = m0 + r < p.q_len;
      cp_async4(sD + r * 4, p.delta + (ok ? lo + m0 + r : 0), ok);
    }
    if constexpr (kDec) cp_async_mbar_arrive_noinc(sBar0 + 8 * buf);
  };

  // mode 2's barriers (S::kBarD): full[b] (the loader's expect_tx and warpgroup 1's 128 cp.async arrivals),
  // empty[b] (all 256 threads: done with the stage), dsfull[w][b] (warpgroup w's 128 threads: dS^T stored),
  // dsfree[b] (all 256: both dQ products that read dS^T buffer b done)
  auto bar_full = [&](int b) { return sBar0 + 8 * b; };
  auto bar_empty = [&](int b) { return sBar0 + 16 + 8 * b; };
  auto bar_dsfull = [&](int w, int b) { return sBar0 + 32 + 16 * w + 8 * b; };
  auto bar_dsfree = [&](int b) { return sBar0 + 64 + 8 * b; };
  if constexpr (kDec) {
    if (tid == 0) {
      for (int b = 0; b < 2; ++b) {
        mbar_init(bar_full(b), 1 + 128);
        mbar_init(bar_empty(b), 256);
        mbar_init(bar_dsfull(0, b), 128);
        mbar_init(bar_dsfull(1, b), 128);
        mbar_init(bar_dsfree(b), 256);
      }
      fence_mbar_init();
    }
  } else if constexpr (kTma) {
    if (tid == 0) {
      mbar_init(sBar0, 1);  // the loader's expect_tx
      mbar_init(sBar0 + 8, 1);
      fence_mbar_init();
    }
  }
  load_tile_w<kTileK, D, 128>(sK, k, p.k_sr, nw, p.kv_len, wt);
  load_tile_w<kTileK, D, 128>(sV, v, p.v_sr, nw, p.kv_len, wt);
  int item = next_item(0);
  if (!kDec && item < nitems) load_item(item, 0);
  cp_async_commit();
  if constexpr (kTma) {  // K, V and the first item's row records in shared memory; the barriers initialised
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  }
  if (kDec && wg == 1 && item < nitems) load_item(item, 0);

  const int g = lane >> 2, t4 = lane & 3;
  const int keyA = nw + warp * 16 + g, keyB = keyA + 8;
  const float sl2 = p.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

  if constexpr (kDec) {
    // Decoupled warpgroups. The two warpgroups exchange dS^T through two buffers and shared-memory
    // barriers instead of block barriers, and warpgroup 0 adds dQ one item late, so that neither waits for
    // the other within an item: warpgroup 1 computes dQ(n)[:, 64 .. 128) as soon as warpgroup 0 has stored
    // dS^T(n), warpgroup 0 computes dQ(n-1)[:, 0 .. 64) after storing dS^T(n), from the dS^T(n-1) both
    // stored an item ago. Warpgroup 1 may thus trail warpgroup 0 by up to an item, and each one's
    // exponentials and dS work can run under the other's products (one CTA per SM). Each warpgroup adds its
    // own 16 KB half of an item's partial (the half its columns fill in the fragment order) by one bulk
    // reduce-add; warpgroup 1 loads the stages (it is the later one to free them). Step n, s = n & 1:
    //   wait full[s]; S^T(n), dP^T(n); wait S^T (dK(n-1) done) -> arrive empty[s^1];
    //   warpgroup 1: wait empty[s^1] (item n-1 freed by both), load item n+1 into stage s^1;
    //   P^T, dV(n); wait dP^T; dS^T; wait dsfree[s] (item n-2's dS^T read by both dQ products);
    //   dS^T -> buffer s, arrive dsfull[w][s] and sync the warpgroup; wait the other's dsfull of the dQ item
    //   (warpgroup 1: item n, buffer s; warpgroup 0: item n-1, buffer s^1); dQ, dK(n); wait<1>: dV, dQ done;
    //   arrive dsfree of the dQ item's buffer; the partial -> this warpgroup's half, sync, bulk add.
    // Every barrier is waited at most one phase behind (each wait precedes the arrivals that would complete
    // the barrier's next phase), so a parity names its phase. dK, dV: the same products in the same order as
    // modes 0 and 1 (bit-identical); dQ: the same per-item partials, added in another order.
    const int ow = wg ^ 1;  // the other warpgroup
    auto wg_sync = [](int w) {  // named barrier 1 + w over warpgroup w (constant ids: ptxas reserves 16 otherwise)
      if (w == 0) named_sync(1, 128);
      else named_sync(2, 128);
    };
    const uint32_t sDqW = base + S::kDqD0 + wg * S::kDqHalf;
    int n = 0, prev = -1;
    uint32_t da[4][4];  // dS^T(n-1): A operand of dK(n-1), in flight into step n
    while (item < nitems) {
      const int s = n & 1;
      const uint32_t u = (n >> 1) & 1;
      const int cand = item + 1;
      const int4 tq_cand = cand < nitems ? qtiles[qt_of(cand)] : make_int4(0, 0, 0, 0);
      mbar_wait(bar_full(s), u);
      // modes 3, 4: named barrier 3 = warpgroup 0's dV(n) issued (warpgroup 1 waits for it here), 4 = warpgroup
      // 1's dV(n-1) issued (mode 4: warpgroup 0 waits); each is arrived at once per item before its wait
      // (neither warpgroup can arrive twice before the other has waited: each arrival follows a wait on the other)
      // Warpgroup 1 then frees item n-1's stage and loads item n+1 before that wait (its dK(n-1) finishing while
      // it would wait anyway), which gives the load the time of warpgroup 0's first half item more.
      const int nxt = cand >= nitems ? nitems : valid_tq(tq_cand) ? cand : next_item(cand + 1);
      if constexpr (kMode >= 3) {
        if (wg == 1) {
          wg_wait<0>();  // dK(n-1) done
          reg_fence(dk);
          reg_fence_a(da);
          if (n >= 1) mbar_arrive(bar_empty(s ^ 1));
          if (nxt < nitems) {
            if (n >= 1) mbar_wait(bar_empty(s ^ 1), ((n - 1) >> 1) & 1);
            load_item(nxt, s ^ 1);
          }
          named_sync(3, 256);
        } else if (kMode == 4 && n >= 1) {
          named_sync(4, 256);
        }
      }
      const uint32_t sQ = sStage0 + s * S::kStageAligned, sdO = sQ + S::kTile;
      const unsigned char* stp = stage_ptr0 + s * S::kStageAligned + 2 * S::kTile;
      const int4* sRows = reinterpret_cast<const int4*>(stp);
      const float* sL = reinterpret_cast<const float*>(stp + kTileQ * 16);
      const float* sD = sL + kTileQ;

      float st[8][4], dpt[8][4];
      wg_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        wgmma_ss_n64(st, desc_k<kTileK>(sK, ks), desc_k<kTileQ>(sQ, ks), ks > 0);
      wg_commit();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks)
        wgmma_ss_n64(dpt, desc_k<kTileK>(sV, ks), desc_k<kTileQ>(sdO, ks), ks > 0);
      wg_commit();
      wg_wait<1>();  // S^T(n) done, and before it dK(n-1): this thread is done with item n-1's stage
      reg_fence(st);
      reg_fence(dk);
      reg_fence_a(da);
      if (kMode == 2 || wg == 0) {
        if (n >= 1) mbar_arrive(bar_empty(s ^ 1));
        if (kMode == 2 && wg == 1 && nxt < nitems) {
          if (n >= 1) mbar_wait(bar_empty(s ^ 1), ((n - 1) >> 1) & 1);
          load_item(nxt, s ^ 1);
        }
      }

      bwd_mask_st(st, sRows, nw + warp * 16, lane, t4, keyA, keyB);
      uint32_t pa[4][4];
      bwd_p_from_st(st, sL, t4, sl2, pa);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dv, pa[kk], desc_mn<kTileQ>(sdO, kk));
      wg_commit();
      if constexpr (kMode >= 3) {
        if (wg == 0) named_arrive(3, 256);
        else if (kMode == 4 && nxt < nitems) named_arrive(4, 256);  // (warpgroup 0 waits only for a next item)
      }
      wg_wait<1>();
      reg_fence(dpt);
      bwd_ds_from_dpt(dpt, sD, t4, pa, da);

      if (n >= 2) mbar_wait(bar_dsfree(s), u ^ 1);  // item n-2's dS^T, in buffer s, read by both dQ products
      const uint32_t sDs = sDs0 + (2 * s + wg) * S::kDs;
      const int ra = warp * 16 + g, rb = ra + 8;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk) + 4 * t4), "r"(da[kk][0]));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk) + 4 * t4), "r"(da[kk][1]));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk + 1) + 4 * t4), "r"(da[kk][2]));
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk + 1) + 4 * t4), "r"(da[kk][3]));
      }
      fence_proxy_async();
      // the previous bulk add has read this warpgroup's partial half (the sync below tells the others)
      if (wt == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      mbar_arrive(bar_dsfull(wg, s));
      wg_sync(wg);  // this warpgroup's dS^T(n) stored (its dQ reads all four warps' rows)

      // dQ of item m = n (warpgroup 1) or n - 1 (warpgroup 0), from dS^T buffer m & 1
      const int m = n - ow;
      const bool has_dq = m >= 0;
      const int mb = m & 1;
      // (warpgroup 0 at n = 0 runs it too, on whatever buffer 1 holds, and drops it: a wgmma under a branch
      // costs ptxas's register allocation more than one product per CTA)
      float dq[8][4];
      if (has_dq) mbar_wait(bar_dsfull(ow, mb), (m >> 1) & 1);
      wg_fence();
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss_n64_tt(dq, desc_mn<kTileK>(sDs0 + (2 * mb + t) * S::kDs, kk),
                          desc_mn<kTileK>(sK0 + t * S::kTile + wg * (kTileK * 128), kk), (t | kk) > 0);
      wg_commit();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dk, da[kk], desc_mn<kTileQ>(sQ, kk));
      wg_commit();
      wg_wait<1>();  // dV(n) and dQ(m) done (pa free); dK(n) runs on under the next item's S^T, dP^T
      reg_fence(dv);
      reg_fence(dq);
      reg_fence_a(pa);
      if (has_dq) {
        mbar_arrive(bar_dsfree(mb));
        float4* dst = reinterpret_cast<float4*>(gbase + S::kDqD0 + wg * S::kDqHalf) + wt;
#pragma unroll
        for (int j = 0; j < 8; ++j) dst[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
        fence_proxy_async();
        wg_sync(wg);
        if (wt == 0) bulk_add_f32(dq_tile(wg == 1 ? item : prev) + wg * (S::kDqHalf / 4), sDqW, S::kDqHalf);
      }
      prev = item;
      item = nxt;
      ++n;
    }
    // warpgroup 0: the last item's dQ
    if (wg == 0 && n >= 1) {
      const int m = n - 1, mb = m & 1;
      float dq[8][4];
      mbar_wait(bar_dsfull(1, mb), (m >> 1) & 1);
      wg_fence();
#pragma unroll
      for (int t = 0; t < 2; ++t)
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_ss_n64_tt(dq, desc_mn<kTileK>(sDs0 + (2 * mb + t) * S::kDs, kk),
                          desc_mn<kTileK>(sK0 + t * S::kTile, kk), (t | kk) > 0);
      wg_commit();
      wg_wait<0>();
      reg_fence(dq);
      if (wt == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      named_sync(1, 128);
      float4* dst = reinterpret_cast<float4*>(gbase + S::kDqD0) + wt;
#pragma unroll
      for (int j = 0; j < 8; ++j) dst[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
      fence_proxy_async();
      named_sync(1, 128);
      if (wt == 0) bulk_add_f32(dq_tile(prev), sDqW, S::kDqHalf);
    }
    wg_wait<0>();
    reg_fence(dk);
    reg_fence_a(da);
    if (wt == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // done before the CTA's memory goes
  } else {
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
      if (tid == 0 && prev >= 0) bulk_add_f32(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    }
    const uint32_t sQ = sStage0 + buf * S::kStageAligned, sdO = sQ + S::kTile;
    const unsigned char* stp = stage_ptr0 + buf * S::kStageAligned + 2 * S::kTile;
    const int4* sRows = reinterpret_cast<const int4*>(stp);
    const float* sL = reinterpret_cast<const float*>(stp + kTileQ * 16);
    const float* sD = sL + kTileQ;

    float st[8][4], dpt[8][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss_n64(st, desc_k<kTileK>(sK, ks), desc_k<kTileQ>(sQ, ks), ks > 0);
    wg_commit();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss_n64(dpt, desc_k<kTileK>(sV, ks), desc_k<kTileQ>(sdO, ks), ks > 0);
    wg_commit();
    wg_wait<1>();  // S^T(i) done, and before it dK(i-1)
    reg_fence(st);
    reg_fence(dk);
    reg_fence_a(da);
    if constexpr (kTma) {
      if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // item i-2's add read buf
      cp_async_wait<0>();  // this item's row records, LSE, delta
    }
    __syncthreads();  // every warp is past dK(i-1): item i-1's stage buffer may be refilled
    if constexpr (kTma) {
      if (tid == 0 && prev >= 0) bulk_add_f32(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    }
    const int nxt = cand >= nitems ? nitems : valid_tq(tq_cand) ? cand : next_item(cand + 1);
    if (nxt < nitems) load_item(nxt, buf ^ 1);
    cp_async_commit();

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

    // dS^T rows (keys) 16 warp + g (+8), columns (query rows) 16 kk + 2 t4 (+8): 4-byte stores into
    // this warpgroup's swizzled [64][64] tile; 8 rows x 4 words per instruction hit 32 distinct banks.
    const uint32_t sDs = sDs0 + wg * S::kDs;
    const int ra = warp * 16 + g, rb = ra + 8;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk) + 4 * t4), "r"(da[kk][0]));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk) + 4 * t4), "r"(da[kk][1]));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(ra, 2 * kk + 1) + 4 * t4), "r"(da[kk][2]));
      asm volatile("st.shared.b32 [%0], %1;" ::"r"(sDs + swz_w<kTileK>(rb, 2 * kk + 1) + 4 * t4), "r"(da[kk][3]));
    }
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
    float4* dst = reinterpret_cast<float4*>(gbase + S::kDq0 + buf * S::kDq) + wg * 8 * 128 + wt;
#pragma unroll
    for (int j = 0; j < 8; ++j) dst[j * 128] = make_float4(dq[j][0], dq[j][1], dq[j][2], dq[j][3]);
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
    if (prev >= 0) bulk_add_f32(dq_tile(prev), sDq0 + (buf ^ 1) * S::kDq, S::kDq);
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // done before the CTA's memory goes
  }
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
std::atomic<int64_t> g_fused_tma_launches{0}, g_fused_decoupled_launches{0};
}  // namespace

// mode (DFLASH_ATTN_FUSED_TMA, read in bwd.cu): 0 cp.async loads; 1 Q and dO by TMA; 2-4 by TMA with decoupled
// warpgroups (3, 4: in an imposed order). 1-4 run as 0 where a tensor map cannot describe q or dO.
void launch_bwd_fused(const AttnParams& p, int mode, void* stream) {
  FusedMaps maps{};
  const bool tma = mode > 0 && tile_map(&maps.q, p.q, p.B, p.Hq, p.q_len, p.d, p.q_sb, p.q_sh, p.q_sr) &&
                   tile_map(&maps.dout, p.dout, p.B, p.Hq, p.q_len, p.d, p.do_sb, p.do_sh, p.do_sr);
  if (!tma) mode = 0;
  const int smem = mode >= 2 ? FusedSmem::kBytesD : FusedSmem::kBytes;
  auto kern = mode == 4   ? attn_bwd_fused_kernel<4>
              : mode == 3 ? attn_bwd_fused_kernel<3>
              : mode == 2 ? attn_bwd_fused_kernel<2>
              : mode == 1 ? attn_bwd_fused_kernel<1>
                          : attn_bwd_fused_kernel<0>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kern<<<dim3((p.meta.nkt + 1) / 2, p.Hkv, p.B), kFThreads, smem, static_cast<cudaStream_t>(stream)>>>(p, maps);
  DFLASH_CHECK_LAUNCH(mode >= 2   ? "attention backward fused dk/dv/dq (wgmma, TMA loads, decoupled warpgroups)"
                      : mode == 1 ? "attention backward fused dk/dv/dq (wgmma, TMA loads)"
                                  : "attention backward fused dk/dv/dq (wgmma)");
  if (mode > 0) g_fused_tma_launches.fetch_add(1, std::memory_order_relaxed);
  if (mode >= 2) g_fused_decoupled_launches.fetch_add(1, std::memory_order_relaxed);
}

int64_t fused_tma_launch_count() { return g_fused_tma_launches.load(std::memory_order_relaxed); }
int64_t fused_decoupled_launch_count() { return g_fused_decoupled_launches.load(std::memory_order_relaxed); }

}  // namespace dflash::attention
