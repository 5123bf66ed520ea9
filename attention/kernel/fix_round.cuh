// The fused backward's fixed-point rounding without F2I (bwd_fused_sm90.cu; dq_sum.cu's test hook).
#pragma once

namespace dflash::attention::dev {

// round(x s) as an int32 for |x s| < 2^30 (s a power of two: x s exact), with four float instructions and one LEA
// instead of F2I, whose unit converts 16 values per clock per SM (a quarter of the integer unit's rate). The high part
// hi = x s + M1 lands in [2^32, 2^33), whose spacing is 512: hi - M1 = 512 round(x s / 512) exactly; the rest
// r = x s - (hi - M1), |r| <= 256, is exact and lo = r + M0 in [2^23, 2^24) rounds it to an integer (nearest, ties to
// even, as F2I: t + rni(r) = rni(t + r) for an integer t). The bits: bits(hi) = const + (hi - M1) / 512 and
// bits(lo) = const + rni(r) - 512, so (bits(hi) << 9) + bits(lo) = round(x s) + C (mod 2^32); M1 and M0 are chosen so
// that C = 0: M0 = 2^23 + 512 (bits 0x4B000200) and M1 = 2^32 + 512 m1 with 512 m1 = -0x4B000200 mod 2^32 =
// 0xB4FFFE00. The same integer as __float2int_rn(x * s), bit for bit (tests: KernelFusedBackward.*).
__device__ __forceinline__ int fix_round_fadd(float x, float s) {
  constexpr float kM1 = 7331642880.0f;  // 2^32 + 0xB4FFFE00, exactly representable (a multiple of 512)
  constexpr float kM0 = 8389120.0f;     // 2^23 + 512
  const float hi = __fmaf_rn(x, s, kM1);
  const float t = __fsub_rn(hi, kM1);
  const float lo = __fadd_rn(__fmaf_rn(x, s, -t), kM0);
  return static_cast<int>((static_cast<unsigned>(__float_as_int(hi)) << 9) + static_cast<unsigned>(__float_as_int(lo)));
}

}  // namespace dflash::attention::dev
