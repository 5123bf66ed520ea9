// Config loading: strict keys, types, overrides, printing round trip.
#include <gtest/gtest.h>

#include "core/error.h"
#include "trainer/config.h"

using dflash::parse_config;
using dflash::UserError;

namespace {
std::string error_of(const std::string& yaml, std::vector<std::string> ov = {}) {
  try {
    parse_config(yaml, "t.yaml", ov);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAndValues) {
  auto c = parse_config("train: {lr: 1e-3}\nlayout: {target_ranks: 5, drafter_ranks: 3}\n", "t.yaml", {});
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-3);
  EXPECT_EQ(c.layout.target_ranks, 5);
  EXPECT_EQ(c.drafter.block_size, 16);
}

TEST(Config, UnknownKeyNamesPathAndAllowed) {
  std::string e = error_of("train: {lrr: 1}\n");
  EXPECT_NE(e.find("t.yaml"), std::string::npos) << e;
  EXPECT_NE(e.find("'train.lrr'"), std::string::npos) << e;
  EXPECT_NE(e.find("warmup_ratio"), std::string::npos) << e;
  e = error_of("bogus: 1\n");
  EXPECT_NE(e.find("'bogus'"), std::string::npos) << e;
}

TEST(Config, WrongType) {
  std::string e = error_of("train: {lr: abc}\n");
  EXPECT_NE(e.find("'train.lr' expects a number, got 'abc'"), std::string::npos) << e;
  e = error_of("layout: {target_ranks: 1.5}\n");
  EXPECT_NE(e.find("expects an integer"), std::string::npos) << e;
  e = error_of("target: {layer_ids: 3}\n");
  EXPECT_NE(e.find("expects a list"), std::string::npos) << e;
}

TEST(Config, Malformed) {
  std::string e = error_of("train: {lr: [1,\n");
  EXPECT_NE(e.find("malformed YAML"), std::string::npos) << e;
}

TEST(Config, Overrides) {
  auto c = parse_config("", "t.yaml", {"train.lr=0.5", "target.layer_ids=[1, 2]", "run.name=x"});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.5);
  ASSERT_EQ(c.target.layer_ids.size(), 2u);
  EXPECT_EQ(c.run.name, "x");
  std::string e = error_of("", {"train.nope=1"});
  EXPECT_NE(e.find("'train.nope'"), std::string::npos) << e;
  EXPECT_NE(e.find("grad_accum"), std::string::npos) << e;
  e = error_of("", {"train.lr"});
  EXPECT_NE(e.find("key.path=value"), std::string::npos) << e;
}

TEST(Config, PrintRoundTrip) {
  auto c = parse_config("train: {lr: 2e-4}\ntarget: {layer_ids: [1, 9]}\n", "t.yaml", {});
  auto c2 = parse_config(dflash::to_yaml(c), "printed", {});
  EXPECT_EQ(dflash::to_yaml(c), dflash::to_yaml(c2));
  EXPECT_DOUBLE_EQ(c2.train.lr, 2e-4);
}
