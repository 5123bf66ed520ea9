// The resolved configuration of a dflash run: one struct tree, loaded from YAML, overridden by
// dotted `key=value` arguments, printed back as YAML.
//
// Owns: every key a user can set, its type, default and one-line doc. The schema is the
// `visit` function of each section: loading, overriding and printing all walk it, so a key
// exists in exactly one place. Loading is strict: an unknown key is a UserError naming the key
// path and the keys allowed there, with a "did you mean" suggestion (edit distance over the
// schema's keys); a wrong type names the key, the value and the expected type. Every error
// about a key names where its value came from: the override argument when it was given on the
// command line, else the YAML file (key_origin).
// Thread-safety: a Config is a plain value; build it once in main and pass it by const ref.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dflash {

struct RunConfig {
  std::string name = "dflash";
  std::string dir = "runs/dflash";  // run directory: metrics.jsonl, checkpoints, logs
  int64_t seed = 42;
  int64_t cpu_threads = 0;  // 0: the node's cores shared among its ranks
  bool overwrite = false;       // start over in a run.dir that holds another run
  bool accept_changes = false;  // --resume although the config's identity keys changed
  template <class V> void visit(V& v) {
    v("name", name, "run name, used in logs");
    v("dir", dir, "run directory: run.json, metrics.jsonl, checkpoints/, exports/, logs/");
    v("seed", seed, "seed of data order, anchors and initialisation");
    v("cpu_threads", cpu_threads, "CPU threads per rank without GPU (0: cores / ranks on the node)");
    v("overwrite", overwrite, "start a new run in a run.dir that holds another run (deletes its state)");
    v("accept_changes", accept_changes, "let --resume continue with changed settings (schedule recomputed)");
  }
};

struct LayoutConfig {
  int64_t target_ranks = 1;
  int64_t drafter_ranks = 1;
  bool colocated = false;
  template <class V> void visit(V& v) {
    v("target_ranks", target_ranks, "ranks 0..T-1 run the target model");
    v("drafter_ranks", drafter_ranks, "ranks T..T+D-1 train the drafter (data parallel)");
    v("colocated", colocated, "one process does both roles in turn (world size 1)");
  }
};

struct CommConfig {
  std::string backend = "auto";  // auto | nccl | mpi
  double timeout_s = 120;
  double startup_timeout_s = 600;
  double grad_bucket_mb = 64;  // 0: one all-reduce after the backward
  template <class V> void visit(V& v) {
    v("backend", backend, "auto (nccl on GPU, mpi on CPU), nccl or mpi");
    v("timeout_s", timeout_s, "deadline of every blocking operation after start-up");
    v("startup_timeout_s", startup_timeout_s, "deadline of rendezvous and the first step");
    v("grad_bucket_mb", grad_bucket_mb,
      "drafter gradients are all-reduced in buckets of at most this many MiB during the backward "
      "(0: in one all-reduce after it)");
  }
};

struct LogConfig {
  std::string level = "info";
  int64_t console_rank = 0;
  bool per_rank_files = false;
  int64_t interval = 10;
  int64_t profile_start = 0;
  int64_t profile_steps = 2;
  template <class V> void visit(V& v) {
    v("level", level, "debug, info, warn or error");
    v("console_rank", console_rank, "rank that prints to the console (-1: every rank)");
    v("per_rank_files", per_rank_files, "also write <run.dir>/logs/rank<N>.log on every rank");
    v("interval", interval, "optimizer steps between metrics lines");
    v("profile_start", profile_start,
      "first step that every rank profiles (host operators, CUDA kernels) into <run.dir>/profile/; 0: off");
    v("profile_steps", profile_steps, "steps in the profiled window");
  }
};

struct TargetConfig {
  std::string model_dir;
  std::vector<int64_t> layer_ids;  // empty: DFLASH.md §1.1 default rule
  int64_t num_features = 5;
  std::string dtype = "auto";  // auto: bf16 on GPU, fp32 on CPU
  template <class V> void visit(V& v) {
    v("model_dir", model_dir, "Hugging Face directory of the target (config.json, *.safetensors)");
    v("layer_ids", layer_ids, "target layers whose outputs are captured (empty: default rule)");
    v("num_features", num_features, "number of captured layers when layer_ids is empty");
    v("dtype", dtype, "auto, bfloat16, float16 or float32");
  }
};

struct DrafterConfig {
  int64_t num_layers = 5;
  int64_t block_size = 16;
  int64_t num_anchors = 512;
  int64_t mask_token_id = -1;  // -1: from the target (Qwen3: 151669)
  double gamma = 0;            // 0: 7 for bs 16, 5 for bs 10, 4 for bs 8 (DFLASH.md §2.4)
  std::string attention = "auto";  // auto | kernel | sdpa
  std::string attention_backward = "auto";  // auto | split | fused (the kernel's backward; attention_choice.h)
  int64_t loss_chunk = 2048;       // draft positions per LM-head chunk
  std::string init_from;           // an exported drafter directory to start from
  template <class V> void visit(V& v) {
    v("num_layers", num_layers, "draft decoder layers");
    v("block_size", block_size, "tokens per block (anchor + block_size-1 predictions)");
    v("num_anchors", num_anchors, "blocks per sequence per step");
    v("mask_token_id", mask_token_id, "id of the MASK token (-1: from the target)");
    v("gamma", gamma, "loss decay; 0 picks DFLASH.md's value for the block size");
    v("attention", attention, "auto (the CUDA block-sparse kernel where it runs, else sdpa), kernel or sdpa (reference)");
    v("attention_backward", attention_backward,
      "auto (fused where it runs and data.max_seq_len >= 16384, else split), split (a dQ pass and a dK/dV pass) or "
      "fused (one pass, Hopper and head_dim 128; faster at long contexts); all deterministic");
    v("loss_chunk", loss_chunk, "draft positions per chunk of the fused LM head + CE (> 0; model/drafter.h)");
    v("init_from", init_from, "exported drafter directory to initialise from (empty: random)");
  }
};

struct DataConfig {
  std::vector<std::string> shards;
  int64_t batch_tokens = 12288;
  int64_t max_seq_len = 3072;
  int64_t prefetch = 2;
  template <class V> void visit(V& v) {
    v("shards", shards, "token shard files or directories (tools/prepare_data.py)");
    v("batch_tokens", batch_tokens, "token budget of one batch (documents are packed)");
    v("max_seq_len", max_seq_len, "longest document; longer ones are truncated");
    v("prefetch", prefetch, "batches in flight per rank");
  }
};

struct TrainConfig {
  double lr = 6e-4;
  double warmup_ratio = 0.04;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double grad_clip = 1.0;
  int64_t epochs = 6;
  int64_t max_steps = -1;  // -1: epochs decide
  int64_t grad_accum = 1;
  template <class V> void visit(V& v) {
    v("lr", lr, "peak learning rate");
    v("warmup_ratio", warmup_ratio, "fraction of steps of linear warm-up, then cosine to 0");
    v("weight_decay", weight_decay, "AdamW weight decay");
    v("beta1", beta1, "AdamW beta1");
    v("beta2", beta2, "AdamW beta2");
    v("eps", eps, "AdamW epsilon");
    v("grad_clip", grad_clip, "global gradient-norm clip (0: off)");
    v("epochs", epochs, "passes over the data");
    v("max_steps", max_steps, "stop after this many optimizer steps (-1: epochs decide)");
    v("grad_accum", grad_accum, "batches per drafter rank per optimizer step");
  }
};

struct CheckpointConfig {
  int64_t export_every = 1000;
  int64_t state_every = 1000;
  int64_t keep_last = 3;
  template <class V> void visit(V& v) {
    v("export_every", export_every, "steps between Hugging Face exports (and one at the end)");
    v("state_every", state_every, "steps between resumable training states");
    v("keep_last", keep_last, "training states kept");
  }
};

struct EvalConfig {
  std::string drafter_dir;
  std::string prompts;
  int64_t max_new_tokens = 256;
  int64_t batch_size = 16;
  int64_t block_size = 0;  // 0: the drafter's
  double temperature = 0;
  int64_t seed = -1;       // -1: run.seed
  bool stop_at_eos = true;
  std::vector<int64_t> stop_token_ids;
  std::string out;
  std::string device = "auto";
  bool baseline = true;
  int64_t max_prompts = 0;
  int64_t every = 0;
  int64_t rank = -1;
  template <class V> void visit(V& v) {
    v("drafter_dir", drafter_dir, "exported drafter to evaluate (dflash_rank eval; training uses the live one)");
    v("prompts", prompts, "JSONL of {\"input_ids\": [...]} prompts (tools/prepare_prompts.py renders chat)");
    v("max_new_tokens", max_new_tokens, "new tokens per prompt");
    v("batch_size", batch_size, "prompts decoded together (rows advance independently)");
    v("block_size", block_size, "tokens per verify block (0: the drafter's block_size)");
    v("temperature", temperature, "0: greedy; > 0: seeded sampling, target-only acceptance rule");
    v("seed", seed, "seed of the sampler (-1: run.seed)");
    v("stop_at_eos", stop_at_eos, "stop a prompt at the target's eos ids (config/generation_config.json)");
    v("stop_token_ids", stop_token_ids, "more token ids that end a prompt's output");
    v("out", out, "JSON report path (empty: <run.dir>/eval.json; training: <run.dir>/eval/)");
    v("device", device, "dflash_rank eval: auto (cuda:0 if present, else cpu), cpu, cuda or cuda:N");
    v("baseline", baseline, "also decode without the drafter (speedup, equal-output rate)");
    v("max_prompts", max_prompts, "use only the first N prompts (0: all)");
    v("every", every, "training: optimizer steps between evals (0: off)");
    v("rank", rank, "training: rank that runs the eval (-1: target rank 0; colocated: the process)");
  }
};

struct Config {
  RunConfig run;
  LayoutConfig layout;
  CommConfig comm;
  LogConfig log;
  TargetConfig target;
  DrafterConfig drafter;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  EvalConfig eval;
  template <class V> void visit(V& v) {
    v.section("run", run);
    v.section("layout", layout);
    v.section("comm", comm);
    v.section("log", log);
    v.section("target", target);
    v.section("drafter", drafter);
    v.section("data", data);
    v.section("train", train);
    v.section("checkpoint", checkpoint);
    v.section("eval", eval);
  }

  // Where the values came from (not keys; not printed): the YAML file ("" for the defaults)
  // and the command-line overrides, and for each key an override set, that override's text.
  std::string source_path;
  std::vector<std::string> overrides;
  std::map<std::string, std::string> overridden;  // "train.lr" -> "train.lr=1e-3"
};

// Where `key`'s value came from, for error messages: "override 'train.lr=-1'" when the command
// line set it, else "config FILE" (or "config (defaults)").
std::string key_origin(const Config& cfg, const std::string& key);
// Every dotted key of the schema ("run.name", ..., "checkpoint.keep_last"), in schema order.
std::vector<std::string> config_keys();
// The closest of `candidates` to `word` by edit distance (at most 1/3 of its length, min 2) as
// "; did you mean 'X'?", else "".
std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates);
// The sections and their keys, one line each ("  train       lr, warmup_ratio, ..."), for --help.
std::string config_sections_help();
// The paths of the config exist: target.model_dir and drafter.init_from (when set) directories,
// every data.shards entry a file or directory. UserError naming the key and its origin.
void check_paths(const Config& cfg);

// Loads `path` (strict, duplicate keys refused), then applies `overrides` ("a.b=value", value
// parsed as YAML), then checks every value's range (trainer/config/validate.h).
// Errors: UserError naming the file, key, value and what was expected.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
// Same from YAML text (tests, embedded defaults); `origin` names it in messages.
Config parse_config(const std::string& yaml_text, const std::string& origin,
                    const std::vector<std::string>& overrides);
// The resolved config as YAML, every key present.
std::string to_yaml(const Config& cfg);

}  // namespace dflash
