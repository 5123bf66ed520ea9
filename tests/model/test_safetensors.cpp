// Our safetensors writer and reader against each other and against hand-made corrupt files.
// (Interop with the Python `safetensors` package is in test_safetensors.py.)
#include <ftw.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "trainer/model/safetensors.h"
#include "core/json.h"

namespace fs = std::filesystem;
using dflash::UserError;
namespace st = dflash::st;

namespace {

// A fresh directory per test, removed when the test ends.
struct TmpDir {
  fs::path path;
  ~TmpDir() {
    // Not std::filesystem::remove_all: that symbol resolves into libtorch.so and crashes there.
    nftw(path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
         16, FTW_DEPTH | FTW_PHYS);
  }
};

fs::path make_tmpdir() {
  fs::path d = fs::temp_directory_path() /
               ("dflash_st_" + std::to_string(::getpid()) + "_" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::create_directories(d);
  return d;
}
#define tmpdir() (tmp_guard_.path = make_tmpdir())

// A file with the given header text and `data_bytes` bytes of data.
void write_raw(const fs::path& p, const std::string& header, size_t data_bytes,
               int64_t claimed_len = -1) {
  std::ofstream f(p, std::ios::binary);
  uint64_t n = claimed_len >= 0 ? uint64_t(claimed_len) : header.size();
  f.write(reinterpret_cast<const char*>(&n), 8);
  f << header;
  std::string data(data_bytes, '\x01');
  f << data;
}

// Runs `fn` and returns the UserError message (fails the test if none is thrown).
template <typename F>
std::string user_error(F fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no UserError thrown";
  return "";
}

}  // namespace

TEST(SafeTensors, RoundTripEveryDtypeExactly) {
  TmpDir tmp_guard_;
  fs::path d = tmpdir();
  at::manual_seed(1);
  std::vector<std::pair<std::string, at::Tensor>> ts = {
      {"b.bf16", at::randn({3, 5}).to(at::kBFloat16)},
      {"a.f32", at::randn({7})},
      {"c.f16", at::randn({2, 2, 3}).to(at::kHalf)},
      {"d.i64", at::randint(-1000000000000LL, 1000000000000LL, {4}, at::kLong)},
      {"e.i32", at::randint(-100000, 100000, {6}, at::kInt)},
      {"f.u8", at::randint(0, 255, {9}, at::kByte)},
      {"g.bool", at::randint(0, 2, {5}, at::kLong).to(at::kBool)},
      {"h.scalar", at::tensor(3.5)},
      {"i.empty", at::empty({0, 4})},
      {"j.noncontig", at::randn({4, 6}).t()},
  };
  st::save((d / "x.safetensors").string(), ts, {{"format", "pt"}, {"quote\"d", "v\n"}});
  EXPECT_FALSE(fs::exists(d / "x.safetensors.tmp"));
  auto f = st::SafeTensors::open((d / "x.safetensors").string());
  ASSERT_EQ(f.names().size(), ts.size());
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("quote\"d"), "v\n");
  for (const auto& [name, t] : ts) {
    const auto& info = f.info(name);
    EXPECT_EQ(info.dtype, t.scalar_type()) << name;
    at::Tensor back = f.load(name, t.scalar_type(), at::kCPU);
    EXPECT_EQ(back.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(back, t)) << name;
  }
  // Conversion: bf16 -> f32 is exact; f32 -> bf16 rounds like at::Tensor::to.
  EXPECT_TRUE(at::equal(f.load("b.bf16", at::kFloat, at::kCPU), ts[0].second.to(at::kFloat)));
  EXPECT_TRUE(at::equal(f.load("a.f32", at::kBFloat16, at::kCPU), ts[1].second.to(at::kBFloat16)));
}

TEST(SafeTensors, ShapeAndNameChecks) {
  TmpDir tmp_guard_;
  fs::path d = tmpdir();
  st::save((d / "m.safetensors").string(), {{"w", at::zeros({2, 3})}, {"extra", at::zeros({1})}});
  auto f = st::SafeTensors::open((d / "m.safetensors").string());
  std::vector<int64_t> want = {3, 2};
  std::string msg = user_error([&] { f.load("w", at::kFloat, at::kCPU, &want); });
  EXPECT_NE(msg.find("'w'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[2, 3]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("m.safetensors"), std::string::npos) << msg;
  msg = user_error([&] { f.expect_names({"w", "v"}); });
  EXPECT_NE(msg.find("missing 1: v"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected 1: extra"), std::string::npos) << msg;
  f.expect_names({"w"}, {"ex"});  // ignored prefix: no error
  msg = user_error([&] { f.info("nope"); });
  EXPECT_NE(msg.find("'nope'"), std::string::npos) << msg;
}

TEST(SafeTensors, CorruptFilesAreUserErrors) {
  TmpDir tmp_guard_;
  fs::path d = tmpdir();
  const std::string ok = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Case {
    const char* what;
    std::string header;
    size_t data;
    int64_t claimed;
    const char* expect;  // substring of the message
  } cases[] = {
      {"header length past end", ok, 8, 1 << 20, "runs past the end"},
      {"huge header length", ok, 8, int64_t(1) << 40, "exceeds"},
      {"data truncated", ok, 4, -1, "point outside"},
      {"bad json", R"({"t":{"dtype":"F32",)", 8, -1, "invalid JSON"},
      {"trailing comma", R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", 8, -1,
       "invalid JSON"},
      {"unknown dtype", R"({"t":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8, -1,
       "unknown dtype 'Q4'"},
      {"size mismatch", R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 12, -1,
       "need 12"},
      {"negative shape", R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8, -1,
       "non-negative"},
      {"begin > end", R"({"t":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8, -1,
       "begin > end"},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       12, -1, "overlap"},
      {"duplicate key",
       R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
       8, -1, "duplicate key"},
      {"missing field", R"({"t":{"dtype":"F32","shape":[2]}})", 8, -1, "missing field"},
      {"not an object", R"([1,2])", 8, -1, "expected an object"},
  };
  for (const auto& c : cases) {
    fs::path p = d / "bad.safetensors";
    write_raw(p, c.header, c.data, c.claimed);
    std::string msg = user_error([&] { st::SafeTensors::open(p.string()); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
    EXPECT_NE(msg.find("bad.safetensors"), std::string::npos) << c.what << ": " << msg;
  }
  // Tensor-level errors name the tensor.
  write_raw(d / "t.safetensors", R"({"weight":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
            8);
  std::string msg = user_error([&] { st::SafeTensors::open((d / "t.safetensors").string()); });
  EXPECT_NE(msg.find("'weight'"), std::string::npos) << msg;
  // Short file, missing file, empty directory.
  { std::ofstream(d / "short.safetensors") << "abc"; }
  msg = user_error([&] { st::SafeTensors::open((d / "short.safetensors").string()); });
  EXPECT_NE(msg.find("too short"), std::string::npos) << msg;
  msg = user_error([&] { st::SafeTensors::open((d / "none.safetensors").string()); });
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  fs::create_directories(d / "empty");
  msg = user_error([&] { st::SafeTensors::open((d / "empty").string()); });
  EXPECT_NE(msg.find("neither"), std::string::npos) << msg;
}

TEST(SafeTensors, ShardedCheckpoint) {
  TmpDir tmp_guard_;
  fs::path d = tmpdir();
  at::Tensor a = at::randn({4}), b = at::randn({2, 2});
  st::save((d / "s1.safetensors").string(), {{"a", a}});
  st::save((d / "s2.safetensors").string(), {{"b", b}});
  {
    std::ofstream(d / "model.safetensors.index.json")
        << R"({"metadata":{"total_size":32},"weight_map":{"a":"s1.safetensors","b":"s2.safetensors"}})";
  }
  auto f = st::SafeTensors::open(d.string());
  EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(at::equal(f.load("b", at::kFloat, at::kCPU), b));
  EXPECT_EQ(fs::path(f.info("b").file).filename(), "s2.safetensors");
  // Missing shard: named.
  fs::remove(d / "s2.safetensors");
  std::string msg = user_error([&] { st::SafeTensors::open(d.string()); });
  EXPECT_NE(msg.find("s2.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing"), std::string::npos) << msg;
  // Tensor listed in a shard that does not hold it.
  st::save((d / "s2.safetensors").string(), {{"c", b}});
  msg = user_error([&] { st::SafeTensors::open(d.string()); });
  EXPECT_NE(msg.find("'b'"), std::string::npos) << msg;
}

TEST(Json, StrictParser) {
  using dflash::json::parse;
  auto v = parse(R"({"a":[1,-2.5e3,"x\u00e9\ud83d\ude00",true,null],"big":18446744073709551615})",
                 "t");
  EXPECT_EQ(v.find("big")->as_uint("big"), 18446744073709551615ull);
  const auto& arr = v.find("a")->as_array("a");
  EXPECT_EQ(arr[0].as_int("x"), 1);
  EXPECT_DOUBLE_EQ(arr[1].as_double("x"), -2500.0);
  EXPECT_EQ(arr[2].as_string("x"), "x\xc3\xa9\xf0\x9f\x98\x80");
  EXPECT_THROW(parse("{} x", "t"), UserError);
  EXPECT_THROW(parse("[01]", "t"), UserError);
  EXPECT_THROW(parse("[NaN]", "t"), UserError);
  EXPECT_THROW(parse("{\"a\":1,}", "t"), UserError);
  EXPECT_THROW(parse("\"\\ud800\"", "t"), UserError);
  EXPECT_THROW(arr[1].as_int("x"), UserError);
  EXPECT_EQ(parse(dflash::json::quote("a\"b\\\n\x01"), "t").as_string("q"), "a\"b\\\n\x01");
}
