// The chunked LM head + cross-entropy's CUDA kernels (trainer/model/ce_kernels.h, the default of
// fused_linear_ce on bf16/fp16 CUDA tensors) against the ATen path of the same function on the
// same GPU (CeImpl::Aten) and against float64 on the CPU from the same bf16 values. The GPU cases
// are skipped without a CUDA device; the CPU case checks that the CPU path is the ATen one.
//
// End to end (fused_linear_ce, both CeModes): M = 3000 rows in chunks of 1024 (the last one
// partial), H = 256, V = 151936 (Qwen3's vocabulary, the vector paths) and V = 1001 (odd: rows
// start unaligned, so the scalar paths and the V % 4 tail run), hidden ~ N(0, 1) and W ~ N(0, 16/H)
// in bf16 (logits with std 4), random labels, positive coef summing to 1, plus rows whose label
// is the argmax: rows aimed at edge columns (0..4, V/2, V-5..V-1, the kernels' 4096-column tiles)
// with a clear margin, and random rows labelled with their fp32 argmax. The backward runs on
// 3 * loss, so the hidden gradient must be 3x the reference (the incoming scalar scales it).
// Tolerances:
//   - loss: relative error vs float64 <= 1e-5 and <= 2x the ATen path's + 1e-6. Both paths use the
//     same fp32 logits (one cuBLAS GEMM with fp32 accumulation of exact bf16 products, ~1e-6
//     absolute) and fp32 sums of exponentials (~1e-6 relative); the loss averages these over
//     3000 rows. An off-by-one label changes every row's CE by O(1); a slip confined to the
//     margin rows still moves the loss by ~30 · coef per row, ~5e-4 relative.
//   - hidden gradient: relative Frobenius error vs float64 <= 1.5x the ATen path's + 1e-4, and
//     <= 1e-2 for both. Both round g = (softmax - onehot)·coef to bf16 (relative 2^-8 at most)
//     before the same GEMM and round its output to bf16, so both sit near 3e-3 and differ only
//     where a float32 rounding of g falls on the other side of a bf16 rounding boundary. A
//     misplaced one-hot or a lost factor of 3 is an O(1) error.
//   - correct: identical to the ATen path's except in rows whose float64 top-two logits lie
//     within 1e-6 (the two paths see the same fp32 logits, so only exact fp32 ties could differ,
//     and both take the smallest index); identical to float64's argmax == label except within
//     1e-4 (fp32 logits are ~1e-6..1e-5 off float64). The counts are printed (0 expected). The
//     margin rows must all be correct, and `correct` must hold both values.
// Per row (the kernels called directly on given fp32 logits, float64 of those same logits as
// the reference, V = 1001 and 151936, row stride V and V + 1 so that aligned and unaligned rows
// mix): lse within 3e-5 + 1e-6 |lse| (fp32 sums of <= 600 terms per thread, then a 256-way tree:
// ~1e-6 expected), the weighted CE within coef * (3e-5 + 1e-6 (|lse| + |ce|)), correct exactly
// (the same logits: the argmax is determined, ties included), g per element within
// u |g| + 2e-5 coef (u: the output's rounding, 2^-8 bf16, 2^-11 fp16, 2e-5 fp32; the slack covers
// exp's argument error through lse, ~1e-5 relative). Rows with two equal maxima (in one float4,
// across threads, across loop rounds, in the tail) must pick the smaller index; margin rows at
// the edge columns catch a lost or doubled element; labels -1 and V give NaN and false.
// CeGpu.Timing prints both paths' forward + backward time at M = 8192, V = 151936 (not checked).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include "trainer/model/ce_kernels.h"
#endif

#include "trainer/model/loss.h"
#include "tests/gpu_test.h"

using namespace dflash::model;

namespace {

constexpr int64_t kRows = 3000, kHidden = 256, kChunk = 1024;
constexpr double kLogitStd = 4.0;
constexpr double kGradScale = 3.0;  // backward of kGradScale * loss

using dflash::test::have_cuda;

// ||a - b|| / ||b|| (b the float64 reference)
double rel_fro(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  return ((x - y).norm() / y.norm().clamp_min(1e-300)).item<double>();
}

// Columns where an indexing slip would show: both ends, the middle, the tails of 4-element
// vectors and the 4096-column tiles of ce_grad.
std::vector<int64_t> edge_columns(int64_t V) {
  std::vector<int64_t> c = {0, 1, 2, 3, 4, V / 2, V - 5, V - 4, V - 3, V - 2, V - 1};
  if (V > 4097) c.insert(c.end(), {4095, 4096});
  return c;
}

struct Problem {
  at::Tensor h, w;            // bf16 on the CPU: [M, H], [V, H]
  at::Tensor labels;          // int64 [M]
  at::Tensor coef;            // float32 [M], positive, sum 1
  std::vector<int64_t> margin_rows;  // label = the argmax by a wide margin
};

Problem make_problem(int64_t V, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Problem p;
  auto h = at::randn({kRows, kHidden}, gen, at::kFloat);
  auto w = at::randn({V, kHidden}, gen, at::kFloat) * (kLogitStd / std::sqrt(double(kHidden)));
  auto labels = at::randint(0, V, {kRows}, gen, at::kLong);
  // Margin rows: h_r along W[col] with |h_r| = sqrt(H) / 2, so logit_col = sqrt(H)/2 * |W[col]|
  // = 32 against ~N(0, 2^2) for the other columns (max ~10 over 151936).
  const auto cols = edge_columns(V);
  for (size_t i = 0; i < cols.size(); ++i) {
    auto wc = w[cols[i]];
    for (int64_t q = 0; q < 4; ++q) {  // every row alignment for V = 1001
      const int64_t r = 8 + 16 * int64_t(i) + q;
      h[r].copy_(wc * (0.5 * std::sqrt(double(kHidden)) / wc.norm().item<double>()));
      labels[r] = cols[i];
      p.margin_rows.push_back(r);
    }
    for (int64_t q = 0; q < 4; ++q) labels[400 + 4 * int64_t(i) + q] = cols[i];  // labels there, not argmax
  }
  p.h = h.to(at::kBFloat16);
  p.w = w.to(at::kBFloat16);
  // Rows 600, 610, ...: label = the fp32 argmax of their logits.
  auto idx = at::arange(600, kRows, 10, at::kLong);
  auto dev = at::Device(at::kCUDA, 0);
  auto am = at::mm(p.h.index_select(0, idx).to(dev).to(at::kFloat), p.w.to(dev).to(at::kFloat).t()).argmax(1);
  labels.index_copy_(0, idx, am.cpu());
  p.labels = labels;
  auto coef = at::rand({kRows}, gen, at::kDouble) + 0.05;
  p.coef = (coef / coef.sum()).to(at::kFloat);
  return p;
}

struct Reference {
  double loss = 0;
  at::Tensor grad;     // [M, H] double: d loss / d hidden
  at::Tensor correct;  // [M] bool: argmax == label
  at::Tensor gap;      // [M] double: largest minus second largest logit
};

// float64 on the CPU from the bf16 values, in blocks of rows.
Reference reference(const Problem& p) {
  auto h = p.h.to(at::kDouble), w = p.w.to(at::kDouble), c = p.coef.to(at::kDouble);
  const int64_t M = h.size(0);
  Reference r;
  r.grad = at::empty({M, h.size(1)}, at::kDouble);
  r.correct = at::empty({M}, at::kBool);
  r.gap = at::empty({M}, at::kDouble);
  for (int64_t c0 = 0; c0 < M; c0 += 250) {
    const int64_t n = std::min<int64_t>(250, M - c0);
    auto l = at::mm(h.narrow(0, c0, n), w.t());
    auto lab = p.labels.narrow(0, c0, n);
    auto cf = c.narrow(0, c0, n);
    auto lse = at::logsumexp(l, {1}, true);
    auto ce = (lse - l.gather(1, lab.unsqueeze(1))).squeeze(1);
    r.loss += (ce * cf).sum().item<double>();
    auto d = at::exp(l - lse);
    d.scatter_add_(1, lab.unsqueeze(1), at::full({n, 1}, -1.0, at::kDouble));
    d.mul_(cf.unsqueeze(1));
    r.grad.narrow(0, c0, n).copy_(at::mm(d, w));
    auto top = std::get<0>(l.topk(2, 1));
    r.gap.narrow(0, c0, n).copy_(top.select(1, 0) - top.select(1, 1));
    r.correct.narrow(0, c0, n).copy_(l.argmax(1).eq(lab));
  }
  return r;
}

struct Run {
  double loss = 0;
  at::Tensor grad;     // [M, H] double on the CPU, of kGradScale * loss
  at::Tensor correct;  // [M] bool on the CPU
};

Run run(const Problem& p, CeMode mode, CeImpl impl) {
  const at::Device dev(at::kCUDA, 0);
  auto h = p.h.to(dev).requires_grad_(true);
  auto res = fused_linear_ce(h, p.w.to(dev), p.labels.to(dev), p.coef.to(dev), kChunk, mode, impl);
  (res.loss * kGradScale).backward();
  return {res.loss.item<double>(), h.grad().to(at::kCPU, at::kDouble), res.correct.to(at::kCPU)};
}

int64_t count(const at::Tensor& b) { return b.sum().item<int64_t>(); }

void check_case(int64_t V, uint64_t seed) {
  const auto p = make_problem(V, seed);
  const auto ref = reference(p);
  const auto gref = ref.grad * kGradScale;
  const auto tie6 = ref.gap.lt(1e-6), tie4 = ref.gap.lt(1e-4);
  for (CeMode mode : {CeMode::GradInForward, CeMode::Recompute}) {
    const std::string what =
        "V=" + std::to_string(V) + (mode == CeMode::Recompute ? " Recompute" : " GradInForward");
    const auto a = run(p, mode, CeImpl::Aten), k = run(p, mode, CeImpl::Cuda);
    const double la = std::abs(a.loss - ref.loss) / std::abs(ref.loss);
    const double lk = std::abs(k.loss - ref.loss) / std::abs(ref.loss);
    EXPECT_LE(la, 1e-5) << what << ": ATen path loss " << a.loss << " vs float64 " << ref.loss;
    EXPECT_LE(lk, 1e-5) << what << ": kernels' loss " << k.loss << " vs float64 " << ref.loss;
    EXPECT_LE(lk, 2 * la + 1e-6) << what << ": kernels' loss error " << lk << " vs ATen's " << la;
    const double ga = rel_fro(a.grad, gref), gk = rel_fro(k.grad, gref);
    EXPECT_LE(ga, 1e-2) << what << ": ATen path hidden gradient vs float64";
    EXPECT_LE(gk, 1e-2) << what << ": kernels' hidden gradient vs float64";
    EXPECT_LE(gk, 1.5 * ga + 1e-4) << what << ": kernels' gradient error " << gk << " vs ATen's " << ga;
    EXPECT_FALSE(k.grad.isnan().any().item<bool>()) << what;
    // the switch took effect: at this size float32 rounding in another order shows somewhere
    if (V > 100000) {
      EXPECT_TRUE(k.loss != a.loss || !at::equal(k.grad, a.grad)) << what << ": kernels' result equals ATen's bit for bit";
    }

    const auto vs_aten = k.correct.ne(a.correct), vs_ref = k.correct.ne(ref.correct);
    EXPECT_EQ(count(vs_aten.logical_and(tie6.logical_not())), 0) << what << ": correct differs from the ATen path's";
    EXPECT_EQ(count(vs_ref.logical_and(tie4.logical_not())), 0) << what << ": correct differs from float64's";
    auto margin = at::tensor(p.margin_rows, at::kLong);
    EXPECT_TRUE(k.correct.index_select(0, margin).all().item<bool>()) << what << ": a margin row is not correct";
    const int64_t n_correct = count(k.correct);
    EXPECT_GT(n_correct, 0) << what;
    EXPECT_LT(n_correct, kRows) << what;
    std::cout << "[ ce       ] " << what << ": loss rel. error ATen " << la << ", kernels " << lk
              << "; gradient ATen " << ga << ", kernels " << gk << "; correct " << n_correct << "/" << kRows
              << ", differing from ATen " << count(vs_aten) << " (near ties < 1e-6: " << count(tie6)
              << "), from float64 " << count(vs_ref) << " (near ties < 1e-4: " << count(tie4) << ")\n";
  }
}

}  // namespace

TEST(CeCpu, AutoIsTheAtenPathOnCpu) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    auto h = at::randn({37, 16}, gen, at::kFloat).to(dtype);
    auto w = at::randn({50, 16}, gen, at::kFloat).to(dtype);
    auto lab = at::randint(0, 50, {37}, gen, at::kLong);
    auto coef = at::rand({37}, gen, at::kFloat);
    EXPECT_FALSE(ce_cuda_available(h));
    EXPECT_ANY_THROW(fused_linear_ce(h, w, lab, coef, 5, CeMode::GradInForward, CeImpl::Cuda));
    for (CeMode mode : {CeMode::GradInForward, CeMode::Recompute}) {
      auto h1 = h.clone().requires_grad_(true), h2 = h.clone().requires_grad_(true);
      auto a = fused_linear_ce(h1, w, lab, coef, 5, mode);
      auto b = fused_linear_ce(h2, w, lab, coef, 5, mode, CeImpl::Aten);
      (a.loss * kGradScale).backward();
      (b.loss * kGradScale).backward();
      EXPECT_TRUE(at::equal(a.loss, b.loss));
      EXPECT_TRUE(at::equal(h1.grad(), h2.grad()));
      EXPECT_TRUE(at::equal(a.correct, b.correct));
    }
  }
}

TEST(CeGpu, KernelsMatchAtenAndFp64Vocab151936) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_case(151936, 11);
}

TEST(CeGpu, KernelsMatchAtenAndFp64Vocab1001) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_case(1001, 12);
}

// Auto is the kernels' path unless DFLASH_CE_FUSED=0 (bit for bit the chosen one), fp32 is ATen's.
TEST(CeGpu, AutoFollowsTheSwitch) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const char* env = std::getenv(kCeFusedEnv);
  const bool kernels = env == nullptr || std::string(env) == "1";
  const auto p = make_problem(1001, 13);
  const auto auto_run = run(p, CeMode::GradInForward, CeImpl::Auto);
  const auto chosen = run(p, CeMode::GradInForward, kernels ? CeImpl::Cuda : CeImpl::Aten);
  EXPECT_EQ(auto_run.loss, chosen.loss);
  EXPECT_TRUE(at::equal(auto_run.grad, chosen.grad));
  EXPECT_TRUE(at::equal(auto_run.correct, chosen.correct));
  auto hf = p.h.to(at::Device(at::kCUDA, 0), at::kFloat);
  EXPECT_FALSE(ce_cuda_available(hf));
  EXPECT_TRUE(ce_cuda_available(hf.to(at::kHalf)));
}

// Time of one forward + backward at the recipe's vocabulary, for A/B comparisons (not checked).
TEST(CeGpu, Timing) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
#ifdef DFLASH_CUDA
  const at::Device dev(at::kCUDA, 0);
  const int64_t M = 8192, V = 151936;
  auto h = at::randn({M, kHidden}, at::TensorOptions().device(dev).dtype(at::kBFloat16));
  auto w = (at::randn({V, kHidden}, at::TensorOptions().device(dev)) * (kLogitStd / 16.0)).to(at::kBFloat16);
  auto lab = at::randint(0, V, {M}, at::TensorOptions().device(dev).dtype(at::kLong));
  auto coef = at::full({M}, 1.0 / double(M), at::TensorOptions().device(dev));
  for (CeImpl impl : {CeImpl::Aten, CeImpl::Cuda}) {
    double ms = 0;
    for (int it = 0; it < 4; ++it) {  // the first is a warm-up
      auto hg = h.detach().requires_grad_(true);
      c10::cuda::device_synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      fused_linear_ce(hg, w, lab, coef, 2048, CeMode::GradInForward, impl).loss.backward();
      c10::cuda::device_synchronize();
      if (it > 0) ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / 3;
    }
    std::cout << "[ ce       ] " << (impl == CeImpl::Aten ? "ATen path" : "kernels  ") << ": " << ms
              << " ms per forward + backward (M = " << M << ", V = " << V << ", H = " << kHidden << ", chunk 2048)\n";
  }
#endif
}

#ifdef DFLASH_CUDA
namespace {

// The kernels on given logits [n, V] (fp32, or bf16 with DFLASH_CE_LOGITS=bf16) stored with row
// stride ld, against float64 of the same logits (bf16: of the bf16 values, so the bounds are the
// kernels' float32 arithmetic only, as for fp32 input).
void check_kernels_per_row(int64_t V, int64_t ld, uint64_t seed, at::ScalarType lt = at::kFloat) {
  const std::string what = "V=" + std::to_string(V) + " ld=" + std::to_string(ld) + " logits " + c10::toString(lt);
  const int64_t n = 300;
  const at::Device dev(at::kCUDA, 0);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto l = at::randn({n, V}, gen, at::kFloat) * kLogitStd;
  auto labels = at::randint(0, V, {n}, gen, at::kLong);
  auto coef = at::rand({n}, gen, at::kFloat) + 0.5;
  // Two equal maxima (60) per pair: in one float4, across threads, across loop rounds, vector
  // part against tail; row 2i is labelled with the smaller index (correct), 2i + 1 the larger.
  const std::vector<std::pair<int64_t, int64_t>> pairs = {{5, V - 1}, {0, 4},      {1, 2},      {149, 803},
                                                          {1, 1025},  {2, 4098},   {V - 2, V - 1}, {3, V / 2}};
  int64_t r = 0;
  for (auto [j1, j2] : pairs) {
    if (j2 >= V) continue;
    l[r][j1] = 60.f, l[r][j2] = 60.f, labels[r] = j1;
    l[r + 1][j1] = 60.f, l[r + 1][j2] = 60.f, labels[r + 1] = j2;
    r += 2;
  }
  // Margin rows: one logit of 30 at an edge column, labelled there (rows 20..) or elsewhere (40..).
  const auto cols = edge_columns(V);
  for (size_t i = 0; i < cols.size(); ++i) {
    const int64_t k = int64_t(i);
    l[20 + k][cols[i]] = 30.f, labels[20 + k] = cols[i];
    l[40 + k][cols[i]] = 30.f;
  }
  labels[60] = -1, labels[61] = V;  // out of range: NaN CE, not correct, no one-hot
  coef[62] = 0.f;
  l = l.to(lt).to(at::kFloat);  // the values the kernels see (ties at 60 and 30 stay exact in bf16)
  for (int64_t q = 70; q < 100; ++q) labels[q] = l[q].argmax().item<int64_t>();

  auto buf = at::zeros({n, ld}, at::TensorOptions().device(dev).dtype(lt));
  buf.narrow(1, 0, V).copy_(l);
  const kernels::DType ldt = lt == at::kFloat ? kernels::DType::F32 : kernels::DType::BF16;
  auto lab_d = labels.to(dev), coef_d = coef.to(dev);
  auto fopt = at::TensorOptions().device(dev).dtype(at::kFloat);
  auto lse = at::empty({n}, fopt), wce = at::empty({n}, fopt);
  auto correct = at::empty({n}, fopt.dtype(at::kBool));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  kernels::ce_stats(buf.data_ptr(), ldt, n, V, ld, lab_d.data_ptr<int64_t>(), coef_d.data_ptr<float>(),
                    lse.data_ptr<float>(), wce.data_ptr<float>(), correct.data_ptr<bool>(), stream);

  auto ld64 = l.to(at::kDouble), cd = coef.to(at::kDouble);
  auto lse_ref = at::logsumexp(ld64, {1});
  auto in_range = labels.ge(0).logical_and(labels.lt(V));
  auto safe_lab = labels.clamp(0, V - 1);
  auto ce_ref = lse_ref - ld64.gather(1, safe_lab.unsqueeze(1)).squeeze(1);
  auto correct_ref = ld64.argmax(1).eq(labels).logical_and(in_range);

  auto lse_k = lse.to(at::kCPU, at::kDouble), wce_k = wce.to(at::kCPU, at::kDouble);
  auto lse_err = (lse_k - lse_ref).abs() - (3e-5 + 1e-6 * lse_ref.abs());
  EXPECT_LE(lse_err.max().item<double>(), 0.0) << what << ": lse, worst row " << lse_err.argmax().item<int64_t>();
  auto wce_err = ((wce_k - ce_ref * cd).abs() - cd * (3e-5 + 1e-6 * (lse_ref.abs() + ce_ref.abs())))
                     .masked_select(in_range);
  EXPECT_LE(wce_err.max().item<double>(), 0.0) << what << ": weighted CE";
  EXPECT_TRUE(wce_k.masked_select(in_range.logical_not()).isnan().all().item<bool>()) << what;
  EXPECT_TRUE(at::equal(correct.cpu(), correct_ref)) << what << ": correct, rows differing "
                                                     << count(correct.cpu().ne(correct_ref));
  for (int64_t q = 0; q < r; ++q)
    EXPECT_EQ(correct[q].item<bool>(), q % 2 == 0) << what << ": tie row " << q << " (smaller index wins)";

  // ce_grad from the kernel's lse, for each output dtype.
  auto g_ref = at::exp(ld64 - lse_k.unsqueeze(1));
  g_ref.scatter_add_(1, safe_lab.unsqueeze(1), at::where(in_range, -1.0, 0.0).to(at::kDouble).unsqueeze(1));
  g_ref.mul_(cd.unsqueeze(1));
  struct Out {
    kernels::DType dtype;
    at::ScalarType st;
    double u, floor;  // rounding of the output (relative), smallest spacing near zero
  };
  for (const Out& o : {Out{kernels::DType::BF16, at::kBFloat16, 1.0 / 256, 0.0},
                       Out{kernels::DType::F16, at::kHalf, 1.0 / 2048, 6e-8}, Out{kernels::DType::F32, at::kFloat, 2e-5, 0.0}}) {
    auto g = at::empty({n, V}, fopt.dtype(o.st));
    kernels::ce_grad(buf.data_ptr(), ldt, n, V, ld, lab_d.data_ptr<int64_t>(), lse.data_ptr<float>(),
                     coef_d.data_ptr<float>(), g.data_ptr(), o.dtype, stream);
    auto gk = g.to(at::kCPU, at::kDouble);
    auto excess = (gk - g_ref).abs() - (o.u * 1.01 * g_ref.abs() + 2e-5 * cd.unsqueeze(1) + o.floor);
    const double worst = excess.max().item<double>();
    const int64_t at_flat = excess.argmax().item<int64_t>();
    EXPECT_LE(worst, 0.0) << what << " " << c10::toString(o.st) << ": g, worst at row " << at_flat / V << " column "
                          << at_flat % V;
    EXPECT_EQ(gk[62].abs().max().item<double>(), 0.0) << what << ": coef 0 row";
  }
}

}  // namespace

TEST(CeGpu, KernelsPerRowAgainstFp64) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_kernels_per_row(1001, 1001, 21);
  check_kernels_per_row(1001, 1002, 22);
  check_kernels_per_row(151936, 151936, 23);
  check_kernels_per_row(151936, 151937, 24);
}

TEST(CeGpu, KernelsOnBf16LogitsAgainstFp64) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  check_kernels_per_row(1001, 1001, 31, at::kBFloat16);  // rows 2-byte aligned only: the scalar loops
  check_kernels_per_row(1004, 1004, 32, at::kBFloat16);  // 8-byte aligned rows: the 4-wide loads
  check_kernels_per_row(151936, 151936, 33, at::kBFloat16);
  check_kernels_per_row(151936, 151937, 34, at::kBFloat16);
}
#endif
