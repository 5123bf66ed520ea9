// Evaluation during training (docs/eval.md): who evaluates, how the weights get there, how the
// result comes back. The decoding itself is trainer/eval/live.h.
//
// Distributed runs: one target rank (eval.rank, default target rank 0: the drafters are the
// bottleneck, the targets have spare time) evaluates. After each optimizer step of
// LiveEval::eval_steps, drafter rank 0 and the eval rank meet in one all_reduce (Sum) over their
// own two-rank group: drafter rank 0 contributes the flat weights, the eval rank zeros plus the
// result of its previous evaluation, so each side gets what the other has. Collectives run on
// their own stream, apart from the target -> drafter batch stream, so the rendezvous cannot
// block batches behind it (an irecv posted early on NCCL's p2p stream would). The eval rank
// meets before producing its first batch of a later step, evaluates, then produces on; its
// batches pause for the eval's duration (the other targets go on). A last exchange after the
// run brings back the final evaluation. The latest result shows in drafter rank 0's metrics line
// as `tau` (with its step and cost) beside the estimate `tau_est`.
// Colocated runs: the one process evaluates between steps (training pauses for it).
// Thread-safety: on the thread of the role that owns them.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "trainer/eval/live.h"
#include "trainer/roles/roles.h"

namespace dflash::roles {

// The rank that evaluates: -1 when eval.every == 0; else eval.rank (checked: a target rank) or
// target rank 0; in a colocated run, 0. UserError naming eval.rank otherwise.
int eval_rank(const Config& cfg, const Schedule& schedule, int world_size);

// Drafter rank 0's side.
class EvalLeader {
 public:
  explicit EvalLeader(const RoleContext& ctx);
  // After optimizer step `done`: hands the weights over if `done` is an eval step; returns the
  // previous evaluation's result when it comes back.
  std::optional<eval::LiveResult> after_step(int64_t done, const model::Drafter& drafter);
  // After the run: the final evaluation's result.
  std::optional<eval::LiveResult> finish();

 private:
  const RoleContext& ctx_;
  std::vector<int64_t> steps_;
  size_t next_ = 0;
};

// The eval rank's side (a target rank).
class EvalWorker {
 public:
  explicit EvalWorker(const RoleContext& ctx);
  ~EvalWorker();
  // Before producing batch k: meets and evaluates for every eval step <= k's step.
  void before_batch(int64_t k);
  // After its last batch: the remaining eval steps, then the result exchange.
  void finish();

 private:
  void meet(int64_t step);
  const RoleContext& ctx_;
  std::vector<int64_t> steps_;
  size_t next_ = 0;
  std::unique_ptr<eval::LiveEval> live_;
  eval::LiveResult last_;
};

// The colocated process's side.
class ColocatedEval {
 public:
  explicit ColocatedEval(const RoleContext& ctx);
  ~ColocatedEval();
  std::optional<eval::LiveResult> after_step(int64_t done, const model::Drafter& drafter);

 private:
  std::vector<int64_t> steps_;
  size_t next_ = 0;
  std::unique_ptr<eval::LiveEval> live_;
};

}  // namespace dflash::roles
