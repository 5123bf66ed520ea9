// core/random.h: splitmix64 against the reference sequence of Vigna's splitmix64.c seeded with 0
// (the values every seeded stream of ours and the Python references build on).
#include <gtest/gtest.h>

#include "core/random.h"

TEST(Random, Splitmix64ReferenceSequence) {
  uint64_t s = 0;
  const uint64_t want[] = {0xE220A8397B1DCDAFull, 0x6E789E6AA1B965F4ull, 0x06C45D188009454Full};
  for (uint64_t w : want) {
    EXPECT_EQ(dflash::splitmix64(s), w);
    s += dflash::kSplitmixGamma;
  }
}
