// Forward kernel of the block-sparse DFlash attention (FA2-style: mma.sync bf16, ldmatrix,
// cp.async double buffering, online softmax in base 2).
//
// One CTA = 4 warps = one 64-row query tile of one (batch row, query head); each warp owns 16
// rows. The CTA walks the key tiles of its query tile's two key ranges (attention/kernel.h):
// the context range [ctx_lo, ctx_hi) and the own-block range [blk_lo, blk_hi), in 64-key steps
// starting at the range's first key (so no alignment of the context length is needed). Inside a
// tile the per-row mask is applied unless every row of the warp sees the whole tile.
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

template <int D>
constexpr int fwd_smem_bytes() {
  return kTileQ * D * 2 + 4 * kTileK * D * 2;
}

template <int D>
__global__ void __launch_bounds__(kThreads, 2) attn_fwd_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt;
  const int qt = nqt - 1 - (int)blockIdx.x;  // heavy (late-anchor) tiles first when sorted
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int m0 = qt * kTileQ;
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  const int4 tq = reinterpret_cast<const int4*>(p.meta.qtiles)[(int64_t)b * nqt + qt];
  const int n1 = tq.y > tq.x ? (tq.y - tq.x + kTileK - 1) / kTileK : 0;
  const int n2 = tq.w > tq.z ? (tq.w - tq.z + kTileK - 1) / kTileK : 0;
  const int ntiles = n1 + n2;

  constexpr uint32_t kQBytes = kTileQ * D * 2, kKVBytes = kTileK * D * 2;
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK0 = sQ + kQBytes, sV0 = sK0 + 2 * kKVBytes;

  auto tile_start = [&](int t) { return t < n1 ? tq.x + t * kTileK : tq.z + (t - n1) * kTileK; };

  load_tile<kTileQ, D, kThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
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

  const float sl2 = p.scale * kLog2e;
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  uint32_t qf[D / 16][4];

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
      for (int ks = 0; ks < D / 16; ++ks) load_a<D>(sQ, warp * 16, ks * 16, lane, qf[ks]);
    }
    const uint32_t sK = sK0 + buf * kKVBytes, sV = sV0 + buf * kKVBytes;
    const int n0 = tile_start(t);
    const bool ctx = t < n1;

    float s[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int np = 0; np < 4; ++np) {
        uint32_t bb[4];
        load_b_nk<D>(sK, np * 16, ks * 16, lane, bb);
        mma16816(s[2 * np], qf[ks], bb[0], bb[1]);
        mma16816(s[2 * np + 1], qf[ks], bb[2], bb[3]);
      }
    }

    const bool full = ctx && n0 >= rowA.x && n0 + kTileK <= rowA.y && n0 >= rowB.x &&
                      n0 + kTileK <= rowB.y;
    if (!__all_sync(0xffffffffu, full)) {
      const int lo_a = ctx ? rowA.x : rowA.z, hi_a = ctx ? rowA.y : rowA.w;
      const int lo_b = ctx ? rowB.x : rowB.z, hi_b = ctx ? rowB.y : rowB.w;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = n0 + j * 8 + 2 * t4 + e;
          if (!(key >= lo_a && key < hi_a)) s[j][e] = -INFINITY;
          if (!(key >= lo_b && key < hi_b)) s[j][2 + e] = -INFINITY;
        }
      }
    }

    float mxA = mA, mxB = mB;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      mxA = fmaxf(mxA, fmaxf(s[j][0], s[j][1]));
      mxB = fmaxf(mxB, fmaxf(s[j][2], s[j][3]));
    }
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    const float uA = mxA == -INFINITY ? 0.f : mxA * sl2;
    const float uB = mxB == -INFINITY ? 0.f : mxB * sl2;
    const float cA = ex2(mA * sl2 - uA), cB = ex2(mB * sl2 - uB);
    mA = mxA;
    mB = mxB;
    lA *= cA;
    lB *= cB;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      s[j][0] = ex2(s[j][0] * sl2 - uA);
      s[j][1] = ex2(s[j][1] * sl2 - uA);
      s[j][2] = ex2(s[j][2] * sl2 - uB);
      s[j][3] = ex2(s[j][3] * sl2 - uB);
      lA += s[j][0] + s[j][1];
      lB += s[j][2] + s[j][3];
    }
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= cA;
      o[i][1] *= cA;
      o[i][2] *= cB;
      o[i][3] *= cB;
    }
#pragma unroll
    for (int ks = 0; ks < kTileK / 16; ++ks) {
      uint32_t a[4];
      acc_to_a(s[2 * ks], s[2 * ks + 1], a);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bb[4];
        load_b_kn<D>(sV, ks * 16, dp * 16, lane, bb);
        mma16816(o[2 * dp], a, bb[0], bb[1]);
        mma16816(o[2 * dp + 1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  lB += __shfl_xor_sync(0xffffffffu, lB, 1);
  lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  const float iA = lA > 0.f ? 1.f / lA : 0.f, iB = lB > 0.f ? 1.f / lB : 0.f;
  bf16* out = static_cast<bf16*>(p.o) + b * p.o_sb + h * p.o_sh;
  float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.q_len;
  if (ra < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(out + (int64_t)ra * p.o_sr + i * 8 + 2 * t4, o[i][0] * iA, o[i][1] * iA);
    if (t4 == 0) lse[ra] = lA > 0.f ? (mA * sl2 + __log2f(lA)) * kLn2 : -INFINITY;
  }
  if (rb < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(out + (int64_t)rb * p.o_sr + i * 8 + 2 * t4, o[i][2] * iB, o[i][3] * iB);
    if (t4 == 0) lse[rb] = lB > 0.f ? (mB * sl2 + __log2f(lB)) * kLn2 : -INFINITY;
  }
}

template <int D>
void run_fwd(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = fwd_smem_bytes<D>();
  cudaFuncSetAttribute(attn_fwd_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  dim3 grid(p.meta.nqt, p.Hq, p.B);
  attn_fwd_kernel<D><<<grid, kThreads, smem, s>>>(p);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess)
    throw std::runtime_error(std::string("dflash attention forward launch failed: ") +
                             cudaGetErrorString(e));
}

}  // namespace

void launch_attn_fwd(const AttnParams& p, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.d == 128) run_fwd<128>(p, s);
  else if (p.d == 64) run_fwd<64>(p, s);
  else throw std::runtime_error("dflash attention kernel: head dim must be 64 or 128");
}

}  // namespace dflash::attention
