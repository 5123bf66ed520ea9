// dK/dV pass of the DFlash attention backward with Hopper warpgroup MMA (wgmma, sm_90a).
//
// Same work split as the mma.sync version in bwd.cu (one CTA = one warpgroup = 64 keys of one
// (batch row, KV head), walking every (query head of the GQA group, 64-row query tile) that sees
// the key tile), but all four matmuls read their shared-memory operands directly:
//   S^T  = K Q^T      (A = K tile, B = Q tile, both K-major)          m64n64k16 x d/16
//   dP^T = V dO^T     (A = V tile, B = dO tile, both K-major)         m64n64k16 x d/16
//   dV  += P^T dO     (A = P^T from registers, B = dO tile N-major)   m64n{d}k16 x 4
//   dK  += dS^T Q     (A = dS^T from registers, B = Q tile N-major)   m64n{d}k16 x 4
// The Q and dO tiles serve as K-major operands for the first two and as N-major operands for the
// last two (same bytes, different descriptors). Tiles use the 128-byte swizzle (wgmma.cuh).
// On other architectures the kernel is compiled empty and never launched (launch_attn_bwd checks
// the device).
#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>

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

constexpr int kWgThreads = 128;


template <int D>
struct DkvWgSmem {
  static constexpr int kTile = kTileQ * D * 2;  // Q, dO, K or V tile (64 rows)
  static constexpr int kStage = 2 * kTile + kTileQ * 16 + 2 * kTileQ * 4;
  static constexpr int kStageAligned = (kStage + 1023) / 1024 * 1024;
  static constexpr int kBar = 2 * kTile + 2 * kStageAligned;           // full[2] (kTma: the Q/dO boxes landed)
  static constexpr int kBytes = 1024 + kBar + 16;                       // +1024: base alignment
};

// kTma (the default where TMA can describe q and dO; DFLASH_ATTN_DKV_TMA, read in bwd.cu): each item's Q and dO
// tiles by TMA, issued by thread 0 onto a "full" mbarrier per stage buffer, instead of 16 cp.async of 16 bytes per
// thread with their address arithmetic (item loop 1069 -> 846 SASS instructions at d = 128); the item then starts
// on that barrier's wait instead of a block barrier, and the row records, LSE and delta (cp.async) are waited at
// the barrier after S^T, as in the fused pass (bwd_fused_sm90.cu). Same bytes, same products in the same order:
// dK and dV are bit-identical to the cp.async kernel's (tested). Measured: bench/RESULTS.md 2026-12-07 10:15.

template <int D, bool kTma>
__global__ void __launch_bounds__(kWgThreads, 2)
    attn_bwd_dkv_wgmma_kernel(const AttnParams p, const __grid_constant__ QdoMaps maps) {
#ifdef DFLASH_WGMMA
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using S = DkvWgSmem<D>;
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* gbase = smem_raw + (base - raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nqt = p.meta.nqt, nkt = p.meta.nkt;
  const int kt = (int)blockIdx.x;
  const int hk = blockIdx.y, b = blockIdx.z;
  const int G = p.Hq / p.Hkv;
  const int n0 = kt * kTileK;
  const bf16* k = static_cast<const bf16*>(p.k) + b * p.k_sb + hk * p.k_sh;
  const bf16* v = static_cast<const bf16*>(p.v) + b * p.v_sb + hk * p.v_sh;

  const int2 kr = reinterpret_cast<const int2*>(p.meta.ktiles)[(int64_t)b * nkt + kt];
  const int4* qtiles = reinterpret_cast<const int4*>(p.meta.qtiles) + (int64_t)b * nqt;
  const int4* rows = reinterpret_cast<const int4*>(p.meta.rows) + (int64_t)b * nqt * kTileQ;
  const int nitems = (kr.y - kr.x) * G;
  // item i: query tile qt_of(i) (ascending from kr.x, or descending from kr.y - 1), query head hk G + i % G
  const int qt0 = p.bwd_descend ? kr.y - 1 : kr.x, qdir = p.bwd_descend ? -1 : 1;
  const ItemDiv div_g(G);
  auto qt_of = [&](int i) { return qt0 + qdir * div_g(i); };
  auto valid_tq = [&](const int4 tq) {  // does query tile record tq see this key tile?
    return (tq.x < n0 + kTileK && tq.y > n0 && tq.y > tq.x) ||
           (tq.z < n0 + kTileK && tq.w > n0 && tq.w > tq.z);
  };
  auto valid = [&](int i) { return valid_tq(qtiles[qt_of(i)]); };
  auto next_item = [&](int i) {
    while (i < nitems && !valid(i)) ++i;
    return i;
  };

  const uint32_t sK = base, sV = base + S::kTile, sStage0 = base + 2 * S::kTile, sBar0 = base + S::kBar;
  unsigned char* stage_ptr0 = gbase + 2 * S::kTile;

  auto load_item = [&](int i, int buf) {
    const auto [gi, hi] = div_g.divmod(i);
    bwd_load_item<D, kWgThreads, kTma>(p, maps, rows, sStage0 + buf * S::kStageAligned, sBar0 + 8 * buf,
                                       b, hk * G + hi, (qt0 + qdir * gi) * kTileQ, tid);
  };

  bwd_init_full_bars<kTma>(sBar0, tid);
  load_tile_w<kTileK, D, kWgThreads>(sK, k, p.k_sr, n0, p.kv_len, tid);
  load_tile_w<kTileK, D, kWgThreads>(sV, v, p.v_sr, n0, p.kv_len, tid);
  int item = next_item(0);
  if (item < nitems) load_item(item, 0);
  cp_async_commit();
  if constexpr (kTma) {  // K, V and the first item's row records in shared memory; the barriers initialised
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
  }

  const int g = lane >> 2, t4 = lane & 3;
  const int keyA = n0 + warp * 16 + g, keyB = keyA + 8;
  const float sl2 = p.scale * kLog2e;
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;

  // Per item i (wgmma groups complete in issue order):
  //   S^T(i), dP^T(i) issued as two groups -> wait<1>: S^T(i) done, and dK(i-1) before it
  //   -> item i-1's stage buffer is free: the loads of item i+1 go there
  //   -> P(i) on the CUDA cores while dP^T(i) runs on the tensor cores -> dV(i) issued
  //   -> wait<1>: dP^T(i) done -> dS(i) while dV(i) runs -> dK(i) issued -> wait<1> (dV(i)):
  //   dK(i) runs on while the next item starts.
  // Masking: a warp whose 16 keys lie inside the context range of every row of the query tile
  // (the common case when blocks are sorted by anchor) skips the per-element test.
  int buf = 0;
  uint32_t phase = 0;  // kTma: parity of full[buf]'s next phase, bit buf
  uint32_t da[4][4];  // dS^T(i-1): A operand of dK(i-1), in flight into item i
  while (item < nitems) {
    // The next item's query-tile record is loaded here and tested after this item's S^T and dP^T
    // are issued: the test right after the block barrier waited for that global load (ncu: 4.4% of
    // the pass's stall samples on one instruction).
    const int cand = item + 1;
    const int4 tq_cand = cand < nitems ? qtiles[qt_of(cand)] : make_int4(0, 0, 0, 0);
    if constexpr (kTma) {
      mbar_wait(sBar0 + 8 * buf, (phase >> buf) & 1);  // Q, dO of this item have landed
      phase ^= 1u << buf;
    } else {
      cp_async_wait<0>();
      fence_proxy_async();
      __syncthreads();
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
    if constexpr (kTma) cp_async_wait<0>();  // this item's row records, LSE, delta
    __syncthreads();  // every warp is past dK(i-1): item i-1's buffer may be refilled
    const int nxt = cand >= nitems ? nitems : valid_tq(tq_cand) ? cand : next_item(cand + 1);
    if (nxt < nitems) load_item(nxt, buf ^ 1);
    cp_async_commit();

    // P^T (0 where masked) as bf16 A fragments (bwd_item.cuh)
    bwd_mask_st(st, sRows, n0 + warp * 16, lane, t4, keyA, keyB);
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
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wgmma_rs_nd_tb<D>(dk, da[kk], desc_mn<kTileQ>(sQ, kk));
    wg_commit();
    wg_wait<1>();  // dV(i) done (pa free); dK(i) runs on under the next item's S^T, dP^T
    reg_fence(dv);
    reg_fence_a(pa);
    item = nxt;
    buf ^= 1;
  }
  wg_wait<0>();
  reg_fence(dk);
  reg_fence_a(da);
  cp_async_wait<0>();

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

std::atomic<int64_t> g_dkv_tma_launches{0};

template <int D>
void run(const AttnParams& p, bool tma, cudaStream_t s) {
  constexpr int smem = DkvWgSmem<D>::kBytes;
  QdoMaps maps{};
  tma = tma && qdo_maps(p, &maps);
  auto kern = tma ? attn_bwd_dkv_wgmma_kernel<D, true> : attn_bwd_dkv_wgmma_kernel<D, false>;
  cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kern<<<dim3(p.meta.nkt, p.Hkv, p.B), kWgThreads, smem, s>>>(p, maps);
  DFLASH_CHECK_LAUNCH(tma ? "attention backward dkv (wgmma, TMA loads)" : "attention backward dkv (wgmma)");
  if (tma) g_dkv_tma_launches.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace

namespace {
__global__ void wgmma_probe_kernel(int* out) {
#ifdef DFLASH_WGMMA
  *out = 1;
#else
  *out = 0;
#endif
}
}  // namespace

// True when the current device is sm_90 and this binary carries the sm_90a (wgmma) code for it.
// Probed once per process (one tiny launch and a 4-byte copy).
bool wgmma_supported() {
  static const bool ok = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major != 9 || minor != 0) return false;
    int* d = nullptr;
    int h = 0;
    if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return false;
    wgmma_probe_kernel<<<1, 1>>>(d);
    const bool good = cudaGetLastError() == cudaSuccess &&
                      cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
    cudaFree(d);
    return good && h == 1;
  }();
  return ok;
}

void launch_dkv_wgmma(const AttnParams& p, bool tma, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  if (p.d == 128) run<128>(p, tma, s);
  else run<64>(p, tma, s);
}

int64_t dkv_tma_launch_count() { return g_dkv_tma_launches.load(std::memory_order_relaxed); }

}  // namespace dflash::attention
