// AdamW/schedule units that need no Python: the schedule's defining values, state round trip,
// errors on a state that does not fit.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "core/error.h"
#include "trainer/optim/adamw.h"

using namespace dflash::optim;

TEST(LrSchedule, WarmupThenCosine) {
  // total 100, ratio 0.04 -> W = 4: 1/4, 2/4, 3/4, 4/4 of lr, then cosine from lr.
  auto s = LrSchedule::cosine(6e-4, 0.04, 100);
  EXPECT_EQ(s.warmup, 4);
  EXPECT_DOUBLE_EQ(s.at(0), 6e-4 * 1 / 4);
  EXPECT_DOUBLE_EQ(s.at(3), 6e-4);
  EXPECT_DOUBLE_EQ(s.at(4), 6e-4);                 // cosine start
  EXPECT_NEAR(s.at(4 + 48), 3e-4, 1e-18);          // half way
  EXPECT_NEAR(s.at(99), 6e-4 * 0.5 * (1 + std::cos(M_PI * 95.0 / 96.0)), 1e-18);
  // int() truncation of W: ratio 0.04 * 49 = 1.96 -> 1.
  EXPECT_EQ(LrSchedule::cosine(1.0, 0.04, 49).warmup, 1);
  EXPECT_EQ(LrSchedule::cosine(1.0, 0.0, 10).at(0), 1.0);
  EXPECT_THROW(LrSchedule::cosine(1.0, 0.1, 0), dflash::UserError);
  EXPECT_THROW(LrSchedule::cosine(1.0, 1.5, 10), dflash::UserError);
}

TEST(AdamW, StateRoundTripContinuesBitExactly) {
  auto make = [] {
    at::manual_seed(1);
    NamedTensors p = {{"a", at::randn({5, 3}).set_requires_grad(true)},
                      {"b", at::randn({7}).to(at::kBFloat16).set_requires_grad(true)}};
    return p;
  };
  auto grads = [](int s, const NamedTensors& p) {
    at::manual_seed(100 + s);
    for (auto& [n, t] : p) t.mutable_grad() = at::randn(t.sizes()).to(t.scalar_type());
  };
  NamedTensors p1 = make();
  AdamW a(p1, {0.9, 0.99, 1e-8, 0.1});
  for (int s = 0; s < 6; ++s) {
    grads(s, p1);
    a.step(1e-2, 1.0);
  }
  NamedTensors p2 = make();
  AdamW b(p2, {0.9, 0.99, 1e-8, 0.1});
  for (int s = 0; s < 3; ++s) {
    grads(s, p2);
    b.step(1e-2, 1.0);
  }
  NamedTensors p3;
  for (auto& [n, t] : p2) p3.emplace_back(n, t.detach().clone().set_requires_grad(true));
  AdamW c(p3, {0.9, 0.99, 1e-8, 0.1});
  c.load_state(b.state(), b.steps(), "test");
  for (int s = 3; s < 6; ++s) {
    grads(s, p3);
    c.step(1e-2, 1.0);
  }
  EXPECT_EQ(c.steps(), 6);
  for (size_t i = 0; i < p1.size(); ++i) EXPECT_TRUE(at::equal(p1[i].second, p3[i].second)) << p1[i].first;
}

TEST(AdamW, LoadStateThatDoesNotFitNamesTheTensors) {
  NamedTensors p = {{"w", at::zeros({2, 2}).set_requires_grad(true)}};
  AdamW a(p, {});
  NamedTensors bad = {{"exp_avg.w", at::zeros({3})}, {"exp_avg_sq.x", at::zeros({2, 2})}};
  try {
    a.load_state(bad, 1, "ckpt/optim.safetensors");
    FAIL();
  } catch (const dflash::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("ckpt/optim.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("missing [exp_avg_sq.w]"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected [exp_avg_sq.x]"), std::string::npos) << m;
    EXPECT_NE(m.find("exp_avg.w has shape [3], expected [2, 2]"), std::string::npos) << m;
  }
}

// The updates (DFLASH_OPTIM_FUSED=0: single-tensor, 1 and aten: ATen's multi-tensor fused one on
// the CPU; 1 picks dflash's CUDA kernels only on a GPU: tests/optim/test_optim_gpu.cpp).
class AdamWBoth : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override { setenv(dflash::optim::kOptimFusedEnv, GetParam(), 1); }
  void TearDown() override { unsetenv(dflash::optim::kOptimFusedEnv); }
};
INSTANTIATE_TEST_SUITE_P(Update, AdamWBoth, ::testing::Values("0", "1", "aten"),
                         [](const ::testing::TestParamInfo<const char*>& i) {
                           const std::string p = i.param;
                           return p == "1" ? "fused" : p == "aten" ? "aten" : "single";
                         });

TEST_P(AdamWBoth, ClipScalesToMaxNormAndSkipsParamsWithoutGrad) {
  NamedTensors p = {{"a", at::zeros({4}).set_requires_grad(true)}, {"b", at::zeros({4}).set_requires_grad(true)}};
  p[0].second.mutable_grad() = at::full({4}, 3.0);  // norm 6
  AdamW a(p, {0.9, 0.999, 1e-8, 0.0});
  EXPECT_EQ(a.fused(), std::string(GetParam()) != "0");
  EXPECT_EQ(a.impl(), std::string(GetParam()) == "0" ? AdamW::Impl::Single : AdamW::Impl::Aten);  // CPU: no kernels
  EXPECT_NEAR(a.grad_norm(), 6.0, 1e-6);
  double n = a.step(0.1, 1.0);
  EXPECT_NEAR(n, 6.0, 1e-6);
  // First Adam step moves each coordinate by about lr against the gradient's sign.
  EXPECT_NEAR(p[0].second[0].item<float>(), -0.1f, 1e-5);
  EXPECT_EQ(p[1].second.abs().sum().item<float>(), 0.0f);
  // The gradient itself was clipped in place (fp32 parameter): norm 1.
  EXPECT_NEAR(at::linalg_vector_norm(p[0].second.grad(), 2).item<float>(), 1.0f, 1e-5);
}

TEST_P(AdamWBoth, Bf16ParametersAreTheirMastersRoundedAndNoGradMeansNoStep) {
  NamedTensors p = {{"w", at::full({3}, 1.0, at::kBFloat16).set_requires_grad(true)},
                    {"x", at::full({2}, 2.0, at::kBFloat16).set_requires_grad(true)}};
  p[0].second.mutable_grad() = at::full({3}, 0.5, at::kBFloat16);
  AdamW a(p, {0.9, 0.999, 1e-8, 0.1});
  a.step(1e-2, 0.0);
  const NamedTensors st = a.state();
  const at::Tensor* master = nullptr;
  for (const auto& [k, v] : st)
    if (k == "master.w") master = &v;
  ASSERT_NE(master, nullptr);
  // decay then one Adam step of ~lr: 1 * (1 - 1e-3) - 1e-2
  EXPECT_NEAR((*master)[0].item<double>(), 1.0 - 1e-3 - 1e-2, 1e-6);
  EXPECT_TRUE(at::equal(p[0].second, master->to(at::kBFloat16)));
  EXPECT_TRUE(at::equal(p[1].second, at::full({2}, 2.0, at::kBFloat16)));  // no gradient: untouched
  EXPECT_EQ(a.steps(), 1);
}
