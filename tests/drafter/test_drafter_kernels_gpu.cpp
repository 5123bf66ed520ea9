// The drafter's fused CUDA kernels (trainer/model/drafter_kernels.h: RoPE forward and transpose,
// the per-head q/k RMSNorm + RoPE forward and backward (with the weight's gradient), SwiGLU
// forward and backward) against the ATen chains they replace on the same GPU, and both
// against a float64 reference computed from the same bf16 inputs. Skipped without a CUDA device.
// Shapes: the drafter's (head_dim 128, 8-element vector path) and odd ones that take the scalar
// path (head_dim 40: 20 pairs, not a multiple of 8; 3 x 1001 elements). The weight gradient of the
// norm sums over up to 19200 rows in float32 in both paths; it is held to the same bounds.
// Tolerance: the kernels compute in float32 and round once to bf16 (relative 2^-9 = 2.0e-3 of an
// element); the ATen chains round after every operation. So the kernels' max error against
// float64, relative to the output's largest magnitude, must be <= 4e-3 (two bf16 roundings) and
// <= 1.5x the ATen chain's + 1e-3. A wrong sign, half, position or head is an O(1) error.
#include <gtest/gtest.h>

#include <cmath>

#include <ATen/ATen.h>
#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "trainer/model/drafter.h"
#include "tests/gpu_test.h"

using namespace dflash::model;

namespace {

using dflash::test::have_cuda;

// max |a - b| / max |b| over all elements (b the float64 reference).
double rel(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

// expect_differs: the kernel's single rounding must show somewhere (else the kernel did not run);
// not asked of a 128-element weight gradient, whose float32 sums may round to the same bf16.
void expect_close(const char* what, const at::Tensor& fused, const at::Tensor& aten, const at::Tensor& ref,
                  bool expect_differs = true) {
  const double ef = rel(fused, ref), ea = rel(aten, ref);
  EXPECT_LE(ef, 4e-3) << what << ": fused kernel vs float64 (ATen chain: " << ea << ")";
  EXPECT_LE(ef, 1.5 * ea + 1e-3) << what << ": fused kernel " << ef << " vs ATen chain " << ea;
  EXPECT_FALSE(fused.isnan().any().item<bool>()) << what;
  // one rounding instead of a chain of them: some element differs, else the kernel did not run
  if (expect_differs) {
    EXPECT_FALSE(at::equal(fused, aten)) << what << ": the fused result equals the ATen chain's bit for bit";
  }
}

// cos/sin [B, L, 1, d] of rotate-half RoPE (both halves equal), rounded to bf16 as the drafter's.
std::pair<at::Tensor, at::Tensor> tables(int64_t B, int64_t L, int64_t d, at::Device dev) {
  auto pos = at::randint(0, 40000, {B, L}, at::kLong).to(at::kDouble);
  auto inv = at::pow(1e6, at::arange(0, d, 2, at::kDouble) / double(d)).reciprocal();
  auto f = pos.unsqueeze(-1) * inv;
  auto emb = at::cat({f, f}, -1).unsqueeze(2);
  return {emb.cos().to(dev, at::kBFloat16), emb.sin().to(dev, at::kBFloat16)};
}

at::Tensor rope_ref(const at::Tensor& x, const at::Tensor& c, const at::Tensor& s, bool transpose) {
  auto xd = x.to(at::kCPU, at::kDouble), cd = c.to(at::kCPU, at::kDouble), sd = s.to(at::kCPU, at::kDouble);
  const int64_t h = xd.size(-1) / 2;
  auto x1 = xd.narrow(-1, 0, h), x2 = xd.narrow(-1, h, h);
  auto rot = transpose ? at::cat({x2, -x1}, -1) : at::cat({-x2, x1}, -1);
  return xd * cd + rot * sd;
}

void check_rope(int64_t B, int64_t L, int64_t heads, int64_t d) {
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(7 + d);
  auto [c, s] = tables(B, L, d, dev);
  auto x0 = (at::randn({B, L, heads, d}) * 2).to(dev, at::kBFloat16);
  auto go = at::randn({B, L, heads, d}).to(dev, at::kBFloat16);
  at::Tensor y[2], dx[2];
  for (int fused = 0; fused < 2; ++fused) {
    auto x = x0.clone().set_requires_grad(true);
    y[fused] = apply_rope(x, c, s, fused == 1);
    y[fused].backward(go);
    dx[fused] = x.grad();
  }
  const std::string shape = "[" + std::to_string(B) + ", " + std::to_string(L) + ", " + std::to_string(heads) +
                            ", " + std::to_string(d) + "]";
  expect_close(("RoPE forward " + shape).c_str(), y[1], y[0], rope_ref(x0, c, s, false));
  expect_close(("RoPE backward " + shape).c_str(), dx[1], dx[0], rope_ref(go, c, s, true));
}

// RMSNorm per head (weight w, eps 1e-6) then RoPE, in float64.
at::Tensor norm_rope_ref(const at::Tensor& x, const at::Tensor& w, const at::Tensor& c, const at::Tensor& s) {
  auto xd = x.to(at::kCPU, at::kDouble);
  auto n = xd * at::rsqrt(xd.pow(2).mean(-1, true) + 1e-6) * w.to(at::kCPU, at::kDouble);
  return rope_ref(n, c, s, false);
}

void check_norm_rope(int64_t B, int64_t L, int64_t heads) {
  const at::Device dev(at::kCUDA, 0);
  const int64_t d = 128;
  at::manual_seed(5 + heads);
  auto [c, s] = tables(B, L, d, dev);
  auto x0 = (at::randn({B, L, heads, d}) * 3).to(dev, at::kBFloat16);
  auto w0 = (1 + at::randn({d}) * 0.2).to(dev, at::kBFloat16);
  auto go = at::randn({B, L, heads, d}).to(dev, at::kBFloat16);
  at::Tensor y[2], dx[2], dw[2];
  for (int fused = 0; fused < 2; ++fused) {
    auto x = x0.clone().set_requires_grad(true), w = w0.clone().set_requires_grad(true);
    y[fused] = norm_rope(x, w, 1e-6, c, s, fused == 1);
    y[fused].backward(go);
    dx[fused] = x.grad(), dw[fused] = w.grad();
  }
  // the float64 reference's gradients by autograd on CPU
  auto xr = x0.to(at::kCPU, at::kDouble).set_requires_grad(true), wr = w0.to(at::kCPU, at::kDouble).set_requires_grad(true);
  auto yr = norm_rope_ref(xr, wr, c, s);
  yr.backward(go.to(at::kCPU, at::kDouble));
  const std::string n = "[" + std::to_string(B) + ", " + std::to_string(L) + ", " + std::to_string(heads) + ", 128]";
  expect_close(("q/k norm + RoPE forward " + n).c_str(), y[1], y[0], yr.detach());
  expect_close(("q/k norm + RoPE d x " + n).c_str(), dx[1], dx[0], xr.grad());
  expect_close(("q/k norm + RoPE d weight " + n).c_str(), dw[1], dw[0], wr.grad(), false);
}

void check_swiglu(std::vector<int64_t> shape) {
  const at::Device dev(at::kCUDA, 0);
  at::manual_seed(11 + shape.back());
  auto g0 = (at::randn(shape) * 3).to(dev, at::kBFloat16);
  auto u0 = at::randn(shape).to(dev, at::kBFloat16);
  auto go = at::randn(shape).to(dev, at::kBFloat16);
  at::Tensor y[2], dg[2], du[2];
  for (int fused = 0; fused < 2; ++fused) {
    auto g = g0.clone().set_requires_grad(true), u = u0.clone().set_requires_grad(true);
    y[fused] = swiglu(g, u, fused == 1);
    y[fused].backward(go);
    dg[fused] = g.grad(), du[fused] = u.grad();
  }
  auto gd = g0.to(at::kCPU, at::kDouble), ud = u0.to(at::kCPU, at::kDouble), od = go.to(at::kCPU, at::kDouble);
  auto sg = at::sigmoid(gd);
  const std::string n = std::to_string(g0.numel()) + " elements";
  expect_close(("SwiGLU forward, " + n).c_str(), y[1], y[0], gd * sg * ud);
  expect_close(("SwiGLU d gate, " + n).c_str(), dg[1], dg[0], od * ud * sg * (1 + gd * (1 - sg)));
  expect_close(("SwiGLU d up, " + n).c_str(), du[1], du[0], od * gd * sg);
}

TEST(DrafterKernelsGpu, RopeDrafterShapes) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_rope(2, 300, 32, 128);  // q of a drafter layer
  check_rope(1, 257, 8, 128);   // k: odd length
}

TEST(DrafterKernelsGpu, RopeScalarPath) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_rope(3, 17, 3, 40);  // 20 pairs per head: not a multiple of the 8-element vector
}

TEST(DrafterKernelsGpu, HeadNormRope) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_norm_rope(2, 300, 32);  // q of a drafter layer
  check_norm_rope(1, 257, 8);   // k: odd length, 2056 rows (not a multiple of a block's 8 warps)
}

TEST(DrafterKernelsGpu, HeadNormRopeFallsBackBelowHeadDim128) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  auto [c, s] = tables(1, 9, 64, dev);
  auto x = at::randn({1, 9, 4, 64}).to(dev, at::kBFloat16);
  auto w = at::ones({64}).to(dev, at::kBFloat16);
  // head_dim 64: the two-step path, the same with or without `fused` for the norm (RoPE's kernel runs in both)
  EXPECT_TRUE(at::equal(norm_rope(x, w, 1e-6, c, s, true), apply_rope(at::rms_norm(x, {64}, w, 1e-6), c, s, true)));
}

TEST(DrafterKernelsGpu, SwigluVectorAndScalar) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_swiglu({64, 12288});
  check_swiglu({3, 1001});
}

}  // namespace
