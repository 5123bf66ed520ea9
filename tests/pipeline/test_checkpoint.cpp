// Training states in the run directory: commit protocol, `latest`, pruning, fallback past
// half-written states, refusal of another layout, exact restore of parameters/optimizer/RNG.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <unistd.h>

#include <fstream>

#include "core/error.h"
#include "trainer/checkpoint/checkpoint.h"
#include "core/files.h"

using namespace dflash;

namespace {
struct TempDir {
  std::string path;
  TempDir() {
    static int n = 0;
    path = "/tmp/dflash_ckpt_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++);
    files::make_dirs(path);
  }
  ~TempDir() { files::remove_tree(path); }
};

optim::NamedTensors make_params() {
  at::manual_seed(0);
  return {{"fc.weight", at::randn({4, 6}).set_requires_grad(true)},
          {"norm.weight", at::randn({4}).to(at::kBFloat16).set_requires_grad(true)}};
}

void train(optim::AdamW& opt, int steps) {
  for (int s = 0; s < steps; ++s) {
    for (auto& [n, p] : opt.params()) p.mutable_grad() = at::randn(p.sizes()).to(p.scalar_type());
    opt.step(1e-2, 1.0);
  }
}

ckpt::RunSignature sig() {
  ckpt::RunSignature s;
  s.world_size = 4;
  s.target_ranks = 2;
  s.drafter_ranks = 2;
  s.grad_accum = 1;
  s.seed = 7;
  s.batch_tokens = 512;
  s.max_seq_len = 256;
  s.data_docs = 100;
  s.data_tokens = 9000;
  return s;
}

// What the drafter ranks of a 2+2 run do at step `step`.
void save(const std::string& run, optim::AdamW& opt, int64_t step, int64_t keep) {
  const std::string tmp = ckpt::state_tmp_dir(run, step);
  ckpt::write_rank_state(tmp, 2, step, &opt);
  ckpt::write_rank_state(tmp, 3, step, nullptr);
  ckpt::StateMeta m;
  m.step = step;
  m.next_batch = 2 * step;
  m.total_steps = 100;
  m.sig = sig();
  m.files = {ckpt::rank_file(2), ckpt::rank_file(3), ckpt::kOptimizerFile, ckpt::kConfigFile};
  ckpt::commit_state(run, m, "run: {seed: 7}\n", keep);
}
}  // namespace

TEST(Checkpoint, CommitLatestAndKeepLast) {
  TempDir t;
  auto p = make_params();
  optim::AdamW opt(p, {});
  for (int step = 10; step <= 40; step += 10) {
    train(opt, 1);
    save(t.path, opt, step, 2);
  }
  EXPECT_FALSE(files::exists(ckpt::state_dir(t.path, 10)));
  EXPECT_FALSE(files::exists(ckpt::state_dir(t.path, 20)));
  EXPECT_TRUE(files::exists(ckpt::state_dir(t.path, 30)));
  EXPECT_TRUE(files::exists(ckpt::state_dir(t.path, 40)));
  EXPECT_FALSE(files::exists(ckpt::state_tmp_dir(t.path, 40)));
  EXPECT_EQ(files::read_file(ckpt::checkpoints_dir(t.path) + "/latest"), "step-00000040\n");
  std::string dir;
  auto m = ckpt::find_latest_state(t.path, &dir);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->step, 40);
  EXPECT_EQ(m->next_batch, 80);
  EXPECT_EQ(dir, ckpt::state_dir(t.path, 40));
  EXPECT_EQ(files::read_file(dir + "/config.yaml"), "run: {seed: 7}\n");
  EXPECT_FALSE(ckpt::find_latest_state(t.path + "/nothing", nullptr).has_value());
}

TEST(Checkpoint, HalfWrittenStatesFallBackToThePreviousComplete) {
  TempDir t;
  auto p = make_params();
  optim::AdamW opt(p, {});
  train(opt, 2);
  save(t.path, opt, 10, 3);
  train(opt, 2);
  save(t.path, opt, 20, 3);
  // (a) killed while writing step 30: only the tmp dir with part of the files.
  ckpt::write_rank_state(ckpt::state_tmp_dir(t.path, 30), 2, 30, &opt);
  auto m = ckpt::find_latest_state(t.path, nullptr);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->step, 20);
  // (b) a step directory without meta.json (not produced by commit_state, but a user's copy
  // could look like it): ignored.
  files::make_dirs(ckpt::state_dir(t.path, 50));
  EXPECT_EQ(ckpt::find_latest_state(t.path, nullptr)->step, 20);
  // (c) a complete-looking state missing a listed file: ignored, with `latest` pointing at it.
  ::unlink((ckpt::state_dir(t.path, 20) + "/" + ckpt::rank_file(3)).c_str());
  std::string dir;
  m = ckpt::find_latest_state(t.path, &dir);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->step, 10);
  EXPECT_EQ(dir, ckpt::state_dir(t.path, 10));
  // (d) a corrupt meta.json: ignored.
  files::write_file_atomic(ckpt::state_dir(t.path, 10) + "/meta.json", "{\"format\": ");
  EXPECT_FALSE(ckpt::find_latest_state(t.path, nullptr).has_value());
  // The next commit removes leftover tmp dirs of older steps.
  save(t.path, opt, 40, 3);
  EXPECT_FALSE(files::exists(ckpt::state_tmp_dir(t.path, 30)));
}

TEST(Checkpoint, RefusesAnotherLayoutSayingWhy) {
  TempDir t;
  auto p = make_params();
  optim::AdamW opt(p, {});
  save(t.path, opt, 5, 3);
  std::string dir;
  auto m = ckpt::find_latest_state(t.path, &dir);
  ASSERT_TRUE(m);
  EXPECT_NO_THROW(ckpt::check_resumable(*m, sig(), dir));
  auto other = sig();
  other.world_size = 3;
  other.target_ranks = 1;
  other.grad_accum = 2;
  try {
    ckpt::check_resumable(*m, other, dir);
    FAIL();
  } catch (const UserError& e) {
    std::string s = e.what();
    EXPECT_NE(s.find(dir), std::string::npos) << s;
    EXPECT_NE(s.find("world size: state 4, this run 3"), std::string::npos) << s;
    EXPECT_NE(s.find("layout.target_ranks: state 2, this run 1"), std::string::npos) << s;
    EXPECT_NE(s.find("train.grad_accum: state 1, this run 2"), std::string::npos) << s;
    EXPECT_EQ(s.find("drafter_ranks"), std::string::npos) << s;
  }
  other = sig();
  other.data_tokens = 1;
  EXPECT_THROW(ckpt::check_resumable(*m, other, dir), UserError);
}

TEST(Checkpoint, RestoresParametersOptimizerAndRngExactly) {
  TempDir t;
  auto p = make_params();
  optim::AdamW opt(p, {0.9, 0.95, 1e-8, 0.01});
  train(opt, 3);
  at::manual_seed(1234);
  save(t.path, opt, 3, 2);
  const at::Tensor after_save = at::randn({5});  // the RNG continues from the saved state
  train(opt, 2);                                 // reference continuation
  at::manual_seed(99);
  auto q = make_params();
  optim::AdamW opt2(q, {0.9, 0.95, 1e-8, 0.01});
  std::string dir;
  auto m = ckpt::find_latest_state(t.path, &dir);
  ASSERT_TRUE(m);
  ckpt::load_rank_state(dir, 2, &opt2, m->step);
  EXPECT_TRUE(at::equal(at::randn({5}), after_save));
  EXPECT_EQ(opt2.steps(), 3);
  // The RNG now stands where the reference's stood before its continuation (both drew one
  // randn({5}) after the save), so train() draws the same gradients.
  train(opt2, 2);
  for (size_t i = 0; i < p.size(); ++i) EXPECT_TRUE(at::equal(p[i].second, q[i].second)) << p[i].first;
  // A rank whose file is absent (another layout) is refused by name.
  EXPECT_THROW(ckpt::load_rank_state(dir, 5, nullptr, m->step), UserError);
}
