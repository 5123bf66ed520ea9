// splitmix64 (Steele, Lea and Flood 2014; the reference constants): the one mixer behind every
// seeded stream of the project (dataset order, anchor draws, sampling in eval and regenerate), so
// that each is a pure function of its seed on every platform and the Python references can
// reproduce it.
//
// Owns nothing; constexpr, stateless. Thread-safety: any.
#pragma once

#include <cstdint>

namespace dflash {

// One step: x + the golden gamma, mixed. A stream s0, s0 + g, s0 + 2g, ... of states gives the
// sequence splitmix64(s0), splitmix64(s0 + g), ...
constexpr uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t splitmix64(uint64_t x) {
  x += kSplitmixGamma;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace dflash
