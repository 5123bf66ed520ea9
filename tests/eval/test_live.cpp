// The evaluation during training (trainer/eval/live.h) and the cache reuse it builds on
// (TargetCache::reset, DFlashProposer::reset), on a tiny random target, CPU fp32:
//   - a TargetCache and a draft cache reused over batches of other sizes decode token for token
//     what fresh caches decode (the reference: SpeculativeDecoder with its own caches, whose
//     output tests/eval/test_speculative.cpp checks against plain greedy decoding), allocate
//     only when a batch does not fit, and hold zeros past every row's length after a reset;
//   - LiveEval uses the target it is given (the same object and the same weight storage: no
//     second copy), allocates its caches once in the constructor (warm-up included), and two
//     evaluations with other weights reuse them (cache_allocations() stays 2) while giving
//     exactly what evaluate() gives with fresh caches and a drafter holding the same weights;
//   - the incremental form (begin / advance) gives exactly what run() gives;
//   - the evaluating rank's load options are the full model (all layers, LM head).
// ctest also runs this binary with MALLOC_PERTURB_=128 (junk in fresh heap memory).
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "trainer/config.h"
#include "trainer/eval/draft.h"
#include "trainer/eval/evaluate.h"
#include "trainer/eval/live.h"
#include "trainer/eval/speculative.h"
#include "trainer/model/drafter.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/target.h"
#include "trainer/model/target_cache.h"

using namespace dflash;
using namespace dflash::eval;

namespace {

constexpr int64_t V = 97;

model::HfConfig tiny_config() {
  return model::parse_hf_config(R"({"model_type": "qwen3", "hidden_size": 32,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 48, "vocab_size": 97, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "tie_word_embeddings": false})", "tiny");
}

const model::TargetModel& tiny() {
  static model::TargetModel m = model::TargetModel::random(tiny_config(), at::kFloat, at::kCPU, 11, 0.3);
  return m;
}

model::DrafterSpec spec() {
  model::DrafterSpec s;
  s.hidden_size = 32, s.intermediate_size = 64, s.num_layers = 2, s.num_heads = 4, s.num_kv_heads = 2;
  s.head_dim = 16, s.vocab_size = V, s.block_size = 8, s.target_layer_ids = {0, 2}, s.num_target_layers = 3;
  s.mask_token_id = V - 1, s.rope_theta = 10000.0;
  s.initializer_range = 0.2;
  return s;
}

std::vector<std::vector<int64_t>> prompts(std::initializer_list<int64_t> lens, int64_t salt) {
  std::vector<std::vector<int64_t>> p;
  for (int64_t n : lens) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < n; ++i) v.push_back((n * 13 + i * 7 + i * i * 3 + salt) % (V - 1));
    p.push_back(v);
  }
  return p;
}

std::vector<int64_t> iota(size_t n, int64_t from = 0) {
  std::vector<int64_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = from + int64_t(i);
  return v;
}

DecodeOptions options(int64_t bs, int64_t max_new) {
  DecodeOptions o;
  o.block_size = bs;
  o.max_new_tokens = max_new;
  return o;
}

std::string temp_dir() {
  char tmpl[] = "/tmp/test_live_XXXXXX";
  const char* d = mkdtemp(tmpl);
  EXPECT_NE(d, nullptr);
  return d ? d : "/tmp";
}

}  // namespace

TEST(CacheReuse, ReusedCachesDecodeWhatFreshOnesDo) {
  model::Drafter d(spec(), at::kCPU, at::kFloat);
  d.init_random(5);
  const int64_t bs = 8, M = 12;
  // Batches of other sizes and lengths, the largest first, then smaller, then one that does not
  // fit the capacity (longer prompts): it must allocate once more.
  const std::vector<std::vector<std::vector<int64_t>>> batches = {
      prompts({5, 1, 13, 9}, 0), prompts({10, 3}, 1), prompts({7, 2, 11}, 2), prompts({30, 6}, 3)};
  DFlashProposer shared(d, tiny());
  model::TargetCache cache(tiny(), 4, 13 + M + bs, shared.capture_ids());
  shared.reset(4, 13 + M + bs);
  EXPECT_EQ(cache.allocations(), 1);
  EXPECT_EQ(shared.allocations(), 1);
  int64_t first = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    const auto& p = batches[i];
    SpeculativeDecoder reused(cache, shared, p, iota(p.size(), first), options(bs, M));
    // Right after the reset (inside the constructor: prefill done), every slot past a row's
    // length is zero in both caches.
    for (int64_t l = 0; l < 3; ++l)
      for (int64_t b = 0; b < int64_t(p.size()); ++b)
        EXPECT_EQ(cache.keys(l)[b].narrow(0, cache.length(b), cache.capacity() - cache.length(b)).abs().max().item<float>(), 0.f)
            << "batch " << i << " layer " << l << " row " << b;
    for (int64_t l = 0; l < 2; ++l)
      for (int64_t b = 0; b < int64_t(p.size()); ++b)
        EXPECT_EQ(shared.keys(l)[b].narrow(0, shared.lengths()[b], cache.capacity() - shared.lengths()[b]).abs().max().item<float>(), 0.f)
            << "draft cache, batch " << i << " layer " << l << " row " << b;
    reused.run();
    DFlashProposer fresh_prop(d, tiny());
    SpeculativeDecoder fresh(tiny(), fresh_prop, p, iota(p.size(), first), options(bs, M));
    fresh.run();
    for (size_t b = 0; b < p.size(); ++b) {
      EXPECT_EQ(reused.results()[b].tokens, fresh.results()[b].tokens) << "batch " << i << " row " << b;
      EXPECT_EQ(reused.results()[b].accepted, fresh.results()[b].accepted) << "batch " << i << " row " << b;
    }
    first += int64_t(p.size());
    EXPECT_EQ(cache.allocations(), i < 3 ? 1 : 2) << "batch " << i;
    EXPECT_EQ(shared.allocations(), i < 3 ? 1 : 2) << "batch " << i;
  }
}

class Live : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = temp_dir();
    std::ofstream f(dir_ + "/prompts.jsonl");
    for (const auto& p : prompts({5, 1, 13, 9, 3}, 7)) {
      f << "{\"input_ids\": [";
      for (size_t i = 0; i < p.size(); ++i) f << (i ? ", " : "") << p[i];
      f << "]}\n";
    }
    cfg_.run.dir = dir_ + "/run";
    cfg_.target.model_dir = dir_;  // no generation_config.json: no extra stop ids
    cfg_.eval.prompts = dir_ + "/prompts.jsonl";
    cfg_.eval.every = 5;
    cfg_.eval.max_new_tokens = 10;
    cfg_.eval.batch_size = 2;  // 3 batches: 2 + 2 + 1
    cfg_.eval.stop_at_eos = false;
  }
  // Flat weights of a random drafter of `seed`.
  at::Tensor weights(uint64_t seed) {
    model::Drafter d(spec(), at::kCPU, at::kFloat);
    d.init_random(seed);
    return LiveEval::flatten(d);
  }
  // The reference: evaluate() with its own caches and a drafter loaded with the same weights.
  EvalReport reference(const at::Tensor& flat) {
    model::Drafter d(spec(), at::kCPU, at::kFloat);
    {
      at::NoGradGuard ng;
      int64_t off = 0;
      for (const auto& [n, t] : d.named_parameters()) {
        const_cast<at::Tensor&>(t).copy_(flat.narrow(0, off, t.numel()).view(t.sizes()));
        off += t.numel();
      }
    }
    DFlashProposer prop(d, tiny());
    PromptLimits lim;
    lim.vocab_size = V;
    std::vector<Prompt> ps = read_prompts(cfg_.eval.prompts, lim, 0);
    EvalSettings st = make_settings(cfg_, 8, {});
    st.baseline = false, st.progress = false;
    return evaluate(tiny(), prop, ps, st);
  }
  std::string dir_;
  Config cfg_;
};

TEST_F(Live, SharesTheTargetAndReusesItsCaches) {
  LiveEval live(cfg_, spec(), tiny());
  // One copy: the target it decodes with is the one it was given, and the draft side reads the
  // target's own embedding and LM head storage.
  EXPECT_EQ(&live.target(), &tiny());
  EXPECT_EQ(live.target().lm_head().data_ptr(), tiny().lm_head().data_ptr());
  EXPECT_EQ(live.cache_allocations(), 2) << "target + draft cache, allocated in the constructor";
  EXPECT_GE(live.warmup_s(), 0.0);
  for (uint64_t seed : {3, 4}) {
    const at::Tensor w = weights(seed);
    const LiveResult r = live.run(w, int64_t(seed) * 5);
    EXPECT_EQ(live.cache_allocations(), 2) << "evaluation with seed " << seed << " allocated caches";
    EvalReport ref = reference(w);
    EXPECT_EQ(r.step, int64_t(seed) * 5);
    EXPECT_DOUBLE_EQ(r.tau, ref.tau) << "seed " << seed;
    EXPECT_GT(r.wall_s, 0.0);
  }
}

TEST_F(Live, InPiecesEqualsWhole) {
  LiveEval a(cfg_, spec(), tiny()), b(cfg_, spec(), tiny());
  const at::Tensor w = weights(9);
  const LiveResult whole = a.run(w, 5);
  b.begin(w, 5);
  int64_t pieces = 0;
  while (b.busy()) b.advance(), ++pieces;
  // 3 batches: per batch a prefill, >= 1 step and the unit that closes the batch.
  EXPECT_GE(pieces, 3 * 2);
  EXPECT_EQ(b.result().step, 5);
  EXPECT_DOUBLE_EQ(b.result().tau, whole.tau);
  EXPECT_DOUBLE_EQ(b.advance(), 0.0) << "not busy: nothing to do";
  EXPECT_EQ(b.cache_allocations(), 2);
}

TEST(LiveLoad, TargetLoadOptionsWidenToTheFullModel) {
  // Training alone loads up to the last captured layer without the LM head; the evaluating rank
  // widens that to the whole model, the one copy training and evaluation share.
  model::TargetLoadOptions lo;
  lo.num_layers = 2;
  lo.lm_head = false;
  const model::TargetLoadOptions full = LiveEval::target_load_options(lo);
  EXPECT_EQ(full.num_layers, -1);
  EXPECT_TRUE(full.lm_head);
}
