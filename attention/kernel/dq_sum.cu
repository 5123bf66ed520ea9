// The fused backward's dQ sum around its pass (bwd_fused_sm90.cu): the K/V maxima that bound its fixed-point scale
// (launched before bwd.cu's delta kernel, which writes the row scales) and the conversion of the sum to bf16 dQ.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "attention/kernel.h"
#include "core/launch_check.h"
#include "attention/kernel/common.cuh"

namespace dflash::attention {

namespace {

using bf16 = __nv_bfloat16;
using namespace dev;

// max |K| over every element and max ||V_k|| over every key row (the fixed point's bound, bwd_fused_sm90.cu), as
// float bits by atomicMax into p.kv_max[0], [1] (zeroed before; non-negative floats order as their bits). Grid-stride
// over (B Hkv kv_len) rows x D / 8 lanes; one atomic per block and value.
template <int D>
__global__ void kv_max_kernel(const AttnParams p) {
  constexpr int L = D / 8;
  const int64_t rows = (int64_t)p.B * p.Hkv * p.kv_len;
  float mk = 0.f, mv = 0.f;
  // block-uniform steps, so that the row's lanes shuffle together also in the last, partial step
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x; base < rows * L; base += (int64_t)gridDim.x * blockDim.x) {
    const int64_t gid = base + threadIdx.x, row = gid / L;
    const int c = (int)(gid % L);
    float n2 = 0.f;
    if (row < rows) {
      const int r = (int)(row % p.kv_len);
      const int64_t bh = row / p.kv_len;
      const int h = (int)(bh % p.Hkv), b = (int)(bh / p.Hkv);
      const uint4 kv = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.k) + b * p.k_sb + h * p.k_sh +
                                                       (int64_t)r * p.k_sr + c * 8);
      const uint4 vv = *reinterpret_cast<const uint4*>(static_cast<const bf16*>(p.v) + b * p.v_sb + h * p.v_sh +
                                                       (int64_t)r * p.v_sr + c * 8);
      const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&kv);
      const __nv_bfloat162* v2 = reinterpret_cast<const __nv_bfloat162*>(&vv);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 a = __bfloat1622float2(k2[i]), w = __bfloat1622float2(v2[i]);
        mk = fmaxf(mk, fmaxf(fabsf(a.x), fabsf(a.y)));
        n2 += w.x * w.x + w.y * w.y;
      }
    }
#pragma unroll
    for (int off = L / 2; off > 0; off >>= 1) n2 += __shfl_xor_sync(0xffffffffu, n2, off);
    mv = fmaxf(mv, sqrtf(n2));
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    mk = fmaxf(mk, __shfl_xor_sync(0xffffffffu, mk, off));
    mv = fmaxf(mv, __shfl_xor_sync(0xffffffffu, mv, off));
  }
  __shared__ float sk[32], sv[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { sk[warp] = mk; sv[warp] = mv; }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w) { mk = fmaxf(mk, sk[w]); mv = fmaxf(mv, sv[w]); }
    atomicMax(reinterpret_cast<unsigned*>(p.kv_max), __float_as_uint(mk));
    atomicMax(reinterpret_cast<unsigned*>(p.kv_max) + 1, __float_as_uint(mv));
  }
}

// dq = scale * the fused pass's sum, read back from its fragment order (bwd_fused_sm90.cu): one thread per 8
// columns of a row, four float2 of one fragment column group. Fixed point (p.dq_row_scale): the int32 sum over the
// row's power-of-two scale.
__global__ void dq_from_accum_kernel(const AttnParams p) {
  constexpr int D = 128, L = D / 8;
  const int64_t gid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t row = gid / L;  // over B * Hq * q_len
  if (row >= (int64_t)p.B * p.Hq * p.q_len) return;
  const int c8 = (int)(gid % L);  // columns 8 c8 .. +7: warpgroup c8 / 8, fragment j = c8 % 8
  const int r = (int)(row % p.q_len);
  const int64_t bh = row / p.q_len;
  const int b = (int)(bh / p.Hq), h = (int)(bh % p.Hq);
  const int qt = r / kTileQ, rr = r % kTileQ;
  const int t0 = (rr / 16) * 32 + (rr % 8) * 4;  // thread of t4 = 0 in its warpgroup
  const int64_t at = (bh * p.meta.nqt + qt) * (kTileQ * D) + (c8 * 128 + t0) * 4 + ((rr % 16) / 8) * 2;
  float v[8];
  if (p.dq_row_scale != nullptr) {
    const float inv = 1.f / p.dq_row_scale[row];  // a power of two: exact
    const int* f = reinterpret_cast<const int*>(p.dq_accum) + at;
#pragma unroll
    for (int t4 = 0; t4 < 4; ++t4) {
      const int2 x = *reinterpret_cast<const int2*>(f + t4 * 4);
      v[2 * t4] = (float)x.x * inv;
      v[2 * t4 + 1] = (float)x.y * inv;
    }
  } else {
    const float* f = p.dq_accum + at;
#pragma unroll
    for (int t4 = 0; t4 < 4; ++t4) {
      const float2 x = *reinterpret_cast<const float2*>(f + t4 * 4);
      v[2 * t4] = x.x;
      v[2 * t4 + 1] = x.y;
    }
  }
  const float sc = p.scale;
  uint4 out;
  out.x = pack_bf16(v[0] * sc, v[1] * sc);
  out.y = pack_bf16(v[2] * sc, v[3] * sc);
  out.z = pack_bf16(v[4] * sc, v[5] * sc);
  out.w = pack_bf16(v[6] * sc, v[7] * sc);
  *reinterpret_cast<uint4*>(static_cast<bf16*>(p.dq) + b * p.dq_sb + h * p.dq_sh + (int64_t)r * p.dq_sr + c8 * 8) = out;
}


}  // namespace

// d = 128 only (the fused pass's head dim; bwd.cu checks before it sets p.dq_row_scale).
void launch_kv_max(const AttnParams& p, void* stream) {
  const int64_t threads = (int64_t)p.B * p.Hkv * p.kv_len * (128 / 8);
  kv_max_kernel<128><<<(unsigned)std::min<int64_t>((threads + 255) / 256, 1056), 256, 0,
                       static_cast<cudaStream_t>(stream)>>>(p);
  DFLASH_CHECK_LAUNCH("attention backward K/V maxima");
}

void launch_dq_from_accum(const AttnParams& p, void* stream) {
  const int64_t threads = (int64_t)p.B * p.Hq * p.q_len * (128 / 8);
  dq_from_accum_kernel<<<(unsigned)((threads + 255) / 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(p);
  DFLASH_CHECK_LAUNCH("attention backward dq from the fused sum");
}

}  // namespace dflash::attention
