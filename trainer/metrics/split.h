// The T : D split a run recommends, from its own measured supply and demand.
//
// A target rank supplies s tokens/s (its capture forward, measured as tokens / busy seconds); a
// drafter rank consumes d tokens/s (its training step, measured as tokens / compute seconds,
// waits excluded). With T target and D drafter ranks the pipeline trains at min(T·s, D·d) (the
// slower side bounds it; prefetching hides the rest), so on N GPUs the best split maximises that
// over T + D = N. A colocated rank does both in turn on one GPU: 1 / (1/s + 1/d) per GPU.
// Drafter data parallelism is taken as linear (its all-reduce is inside the measured step time).
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::metrics {

struct SplitOption {
  int64_t target_ranks = 0, drafter_ranks = 0;  // 0 + 0: colocated (one GPU, both roles)
  double tok_s = 0;                              // expected training tokens/s
  const char* bound = "";                        // "target", "drafter" or "balanced"
};

struct SplitAdvice {
  int64_t gpus = 0;
  double target_tok_s = 0, drafter_tok_s = 0;  // the per-rank rates it was computed from
  SplitOption best;                            // the best T + D = gpus split (gpus >= 2)
  SplitOption colocated;                       // one GPU doing both, for comparison
  std::vector<SplitOption> options;            // every T = 1 .. gpus-1, in order
};

// UserError-free: rates <= 0 or gpus < 1 give an empty advice (gpus == 0).
SplitAdvice recommend_split(int64_t gpus, double target_tok_s_per_rank, double drafter_tok_s_per_rank);
// "on 8 GPUs: 3 target + 5 drafter ranks, 106.5K tok/s (drafter-bound); colocated 14.1K tok/s per GPU"
std::string format_split(const SplitAdvice& a);
// One JSON object with every field and option.
std::string split_json(const SplitAdvice& a);

}  // namespace dflash::metrics
