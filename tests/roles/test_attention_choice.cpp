// drafter.attention and drafter.attention_backward resolved against the binary and the device
// (trainer/roles/attention_choice.h):
// every branch on given facts (a CUDA build on an H200, an A100, an older GPU, a CPU build), the
// facts of this CPU process, and the errors of `kernel` where the kernel cannot run (one line
// naming the key and its origin; the test suite's CPU build has no kernel).
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "core/error.h"
#include "trainer/config.h"
#include "trainer/roles/attention_choice.h"

using namespace dflash;
using roles::DeviceFacts;
using attention::Backend;

namespace {

Config with(const std::string& attention) {
  return parse_config("", "test.yaml", {"drafter.attention=" + attention});
}

Config fused(const std::string& attention = "auto") {
  return parse_config("", "test.yaml", {"drafter.attention=" + attention, "drafter.attention_backward=fused"});
}

std::string error_of(const Config& c, const DeviceFacts& f, int64_t head_dim) {
  try {
    roles::choose_attention(c, f, head_dim);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

const DeviceFacts kH200{true, true, 9, 0}, kA100{true, true, 8, 0}, kL40{true, true, 8, 9}, kT4{true, true, 7, 5},
    kB200{true, true, 10, 0}, kCpuBuild{false, false, 0, 0}, kCudaBuildOnCpu{true, false, 0, 0};
// an H200 whose probe found the fused backward's sm_90a code (device_facts with probe_fused)
const DeviceFacts kH200Fused{true, true, 9, 0, true};

}  // namespace

TEST(AttentionChoice, DefaultIsAutoEverywhere) {
  EXPECT_EQ(Config().drafter.attention, "auto");
  EXPECT_EQ(parse_config("", "test.yaml", {}).drafter.attention, "auto");
}

TEST(AttentionChoice, AutoPicksTheKernelOnSm80AndSm90) {
  for (const DeviceFacts& f : {kH200, kA100, kL40}) {
    auto c = roles::choose_attention(with("auto"), f, 128);
    EXPECT_EQ(c.backend, Backend::Kernel) << c.why;
    EXPECT_EQ(c.why.rfind("kernel (drafter.attention=auto: CUDA sm_", 0), 0u) << c.why;
  }
  EXPECT_EQ(roles::choose_attention(with("auto"), kH200, 64).backend, Backend::Kernel);
}

TEST(AttentionChoice, AutoFallsBackToSdpaAndSaysWhy) {
  struct Case {
    DeviceFacts f;
    int64_t head_dim;
    const char* reason;
  };
  for (const Case& k : {Case{kCpuBuild, 128, "this binary has no CUDA attention kernel"},
                        Case{kCudaBuildOnCpu, 128, "this rank runs on the CPU"},
                        Case{kT4, 128, "the GPU is sm_75"}, Case{kB200, 128, "the GPU is sm_100"},
                        Case{kH200, 96, "head_dim is 96"}}) {
    auto c = roles::choose_attention(with("auto"), k.f, k.head_dim);
    EXPECT_EQ(c.backend, Backend::Reference) << c.why;
    EXPECT_EQ(c.why.rfind("sdpa (drafter.attention=auto: ", 0), 0u) << c.why;
    EXPECT_NE(c.why.find(k.reason), std::string::npos) << c.why;
  }
}

TEST(AttentionChoice, SdpaIsAlwaysTheReferencePath) {
  for (const DeviceFacts& f : {kH200, kCpuBuild, kT4}) {
    auto c = roles::choose_attention(with("sdpa"), f, 128);
    EXPECT_EQ(c.backend, Backend::Reference);
    EXPECT_NE(c.why.find("chosen explicitly"), std::string::npos) << c.why;
  }
}

TEST(AttentionChoice, KernelWhereItCannotRunIsOneUserErrorNamingTheKey) {
  EXPECT_EQ(roles::choose_attention(with("kernel"), kH200, 128).backend, Backend::Kernel);
  for (const DeviceFacts& f : {kCpuBuild, kCudaBuildOnCpu, kT4}) {
    const std::string e = error_of(with("kernel"), f, 128);
    EXPECT_NE(e.find("override 'drafter.attention=kernel': key 'drafter.attention' is kernel, but "), std::string::npos) << e;
    EXPECT_NE(e.find("use auto"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  EXPECT_NE(error_of(with("kernel"), kH200, 96).find("head_dim is 96"), std::string::npos);
}

TEST(AttentionChoice, ThisCpuProcess) {
  const DeviceFacts f = roles::device_facts(c10::Device(c10::kCPU));
  EXPECT_FALSE(f.cuda);
  EXPECT_EQ(f.kernel_built, attention::kernel_available());
  EXPECT_EQ(roles::choose_attention(with("auto"), f, 128).backend, Backend::Reference);
}

TEST(AttentionChoice, UnknownValueIsRejectedAtLoad) {
  try {
    with("flash");
    FAIL() << "accepted drafter.attention=flash";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("key 'drafter.attention' must be one of auto, kernel, sdpa, got 'flash'"),
              std::string::npos) << e.what();
  }
}

// The default, auto, at the default data.max_seq_len (below kFusedHintSeqLen): the split backward, and the header
// says nothing about it.
TEST(AttentionBackwardChoice, DefaultIsAutoWhichSplitsShortDocuments) {
  EXPECT_EQ(Config().drafter.attention_backward, "auto");
  ASSERT_LT(Config().data.max_seq_len, roles::kFusedHintSeqLen);
  const auto c = roles::choose_attention(with("auto"), kH200Fused, 128);
  EXPECT_EQ(c.backend, Backend::Kernel);
  EXPECT_FALSE(c.fused_backward);
  EXPECT_EQ(c.why.find("fused"), std::string::npos) << c.why;
}

// auto at long documents (data.max_seq_len >= kFusedHintSeqLen): the fused backward where it runs, named in the header;
// the split one, silently and without an error, where it does not (no sm_90a code, another GPU, head_dim 64, sdpa, a
// CPU build) and below the threshold.
TEST(AttentionBackwardChoice, AutoRunsFusedAtLongDocumentsWhereItRuns) {
  auto at = [](int64_t len, const char* attention = "auto") {
    return parse_config("", "test.yaml", {"data.max_seq_len=" + std::to_string(len),
                                          std::string("drafter.attention=") + attention});
  };
  const auto c = roles::choose_attention(at(40000), kH200Fused, 128);
  EXPECT_TRUE(c.fused_backward) << c.why;
  EXPECT_NE(c.why.find(", fused backward (drafter.attention_backward=auto: 40000-token documents)"), std::string::npos)
      << c.why;
  EXPECT_TRUE(roles::choose_attention(at(roles::kFusedHintSeqLen), kH200Fused, 128).fused_backward);
  for (const auto& [cfg, f, hd] : {std::tuple{at(roles::kFusedHintSeqLen - 1), kH200Fused, int64_t{128}},
                                   std::tuple{at(40000), kH200, int64_t{128}},
                                   std::tuple{at(40000), kA100, int64_t{128}},
                                   std::tuple{at(40000), kH200Fused, int64_t{64}},
                                   std::tuple{at(40000, "sdpa"), kH200Fused, int64_t{128}},
                                   std::tuple{at(40000), kCpuBuild, int64_t{128}}}) {
    const auto w = roles::choose_attention(cfg, f, hd);
    EXPECT_FALSE(w.fused_backward) << cfg.data.max_seq_len << " " << hd << ": " << w.why;
    EXPECT_EQ(w.why.find("fused"), std::string::npos) << cfg.data.max_seq_len << " " << hd << ": " << w.why;
  }
}

// With the split backward where the fused one runs, long documents (data.max_seq_len >= kFusedHintSeqLen) get one
// clause in the header saying that fused is faster there; not at the recipe's 3072, not where fused cannot run.
TEST(AttentionBackwardChoice, SplitAtLongDocumentsRecommendsFused) {
  auto split_at = [](int64_t len) {
    return parse_config("", "test.yaml", {"data.max_seq_len=" + std::to_string(len), "drafter.attention_backward=split"});
  };
  const auto c = roles::choose_attention(split_at(40000), kH200Fused, 128);
  EXPECT_FALSE(c.fused_backward);
  EXPECT_NE(c.why.find(", split backward (drafter.attention_backward=fused (or auto) runs 40000-token documents faster: "),
            std::string::npos) << c.why;
  EXPECT_NE(roles::choose_attention(split_at(roles::kFusedHintSeqLen), kH200Fused, 128).why.find("split backward"),
            std::string::npos);
  for (const auto& [len, f, hd] : {std::tuple{roles::kFusedHintSeqLen - 1, kH200Fused, int64_t{128}},
                                   std::tuple{int64_t{40000}, kH200, int64_t{128}},
                                   std::tuple{int64_t{40000}, kA100, int64_t{128}},
                                   std::tuple{int64_t{40000}, kH200Fused, int64_t{64}}}) {
    const auto w = roles::choose_attention(split_at(len), f, hd).why;
    EXPECT_EQ(w.find("fused"), std::string::npos) << len << " " << hd << ": " << w;
  }
  EXPECT_EQ(roles::choose_attention(parse_config("", "test.yaml", {"data.max_seq_len=40000", "drafter.attention=sdpa",
                                                                    "drafter.attention_backward=split"}),
                                    kH200Fused, 128).why.find("fused"), std::string::npos);
}

TEST(AttentionBackwardChoice, FusedOnHopperWithItsCodeAndHeadDim128) {
  for (const char* a : {"auto", "kernel"}) {
    const auto c = roles::choose_attention(fused(a), kH200Fused, 128);
    EXPECT_EQ(c.backend, Backend::Kernel) << c.why;
    EXPECT_TRUE(c.fused_backward) << c.why;
    EXPECT_NE(c.why.find(", fused backward (drafter.attention_backward=fused)"),
              std::string::npos) << c.why;
  }
}

TEST(AttentionBackwardChoice, FusedWhereItCannotRunIsOneUserErrorNamingTheKey) {
  struct Case {
    Config cfg;
    DeviceFacts f;
    int64_t head_dim;
    const char* reason;
  };
  for (const Case& k : {Case{fused(), kH200, 128, "this binary has no sm_90a code"},
                        Case{fused(), kA100, 128, "the GPU is sm_80, the fused backward runs on sm_90"},
                        Case{fused(), kH200Fused, 64, "the drafter's head_dim is 64"},
                        Case{fused("sdpa"), kH200Fused, 128, "the drafter runs the sdpa path (sdpa (drafter.attention=sdpa"},
                        Case{fused(), kCpuBuild, 128, "the drafter runs the sdpa path (sdpa (drafter.attention=auto: "
                                                      "this binary has no CUDA attention kernel"}}) {
    const std::string e = error_of(k.cfg, k.f, k.head_dim);
    EXPECT_NE(e.find("override 'drafter.attention_backward=fused': key 'drafter.attention_backward' is fused, but "),
              std::string::npos) << e;
    EXPECT_NE(e.find(k.reason), std::string::npos) << e;
    EXPECT_NE(e.find("use auto (the default) or split"), std::string::npos) << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

TEST(AttentionBackwardChoice, UnknownValueIsRejectedAtLoad) {
  try {
    parse_config("", "test.yaml", {"drafter.attention_backward=fast"});
    FAIL() << "accepted drafter.attention_backward=fast";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("key 'drafter.attention_backward' must be one of auto, split, fused, got 'fast'"),
              std::string::npos) << e.what();
  }
}

TEST(AttentionBackwardChoice, ThisCpuProcessHasNoFusedBackward) {
  // a CPU rank: no probe, whatever the machine has
  EXPECT_FALSE(roles::device_facts(c10::Device(c10::kCPU), /*probe_fused=*/true).fused_backward);
}
