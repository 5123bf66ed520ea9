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
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "attention/kernel.h"
#include "attention/kernel/common.cuh"

namespace dflash::attention {
namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kThreads = 128;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

void check(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("dflash attention backward: launch of ") + what +
                             " failed: " + cudaGetErrorString(e));
}

// ---- 1. delta ------------------------------------------------------------------------------
template <int D>
__global__ void delta_kernel(const AttnParams p) {
  constexpr int L = D / 8;  // lanes per row, 16 bytes each
  const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t row = gid / L;
  const int c = (int)(gid % L);
  const int64_t total = (int64_t)p.B * p.Hq * p.q_len;
  float acc = 0.f;
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
    }
  }
#pragma unroll
  for (int off = L / 2; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  if (row < total && c == 0) p.delta[row] = acc;
}

// ---- 2. dQ ---------------------------------------------------------------------------------
template <int D>
constexpr int dq_smem_bytes() {
  return 2 * kTileQ * D * 2 + 4 * kTileK * D * 2;
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) attn_bwd_dq_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
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

  const int4 tq = reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * nqt + qt];
  const int n1 = tq.y > tq.x ? (tq.y - tq.x + kTileK - 1) / kTileK : 0;
  const int n2 = tq.w > tq.z ? (tq.w - tq.z + kTileK - 1) / kTileK : 0;
  const int ntiles = n1 + n2;

  constexpr uint32_t kQBytes = kTileQ * D * 2, kKVBytes = kTileK * D * 2;
  const uint32_t sQ = smem_u32(smem), sdO = sQ + kQBytes;
  const uint32_t sK0 = sdO + kQBytes, sV0 = sK0 + 2 * kKVBytes;
  auto tile_start = [&](int t) { return t < n1 ? tq.x + t * kTileK : tq.z + (t - n1) * kTileK; };

  load_tile<kTileQ, D, kThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
  load_tile<kTileQ, D, kThreads>(sdO, dout, p.do_sr, m0, p.q_len, tid);
  if (ntiles > 0) {
    const int n0 = tile_start(0);
    load_tile<kTileK, D, kThreads>(sK0, k, p.k_sr, n0, p.kv_len, tid);
    load_tile<kTileK, D, kThreads>(sV0, v, p.v_sr, n0, p.kv_len, tid);
  }
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int ra = m0 + warp * 16 + g, rb = ra + 8;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int4 rowA = rows[ra], rowB = rows[rb];
  const float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.q_len;
  const float* delta = p.delta + ((int64_t)b * p.Hq + h) * p.q_len;
  const float lA = ra < p.q_len ? lse[ra] * kLog2e : 0.f, lB = rb < p.q_len ? lse[rb] * kLog2e : 0.f;
  const float dA = ra < p.q_len ? delta[ra] : 0.f, dB = rb < p.q_len ? delta[rb] : 0.f;
  const float sl2 = p.scale * kLog2e;

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
  uint32_t qf[D / 16][4], of[D / 16][4];

  for (int t = 0; t < ntiles; ++t) {
    const int buf = t & 1;
    if (t + 1 < ntiles) {
      const int n0n = tile_start(t + 1);
      load_tile<kTileK, D, kThreads>(sK0 + (buf ^ 1) * kKVBytes, k, p.k_sr, n0n, p.kv_len, tid);
      load_tile<kTileK, D, kThreads>(sV0 + (buf ^ 1) * kKVBytes, v, p.v_sr, n0n, p.kv_len, tid);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    if (t == 0) {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        load_a<D>(sQ, warp * 16, ks * 16, lane, qf[ks]);
        load_a<D>(sdO, warp * 16, ks * 16, lane, of[ks]);
      }
    }
    const uint32_t sK = sK0 + buf * kKVBytes, sV = sV0 + buf * kKVBytes;
    const int n0 = tile_start(t);
    const bool ctx = t < n1;

    float s[8][4], dp[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j)
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bb[4];
        load_b_nk<D>(sK, np * 16, ks * 16, lane, bb);
        mma16816(s[2 * np], qf[ks], bb[0], bb[1]);
        mma16816(s[2 * np + 1], qf[ks], bb[2], bb[3]);
        load_b_nk<D>(sV, np * 16, ks * 16, lane, bb);
        mma16816(dp[2 * np], of[ks], bb[0], bb[1]);
        mma16816(dp[2 * np + 1], of[ks], bb[2], bb[3]);
      }
    }
    const bool full = ctx && n0 >= rowA.x && n0 + kTileK <= rowA.y && n0 >= rowB.x &&
                      n0 + kTileK <= rowB.y;
    const bool all_full = __all_sync(0xffffffffu, full);
    const int lo_a = ctx ? rowA.x : rowA.z, hi_a = ctx ? rowA.y : rowA.w;
    const int lo_b = ctx ? rowB.x : rowB.z, hi_b = ctx ? rowB.y : rowB.w;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = n0 + j * 8 + 2 * t4 + e;
        const bool va = all_full || (key >= lo_a && key < hi_a);
        const bool vb = all_full || (key >= lo_b && key < hi_b);
        const float pa = va ? ex2(s[j][e] * sl2 - lA) : 0.f;
        const float pb = vb ? ex2(s[j][2 + e] * sl2 - lB) : 0.f;
        s[j][e] = pa * (dp[j][e] - dA);
        s[j][2 + e] = pb * (dp[j][2 + e] - dB);
      }
    }
#pragma unroll
    for (int ks = 0; ks < kTileK / 16; ++ks) {
      uint32_t a[4];
      acc_to_a(s[2 * ks], s[2 * ks + 1], a);
#pragma unroll
      for (int dpi = 0; dpi < D / 16; ++dpi) {
        uint32_t bb[4];
        load_b_kn<D>(sK, ks * 16, dpi * 16, lane, bb);
        mma16816(dq[2 * dpi], a, bb[0], bb[1]);
        mma16816(dq[2 * dpi + 1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  bf16* dqo = static_cast<bf16*>(p.dq) + b * p.dq_sb + h * p.dq_sh;
  if (ra < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(dqo + (int64_t)ra * p.dq_sr + i * 8 + 2 * t4, dq[i][0] * p.scale,
                   dq[i][1] * p.scale);
  }
  if (rb < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(dqo + (int64_t)rb * p.dq_sr + i * 8 + 2 * t4, dq[i][2] * p.scale,
                   dq[i][3] * p.scale);
  }
}

// ---- 3. dK, dV -----------------------------------------------------------------------------
template <int D>
struct DkvSmem {
  static constexpr int kTile = kTileQ * D * 2;                 // one Q or dO tile
  static constexpr int kStage = 2 * kTile + kTileQ * 16 + 2 * kTileQ * 4;  // Q, dO, rows, lse, delta
  static constexpr int kBytes = 2 * kTileK * D * 2 + 2 * kStage;
};

template <int D>
__global__ void __launch_bounds__(kThreads, 2) attn_bwd_dkv_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  using S = DkvSmem<D>;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt, nkt = p.meta.nkt;
  const int kt = (int)blockIdx.x;  // low key tiles (seen by most query tiles) first
  const int hk = blockIdx.y, b = blockIdx.z;
  const int G = p.Hq / p.Hkv;
  const int n0 = kt * kTileK;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  const int2 kr = reinterpret_cast<const int2*>(p.meta.ktiles)[(int64_t)b * nkt + kt];
  const int4* qtiles = reinterpret_cast<const int4*>(p.meta.qtiles) + (int64_t)b * nqt;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int nitems = (kr.y - kr.x) * G;
  auto valid = [&](int i) {
    const int4 tq = qtiles[kr.x + i / G];
    return (tq.x < n0 + kTileK && tq.y > n0 && tq.y > tq.x) ||
           (tq.z < n0 + kTileK && tq.w > n0 && tq.w > tq.z);
  };
  auto next_item = [&](int i) {
    while (i < nitems && !valid(i)) ++i;
    return i;
  };

  const uint32_t sK = smem_u32(smem), sV = sK + kTileK * D * 2;
  const uint32_t sStage0 = sV + kTileK * D * 2;
  unsigned char* stage_ptr0 = smem + 2 * kTileK * D * 2;

  auto load_item = [&](int i, int buf) {
    const int qt = kr.x + i / G, h = hk * G + i % G;
    const int m0 = qt * kTileQ;
    const uint32_t st = sStage0 + buf * S::kStage;
    load_tile<kTileQ, D, kThreads>(st, static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh,
                                   p.q_sr, m0, p.q_len, tid);
    load_tile<kTileQ, D, kThreads>(st + S::kTile,
                                   static_cast<const bf16*>(p.dout) + b * p.do_sb + h * p.do_sh,
                                   p.do_sr, m0, p.q_len, tid);
    const uint32_t sRows = st + 2 * S::kTile, sL = sRows + kTileQ * 16, sD = sL + kTileQ * 4;
    const int64_t lo = ((int64_t)b * p.Hq + h) * p.q_len;
    if (tid < kTileQ) {
      cp_async16(sRows + tid * 16, rows + m0 + tid, true);
      const bool ok = m0 + tid < p.q_len;
      cp_async4(sL + tid * 4, p.lse + (ok ? lo + m0 + tid : 0), ok);
    } else {
      const int r = tid - kTileQ;
      const bool ok = m0 + r < p.q_len;
      cp_async4(sD + r * 4, p.delta + (ok ? lo + m0 + r : 0), ok);
    }
  };

  load_tile<kTileK, D, kThreads>(sK, k, p.k_sr, n0, p.kv_len, tid);
  load_tile<kTileK, D, kThreads>(sV, v, p.v_sr, n0, p.kv_len, tid);
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

template <int D>
void run_bwd(const AttnParams& p, cudaStream_t s) {
  const int64_t rows = (int64_t)p.B * p.Hq * p.q_len;
  const int64_t threads = rows * (D / 8);
  delta_kernel<D><<<(unsigned)((threads + 255) / 256), 256, 0, s>>>(p);
  check("delta");
  constexpr int smem_dq = dq_smem_bytes<D>();
  cudaFuncSetAttribute(attn_bwd_dq_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_dq);
  attn_bwd_dq_kernel<D><<<dim3(p.meta.nqt, p.Hq, p.B), kThreads, smem_dq, s>>>(p);
  check("dq");
  constexpr int smem_kv = DkvSmem<D>::kBytes;
  cudaFuncSetAttribute(attn_bwd_dkv_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_kv);
  attn_bwd_dkv_kernel<D><<<dim3(p.meta.nkt, p.Hkv, p.B), kThreads, smem_kv, s>>>(p);
  check("dkv");
}

}  // namespace

void launch_attn_bwd(const AttnParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.d == 128) run_bwd<128>(p, s);
  else if (p.d == 64) run_bwd<64>(p, s);
  else throw std::runtime_error("dflash attention kernel: head dim must be 64 or 128");
}

}  // namespace dflash::attention
