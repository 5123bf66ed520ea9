// Builds the kernel metadata (attention/kernel.h) from the per-block mask description, on the
// GPU, in three small launches: per-row key ranges, per-query-tile unions, per-key-tile query
// tile ranges. Cost is negligible next to one attention layer (O(rows + qtiles * ktiles)).
#include <cuda_runtime.h>

#include <climits>
#include <stdexcept>
#include <string>

#include "attention/kernel.h"
#include "core/launch_check.h"

namespace dflash::attention {
namespace {

__global__ void meta_rows_kernel(MetaParams p, KernelMeta m) {
  const int nrows = m.nqt * kTileQ;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)p.B * nrows) return;
  const int b = (int)(i / nrows), r = (int)(i % nrows);
  int4 out = make_int4(0, 0, 0, 0);
  const int j = r / p.block_size;
  if (j < p.N && p.keep[(int64_t)b * p.N + j]) {
    int lo = p.ctx_begin[(int64_t)b * p.N + j], hi = p.ctx_end[(int64_t)b * p.N + j];
    lo = max(0, min(lo, p.ctx_len));
    hi = max(lo, min(hi, p.ctx_len));
    out.x = lo;
    out.y = hi;
    out.z = p.ctx_len + j * p.block_size;
    out.w = out.z + p.block_size;
  }
  reinterpret_cast<int4*>(const_cast<int32_t*>(m.rows))[i] = out;
}

__global__ void meta_qtiles_kernel(MetaParams p, KernelMeta m) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)p.B * m.nqt) return;
  const int4* rows = reinterpret_cast<const int4*>(m.rows) + i * kTileQ;
  int clo = INT_MAX, chi = INT_MIN, blo = INT_MAX, bhi = INT_MIN;
  for (int r = 0; r < kTileQ; ++r) {
    const int4 v = rows[r];
    if (v.y > v.x) { clo = min(clo, v.x); chi = max(chi, v.y); }
    if (v.w > v.z) { blo = min(blo, v.z); bhi = max(bhi, v.w); }
  }
  if (chi < clo) clo = chi = 0;
  if (bhi < blo) blo = bhi = 0;
  reinterpret_cast<int4*>(const_cast<int32_t*>(m.qtiles))[i] = make_int4(clo, chi, blo, bhi);
}

__global__ void meta_ktiles_kernel(MetaParams p, KernelMeta m) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (int64_t)p.B * m.nkt) return;
  const int b = (int)(i / m.nkt), kt = (int)(i % m.nkt);
  const int n0 = kt * kTileK, n1 = n0 + kTileK;
  const int4* qt = reinterpret_cast<const int4*>(m.qtiles) + (int64_t)b * m.nqt;
  int first = INT_MAX, last = -1;
  for (int t = 0; t < m.nqt; ++t) {
    const int4 v = qt[t];
    const bool hit = (v.x < n1 && v.y > n0 && v.y > v.x) || (v.z < n1 && v.w > n0 && v.w > v.z);
    if (hit) { first = min(first, t); last = t; }
  }
  int2 out = last < 0 ? make_int2(0, 0) : make_int2(first, last + 1);
  reinterpret_cast<int2*>(const_cast<int32_t*>(m.ktiles))[i] = out;
}

// Largest j in [0, n_docs) with cu[j] <= r (cu strictly increasing, cu[0] = 0 <= r).
__device__ __forceinline__ int doc_of(const int32_t* cu, int n_docs, int r) {
  int lo = 0, hi = n_docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= r) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Causal rows: row r of document j sees [cu[j], r + 1); in the ctx slot when j is the document of
// its tile's first row, else in the blk slot (kernel.h, CausalMetaParams). Padding rows: empty.
__global__ void causal_rows_kernel(CausalMetaParams p, KernelMeta m) {
  const int r = (int)((int64_t)blockIdx.x * blockDim.x + threadIdx.x);
  if (r >= m.nqt * kTileQ) return;
  int4 out = make_int4(0, 0, 0, 0);
  if (r < p.T) {
    const int j = doc_of(p.cu, p.n_docs, r);
    const int j0 = doc_of(p.cu, p.n_docs, (r / kTileQ) * kTileQ);
    if (j == j0) out = make_int4(p.cu[j], r + 1, 0, 0);
    else out = make_int4(0, 0, p.cu[j], r + 1);
  }
  reinterpret_cast<int4*>(const_cast<int32_t*>(m.rows))[r] = out;
}

}  // namespace

KernelMeta meta_view(const int32_t* meta, int B, int q_len, int kv_len) {
  KernelMeta m;
  m.nqt = (q_len + kTileQ - 1) / kTileQ;
  m.nkt = (kv_len + kTileK - 1) / kTileK;
  m.rows = meta;
  m.qtiles = m.rows + (int64_t)B * m.nqt * kTileQ * 4;
  m.ktiles = m.qtiles + (int64_t)B * m.nqt * 4;
  return m;
}

void launch_build_meta(const MetaParams& p, void* stream) {
  const int q_len = p.N * p.block_size, kv_len = p.ctx_len + q_len;
  const KernelMeta m = meta_view(p.out, p.B, q_len, kv_len);
  auto s = static_cast<cudaStream_t>(stream);
  constexpr int T = 256;
  const int64_t nr = (int64_t)p.B * m.nqt * kTileQ, nq = (int64_t)p.B * m.nqt,
                nk = (int64_t)p.B * m.nkt;
  meta_rows_kernel<<<(unsigned)((nr + T - 1) / T), T, 0, s>>>(p, m);
  DFLASH_CHECK_LAUNCH("attention meta_rows");
  meta_qtiles_kernel<<<(unsigned)((nq + T - 1) / T), T, 0, s>>>(p, m);
  DFLASH_CHECK_LAUNCH("attention meta_qtiles");
  if (nk > 0) {
    meta_ktiles_kernel<<<(unsigned)((nk + T - 1) / T), T, 0, s>>>(p, m);
    DFLASH_CHECK_LAUNCH("attention meta_ktiles");
  }
}

void launch_build_causal_meta(const CausalMetaParams& p, void* stream) {
  const KernelMeta m = meta_view(p.out, 1, p.T, p.T);
  auto s = static_cast<cudaStream_t>(stream);
  constexpr int T = 256;
  const int64_t nr = (int64_t)m.nqt * kTileQ;
  causal_rows_kernel<<<(unsigned)((nr + T - 1) / T), T, 0, s>>>(p, m);
  DFLASH_CHECK_LAUNCH("attention causal meta_rows");
  MetaParams one;  // the tile unions below read only B
  one.B = 1;
  meta_qtiles_kernel<<<(unsigned)((m.nqt + T - 1) / T), T, 0, s>>>(one, m);
  DFLASH_CHECK_LAUNCH("attention causal meta_qtiles");
  meta_ktiles_kernel<<<(unsigned)((m.nkt + T - 1) / T), T, 0, s>>>(one, m);
  DFLASH_CHECK_LAUNCH("attention causal meta_ktiles");
}

}  // namespace dflash::attention
