// The fused gate/up GEMM + SwiGLU (swiglu_gemm.h), tile configuration 4: ping-pong, 128 x 128 x 64 tile, cluster 2 x 1.
#include "trainer/model/swiglu_gemm_impl.cuh"

namespace dflash::model::kernels::swiglu_detail {

template <>
void run_config<4>(const void* x, int64_t ldx, const void* w, void* act, int64_t T, int64_t H, int64_t I,
                   int max_swizzle, int raster, cudaStream_t stream) {
  using G = SwigluGemm<Shape<_128, _128, _64>, Shape<_2, _1, _1>, cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  static_assert(G::kBlock == kSwigluConfigBlocks[4]);
  G::run(x, ldx, w, act, T, H, I, max_swizzle, raster, stream);
}

}  // namespace dflash::model::kernels::swiglu_detail
