// The schedule (trainer/roles/schedule.h), through exactly the functions the roles call: every
// batch has exactly one producer and one consumer, each rank's batches are increasing, pairs
// meet in the same order, walks from a resumed start batch and the optimizer steps a drafter
// closes agree with brute-force references written here, and a layout that does not match the
// world size names the keys.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "trainer/roles/schedule.h"

using namespace dflash::roles;

TEST(Schedule, RolesOfFivePlusThree) {
  Schedule s(5, 3, false, 8);
  for (int r = 0; r < 5; ++r) EXPECT_EQ(s.role_of(r), Role::Target);
  for (int r = 5; r < 8; ++r) EXPECT_EQ(s.role_of(r), Role::Drafter);
  EXPECT_EQ(s.drafter_index(7), 2);
  EXPECT_EQ(s.drafter_rank(2), 7);
  EXPECT_EQ(s.drafter_ranks(), (std::vector<int>{5, 6, 7}));
  EXPECT_EQ(s.name(6), "rank 6 (drafter 1)");
  EXPECT_EQ(s.name(4), "rank 4 (target 4)");
}

TEST(Schedule, BatchKGoesFromKModTToKModD) {
  for (auto [T, D] : std::vector<std::pair<int, int>>{{5, 3}, {1, 1}, {2, 1}, {1, 2}, {3, 5}}) {
    Schedule s(T, D, false, T + D);
    const int64_t n = 200;
    // independent reference: walk k and count what each (target, drafter) pair carries
    std::map<std::pair<int, int>, std::vector<int64_t>> by_pair_send, by_pair_recv;
    int64_t total_sent = 0, total_recv = 0;
    for (int64_t i = 0; i < T; ++i)
      for (int64_t k : s.target_batches(i, 0, n)) {
        EXPECT_EQ(k % T, i);
        by_pair_send[{s.target_rank(i), s.drafter_of(k)}].push_back(k);
        ++total_sent;
      }
    for (int64_t j = 0; j < D; ++j) {
      int64_t prev = -1;
      for (int64_t k : s.drafter_batches(j, 0, n)) {
        EXPECT_EQ(k % D, j);
        EXPECT_GT(k, prev);
        prev = k;
        by_pair_recv[{s.target_of(k), s.drafter_rank(j)}].push_back(k);
        ++total_recv;
      }
    }
    EXPECT_EQ(total_sent, n);
    EXPECT_EQ(total_recv, n);
    // the n-th send on a pair is the n-th receive on it: same sequence on both sides
    EXPECT_EQ(by_pair_send, by_pair_recv) << T << ":" << D;
  }
}

TEST(Schedule, Colocated) {
  Schedule s(2, 3, true, 1);
  EXPECT_EQ(s.role_of(0), Role::Both);
  EXPECT_EQ(s.target_of(7), 0);
  EXPECT_EQ(s.drafter_of(7), 0);
  EXPECT_EQ(s.target_batches(0, 0, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(s.drafter_batches(0, 0, 4), (std::vector<int64_t>{0, 1, 2, 3}));
}

TEST(Schedule, StepOf) {
  Schedule s(5, 3, false, 8);
  EXPECT_EQ(s.step_of(5, 2), 0);
  EXPECT_EQ(s.step_of(6, 2), 1);
}

TEST(Schedule, WorldSizeMismatchNamesKeys) {
  try {
    Schedule s(5, 3, false, 4);
    FAIL();
  } catch (const dflash::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("layout.target_ranks=5"), std::string::npos) << m;
    EXPECT_NE(m.find("layout.drafter_ranks=3"), std::string::npos) << m;
    EXPECT_NE(m.find("world size 4"), std::string::npos) << m;
  }
  EXPECT_THROW(Schedule(1, 1, true, 2), dflash::UserError);
  EXPECT_THROW(Schedule(0, 1, false, 1), dflash::UserError);
}

// The walks of a run as the roles take them: target i walks target_batches(i, start, end),
// drafter j walks drafter_batches(j, start, end) and closes step step_of(k) after the batch for
// which closes_step(k) holds. Reference: the definition in docs/training.md, by brute force
// over every k (target k mod T, drafter k mod D; drafter j trains s*G + a*D + j, a < grad_accum,
// of step s; G = D x grad_accum), for fresh and resumed starts.
TEST(Schedule, RunWalksMatchTheDefinition) {
  struct Layout {
    int64_t T, D, grad_accum;
  };
  for (auto [T, D, ga] : std::vector<Layout>{{1, 1, 2}, {2, 2, 1}, {3, 1, 2}, {5, 3, 2}, {2, 3, 4}}) {
    Schedule s(T, D, false, static_cast<int>(T + D));
    const int64_t G = D * ga;
    EXPECT_EQ(s.batches_per_step(ga), G);
    for (int64_t start_step : {0, 1, 3}) {
      const int64_t total_steps = 7, begin = start_step * G, end = total_steps * G;
      for (int64_t i = 0; i < T; ++i) {
        std::vector<int64_t> want;
        for (int64_t k = begin; k < end; ++k)
          if (k % T == i) want.push_back(k);
        EXPECT_EQ(s.target_batches(i, begin, end), want) << T << "+" << D << " target " << i << " from " << begin;
        for (int64_t k : want) EXPECT_EQ(s.target_of(k), i);
      }
      for (int64_t j = 0; j < D; ++j) {
        std::vector<int64_t> want;  // step by step, as the definition reads
        std::vector<std::pair<int64_t, int64_t>> want_closes;  // (batch, step) after which the step closes
        for (int64_t st = start_step; st < total_steps; ++st) {
          for (int64_t a = 0; a < ga; ++a) want.push_back(st * G + a * D + j);
          want_closes.emplace_back(st * G + (ga - 1) * D + j, st);
        }
        const std::vector<int64_t> got = s.drafter_batches(j, begin, end);
        EXPECT_EQ(got, want) << T << "+" << D << " drafter " << j << " from " << begin;
        std::vector<std::pair<int64_t, int64_t>> closes;
        for (int64_t k : got) {
          EXPECT_EQ(s.drafter_of(k), s.drafter_rank(j));
          if (s.closes_step(k, ga)) closes.emplace_back(k, s.step_of(k, ga));
        }
        EXPECT_EQ(closes, want_closes) << T << "+" << D << " drafter " << j;
      }
    }
  }
}

// A colocated run walks every batch and closes a step every grad_accum batches, whatever
// target_ranks/drafter_ranks say (they do not apply to one process).
TEST(Schedule, ColocatedRunWalks) {
  Schedule s(2, 3, true, 1);
  EXPECT_EQ(s.targets(), 1);
  EXPECT_EQ(s.drafters(), 1);
  EXPECT_EQ(s.batches_per_step(2), 2);
  EXPECT_EQ(s.drafter_batches(s.drafter_index(0), 4, 10), (std::vector<int64_t>{4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(s.target_batches(s.target_index(0), 4, 10), (std::vector<int64_t>{4, 5, 6, 7, 8, 9}));
  std::vector<int64_t> closes;
  for (int64_t k = 4; k < 10; ++k)
    if (s.closes_step(k, 2)) closes.push_back(s.step_of(k, 2));
  EXPECT_EQ(closes, (std::vector<int64_t>{2, 3, 4}));
  EXPECT_EQ(s.drafter_ranks(), (std::vector<int>{0}));
}

// Start-up maps a rank onto its role's index the way the walks expect.
TEST(Schedule, IndicesRoundTrip) {
  Schedule s(3, 2, false, 5);
  for (int r = 0; r < 5; ++r) {
    if (s.is_target(r)) {
      EXPECT_EQ(s.target_rank(s.target_index(r)), r);
    }
    if (s.is_drafter(r)) {
      EXPECT_EQ(s.drafter_rank(s.drafter_index(r)), r);
    }
    EXPECT_NE(s.is_target(r), s.is_drafter(r));
  }
  EXPECT_TRUE(s.target_batches(0, 10, 10).empty());
  EXPECT_TRUE(s.drafter_batches(1, 10, 11).empty());
}
