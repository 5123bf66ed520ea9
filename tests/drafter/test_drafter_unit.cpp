// Unit tests of the drafter pieces that need no Python reference: the default target-layer rule
// and γ table (DFLASH.md §1.1, §2.4), the spec's validation messages, the anchor sampler's
// statistics, attention argument checks, and the chunked CE against the unfused one.
#include <cstdlib>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "attention/dflash_attention.h"
#include "core/error.h"
#include "trainer/config.h"
#include "trainer/model/anchors.h"
#include "core/files.h"
#include "trainer/model/drafter.h"
#include "trainer/model/export.h"
#include "trainer/model/target.h"
#include "trainer/model/loss.h"

using namespace dflash;
using namespace dflash::model;

namespace {

template <class F>
std::string user_error(F&& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

TargetInfo qwen3_8b() {
  HfConfig c;
  c.model_type = "qwen3", c.hidden_size = 4096, c.intermediate_size = 12288, c.num_hidden_layers = 36;
  c.num_attention_heads = 32, c.num_key_value_heads = 8, c.head_dim = 128, c.vocab_size = 151936;
  c.rope.theta = 1e6, c.max_position_embeddings = 40960, c.bos_token_id = 151643, c.eos_token_ids = {151645};
  TargetInfo t = target_info(c);
  t.mask_token_id = 151669;
  return t;
}

}  // namespace

TEST(DrafterSpec, DefaultTargetLayerIds) {
  EXPECT_EQ(default_layer_ids(36, 5), (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(default_layer_ids(32, 5), (std::vector<int64_t>{1, 8, 15, 22, 29}));
  EXPECT_EQ(default_layer_ids(64, 5), (std::vector<int64_t>{1, 16, 31, 46, 61}));
  EXPECT_EQ(default_layer_ids(48, 5), (std::vector<int64_t>{1, 12, 23, 34, 45}));
  EXPECT_EQ(default_layer_ids(36, 1), (std::vector<int64_t>{18}));
}

TEST(DrafterSpec, Gamma) {
  EXPECT_EQ(resolve_gamma(16, 0), 7.0);
  EXPECT_EQ(resolve_gamma(10, 0), 5.0);
  EXPECT_EQ(resolve_gamma(8, 0), 4.0);
  EXPECT_EQ(resolve_gamma(12, 3.5), 3.5);
  EXPECT_NE(user_error([] { resolve_gamma(12, 0); }).find("drafter.gamma"), std::string::npos);
  auto d = decay(16, 7.0);  // DFLASH.md §2.4 table: 1.000 0.867 0.751 ... 0.135
  EXPECT_NEAR(d[1].item<float>(), 1.0, 1e-6);
  EXPECT_NEAR(d[2].item<float>(), 0.867, 5e-4);
  EXPECT_NEAR(d[15].item<float>(), 0.135, 5e-4);
}

TEST(DrafterSpec, MakeSpecForQwen3_8B) {
  DrafterConfig cfg;
  auto s = make_spec(qwen3_8b(), cfg, {}, 5);
  EXPECT_EQ(s.target_layer_ids, (std::vector<int64_t>{1, 9, 17, 25, 33}));
  EXPECT_EQ(s.mask_token_id, 151669);
  EXPECT_EQ(s.num_target_layers, 36);
  int64_t n = 0;
  for (auto& [name, shape] : s.param_shapes()) {
    int64_t e = 1;
    for (auto x : shape) e *= x;
    n += e;
  }
  EXPECT_EQ(n, 1048626432);  // DFLASH.md §1: 5 x 192,946,432 + 83,886,080 + 8,192
}

TEST(DrafterSpec, BadConfigsNameTheField) {
  DrafterConfig cfg;
  auto t = qwen3_8b();
  EXPECT_NE(user_error([&] { make_spec(t, cfg, {1, 9, 36}, 3); }).find("target.layer_ids"), std::string::npos);
  cfg.mask_token_id = 151936;
  EXPECT_NE(user_error([&] { make_spec(t, cfg, {}, 5); }).find("drafter.mask_token_id"), std::string::npos);
  cfg.mask_token_id = -1;
  t.mask_token_id = -1;
  EXPECT_NE(user_error([&] { make_spec(t, cfg, {}, 5); }).find("drafter.mask_token_id"), std::string::npos);
  auto s = make_spec(qwen3_8b(), DrafterConfig{}, {}, 5);
  auto t2 = qwen3_8b();
  t2.config.hidden_size = 2560;
  EXPECT_NE(user_error([&] { s.check_fits(t2, "x"); }).find("hidden_size"), std::string::npos);
  s.num_kv_heads = 5;
  EXPECT_NE(user_error([&] { s.validate("x"); }).find("num_key_value_heads"), std::string::npos);
}

TEST(Anchors, SamplingIsUniformOverValidPositions) {
  // One document, valid positions 10..49 (m = 1 on 10..50); 4 anchors per draw, 4000 draws:
  // each position is drawn with probability 4/40 = 0.1; expected count 400, sd ~19.
  auto m = at::zeros({1, 64}, at::kLong);
  m.narrow(1, 10, 41).fill_(1);
  std::vector<int64_t> hits(64, 0);
  AnchorOptions o;
  o.num_anchors = 4;
  for (int64_t k = 0; k < 4000; ++k) {
    o.batch_index = k;
    auto b = sample_blocks(m, {}, o);
    ASSERT_EQ(b.num_blocks(), 4);
    for (int64_t j = 0; j < 4; ++j) {
      ++hits[b.anchor[0][j].item<int64_t>()];
      if (j) {
        ASSERT_LT(b.anchor[0][j - 1].item<int64_t>(), b.anchor[0][j].item<int64_t>());
      }
    }
  }
  for (int64_t p = 0; p < 64; ++p) {
    if (p < 10 || p > 49) EXPECT_EQ(hits[p], 0) << p;
    else EXPECT_NEAR(hits[p], 400, 100) << p;  // > 5 sd
  }
}

TEST(Anchors, BlockInputsFollowTheRules) {
  auto ids = at::arange(100, 130, at::kLong).view({1, 30});
  auto m = at::ones({1, 30}, at::kLong);
  m[0][5] = 0;
  std::vector<DocBounds> docs = {{0, 12, 30}};
  auto blocks = blocks_from_anchors(at::tensor({3, 13, 0}, at::kLong).view({1, 3}),
                                    at::tensor({1, 1, 0}, at::kLong).to(at::kBool).view({1, 3}), docs, 30, 4);
  auto in = build_block_inputs(ids, m, docs, blocks, 7);
  // block 0 (anchor 3, doc [0,12)): ids [103, 7, 7, 7], labels at 4,5,6 with m[5] = 0
  EXPECT_TRUE(at::equal(in.input_ids[0].narrow(0, 0, 4), at::tensor({103, 7, 7, 7}, at::kLong)));
  EXPECT_TRUE(at::equal(in.weight[0].narrow(0, 0, 4), at::tensor({0.f, 1.f, 0.f, 1.f})));
  EXPECT_TRUE(at::equal(in.labels[0].narrow(0, 0, 4), at::tensor({0, 104, 0, 106}, at::kLong)));
  // block 1 (anchor 13, doc [12,30)): positions restart: 1..4
  EXPECT_TRUE(at::equal(in.positions[0].narrow(0, 4, 4), at::tensor({1, 2, 3, 4}, at::kLong)));
  EXPECT_EQ(blocks.doc_begin[0][1].item<int64_t>(), 12);
  // dropped block: all MASK, no weight
  EXPECT_TRUE(at::equal(in.input_ids[0].narrow(0, 8, 4), at::full({4}, 7, at::kLong)));
  EXPECT_EQ(in.weight[0].narrow(0, 8, 4).sum().item<float>(), 0.f);
  EXPECT_EQ(in.ctx_positions[0][12].item<int64_t>(), 0);
  EXPECT_EQ(in.ctx_positions[0][29].item<int64_t>(), 17);
  EXPECT_NE(user_error([&] { blocks_from_anchors(at::tensor({30}, at::kLong).view({1, 1}),
                                                 at::tensor({1}, at::kLong).to(at::kBool).view({1, 1}), docs, 30, 4); })
                .find("anchor 30"),
            std::string::npos);
  EXPECT_NE(user_error([&] { normalize_docs({{0, 20, 15}}, 1, 30); }).find("strictly increasing"), std::string::npos);
}

TEST(Loss, FusedChunksEqualUnfused) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  auto h = at::randn({37, 16}, g, at::kFloat);
  auto w = at::randn({50, 16}, g, at::kFloat);
  auto lab = at::randint(0, 50, {37}, g, at::kLong);
  auto coef = at::rand({37}, g, at::kFloat);
  auto h1 = h.clone().requires_grad_(true), h2 = h.clone().requires_grad_(true), h3 = h.clone().requires_grad_(true);
  auto a = plain_linear_ce(h1, w, lab, coef);
  auto b = fused_linear_ce(h2, w, lab, coef, 5, CeMode::GradInForward);
  auto c = fused_linear_ce(h3, w, lab, coef, 8, CeMode::Recompute);
  a.loss.backward();
  b.loss.backward();
  (c.loss * 2).backward();  // the incoming gradient scales the result
  EXPECT_NEAR(a.loss.item<float>(), b.loss.item<float>(), 1e-5 * std::abs(a.loss.item<float>()));
  EXPECT_NEAR(a.loss.item<float>(), c.loss.item<float>(), 1e-5 * std::abs(a.loss.item<float>()));
  // fp32, different summation orders: relative differences ~1e-7 of the gradient's scale
  const double scale = h1.grad().abs().max().item<double>();
  EXPECT_LT((h1.grad() - h2.grad()).abs().max().item<double>(), 1e-5 * scale);
  EXPECT_LT((h1.grad() * 2 - h3.grad()).abs().max().item<double>(), 1e-5 * scale);
  EXPECT_TRUE(at::equal(a.correct, b.correct));
}

TEST(Attention, ArgumentErrorsNameTheField) {
  attention::MaskSpec ms;
  ms.ctx_begin = at::zeros({1, 2}, at::kLong);
  ms.ctx_end = at::tensor({3, 9}, at::kLong).view({1, 2});
  ms.keep = at::ones({1, 2}, at::kBool);
  ms.ctx_len = 8;
  ms.block_size = 4;
  EXPECT_NE(user_error([&] { attention::prepare(ms, attention::Backend::Reference, at::kFloat, at::kCPU); })
                .find("ctx_end"),
            std::string::npos);
  ms.ctx_end = at::tensor({3, 8}, at::kLong).view({1, 2});
  auto p = attention::prepare(ms, attention::Backend::Reference, at::kFloat, at::kCPU);
  auto q = at::randn({1, 2, 8, 4}), k = at::randn({1, 1, 15, 4});
  EXPECT_NE(user_error([&] { attention::attend(q, k, k, p); }).find("kv_len=16"), std::string::npos);
  if (!attention::kernel_available()) {
    EXPECT_NE(user_error([&] { attention::prepare(ms, attention::Backend::Kernel, at::kBFloat16, at::kCPU); })
                  .find("drafter.attention=sdpa"),
              std::string::npos);
  }
}

TEST(Export, MakeDrafterFromInitFromChecksTheConfig) {
  HfConfig c;
  c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 8, c.num_attention_heads = 4;
  c.num_key_value_heads = 2, c.head_dim = 8, c.vocab_size = 64, c.rope.theta = 1e6;
  TargetInfo t = target_info(c);
  t.mask_token_id = 63;
  DrafterConfig cfg;
  cfg.num_layers = 2;
  auto d = make_drafter(t, cfg, {1, 3, 5}, 3, 11, at::kCPU, at::kBFloat16);
  char tmpl[] = "/tmp/dflash_export_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/drafter";
  export_drafter(d, dir);
  cfg.init_from = dir;
  auto back = make_drafter(t, cfg, {}, 3, 0, at::kCPU, at::kBFloat16);
  for (auto& [n, p] : d.named_parameters()) EXPECT_TRUE(at::equal(p, back.param(n))) << n;  // bf16: exact
  cfg.block_size = 10;
  EXPECT_NE(user_error([&] { make_drafter(t, cfg, {}, 3, 0, at::kCPU, at::kFloat); }).find("drafter.block_size"),
            std::string::npos);
  cfg.block_size = 16;
  EXPECT_NE(user_error([&] { make_drafter(t, cfg, {1, 2, 5}, 3, 0, at::kCPU, at::kFloat); }).find("target.layer_ids"),
            std::string::npos);
  files::remove_tree(tmpl);
}

TEST(Drafter, InitIsDeterministicFromTheSeed) {
  DrafterSpec s;
  s.hidden_size = 32, s.intermediate_size = 48, s.num_layers = 1, s.num_heads = 4, s.num_kv_heads = 2;
  s.head_dim = 8, s.vocab_size = 64, s.num_target_layers = 8, s.target_layer_ids = {1, 3}, s.mask_token_id = 63;
  Drafter a(s, at::kCPU, at::kFloat), b(s, at::kCPU, at::kFloat), c(s, at::kCPU, at::kFloat);
  a.init_random(5), b.init_random(5), c.init_random(6);
  EXPECT_TRUE(at::equal(a.param("fc.weight"), b.param("fc.weight")));
  EXPECT_FALSE(at::equal(a.param("fc.weight"), c.param("fc.weight")));
  EXPECT_NEAR(a.param("layers.0.mlp.up_proj.weight").std().item<double>(), 0.02, 0.002);
  EXPECT_TRUE(at::equal(a.param("norm.weight"), at::ones({32})));
  EXPECT_TRUE(a.param("fc.weight").requires_grad());
}

// A float32 CPU drafter of hidden 32 (4 heads of 8, 2 kv heads), vocabulary 64, reading target
// layers 1 and 3, random weights from `seed` and random target embeddings / LM head.
static Drafter tiny_drafter(int64_t layers, uint64_t seed) {
  DrafterSpec s;
  s.hidden_size = 32, s.intermediate_size = 48, s.num_layers = layers, s.num_heads = 4, s.num_kv_heads = 2;
  s.head_dim = 8, s.vocab_size = 64, s.num_target_layers = 8, s.target_layer_ids = {1, 3}, s.mask_token_id = 63;
  Drafter d(s, at::kCPU, at::kFloat);
  d.init_random(seed);
  d.set_target_weights(at::randn({64, 32}), at::randn({64, 32}) * 0.3);
  return d;
}

// StepOptions::defer_metrics: forward returns before reading anything back; finish() then yields
// exactly what the eager forward reports, once (a second call changes nothing), and the loss's
// gradient is the same whether the metrics were read before or after the backward.
TEST(Drafter, DeferredMetricsEqualTheEagerOnes) {
  Drafter d = tiny_drafter(1, 3);
  DrafterBatch batch;
  batch.ids = at::randint(0, 60, {2, 96});
  batch.loss_mask = at::ones({2, 96}, at::kLong);
  batch.features = at::randn({2, 96, 2 * 32});
  StepOptions opt;
  opt.num_anchors = 6;
  opt.loss_chunk = 16;
  auto eager = d.forward(batch, opt);
  eager.loss.backward();
  auto g_eager = d.param("fc.weight").grad().clone();
  for (auto& p : d.parameters()) p.mutable_grad().reset();
  opt.defer_metrics = true;
  auto late = d.forward(batch, opt);
  EXPECT_TRUE(late.correct_per_pos.empty());  // nothing read yet
  late.loss.backward();
  late.finish();
  late.finish();
  EXPECT_EQ(late.loss_value, eager.loss_value);
  EXPECT_EQ(late.correct_per_pos, eager.correct_per_pos);
  EXPECT_EQ(late.count_per_pos, eager.count_per_pos);
  EXPECT_EQ(late.tau_sum, eager.tau_sum);
  EXPECT_EQ(late.tau_inv_sum, eager.tau_inv_sum);
  EXPECT_EQ(late.tau_blocks, eager.tau_blocks);
  EXPECT_GT(late.tau_blocks, 0);
  EXPECT_TRUE(at::equal(d.param("fc.weight").grad(), g_eager));
}

// Drafter::forward queues the context before it samples the blocks (the host prepares the step
// while the device computes fc + hidden_norm); the result is that of forward_blocks on the
// blocks sample_blocks draws from the same options, bit for bit, and hidden() with context(batch)
// is hidden() itself.
TEST(Drafter, ForwardEqualsForwardBlocksOfTheSampledBlocks) {
  Drafter d = tiny_drafter(2, 4);
  DrafterBatch batch;
  batch.ids = at::randint(0, 60, {2, 96});
  batch.loss_mask = at::ones({2, 96}, at::kLong);
  batch.loss_mask.narrow(1, 0, 10).zero_();
  batch.features = at::randn({2, 96, 2 * 32});
  batch.docs = {{0, 40, 96}, {}};
  batch.global_batch_index = 7;
  StepOptions opt;
  opt.num_anchors = 5;
  opt.seed = 11;
  opt.min_blocks = 12;
  opt.loss_chunk = 16;
  auto a = d.forward(batch, opt);
  a.loss.backward();
  std::vector<at::Tensor> ga;
  for (auto& p : d.parameters()) ga.push_back(p.grad().clone()), p.mutable_grad().reset();
  AnchorOptions ao;
  ao.block_size = d.spec().block_size, ao.num_anchors = opt.num_anchors, ao.seed = opt.seed;
  ao.batch_index = batch.global_batch_index, ao.min_blocks = opt.min_blocks;
  auto blocks = sample_blocks(batch.loss_mask, batch.docs, ao);
  EXPECT_EQ(blocks.num_blocks(), 12);
  auto b = d.forward_blocks(batch, blocks, opt);
  b.loss.backward();
  EXPECT_EQ(a.loss_value, b.loss_value);
  EXPECT_EQ(a.n_tokens, b.n_tokens);
  EXPECT_EQ(a.n_blocks, b.n_blocks);
  EXPECT_EQ(a.correct_per_pos, b.correct_per_pos);
  EXPECT_EQ(a.tau_sum, b.tau_sum);
  size_t i = 0;
  for (auto& p : d.parameters()) EXPECT_TRUE(at::equal(p.grad(), ga[i++]));

  at::NoGradGuard ng;
  auto in = build_block_inputs(batch.ids, batch.loss_mask, batch.docs, blocks, d.spec().mask_token_id);
  EXPECT_TRUE(at::equal(d.hidden(d.context(batch), batch, blocks, in, attention::Backend::Reference),
                        d.hidden(batch, blocks, in, attention::Backend::Reference)));
  EXPECT_THROW(d.hidden(d.context(batch).narrow(1, 0, 95), batch, blocks, in, attention::Backend::Reference),
               std::exception);
}
