// The recommended T : D split: the arithmetic of trainer/metrics/split.h on given rates, checked
// against values worked out by hand (min(T·s, D·d) over T + D = N; colocated 1/(1/s + 1/d)).
#include <gtest/gtest.h>

#include "core/json.h"
#include "trainer/metrics/split.h"

using namespace dflash;

TEST(Split, EightGpusWithMeasuredH200Rates) {
  // target 44.0K tok/s per rank, drafter 21.3K per rank (bench/RESULTS.md): T=3 gives
  // min(132K, 5 x 21.3K = 106.5K) = 106.5K; T=2 gives min(88K, 127.8K) = 88K; T=4 gives 85.2K.
  auto a = metrics::recommend_split(8, 44000, 21300);
  ASSERT_EQ(a.gpus, 8);
  EXPECT_EQ(a.best.target_ranks, 3);
  EXPECT_EQ(a.best.drafter_ranks, 5);
  EXPECT_DOUBLE_EQ(a.best.tok_s, 5 * 21300.0);
  EXPECT_STREQ(a.best.bound, "drafter");
  ASSERT_EQ(a.options.size(), 7u);
  EXPECT_DOUBLE_EQ(a.options[1].tok_s, 88000.0);  // T = 2
  EXPECT_STREQ(a.options[1].bound, "target");
  EXPECT_DOUBLE_EQ(a.options[3].tok_s, 4 * 21300.0);  // T = 4
  EXPECT_NEAR(a.colocated.tok_s, 1.0 / (1.0 / 44000 + 1.0 / 21300), 1e-9);
}

TEST(Split, TwoGpusAndBalance) {
  auto a = metrics::recommend_split(2, 10000, 10000);
  EXPECT_EQ(a.best.target_ranks, 1);
  EXPECT_EQ(a.best.drafter_ranks, 1);
  EXPECT_DOUBLE_EQ(a.best.tok_s, 10000.0);
  EXPECT_STREQ(a.best.bound, "balanced");
  EXPECT_DOUBLE_EQ(a.colocated.tok_s, 5000.0);
}

TEST(Split, FastDrafterWantsFewDrafters) {
  // targets slow (5K), drafters fast (30K): on 8 GPUs T=7 gives min(35K, 30K) = 30K, T=6 gives
  // min(30K, 60K) = 30K: a tie, broken towards more drafter ranks (T=6).
  auto a = metrics::recommend_split(8, 5000, 30000);
  EXPECT_EQ(a.best.target_ranks, 6);
  EXPECT_DOUBLE_EQ(a.best.tok_s, 30000.0);
}

TEST(Split, NoMeasurementsGiveEmptyAdvice) {
  EXPECT_EQ(metrics::recommend_split(8, 0, 100).gpus, 0);
  EXPECT_EQ(metrics::recommend_split(8, 100, -1).gpus, 0);
  EXPECT_EQ(metrics::recommend_split(0, 100, 100).gpus, 0);
  EXPECT_EQ(metrics::format_split(metrics::recommend_split(0, 1, 1)), "split: not enough measurements yet");
}

TEST(Split, OneGpuIsColocatedOnly) {
  auto a = metrics::recommend_split(1, 44000, 21300);
  EXPECT_TRUE(a.options.empty());
  EXPECT_EQ(a.best.target_ranks, 0);
  EXPECT_NE(metrics::format_split(a).find("colocated"), std::string::npos);
}

TEST(Split, JsonParsesBack) {
  auto a = metrics::recommend_split(8, 44000, 21300);
  json::Value v = json::parse(metrics::split_json(a), "split");
  EXPECT_EQ(v.find("gpus")->as_int("gpus"), 8);
  EXPECT_EQ(v.find("best")->find("target_ranks")->as_int("t"), 3);
  EXPECT_EQ(v.find("options")->as_array("o").size(), 7u);
}
