// trainer/model/gemm.h on a GPU: the per-shape cuBLASLt products (timed at the first product of a
// shape class) against a float64 reference of the same bf16 operands, beside at::mm's error on
// the same operands:
//  - every layout the models use (x W^T, dy W, dy^T x) and a plain a @ b, at sizes that are timed
//    (>= kMinTuned) and one that is not;
//  - c += a @ b (the target's residual adds) twice in a row, so that the second product runs the
//    kept choice on an output that already holds the first;
//  - another m of a timed class (m rounded up to 1024: the kept algorithm on a new m);
//  - linear() forward and both gradients against at::linear's under autograd;
//  - a view whose strides cuBLASLt cannot take (falls back to at::mm).
// Tolerance: the max error against float64 at most 1.5x at::mm's plus 2^-9 of the output's scale
// (both round the same fp32 sums to bf16 once; another algorithm only reorders the fp32
// accumulation, which moves an element by far less than one bf16 ulp, 2^-8 relative; a wrong
// layout, transpose or leading dimension is O(1)). Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "trainer/model/gemm.h"

using namespace dflash::model;

namespace {

bool have_cuda() { return at::hasCUDA(); }

// max |x - ref| / max |ref|
double err(const at::Tensor& x, const at::Tensor& ref) {
  at::Tensor r = ref.to(at::kCPU, at::kDouble);
  return (x.to(at::kCPU, at::kDouble) - r).abs().max().item<double>() / std::max(1e-30, r.abs().max().item<double>());
}

at::Tensor ref_mm(const at::Tensor& a, const at::Tensor& b) {
  return at::mm(a.to(at::kCPU, at::kDouble), b.to(at::kCPU, at::kDouble));
}

void expect_close(const at::Tensor& got, const at::Tensor& aten, const at::Tensor& ref, const char* what) {
  const double eg = err(got, ref), ea = err(aten, ref);
  std::printf("[%s] gemm error %.3e, at::mm error %.3e\n", what, eg, ea);
  EXPECT_LE(eg, 1.5 * ea + 1.0 / 512) << what;
}

at::TensorOptions bf16() { return at::TensorOptions().dtype(at::kBFloat16).device(at::kCUDA); }

}  // namespace

TEST(GemmGpu, LayoutsAgainstFloat64) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(1);
  struct P {
    int64_t m, n, k;
    bool ta, tb;
    const char* what;
  };
  for (const P& p : {P{1024, 768, 512, false, true, "x W^T"}, P{1024, 512, 768, false, false, "dy W"},
                     P{768, 512, 1024, true, false, "dy^T x"}, P{640, 384, 320, false, false, "a @ b"},
                     P{100, 768, 512, false, true, "small m (not timed)"}}) {
    at::Tensor A = p.ta ? at::randn({p.k, p.m}, bf16()) : at::randn({p.m, p.k}, bf16());
    at::Tensor B = p.tb ? at::randn({p.n, p.k}, bf16()) : at::randn({p.k, p.n}, bf16());
    at::Tensor a = p.ta ? A.t() : A, b = p.tb ? B.t() : B;
    const auto before = gemm::tune_stats().classes;
    at::Tensor c = gemm::mm(a, b);
    at::Tensor c2 = gemm::mm(a, b);  // the kept choice
    const at::Tensor ref = ref_mm(a, b);
    expect_close(c, at::mm(a, b), ref, p.what);
    expect_close(c2, at::mm(a, b), ref, p.what);
    const bool timed = p.m >= gemm::kMinTuned && p.n >= gemm::kMinTuned && p.k >= gemm::kMinTuned;
    if (gemm::tuning_enabled()) EXPECT_EQ(gemm::tune_stats().classes - before, timed ? 1 : 0) << p.what;
  }
}

TEST(GemmGpu, AccumulateAndAnotherM) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(2);
  at::Tensor x = at::randn({2048, 512}, bf16()), a = at::randn({2048, 768}, bf16());
  at::Tensor W = at::randn({512, 768}, bf16());
  at::Tensor c = x.clone(), ref = x.to(at::kCPU, at::kDouble), aten = x.clone();
  for (int i = 0; i < 2; ++i) {
    gemm::mm_out(c, a, W.t(), /*accumulate=*/true);
    aten.addmm_(a, W.t());
    ref = ref + ref_mm(a, W.t());
  }
  expect_close(c, aten, ref, "c += a W^T, twice");
  // m = 1900 is in the class of 2048 (rounded up to 1024): the kept algorithm at a new m
  at::Tensor a2 = a.narrow(0, 0, 1900);
  const auto before = gemm::tune_stats().classes;
  at::Tensor c2 = x.narrow(0, 0, 1900).clone();
  gemm::mm_out(c2, a2, W.t(), true);
  EXPECT_EQ(gemm::tune_stats().classes, before) << "m 1900 should reuse the class of m 2048";
  at::Tensor aten2 = x.narrow(0, 0, 1900).clone();
  aten2.addmm_(a2, W.t());
  expect_close(c2, aten2, x.narrow(0, 0, 1900).to(at::kCPU, at::kDouble) + ref_mm(a2, W.t()), "another m");
}

TEST(GemmGpu, LinearForwardAndGradients) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(3);
  at::Tensor x0 = at::randn({2, 640, 512}, bf16()), w0 = at::randn({768, 512}, bf16()) * 0.05;
  at::Tensor gy = at::randn({2, 640, 768}, bf16());
  auto run = [&](bool tuned) {
    at::Tensor x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
    at::Tensor y = tuned ? gemm::linear(x, w) : at::linear(x, w);
    torch::autograd::backward({y}, {gy});
    return std::vector<at::Tensor>{y.detach(), x.grad(), w.grad()};
  };
  auto got = run(true), aten = run(false);
  const at::Tensor xd = x0.to(at::kCPU, at::kDouble).reshape({-1, 512}), wd = w0.to(at::kCPU, at::kDouble),
                   gd = gy.to(at::kCPU, at::kDouble).reshape({-1, 768});
  expect_close(got[0].reshape({-1, 768}), aten[0].reshape({-1, 768}), at::mm(xd, wd.t()), "linear y");
  expect_close(got[1].reshape({-1, 512}), aten[1].reshape({-1, 512}), at::mm(gd, wd), "linear dx");
  expect_close(got[2], aten[2], at::mm(gd.t(), xd), "linear dw");
  // no gradient for an input that does not need one (the drafter's fc reads frozen features)
  at::Tensor w = w0.clone().set_requires_grad(true);
  at::Tensor y = gemm::linear(x0, w);
  torch::autograd::backward({y}, {gy});
  EXPECT_TRUE(w.grad().defined());
}

TEST(GemmGpu, UnsupportedStridesFallBack) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(4);
  // every other column: neither stride is 1, so at::mm runs (and is still right)
  at::Tensor big = at::randn({512, 1024}, bf16()), b = at::randn({512, 384}, bf16());
  at::Tensor a = big.slice(1, 0, 1024, 2);
  expect_close(gemm::mm(a, b), at::mm(a, b), ref_mm(a, b), "strided view");
}
