// Range checks of a resolved Config and duplicate-key detection in its YAML (validate.h).
#include "trainer/config/validate.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/files.h"

namespace dflash {

namespace {

struct Check {
  const Config& cfg;
  // list elements ("data.shards[2]") come from the list's key
  std::string of(const std::string& key) const { return key_origin(cfg, key.substr(0, key.find('['))); }

  template <class T>
  [[noreturn]] void fail(const std::string& key, const T& got, const std::string& expected) const {
    throw_user("{}: key '{}' must be {}, got {}", of(key), key, expected, got);
  }
  void int_range(const std::string& key, int64_t v, int64_t lo, int64_t hi, const std::string& what = "") const {
    if (v >= lo && v <= hi) return;
    if (!what.empty()) fail(key, v, what);
    fail(key, v, v < lo && lo == 1 ? std::string("positive") : fmt::format("an integer in [{}, {}]", lo, hi));
  }
  // finite, lo <= v (or lo < v with open_lo) and v <= hi (or v < hi with open_hi)
  void real_range(const std::string& key, double v, double lo, double hi, bool open_lo, bool open_hi,
                  const std::string& what) const {
    const bool ok = std::isfinite(v) && (open_lo ? v > lo : v >= lo) && (open_hi ? v < hi : v <= hi);
    if (!ok) fail(key, v, what);
  }
  void one_of(const std::string& key, const std::string& v, std::initializer_list<const char*> allowed) const {
    for (const char* a : allowed)
      if (v == a) return;
    fail(key, fmt::format("'{}'", v), fmt::format("one of {}", fmt::join(allowed, ", ")));
  }
};

void check_run_dir(const Check& c, const std::string& dir) {
  const std::string key = "run.dir";
  if (dir.empty()) c.fail(key, "an empty path", "a directory path (an empty run.dir would put checkpoints/ and exports/ under /)");
  if (dir.find_first_not_of('/') == std::string::npos)
    c.fail(key, fmt::format("'{}'", dir), "a directory below the root, not the root itself");
  if (dir.find_first_of(std::string("\n\r\0", 3)) != std::string::npos)
    c.fail(key, "a path with a line break", "a directory path on one line");
  if (files::exists(dir) && !files::is_dir(dir))
    c.fail(key, fmt::format("'{}', an existing file", dir), "a directory (or a path that does not exist yet)");
}

}  // namespace

void validate_config(const Config& cfg) {
  Check c{cfg};
  using namespace limits;
  // run
  if (cfg.run.name.empty()) c.fail("run.name", "an empty name", "a non-empty name");
  check_run_dir(c, cfg.run.dir);
  c.int_range("run.seed", cfg.run.seed, 0, INT64_MAX, "an integer >= 0");
  const int64_t hw = std::max<int64_t>(1, static_cast<int64_t>(std::thread::hardware_concurrency()));
  const int64_t max_threads = std::min(kMaxCpuThreads, 4 * hw);
  c.int_range("run.cpu_threads", cfg.run.cpu_threads, 0, max_threads,
              fmt::format("0 (automatic) or at most {} (4 x the {} hardware threads, at most {})", max_threads, hw,
                          kMaxCpuThreads));
  // layout
  c.int_range("layout.target_ranks", cfg.layout.target_ranks, 1, kMaxRanks);
  c.int_range("layout.drafter_ranks", cfg.layout.drafter_ranks, 1, kMaxRanks);
  // comm: a NaN, infinite, zero or negative deadline would remove the deadline
  c.one_of("comm.backend", cfg.comm.backend, {"auto", "nccl", "mpi"});
  const std::string secs = fmt::format("a finite number of seconds in (0, {:.0f}]", kMaxTimeoutS);
  c.real_range("comm.timeout_s", cfg.comm.timeout_s, 0, kMaxTimeoutS, true, false, secs);
  c.real_range("comm.startup_timeout_s", cfg.comm.startup_timeout_s, 0, kMaxTimeoutS, true, false, secs);
  c.real_range("comm.grad_bucket_mb", cfg.comm.grad_bucket_mb, 0, kMaxGradBucketMb, false, false,
               fmt::format("0 (one all-reduce after the backward) or a finite bucket size in MiB in (0, {:.0f}]",
                           kMaxGradBucketMb));
  // log
  c.one_of("log.level", cfg.log.level, {"debug", "info", "warn", "error"});
  c.int_range("log.console_rank", cfg.log.console_rank, -1, kMaxRanks - 1, "-1 (every rank) or a rank >= 0");
  c.int_range("log.interval", cfg.log.interval, 1, kMaxEvery);
  c.int_range("log.profile_start", cfg.log.profile_start, 0, kMaxEvery, "0 (off) or a step >= 1");
  c.int_range("log.profile_steps", cfg.log.profile_steps, 1, 1000, "a step count from 1 to 1000");
  // target
  for (size_t i = 0; i < cfg.target.layer_ids.size(); ++i)
    c.int_range(fmt::format("target.layer_ids[{}]", i), cfg.target.layer_ids[i], 0, 4095, "a layer index >= 0");
  if (cfg.target.layer_ids.size() > static_cast<size_t>(kMaxFeatures))
    c.fail("target.layer_ids", fmt::format("{} entries", cfg.target.layer_ids.size()),
           fmt::format("at most {} layers", kMaxFeatures));
  c.int_range("target.num_features", cfg.target.num_features, 1, kMaxFeatures);
  c.one_of("target.dtype", cfg.target.dtype, {"auto", "bfloat16", "float16", "float32"});
  // drafter
  c.int_range("drafter.num_layers", cfg.drafter.num_layers, 1, kMaxDrafterLayers);
  c.int_range("drafter.block_size", cfg.drafter.block_size, 2, kMaxBlockSize);
  c.int_range("drafter.num_anchors", cfg.drafter.num_anchors, 1, kMaxAnchors);
  c.int_range("drafter.mask_token_id", cfg.drafter.mask_token_id, -1, (1 << 24) - 1,
              "-1 (from the target) or a token id >= 0");
  c.real_range("drafter.gamma", cfg.drafter.gamma, 0, 1e6, false, false,
               "0 (DFLASH.md's value) or a finite number > 0");
  c.one_of("drafter.attention", cfg.drafter.attention, {"auto", "kernel", "sdpa"});
  c.one_of("drafter.attention_backward", cfg.drafter.attention_backward, {"auto", "split", "fused"});
  c.int_range("drafter.loss_chunk", cfg.drafter.loss_chunk, 1, kMaxLossChunk);
  // data
  for (size_t i = 0; i < cfg.data.shards.size(); ++i)
    if (cfg.data.shards[i].empty()) c.fail(fmt::format("data.shards[{}]", i), "an empty path", "a file or directory");
  c.int_range("data.batch_tokens", cfg.data.batch_tokens, 1, kMaxBatchTokens);
  c.int_range("data.max_seq_len", cfg.data.max_seq_len, 1, kMaxSeqLen);
  c.int_range("data.prefetch", cfg.data.prefetch, 1, kMaxPrefetch);
  // train
  c.real_range("train.lr", cfg.train.lr, 0, 1, true, false, "a finite learning rate in (0, 1]");
  c.real_range("train.warmup_ratio", cfg.train.warmup_ratio, 0, 1, false, false, "a fraction in [0, 1]");
  c.real_range("train.weight_decay", cfg.train.weight_decay, 0, 1e3, false, false, "a finite number >= 0");
  c.real_range("train.beta1", cfg.train.beta1, 0, 1, false, true, "in [0, 1)");
  c.real_range("train.beta2", cfg.train.beta2, 0, 1, false, true, "in [0, 1)");
  c.real_range("train.eps", cfg.train.eps, 0, 1, true, false, "a finite number in (0, 1]");
  c.real_range("train.grad_clip", cfg.train.grad_clip, 0, 1e12, false, false, "0 (off) or a finite norm > 0");
  c.int_range("train.epochs", cfg.train.epochs, 0, kMaxEpochs);
  if (cfg.train.max_steps != -1)
    c.int_range("train.max_steps", cfg.train.max_steps, 1, kMaxSteps,
                fmt::format("-1 (epochs decide) or a step count in [1, {}]", kMaxSteps));
  c.int_range("train.grad_accum", cfg.train.grad_accum, 1, kMaxGradAccum);
  // checkpoint
  c.int_range("checkpoint.export_every", cfg.checkpoint.export_every, 0, kMaxEvery, "0 (off) or a step count > 0");
  c.int_range("checkpoint.state_every", cfg.checkpoint.state_every, 0, kMaxEvery, "0 (off) or a step count > 0");
  c.int_range("checkpoint.keep_last", cfg.checkpoint.keep_last, 0, kMaxEvery, "0 (keep all) or a count > 0");
  // eval (dflash_rank eval and evaluation during training; the drafter-dependent block size is
  // checked against the drafter by trainer/eval)
  const auto& e = cfg.eval;
  c.int_range("eval.max_new_tokens", e.max_new_tokens, 1, kMaxSeqLen);
  c.int_range("eval.batch_size", e.batch_size, 1, kMaxAnchors);
  if (e.block_size != 0)
    c.int_range("eval.block_size", e.block_size, 2, kMaxBlockSize, fmt::format("0 (the drafter's) or in [2, {}]", kMaxBlockSize));
  c.real_range("eval.temperature", e.temperature, 0, 1e3, false, false, "0 (greedy) or a finite temperature > 0");
  c.int_range("eval.seed", e.seed, -1, INT64_MAX, "-1 (run.seed) or an integer >= 0");
  c.int_range("eval.max_prompts", e.max_prompts, 0, INT64_MAX, "0 (all) or a count > 0");
  c.int_range("eval.every", e.every, 0, kMaxEvery, "0 (off) or a step count > 0");
  c.int_range("eval.rank", e.rank, -1, kMaxRanks - 1, "-1 (automatic) or a rank >= 0");
  for (size_t i = 0; i < e.stop_token_ids.size(); ++i)
    c.int_range(fmt::format("eval.stop_token_ids[{}]", i), e.stop_token_ids[i], 0, (1 << 24) - 1, "a token id >= 0");
}

namespace {

void walk_duplicates(const YAML::Node& n, const std::string& path, const std::string& origin) {
  if (n.IsSequence()) {
    for (size_t i = 0; i < n.size(); ++i) walk_duplicates(n[i], fmt::format("{}[{}]", path, i), origin);
    return;
  }
  if (!n.IsMap()) return;
  std::map<std::string, int> first_line;  // key -> 1-based line (0: unknown)
  for (const auto& kv : n) {
    const std::string k = kv.first.IsScalar() ? kv.first.Scalar() : "(a non-scalar key)";
    const int line = kv.first.Mark().is_null() ? 0 : kv.first.Mark().line + 1;
    const std::string full = path.empty() ? k : path + "." + k;
    auto [it, fresh] = first_line.emplace(k, line);
    if (!fresh) {
      if (it->second > 0 && line > 0)
        throw_user("{}: key '{}' is given twice (lines {} and {}); keep one", origin, full, it->second, line);
      throw_user("{}: key '{}' is given twice; keep one", origin, full);
    }
    walk_duplicates(kv.second, full, origin);
  }
}

}  // namespace

void check_duplicate_keys(const YAML::Node& root, const std::string& origin) {
  if (root) walk_duplicates(root, "", origin);
}

}  // namespace dflash
