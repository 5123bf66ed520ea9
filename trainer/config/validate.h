// Validation of a resolved Config before anything is allocated or written (docs/training.md
// "Configuration"), and of the YAML text's shape (duplicate keys).
//
// Owns: the range of every key: type is checked while loading (trainer/config.cpp); here every
// number is checked for finiteness and a sane range (so that no value removes a deadline, hangs
// creating threads, or allocates until memory runs out), every enum for its allowed names, and
// run.dir for being a usable directory name. Each error is one UserError line naming the key,
// where its value came from (key_origin: the YAML file or the command-line override) and what was expected.
// The limits are constants below, documented in docs/training.md.
// Thread-safety: stateless functions.
#pragma once

#include <string>

#include "trainer/config.h"

namespace YAML {
class Node;
}

namespace dflash {

// Limits (documented in docs/training.md "Limits").
namespace limits {
constexpr double kMaxTimeoutS = 7 * 24 * 3600.0;  // a week: beyond that a deadline is no deadline
constexpr int64_t kMaxCpuThreads = 1024;           // also at most 4 x the hardware threads
constexpr int64_t kMaxRanks = 65536;
constexpr int64_t kMaxSteps = 10'000'000;
constexpr int64_t kMaxEpochs = 10'000;
constexpr int64_t kMaxGradAccum = 4096;
constexpr int64_t kMaxDrafterLayers = 256;
constexpr int64_t kMaxBlockSize = 256;
constexpr int64_t kMaxAnchors = 65536;
constexpr int64_t kMaxBatchTokens = 1 << 24;  // 16 Mi tokens per batch
constexpr int64_t kMaxSeqLen = 1 << 24;
constexpr int64_t kMaxLossChunk = 1 << 24;
constexpr int64_t kMaxPrefetch = 64;
constexpr int64_t kMaxFeatures = 64;
constexpr int64_t kMaxEvery = 1'000'000'000;  // log.interval, checkpoint.*_every, keep_last
constexpr double kMaxGradBucketMb = 1 << 20;  // comm.grad_bucket_mb: 1 TiB, more than any drafter
}  // namespace limits

// Throws UserError for the first value out of range (see above).
void validate_config(const Config& cfg);

// Throws UserError naming the key path and both lines if a mapping anywhere in `root` holds the
// same key twice (yaml-cpp keeps the first silently).
void check_duplicate_keys(const YAML::Node& root, const std::string& origin);

}  // namespace dflash
