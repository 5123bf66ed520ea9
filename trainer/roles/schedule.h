// The schedule of a run: which rank plays which role, and who produces and who consumes
// global batch k. It is the one source of the batch walks: the target loop, the drafter loop,
// the colocated loop and --comm-check walk the lists below and nothing else, and
// tests/roles/test_schedule.cpp tests exactly these functions.
//
// Owns: the rank <-> role mapping of a layout (ranks 0..T-1 run the target, T..T+D-1 the
// drafter; a colocated run is one process doing both, so T = D = 1 for its walks) and the rule
// "batch k goes from target rank k mod T to drafter rank k mod D". Each rank walks its own k's
// in increasing order, so the n-th send on a (target, drafter) pair always meets the n-th
// receive: no negotiation, no deadlock. One optimizer step s consumes the G = D x grad_accum
// consecutive batches [s*G, (s+1)*G); drafter j trains those with k mod D = j, i.e.
// s*G + a*D + j for a = 0 .. grad_accum-1.
// Thread-safety: a Schedule is an immutable value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::roles {

enum class Role { Target, Drafter, Both };

const char* role_name(Role r);

class Schedule {
 public:
  // UserError naming layout.target_ranks / layout.drafter_ranks and the world size when
  // T + D != world_size (or world_size != 1 when colocated).
  Schedule(int64_t target_ranks, int64_t drafter_ranks, bool colocated, int world_size);

  // The number of targets / drafters the batches are shared among (1 and 1 when colocated).
  int64_t targets() const { return colocated_ ? 1 : T_; }
  int64_t drafters() const { return colocated_ ? 1 : D_; }
  bool colocated() const { return colocated_; }
  int world_size() const { return colocated_ ? 1 : static_cast<int>(T_ + D_); }

  // ---- rank <-> role ----
  Role role_of(int rank) const;
  bool is_target(int rank) const { return colocated_ || rank < T_; }
  bool is_drafter(int rank) const { return colocated_ || rank >= T_; }
  // index among the targets (0..T-1) / drafters (0..D-1) and back; a colocated run's one
  // process is target 0 and drafter 0.
  int64_t target_index(int rank) const { return colocated_ ? 0 : rank; }
  int64_t drafter_index(int rank) const { return colocated_ ? 0 : rank - T_; }
  int target_rank(int64_t i) const { return colocated_ ? 0 : static_cast<int>(i); }
  int drafter_rank(int64_t j) const { return colocated_ ? 0 : static_cast<int>(T_ + j); }
  std::vector<int> drafter_ranks() const;
  // "rank 5 (drafter 0)"
  std::string name(int rank) const;

  // ---- batches ----
  // The rank that produces / consumes batch k.
  int target_of(int64_t k) const { return target_rank(k % targets()); }
  int drafter_of(int64_t k) const { return drafter_rank(k % drafters()); }
  // The batches k in [begin, end) that target i produces / drafter j consumes, increasing.
  // In a colocated run every batch belongs to the one process.
  std::vector<int64_t> target_batches(int64_t i, int64_t begin, int64_t end) const;
  std::vector<int64_t> drafter_batches(int64_t j, int64_t begin, int64_t end) const;
  // G = D x grad_accum, and the optimizer step (0-based) that batch k belongs to.
  int64_t batches_per_step(int64_t grad_accum) const { return drafters() * grad_accum; }
  int64_t step_of(int64_t k, int64_t grad_accum) const { return k / batches_per_step(grad_accum); }
  // Whether batch k is the last its drafter trains in its step (the drafter then closes the
  // step): its next batch, k + D, belongs to the next step.
  bool closes_step(int64_t k, int64_t grad_accum) const {
    return step_of(k + drafters(), grad_accum) != step_of(k, grad_accum);
  }

 private:
  int64_t T_, D_;
  bool colocated_;
};

}  // namespace dflash::roles
