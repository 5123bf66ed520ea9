// Forward and dQ pass of the DFlash attention with Hopper warpgroup MMA (wgmma, sm_90a).
//
// Same schedule as the mma.sync forward in fwd.cu (one CTA per 64-row query tile of one (batch
// row, query head), walking the tile's context key range then its own-block key range in 64-key
// steps, online softmax in base 2), with one warpgroup (4 warps x 16 rows) and:
//   S  = Q K^T   (A = Q tile, B = K tile, both K-major in shared memory;   m64n64k16 x d/16
//                 QREG, the default: A = Q's fragments, loaded once into registers)
//   O += P V     (A = P from registers, B = V tile N-major)               m64n{d}k16 x 4
// Compiled empty on other architectures and never launched there (launch_attn_fwd checks).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "attention/kernel.h"
#include "core/launch_check.h"
#include "attention/kernel/common.cuh"
#include "attention/kernel/tile_math.cuh"
#include "attention/kernel/wgmma.cuh"

namespace dflash::attention {
namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kWgThreads = 128;

template <int D>
struct FwdWgSmem {
  static constexpr int kTile = kTileQ * D * 2;  // == kTileK * D * 2
  static constexpr int kBytes = 1024 + 5 * kTile;  // Q, K x2, V x2 (+1024: base alignment)
};

// QREG: S = Q K^T with Q as a register operand (loaded once per CTA with ldmatrix; +D/4
// registers), so that each S product reads only K from shared memory: with 64-key tiles the
// smem-operand form reads Q's 64 x 16 slice again for every 64 x 64 x 16 step, as many bytes as
// K's (kernel/NOTES.md).
template <int D, bool QREG>
__global__ void __launch_bounds__(kWgThreads, 2) attn_fwd_wgmma_kernel(const AttnParams p) {
#ifdef DFLASH_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = FwdWgSmem<D>;
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt;
  const int qt = nqt - 1 - (int)blockIdx.x;  // heavy (late-anchor) tiles first when sorted
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int m0 = qt * kTileQ;
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  const KeyWalk walk(reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * nqt + qt]);
  const int ntiles = walk.ntiles;

  // Pipeline (wgmma groups and cp.async groups each complete in issue order): iteration t issues
  // S(t) = Q K(t)^T and then O += P(t-1) V(t-1); the softmax of tile t is written to run on the
  // CUDA cores while P(t-1) V(t-1) is on the tensor cores, but ptxas puts the wait for that product
  // ahead of it in SASS (kernel/NOTES.md "v6"); O is rescaled once that product is done. K(t+1)
  // is loaded at the top of iteration t (K(t-1)'s buffer, read by S(t-1), long done) and V(t+1)
  // once P(t-1) V(t-1) has completed (its buffer). cp.async groups: {Q, K0}, {V0}, K1, V1, K2, ...
  const uint32_t sQ = base, sK0 = base + S::kTile, sV0 = base + 3 * S::kTile;
  load_tile_w<kTileQ, D, kWgThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
  if (ntiles > 0) load_tile_w<kTileK, D, kWgThreads>(sK0, k, p.k_sr, walk.start(0), p.kv_len, tid);
  cp_async_commit();
  if (ntiles > 0) load_tile_w<kTileK, D, kWgThreads>(sV0, v, p.v_sr, walk.start(0), p.kv_len, tid);
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int ra = m0 + warp * 16 + g, rb = ra + 8;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int4 rowA = rows[ra], rowB = rows[rb];

  const float sl2 = p.scale * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  uint32_t pa[4][4];  // P(t-1), the A operand of the product in flight
  uint32_t qa[QREG ? D / 16 : 1][4];  // QREG: Q's A fragments, k-steps 0 .. D/16-1

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < ntiles)
      load_tile_w<kTileK, D, kWgThreads>(sK0 + (buf ^ 1) * S::kTile, k, p.k_sr, walk.start(t + 1),
                                         p.kv_len, tid);
    cp_async_commit();
    cp_async_wait<2>();  // K(t) and V(t-1) have landed
    fence_proxy_async();
    __syncthreads();
    const uint32_t sK = sK0 + buf * S::kTile;
    const int n0 = walk.start(t);
    const bool ctx = walk.ctx(t);

    float s[8][4];
    if constexpr (QREG) {
      if (t == 0) {  // Q has landed (the first wait above)
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) load_a_w<kTileQ>(sQ, warp, ks, lane, qa[ks]);
      }
    }
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      if constexpr (QREG) wgmma_rs_n64_kb(s, qa[ks], desc_k<kTileK>(sK, ks), ks > 0);
      else wgmma_ss_n64(s, desc_k<kTileQ>(sQ, ks), desc_k<kTileK>(sK, ks), ks > 0);
    }
    wg_commit();
    if (t > 0) {
      reg_fence(o);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(o, pa[kk], desc_mn<kTileK>(sV0 + (buf ^ 1) * S::kTile, kk));
      wg_commit();
      wg_wait<1>();
    } else {
      wg_wait<0>();
    }
    reg_fence(s);

    mask_tile(s, n0, ctx, rowA, rowB, t4);
    float cA, cB;
    uint32_t pn[4][4];
    const bool keep_o = softmax_step(s, mA, mB, lA, lB, sl2, p.rescale_slack, pn, cA, cB);
    wg_wait<0>();  // P(t-1) V(t-1) done
    reg_fence(o);
    reg_fence_a(pa);
    if (!keep_o) scale_rows(o, cA, cB);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) pa[kk][r] = pn[kk][r];
    __syncthreads();  // every warp is done with V(t-1)'s buffer
    if (t + 1 < ntiles)
      load_tile_w<kTileK, D, kWgThreads>(sV0 + (buf ^ 1) * S::kTile, v, p.v_sr, walk.start(t + 1),
                                         p.kv_len, tid);
    cp_async_commit();
  }
  cp_async_wait<0>();
  if (ntiles > 0) {
    fence_proxy_async();
    __syncthreads();
    reg_fence(o);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_rs_nd_tb<D>(o, pa[kk], desc_mn<kTileK>(sV0 + ((ntiles - 1) & 1) * S::kTile, kk));
    wg_commit();
    wg_wait<0>();
    reg_fence(o);
    reg_fence_a(pa);
  }

  store_fwd_rows<D>(p, b, h, ra, t4, o, mA, mB, lA, lB, sl2);
#endif
}

template <int D, bool QREG>
void run(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = FwdWgSmem<D>::kBytes;
  cudaFuncSetAttribute(attn_fwd_wgmma_kernel<D, QREG>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  attn_fwd_wgmma_kernel<D, QREG><<<dim3(p.meta.nqt, p.Hq, p.B), kWgThreads, smem, s>>>(p);
  DFLASH_CHECK_LAUNCH("attention forward (wgmma)");
}


// ---- dQ pass of the backward (same schedule as attn_bwd_dq_kernel in bwd.cu) -----------------
//   S  = Q K^T, dP = dO V^T   (A = Q / dO tile, B = K / V tile, K-major)    m64n64k16 x d/16 each
//   dQ += dS K                (A = dS from registers, B = K tile N-major)   m64n{d}k16 x 4
template <int D>
struct DqWgSmem {
  static constexpr int kTile = kTileQ * D * 2;
  static constexpr int kBytes = 1024 + 6 * kTile;  // Q, dO, K x2, V x2
};

template <int D>
__global__ void __launch_bounds__(kWgThreads, 2) attn_bwd_dq_wgmma_kernel(const AttnParams p) {
#ifdef DFLASH_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = DqWgSmem<D>;
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt;
  const int qt = nqt - 1 - (int)blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int m0 = qt * kTileQ;
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh;
  const bf16* dout = static_cast<const bf16*>(p.dout) + b * p.do_sb + h * p.do_sh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  const KeyWalk walk(reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * nqt + qt]);
  const int ntiles = walk.ntiles;

  const uint32_t sQ = base, sdO = base + S::kTile, sK0 = base + 2 * S::kTile, sV0 = base + 4 * S::kTile;
  load_tile_w<kTileQ, D, kWgThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
  load_tile_w<kTileQ, D, kWgThreads>(sdO, dout, p.do_sr, m0, p.q_len, tid);
  if (ntiles > 0) {
    const int n0 = walk.start(0);
    load_tile_w<kTileK, D, kWgThreads>(sK0, k, p.k_sr, n0, p.kv_len, tid);
    load_tile_w<kTileK, D, kWgThreads>(sV0, v, p.v_sr, n0, p.kv_len, tid);
  }
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int ra = m0 + warp * 16 + g, rb = ra + 8;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int4 rowA = rows[ra], rowB = rows[rb];
  const DqRows rw = dq_rows(p, b, h, ra);
  const float sl2 = p.scale * kLog2e;

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

  // Per key tile t: S(t) and dP(t) issued as two wgmma groups -> wait<1>: S(t) done, and
  // dQ(t-1) before it -> tile t-1's buffers are free: the loads of tile t+1 go there -> P (in SASS
  // after the wait for dP(t): ptxas hoists it, NOTES "v6"; dQ 7 in ws_sm90.cu avoids that) -> dS
  // -> dQ(t) += dS K(t) issued, running on into tile t+1.
  uint32_t da[4][4];  // dS(t-1): A operand of dQ(t-1), in flight into iteration t
  for (int t = 0; t < ntiles; ++t) {
    const int buf = t & 1;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    const uint32_t sK = sK0 + buf * S::kTile, sV = sV0 + buf * S::kTile;
    const int n0 = walk.start(t);
    const bool ctx = walk.ctx(t);

    float s[8][4], dp[8][4];
    wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss_n64(s, desc_k<kTileQ>(sQ, ks), desc_k<kTileK>(sK, ks), ks > 0);
    wg_commit();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks)
      wgmma_ss_n64(dp, desc_k<kTileQ>(sdO, ks), desc_k<kTileK>(sV, ks), ks > 0);
    wg_commit();
    wg_wait<1>();
    reg_fence(s);
    reg_fence(dq);
    reg_fence_a(da);
    __syncthreads();  // every warp is past dQ(t-1): tile t-1's buffers may be refilled
    if (t + 1 < ntiles) {
      const int n0n = walk.start(t + 1);
      load_tile_w<kTileK, D, kWgThreads>(sK0 + (buf ^ 1) * S::kTile, k, p.k_sr, n0n, p.kv_len, tid);
      load_tile_w<kTileK, D, kWgThreads>(sV0 + (buf ^ 1) * S::kTile, v, p.v_sr, n0n, p.kv_len, tid);
    }
    cp_async_commit();

    mask_tile(s, n0, ctx, rowA, rowB, t4);
    dq_p(s, sl2, rw);
    wg_wait<0>();
    reg_fence(dp);
    dq_ds(s, dp, rw, da);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dq, da[kk], desc_mn<kTileK>(sK, kk));
    wg_commit();
  }
  wg_wait<0>();
  reg_fence(dq);
  reg_fence_a(da);
  cp_async_wait<0>();

  store_dq_rows<D>(p, b, h, ra, t4, dq);
#endif
}

template <int D>
void run_dq(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = DqWgSmem<D>::kBytes;
  cudaFuncSetAttribute(attn_bwd_dq_wgmma_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  attn_bwd_dq_wgmma_kernel<D><<<dim3(p.meta.nqt, p.Hq, p.B), kWgThreads, smem, s>>>(p);
  DFLASH_CHECK_LAUNCH("attention backward dq (wgmma)");
}

}  // namespace

void launch_dq_wgmma(const AttnParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.d == 128) run_dq<128>(p, s);
  else run_dq<64>(p, s);
}


void launch_fwd_wgmma(const AttnParams& p, bool q_in_registers, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.d == 128) q_in_registers ? run<128, true>(p, s) : run<128, false>(p, s);
  else q_in_registers ? run<64, true>(p, s) : run<64, false>(p, s);
}

}  // namespace dflash::attention
