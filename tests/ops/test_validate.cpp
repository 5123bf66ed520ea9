// Config validation (trainer/config/validate.h), table-driven: every value class that could
// remove a deadline, hang, allocate without bound or write to the wrong place is refused by
// parse_config with one line naming the key and where the value came from (file or override);
// duplicate YAML keys name both lines. Also the config.json range checks of targets and drafter
// exports (trainer/model/hf_config.cpp, DrafterSpec::validate) and the finiteness check of
// loaded tensors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/error.h"
#include "trainer/config.h"
#include "trainer/config/identity.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/safetensors.h"

using dflash::parse_config;
using dflash::UserError;

namespace {

std::string error_of(const std::string& yaml, const std::vector<std::string>& ov = {}) {
  try {
    parse_config(yaml, "t.yaml", ov);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

struct Bad {
  std::string key;    // dotted key
  std::string value;  // YAML scalar
};

// One bad value per row; each is tried once from the file and once as an override.
const std::vector<Bad> kBad = {
    // timeouts: NaN, inf, negative, 0 and beyond a week all remove or defeat the deadline
    {"comm.timeout_s", "nan"}, {"comm.timeout_s", "inf"}, {"comm.timeout_s", "-1"}, {"comm.timeout_s", "0"},
    {"comm.timeout_s", "1e300"}, {"comm.startup_timeout_s", "nan"}, {"comm.startup_timeout_s", "-inf"},
    // gradient buckets: negative, NaN, infinite, beyond 1 TiB
    {"comm.grad_bucket_mb", "-1"}, {"comm.grad_bucket_mb", "nan"}, {"comm.grad_bucket_mb", "inf"},
    {"comm.grad_bucket_mb", "1e12"},
    // threads, ranks
    {"run.cpu_threads", "1000000"}, {"run.cpu_threads", "-1"}, {"layout.target_ranks", "0"},
    {"layout.drafter_ranks", "100000000"},
    // steps and sizes that would allocate without bound
    {"train.max_steps", "1000000000000"}, {"train.max_steps", "0"}, {"train.max_steps", "-5"},
    {"train.grad_accum", "0"}, {"train.grad_accum", "100000000"}, {"train.epochs", "-1"},
    {"train.epochs", "1000000000"}, {"drafter.num_layers", "0"}, {"drafter.num_layers", "100000"},
    {"drafter.num_anchors", "0"}, {"drafter.num_anchors", "1000000000"}, {"drafter.block_size", "1"},
    {"drafter.block_size", "100000"}, {"drafter.loss_chunk", "0"}, {"data.batch_tokens", "0"},
    {"data.batch_tokens", "10000000000"}, {"data.max_seq_len", "10000000000"}, {"data.prefetch", "0"},
    {"data.prefetch", "100000"}, {"target.num_features", "0"}, {"target.num_features", "1000"},
    {"drafter.mask_token_id", "-2"}, {"drafter.gamma", "nan"}, {"drafter.gamma", "-1"},
    // optimizer
    {"train.lr", "nan"}, {"train.lr", "inf"}, {"train.lr", "-1e-3"}, {"train.lr", "0"}, {"train.lr", "5"},
    {"train.beta1", "1.5"}, {"train.beta1", "1"}, {"train.beta2", "-0.1"}, {"train.beta2", "nan"},
    {"train.eps", "0"}, {"train.eps", "-1e-8"}, {"train.grad_clip", "-1"}, {"train.grad_clip", "nan"},
    {"train.weight_decay", "-0.1"}, {"train.weight_decay", "inf"}, {"train.warmup_ratio", "1.5"},
    {"train.warmup_ratio", "-0.1"}, {"train.warmup_ratio", "nan"},
    // checkpoints, logs
    {"checkpoint.state_every", "-1"}, {"checkpoint.export_every", "-1"}, {"checkpoint.keep_last", "-3"},
    {"log.interval", "0"}, {"log.console_rank", "-2"}, {"run.seed", "-1"},
    // enums and paths
    {"log.level", "loud"}, {"target.dtype", "int8"}, {"comm.backend", "gloo"}, {"drafter.attention", "flash"},
    {"run.dir", "\"\""}, {"run.dir", "/"}, {"run.dir", "///"}, {"run.name", "\"\""},
};

std::string yaml_of(const Bad& b) {
  const auto dot = b.key.find('.');
  return b.key.substr(0, dot) + ":\n  " + b.key.substr(dot + 1) + ": " + b.value + "\n";
}

}  // namespace

TEST(Validate, EveryBadValueFromTheFileNamesKeyAndFile) {
  for (const Bad& b : kBad) {
    const std::string e = error_of(yaml_of(b));
    EXPECT_NE(e.find("config t.yaml: key '" + b.key + "'"), std::string::npos) << b.key << "=" << b.value << ": " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;  // one line
  }
}

TEST(Validate, EveryBadValueFromAnOverrideNamesTheOverride) {
  for (const Bad& b : kBad) {
    const std::string ov = b.key + "=" + b.value;
    const std::string e = error_of("", {ov});
    EXPECT_NE(e.find("override '" + ov + "': key '" + b.key + "'"), std::string::npos) << ov << ": " << e;
  }
}

TEST(Validate, MessageSaysWhatIsExpected) {
  EXPECT_NE(error_of("", {"comm.timeout_s=nan"}).find("must be a finite number of seconds in (0, 604800], got nan"),
            std::string::npos);
  EXPECT_NE(error_of("train: {beta1: 1.5}").find("must be in [0, 1), got 1.5"), std::string::npos);
  EXPECT_NE(error_of("", {"comm.grad_bucket_mb=-1"})
                .find("key 'comm.grad_bucket_mb' must be 0 (one all-reduce after the backward) or a finite bucket "
                      "size in MiB in (0, 1048576], got -1"),
            std::string::npos)
      << error_of("", {"comm.grad_bucket_mb=-1"});
  EXPECT_NE(error_of("", {"run.cpu_threads=1000000"}).find("hardware threads"), std::string::npos);
  EXPECT_NE(error_of("", {"run.dir=\"\""}).find("an empty run.dir would put"), std::string::npos);
  EXPECT_NE(error_of("", {"train.max_steps=1000000000000"}).find("-1 (epochs decide) or a step count in [1, 10000000]"),
            std::string::npos);
  // an override of a value that is fine in the file is blamed on the override, the file on the file
  EXPECT_NE(error_of("train: {lr: 1e-3}\n", {"train.lr=-1"}).find("override 'train.lr=-1'"), std::string::npos);
  EXPECT_NE(error_of("train: {lr: -1}\n", {"train.beta1=0.8"}).find("config t.yaml: key 'train.lr'"),
            std::string::npos);
  // a list element names its index
  EXPECT_NE(error_of("data: {shards: [a, \"\"]}\n").find("key 'data.shards[1]'"), std::string::npos);
  EXPECT_NE(error_of("target: {layer_ids: [1, -3]}\n").find("key 'target.layer_ids[1]'"), std::string::npos);
}

TEST(Validate, GoodValuesAtTheEdgesPass) {
  // the limits themselves are allowed: a check that refused everything would fail here
  auto c = parse_config("comm: {timeout_s: 604800, startup_timeout_s: 0.5, grad_bucket_mb: 0}\ntrain: {lr: 1, beta1: 0, beta2: 0.999999,"
                        " warmup_ratio: 1, weight_decay: 0, grad_clip: 0, max_steps: 10000000, grad_accum: 4096}\n"
                        "drafter: {block_size: 2, num_layers: 256, mask_token_id: -1, gamma: 0}\n"
                        "checkpoint: {state_every: 0, export_every: 0, keep_last: 0}\nrun: {cpu_threads: 0}\n",
                        "t.yaml", {"run.dir=/tmp/x", "train.max_steps=-1", "log.console_rank=-1"});
  EXPECT_DOUBLE_EQ(c.comm.timeout_s, 604800);
  EXPECT_EQ(c.comm.grad_bucket_mb, 0);  // the old path: one all-reduce after the backward
  EXPECT_DOUBLE_EQ(parse_config("comm: {grad_bucket_mb: 1048576}\n", "t.yaml", {}).comm.grad_bucket_mb, 1048576);
  EXPECT_DOUBLE_EQ(parse_config("", "t.yaml", {}).comm.grad_bucket_mb, 64);  // the default
  EXPECT_EQ(c.train.max_steps, -1);
  EXPECT_EQ(c.run.dir, "/tmp/x");
}

TEST(Validate, DuplicateKeysNameTheKeyAndBothLines) {
  std::string e = error_of("train:\n  lr: 1e-3\n  epochs: 2\n  lr: 5\n");
  EXPECT_NE(e.find("config t.yaml: key 'train.lr' is given twice (lines 2 and 4)"), std::string::npos) << e;
  e = error_of("run: {dir: a}\ntrain: {lr: 1e-3}\nrun: {dir: b}\n");
  EXPECT_NE(e.find("key 'run' is given twice (lines 1 and 3)"), std::string::npos) << e;
  // the same key in different sections is not a duplicate
  EXPECT_EQ(error_of("log: {interval: 3}\ncheckpoint: {state_every: 3}\n"), "");
}

// ---- config.json of a target: ranges before anything is allocated ---------------------------
namespace {
// A valid tiny qwen3 config.json with `key` set to `value` (JSON text); the parse error or "".
std::string hf_error(const std::string& key = "", const std::string& value = "") {
  std::map<std::string, std::string> kv = {
      {"model_type", "\"qwen3\""}, {"hidden_size", "64"}, {"num_hidden_layers", "6"}, {"num_attention_heads", "4"},
      {"num_key_value_heads", "2"}, {"head_dim", "16"}, {"intermediate_size", "128"}, {"vocab_size", "512"}};
  if (!key.empty()) kv[key] = value;
  std::string j = "{";
  for (const auto& [k, v] : kv) j += (j.size() > 1 ? ", \"" : "\"") + k + "\": " + v;
  j += "}";
  try {
    dflash::model::parse_hf_config(j, "m/config.json");
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Validate, TargetConfigJsonRanges) {
  EXPECT_EQ(hf_error(), "");
  struct Row {
    const char* key;
    const char* value;
    const char* needle;
  };
  const Row rows[] = {
      {"num_hidden_layers", "1000000", "key 'num_hidden_layers' must be at most 1024"},
      {"hidden_size", "100000000", "key 'hidden_size' must be at most 65536"},
      {"intermediate_size", "1000000000", "key 'intermediate_size' must be at most"},
      {"vocab_size", "10000000000", "key 'vocab_size' must be at most"},
      {"num_attention_heads", "100000", "key 'num_attention_heads' must be at most"},
      {"head_dim", "0", "key 'head_dim' must be positive"},
      {"rope_theta", "1e999", "key 'rope_theta' must be a finite number"},
      {"rope_theta", "-5", "key 'rope_theta' must be a finite number"},
      {"rope_parameters", R"({"rope_type": "default", "rope_theta": 0})", "key 'rope_parameters'.rope_theta must be a finite number"},
      {"rms_norm_eps", "1e999", "key 'rms_norm_eps' must be a finite number in (0, 1)"},
  };
  for (const Row& r : rows) {
    const std::string e = hf_error(r.key, r.value);
    EXPECT_NE(e.find(std::string("m/config.json: ") + r.needle), std::string::npos) << r.key << ": " << e;
  }
}

TEST(Validate, NonFiniteTensorsNameFileAndTensor) {
  at::Tensor t = at::ones({4, 4});
  EXPECT_NO_THROW(dflash::st::check_finite(t, "f.safetensors", "w"));
  t[1][2] = std::numeric_limits<float>::quiet_NaN();
  t[3][0] = std::numeric_limits<float>::infinity();
  try {
    dflash::st::check_finite(t, "f.safetensors", "layers.0.w");
    FAIL() << "NaN passed";
  } catch (const UserError& e) {
    EXPECT_NE(std::string(e.what()).find("'f.safetensors': tensor 'layers.0.w' holds 1 NaN and 1 infinite value(s) of 16"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(dflash::st::check_finite(at::zeros({3}, at::kLong), "f", "ids"));
}

// The identity of a run (trainer/config/identity.h): what it computes, not how it is watched.
TEST(Identity, WatchingAndPlacementKeysAreNotIdentity) {
  for (const char* k : {"log.interval", "comm.timeout_s", "checkpoint.state_every", "eval.every", "eval.prompts",
                        "run.name", "run.dir", "run.cpu_threads", "run.overwrite", "run.accept_changes",
                        "drafter.attention", "drafter.attention_backward", "drafter.loss_chunk"})
    EXPECT_FALSE(dflash::is_identity_key(k)) << k;
  for (const char* k : {"train.lr", "train.max_steps", "drafter.num_layers", "data.shards", "run.seed",
                        "layout.target_ranks", "target.model_dir", "drafter.num_anchors", "drafter.block_size"})
    EXPECT_TRUE(dflash::is_identity_key(k)) << k;
}

// A config recorded by an older build (fewer keys, another default) is compared under this build's rules.
TEST(Identity, RecordedConfigIsResolvedAgainByThisBuild) {
  const std::string now = dflash::to_yaml(dflash::parse_config("", "t.yaml", {"train.lr=0.002"}));
  // that build had no drafter.gamma and ran the split backward by default
  std::string old;
  for (size_t at = 0, nl; at < now.size(); at = nl + 1) {
    nl = now.find('\n', at);
    if (nl == std::string::npos) nl = now.size();
    const std::string line = now.substr(at, nl - at);
    if (line.find("gamma:") == std::string::npos) old += line + "\n";
  }
  ASSERT_NE(old, now);
  const auto pos = old.find("attention_backward: \"auto\"");
  ASSERT_NE(pos, std::string::npos) << old;
  old.replace(pos, 26, "attention_backward: \"split\"");
  EXPECT_NE(dflash::identity_hash_of_yaml(old, "old"), dflash::identity_hash_of_yaml(now, "now"));  // as written
  const std::string again = dflash::reresolved_yaml(old, "old");
  EXPECT_EQ(dflash::identity_hash_of_yaml(again, "old"), dflash::identity_hash_of_yaml(now, "now"));
  EXPECT_TRUE(dflash::identity_changes(again, now, "old").empty());
  // a real change stays one
  const std::string lr = dflash::reresolved_yaml(dflash::to_yaml(dflash::parse_config("", "t.yaml", {})), "old");
  const auto ch = dflash::identity_changes(lr, now, "old");
  ASSERT_EQ(ch.size(), 1u);
  EXPECT_EQ(ch[0].key, "train.lr");
  // a key this build does not know: compared as written (the caller names it as a change)
  const std::string unknown = "bogus_section:\n  x: 1\n" + now;
  EXPECT_EQ(dflash::reresolved_yaml(unknown, "old"), unknown);
}
