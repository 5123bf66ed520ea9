// The training data as a stream of packed batches, numbered globally k = 0, 1, 2, ...
//
// Owns: the opened shards (trainer/data/shard.h), a global document index over them, and the
// per-epoch plans. The documents of epoch e are visited in a permutation that is a pure
// function of (seed, e) (own splitmix64 + Fisher-Yates, the same on every platform); they are
// packed greedily into batches of at most data.batch_tokens tokens (a document longer than
// data.max_seq_len is truncated to it; empty documents are skipped; the trailing, partial
// batch of an epoch is dropped). Batches are numbered continuously across epochs, so batch k
// depends only on (seed, k) — through its epoch and its index inside that epoch — and any rank
// computes any batch from the shards' document offsets alone, without reading other batches.
// Data that cannot fill one batch is a UserError (raised by the constructor, so on every rank).
// Thread-safety: all methods may be called from several threads (plans are built under a
// mutex); the returned Batch owns its tensors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/data/shard.h"

namespace dflash::data {

// One packed batch. Document i of the batch spans ids[cu_seqlens[i] : cu_seqlens[i+1]].
struct Batch {
  int64_t index = -1;     // global batch index k
  int64_t epoch = 0;
  at::Tensor ids;         // [T] int64
  at::Tensor loss_mask;   // [T] uint8, 1 = supervised (assistant) token
  at::Tensor cu_seqlens;  // [n_docs + 1] int64, starting at 0, ending at T
  int64_t num_tokens() const;
  int64_t num_docs() const;
  int64_t num_supervised() const;  // sum of loss_mask
};

struct DataOptions {
  std::vector<std::string> shards;  // files or directories (see expand_shard_paths)
  int64_t batch_tokens = 12288;
  int64_t max_seq_len = 3072;
  int64_t seed = 42;
  int64_t vocab_limit = 0;          // > 0: every token id must be below it (the target's vocab)
};

class Dataset {
 public:
  // Opens and validates every shard. UserError on a bad shard, bad options, or data smaller
  // than one batch.
  explicit Dataset(DataOptions opt);

  const DataOptions& options() const { return opt_; }
  const std::vector<std::string>& shard_paths() const { return paths_; }
  int64_t num_docs() const { return total_docs_; }
  int64_t num_tokens() const { return total_tokens_; }

  int64_t batches_in_epoch(int64_t epoch) const;
  // Batches in epochs 0..epochs-1.
  int64_t batches_in_epochs(int64_t epochs) const;
  // Global batch k -> (epoch, index inside that epoch).
  std::pair<int64_t, int64_t> locate(int64_t k) const;
  // Global batch k (CPU tensors).
  Batch batch(int64_t k) const;
  // The global document ids of batch k, in order (tests, debugging).
  std::vector<int64_t> batch_documents(int64_t k) const;

  // The permutation of global document ids for an epoch (tests).
  static std::vector<int64_t> document_order(int64_t num_docs, int64_t seed, int64_t epoch);

 private:
  struct Plan {
    std::vector<int64_t> order;   // global document ids in visiting order
    std::vector<int64_t> starts;  // batch b covers order[starts[b] .. starts[b+1]); size batches+1
    int64_t batches() const { return static_cast<int64_t>(starts.size()) - 1; }
  };
  std::shared_ptr<const Plan> plan(int64_t epoch) const;
  std::shared_ptr<const Plan> build_plan(int64_t epoch) const;
  std::pair<const ShardFile*, int64_t> resolve(int64_t global_doc) const;
  int64_t doc_length(int64_t global_doc) const;  // after truncation

  DataOptions opt_;
  std::vector<std::string> paths_;
  std::vector<std::shared_ptr<const ShardFile>> shards_;
  std::vector<int64_t> doc_prefix_;  // global id of each shard's first document; size shards+1
  int64_t total_docs_ = 0, total_tokens_ = 0;

  mutable std::mutex mu_;
  mutable std::map<int64_t, std::shared_ptr<const Plan>> plans_;  // a few recent epochs
  mutable std::vector<int64_t> epoch_batches_;                    // batch counts of epochs 0..n-1
};

}  // namespace dflash::data
