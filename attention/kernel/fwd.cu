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
#include "core/launch_check.h"
#include "attention/kernel/common.cuh"

namespace dflash::attention {

bool wgmma_supported();                                  // bwd_sm90.cu
void launch_fwd_wgmma(const AttnParams& p, bool q_in_registers, void* stream);  // fwd_sm90.cu
bool launch_fwd_ws(const AttnParams& p, int variant, void* stream);           // ws_sm90.cu

namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

constexpr int kThreads = 128;

// Tile variant, for benchmarking (DFLASH_ATTN_FWD_VARIANT = 1: 16 rows/warp x 64 keys,
// 2: 32 rows/warp x 32 keys, 3: 32 rows/warp x 64 keys, 4: Hopper wgmma, 5: Hopper wgmma with Q
// as a register operand of S (fwd_sm90.cu); 7: variant 5's schedule with two query heads per CTA
// sharing a TMA K/V ring, 8: the same with ping-pong between the two warpgroups, 13 (the default
// since 2026-12-05): variant 7 on 128-key tiles (ws_sm90.cu; 7, 8 and 13 run 5 where the heads
// cannot be paired or TMA cannot describe the tensors; 13 is within rounding of 7,
// KernelForward128Keys). 4 to 8 are bit-identical (KernelForwardVariants); all fall back to 3 where
// wgmma is unavailable; measured in kernel/NOTES.md. Read at each launch.
int fwd_variant() {
  static constexpr int kAllowed[] = {1, 2, 3, 4, 5, 7, 8, 13};
  return kernel_variant_from_env("DFLASH_ATTN_FWD_VARIANT", kAllowed, 8, 13);
}

// The Hopper forwards' rescale slack in log2 units (DFLASH_ATTN_RESCALE_SLACK = 8, the default, or
// 0: O rescaled whenever a running maximum grows; kernel/tile_math.cuh softmax_step). Variants 1-3
// (the sm_80 path) always take the exact maximum. Read at each launch.
int rescale_slack() {
  static constexpr int kAllowed[] = {0, kRescaleSlackDefault};
  return kernel_variant_from_env("DFLASH_ATTN_RESCALE_SLACK", kAllowed, 2, kRescaleSlackDefault);
}

template <int D, int MT, int BN>
constexpr int fwd_smem_bytes() {
  return MT * kTileQ * D * 2 + 4 * BN * D * 2;
}

// MT: 16-row m-tiles per warp (the CTA covers MT metadata tiles of 64 rows: rows
// mt*64 + warp*16 + [0, 16) for m-tile mt); BN: keys per key tile.
template <int D, int MT, int BN>
__global__ void __launch_bounds__(kThreads, 2) attn_fwd_kernel(const AttnParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int BM = MT * kTileQ;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt;
  const int ncta = (nqt + MT - 1) / MT;
  const int cta = ncta - 1 - (int)blockIdx.x;  // heavy (late-anchor) tiles first when sorted
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / (p.Hq / p.Hkv);
  const int m0 = cta * BM;
  const bf16* q = static_cast<const bf16*>(p.q) + b * p.q_sb + h * p.q_sh;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  // Union of the key ranges of this CTA's metadata tiles.
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
  const uint32_t sQ = smem_u32(smem);
  const uint32_t sK0 = sQ + kQBytes, sV0 = sK0 + 2 * kKVBytes;

  auto tile_start = [&](int t) { return t < n1 ? clo + t * BN : blo + (t - n1) * BN; };

  load_tile<BM, D, kThreads>(sQ, q, p.q_sr, m0, p.q_len, tid);
  if (ntiles > 0) {
    const int n0 = tile_start(0);
    load_tile<BN, D, kThreads>(sK0, k, p.k_sr, n0, p.kv_len, tid);
    load_tile<BN, D, kThreads>(sV0, v, p.v_sr, n0, p.kv_len, tid);
  }
  cp_async_commit();

  const int g = lane >> 2, t4 = lane & 3;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  // The context key range every row of this warp sees (for the no-mask fast path).
  int wlo = 0, whi = 0x7fffffff;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int r = m0 + mt * kTileQ + warp * 16 + g;
    const bool in = cta * MT + mt < nqt;
    const int4 ra = in ? rows[r] : make_int4(0, 0, 0, 0), rb = in ? rows[r + 8] : make_int4(0, 0, 0, 0);
    wlo = max(wlo, max(ra.x, rb.x));
    whi = min(whi, min(ra.y, rb.y));
  }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    wlo = max(wlo, __shfl_xor_sync(0xffffffffu, wlo, off));
    whi = min(whi, __shfl_xor_sync(0xffffffffu, whi, off));
  }

  const float sl2 = p.scale * kLog2e;
  float o[MT][D / 8][4];
  float mrow[MT][2], lrow[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[mt][i][0] = o[mt][i][1] = o[mt][i][2] = o[mt][i][3] = 0.f;
    mrow[mt][0] = mrow[mt][1] = -INFINITY;
    lrow[mt][0] = lrow[mt][1] = 0.f;
  }

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

    float s[MT][BN / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t qa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a<D>(sQ, mt * kTileQ + warp * 16, ks * 16, lane, qa[mt]);
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        uint32_t bb[4];
        load_b_nk<D>(sK, np * 16, ks * 16, lane, bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(s[mt][2 * np], qa[mt], bb[0], bb[1]);
          mma16816(s[mt][2 * np + 1], qa[mt], bb[2], bb[3]);
        }
      }
    }

    const bool full = ctx && n0 >= wlo && n0 + BN <= whi;
    if (!full) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = m0 + mt * kTileQ + warp * 16 + g;
        const int4 ra = rows[r], rb = rows[r + 8];
        const int lo_a = ctx ? ra.x : ra.z, hi_a = ctx ? ra.y : ra.w;
        const int lo_b = ctx ? rb.x : rb.z, hi_b = ctx ? rb.y : rb.w;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = n0 + j * 8 + 2 * t4 + e;
            if (!(key >= lo_a && key < hi_a)) s[mt][j][e] = -INFINITY;
            if (!(key >= lo_b && key < hi_b)) s[mt][j][2 + e] = -INFINITY;
          }
        }
      }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      float mx[2] = {mrow[mt][0], mrow[mt][1]};
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        mx[0] = fmaxf(mx[0], fmaxf(s[mt][j][0], s[mt][j][1]));
        mx[1] = fmaxf(mx[1], fmaxf(s[mt][j][2], s[mt][j][3]));
      }
      float c[2], u[2];
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 1));
        mx[hh] = fmaxf(mx[hh], __shfl_xor_sync(0xffffffffu, mx[hh], 2));
        u[hh] = mx[hh] == -INFINITY ? 0.f : mx[hh] * sl2;
        c[hh] = ex2(mrow[mt][hh] * sl2 - u[hh]);
        mrow[mt][hh] = mx[hh];
        lrow[mt][hh] *= c[hh];
      }
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        s[mt][j][0] = ex2(s[mt][j][0] * sl2 - u[0]);
        s[mt][j][1] = ex2(s[mt][j][1] * sl2 - u[0]);
        s[mt][j][2] = ex2(s[mt][j][2] * sl2 - u[1]);
        s[mt][j][3] = ex2(s[mt][j][3] * sl2 - u[1]);
        lrow[mt][0] += s[mt][j][0] + s[mt][j][1];
        lrow[mt][1] += s[mt][j][2] + s[mt][j][3];
      }
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        o[mt][i][0] *= c[0];
        o[mt][i][1] *= c[0];
        o[mt][i][2] *= c[1];
        o[mt][i][3] *= c[1];
      }
    }
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a(s[mt][2 * ks], s[mt][2 * ks + 1], a[mt]);
#pragma unroll
      for (int dp = 0; dp < D / 16; ++dp) {
        uint32_t bb[4];
        load_b_kn<D>(sV, ks * 16, dp * 16, lane, bb);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816(o[mt][2 * dp], a[mt], bb[0], bb[1]);
          mma16816(o[mt][2 * dp + 1], a[mt], bb[2], bb[3]);
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  bf16* out = static_cast<bf16*>(p.o) + b * p.o_sb + h * p.o_sh;
  float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.q_len;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      float l = lrow[mt][hh];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const float il = l > 0.f ? 1.f / l : 0.f;
      const int r = m0 + mt * kTileQ + warp * 16 + g + hh * 8;
      if (r < p.q_len) {
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          store_bf16x2(out + (int64_t)r * p.o_sr + i * 8 + 2 * t4, o[mt][i][2 * hh] * il,
                       o[mt][i][2 * hh + 1] * il);
        if (t4 == 0) lse[r] = l > 0.f ? (mrow[mt][hh] * sl2 + __log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
}

template <int D, int MT, int BN>
void run_fwd(const AttnParams& p, cudaStream_t s) {
  constexpr int smem = fwd_smem_bytes<D, MT, BN>();
  cudaFuncSetAttribute(attn_fwd_kernel<D, MT, BN>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  dim3 grid((p.meta.nqt + MT - 1) / MT, p.Hq, p.B);
  attn_fwd_kernel<D, MT, BN><<<grid, kThreads, smem, s>>>(p);
  DFLASH_CHECK_LAUNCH("attention forward");
}

template <int D>
void run_fwd_variant(const AttnParams& p, cudaStream_t s) {
  const int variant = fwd_variant();
  switch (variant) {
    case 1: run_fwd<D, 1, 64>(p, s); break;
    case 2: run_fwd<D, 2, 32>(p, s); break;
    case 3: run_fwd<D, 2, 64>(p, s); break;
    default:
      if (!wgmma_supported()) run_fwd<D, 2, 64>(p, s);
      else if (!((variant == 7 || variant == 8 || variant == 13) && launch_fwd_ws(p, variant, s)))
        launch_fwd_wgmma(p, variant != 4, s);
      break;
  }
}

}  // namespace

bool forward_is_wgmma() { return fwd_variant() >= 4 && wgmma_supported(); }  // 4 and up: the default

void launch_attn_fwd(const AttnParams& params, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  AttnParams p = params;
  p.rescale_slack = float(rescale_slack());
  if (p.d == 128) run_fwd_variant<128>(p, s);
  else if (p.d == 64) run_fwd_variant<64>(p, s);
  else throw std::runtime_error("dflash attention kernel: head dim must be 64 or 128");
}

}  // namespace dflash::attention
