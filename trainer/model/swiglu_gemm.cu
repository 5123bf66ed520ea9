// The target MLP's gate/up GEMM with SwiGLU in its epilogue (swiglu_gemm.h): the dispatch over the
// tile configurations (each compiled in its own swiglu_gemm_c<N>.cu, from swiglu_gemm_impl.cuh).
#include "trainer/model/swiglu_gemm.h"

#include <stdexcept>
#include <string>

#if DFLASH_SWIGLU_GEMM
#include "trainer/model/swiglu_gemm_impl.cuh"
#endif

namespace dflash::model::kernels {

int64_t swiglu_block(int config) {
  if (config < 0 || config >= kSwigluConfigs)
    throw std::runtime_error("swiglu_gemm: no tile configuration " + std::to_string(config));
  return kSwigluConfigBlocks[config];
}

#if DFLASH_SWIGLU_GEMM

bool swiglu_gemm_available() {
  int device = 0, major = 0, minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  return major == 9 && minor == 0;
}

void swiglu_gemm(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H, int64_t I,
                 int config, int max_swizzle, int raster, cudaStream_t stream) {
  using namespace swiglu_detail;
  if (T == 0) return;
  if (I % swiglu_block(config) != 0)
    throw std::runtime_error("swiglu_gemm: intermediate size " + std::to_string(I) + " is not a multiple of " +
                             std::to_string(swiglu_block(config)));
  switch (config) {
    case 0: return run_config<0>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
    case 1: return run_config<1>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
    case 2: return run_config<2>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
    case 3: return run_config<3>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
    case 4: return run_config<4>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
    case 5: return run_config<5>(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
  }
}

#else  // built without CUTLASS

bool swiglu_gemm_available() { return false; }

void swiglu_gemm(const void*, int64_t, const void*, void*, int64_t, int64_t, int64_t, int, int, int, cudaStream_t) {
  throw std::runtime_error("swiglu_gemm: this build has no CUTLASS (see docs/environment.md)");
}

#endif

}  // namespace dflash::model::kernels
