// i / G for the backward passes' item walk (bwd_sm90.cu, bwd_fused_sm90.cu: item i is query tile i / G, head i % G)
// as (i * ceil(2^32 / G)) >> 32, with no integer division (~25 dependent instructions, three per item) in the loop.
// With m = ceil(2^32 / G) = (2^32 + e) / G, 0 <= e < G: i m / 2^32 = i / G + i e / (G 2^32), and the second term
// stays below 1 / G, so the floor is exact, while i e < 2^32: for every i < 2^32 / G. launch_attn_bwd_stage (bwd.cu)
// checks query tiles x G^2 < 2^32. Host and device (tests/attention: ItemDiv.MatchesDivision). kernel/NOTES.md v15.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DFLASH_HD __host__ __device__ __forceinline__
#else
#define DFLASH_HD inline
#endif

namespace dflash::attention::dev {

struct ItemDiv {
  int G;
  uint64_t magic;
  DFLASH_HD explicit ItemDiv(int g) : G(g), magic((0x100000000ull + static_cast<uint64_t>(g) - 1) / g) {}
  DFLASH_HD int operator()(int i) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(i)) * magic) >> 32);
  }
  struct QuotRem {
    int q, r;
  };
  DFLASH_HD QuotRem divmod(int i) const {  // {i / G, i % G}: item i's query tile offset and head in the group
    const int q = (*this)(i);
    return {q, i - q * G};
  }
};

}  // namespace dflash::attention::dev

#undef DFLASH_HD
