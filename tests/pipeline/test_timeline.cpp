// Time measurement of the metrics (trainer/metrics/timeline.h) and the new metrics.jsonl fields:
// a CPU Timeline measures what the host clock around a sleep measures; marks are read in any
// order and dropped; the process age agrees with the steady clock across a sleep; the time to
// first step and the split fields are null until known and parse back to their values.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "core/error.h"
#include "core/json.h"
#include "trainer/metrics/metrics.h"
#include "trainer/metrics/timeline.h"

using namespace dflash;

namespace {
double steady() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }
}  // namespace

TEST(Timeline, CpuMarksMeasureWhatTheClockMeasures) {
  metrics::Timeline tl(c10::Device(c10::kCPU));
  EXPECT_EQ(tl.last(), -1);
  const double h0 = steady();
  const int64_t a = tl.mark();
  sleep_s(0.05);
  const int64_t b = tl.mark();
  sleep_s(0.02);
  const int64_t c = tl.mark();
  const double h1 = steady();
  EXPECT_EQ(a, 0);
  EXPECT_EQ(c, 2);
  EXPECT_EQ(tl.last(), 2);
  // the marks lie inside [h0, h1]; sleeps last at least as long as asked
  EXPECT_GE(tl.seconds(a, b), 0.05);
  EXPECT_GE(tl.seconds(b, c), 0.02);
  EXPECT_LE(tl.seconds(a, c), h1 - h0);
  EXPECT_DOUBLE_EQ(tl.seconds(a, b) + tl.seconds(b, c), tl.seconds(a, c));
  EXPECT_EQ(tl.seconds(b, b), 0.0);
  EXPECT_THROW(tl.seconds(c, a), std::exception);  // reversed
  tl.drop_before(b);
  EXPECT_THROW(tl.seconds(a, c), std::exception);  // dropped
  EXPECT_GE(tl.seconds(b, c), 0.02);
}

TEST(Timeline, ProcessAgeFollowsTheSteadyClock) {
  const double a = metrics::process_age_s();
  ASSERT_GT(a, 0.0);
  ASSERT_LT(a, 3600.0);  // this test binary started within the hour
  const double h0 = steady();
  sleep_s(0.2);
  const double b = metrics::process_age_s(), h = steady() - h0;
  // /proc/uptime has 10 ms resolution, the start time one clock tick (10 ms): 30 ms of slack
  EXPECT_NEAR(b - a, h, 0.03);
}

TEST(Timeline, FirstStepAndSplitFieldsInTheRecord) {
  metrics::StepMetrics m;
  json::Value v = json::parse(metrics::to_json(m), "metrics");
  for (const char* k : {"startup_s", "load_s", "first_step_s", "first_wait_s", "split"})
    EXPECT_TRUE(v.find(k)->is_null()) << k;
  EXPECT_NE(metrics::format_first_step(m).find("start-up ?"), std::string::npos);
  m.startup_s = 1.25, m.load_s = 2.5, m.first_step_s = 0.75, m.first_wait_s = 0.5;
  m.target_busy_s = 0.2, m.drafter_busy_s = 0.4, m.interval_s = 4.5;
  m.split = metrics::recommend_split(8, 44000, 21300);
  v = json::parse(metrics::to_json(m), "metrics");
  EXPECT_DOUBLE_EQ(v.find("startup_s")->as_double("s"), 1.25);
  EXPECT_DOUBLE_EQ(v.find("load_s")->as_double("s"), 2.5);
  EXPECT_DOUBLE_EQ(v.find("first_step_s")->as_double("s"), 0.75);
  EXPECT_DOUBLE_EQ(v.find("first_wait_s")->as_double("s"), 0.5);
  EXPECT_DOUBLE_EQ(v.find("interval_s")->as_double("s"), 4.5);
  EXPECT_DOUBLE_EQ(v.find("target_busy_s")->as_double("s"), 0.2);
  EXPECT_DOUBLE_EQ(v.find("drafter_busy_s")->as_double("s"), 0.4);
  const json::Value* sp = v.find("split");
  EXPECT_EQ(sp->find("gpus")->as_int("g"), 8);
  EXPECT_EQ(sp->find("target_ranks")->as_int("t"), 3);
  EXPECT_EQ(sp->find("drafter_ranks")->as_int("d"), 5);
  EXPECT_DOUBLE_EQ(sp->find("tok_s")->as_double("x"), 106500.0);
  EXPECT_NEAR(sp->find("colocated_tok_s")->as_double("x"), 1.0 / (1.0 / 44000 + 1.0 / 21300), 1e-3);
  EXPECT_EQ(metrics::format_first_step(m),
            "first step done 4.50 s after the process started: start-up 1.25 s, loading weights 2.50 s, first step "
            "0.75 s (of which 0.50 s waiting for the first batch)");
}
