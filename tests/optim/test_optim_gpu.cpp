// AdamW's CUDA kernels (trainer/optim/adamw_kernels.h, DFLASH_OPTIM_FUSED=1 / auto on CUDA) against
// (a) ATen's fused path on the same GPU (DFLASH_OPTIM_FUSED=aten: _foreach_norm + _fused_adamw_)
// and (b) a float64 evaluation of the same formulas (torch.optim.AdamW + clip_grad_norm_) from the
// same 16-bit/fp32 inputs. The GPU tests skip without a CUDA device; the same harness runs on the
// CPU with ATen's fused path as the candidate and the single-tensor path as the oracle
// (AdamWHarnessCpu), so that the reference and the bounds are exercised in every build.
//
// Cases: 5 steps, weight decay 0.1, betas (0.9, 0.95); tensors of 1, 7, 4097, 64 x 64 and 3 x 65537
// elements (the last one 4 blocks of 65536 with a 3-element tail), and unaligned views (parameter
// and gradient at element offset 1 or 3 of a larger buffer: the kernels' element-by-element path);
// bf16 and fp32 parameters, one case of bf16 + fp16 + fp32 in one optimizer (one launch per dtype
// pair), one of 100 tensors (more than one launch's 48); clipping active in some steps (max_norm
// 50 against norms ~300-450, gradient scale 0.02 every third step: norms ~6-9), inactive (max_norm
// 1e9) and off (0).
//
// Tolerances, as max |a - b| / max |b| per tensor:
//   - norm: 1e-6 against both. The kernels add squares in fp32 per thread (128 terms) and per block,
//     then the block sums in float64 (an fp32 emulation of that order on these sizes: 6-8e-8 off
//     float64); ATen's CUDA _foreach_norm sums per thread and block likewise.
//   - fp32 master, exp_avg, exp_avg_sq: 1e-6 against both. Every element goes through the same
//     ops; each step rounds m, v and the master to fp32 a few times (2^-24 = 6e-8 each) and the fp32
//     clip coefficient carries the norm's error (v its square); an fp32 emulation of 5 steps over
//     2e5 elements lands at 1-2.4e-7, 4x inside the bound, while a wrong bias correction, decay,
//     step count or a clip applied to the wrong tensor is 1e-3 and more.
//   - 16-bit parameters: exactly their fp32 master rounded (round to nearest even); against ATen's
//     and the float64 ones rounded, 2^-8 (one bf16 unit where masters within 1e-6 straddle a
//     rounding boundary).
//   - determinism: the kernels run twice give the same bits (fixed-order reductions, no atomics).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "trainer/optim/adamw.h"
#include "tests/gpu_test.h"

using namespace dflash::optim;

namespace {

using dflash::test::have_cuda;

constexpr int kSteps = 5;
constexpr double kLr = 1e-2;
const AdamWOptions kOpt{0.9, 0.95, 1e-8, 0.1};

// One parameter: its shape, dtype, and the element offset of it and its gradient inside a larger
// buffer (0: an allocation of its own, 16-byte aligned).
struct Spec {
  std::vector<int64_t> shape;
  at::ScalarType dtype;
  int64_t offset = 0;
};

struct Data {
  std::vector<Spec> specs;
  std::vector<at::Tensor> init;               // CPU, spec dtype
  std::vector<std::vector<at::Tensor>> grads;  // [step][tensor], CPU, spec dtype
};

Data make_data(std::vector<Spec> specs, uint64_t seed) {
  Data d;
  d.specs = std::move(specs);
  at::manual_seed(seed);
  for (const Spec& s : d.specs) d.init.push_back(at::randn(s.shape).to(s.dtype));
  for (int st = 0; st < kSteps; ++st) {
    // the scale varies so that max_norm 1 clips in some steps and not in others
    const double scale = st % 3 == 0 ? 0.02 : 1.0;
    std::vector<at::Tensor> g;
    for (const Spec& s : d.specs) g.push_back((at::randn(s.shape) * scale).to(s.dtype));
    d.grads.push_back(std::move(g));
  }
  return d;
}

// `src` on `dev`, as its own allocation or as a view at element `offset` of a larger buffer.
at::Tensor place(const at::Tensor& src, int64_t offset, at::Device dev) {
  if (offset == 0) return src.to(dev).clone();
  at::Tensor buf = at::zeros({src.numel() + offset}, src.options().device(dev));
  at::Tensor v = buf.narrow(0, offset, src.numel()).view(src.sizes());
  v.copy_(src);
  return v;
}

struct Result {
  AdamW::Impl impl;
  std::vector<double> norms;
  std::vector<at::Tensor> params, masters, m, v;  // after the last step, on the CPU
};

Result run(const Data& d, const char* mode, at::Device dev, double max_norm) {
  at::NoGradGuard ng;
  setenv(kOptimFusedEnv, mode, 1);
  NamedTensors params;
  for (size_t i = 0; i < d.specs.size(); ++i)
    params.emplace_back("p" + std::to_string(i), place(d.init[i], d.specs[i].offset, dev).set_requires_grad(true));
  AdamW opt(params, kOpt);
  unsetenv(kOptimFusedEnv);
  Result r;
  r.impl = opt.impl();
  for (int st = 0; st < kSteps; ++st) {
    for (size_t i = 0; i < params.size(); ++i)
      params[i].second.mutable_grad() = place(d.grads[st][i], d.specs[i].offset, dev);
    r.norms.push_back(opt.step(kLr, max_norm));
    opt.zero_grad();
  }
  std::map<std::string, at::Tensor> state;
  for (const auto& [k, v] : opt.state()) state[k] = v;
  for (const auto& [n, p] : params) {
    r.params.push_back(p.detach().to(at::kCPU).clone());
    r.masters.push_back((state.count("master." + n) ? state["master." + n] : p.detach()).to(at::kCPU).clone());
    r.m.push_back(state.at("exp_avg." + n).to(at::kCPU).clone());
    r.v.push_back(state.at("exp_avg_sq." + n).to(at::kCPU).clone());
  }
  return r;
}

// The same formulas in float64 from the same inputs (torch.optim.AdamW + clip_grad_norm_).
struct Reference {
  std::vector<double> norms;
  int clipped = 0;  // steps with norm > max_norm > 0
  std::vector<at::Tensor> p, m, v;
};

Reference reference(const Data& d, double max_norm) {
  Reference r;
  for (const at::Tensor& t : d.init) {
    r.p.push_back(t.to(at::kDouble));
    r.m.push_back(at::zeros_like(r.p.back()));
    r.v.push_back(at::zeros_like(r.p.back()));
  }
  const double b1 = kOpt.beta1, b2 = kOpt.beta2;
  for (int st = 0; st < kSteps; ++st) {
    std::vector<at::Tensor> g;
    double total = 0;
    for (const at::Tensor& t : d.grads[st]) {
      g.push_back(t.to(at::kDouble));
      total += g.back().pow(2).sum().item<double>();
    }
    const double norm = std::sqrt(total);
    r.norms.push_back(norm);
    const double coef = max_norm > 0 ? std::min(1.0, max_norm / (norm + 1e-6)) : 1.0;
    r.clipped += max_norm > 0 && norm > max_norm;
    const double t = st + 1, bc1 = 1 - std::pow(b1, t), bc2 = 1 - std::pow(b2, t);
    for (size_t i = 0; i < g.size(); ++i) {
      at::Tensor gi = g[i] * coef;
      r.p[i] = r.p[i] * (1 - kLr * kOpt.weight_decay);
      r.m[i] = r.m[i] + (1 - b1) * (gi - r.m[i]);
      r.v[i] = b2 * r.v[i] + (1 - b2) * gi * gi;
      r.p[i] = r.p[i] - (kLr / bc1) * r.m[i] / (r.v[i].sqrt() / std::sqrt(bc2) + kOpt.eps);
    }
  }
  return r;
}

// max |a - b| / max |b|
double rel(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item<double>();
}

constexpr double kRel = 1e-6;
constexpr double kParamRel = 1.0 / 256;  // 2^-8

// The candidate update against the oracle's (same device, kRel) and against float64 (ref_rel).
void check(const Data& d, double max_norm, at::Device dev, const char* cand_mode, AdamW::Impl cand_impl,
           const char* oracle_mode, AdamW::Impl oracle_impl, bool expect_some_clipping, double ref_rel = kRel) {
  const Result c = run(d, cand_mode, dev, max_norm);
  const Result o = run(d, oracle_mode, dev, max_norm);
  const Reference ref = reference(d, max_norm);
  ASSERT_EQ(c.impl, cand_impl) << cand_mode;
  ASSERT_EQ(o.impl, oracle_impl) << oracle_mode;
  if (max_norm > 0 && max_norm < 1e6) {
    if (expect_some_clipping) {
      EXPECT_GT(ref.clipped, 0);
      EXPECT_LT(ref.clipped, kSteps);  // both regimes
    }
  } else {
    EXPECT_EQ(ref.clipped, 0);
  }
  for (int st = 0; st < kSteps; ++st) {
    EXPECT_NEAR(c.norms[st], o.norms[st], kRel * o.norms[st]) << "norm, step " << st;
    EXPECT_NEAR(c.norms[st], ref.norms[st], ref_rel * ref.norms[st]) << "norm vs float64, step " << st;
  }
  for (size_t i = 0; i < d.specs.size(); ++i) {
    const std::string what = "tensor " + std::to_string(i) + " (" + std::to_string(d.init[i].numel()) + " elements, " +
                             c10::toString(d.specs[i].dtype) + ", offset " + std::to_string(d.specs[i].offset) + ")";
    EXPECT_LE(rel(c.masters[i], o.masters[i]), kRel) << "master of " << what;
    EXPECT_LE(rel(c.m[i], o.m[i]), kRel) << "exp_avg of " << what;
    EXPECT_LE(rel(c.v[i], o.v[i]), kRel) << "exp_avg_sq of " << what;
    EXPECT_LE(rel(c.masters[i], ref.p[i]), ref_rel) << "master vs float64 of " << what;
    EXPECT_LE(rel(c.m[i], ref.m[i]), ref_rel) << "exp_avg vs float64 of " << what;
    EXPECT_LE(rel(c.v[i], ref.v[i]), ref_rel) << "exp_avg_sq vs float64 of " << what;
    EXPECT_EQ(c.params[i].scalar_type(), d.specs[i].dtype) << what;
    EXPECT_FALSE(c.masters[i].isnan().any().item<bool>()) << what;
    if (d.specs[i].dtype != at::kFloat) {
      EXPECT_TRUE(at::equal(c.params[i], c.masters[i].to(d.specs[i].dtype))) << "param != its master rounded, " << what;
      EXPECT_LE(rel(c.params[i], o.params[i]), kParamRel) << "param of " << what;
      EXPECT_LE(rel(c.params[i], ref.p[i].to(d.specs[i].dtype)), kParamRel) << "param vs float64 of " << what;
    }
  }
  // determinism: a second run of the candidate, bit for bit
  const Result c2 = run(d, cand_mode, dev, max_norm);
  for (int st = 0; st < kSteps; ++st) EXPECT_EQ(c.norms[st], c2.norms[st]) << "norm not reproducible, step " << st;
  for (size_t i = 0; i < d.specs.size(); ++i) {
    EXPECT_TRUE(at::equal(c.params[i], c2.params[i])) << "param " << i << " not reproducible";
    EXPECT_TRUE(at::equal(c.masters[i], c2.masters[i])) << "master " << i << " not reproducible";
  }
}

// Gradient norms of the cases below: ~300-450 at scale 1, ~6-9 at scale 0.02, so max_norm kClip
// clips two steps of three.
constexpr double kClip = 50.0;

std::vector<Spec> odd_sizes(at::ScalarType dt) {
  return {{{1}, dt, 0},         {{7}, dt, 0},     {{4097}, dt, 0}, {{64, 64}, dt, 0},
          {{3, 65537}, dt, 0}, {{5, 13}, dt, 1}, {{4099}, dt, 3}};
}

std::vector<Spec> mixed() {
  return {{{4097}, at::kBFloat16, 0}, {{33, 7}, at::kHalf, 0},  {{65536}, at::kFloat, 0},
          {{9}, at::kFloat, 1},       {{1000}, at::kHalf, 1},   {{70001}, at::kBFloat16, 0}};
}

std::vector<Spec> many() {
  std::vector<Spec> s;
  for (int i = 0; i < 100; ++i) s.push_back({{1 + (i * 37) % 2000}, at::kBFloat16, i % 7 == 3 ? 1 : 0});
  return s;
}

// GPU: the kernels (1) against ATen's fused path (aten).
void gpu_check(const std::vector<Spec>& specs, double max_norm, bool expect_some_clipping = true) {
  check(make_data(specs, 17), max_norm, at::Device(at::kCUDA, 0), "1", AdamW::Impl::Kernels, "aten",
        AdamW::Impl::Aten, expect_some_clipping);
}

}  // namespace

TEST(AdamWKernelsGpu, Bf16ClipSomeSteps) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(odd_sizes(at::kBFloat16), kClip);
}

TEST(AdamWKernelsGpu, Bf16ClipInactive) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(odd_sizes(at::kBFloat16), 1e9);
}

TEST(AdamWKernelsGpu, Bf16NoClip) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(odd_sizes(at::kBFloat16), 0.0);
}

TEST(AdamWKernelsGpu, Fp32ClipSomeSteps) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(odd_sizes(at::kFloat), kClip);
}

TEST(AdamWKernelsGpu, Fp32ClipInactive) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(odd_sizes(at::kFloat), 1e9);
}

TEST(AdamWKernelsGpu, MixedDtypesOneOptimizer) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(mixed(), kClip);
}

TEST(AdamWKernelsGpu, MoreTensorsThanOneLaunchHolds) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  gpu_check(many(), kClip);
}

TEST(AdamWKernelsGpu, ParametersWithoutGradientAreSkipped) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  at::NoGradGuard ng;
  const at::Device dev(at::kCUDA, 0);
  NamedTensors p = {{"a", at::zeros({4}, at::TensorOptions().device(dev)).set_requires_grad(true)},
                    {"b", at::full({3}, 2.0, at::TensorOptions().device(dev).dtype(at::kBFloat16)).set_requires_grad(true)}};
  p[0].second.mutable_grad() = at::full({4}, 3.0, at::TensorOptions().device(dev));  // norm 6
  AdamW a(p, {0.9, 0.999, 1e-8, 0.1});  // auto: the kernels on CUDA
  ASSERT_EQ(a.impl(), AdamW::Impl::Kernels);
  EXPECT_NEAR(a.step(0.1, 1.0), 6.0, 1e-5);
  // one Adam step of ~lr against the gradient's sign (decay of a zero weight is zero)
  EXPECT_NEAR(p[0].second[0].item<float>(), -0.1f, 1e-5);
  EXPECT_TRUE(at::equal(p[1].second.cpu(), at::full({3}, 2.0, at::kBFloat16)));  // no gradient: untouched
  EXPECT_EQ(a.steps(), 1);
  a.zero_grad();
  EXPECT_EQ(a.step(0.1, 1.0), 0.0);  // no gradient at all: norm 0, nothing moves
  EXPECT_NEAR(p[0].second[0].item<float>(), -0.1f, 1e-5);
}

TEST(AdamWKernelsGpu, FallsBackToAtenForStridedParameters) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const at::Device dev(at::kCUDA, 0);
  NamedTensors p = {{"t", at::zeros({4, 6}, at::TensorOptions().device(dev)).t().set_requires_grad(true)}};
  setenv(kOptimFusedEnv, "1", 1);
  AdamW a(p, {});
  unsetenv(kOptimFusedEnv);
  EXPECT_EQ(a.impl(), AdamW::Impl::Aten);
  EXPECT_EQ(AdamW(p, {}).impl(), AdamW::Impl::Aten);  // auto too
}

// The harness itself on the CPU: ATen's fused path against the single-tensor one (kRel) and float64
// (no GPU needed; runs in every build). Against float64 the bound is kCpuRefRel = 3e-5: ATen's CPU
// fp32 norms of ~2e5 elements are ~5e-6 off (both CPU paths alike: measured 4-5e-6, where the
// kernels' summation order gives ~1e-7), and exp_avg_sq scales with the clip coefficient squared
// (measured up to 8.6e-6).
constexpr double kCpuRefRel = 3e-5;

TEST(AdamWHarnessCpu, AtenFusedAgainstSingleTensorAndFloat64) {
  const at::Device cpu(at::kCPU);
  for (double max_norm : {kClip, 1e9, 0.0}) {
    SCOPED_TRACE("max_norm " + std::to_string(max_norm));
    check(make_data(odd_sizes(at::kBFloat16), 17), max_norm, cpu, "aten", AdamW::Impl::Aten, "0", AdamW::Impl::Single,
          true, kCpuRefRel);
  }
  check(make_data(odd_sizes(at::kFloat), 17), kClip, cpu, "aten", AdamW::Impl::Aten, "0", AdamW::Impl::Single, true,
        kCpuRefRel);
  check(make_data(mixed(), 17), kClip, cpu, "aten", AdamW::Impl::Aten, "0", AdamW::Impl::Single, true, kCpuRefRel);
}
