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
  m.tau_block_mean = 3.5;
  m.lr = 4.2e-4;
  m.grad_norm = 0.83;
  m.target_tok_s = 12345;
  m.drafter_tok_s = 11900;
  m.target_wait_s = 0.12;
  m.drafter_wait_s = 0.03;
  m.mfu = 0.412;
  m.mem_gb = 23.1;
  m.elapsed_s = 61.5;
  m.eta_s = 3 * 3600 + 7 * 60 + 20;
  m.percent = 30;
  m.total_epochs = 2;
  m.accuracy_per_pos = {0.5, 0.25};
  const std::string line = metrics::format_line(m);
  for (const char* s : {"step 120/400", "loss 3.4122", "acc 0.412", "tau_est 2.31", "tau -", "lr 4.20e-04", "gnorm 0.830",
                        "tok/s target 12.3K drafter 11.9K", "wait target 0.120s drafter 0.030s", "mfu 41.2%",
                        "mem 23.1 GB", "epoch 2/2", "elapsed 1m02s"})
    EXPECT_NE(line.find(s), std::string::npos) << s << " in " << line;
  json::Value v = json::parse(metrics::to_json(m), "metrics");
  EXPECT_EQ(v.find("step")->as_int("step"), 120);
  EXPECT_EQ(v.find("batch")->as_int("batch"), 240);
  EXPECT_DOUBLE_EQ(v.find("loss")->as_double("loss"), 3.41215);
  EXPECT_DOUBLE_EQ(v.find("target_tok_s")->as_double("t"), 12345);
  EXPECT_DOUBLE_EQ(v.find("mfu")->as_double("mfu"), 0.412);
  EXPECT_NE(line.find("step 120/400 (30.0%)"), std::string::npos) << line;
  EXPECT_NE(line.find("eta 3h07m"), std::string::npos) << line;
  EXPECT_DOUBLE_EQ(v.find("eta_s")->as_double("eta"), m.eta_s);
  EXPECT_DOUBLE_EQ(v.find("accuracy_per_pos")->as_array("a")[1].as_double("a"), 0.25);
  EXPECT_EQ(metrics::format_duration(45.2), "45s");
  EXPECT_EQ(metrics::format_duration(725), "12m05s");
  EXPECT_DOUBLE_EQ(v.find("tau_est")->as_double("tau_est"), 2.314);
  EXPECT_DOUBLE_EQ(v.find("tau_est_block_mean")->as_double("tau_est_block_mean"), 3.5);
  EXPECT_EQ(line.find("3.50"), std::string::npos) << "the block mean is not on the console: " << line;
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

// CRC-32C check value of the standard test string (RFC 3720 B.4 / the Castagnoli catalogue) and
// the TFRecord mask; the event bytes are read back by tensorboard's own reader in
// tests/pipeline/test_tensorboard.py.
TEST(TensorBoard, Crc32cAndScalarsOfJson) {
  EXPECT_EQ(metrics::crc32c("123456789", 9), 0xE3069283u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(metrics::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xa282ead8u);
  auto v = metrics::scalars_of_json(R"({"step": 3, "loss": 1.5, "mfu": null, "name": "x", "acc": [0.5, 0.25],
                                        "eval": {"tau": 2.5}})", {"step"});
  ASSERT_EQ(v.size(), 4u);
  EXPECT_EQ(v[0].first, "loss");
  EXPECT_EQ(v[1].first, "acc/0");
  EXPECT_EQ(v[2].first, "acc/1");
  EXPECT_FLOAT_EQ(v[2].second, 0.25f);
  EXPECT_EQ(v[3].first, "eval/tau");
}
