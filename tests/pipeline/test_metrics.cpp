// The metrics line and metrics.jsonl: every number appears, the JSON parses back to the values.
#include <gtest/gtest.h>

#include <unistd.h>

#include "core/files.h"
#include "trainer/metrics/metrics.h"
#include "core/json.h"

using namespace dflash;

TEST(Metrics, LineAndJson) {
  metrics::StepMetrics m;
  m.step = 120;
  m.total_steps = 400;
  m.epoch = 1;
  m.batch = 240;
  m.loss = 3.41215;
  m.accuracy = 0.4123;
  m.tau = 2.314;
  m.lr = 4.2e-4;
  m.grad_norm = 0.83;
  m.target_tok_s = 12345;
  m.drafter_tok_s = 11900;
  m.target_wait_s = 0.12;
  m.drafter_wait_s = 0.03;
  m.mfu = 0.412;
  m.mem_gb = 23.1;
  m.elapsed_s = 61.5;
  const std::string line = metrics::format_line(m);
  for (const char* s : {"step 120/400", "loss 3.4122", "acc 0.412", "tau_est 2.31", "tau -", "lr 4.20e-04", "gnorm 0.830",
                        "tok/s target 12.3K drafter 11.9K", "wait target 0.120s drafter 0.030s", "mfu 41.2%",
                        "mem 23.1 GB"})
    EXPECT_NE(line.find(s), std::string::npos) << s << " in " << line;
  json::Value v = json::parse(metrics::to_json(m), "metrics");
  EXPECT_EQ(v.find("step")->as_int("step"), 120);
  EXPECT_EQ(v.find("batch")->as_int("batch"), 240);
  EXPECT_DOUBLE_EQ(v.find("loss")->as_double("loss"), 3.41215);
  EXPECT_DOUBLE_EQ(v.find("target_tok_s")->as_double("t"), 12345);
  EXPECT_DOUBLE_EQ(v.find("mfu")->as_double("mfu"), 0.412);
  EXPECT_DOUBLE_EQ(v.find("tau_est")->as_double("tau_est"), 2.314);
  EXPECT_TRUE(v.find("tau")->is_null());  // no evaluation yet
  m.eval_tau = 1.618, m.eval_step = 100, m.eval_s = 3.14;
  EXPECT_NE(metrics::format_line(m).find("tau 1.62@100 (eval 3.1s)"), std::string::npos) << metrics::format_line(m);
  json::Value e = json::parse(metrics::to_json(m), "metrics");
  EXPECT_DOUBLE_EQ(e.find("tau")->as_double("tau"), 1.618);
  EXPECT_EQ(e.find("tau_step")->as_int("tau_step"), 100);
  EXPECT_DOUBLE_EQ(e.find("eval_s")->as_double("eval_s"), 3.14);
  m.mfu = -1;
  EXPECT_NE(metrics::format_line(m).find("mfu -"), std::string::npos);
  EXPECT_TRUE(json::parse(metrics::to_json(m), "metrics").find("mfu")->is_null());
}

TEST(Metrics, FileAppendsOneLinePerWrite) {
  const std::string dir = "/tmp/dflash_metrics_test_" + std::to_string(::getpid());
  {
    metrics::MetricsLog log(dir, true);
    metrics::StepMetrics m;
    m.step = 1;
    log.write(m);
    m.step = 2;
    log.write(m);
    metrics::MetricsLog inactive(dir + "/other", false);
    inactive.write(m);
    EXPECT_FALSE(files::exists(dir + "/other"));
  }
  std::string text = files::read_file(dir + "/metrics.jsonl");
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2);
  EXPECT_NE(text.find("{\"step\": 2,"), std::string::npos);
  EXPECT_GT(metrics::peak_rss_gb(), 0.0);
  files::remove_tree(dir);
}
