// The schedule primitive (comm/schedule.h): every batch has exactly one producer and one
// consumer, each rank's batches are increasing, pairs meet in the same order, and a layout
// that does not match the world size names the keys.
#include <gtest/gtest.h>

#include <map>

#include "core/error.h"
#include "comm/schedule.h"

using namespace dflash::comm;

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
      for (int64_t k : s.target_batches(i, n)) {
        EXPECT_EQ(k % T, i);
        by_pair_send[{s.target_rank(i), s.dest_rank(k)}].push_back(k);
        ++total_sent;
      }
    for (int64_t j = 0; j < D; ++j) {
      int64_t prev = -1;
      for (int64_t k : s.drafter_batches(j, n)) {
        EXPECT_EQ(k % D, j);
        EXPECT_GT(k, prev);
        prev = k;
        by_pair_recv[{s.source_rank(k), s.drafter_rank(j)}].push_back(k);
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
  EXPECT_EQ(s.source_rank(7), 0);
  EXPECT_EQ(s.dest_rank(7), 0);
  EXPECT_EQ(s.target_batches(0, 4), (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_EQ(s.drafter_batches(0, 4), (std::vector<int64_t>{0, 1, 2, 3}));
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
