// The speculative decoding loop (trainer/eval/speculative.h) on a tiny random target, CPU fp32:
//   - output token for token equal to the target's own greedy decoding (model/target_cache.h's
//     greedy_generate, itself checked against transformers in tests/model/test_target.py), for
//     a batch of prompts of unequal lengths and block sizes 16 and 10, with the real DFlash
//     proposer (a random drafter) and with oracle proposers;
//   - the acceptance rule, honestly: the oracle proposers know the target's own continuation
//     (computed beforehand by plain decoding, never by the loop under test) and propose it
//     correctly for exactly k tokens of each block, then a token that differs from it. The
//     loop must then accept exactly k per step: tau = k + 1 exactly (k = bs - 1: always agree,
//     tau = bs; k = 0: never agree, tau = 1), with the same output;
//   - temperature > 0: the seeded target-only rule makes speculative output equal plain
//     sampling output, and an oracle of the sampled continuation is accepted in full;
//   - the draft cache holds only context K/V after every step: per row exactly the committed
//     positions below the block start, equal to the keys of one fresh add_context over the
//     target's features of the committed sequence, and zeros past it;
//   - the fixed-shape loop (speculative_fixed.h) equals this one row for row (FixedDecoder).
// ctest also runs this binary with MALLOC_PERTURB_=128 (junk in fresh heap memory).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "core/error.h"
#include "trainer/eval/draft.h"
#include "trainer/eval/speculative.h"
#include "trainer/eval/speculative_fixed.h"
#include "trainer/model/drafter.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/target.h"
#include "trainer/model/target_cache.h"

using namespace dflash;
using namespace dflash::eval;

namespace {

constexpr int64_t V = 97;

const model::TargetModel& tiny() {
  static model::TargetModel m = [] {
    model::HfConfig c = model::parse_hf_config(R"({"model_type": "qwen3", "hidden_size": 32,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
      "intermediate_size": 48, "vocab_size": 97, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
      "rope_theta": 10000.0, "tie_word_embeddings": false})", "tiny");
    return model::TargetModel::random(c, at::kFloat, at::kCPU, 11, 0.3);
  }();
  return m;
}

model::Drafter& drafter() {
  static model::Drafter d = [] {
    model::DrafterSpec s;
    s.hidden_size = 32, s.intermediate_size = 64, s.num_layers = 2, s.num_heads = 4, s.num_kv_heads = 2;
    s.head_dim = 16, s.vocab_size = V, s.block_size = 16, s.target_layer_ids = {0, 2}, s.num_target_layers = 3;
    s.mask_token_id = V - 1, s.rope_theta = 10000.0;
    s.initializer_range = 0.2;
    model::Drafter dr(s, at::kCPU, at::kFloat);
    dr.init_random(5);
    return dr;
  }();
  return d;
}

std::vector<std::vector<int64_t>> prompts() {
  std::vector<std::vector<int64_t>> p;
  for (int64_t n : {5, 1, 23, 9, 14}) {
    std::vector<int64_t> v;
    for (int64_t i = 0; i < n; ++i) v.push_back((n * 13 + i * 7 + i * i * 3) % (V - 1));
    p.push_back(v);
  }
  return p;
}

std::vector<int64_t> iota(size_t n) {
  std::vector<int64_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = int64_t(i);
  return v;
}

// Proposes the known continuation `cont[b]` (tokens after prompt b) correctly for `k` tokens,
// then a token that differs from the continuation.
class Oracle : public DraftProposer {
 public:
  Oracle(std::vector<std::vector<int64_t>> prompts, std::vector<std::vector<int64_t>> cont, int64_t k, int64_t bs)
      : prompts_(std::move(prompts)), cont_(std::move(cont)), k_(k), bs_(bs) {}
  void reset(int64_t, int64_t) override {}
  void add_context(const at::Tensor&, const std::vector<int64_t>&) override {}
  std::vector<int64_t> capture_ids() const override { return {}; }
  int64_t max_block_size() const override { return bs_; }
  std::vector<std::vector<int64_t>> propose(const std::vector<int64_t>& rows, const std::vector<int64_t>&,
                                            const std::vector<int64_t>& start, int64_t bs) override {
    std::vector<std::vector<int64_t>> out;
    for (size_t j = 0; j < rows.size(); ++j) {
      const auto& c = cont_[rows[j]];
      const int64_t P = int64_t(prompts_[rows[j]].size());
      std::vector<int64_t> d;
      for (int64_t i = 1; i < bs; ++i) {
        const int64_t idx = start[j] + i - P;  // index into the continuation of position start + i
        EXPECT_LT(idx, int64_t(c.size())) << "oracle continuation too short";
        const int64_t truth = idx < int64_t(c.size()) ? c[idx] : 0;
        d.push_back(i <= k_ ? truth : (truth + 1) % V);
      }
      out.push_back(d);
    }
    return out;
  }

 private:
  std::vector<std::vector<int64_t>> prompts_, cont_;
  int64_t k_, bs_;
};

DecodeOptions options(int64_t bs, int64_t max_new, double temperature = 0) {
  DecodeOptions o;
  o.block_size = bs;
  o.max_new_tokens = max_new;
  o.temperature = temperature;
  o.seed = 1234;
  return o;
}

}  // namespace

class EqualsGreedy : public ::testing::TestWithParam<int64_t> {};

TEST_P(EqualsGreedy, DFlashProposer) {
  const int64_t bs = GetParam(), M = 40;
  auto p = prompts();
  auto greedy = model::greedy_generate(tiny(), p, M, {});
  DFlashProposer prop(drafter(), tiny());
  SpeculativeDecoder dec(tiny(), prop, p, iota(p.size()), options(bs, M));
  dec.run();
  for (size_t b = 0; b < p.size(); ++b) {
    EXPECT_EQ(dec.results()[b].tokens, greedy[b]) << "prompt " << b;
    for (auto a : dec.results()[b].accepted) EXPECT_TRUE(a >= 0 && a < bs);
  }
}

TEST_P(EqualsGreedy, OracleAgreeingForExactlyKTokens) {
  const int64_t bs = GetParam(), M = 37;
  auto p = prompts();
  // The continuation the oracle knows: plain decoding, long enough for the last block.
  auto cont = model::greedy_generate(tiny(), p, M + bs, {});
  for (int64_t k : {bs - 1, int64_t(0), int64_t(3)}) {
    Oracle oracle(p, cont, k, bs);
    SpeculativeDecoder dec(tiny(), oracle, p, iota(p.size()), options(bs, M));
    dec.run();
    for (size_t b = 0; b < p.size(); ++b) {
      const auto& r = dec.results()[b];
      EXPECT_EQ(r.tokens, std::vector<int64_t>(cont[b].begin(), cont[b].begin() + M)) << "k " << k << " prompt " << b;
      for (auto a : r.accepted) EXPECT_EQ(a, k) << "k " << k << " prompt " << b;
      EXPECT_DOUBLE_EQ(r.tau(), double(k + 1));
      // The first token comes from the prefill, each step commits k + 1.
      EXPECT_EQ(int64_t(r.accepted.size()), (M - 1 + k) / (k + 1)) << "k " << k;
      EXPECT_EQ(r.target_forwards, 1 + int64_t(r.accepted.size()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, EqualsGreedy, ::testing::Values(16, 10));

TEST(Speculative, StopTokensEndARow) {
  auto p = prompts();
  auto greedy = model::greedy_generate(tiny(), p, 30, {});
  const int64_t stop = greedy[2][6];  // row 2 must end at its first occurrence of this token
  auto ref = model::greedy_generate(tiny(), p, 30, {stop});
  DFlashProposer prop(drafter(), tiny());
  auto o = options(10, 30);
  o.stop_ids = {stop};
  SpeculativeDecoder dec(tiny(), prop, p, iota(p.size()), o);
  dec.run();
  for (size_t b = 0; b < p.size(); ++b) EXPECT_EQ(dec.results()[b].tokens, ref[b]) << "prompt " << b;
  EXPECT_LE(dec.results()[2].tokens.size(), 7u);
}

TEST(Speculative, SamplingEqualsPlainSampling) {
  const int64_t M = 33;
  auto p = prompts();
  auto plain = plain_decode(tiny(), p, iota(p.size()), options(1, M, 0.8));
  auto greedy = model::greedy_generate(tiny(), p, M, {});
  EXPECT_NE(plain[1].tokens, greedy[1]);  // sampling is not greedy
  DFlashProposer prop(drafter(), tiny());
  SpeculativeDecoder dec(tiny(), prop, p, iota(p.size()), options(16, M, 0.8));
  dec.run();
  for (size_t b = 0; b < p.size(); ++b) EXPECT_EQ(dec.results()[b].tokens, plain[b].tokens) << "prompt " << b;
  // An oracle of the sampled continuation is accepted in full.
  auto longer = plain_decode(tiny(), p, iota(p.size()), options(1, M + 16, 0.8));
  std::vector<std::vector<int64_t>> cont;
  for (auto& r : longer) cont.push_back(r.tokens);
  Oracle oracle(p, cont, 15, 16);
  SpeculativeDecoder od(tiny(), oracle, p, iota(p.size()), options(16, M, 0.8));
  od.run();
  for (size_t b = 0; b < p.size(); ++b) {
    EXPECT_EQ(od.results()[b].tokens, plain[b].tokens);
    EXPECT_DOUBLE_EQ(od.results()[b].tau(), 16.0);
  }
  // Another seed, another output; a prompt's tokens do not depend on its batch slot.
  auto o2 = options(1, M, 0.8);
  o2.seed = 99;
  EXPECT_NE(plain_decode(tiny(), p, iota(p.size()), o2)[1].tokens, plain[1].tokens);
  auto alone = plain_decode(tiny(), {p[3]}, {3}, options(1, M, 0.8));
  EXPECT_EQ(alone[0].tokens, plain[3].tokens);
}

TEST(Speculative, SamplerFollowsTheDistribution) {
  // 4000 draws of one row at distinct positions: empirical frequencies within 5 sigma.
  at::Tensor logits = at::tensor({0.0f, 1.0f, 2.0f, -1.0f}).view({1, 4});
  at::Tensor prob = at::softmax(logits / 0.5, -1)[0];
  std::vector<int64_t> count(4, 0);
  const int64_t n = 4000;
  for (int64_t i = 0; i < n; ++i) count[choose_tokens(logits, {0}, {i}, 0.5, 7)[0]]++;
  for (int64_t v = 0; v < 4; ++v) {
    const double p = prob[v].item<double>(), sd = std::sqrt(p * (1 - p) / double(n));
    EXPECT_NEAR(double(count[v]) / double(n), p, 5 * sd + 1e-9) << "token " << v;
  }
  EXPECT_EQ(choose_tokens(logits, {0}, {0}, 0.0, 7)[0], 2);
}

TEST(Speculative, DraftCacheHoldsOnlyContext) {
  const int64_t bs = 10, M = 40;
  auto p = prompts();
  DFlashProposer prop(drafter(), tiny());
  SpeculativeDecoder dec(tiny(), prop, p, iota(p.size()), options(bs, M));
  const std::vector<int64_t> layers = drafter().spec().target_layer_ids;
  int64_t steps = 0;
  do {
    ++steps;
    for (size_t b = 0; b < p.size(); ++b) {
      if (dec.done(int64_t(b))) continue;
      const int64_t start = dec.start(int64_t(b));
      ASSERT_EQ(prop.lengths()[b], start) << "row " << b << " step " << steps;
      ASSERT_EQ(dec.target_cache().length(int64_t(b)), start);
      // The committed sequence below the block start: prompt + all new tokens but the last.
      std::vector<int64_t> seq = p[b];
      const auto& t = dec.results()[b].tokens;
      seq.insert(seq.end(), t.begin(), t.end() - 1);
      ASSERT_EQ(int64_t(seq.size()), start);
      auto feats = tiny().forward(at::tensor(seq, at::kLong), at::tensor(std::vector<int64_t>{0, start}, at::kLong),
                                  layers).captured;
      DFlashProposer fresh(drafter(), tiny());
      fresh.reset(1, start + 1);
      fresh.add_context(feats, {0, start});
      for (int64_t l = 0; l < drafter().spec().num_layers; ++l) {
        at::Tensor k = prop.keys(l)[int64_t(b)], v = prop.values(l)[int64_t(b)];
        EXPECT_TRUE(at::allclose(k.narrow(0, 0, start), fresh.keys(l)[0].narrow(0, 0, start), 1e-4, 1e-5))
            << "row " << b << " layer " << l << " step " << steps;
        EXPECT_TRUE(at::allclose(v.narrow(0, 0, start), fresh.values(l)[0].narrow(0, 0, start), 1e-4, 1e-5));
        EXPECT_EQ(k.narrow(0, start, k.size(0) - start).abs().max().item<float>(), 0.f) << "block K/V left behind";
        EXPECT_EQ(v.narrow(0, start, v.size(0) - start).abs().max().item<float>(), 0.f);
      }
    }
  } while (dec.step());
  EXPECT_GT(steps, 4);
}

// DFlashProposer::propose for a subset of rows pads it with idle rows to a power of two (3 of 6
// -> 4 drafted, 5 -> all 6, 2 -> 2, 1 -> 1): each requested row's drafts equal those of a
// proposer holding that row alone, whatever the idle rows hold.
TEST(Speculative, ProposeForSomeRowsEqualsEachRowAlone) {
  const int64_t bs = 10, R = 6;
  const std::vector<int64_t> layers = drafter().spec().target_layer_ids;
  const std::vector<int64_t> lens = {5, 17, 1, 9, 30, 12};
  std::vector<at::Tensor> feats;
  for (int64_t b = 0; b < R; ++b) {
    std::vector<int64_t> seq;
    for (int64_t i = 0; i < lens[b]; ++i) seq.push_back((b * 31 + i * 7 + i * i) % (V - 1));
    feats.push_back(tiny().forward(at::tensor(seq, at::kLong), at::tensor(std::vector<int64_t>{0, lens[b]}, at::kLong),
                                   layers).captured);
  }
  DFlashProposer all(drafter(), tiny());
  all.reset(R, 48);
  std::vector<int64_t> off = {0};
  for (int64_t b = 0; b < R; ++b) off.push_back(off.back() + lens[b]);
  all.add_context(at::cat(feats), off);
  std::vector<std::vector<int64_t>> alone(R);
  for (int64_t b = 0; b < R; ++b) {
    DFlashProposer one(drafter(), tiny());
    one.reset(1, 48);
    one.add_context(feats[b], {0, lens[b]});
    alone[b] = one.propose({0}, {(b * 5 + 3) % V}, {lens[b]}, bs)[0];
  }
  for (const std::vector<int64_t>& rows : {std::vector<int64_t>{0, 2, 5}, std::vector<int64_t>{4, 0, 1, 2, 3},
                                           std::vector<int64_t>{3, 4}, std::vector<int64_t>{1}}) {
    std::vector<int64_t> last, start;
    for (int64_t b : rows) last.push_back((b * 5 + 3) % V), start.push_back(lens[b]);
    auto got = all.propose(rows, last, start, bs);
    ASSERT_EQ(got.size(), rows.size());
    for (size_t j = 0; j < rows.size(); ++j) EXPECT_EQ(got[j], alone[rows[j]]) << "row " << rows[j] << " of " << rows.size();
  }
}

TEST(Speculative, BadOptions) {
  auto p = prompts();
  DFlashProposer prop(drafter(), tiny());
  EXPECT_THROW(SpeculativeDecoder(tiny(), prop, p, iota(p.size()), options(17, 8)), UserError);  // > drafter's 16
  EXPECT_THROW(SpeculativeDecoder(tiny(), prop, p, iota(p.size()), options(1, 8)), UserError);
  EXPECT_THROW(SpeculativeDecoder(tiny(), prop, {{}}, {0}, options(8, 8)), UserError);  // empty prompt
  EXPECT_THROW(SpeculativeDecoder(tiny(), prop, {{V}}, {0}, options(8, 8)), UserError);  // outside the vocab
}

// The fixed-shape loop (speculative_fixed.h) against SpeculativeDecoder with the same DFlash
// proposer: the same tokens and accepted drafts per row, for block sizes 16 and 10 and short
// limits, and with stop tokens taken from the rows' own outputs (so rows end at different steps,
// some inside a step's commit). The acceptance itself is checked end to end with a trained
// drafter in tests/eval/test_eval.py; here the random drafter mostly accepts nothing.
TEST(FixedDecoder, EqualsSpeculativeDecoder) {
  auto p = prompts();
  DFlashProposer prop(drafter(), tiny());
  for (int64_t bs : {16, 10}) {
    for (int64_t max_new : {1, 3, 40}) {
      for (bool stops : {false, true}) {
        DecodeOptions o = options(bs, max_new);
        if (stops) {
          SpeculativeDecoder free_run(tiny(), prop, p, iota(p.size()), options(bs, max_new));
          free_run.run();
          for (const auto& r : free_run.results())  // a token from the middle of each row's output
            if (r.tokens.size() > 2) o.stop_ids.push_back(r.tokens[r.tokens.size() / 2]);
        }
        SpeculativeDecoder ref(tiny(), prop, p, iota(p.size()), o);
        ref.run();
        FixedSpeculativeDecoder fixed(tiny(), prop, p, o);
        fixed.run();
        for (size_t b = 0; b < p.size(); ++b) {
          EXPECT_EQ(fixed.results()[b].tokens, ref.results()[b].tokens) << "bs " << bs << " max_new " << max_new << " row " << b;
          EXPECT_EQ(fixed.results()[b].accepted, ref.results()[b].accepted) << "bs " << bs << " row " << b;
          EXPECT_EQ(fixed.results()[b].target_forwards, ref.results()[b].target_forwards) << "row " << b;
        }
      }
    }
  }
}

TEST(FixedDecoder, BadOptions) {
  auto p = prompts();
  DFlashProposer prop(drafter(), tiny());
  EXPECT_THROW(FixedSpeculativeDecoder(tiny(), prop, p, options(8, 8, 0.7)), UserError);  // greedy only
  EXPECT_THROW(FixedSpeculativeDecoder(tiny(), prop, p, options(17, 8)), UserError);     // > drafter's 16
  EXPECT_THROW(FixedSpeculativeDecoder(tiny(), prop, {{}}, options(8, 8)), UserError);   // empty prompt
  EXPECT_THROW(FixedSpeculativeDecoder(tiny(), prop, {{V}}, options(8, 8)).run(), UserError);  // outside the vocab
  EXPECT_FALSE(FixedSpeculativeDecoder::supports(tiny(), options(8, 8, 0.5)));
  EXPECT_TRUE(FixedSpeculativeDecoder::supports(tiny(), options(8, 8)));
}
