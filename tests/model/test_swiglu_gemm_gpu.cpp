// The target MLP's fused gate/up GEMM + SwiGLU (trainer/model/swiglu_gemm.h, target_ops.h
// gate_up_silu) against a float64 reference of silu(x W_gate^T) * (x W_up^T) computed on the CPU
// from the same bf16 inputs, beside the unfused path (cuBLAS, then the silu_mul kernel) on the
// same GPU:
//  - shapes with a partial last row tile (T = 1, 77, 1000), several column tiles (I = 384: three
//    128-wide blocks; I = 320: five 64-wide blocks, for the configurations of block 64 only), the Qwen3-8B width (H = 4096, I = 12288) at 512 tokens, and T = 0;
//  - every tile configuration (swiglu_gemm.h) and the scheduler's raster orders;
//  - rows of x with a stride (a view into a wider tensor), as the model may pass.
// Tolerance: the fused error against float64 at most 1.25x the unfused path's plus 1e-6 of the
// output's scale. Both round g and u to bf16 before SiLU and the result to bf16, and differ only
// in the order of the GEMM's float32 sums, so their errors are of one size; a gate value paired
// with the wrong up value, a wrong row or column, or a missing tile is an O(1) error.
// The layout helpers (block_gate_up / unblock_gate_up) are checked on the CPU, in CI.
// The GPU tests skip without a CUDA device or without the kernel (a build without CUTLASS).
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Context.h>

#include "trainer/model/target_ops.h"
#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "trainer/model/swiglu_gemm.h"
#endif

namespace ops = dflash::model::ops;

namespace {

TEST(SwigluLayout, BlockedRowsAndRoundTrip) {
  const int64_t I = 6, H = 3, B = 2;
  at::Tensor w = at::arange(2 * I * H, at::kFloat).reshape({2 * I, H});
  at::Tensor b = ops::block_gate_up(w, I, B);
  ASSERT_EQ(b.sizes(), w.sizes());
  // rows [2kB, 2kB + B): gate rows kB..; rows [2kB + B, 2(k + 1)B): up rows I + kB..
  for (int64_t k = 0; k < I / B; ++k)
    for (int64_t r = 0; r < B; ++r) {
      EXPECT_TRUE(at::equal(b[2 * k * B + r], w[k * B + r])) << "block " << k << " gate row " << r;
      EXPECT_TRUE(at::equal(b[2 * k * B + B + r], w[I + k * B + r])) << "block " << k << " up row " << r;
    }
  EXPECT_TRUE(at::equal(ops::unblock_gate_up(b, I, B), w));
  EXPECT_TRUE(at::equal(ops::unblock_gate_up(w, I, 0), w));
}

TEST(SwigluLayout, KnobOffOrCpuMeansUnblocked) {
  // On the CPU, and for float32 anywhere, the weight stays as loaded.
  EXPECT_EQ(ops::gate_up_block_for(at::kBFloat16, at::Device(at::kCPU), 4096, 12288), 0);
  EXPECT_EQ(ops::gate_up_block_for(at::kFloat, at::Device(at::kCPU), 4096, 12288), 0);
}

#ifdef DFLASH_CUDA

bool kernel_here() { return at::hasCUDA() && dflash::model::kernels::swiglu_gemm_available(); }

// float64 on the CPU: silu(bf16(g)) * bf16(u) with g, u from the bf16 inputs' exact products.
at::Tensor reference(const at::Tensor& x, const at::Tensor& w, int64_t I) {
  at::Tensor xd = x.to(at::kCPU, at::kDouble), wd = w.to(at::kCPU, at::kDouble);
  at::Tensor gu = at::mm(xd, wd.t()).to(at::kBFloat16).to(at::kDouble);
  at::Tensor g = gu.narrow(1, 0, I), u = gu.narrow(1, I, I);
  return g / (1 + at::exp(-g)) * u;
}

double max_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kCPU, at::kDouble) - ref).abs().max().item<double>();
}

struct Case {
  int64_t T, H, I;
};

void check(const Case& c, int config, int raster, bool strided_x) {
  namespace k = dflash::model::kernels;
  at::manual_seed(1000 + c.T + c.H + c.I);
  auto opt = at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA);
  // weights ~ N(0, 1/H) and x ~ N(0, 1): g, u of order 1, across SiLU's curved range
  at::Tensor w = (at::randn({2 * c.I, c.H}, opt.dtype(at::kFloat)) / std::sqrt(double(c.H))).to(at::kBFloat16);
  at::Tensor x = strided_x ? at::randn({c.T, c.H + 64}, opt).narrow(1, 32, c.H) : at::randn({c.T, c.H}, opt);
  at::Tensor wb = ops::block_gate_up(w, c.I, k::swiglu_block(config));
  at::Tensor out = at::full({c.T, c.I}, 7.0, opt);  // a stale value a missed tile would leave
  k::swiglu_gemm(x.data_ptr(), x.stride(0), wb.data_ptr(), out.data_ptr(), c.T, c.H, c.I, config, 1, raster,
                 at::cuda::getCurrentCUDAStream());
  at::Tensor unfused = ops::silu_mul(at::mm(x, w.t()), c.I);
  if (c.T == 0) return;
  at::Tensor ref = reference(x, w, c.I);
  const double scale = ref.abs().max().item<double>();
  const double e_fused = max_err(out, ref), e_unfused = max_err(unfused, ref);
  SCOPED_TRACE(::testing::Message() << "T " << c.T << " H " << c.H << " I " << c.I << " config " << config
                                    << " raster " << raster << (strided_x ? " strided x" : ""));
  EXPECT_LE(e_fused, 1.25 * e_unfused + 1e-6 * scale) << "fused " << e_fused << " unfused " << e_unfused
                                                       << " scale " << scale;
  // and through the model's entry point (the default configuration)
  at::Tensor via_ops = ops::gate_up_silu(x, ops::block_gate_up(w, c.I, k::kSwigluBlock), c.I, k::kSwigluBlock);
  EXPECT_LE(max_err(via_ops, ref), 1.25 * e_unfused + 1e-6 * scale);
}

TEST(SwigluGemmGpu, MatchesFloat64AsTheUnfusedPath) {
  if (!kernel_here()) GTEST_SKIP() << "no CUDA device, or a build without the fused kernel (CUTLASS, sm_90a)";
  const Case cases[] = {{1, 128, 128}, {77, 512, 256}, {1000, 256, 384}, {1000, 256, 320}, {512, 4096, 12288}, {0, 256, 128}};
  for (const Case& c : cases)
    for (int config = 0; config < dflash::model::kernels::kSwigluConfigs; ++config)
      if (c.I % dflash::model::kernels::swiglu_block(config) == 0) check(c, config, 0, false);
}

TEST(SwigluGemmGpu, RasterOrdersAndStridedRows) {
  if (!kernel_here()) GTEST_SKIP() << "no CUDA device, or a build without the fused kernel (CUTLASS, sm_90a)";
  for (int raster : {1, 2})
    for (int config = 0; config < dflash::model::kernels::kSwigluConfigs; ++config)
      check({1000, 256, 384}, config, raster, false);
  check({300, 512, 256}, 0, 0, true);
}

TEST(SwigluGemmGpu, ModelStoresBlockedWeightsOnHopper) {
  if (!kernel_here()) GTEST_SKIP() << "no CUDA device, or a build without the fused kernel (CUTLASS, sm_90a)";
  EXPECT_EQ(ops::gate_up_block_for(at::kBFloat16, at::Device(at::kCUDA), 4096, 12288),
            dflash::model::kernels::kSwigluBlock);
  // shapes the kernel does not take fall back to cuBLAS + silu_mul
  EXPECT_EQ(ops::gate_up_block_for(at::kBFloat16, at::Device(at::kCUDA), 4096, 12288 + 64), 0);
  EXPECT_EQ(ops::gate_up_block_for(at::kHalf, at::Device(at::kCUDA), 4096, 12288), 0);
}

#endif  // DFLASH_CUDA

}  // namespace
