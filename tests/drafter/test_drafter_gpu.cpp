// GPU checks of the drafter (skipped without CUDA): the bf16 CUDA forward/backward (cuDNN SDPA
// through the grouped reference path, fused CE) against the fp32 CPU computation of the same
// parameters and batch, which tests/drafter/test_drafter_ref.py ties to the Python reference.
// Tolerances: bf16 has 8 mantissa bits (relative rounding 2^-9 = 2e-3 per operation); after two
// layers, norms and a 512-wide softmax the observed differences are ~1e-2 relative, so the loss
// must agree within 2e-2 and gradients within 1e-1 (relative Frobenius norm). A wrong mask or
// label is an O(1) difference. Rows of dropped blocks must yield exactly 0 and no NaN anywhere.
#include <cmath>
#include <cstdlib>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "attention/dflash_attention.h"
#include "trainer/model/anchors.h"
#include "trainer/model/drafter.h"

using namespace dflash;
using namespace dflash::model;

namespace {

bool have_cuda() {
#ifdef DFLASH_CUDA
  if (c10::cuda::device_count() > 0) return true;
#endif
  // DFLASH_TEST_GPU_ON_CPU=1 runs these tests with bf16 on the CPU (checks the test itself).
  return std::getenv("DFLASH_TEST_GPU_ON_CPU") != nullptr;
}

at::Device test_device() {
#ifdef DFLASH_CUDA
  if (c10::cuda::device_count() > 0) return at::Device(at::kCUDA, 0);
#endif
  return at::Device(at::kCPU);
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  return ((x - y).norm() / y.norm().clamp_min(1e-30)).item<double>();
}

DrafterSpec small_spec() {
  DrafterSpec s;
  s.hidden_size = 256, s.intermediate_size = 512, s.num_layers = 2, s.num_heads = 4, s.num_kv_heads = 2;
  s.head_dim = 128, s.vocab_size = 512, s.block_size = 16, s.num_target_layers = 8;
  s.target_layer_ids = {1, 3, 5}, s.mask_token_id = 511;
  return s;
}

}  // namespace

TEST(DrafterGpu, Bf16CudaMatchesFp32Cpu) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  for (const char* groups : {"0", "64"}) {
    setenv("DFLASH_SDPA_GROUP_QUERIES", groups, 1);
    auto spec = small_spec();
    Drafter cpu(spec, at::kCPU, at::kFloat);
    cpu.init_random(7);
    {
      at::NoGradGuard ng;
      for (auto& [n, t] : cpu.named_parameters()) {  // bf16-representable, larger than the init
        auto w = t;
        w.mul_(w.dim() == 1 ? 1.0 : 10.0).copy_(w.to(at::kBFloat16).to(at::kFloat));
      }
    }
    Drafter gpu(spec, test_device(), at::kBFloat16);
    for (auto& [n, t] : cpu.named_parameters()) gpu.load_param(n, t);
    auto embed = at::randn({spec.vocab_size, spec.hidden_size}).to(at::kBFloat16).to(at::kFloat);
    auto head = (at::randn({spec.vocab_size, spec.hidden_size}) * 0.1).to(at::kBFloat16).to(at::kFloat);
    cpu.set_target_weights(embed, head);
    gpu.set_target_weights(embed, head);

    const int64_t B = 2, S = 200;
    DrafterBatch batch;
    batch.ids = at::randint(0, 500, {B, S});
    batch.loss_mask = at::ones({B, S}, at::kLong);
    batch.loss_mask.narrow(1, 0, 20).zero_();
    batch.loss_mask[1].narrow(0, 100, 100).zero_();  // row 1: fewer anchors -> dropped blocks
    batch.features = at::randn({B, S, 3 * spec.hidden_size}).to(at::kBFloat16).to(at::kFloat);
    batch.docs = {{0, 120, 200}, {}};
    StepOptions opt;
    opt.num_anchors = 40;
    opt.loss_chunk = 100;
    auto oc = cpu.forward(batch, opt);
    oc.loss.backward();
    auto og = gpu.forward(batch, opt);
    og.loss.backward();
    EXPECT_FALSE(std::isnan(og.loss_value));
    EXPECT_NEAR(og.loss_value, oc.loss_value, 2e-2 * std::abs(oc.loss_value)) << "groups " << groups;
    EXPECT_EQ(og.n_tokens, oc.n_tokens);
    for (auto& [n, t] : gpu.named_parameters()) {
      ASSERT_TRUE(t.grad().defined()) << n;
      EXPECT_FALSE(t.grad().isnan().any().item<bool>()) << n;
      EXPECT_LT(rel(t.grad(), cpu.param(n).grad()), 1e-1) << n << " groups " << groups;
    }
  }
  unsetenv("DFLASH_SDPA_GROUP_QUERIES");
}

// StepOptions::defer_metrics on the device: the forward queues copies of the loss and of the
// per-position hits into pinned host memory behind it (pending.ready), and finish() after the
// backward yields what the eager forward reports; the batch as training receives it (ids, mask
// and features on the device). A NaN weight still gives a NaN loss_value (the trainer's stop).
TEST(DrafterGpu, DeferredMetricsEqualTheEagerOnes) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const auto dev = test_device();
  const bool on_cuda = dev.is_cuda();
  auto spec = small_spec();
  Drafter d(spec, dev, at::kBFloat16);
  d.init_random(5);
  d.set_target_weights(at::randn({spec.vocab_size, spec.hidden_size}),
                       at::randn({spec.vocab_size, spec.hidden_size}) * 0.1);
  const int64_t B = 2, S = 300;
  DrafterBatch batch;
  batch.ids = at::randint(0, 500, {B, S}).to(dev);
  batch.loss_mask = at::ones({B, S}, at::kByte);
  batch.loss_mask.narrow(1, 0, 30).zero_();
  batch.loss_mask = batch.loss_mask.to(dev);
  batch.features = at::randn({B, S, 3 * spec.hidden_size}, at::TensorOptions().dtype(at::kBFloat16).device(dev));
  batch.docs = {{0, 170, 300}, {}};
  batch.global_batch_index = 3;
  StepOptions opt;
  opt.num_anchors = 30;
  opt.loss_chunk = 128;
  auto eager = d.forward(batch, opt);
  eager.loss.backward();
  for (auto& p : d.parameters()) p.mutable_grad().reset();
  opt.defer_metrics = true;
  auto late = d.forward(batch, opt);
  EXPECT_EQ(late.pending.ready != nullptr, on_cuda);
  if (on_cuda) {
    EXPECT_TRUE(late.pending.correct.is_pinned());
    EXPECT_TRUE(late.pending.loss_host.is_pinned());
  }
  EXPECT_TRUE(late.correct_per_pos.empty());
  late.loss.backward();
  late.finish();
  EXPECT_FALSE(late.pending.ready);
  EXPECT_EQ(late.loss_value, late.loss.item<double>());
  EXPECT_EQ(late.loss_value, eager.loss_value);
  EXPECT_EQ(late.correct_per_pos, eager.correct_per_pos);
  EXPECT_EQ(late.count_per_pos, eager.count_per_pos);
  EXPECT_EQ(late.tau_sum, eager.tau_sum);
  EXPECT_EQ(late.tau_inv_sum, eager.tau_inv_sum);
  EXPECT_EQ(late.tau_blocks, eager.tau_blocks);
  EXPECT_GT(late.tau_blocks, 0);
  for (auto& p : d.parameters()) p.mutable_grad().reset();

  d.load_param("layers.0.mlp.down_proj.weight",
               at::full(d.param("layers.0.mlp.down_proj.weight").sizes(), NAN));
  auto bad = d.forward(batch, opt);
  bad.loss.backward();
  bad.finish();
  EXPECT_TRUE(std::isnan(bad.loss_value));
  for (auto& p : d.parameters()) p.mutable_grad().reset();
}

TEST(DrafterGpu, DroppedRowsAreZeroWithoutNaN) {
  if (!have_cuda()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 1, N = 8, bs = 16, C = 64, d = 128;  // C + N*bs = 192: 128-padding + sink
  auto dev = test_device();
  attention::MaskSpec ms;
  ms.ctx_begin = at::zeros({B, N}, at::kLong);
  ms.ctx_end = at::tensor({0, 5, 9, 20, 33, 40, 50, 64}, at::kLong).view({B, N});
  ms.keep = at::tensor({1, 1, 0, 1, 0, 1, 1, 1}, at::kLong).to(at::kBool).view({B, N});
  ms.ctx_len = C;
  ms.block_size = bs;
  auto opt = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  auto q = at::randn({B, 4, N * bs, d}, opt).requires_grad_(true);
  auto k = at::randn({B, 2, C + N * bs, d}, opt).requires_grad_(true);
  auto v = at::randn({B, 2, C + N * bs, d}, opt).requires_grad_(true);
  for (const char* groups : {"0", "32"}) {
    setenv("DFLASH_SDPA_GROUP_QUERIES", groups, 1);
    auto p = attention::prepare(ms, attention::Backend::Reference, at::kBFloat16, dev);
    auto o = attention::attend(q, k, v, p);
    // fp32 dense reference on the CPU
    auto vis = attention::dense_bool_mask(ms).unsqueeze(1);  // [B,1,Q,KV]
    auto kf = k.detach().to(at::kFloat).cpu().repeat_interleave(2, 1), vf = v.detach().to(at::kFloat).cpu().repeat_interleave(2, 1);
    auto sc = at::matmul(q.detach().to(at::kFloat).cpu(), kf.transpose(2, 3)) / std::sqrt(128.0);
    sc = sc.masked_fill(vis.logical_not(), -INFINITY);
    auto any = vis.any(-1, true);
    auto pr = at::softmax(at::where(any, sc, at::zeros_like(sc)), -1) * vis;
    auto ref = at::matmul(pr, vf);
    EXPECT_LT(rel(o.to(at::kFloat), ref), 2e-2) << groups;
    auto dropped_rows = o.to(at::kFloat).cpu().view({B, 4, N, bs, d}).select(2, 2);
    EXPECT_EQ(dropped_rows.abs().max().item<float>(), 0.f) << groups;
    o.to(at::kFloat).pow(2).sum().backward();
    for (auto* t : {&q, &k, &v}) {
      EXPECT_FALSE(t->grad().isnan().any().item<bool>()) << groups;
      t->mutable_grad().reset();
    }
  }
  unsetenv("DFLASH_SDPA_GROUP_QUERIES");
}
