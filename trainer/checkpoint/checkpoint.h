// Resumable training states and Hugging Face exports in the run directory (docs/training.md).
//
//   <run.dir>/checkpoints/step-00000200/      one complete state, written as step-00000200.tmp/
//       meta.json                              and renamed when every rank's part is in:
//       config.yaml                            step, global batch cursor, layout, signature
//       optimizer.safetensors                  (drafter rank 0) parameters + AdamW state
//       rank-00002.safetensors, ...            (every drafter rank) its RNG state
//   <run.dir>/checkpoints/latest               "step-00000200", replaced atomically
//   <run.dir>/exports/step-00000200/, final/   config.json + model.safetensors (DFLASH.md §5)
//
// Protocol (roles/ drives it): every drafter rank writes its files into the .tmp directory,
// the drafter group meets at a barrier, then drafter rank 0 writes meta.json last, renames the
// directory, rewrites `latest` and prunes to checkpoint.keep_last. A crash at any point leaves
// either the previous complete state or the new one; a directory without a readable meta.json
// (or missing a listed file) is never resumed from. Target ranks hold no state: they restart
// at the drafters' batch cursor. A state is refused (UserError saying which value differs) if
// it was written with another world size, layout, grad_accum, seed or data stream.
// Thread-safety: plain functions; call from the rank's main thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "trainer/optim/adamw.h"

namespace dflash::ckpt {

// What must be equal for a state to be resumed: the layout and the batch stream.
struct RunSignature {
  int64_t world_size = 1;
  int64_t target_ranks = 1;
  int64_t drafter_ranks = 1;
  bool colocated = false;
  int64_t grad_accum = 1;
  int64_t seed = 0;
  int64_t batch_tokens = 0;
  int64_t max_seq_len = 0;
  int64_t data_docs = 0;    // documents in data.shards
  int64_t data_tokens = 0;  // tokens in data.shards
};

struct StateMeta {
  int64_t step = 0;         // optimizer steps completed
  int64_t next_batch = 0;   // global batch cursor: the first batch not yet trained on
  int64_t total_steps = 0;  // of the run that wrote it (informative)
  std::string config_hash;  // identity hash of the config that wrote it (config/identity.h); "" from older builds
  RunSignature sig;
  std::vector<std::string> files;  // besides meta.json; all must exist for the state to count
};

std::string checkpoints_dir(const std::string& run_dir);
std::string state_dir(const std::string& run_dir, int64_t step);      // .../step-%08d
std::string state_tmp_dir(const std::string& run_dir, int64_t step);  // .../step-%08d.tmp
std::string export_dir(const std::string& run_dir, int64_t step);     // <run>/exports/step-%08d
std::string final_export_dir(const std::string& run_dir);             // <run>/exports/final

// File names inside a state directory.
std::string rank_file(int rank);  // rank-%05d.safetensors
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kMetaFile = "meta.json";
constexpr const char* kConfigFile = "config.yaml";

// Every drafter rank: creates the tmp directory if needed and writes its rank file (the CPU
// RNG state). Drafter rank 0 also writes optimizer.safetensors (parameters + `opt` state).
void write_rank_state(const std::string& tmp_dir, int rank, int64_t step, const optim::AdamW* opt);

// Drafter rank 0, after every drafter rank's write_rank_state returned: meta.json (last), the
// rename, `latest`, pruning to keep_last complete states and removing older leftover .tmp dirs.
void commit_state(const std::string& run_dir, const StateMeta& meta, const std::string& config_yaml,
                  int64_t keep_last);

// The newest complete state of `run_dir` (`latest` if it names a complete state, else the highest
// complete step directory; a warning is logged when falling back), or nullopt if there is none.
// `dir_out` receives its directory.
std::optional<StateMeta> find_latest_state(const std::string& run_dir, std::string* dir_out);
// A state's meta.json, or nullopt if the directory is not a complete state.
std::optional<StateMeta> read_state(const std::string& dir);

// UserError naming `dir` and every value that differs between the state and this run.
void check_resumable(const StateMeta& meta, const RunSignature& now, const std::string& dir);

// Restores this rank's RNG state and, with `opt`, the parameters and optimizer state (from
// optimizer.safetensors, written by drafter rank 0; every drafter rank loads it).
void load_rank_state(const std::string& dir, int rank, optim::AdamW* opt, int64_t step);

}  // namespace dflash::ckpt
