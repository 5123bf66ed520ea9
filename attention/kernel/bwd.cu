// Backward kernels of the block-sparse DFlash attention. Three launches, all deterministic
// (no atomics):
//   1. delta = rowsum(dO * O) (fp32), one group of d/8 lanes per query row;
//   2. dQ: like the forward, one CTA per 64-row query tile walking the same key tiles, P
//      recomputed from the saved LSE, dQ = scale * sum_tiles (P * (dO V^T - delta)) K;
//   3. dK, dV: one CTA per 64-key tile of one (batch row, KV head); each warp owns 16 keys and
//      walks every (query head of the GQA group, query tile that sees the key tile) pair,
//      computing S^T = K Q^T and dP^T = V dO^T, then dV += P^T dO and dK += dS^T Q.
// dQ recomputes S and dP (7 matmuls per visible tile pair instead of 5 with atomics) in
// exchange for determinism and no fp32 accumulation buffer.
// Fused (dK/dV variant 7, Hopper, d = 128; bwd_fused_sm90.cu): delta and a zeroed fp32 buffer
// (AttnParams::dq_accum), one pass computing dK, dV and adding each item's dQ partial into the buffer
// with TMA bulk reduce-adds (5 matmuls per visible pair), then dQ = scale * buffer in bf16.
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

#include "attention/kernel.h"
#include "core/launch_check.h"
#include "attention/kernel/common.cuh"

namespace dflash::attention {

bool wgmma_supported();                                   // bwd_sm90.cu
void launch_dkv_wgmma(const AttnParams& p, bool tma, void* stream);  // bwd_sm90.cu
void launch_bwd_fused(const AttnParams& p, bool tma, void* stream);  // bwd_fused_sm90.cu (fixed point: p.dq_row_scale)
void launch_kv_max(const AttnParams& p, void* stream);         // dq_sum.cu: the fixed point's K/V maxima
void launch_dq_from_accum(const AttnParams& p, void* stream);  // dq_sum.cu: the fused pass's sum -> bf16 dQ
void launch_dq_wgmma(const AttnParams& p, void* stream);   // fwd_sm90.cu
bool launch_dq_ws(const AttnParams& p, int variant, void* stream);  // ws_sm90.cu

namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kThreads = 128;

// Tile variant of the dQ kernel, for benchmarking (DFLASH_ATTN_DQ_VARIANT = 1: 16 rows/warp x
// 64 keys, 2: 32 rows/warp x 16 keys, 3: 32 rows/warp x 32 keys, 4: Hopper wgmma (fwd_sm90.cu),
// 7: two query heads per CTA sharing a TMA K/V ring, with late waits (P under dQ(t-1) and
// dP(t); ws_sm90.cu; 3.5% faster than 4 at the long shape, kernel/NOTES.md "v6"), 8 (default): 7 with
// Q as a register operand of S (3.1-3.8% faster than 7, "v7"; at d = 64 it runs 7). 4, 7 and 8 are
// bit-identical, 7 and 8 run 4 where the heads cannot be paired, all fall back to 3 where wgmma is
// unavailable. Read at each launch.
int dq_variant() {
  static constexpr int kAllowed[] = {1, 2, 3, 4, 7, 8};
  return kernel_variant_from_env("DFLASH_ATTN_DQ_VARIANT", kAllowed, 6, 8);
}
// dK/dV kernel variant (DFLASH_ATTN_DKV_VARIANT = 1: 4 warps x 16 keys, 2: 8 warps,
// 3 (default): Hopper wgmma (bwd_sm90.cu; falls back to 1 where unavailable), 7: the fused backward
// (bwd_fused_sm90.cu: dQ added in the same pass, no dQ pass; runs 3 at d = 64 or without wgmma)).
// The default where the variable is unset: 3, or 7 after set_fused_backward(true).
std::atomic<int> g_dkv_default{3};
int dkv_variant() {
  static constexpr int kAllowed[] = {1, 2, 3, 7};
  return kernel_variant_from_env("DFLASH_ATTN_DKV_VARIANT", kAllowed, 4, g_dkv_default.load());
}

// The fused pass's loads of Q and dO (DFLASH_ATTN_FUSED_TMA = 1, the default: TMA onto mbarriers where the
// tensors allow it, else cp.async; 0: cp.async, the A/B oracle; bwd_fused_sm90.cu). Read at each launch.
int fused_tma() {
  static constexpr int kAllowed[] = {0, 1};
  return kernel_variant_from_env("DFLASH_ATTN_FUSED_TMA", kAllowed, 2, 1);
}

// The fused pass's dQ sum (DFLASH_ATTN_FUSED_DET = 1, the default: int32 fixed point with a power-of-two scale per
// query row, dQ the same bits in every run; 0: fp32 bulk adds in the order the CTAs reach them, the first version,
// dQ's last bits vary from run to run; bwd_fused_sm90.cu). Read at each launch.
int fused_det() {
  static constexpr int kAllowed[] = {0, 1};
  return kernel_variant_from_env("DFLASH_ATTN_FUSED_DET", kAllowed, 2, 1);
}

// The split dK/dV pass's loads of Q and dO (DFLASH_ATTN_DKV_TMA = 1, the default since 2026-12-07: TMA onto
// mbarriers where the tensors allow it, else cp.async; 0: cp.async, the A/B and test oracle; bwd_sm90.cu). Read
// at each launch.
int dkv_tma() {
  static constexpr int kAllowed[] = {0, 1};
  return kernel_variant_from_env("DFLASH_ATTN_DKV_TMA", kAllowed, 2, 1);
}

// ---- 1. delta ------------------------------------------------------------------------------
// The fused pass's fixed-point scale of a query row (bwd_fused_sm90.cu): the largest power of two s with
// s * bound < 2^30, bound = 2.5 ||dO_i|| max_k ||V_k|| max |K| >= sum_k |dS_ik| |K_kj| for every column j (dS_ik =
// P_ik (dP_ik - delta_i), |dP_ik| <= ||dO_i|| ||V_k||, |delta_i| <= ||dO_i|| ||O_i|| <= ||dO_i|| max ||V_k||,
// sum_k P_ik = 1; 2.5 instead of 2 covers the bf16 roundings of P and dS), so no partial sum leaves int32. A row
// whose bound is 0 has dS = 0 (scale 1); a NaN bound gives scale 1 (the NaN then shows in dK/dV, not in dQ); the
// scale stops at 2^126 (rows whose bound is under 2^-96 keep fewer bits; 1 / s stays a normal float).
__device__ __forceinline__ float fixed_point_scale(float norm_do, float max_k, float max_v) {
  const float bound = 2.5f * norm_do * max_v * max_k;
  if (!(bound > 0.f) || !isfinite(bound)) return 1.f;
  int e;
  frexpf(bound, &e);  // bound < 2^e
  return ldexpf(1.f, min(30 - e, 126));
}

template <int D>
__global__ void delta_kernel(const AttnParams p) {
  constexpr int L = D / 8;  // lanes per row, 16 bytes each
  const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t row = gid / L;
  const int c = (int)(gid % L);
  const int64_t total = (int64_t)p.B * p.Hq * p.q_len;
  float acc = 0.f, n2 = 0.f;  // rowsum(dO * O), ||dO||^2
  if (row < total) {
    const int r = (int)(row % p.q_len);
    const int64_t bh = row / p.q_len;
    const int h = (int)(bh % p.Hq), b = (int)(bh / p.Hq);
    const uint4 ov = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.o) + b * p.o_sb +
                                                     h * p.o_sh + r * p.o_sr + c * 8);
    const uint4 dv = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.dout) +
                                                     b * p.do_sb + h * p.do_sh + r * p.do_sr + c * 8);
    const __nv_bfloat162* o2 = reinterpret_cast<const __nv_bfloat162*>(&ov);
    const __nv_bfloat162* d2 = reinterpret_cast<const __nv_bfloat162*>(&dv);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = __bfloat1622float2(o2[i]), bq = __bfloat1622float2(d2[i]);
      acc += a.x * bq.x + a.y * bq.y;
      n2 += bq.x * bq.x + bq.y * bq.y;
    }
  }
#pragma unroll
  for (int off = L / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < total && c == 0) p.delta[row] = acc;
  if (p.dq_row_scale != nullptr) {  // the fused pass's fixed point (p.kv_max: kv_max_kernel, launched before)
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) n2 += __shfl_xor_sync(0xffffffffu, n2, off);
    if (row < total && c == 0) p.dq_row_scale[row] = fixed_point_scale(sqrtf(n2), p.kv_max[0], p.kv_max[1]);
  }
}

// ---- 2. dQ ---------------------------------------------------------------------------------
template <int D, int MT, int BN>
constexpr int dq_smem_bytes() {
  return 2 * MT * kTileQ * D * 2 + 4 * BN * D * 2;
}

// MT: 16-row m-tiles per warp (rows mt*64 + warp*16 + [0,16) of the CTA's MT*64 rows);
// BN: keys per key tile.
template <int D, int MT, int BN>
__global__ void __launch_bounds__(kThreads, 2) attn_bwd_dq_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int BM = MT * kTileQ;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt;
  const int ncta = (nqt + MT - 1) / MT;
  const int cta = ncta - 1 - (int)blockIdx.x;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int m0 = cta * BM;
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh;
  const bf16* dout = static_cast<const bf16*>(p.dout) + b * p.do_sb + h * p.do_sh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  int clo = 0x7fffffff, chi = 0, blo = 0x7fffffff, bhi = 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (cta * MT + mt < nqt) {
      const int4 tq = reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * nqt + cta * MT + mt];
      if (tq.y > tq.x) { clo = min(clo, tq.x); chi = max(chi, tq.y); }
      if (tq.w > tq.z) { blo = min(blo, tq.z); bhi = max(bhi, tq.w); }
    }
  }
  const int n1 = chi > clo ? (chi - clo + BN - 1) / BN : 0;
  const int n2 = bhi > blo ? (bhi - blo + BN - 1) / BN : 0;
  const int ntiles = n1 + n2;

  constexpr uint32_t kQBytes = BM * D * 2, kKVBytes = BN * D * 2;
  const uint32_t sQ = smem_u32(smem), sdO = sQ + kQBytes;
  const uint32_t sK0 = sdO + kQBytes, sV0 = sK0 + 2 * kKVBytes;
  auto tile_start = [&](int t) { return t < n1 ? clo + t * BN : blo + (t - n1) * BN; };

  load_tile<BM, D, kThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
  load_tile<BM, D, kThreads>(sdO, dout, p.do_sr, m0, p.q_len, tid);
  if (ntiles > 0) {
    const int n0 = tile_start(0);
    load_tile<BN, D, kThreads>(sK0, k, p.k_sr, n0, p.kv_len, tid);
    load_tile<BN, D, kThreads>(sV0, v, p.v_sr, n0, p.kv_len, tid);
  }
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.q_len;
  const float* delta = p.delta + ((int64_t)b * p.Hq + h) * p.q_len;
  float lrow[MT][2], drow[MT][2];
  int wlo = 0, whi = 0x7fffffff;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = m0 + mt * kTileQ + warp * 16 + g + 8 * hh;
      const bool in = r < p.q_len;
      lrow[mt][hh] = in ? lse[r] * kLog2e : 0.f;
      drow[mt][hh] = in ? delta[r] : 0.f;
      const int4 rm = cta * MT + mt < nqt ? rows[r] : make_int4(0, 0, 0, 0);
      wlo = max(wlo, rm.x);
      whi = min(whi, rm.y);
    }
  }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    wlo = max(wlo, __shfl_xor_sync(0xffffffffu, wlo, off));
    whi = min(whi, __shfl_xor_sync(0xffffffffu, whi, off));
  }
  const float sl2 = p.scale * kLog2e;

  float dq[MT][D / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) dq[mt][i][0] = dq[mt][i][1] = dq[mt][i][2] = dq[mt][i][3] = 0.f;

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < ntiles) {
      const int n0n = tile_start(t + 1);
      load_tile<BN, D, kThreads>(sK0 + (buf ^ 1) * kKVBytes, k, p.k_sr, n0n, p.kv_len, tid);
      load_tile<BN, D, kThreads>(sV0 + (buf ^ 1) * kKVBytes, v, p.v_sr, n0n, p.kv_len, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t sK = sK0 + buf * kKVBytes, sV = sV0 + buf * kKVBytes;
    const int n0 = tile_start(t);
    const bool ctx = t < n1;

    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j)
        s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = dp[mt][j][0] = dp[mt][j][1] =
            dp[mt][j][2] = dp[mt][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t qa[MT][4], oa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        load_a<D>(sQ, mt * kTileQ + warp * 16, ks * 16, lane, qa[mt]);
        load_a<D>(sdO, mt * kTileQ + warp * 16, ks * 16, lane, oa[mt]);
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bb[4];
        load_b_nk<D>(sK, np * 16, ks * 16, lane, bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(s[mt][2 * np], qa[mt], bb[0], bb[1]);
          mma16816(s[mt][2 * np + 1], qa[mt], bb[2], bb[3]);
        }
        load_b_nk<D>(sV, np * 16, ks * 16, lane, bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(dp[mt][2 * np], oa[mt], bb[0], bb[1]);
          mma16816(dp[mt][2 * np + 1], oa[mt], bb[2], bb[3]);
        }
      }
    }
    const bool full = ctx && n0 >= wlo && n0 + BN <= whi;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      int lo[2] = {0, 0}, hi[2] = {0x7fffffff, 0x7fffffff};
      if (!full) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int4 rm = rows[m0 + mt * kTileQ + warp * 16 + g + 8 * hh];
          lo[hh] = ctx ? rm.x : rm.z;
          hi[hh] = ctx ? rm.y : rm.w;
        }
      }
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int hh = e >> 1;
          const int key = n0 + j * 8 + 2 * t4 + (e & 1);
          const bool vis = key >= lo[hh] && key < hi[hh];
          const float pv = vis ? ex2(s[mt][j][e] * sl2 - lrow[mt][hh]) : 0.f;
          s[mt][j][e] = pv * (dp[mt][j][e] - drow[mt][hh]);
        }
      }
    }
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(s[mt][2 * ks], s[mt][2 * ks + 1], a[mt]);
#pragma unroll
      for (int dpi = 0; dpi < D / 16; ++dpi) {
        uint32_t bb[4];
        load_b_kn<D>(sK, ks * 16, dpi * 16, lane, bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(dq[mt][2 * dpi], a[mt], bb[0], bb[1]);
          mma16816(dq[mt][2 * dpi + 1], a[mt], bb[2], bb[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  bf16* dqo = static_cast<bf16*>(p.dq) + b * p.dq_sb + h * p.dq_sh;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int r = m0 + mt * kTileQ + warp * 16 + g + 8 * hh;
      if (r < p.q_len) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          store_bf16x2(dqo + (int64_t)r * p.dq_sr + i * 8 + 2 * t4, dq[mt][i][2 * hh] * p.scale,
                       dq[mt][i][2 * hh + 1] * p.scale);
      }
    }
  }
}

// ---- 3. dK, dV -----------------------------------------------------------------------------
// NW warps of 16 keys each: the CTA covers 16*NW keys (NW/4 metadata key tiles).
template <int D, int NW>
struct DkvSmem {
  static constexpr int kKeys = 16 * NW;
  static constexpr int kTile = kTileQ * D * 2;                 // one Q or dO tile
  static constexpr int kStage = 2 * kTile + kTileQ * 16 + 2 * kTileQ * 4;  // Q, dO, rows, lse, delta
  static constexpr int kBytes = 2 * kKeys * D * 2 + 2 * kStage;
};

template <int D, int NW>
__global__ void __launch_bounds__(32 * NW, 8 / NW) attn_bwd_dkv_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = DkvSmem<D, NW>;
  constexpr int NT = 32 * NW, BNK = S::kKeys, SUB = BNK / kTileK;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt, nkt = p.meta.nkt;
  const int kt = (int)blockIdx.x;  // low key tiles (seen by most query tiles) first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int G = p.Hq / p.Hkv;
  const int n0 = kt * BNK;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  int2 kr = make_int2(0x7fffffff, 0);
#pragma unroll
  for (int sub = 0; sub < SUB; ++sub) {
    if (kt * SUB + sub < nkt) {
      const int2 r = reinterpret_cast<const int2*>(p.meta.ktiles)[(int64_t)b * nkt + kt * SUB + sub];
      if (r.y > r.x) { kr.x = min(kr.x, r.x); kr.y = max(kr.y, r.y); }
    }
  }
  if (kr.y <= kr.x) kr = make_int2(0, 0);
  const int4* qtiles = reinterpret_cast<const int4*>(p.meta.qtiles) + (int64_t)b * nqt;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int nitems = (kr.y - kr.x) * G;
  auto valid = [&](int i) {
    const int4 tq = qtiles[kr.x + i / G];
    return (tq.x < n0 + BNK && tq.y > n0 && tq.y > tq.x) ||
           (tq.z < n0 + BNK && tq.w > n0 && tq.w > tq.z);
  };
  auto next_item = [&](int i) {
    while (i < nitems && !valid(i)) ++i;
    return i;
  };

  const uint32_t sK = smem_u32(smem), sV = sK + BNK * D * 2;
  const uint32_t sStage0 = sV + BNK * D * 2;
  unsigned char* stage_ptr0 = smem + 2 * BNK * D * 2;

  auto load_item = [&](int i, int buf) {
    const int qt = kr.x + i / G, h = hk * G + i % G;
    const int m0 = qt * kTileQ;
    const uint32_t st = sStage0 + buf * S::kStage;
    load_tile<kTileQ, D, NT>(st, static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh,
                                   p.q_sr, m0, p.q_len, tid);
    load_tile<kTileQ, D, NT>(st + S::kTile,
                                   static_cast<const bf16*>(p.dout) + b * p.do_sb + h * p.do_sh,
                                   p.do_sr, m0, p.q_len, tid);
    const int64_t lo = ((int64_t)b * p.Hq + h) * p.q_len;
    load_row_stats<kTileQ, NT>(st + 2 * S::kTile, rows, p.lse, p.delta, lo, m0, p.q_len, tid);
  };

  load_tile<BNK, D, NT>(sK, k, p.k_sr, n0, p.kv_len, tid);
  load_tile<BNK, D, NT>(sV, v, p.v_sr, n0, p.kv_len, tid);
  int item = next_item(0);
  if (item < nitems) load_item(item, 0);
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int keyA = n0 + warp * 16 + g, keyB = keyA + 8;
  const float sl2 = p.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

  int buf = 0;
  while (item < nitems) {
    const int nxt = next_item(item + 1);
    if (nxt < nitems) load_item(nxt, buf ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const uint32_t sQ = sStage0 + buf * S::kStage, sdO = sQ + S::kTile;
    const unsigned char* stp = stage_ptr0 + buf * S::kStage + 2 * S::kTile;
    const int4* sRows = reinterpret_cast<const int4*>(stp);
    const float* sL = reinterpret_cast<const float*>(stp + kTileQ * 16);
    const float* sD = sL + kTileQ;

#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      float st[4][4], dpt[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        st[j][0] = st[j][1] = st[j][2] = st[j][3] = dpt[j][0] = dpt[j][1] = dpt[j][2] =
            dpt[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a[4], av[4];
        load_a<D>(sK, warp * 16, ks * 16, lane, a);
        load_a<D>(sV, warp * 16, ks * 16, lane, av);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t bb[4];
          load_b_nk<D>(sQ, hf * 32 + np * 16, ks * 16, lane, bb);
          mma16816(st[2 * np], a, bb[0], bb[1]);
          mma16816(st[2 * np + 1], a, bb[2], bb[3]);
          load_b_nk<D>(sdO, hf * 32 + np * 16, ks * 16, lane, bb);
          mma16816(dpt[2 * np], av, bb[0], bb[1]);
          mma16816(dpt[2 * np + 1], av, bb[2], bb[3]);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int ql = hf * 32 + j * 8 + 2 * t4 + e;
          const int4 rm = sRows[ql];
          const float l2 = sL[ql] * kLog2e, dl = sD[ql];
          const float pa = visible(rm, keyA) ? ex2(st[j][e] * sl2 - l2) : 0.f;
          const float pb = visible(rm, keyB) ? ex2(st[j][2 + e] * sl2 - l2) : 0.f;
          st[j][e] = pa;
          st[j][2 + e] = pb;
          dpt[j][e] = pa * (dpt[j][e] - dl);
          dpt[j][2 + e] = pb * (dpt[j][2 + e] - dl);
        }
      }
#pragma unroll
      for (int ks = 0; ks < 2; ++ks) {
        uint32_t a[4], ad[4];
        acc_to_a(st[2 * ks], st[2 * ks + 1], a);
        acc_to_a(dpt[2 * ks], dpt[2 * ks + 1], ad);
#pragma unroll
        for (int dpi = 0; dpi < D / 16; ++dpi) {
          uint32_t bb[4];
          load_b_kn<D>(sdO, hf * 32 + ks * 16, dpi * 16, lane, bb);
          mma16816(dv[2 * dpi], a, bb[0], bb[1]);
          mma16816(dv[2 * dpi + 1], a, bb[2], bb[3]);
          load_b_kn<D>(sQ, hf * 32 + ks * 16, dpi * 16, lane, bb);
          mma16816(dk[2 * dpi], ad, bb[0], bb[1]);
          mma16816(dk[2 * dpi + 1], ad, bb[2], bb[3]);
        }
      }
    }
    __syncthreads();
    item = nxt;
    buf ^= 1;
  }
  cp_async_wait<0>();

  bf16* dko = static_cast<bf16*>(p.dk) + b * p.dk_sb + hk * p.dk_sh;
  bf16* dvo = static_cast<bf16*>(p.dv) + b * p.dv_sb + hk * p.dv_sh;
  if (keyA < p.kv_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      store_bf16x2(dko + (int64_t)keyA * p.dk_sr + i * 8 + 2 * t4, dk[i][0] * p.scale,
                   dk[i][1] * p.scale);
      store_bf16x2(dvo + (int64_t)keyA * p.dv_sr + i * 8 + 2 * t4, dv[i][0], dv[i][1]);
    }
  }
  if (keyB < p.kv_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      store_bf16x2(dko + (int64_t)keyB * p.dk_sr + i * 8 + 2 * t4, dk[i][2] * p.scale,
                   dk[i][3] * p.scale);
      store_bf16x2(dvo + (int64_t)keyB * p.dv_sr + i * 8 + 2 * t4, dv[i][2], dv[i][3]);
    }
  }
}

template <int D, int MT, int BN>
void run_dq(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = dq_smem_bytes<D, MT, BN>();
  cudaFuncSetAttribute(attn_bwd_dq_kernel<D, MT, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  attn_bwd_dq_kernel<D, MT, BN><<<dim3((p.meta.nqt + MT - 1) / MT, p.Hq, p.B), kThreads, smem, s>>>(p);
  DFLASH_CHECK_LAUNCH("attention backward dq");
}

template <int D, int NW>
void run_dkv(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = DkvSmem<D, NW>::kBytes;
  cudaFuncSetAttribute(attn_bwd_dkv_kernel<D, NW>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  const int nct = (p.meta.nkt + NW / 4 - 1) / (NW / 4);
  attn_bwd_dkv_kernel<D, NW><<<dim3(nct, p.Hkv, p.B), 32 * NW, smem, s>>>(p);
  DFLASH_CHECK_LAUNCH("attention backward dkv");
}

template <int D>
void run_bwd(const AttnParams& p, cudaStream_t s, int stage) {
  const bool fused = backward_accumulates_dq(D);
  const int64_t threads = (int64_t)p.B * p.Hq * p.q_len * (D / 8);
  if (fused && p.dq_accum == nullptr)
    throw std::runtime_error("dflash attention kernel: the fused backward (DFLASH_ATTN_DKV_VARIANT=7) needs "
                             "AttnParams::dq_accum (dq_accum_numel() floats)");
  if (stage < 0 || stage == 0) {
    if (fused) {  // the sum, and the fixed point's K/V maxima (the row scales are written, not added)
      const cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, dq_accum_numel(p.B, p.Hq, p.q_len, D) * sizeof(float), s);
      if (e != cudaSuccess)
        throw std::runtime_error(std::string("dflash attention kernel: zeroing dq_accum: ") + cudaGetErrorString(e));
    }
    if (p.dq_row_scale != nullptr) {
      launch_kv_max(p, s);
    }
    delta_kernel<D><<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(p);
    DFLASH_CHECK_LAUNCH("attention backward delta");
  }
  if ((stage < 0 || stage == 1) && !fused) {
    const int dqv = dq_variant();
    switch (dqv) {
      case 1: run_dq<D, 1, 64>(p, s); break;
      case 2: run_dq<D, 2, 16>(p, s); break;
      case 3: run_dq<D, 2, 32>(p, s); break;
      default:
        if (!wgmma_supported()) run_dq<D, 2, 32>(p, s);
        else if (!((dqv == 7 || dqv == 8) && launch_dq_ws(p, dqv, s))) launch_dq_wgmma(p, s);
        break;
    }
  }
  if (stage < 0 || stage == 2) {
    const int var = dkv_variant();
    if (fused) {
      launch_bwd_fused(p, fused_tma() == 1, s);
      launch_dq_from_accum(p, s);
    } else if ((var == 3 || var == 7) && wgmma_supported()) launch_dkv_wgmma(p, dkv_tma() == 1, s);
    else if (var == 2) run_dkv<D, 8>(p, s);
    else run_dkv<D, 4>(p, s);
  }
}

}  // namespace

// The Hopper backward passes' walk over query tiles (AttnParams::bwd_descend; DFLASH_ATTN_BWD_DESCEND = 1:
// descending, the default since 2026-12-06, recipe shape 8.6-8.8 -> 7.8-8.2 ms fwd+bwd on an H100,
// bench/RESULTS.md; 0: ascending, the A/B and test oracle). Read at each launch.
static int bwd_descend() {
  static constexpr int kAllowed[] = {0, 1};
  return kernel_variant_from_env("DFLASH_ATTN_BWD_DESCEND", kAllowed, 2, 1);
}

void launch_attn_bwd_stage(const AttnParams& params, int stage, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  AttnParams p = params;
  p.bwd_descend = bwd_descend();
  // The fused pass's fixed-point dQ: the row scales and K/V maxima live in dq_accum after the sum (dq_accum_numel).
  p.dq_row_scale = nullptr;
  p.kv_max = nullptr;
  if (p.d == 128 && backward_accumulates_dq(128) && p.dq_accum != nullptr && fused_det() == 1) {
    const int64_t sum = (int64_t)p.B * p.Hq * p.meta.nqt * kTileQ * 128;
    p.dq_row_scale = p.dq_accum + sum;
    p.kv_max = p.dq_row_scale + (int64_t)p.B * p.Hq * p.meta.nqt * kTileQ;
  }
  // The dK/dV and fused passes divide an item index by G with a multiply (ItemDiv, item_div.h), exact below 2^32 / G.
  const int64_t G = p.Hkv > 0 ? p.Hq / p.Hkv : 1;
  if (static_cast<int64_t>(p.meta.nqt) * G * G >= (int64_t{1} << 32))
    throw std::runtime_error("dflash attention kernel: " + std::to_string(p.meta.nqt) + " query tiles x (" +
                             std::to_string(G) + " query heads per KV head)^2 must stay below 2^32 (the backward's item walk)");
  if (p.d == 128) run_bwd<128>(p, s, stage);
  else if (p.d == 64) run_bwd<64>(p, s, stage);
  else throw std::runtime_error("dflash attention kernel: head dim must be 64 or 128");
}

void launch_attn_bwd(const AttnParams& p, void* stream) { launch_attn_bwd_stage(p, -1, stream); }

bool backward_accumulates_dq(int d) { return d == 128 && dkv_variant() == 7 && wgmma_supported(); }

bool fused_backward_available(int64_t d) { return d == 128 && wgmma_supported(); }

void set_fused_backward(bool on) { g_dkv_default.store(on ? 7 : 3); }

// The sum (B Hq (query tiles) 64 x d), the fixed point's row scales (B Hq (query tiles) 64) and K/V maxima (2, padded
// to 4).
int64_t dq_accum_numel(int64_t B, int64_t Hq, int64_t q_len, int64_t d) {
  const int64_t rows = B * Hq * ((q_len + kTileQ - 1) / kTileQ) * kTileQ;
  return rows * d + rows + 4;
}

}  // namespace dflash::attention
