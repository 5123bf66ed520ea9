// DFlash speculative decoding with fixed shapes (greedy, dense targets): the loop of
// speculative.h with every row's state on the device, so that a step issues the same kernels on
// the same shapes each time (a CUDA graph per attention window on CUDA) and reads nothing from the
// host but one pair of numbers (are all rows done, the longest row) to size the next window.
//
// A step, for all rows at once (rows that are done still run and change nothing):
//   1. draft: the proposer's block forward over [last[b], MASK x (bs - 1)] at start[b] ..
//      (DFlashProposer::propose_rows);
//   2. verify: the target's static KV cache (model/target_cache_static.h) runs the bs block
//      tokens of every row at positions start[b] .. start[b] + bs - 1 and captures the layers the
//      drafter reads; posterior = argmax;
//   3. accept: a[b] = the longest prefix with draft == posterior; the commit is posterior[0..a];
//      the target's length and the row's start advance by a + 1 (the rejected slots stay behind,
//      past the length, masked and later overwritten), and all bs captured features go into the
//      draft cache at start[b] .. (only the first a + 1 are context: the proposer's mask stops at
//      start); the commit is truncated at the first stop token and at max_new_tokens.
// The results equal SpeculativeDecoder's (the same arithmetic; tests/eval/test_speculative.cpp
// checks token for token and step for step on CPU in float32).
//
// Why: SpeculativeDecoder drives TargetCache, whose every extend builds index lists on the host
// and uploads them; this loop keeps them on the device (docs/eval.md "Engines").
// Thread-safety: none; one thread drives a decoder.
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/eval/draft.h"
#include "trainer/eval/speculative.h"
#include "trainer/model/target.h"

namespace dflash::eval {

class FixedSpeculativeDecoder {
 public:
  // UserError for temperature > 0 or a target with linear_attention / MoE layers (use
  // SpeculativeDecoder), and for the option errors SpeculativeDecoder reports.
  FixedSpeculativeDecoder(const model::TargetModel& target, DFlashProposer& proposer,
                          const std::vector<std::vector<int64_t>>& prompts, const DecodeOptions& opt);
  // Decodes every row to its end.
  void run();
  const std::vector<RowResult>& results() const { return res_; }
  int64_t steps() const { return steps_; }    // fixed-shape steps run (all rows)
  int64_t graphs() const { return graphs_; }  // CUDA graphs captured (0 on CPU or with graphs off)

  // The step as CUDA graphs, one per attention window (regenerate_graph.h): DFLASH_EVAL_GRAPHS
  // (1, default; 0: eager). The window is a multiple of kWindowBucket above the longest row.
  static constexpr const char* kFixedGraphsEnv = "DFLASH_EVAL_GRAPHS";
  static constexpr int64_t kWindowBucket = 64;
  static bool graphs_enabled();

  // Whether this decoder serves `target` with `opt` (greedy, dense).
  static bool supports(const model::TargetModel& target, const DecodeOptions& opt);

 private:
  const model::TargetModel& target_;
  DFlashProposer& proposer_;
  std::vector<std::vector<int64_t>> prompts_;
  DecodeOptions opt_;
  std::vector<RowResult> res_;
  int64_t steps_ = 0, graphs_ = 0;
};

}  // namespace dflash::eval
