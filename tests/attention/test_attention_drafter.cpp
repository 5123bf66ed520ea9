// GPU test: one full drafter training step (trainer/model/drafter.h: forward, loss, backward)
// with the block-sparse kernel matches the reference attention path.
//
// Shapes: the real drafter's attention geometry (head dim 128, 4 query heads per KV head, block
// 16, anchors sampled by the drafter itself, one row with two packed documents) in a small model
// (hidden 1024, 2 layers, vocab 2048, 2 x 640 tokens) so the test runs in seconds.
// Tolerance: three runs on identical (bf16-representable) weights and inputs: fp32 + reference
// attention (the yardstick), bf16 + reference attention, bf16 + kernel. For the loss and for the
// gradient of every parameter, the kernel run's error against fp32 must be at most 2x the bf16
// reference run's error plus a floor (loss: 1e-4 relative; gradients: 1e-3 relative Frobenius,
// far below the O(1) errors a wrong mask or index gives on the attention projections). Both bf16
// runs round every other op identically, so their errors are of one size; no NaN anywhere.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "attention/dflash_attention.h"
#include "trainer/model/drafter.h"

namespace dflash::model {
namespace {

[[maybe_unused]] DrafterSpec tiny_spec() {
  DrafterSpec s;
  s.hidden_size = 1024;
  s.intermediate_size = 2048;
  s.num_layers = 2;
  s.num_heads = 8;
  s.num_kv_heads = 2;
  s.head_dim = 128;
  s.vocab_size = 2048;
  s.block_size = 16;
  s.target_layer_ids = {1, 3};
  s.num_target_layers = 6;
  s.mask_token_id = 2047;
  return s;
}

struct StepResult {
  double loss = 0;
  std::vector<std::pair<std::string, at::Tensor>> grads;  // fp32 copies
};

[[maybe_unused]] StepResult step(Drafter& d, const DrafterBatch& batch, attention::Backend backend) {
  StepOptions opt;
  opt.attention = backend;
  opt.num_anchors = 24;
  opt.seed = 11;
  opt.loss_chunk = 512;
  StepOutput out = d.forward(batch, opt);
  out.loss.backward();
  StepResult r;
  r.loss = out.loss.item<double>();
  for (const auto& [name, p] : d.named_parameters()) {
    EXPECT_TRUE(p.grad().defined()) << name;
    r.grads.emplace_back(name, p.grad().detach().to(at::kFloat));
  }
  return r;
}

TEST(KernelInDrafter, FullStepMatchesReferencePath) {
#if DFLASH_ATTENTION_KERNEL
  if (!at::hasCUDA() || !attention::kernel_available()) GTEST_SKIP() << "no CUDA device or kernel not built";
  const at::Device dev(at::kCUDA, 0);
  const DrafterSpec spec = tiny_spec();
  at::manual_seed(3);
  const int64_t B = 2, S = 640, V = spec.vocab_size, H = spec.hidden_size;

  // Weights: drawn once, rounded to bf16, loaded into all three drafters.
  Drafter ref32(spec, dev, at::kFloat), ref16(spec, dev, at::kBFloat16), ker16(spec, dev, at::kBFloat16);
  ref16.init_random(5);
  for (const auto& [name, p] : ref16.named_parameters()) {
    ref32.load_param(name, p.detach().to(at::kFloat));
    ker16.load_param(name, p.detach());
  }
  auto embed = (at::randn({V, H}) * 0.02).to(at::kBFloat16).to(at::kFloat);
  auto head = (at::randn({V, H}) * 0.02).to(at::kBFloat16).to(at::kFloat);
  for (Drafter* d : {&ref32, &ref16, &ker16}) d->set_target_weights(embed, head);

  DrafterBatch batch;
  batch.ids = at::randint(0, V - 1, {B, S}, at::kLong);
  batch.loss_mask = at::ones({B, S}, at::kLong);
  batch.loss_mask.narrow(1, 0, 40).zero_();  // a prompt
  batch.features = at::randn({B, S, spec.num_features() * H}).to(at::kBFloat16).to(at::kFloat);
  batch.docs = {{}, {0, 300, S}};  // row 1 packs two documents (ctx_begin > 0 for its 2nd)

  const StepResult r32 = step(ref32, batch, attention::Backend::Reference);
  const StepResult r16 = step(ref16, batch, attention::Backend::Reference);
  const StepResult k16 = step(ker16, batch, attention::Backend::Kernel);

  ASSERT_TRUE(std::isfinite(k16.loss)) << "kernel loss " << k16.loss;
  const double el_ref = std::abs(r16.loss - r32.loss), el_ker = std::abs(k16.loss - r32.loss);
  std::printf("loss: fp32 %.6f, bf16 reference %.6f (err %.2e), bf16 kernel %.6f (err %.2e)\n", r32.loss,
              r16.loss, el_ref, k16.loss, el_ker);
  EXPECT_LE(el_ker, 2 * el_ref + 1e-4 * std::abs(r32.loss));

  for (size_t i = 0; i < r32.grads.size(); ++i) {
    const auto& name = r32.grads[i].first;
    const at::Tensor& g32 = r32.grads[i].second;
    const double n = g32.norm().item<double>();
    const double er = (r16.grads[i].second - g32).norm().item<double>() / (n > 0 ? n : 1);
    const double ek = (k16.grads[i].second - g32).norm().item<double>() / (n > 0 ? n : 1);
    ASSERT_FALSE(k16.grads[i].second.isnan().any().item<bool>()) << name;
    std::printf("grad %-36s rel err: bf16 reference %.2e, bf16 kernel %.2e\n", name.c_str(), er, ek);
    EXPECT_LE(ek, 2 * er + 1e-3) << name;
  }
#else
  GTEST_SKIP() << "kernel not built";
#endif
}

}  // namespace
}  // namespace dflash::model
