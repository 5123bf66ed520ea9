// Device helpers shared by the DFlash attention kernels: cp.async tile loads into a swizzled
// shared-memory layout, ldmatrix fragment loads and the bf16 m16n8k16 tensor-core MMA (sm_80+).
//
// Fragment conventions (PTX ISA, mma.m16n8k16 .bf16): g = lane / 4, t = lane % 4.
//   A 16x16 (4 regs): a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//   B 16x8  (2 regs): b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//   C 16x8  (4 f32) : c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..2t+1)
// Shared tiles are [rows][D] bf16 with 16-byte chunk c of row r stored at chunk c ^ (r & 7), so
// that the 8 row addresses of one ldmatrix phase hit 8 different bank groups.
// Header-only, no state.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

namespace dflash::attention::dev {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Byte offset of the 16-byte chunk (row, chunk) in a swizzled [rows][D] bf16 tile.
template <int D>
__device__ __forceinline__ uint32_t swz(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;  // 0: zero-fill the destination
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// A backward item's per-row data into the tail of its stage at sRows: R row records (int4, rows + m0 ..), then the
// LSE and delta of rows m0 .. m0 + R (lse / delta + lo + m0 ..; rows >= q_len zero-filled). Threads 0 .. R-1 load
// the records and LSE, threads R .. 2R-1 the deltas, of the NT >= 2R threads of the block.
template <int R, int NT>
__device__ __forceinline__ void load_row_stats(uint32_t sRows, const int4* rows, const float* lse, const float* delta,
                                               int64_t lo, int m0, int q_len, int tid) {
  const uint32_t sL = sRows + R * 16, sD = sL + R * 4;
  if (tid < R) {
    cp_async16(sRows + tid * 16, rows + m0 + tid, true);
    const bool ok = m0 + tid < q_len;
    cp_async4(sL + tid * 4, lse + (ok ? lo + m0 + tid : 0), ok);
  } else if (NT == 2 * R || tid < 2 * R) {
    const int r = tid - R;
    const bool ok = m0 + r < q_len;
    cp_async4(sD + r * 4, delta + (ok ? lo + m0 + r : 0), ok);
  }
}

// Loads rows [row0, row0 + R) of a [*, D] bf16 matrix with row stride `ld` (elements) into a
// swizzled tile; rows >= nrows are zero-filled. All NT threads of the block take part.
template <int R, int D, int NT>
__device__ __forceinline__ void load_tile(uint32_t sdst, const __nv_bfloat16* gsrc, int64_t ld,
                                          int row0, int nrows, int tid) {
  constexpr int CH = D / 8;
  static_assert((R * CH) % NT == 0, "tile chunks must divide among threads");
#pragma unroll
  for (int i = 0; i < R * CH / NT; ++i) {
    const int idx = i * NT + tid;
    const int r = idx / CH, c = idx % CH;
    const bool valid = row0 + r < nrows;
    const __nv_bfloat16* src = gsrc + (valid ? (int64_t)(row0 + r) * ld + c * 8 : 0);
    cp_async16(sdst + swz<D>(r, c), src, valid);
  }
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                        uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                          uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}

// A fragment (16 rows x 16 k) at (r0, k0) of a row-major tile (k contiguous).
template <int D>
__device__ __forceinline__ void load_a(uint32_t tile, int r0, int k0, int lane, uint32_t (&a)[4]) {
  const int r = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int c = (k0 >> 3) + (lane >> 4);
  ldsm_x4(tile + swz<D>(r, c), a[0], a[1], a[2], a[3]);
}
// B fragments of two n-tiles (n0, n0+8) x 16 k from a tile stored [n][k] (k contiguous):
// b[0..1] for n-tile n0, b[2..3] for n0+8.
template <int D>
__device__ __forceinline__ void load_b_nk(uint32_t tile, int n0, int k0, int lane, uint32_t (&b)[4]) {
  const int r = n0 + (lane & 7) + (lane >> 4) * 8;
  const int c = (k0 >> 3) + ((lane >> 3) & 1);
  ldsm_x4(tile + swz<D>(r, c), b[0], b[1], b[2], b[3]);
}
// B fragments of two n-tiles (n0, n0+8) x 16 k from a tile stored [k][n] (n contiguous).
template <int D>
__device__ __forceinline__ void load_b_kn(uint32_t tile, int k0, int n0, int lane, uint32_t (&b)[4]) {
  const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int c = (n0 >> 3) + (lane >> 4);
  ldsm_x4_t(tile + swz<D>(r, c), b[0], b[1], b[2], b[3]);
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A fragment for k-step i from accumulators of n-tiles 2i and 2i+1 (FA2's register reuse).
__device__ __forceinline__ void acc_to_a(const float (&c0)[4], const float (&c1)[4], uint32_t (&a)[4]) {
  a[0] = pack_bf16(c0[0], c0[1]);
  a[1] = pack_bf16(c0[2], c0[3]);
  a[2] = pack_bf16(c1[0], c1[1]);
  a[3] = pack_bf16(c1[2], c1[3]);
}

__device__ __forceinline__ void store_bf16x2(void* p, float lo, float hi) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(lo, hi);
}

// Visibility of key `key` for a query row whose metadata is (ctx_lo, ctx_hi, blk_lo, blk_hi).
__device__ __forceinline__ bool visible(const int4& m, int key) {
  return (key >= m.x && key < m.y) || (key >= m.z && key < m.w);
}

// 2^x (MUFU.EX2, ~2 ulp; -inf -> +0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

}  // namespace dflash::attention::dev
