// Forward and dQ pass of the DFlash attention with two query heads per CTA on a TMA K/V ring
// (Hopper, sm_90a): forward variants 7 (8: the same with ping-pong between the warpgroups) and 13
// (the default: 7 on 128-key tiles), and dQ variants 7 (a late-wait schedule, below) and 8 (the
// default: 7 with Q in registers).
//
// One CTA per (64-row query tile, pair of query heads 2i and 2i+1 of one KV head), two warpgroups
// (256 threads), warpgroup wg computing head 2i + wg with the products of the one-warpgroup kernels
// in fwd_sm90.cu (forward variant 5, dQ variant 4). Both heads walk the same key tiles (one KV head,
// one query tile, one mask), so each K/V tile comes from L2 once per pair of heads instead of once
// per head (ncu: the one-head forward kept L2 77% busy; the ring halves that, kernel/NOTES.md). The
// tiles arrive by TMA in a ring of kStages buffers, each with a "full" mbarrier; a warp done with a
// buffer counts itself out on a shared counter, and the warp that completes the count (the 8th)
// issues the buffer's next tile at once. No producer warp: a ninth warp would put three warps on
// one SM quadrant, whose 16K registers then cap every thread at 168 (the forward needs ~175; the
// launch fails with "too many resources" above that). No block-wide barrier after the start, so
// the warpgroups may run up to kStages - 1 tiles apart (a ring of 6 measured slower, NOTES v6).
// PINGPONG (forward variant 8): named barriers make the two warpgroups take turns to issue their
// products, so that one's softmax runs while the other's products occupy the tensor cores.
// Results are bit-identical to the one-warpgroup kernels (same operands, same k-step order).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <atomic>
#include <cstdint>

#include "attention/kernel.h"
#include "attention/kernel/common.cuh"
#include "attention/kernel/tile_math.cuh"
#include "attention/kernel/tma.cuh"
#include "attention/kernel/wgmma.cuh"
#include "core/launch_check.h"

namespace dflash::attention {
namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kStages = 4;
constexpr int kWsThreads = 256;

struct WsMaps {
  CUtensorMap q, k, v, dout;  // [B, H, rows, D] as 4-d (D, rows, H, B), boxes of 64 x 64
};

// Shared memory: NQ per-head tiles (Q for 2 heads; dQ pass: Q and dO for 2 heads), then the ring
// (K, V per stage, KR keys each; ST stages), then the mbarriers full[ST] and one for the per-head
// tiles, then the per-stage release counters.
template <int D, int NQ, int ST = kStages, int KR = kTileK>
struct WsSmem {
  static constexpr int kTile = kTileQ * D * 2;  // a per-head tile
  static constexpr int kKV = KR * D * 2;        // a K or V tile of the ring
  static constexpr int kRing = NQ * kTile;
  static constexpr int kBars = kRing + 2 * ST * kKV;
  static constexpr int kCounts = kBars + 8 * (ST + 1);
  static constexpr int kBytes = 1024 + kCounts + 4 * ST;
  static_assert(kBytes <= 227 * 1024, "ring does not fit in shared memory");
};

// K and V of key tile t (first key n0) into ring buffer t % ST (one thread).
template <int D, int NQ, int ST, int KR = kTileK>
__device__ __forceinline__ void load_kv(const WsMaps& maps, uint32_t base, int t, int n0, int hk, int b) {
  using S = WsSmem<D, NQ, ST, KR>;
  const int st = t % ST;
  const uint32_t full = base + S::kBars + 8 * st, sK = base + S::kRing + 2 * st * S::kKV;
  mbar_arrive_expect_tx(full, 2 * S::kKV);
  tma_tile<D, KR>(sK, &maps.k, n0, hk, b, full);
  tma_tile<D, KR>(sK + S::kKV, &maps.v, n0, hk, b, full);
}

// Thread 0, at the start: the barriers; the per-head tiles (NQ: Q of heads h0, h0 + 1, then dO of
// both) on the last barrier; the first ST key tiles.
template <int D, int NQ, int ST = kStages, int KR = kTileK>
__device__ __forceinline__ void ws_start(const WsMaps& maps, uint32_t base, int tid, int m0, int h0, int hk, int b,
                                         const KeyWalkN<KR>& walk) {
  using S = WsSmem<D, NQ, ST, KR>;
  const uint32_t bars = base + S::kBars, qbar = bars + 8 * ST;
  if (tid == 0) {
    for (int i = 0; i < ST; ++i) mbar_init(bars + 8 * i, 1);  // the loader's expect_tx
    mbar_init(qbar, 1);
    for (int i = 0; i < ST; ++i) st_shared_u32(base + S::kCounts + 4 * i, 0);
    fence_mbar_init();
    mbar_arrive_expect_tx(qbar, NQ * S::kTile);
#pragma unroll
    for (int i = 0; i < NQ; ++i)
      tma_tile<D>(base + i * S::kTile, i < 2 ? &maps.q : &maps.dout, m0, h0 + (i & 1), b, qbar);
    for (int t = 0; t < ST && t < walk.ntiles; ++t) load_kv<D, NQ, ST, KR>(maps, base, t, walk.start(t), hk, b);
  }
  __syncthreads();
}

// This warp is done with key tile t's buffer (every read of it retired). The 8th warp to say so
// refills the buffer with tile t + ST.
template <int D, int NQ, int ST = kStages, int KR = kTileK>
__device__ __forceinline__ void ws_release(const WsMaps& maps, uint32_t base, int lane, int t, int hk, int b,
                                           const KeyWalkN<KR>& walk) {
  using S = WsSmem<D, NQ, ST, KR>;
  if (lane == 0) {
    const uint32_t cnt = base + S::kCounts + 4 * (t % ST);
    if (atom_add_acq_rel_shared(cnt, 1) == 7) {
      st_shared_u32(cnt, 0);
      if (t + ST < walk.ntiles) {
        fence_proxy_async();
        load_kv<D, NQ, ST, KR>(maps, base, t + ST, walk.start(t + ST), hk, b);
      }
    }
  }
  __syncwarp();
}

// A ring kernel's coordinates: the query tile (heavy, late-anchor tiles first when sorted), the
// pair of query heads h0, h0 + 1 and their KV head, the tile's key walk; this thread's warpgroup wg
// (head h = h0 + wg), its warp w there, and its rows ra and ra + 8 with their metadata records.
struct WsCta {
  int lane, wg, w, t4, qt, h0, h, hk, b, m0, ra;
  int4 rowA, rowB;
  KeyWalk walk;
  __device__ __forceinline__ explicit WsCta(const AttnParams& p)
      : lane(threadIdx.x & 31),
        wg(threadIdx.x >> 7),
        w((threadIdx.x >> 5) & 3),
        t4(lane & 3),
        qt(p.meta.nqt - 1 - (int)blockIdx.x),
        h0(2 * blockIdx.y),
        h(h0 + wg),
        hk(h0 / (p.Hq / p.Hkv)),
        b(blockIdx.z),
        m0(qt * kTileQ),
        ra(m0 + w * 16 + (lane >> 2)),
        walk(reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * p.meta.nqt + qt]) {
    const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * p.meta.nqt * kTileQ;
    rowA = rows[ra];
    rowB = rows[ra + 8];
  }
};

// The last tile's P V (V at v, KR keys), retired: the forward's final product.
template <int D, int KR>
__device__ __forceinline__ void fwd_last_pv(float (&o)[D / 8][4], uint32_t (&pa)[KR / 16][4], uint32_t v) {
  reg_fence(o);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < KR / 16; ++kk) wgmma_rs_nd_tb<D>(o, pa[kk], desc_mn<KR>(v, kk));
  wg_commit();
  wg_wait<0>();
  reg_fence(o);
  reg_fence_a(pa);
}

template <int D, bool PINGPONG>
__global__ void __launch_bounds__(kWsThreads, 1) attn_fwd_ws_kernel(const AttnParams p, const __grid_constant__ WsMaps maps) {
#ifdef DFLASH_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WsSmem<D, 2>;
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const WsCta c(p);
  const int lane = c.lane, wg = c.wg, w = c.w, t4 = c.t4, hk = c.hk, b = c.b;
  const KeyWalk& walk = c.walk;
  const int ntiles = walk.ntiles;
  const uint32_t bars = base + S::kBars;
  ws_start<D, 2>(maps, base, threadIdx.x, c.m0, c.h0, hk, b, walk);

  // Warpgroup wg computes query head h0 + wg. Iteration t issues S(t) = Q K(t)^T and
  // O += P(t-1) V(t-1) (fwd_sm90.cu's variant 5), and releases tile t-1's buffer once
  // P(t-1) V(t-1) has retired.
  const uint32_t sQ = base + wg * S::kTile;
  auto sK = [&](int t) { return base + S::kRing + 2 * (t % kStages) * S::kTile; };
  const float sl2 = p.scale * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  uint32_t pa[4][4];
  uint32_t qa[D / 16][4];
  mbar_wait(bars + 8 * kStages, 0);  // Q has landed
  // Converged again before the fragments are loaded: register A operands defined where ptxas cannot
  // prove the warp converged (after the wait loop) make it serialise every wgmma (seen in SASS).
  __syncwarp();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) load_a_w<kTileQ>(sQ, w, ks, lane, qa[ks]);
  // Ping-pong: warpgroup wg issues after `bar.sync 1 + wg` and lets the other one go with
  // `bar.arrive 2 - wg`; warpgroup 1 starts by letting warpgroup 0 go first.
  if (PINGPONG && wg == 1 && ntiles > 0) named_arrive(1, kWsThreads);

  for (int t = 0; t < ntiles; ++t) {
    const uint32_t k_t = sK(t);
    mbar_wait(bars + 8 * (t % kStages), (t / kStages) & 1);
    const int n0 = walk.start(t);
    const bool ctx = walk.ctx(t);
    if (PINGPONG) named_sync(1 + wg, kWsThreads);
    float s[8][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma_rs_n64_kb(s, qa[ks], desc_k<kTileK>(k_t, ks), ks > 0);
    wg_commit();
    if (t > 0) {
      reg_fence(o);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(o, pa[kk], desc_mn<kTileK>(sK(t - 1) + S::kTile, kk));
      wg_commit();
      if (PINGPONG) named_arrive(2 - wg, kWsThreads);
      wg_wait<1>();
    } else {
      if (PINGPONG) named_arrive(2 - wg, kWsThreads);
      wg_wait<0>();
    }
    reg_fence(s);

    mask_tile(s, n0, ctx, c.rowA, c.rowB, t4);
    float cA, cB;
    uint32_t pn[4][4];
    const bool keep_o = softmax_step(s, mA, mB, lA, lB, sl2, p.rescale_slack, pn, cA, cB);
    wg_wait<0>();  // P(t-1) V(t-1) done: tile t-1's buffer is released
    reg_fence(o);
    reg_fence_a(pa);
    if (t > 0) ws_release<D, 2>(maps, base, lane, t - 1, hk, b, walk);
    if (!keep_o) scale_rows(o, cA, cB);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pn[kk][r];
  }
  if (PINGPONG && wg == 0 && ntiles > 0) named_sync(1, kWsThreads);  // warpgroup 1's last arrival
  if (ntiles > 0) fwd_last_pv<D, kTileK>(o, pa, sK(ntiles - 1) + S::kTile);

  store_fwd_rows<D>(p, b, c.h, c.ra, t4, o, mA, mB, lA, lB, sl2);
#endif
}

// Forward variant 13: variant 7 on 128-key tiles. Each warpgroup's step covers 128 keys: S is eight
// m64n128 products (Q in registers, K from a 128-row ring tile), one online-softmax step (row maxima,
// the keep-or-rescale decision, the buffer's mbarrier wait and release) per 128 keys instead of per
// 64, and P V eight m64nD k-steps over the tile. Half the per-tile fixed work and wgmma waits of
// variant 7 for the same products, at ~30 more registers (S 64, P 32). The ring holds three stages of
// 128 keys (64 KB each at d = 128: 224 KB with Q). The key walk is in 128-key steps, so a region
// whose length is not a multiple of 128 ends in a partly masked tile (the DFlash block region: one
// 64-key tile's worth per query tile, against hundreds of context tiles at the long shape).
// Not bit-identical to variant 7 (the running maxima advance per 128 keys, so P is rounded at other
// scales); within rounding of it (KernelForward128Keys) and of the fp32 reference.
constexpr int kStages128 = 3;
constexpr int kKeys128 = 128;

template <int D>
__global__ void __launch_bounds__(kWsThreads, 1) attn_fwd_ws128_kernel(const AttnParams p, const __grid_constant__ WsMaps maps) {
#ifdef DFLASH_WGMMA
  constexpr int ST = kStages128, KR = kKeys128, J = KR / 8;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WsSmem<D, 2, ST, KR>;
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const WsCta c(p);
  const int lane = c.lane, wg = c.wg, w = c.w, t4 = c.t4, hk = c.hk, b = c.b;
  const KeyWalkN<KR> walk(c.walk.tq);
  const int ntiles = walk.ntiles;
  const uint32_t bars = base + S::kBars;
  ws_start<D, 2, ST, KR>(maps, base, threadIdx.x, c.m0, c.h0, hk, b, walk);

  const uint32_t sQ = base + wg * S::kTile;
  auto sK = [&](int t) { return base + S::kRing + 2 * (t % ST) * S::kKV; };
  const float sl2 = p.scale * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  uint32_t pa[J / 2][4];  // P(t - 1), A operand of P(t-1) V(t-1); P(t) once that product has retired
  uint32_t qa[D / 16][4];
  mbar_wait(bars + 8 * ST, 0);  // Q has landed
  __syncwarp();  // converged before register operands are loaded (variant 7)
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) load_a_w<kTileQ>(sQ, w, ks, lane, qa[ks]);

  // Iteration t issues S(t) and P(t-1) V(t-1), waits for both (ptxas places the wait at the top of
  // the softmax's block in any case, NOTES v6), releases tile t-1 and runs tile t's softmax, which
  // writes P(t) into the registers P(t-1) V(t-1) has finished reading.
  for (int t = 0; t < ntiles; ++t) {
    const uint32_t k_t = sK(t);
    mbar_wait(bars + 8 * (t % ST), (t / ST) & 1);
    const int n0 = walk.start(t);
    const bool ctx = walk.ctx(t);
    float s[J][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma_rs_n128_kb(s, qa[ks], desc_k<KR>(k_t, ks), ks > 0);
    wg_commit();
    if (t > 0) {
      reg_fence(o);
#pragma unroll
      for (int kk = 0; kk < J / 2; ++kk) wgmma_rs_nd_tb<D>(o, pa[kk], desc_mn<KR>(sK(t - 1) + S::kKV, kk));
      wg_commit();
    }
    wg_wait<0>();
    reg_fence(s);
    reg_fence(o);
    reg_fence_a(pa);
    if (t > 0) ws_release<D, 2, ST, KR>(maps, base, lane, t - 1, hk, b, walk);

    mask_tile(s, n0, ctx, c.rowA, c.rowB, t4);
    float cA, cB;
    const bool keep_o = softmax_step(s, mA, mB, lA, lB, sl2, p.rescale_slack, pa, cA, cB);
    if (!keep_o) scale_rows(o, cA, cB);
  }
  if (ntiles > 0) fwd_last_pv<D, KR>(o, pa, sK(ntiles - 1) + S::kKV);

  store_fwd_rows<D>(p, b, c.h, c.ra, t4, o, mA, mB, lA, lB, sl2);
#endif
}

// dQ variant 7 ("late waits"; 8, the default, adds QREG below): consumer warpgroup wg computes dQ of
// head h0 + wg with the products and arithmetic of the one-head dQ pass (fwd_sm90.cu, dQ 4) in the
// same order (bit-identical), scheduled so that P runs under products in flight. ptxas places a
// wgmma wait like an instruction with no inputs, at the top of its basic block: in dQ 4 (and the
// forward's variants 5-8) the CUDA-core work written between a product's issue and its wait sits in
// SASS after the WARPGROUP.DEPBAR, so it never overlaps that product (kernel/NOTES.md, "v6"). Here
// the wait comes right after the next issue and P ends the iteration:
//   iteration t: S(t) issued; wait<0> retires S(t), dP(t-1) and dQ(t-2); dS(t-1) from P(t-1);
//   dQ += dS(t-1) K(t-1) and dP(t) issued; P(t) = exp2(S(t) - lse) runs under both.
// (A wait<1> leaving S(t) in flight there makes ptxas serialise every wgmma: it cannot tell that
// dP's accumulator is settled.) dQ(t-1) reads its A operand dS(t-1) from registers until iteration
// t+1: ptxas does not see that read as asynchronous and could hand those registers to P(t)'s work;
// tests/attention/test_sass_hazards.py checks the built SASS for such a write (there is none). The
// same schedule for the forward (softmax(t) under P(t-1) V(t-1)) had 6 such writes and wrong
// results, and with P through shared memory instead it was right but 6% slower: both removed
// (NOTES v6), as was dQ variant 6 (dQ 4's schedule on this ring, level with dQ 4). A K/V buffer is
// released two tiles back (dQ(t-1) reads K(t-1) until iteration t+1), so the ring is one stage
// deeper than the forward's: five, what fits at d = 128.
constexpr int kLwDqStages = 5;

// QREG (dQ variant 8, the default at d = 128): S = Q K^T with Q's fragments in registers (the
// forward's form, loaded once), so that S reads only K from shared memory. A shared x shared m64n64
// product reads 4 KB per 32-clock k-step, the SM's whole shared-memory bandwidth (128 B/clock); with
// S and dP both in that form, dQ's B reads and the ring's TMA writes, the pass asked for more than
// that. 3.1-3.8% faster as a raw stage at the long shape, bit-identical (kernel/NOTES.md "v7").
// Not at d = 64: there ptxas gave Q's registers to other values inside the loop although the PTX
// keeps them live (wrong dQ; tests/attention/test_sass_hazards.py now checks every kernel's SASS
// for that), so d = 64 runs variant 7.
template <int D, bool QREG = false>
__global__ void __launch_bounds__(kWsThreads, 1) attn_bwd_dq_ws_lw_kernel(const AttnParams p, const __grid_constant__ WsMaps maps) {
#ifdef DFLASH_WGMMA
  constexpr int ST = kLwDqStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = WsSmem<D, 4, ST>;
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const WsCta c(p);
  const int lane = c.lane, wg = c.wg, t4 = c.t4, hk = c.hk, b = c.b;
  const KeyWalk& walk = c.walk;
  const int ntiles = walk.ntiles;
  const uint32_t bars = base + S::kBars;
  ws_start<D, 4, ST>(maps, base, threadIdx.x, c.m0, c.h0, hk, b, walk);

  const uint32_t sQ = base + wg * S::kTile, sdO = base + (2 + wg) * S::kTile;
  auto sK = [&](int t) { return base + S::kRing + 2 * (t % ST) * S::kTile; };
  const DqRows rw = dq_rows(p, b, c.h, c.ra);
  const float sl2 = p.scale * kLog2e;

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  mbar_wait(bars + 8 * ST, 0);
  uint32_t qa[QREG ? D / 16 : 1][4];
  if constexpr (QREG) {
    __syncwarp();  // converged before the register operands are loaded (ws_sm90.cu's forward)
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) load_a_w<kTileQ>(sQ, c.w, ks, lane, qa[ks]);
  }

  // A tile that sees no key returns here, so that the loop runs at least once and its last dQ
  // product is retired on every path (a path with a product in flight at the stores makes ptxas
  // serialise every wgmma of the kernel).
  if (ntiles == 0) {
    store_dq_rows<D>(p, b, c.h, c.ra, t4, dq);
    return;
  }
  uint32_t da[4][4];  // dS(t-1): A operand of dQ(t-1), in flight into iteration t+1
  float pp[8][4];     // P(t-1)
  float dp[8][4];     // dP(t-1) accumulator, in flight into iteration t
  for (int t = 0; t < ntiles; ++t) {
    const uint32_t k_t = sK(t), v_t = k_t + S::kTile;
    mbar_wait(bars + 8 * (t % ST), (t / ST) & 1);
    const int n0 = walk.start(t);
    const bool ctx = walk.ctx(t);
    float s[8][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      if constexpr (QREG) wgmma_rs_n64_kb(s, qa[ks], desc_k<kTileK>(k_t, ks), ks > 0);
      else wgmma_ss_n64(s, desc_k<kTileQ>(sQ, ks), desc_k<kTileK>(k_t, ks), ks > 0);
    }
    wg_commit();
    wg_wait<0>();  // S(t), dP(t-1) and dQ(t-2) retired (wait<1> here: ptxas serialises, as above)
    reg_fence(s);
    if (t > 0) {
      reg_fence(dp);
      reg_fence(dq);
      reg_fence_a(da);
      if (t > 1) ws_release<D, 4, ST>(maps, base, lane, t - 2, hk, b, walk);
      dq_ds(pp, dp, rw, da);
      wg_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dq, da[kk], desc_mn<kTileK>(sK(t - 1), kk));
      wg_commit();
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma_ss_n64(dp, desc_k<kTileQ>(sdO, ks), desc_k<kTileK>(v_t, ks), ks > 0);
    wg_commit();  // dQ(t-1) and dP(t) run under P(t) below
    mask_tile(s, n0, ctx, c.rowA, c.rowB, t4);
    dq_p(s, sl2, rw);
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) pp[j][e] = s[j][e];
  }
  wg_wait<0>();
  reg_fence(dp);
  reg_fence(dq);
  reg_fence_a(da);
  dq_ds(pp, dp, rw, da);
  wg_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dq, da[kk], desc_mn<kTileK>(sK(ntiles - 1), kk));
  wg_commit();
  wg_wait<0>();
  reg_fence(dq);
  reg_fence_a(da);

  store_dq_rows<D>(p, b, c.h, c.ra, t4, dq);
#endif
}

// The driver's cuTensorMapEncodeTiled, found once through the runtime (no libcuda link); null when
// the driver lacks it.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      f = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

// [B, H, rows, D] bf16 with element strides (sb, sh, sr) as the 4-d map (D, rows, H, B), boxes of
// 64 columns x 64 rows in the 128-byte swizzle; false where TMA cannot describe the tensor (the
// caller then runs a kernel without TMA). Declared in tma.cuh.
bool tile_map(CUtensorMap* m, const void* ptr, int64_t B, int64_t H, int64_t rows, int D, int64_t sb, int64_t sh,
              int64_t sr) {
  auto ok16 = [](int64_t elems) { return elems > 0 && (elems * 2) % 16 == 0; };
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || !ok16(sr) || (H > 1 && !ok16(sh)) || (B > 1 && !ok16(sb)))
    return false;
  const auto enc = encode_tiled();
  if (!enc) return false;
  const cuuint64_t dims[4] = {(cuuint64_t)D, (cuuint64_t)rows, (cuuint64_t)H, (cuuint64_t)B};
  // a size-1 dimension's stride is never used; any valid one (a multiple of 16 bytes) will do
  const cuuint64_t strides[3] = {(cuuint64_t)sr * 2, (cuuint64_t)(H > 1 ? sh : sr) * 2,
                                 (cuuint64_t)(B > 1 ? sb : sr) * 2};
  const cuuint32_t box[4] = {64, 64, 1, 1}, estr[4] = {1, 1, 1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(ptr), dims, strides, box, estr,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

bool qdo_maps(const AttnParams& p, QdoMaps* maps) {
  return tile_map(&maps->q, p.q, p.B, p.Hq, p.q_len, p.d, p.q_sb, p.q_sh, p.q_sr) &&
         tile_map(&maps->dout, p.dout, p.B, p.Hq, p.q_len, p.d, p.do_sb, p.do_sh, p.do_sr);
}

namespace {

// The pair-of-heads kernels need an even number of query heads per KV head.
bool ws_maps(const AttnParams& p, bool dq_pass, WsMaps* maps) {
  if (p.Hkv <= 0 || p.Hq % p.Hkv != 0 || (p.Hq / p.Hkv) % 2 != 0) return false;
  bool ok = tile_map(&maps->q, p.q, p.B, p.Hq, p.q_len, p.d, p.q_sb, p.q_sh, p.q_sr) &&
            tile_map(&maps->k, p.k, p.B, p.Hkv, p.kv_len, p.d, p.k_sb, p.k_sh, p.k_sr) &&
            tile_map(&maps->v, p.v, p.B, p.Hkv, p.kv_len, p.d, p.v_sb, p.v_sh, p.v_sr);
  if (dq_pass) ok = ok && tile_map(&maps->dout, p.dout, p.B, p.Hq, p.q_len, p.d, p.do_sb, p.do_sh, p.do_sr);
  return ok;
}

std::atomic<int64_t> g_ws_launches{0};

template <typename Kern>
void launch(Kern kern, int smem, const AttnParams& p, const WsMaps& maps, cudaStream_t s, const char* what) {
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kern<<<dim3(p.meta.nqt, p.Hq / 2, p.B), kWsThreads, smem, s>>>(p, maps);
  DFLASH_CHECK_LAUNCH(what);
  g_ws_launches.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

int64_t ws_launch_count() { return g_ws_launches.load(std::memory_order_relaxed); }

bool launch_fwd_ws(const AttnParams& p, int variant, void* stream) {
  WsMaps maps{};
  if (!ws_maps(p, false, &maps)) return false;
  auto s = static_cast<cudaStream_t>(stream);
  const char* what = "attention forward (two heads per CTA)";
  if (variant == 13) {
    if (p.d == 128) launch(attn_fwd_ws128_kernel<128>, WsSmem<128, 2, kStages128, kKeys128>::kBytes, p, maps, s, what);
    else launch(attn_fwd_ws128_kernel<64>, WsSmem<64, 2, kStages128, kKeys128>::kBytes, p, maps, s, what);
    return true;
  }
  const bool pingpong = variant == 8;
  if (p.d == 128) {
    pingpong ? launch(attn_fwd_ws_kernel<128, true>, WsSmem<128, 2>::kBytes, p, maps, s, what)
             : launch(attn_fwd_ws_kernel<128, false>, WsSmem<128, 2>::kBytes, p, maps, s, what);
  } else {
    pingpong ? launch(attn_fwd_ws_kernel<64, true>, WsSmem<64, 2>::kBytes, p, maps, s, what)
             : launch(attn_fwd_ws_kernel<64, false>, WsSmem<64, 2>::kBytes, p, maps, s, what);
  }
  return true;
}

bool launch_dq_ws(const AttnParams& p, int variant, void* stream) {
  WsMaps maps{};
  if (!ws_maps(p, true, &maps)) return false;
  auto s = static_cast<cudaStream_t>(stream);
  const char* what = "attention backward dq (two heads per CTA)";
  if (p.d == 128) {
    constexpr int smem = WsSmem<128, 4, kLwDqStages>::kBytes;
    variant == 8 ? launch(attn_bwd_dq_ws_lw_kernel<128, true>, smem, p, maps, s, what)
                 : launch(attn_bwd_dq_ws_lw_kernel<128, false>, smem, p, maps, s, what);
  } else {  // variant 8 runs 7 here (QREG)
    launch(attn_bwd_dq_ws_lw_kernel<64, false>, WsSmem<64, 4, kLwDqStages>::kBytes, p, maps, s, what);
  }
  return true;
}

}  // namespace dflash::attention
