// Evaluation during training (docs/eval.md): who evaluates, how the weights get there, how the
// result comes back. The decoding itself is trainer/eval/live.h.
//
// One copy of the target: the evaluating rank loads its one target with all layers and the LM
// head (target_load_options; training's capture stops at the last captured layer, so it computes
// the same) and the evaluation uses that model; its caches are allocated and warmed up before
// training (live.h).
//
// Distributed runs: one target rank (eval.rank, default target rank 0: the drafters are the
// bottleneck, the targets have spare time) evaluates. After each optimizer step of
// LiveEval::eval_steps, drafter rank 0 and the eval rank meet in one all_reduce (Sum) over their
// own two-rank group: drafter rank 0 contributes the flat weights, the eval rank zeros plus the
// result of its previous evaluation, so each side gets what the other has. Collectives run on
// their own stream, apart from the target -> drafter batch stream, so the rendezvous cannot
// block batches behind it (an irecv posted early on NCCL's p2p stream would). The eval rank
// meets before producing its first batch of a later step (it runs `data.prefetch` batches ahead,
// so it is the one that waits there, not drafter rank 0) and then evaluates in its spare time:
// whenever its sends are `data.prefetch` deep and it would wait for the drafters to take one,
// it advances the evaluation one decode step at a time until a send completes (use_slack), so
// its batches are late by at most one decode step. An evaluation still unfinished at the next
// rendezvous (a target-bound pipeline has no spare time) is completed before it (logged), and
// drafter rank 0 logs any wait of its own at a rendezvous. A last exchange after the run brings back the final evaluation. The latest
// result shows in drafter rank 0's metrics line as `tau` (with its step and cost eval_s) beside
// the estimate `tau_est`.
// Colocated runs: the one process evaluates between steps (training pauses for eval_s).
// Thread-safety: on the thread of the role that owns them.
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"
#include "trainer/eval/live.h"
#include "trainer/model/target.h"
#include "trainer/roles/roles.h"

namespace dflash::roles {

// The rank that evaluates: -1 when eval.every == 0; else eval.rank (checked: a target rank) or
// target rank 0; in a colocated run, 0. UserError naming eval.rank otherwise.
int eval_rank(const Config& cfg, const Schedule& schedule, int world_size);

// Whether this rank evaluates during training (the colocated process, or the eval rank).
bool evaluates(const RoleContext& ctx);
// How this rank loads its target: `training` on a rank that does not evaluate, else widened to
// the full model (LiveEval::target_load_options), the one copy both share.
model::TargetLoadOptions target_load_options(const RoleContext& ctx, model::TargetLoadOptions training);

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
  // `target`: the rank's one target (loaded with target_load_options).
  EvalWorker(const RoleContext& ctx, const model::TargetModel& target);
  ~EvalWorker();
  // Before producing batch k: meets drafter rank 0 for every eval step <= k's step (each meet
  // first completes the evaluation in progress, then begins the next one).
  void before_batch(int64_t k);
  // While `send` (the oldest send in flight) is not complete: advances the evaluation in
  // progress one decode unit at a time. Returns the seconds spent evaluating.
  double use_slack(comm::Handle& send);
  // After its last batch: the remaining eval steps, then the result exchange.
  void finish();

 private:
  void meet(int64_t step);
  // Completes the evaluation in progress (in_training: at a rendezvous, logged as a stall).
  void complete(bool in_training);
  const RoleContext& ctx_;
  std::vector<int64_t> steps_;
  size_t next_ = 0;
  std::unique_ptr<eval::LiveEval> live_;
  eval::LiveResult last_;
};

// The colocated process's side.
class ColocatedEval {
 public:
  // `target`: the process's one target (loaded with target_load_options).
  ColocatedEval(const RoleContext& ctx, const model::TargetModel& target);
  ~ColocatedEval();
  std::optional<eval::LiveResult> after_step(int64_t done, const model::Drafter& drafter);

 private:
  std::vector<int64_t> steps_;
  size_t next_ = 0;
  std::unique_ptr<eval::LiveEval> live_;
};

}  // namespace dflash::roles
