// trainer/metrics/profile.h: the profile summary's arithmetic on hand-built operator lists (self time
// of nested host operators per thread, device activities summed, kinds and top names) and one
// real profiled run on the CPU.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "trainer/metrics/profile.h"

using dflash::metrics::op_kind;
using dflash::metrics::ProfiledOp;
using dflash::metrics::summarize;

namespace {
constexpr uint64_t ms = 1000000;
ProfiledOp host(const char* name, uint64_t a, uint64_t b, uint64_t thread = 1) {
  return {name, false, a * ms, b * ms, thread};
}
double kind_ms(const dflash::metrics::ProfileSummary& s, const std::string& kind) {
  for (const auto& k : s.kinds)
    if (k.name == kind) return k.ms;
  return -1;
}
}  // namespace

TEST(ProfileStep, HostSelfTimeSubtractsDirectChildrenPerThread) {
  // thread 1: linear [0, 10) holds mm [2, 5) and add [6, 9), which holds fill [7, 8);
  // thread 2: mm [1, 4) overlapping thread 1 in time but not nested in it.
  std::vector<ProfiledOp> ops = {host("aten::add", 6, 9), host("aten::linear", 0, 10), host("aten::mm", 2, 5),
                                 host("aten::fill_", 7, 8), host("aten::mm", 1, 4, 2)};
  auto s = summarize(ops, 10);
  EXPECT_FALSE(s.device);
  EXPECT_NEAR(s.busy_ms, 10 + 3, 1e-9);                // the top-level durations of both threads
  EXPECT_NEAR(kind_ms(s, "matmul"), 3 + 3, 1e-9);      // both mm
  EXPECT_NEAR(kind_ms(s, "elementwise"), 4 + 2, 1e-9);  // linear's self 10-3-3, add's 3-1
  EXPECT_NEAR(kind_ms(s, "data movement"), 1, 1e-9);
  ASSERT_FALSE(s.top.empty());
  EXPECT_EQ(s.top[0].name, "aten::mm");
  EXPECT_EQ(s.top[0].count, 2);
}

TEST(ProfileStep, DeviceActivitiesAloneAreSummedWhenPresent) {
  std::vector<ProfiledOp> ops = {host("aten::mm", 0, 50),
                                 {"sm90_xmma_gemm_bf16bf16_bf16f32", true, 1 * ms, 9 * ms, 0},
                                 {"void attn_fwd_kernel<128>", true, 9 * ms, 12 * ms, 0},
                                 {"void at::native::vectorized_elementwise_kernel<4, add>", true, 12 * ms, 13 * ms, 0},
                                 {"void at::native::(anonymous namespace)::fused_adamw_kernel", true, 13 * ms, 15 * ms, 0}};
  auto s = summarize(ops, 2);
  EXPECT_TRUE(s.device);
  EXPECT_NEAR(s.busy_ms, 8 + 3 + 1 + 2, 1e-9);  // the host mm is not counted beside its kernels
  EXPECT_NEAR(kind_ms(s, "matmul"), 8, 1e-9);
  EXPECT_NEAR(kind_ms(s, "attention"), 3, 1e-9);
  EXPECT_NEAR(kind_ms(s, "optimizer"), 2, 1e-9);
  EXPECT_NEAR(kind_ms(s, "elementwise"), 1, 1e-9);
  EXPECT_EQ(s.top.size(), 2u);
  EXPECT_EQ(s.kinds.front().name, "matmul");  // largest first
}

TEST(ProfileStep, KindsOfTypicalNames) {
  EXPECT_EQ(op_kind("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT"), "matmul");
  EXPECT_EQ(op_kind("void attn_bwd_dkv_kernel<...>"), "attention");
  EXPECT_EQ(op_kind("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8>"), "loss");
  EXPECT_EQ(op_kind("void at::native::multi_tensor_apply_kernel<LpNormFunctor>"), "optimizer");
  EXPECT_EQ(op_kind("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>"), "data movement");
  EXPECT_EQ(op_kind("void at::native::reduce_kernel<512, 1, ReduceOp<MeanOps>>"), "reduce");
  EXPECT_EQ(op_kind("aten::view"), "views (host)");
  EXPECT_EQ(op_kind("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"), "communication");
  EXPECT_EQ(op_kind("MulBackward0"), "other");
  // the project's namespace holds "flash": its kernels are classified by what they do
  EXPECT_EQ(op_kind("void dflash::model::kernels::(anonymous namespace)::silu_mul_kernel<__nv_bfloat16, 8>"),
            "elementwise");
  EXPECT_EQ(op_kind("void dflash::model::kernels::(anonymous namespace)::qk_norm_rope_kernel<__nv_bfloat16>"), "norm");
  EXPECT_EQ(op_kind("void dflash::attention::(anonymous namespace)::attn_fwd_wgmma_kernel<128>"), "attention");
  EXPECT_EQ(op_kind("void dflash::model::kernels::(anonymous namespace)::ce_grad_kernel<__nv_bfloat16>(float const*)"),
            "loss");
  EXPECT_EQ(op_kind("void dflash::model::kernels::(anonymous namespace)::head_norm_rope_bwd_kernel<__nv_bfloat16>"),
            "norm");
  EXPECT_EQ(op_kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>"), "attention");
}

TEST(ProfileStep, ProfilesARealRunOnTheCpu) {
  auto a = at::randn({64, 64}), b = at::randn({64, 64});
  auto ops = dflash::metrics::profile_ops([&] { (at::mm(a, b) + 1).sum(); }, /*cuda=*/false);
  auto s = summarize(ops, 5);
  EXPECT_GT(kind_ms(s, "matmul"), 0);
  EXPECT_GT(s.busy_ms, 0);
  const std::string text = dflash::metrics::format_profile(s, 2 * s.busy_ms, "t");
  EXPECT_NE(text.find("| matmul |"), std::string::npos) << text;
  EXPECT_NE(text.find("(50% of the wall time)"), std::string::npos) << text;
}
