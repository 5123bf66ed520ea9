// TargetCache (trainer/model/target_cache.h) on the hybrid targets of target_qwen35.h (Gated
// DeltaNet + gated attention, dense and MoE), against the cache-free packed forward of the same
// model (itself checked against transformers in test_target_qwen35.py): prefill + extends of
// unequal sizes (across a 64-token chunk boundary) equal one packed forward of each full
// sequence; a crop inside the last extend (the recurrent state restored and the kept tokens
// replayed) followed by a re-extend equals the new sequence; a crop to before the last extend
// is refused. CPU fp32, tiny random models.
//
// Tolerance 1e-4 relative (kTol): float32 on both sides, but the delta rule is chunked at other
// boundaries (an extend starts its chunks at its first token, the reference at the document's),
// so exp(cumsum(g)) and the triangular solves round differently and the difference accumulates
// in the recurrent state over ~70 tokens: observed <= 2.4e-5 on logits (per-token errors
// ~1e-6, up to 5e-5 late in the long row); a leaked, lost or misplaced state changes logits by
// > 1e-2.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "core/error.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/target.h"
#include "trainer/model/target_cache.h"

using namespace dflash;
using namespace dflash::model;

namespace {

constexpr double kTol = 1e-4;

const char* kDense = R"({"model_type": "qwen3_5_text", "hidden_size": 32, "num_hidden_layers": 4,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
  "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "vocab_size": 97,
  "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}})";
const char* kMoe = R"({"model_type": "qwen3_5_moe_text", "hidden_size": 32, "num_hidden_layers": 2,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_experts": 4,
  "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
  "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
  "linear_value_head_dim": 8, "vocab_size": 97, "layer_types": ["linear_attention", "full_attention"]})";

TargetModel make(const char* json) {
  return TargetModel::random(parse_hf_config(json, "tiny"), at::kFloat, at::kCPU, 7, 0.1);
}

std::vector<int64_t> seq(int64_t n, int64_t seed) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i) v.push_back((seed * 31 + i * 17 + i * i) % 97);
  return v;
}

double rel(const at::Tensor& a, const at::Tensor& b) {
  return ((a.to(at::kDouble) - b.to(at::kDouble)).abs().max() / b.to(at::kDouble).abs().max()).item<double>();
}

TargetModel::Output full(const TargetModel& m, const std::vector<int64_t>& s) {
  return m.forward(at::tensor(s, at::kLong), at::tensor(std::vector<int64_t>{0, int64_t(s.size())}, at::kLong), {0, 1});
}

void extends_equal_forward(const TargetModel& m) {
  const std::vector<int64_t> plen = {70, 1, 5};
  const std::vector<std::vector<int64_t>> chunks = {{3, 1, 0}, {1, 66, 1}, {0, 2, 16}};
  std::vector<std::vector<int64_t>> rows, pre;
  for (size_t b = 0; b < 3; ++b) {
    int64_t n = plen[b];
    for (auto c : chunks[b]) n += c;
    rows.push_back(seq(n, int64_t(b) + 1));
    pre.emplace_back(rows[b].begin(), rows[b].begin() + plen[b]);
  }
  TargetCache cache(m, 3, 160, {0, 1});
  auto st = cache.prefill(pre, TargetCache::Logits::All);
  std::vector<at::Tensor> lg(3), cap(3);
  for (int64_t b = 0; b < 3; ++b) {
    lg[b] = st.logits.narrow(0, st.offsets[b], plen[b]);
    cap[b] = st.captured.narrow(0, st.offsets[b], plen[b]);
  }
  std::vector<int64_t> done = plen;
  for (size_t k = 0; k < 3; ++k) {
    std::vector<std::vector<int64_t>> step(3);
    for (int64_t b = 0; b < 3; ++b) step[b].assign(rows[b].begin() + done[b], rows[b].begin() + done[b] + chunks[b][k]);
    auto s = cache.extend(step);
    for (int64_t b = 0; b < 3; ++b) {
      const int64_t n = chunks[b][k];
      if (n == 0) continue;
      lg[b] = at::cat({lg[b], s.logits.narrow(0, s.offsets[b], n)});
      cap[b] = at::cat({cap[b], s.captured.narrow(0, s.offsets[b], n)});
      done[b] += n;
    }
  }
  for (int64_t b = 0; b < 3; ++b) {
    auto ref = full(m, rows[b]);
    EXPECT_LT(rel(lg[b], ref.logits), kTol) << "row " << b;
    EXPECT_LT(rel(cap[b], ref.captured), kTol) << "row " << b;
  }
}

void crop_and_reextend(const TargetModel& m) {
  TargetCache cache(m, 2, 64);
  auto a = seq(10, 5), b = seq(6, 6);
  cache.prefill({a, b});
  cache.extend({seq(8, 7), seq(3, 8)});
  cache.crop({12, 6});  // row 0 keeps 2 of its 8 new tokens, row 1 none of its 3
  EXPECT_EQ(cache.lengths(), (std::vector<int64_t>{12, 6}));
  auto s = cache.extend({seq(4, 9), seq(5, 10)});
  std::vector<int64_t> ra = a, rb = b;
  auto kept = seq(8, 7), na = seq(4, 9), nb = seq(5, 10);
  ra.insert(ra.end(), kept.begin(), kept.begin() + 2);
  ra.insert(ra.end(), na.begin(), na.end());
  rb.insert(rb.end(), nb.begin(), nb.end());
  EXPECT_LT(rel(s.logits.narrow(0, 0, 4), full(m, ra).logits.narrow(0, 12, 4)), kTol);
  EXPECT_LT(rel(s.logits.narrow(0, 4, 5), full(m, rb).logits.narrow(0, 6, 5)), kTol);
  // Before the last extend (row 0 now starts its last extend at 12): only 0 is allowed.
  EXPECT_THROW(cache.crop({11, 11}), UserError);
  cache.crop({0, 0});
  auto f = cache.prefill({a, b}, TargetCache::Logits::All);
  EXPECT_LT(rel(f.logits.narrow(0, 0, 10), full(m, a).logits), kTol);
}

}  // namespace

TEST(TargetCacheHybrid, ExtendsEqualThePackedForwardDense) { extends_equal_forward(make(kDense)); }
TEST(TargetCacheHybrid, ExtendsEqualThePackedForwardMoe) { extends_equal_forward(make(kMoe)); }
TEST(TargetCacheHybrid, CropReplaysTheKeptTokensDense) { crop_and_reextend(make(kDense)); }
TEST(TargetCacheHybrid, CropReplaysTheKeptTokensMoe) { crop_and_reextend(make(kMoe)); }
