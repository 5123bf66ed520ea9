// Per-tile math shared by the query-stationary wgmma kernels (fwd_sm90.cu: one head per CTA;
// ws_sm90.cu: two heads per CTA on a TMA ring): the key tiles a query tile walks, the mask, the
// forward's online softmax step and the dQ pass's P and dS, and their outputs. All of it acts on
// wgmma m64nN accumulators as one thread holds them: rows A = 16 * warp + g and B = A + 8 of the
// warpgroup's 64 (g = lane / 4), columns 8j + 2 * t4 + e (t4 = lane % 4, e = 0, 1). Header-only.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "attention/kernel.h"
#include "attention/kernel/common.cuh"

namespace dflash::attention::dev {

// The key tiles of one 64-row query tile (its metadata record, kernel.h): the context range, then
// the own-block range, in steps of KR keys (64: every kernel but forward variant 13, which walks
// 128-key tiles; a tile reaching past its range is masked there).
template <int KR>
struct KeyWalkN {
  int4 tq;
  int n1, ntiles;
  __device__ __forceinline__ explicit KeyWalkN(int4 r) : tq(r) {
    n1 = tq.y > tq.x ? (tq.y - tq.x + KR - 1) / KR : 0;
    const int n2 = tq.w > tq.z ? (tq.w - tq.z + KR - 1) / KR : 0;
    ntiles = n1 + n2;
  }
  __device__ __forceinline__ int start(int t) const { return t < n1 ? tq.x + t * KR : tq.z + (t - n1) * KR; }
  __device__ __forceinline__ bool ctx(int t) const { return t < n1; }
};
using KeyWalk = KeyWalkN<kTileK>;

// S of a tile of 8J keys (J = 8: 64) at n0 of the context (ctx) or block region, as a wgmma
// m64n(8J) accumulator (this thread: rows A and B = g and g + 8 of its warp, metadata rowA and rowB;
// keys n0 + 8j + 2*t4 + e): set to -inf where the key is not visible. A warp whose rows all see the
// whole tile (the common case with sorted blocks) skips the test.
template <int J>
__device__ __forceinline__ void mask_tile(float (&s)[J][4], int n0, bool ctx, const int4& rowA,
                                          const int4& rowB, int t4) {
  const bool full = ctx && n0 >= rowA.x && n0 + 8 * J <= rowA.y && n0 >= rowB.x &&
                    n0 + 8 * J <= rowB.y;
  if (__all_sync(0xffffffffu, full)) return;
  const int lo_a = ctx ? rowA.x : rowA.z, hi_a = ctx ? rowA.y : rowA.w;
  const int lo_b = ctx ? rowB.x : rowB.z, hi_b = ctx ? rowB.y : rowB.w;
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = n0 + j * 8 + 2 * t4 + e;
      s[j][e] = (key >= lo_a) & (key < hi_a) ? s[j][e] : -INFINITY;
      s[j][2 + e] = (key >= lo_b) & (key < hi_b) ? s[j][2 + e] : -INFINITY;
    }
  }
}

// The forward's online softmax (base 2) over one tile of 8J keys of S (masked; J = 8: 64 keys): the running maxima m
// and sums l of rows A and B updated, P = exp2(S * sl2 - m * sl2) as bf16 A fragments in pn, and the
// factors c by which O must be rescaled (exactly 1 where the maximum did not change: an FFMA of
// m*sl2 - u would leave a rounding residual there). Returns whether O can be left as is.
//
// slack (log2 units, AttnParams::rescale_slack): while no row of the warp sees a tile maximum more
// than `slack` above its running m, every row keeps its m, stale, and O is not rescaled; P then
// lies in (0, 2^slack], which bf16 P, the fp32 sums l and O hold without loss (their relative
// rounding does not depend on the scale), and m, l and O stay consistent, so O / l and the LSE
// (m * sl2 + log2 l) are the softmax's up to rounding. Once one row exceeds it, the warp takes the
// exact step: every row's m becomes its maximum. slack = 0 is the exact-maximum softmax (O rescaled
// whenever a maximum grows). With maxima that keep growing along the keys (causal attention under
// RoPE: the nearest keys score highest) the stale maxima save most tiles' rescale.
template <int J>
__device__ __forceinline__ bool softmax_step(float (&s)[J][4], float& mA, float& mB, float& lA, float& lB, float sl2,
                                             float slack, uint32_t (&pn)[J / 2][4], float& cA, float& cB) {
  float mxA = mA, mxB = mB;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    mxA = fmaxf(mxA, fmaxf(s[j][0], s[j][1]));
    mxB = fmaxf(mxB, fmaxf(s[j][2], s[j][3]));
  }
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
  mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
  mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
  mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
  // a row within the slack: its maximum did not grow, or grew by at most slack from a finite m
  // (mx >= m always; a first finite maximum after -inf is never within it)
  const bool inA = mxA == mA || (mA != -INFINITY && (mxA - mA) * sl2 <= slack);
  const bool inB = mxB == mB || (mB != -INFINITY && (mxB - mB) * sl2 <= slack);
  const bool keep = __all_sync(0xffffffffu, inA && inB);
  mxA = keep ? mA : mxA;  // selects, not a branch (a branch here can cost the wgmma overlap, NOTES.md)
  mxB = keep ? mB : mxB;
  const float uA = mxA == -INFINITY ? 0.f : mxA * sl2;
  const float uB = mxB == -INFINITY ? 0.f : mxB * sl2;
  cA = mxA == mA ? 1.f : ex2(mA * sl2 - uA);
  cB = mxB == mB ? 1.f : ex2(mB * sl2 - uB);
  mA = mxA;
  mB = mxB;
  lA *= cA;
  lB *= cB;
#pragma unroll
  for (int j = 0; j < J; ++j) {
    s[j][0] = ex2(s[j][0] * sl2 - uA);
    s[j][1] = ex2(s[j][1] * sl2 - uA);
    s[j][2] = ex2(s[j][2] * sl2 - uB);
    s[j][3] = ex2(s[j][3] * sl2 - uB);
    lA += s[j][0] + s[j][1];
    lB += s[j][2] + s[j][3];
  }
#pragma unroll
  for (int kk = 0; kk < J / 2; ++kk) acc_to_a(s[2 * kk], s[2 * kk + 1], pn[kk]);
  return keep;
}

// Rows A and B of an accumulator times cA and cB.
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N][4], float cA, float cB) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    o[i][0] *= cA;
    o[i][1] *= cA;
    o[i][2] *= cB;
    o[i][3] *= cB;
  }
}

// The forward's outputs for rows ra and ra + 8 of head h: O / l (bf16) and the natural-log LSE
// (-inf for a row that sees no key); l is summed over the row's four threads here.
template <int D>
__device__ __forceinline__ void store_fwd_rows(const AttnParams& p, int b, int h, int ra, int t4,
                                               const float (&o)[D / 8][4], float mA, float mB, float lA, float lB,
                                               float sl2) {
  lA += __shfl_xor_sync(0xffffffffu, lA, 1);
  lA += __shfl_xor_sync(0xffffffffu, lA, 2);
  lB += __shfl_xor_sync(0xffffffffu, lB, 1);
  lB += __shfl_xor_sync(0xffffffffu, lB, 2);
  const float iA = lA > 0.f ? 1.f / lA : 0.f, iB = lB > 0.f ? 1.f / lB : 0.f;
  const int rb = ra + 8;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.o) + b * p.o_sb + h * p.o_sh;
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

// The dQ pass's per-row inputs for rows ra and ra + 8 of head h: lse * log2e (+inf for a row that
// sees no key, so that P = 0 without NaN) and delta.
struct DqRows {
  float lA, lB, dA, dB;
};
__device__ __forceinline__ DqRows dq_rows(const AttnParams& p, int b, int h, int ra) {
  const int rb = ra + 8;
  const float* lse = p.lse + ((int64_t)b * p.Hq + h) * p.q_len;
  const float* delta = p.delta + ((int64_t)b * p.Hq + h) * p.q_len;
  const float lseA = ra < p.q_len ? lse[ra] : 0.f, lseB = rb < p.q_len ? lse[rb] : 0.f;
  DqRows r;
  r.lA = lseA == -INFINITY ? INFINITY : lseA * kLog2e;
  r.lB = lseB == -INFINITY ? INFINITY : lseB * kLog2e;
  r.dA = ra < p.q_len ? delta[ra] : 0.f;
  r.dB = rb < p.q_len ? delta[rb] : 0.f;
  return r;
}
// P = exp2(S * sl2 - lse * log2e) in place (S masked).
__device__ __forceinline__ void dq_p(float (&s)[8][4], float sl2, const DqRows& r) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[j][0] = ex2(fmaf(s[j][0], sl2, -r.lA));
    s[j][1] = ex2(fmaf(s[j][1], sl2, -r.lA));
    s[j][2] = ex2(fmaf(s[j][2], sl2, -r.lB));
    s[j][3] = ex2(fmaf(s[j][3], sl2, -r.lB));
  }
}
// dS = P * (dP - delta) as bf16 A fragments.
__device__ __forceinline__ void dq_ds(float (&s)[8][4], const float (&dp)[8][4], const DqRows& r, uint32_t (&da)[4][4]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    s[j][0] *= dp[j][0] - r.dA;
    s[j][1] *= dp[j][1] - r.dA;
    s[j][2] *= dp[j][2] - r.dB;
    s[j][3] *= dp[j][3] - r.dB;
  }
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) acc_to_a(s[2 * kk], s[2 * kk + 1], da[kk]);
}
// dQ * scale (bf16) for rows ra and ra + 8 of head h.
template <int D>
__device__ __forceinline__ void store_dq_rows(const AttnParams& p, int b, int h, int ra, int t4, const float (&dq)[D / 8][4]) {
  const int rb = ra + 8;
  __nv_bfloat16* dqo = static_cast<__nv_bfloat16*>(p.dq) + b * p.dq_sb + h * p.dq_sh;
  if (ra < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(dqo + (int64_t)ra * p.dq_sr + i * 8 + 2 * t4, dq[i][0] * p.scale, dq[i][1] * p.scale);
  }
  if (rb < p.q_len) {
#pragma unroll
    for (int i = 0; i < D / 8; ++i)
      store_bf16x2(dqo + (int64_t)rb * p.dq_sr + i * 8 + 2 * t4, dq[i][2] * p.scale, dq[i][3] * p.scale);
  }
}

}  // namespace dflash::attention::dev
