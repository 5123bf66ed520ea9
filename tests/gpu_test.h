// What the GPU tests share: whether this process sees a CUDA device (a build without CUDA sees
// none). A GPU test skips cleanly without one: `if (!dflash::test::have_cuda()) GTEST_SKIP() << ...`.
#pragma once

#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::test {

inline bool have_cuda() {
#ifdef DFLASH_CUDA
  return c10::cuda::device_count() > 0;
#else
  return false;
#endif
}

}  // namespace dflash::test
