// The schedule primitive of DESIGN.md: who produces and who consumes global batch k.
//
// Owns: the rank <-> role mapping of a layout (ranks 0..T-1 run the target, T..T+D-1 the
// drafter; a colocated run is one process doing both) and the rule "batch k goes from target
// rank k mod T to drafter rank k mod D". Each rank walks its own k's in increasing order, so
// the n-th send on a (target, drafter) pair always meets the n-th receive: no negotiation, no
// deadlock. One optimizer step consumes D x grad_accum consecutive batches.
// Thread-safety: a Schedule is an immutable value.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"

namespace dflash::comm {

enum class Role { Target, Drafter, Both };

inline const char* role_name(Role r) {
  switch (r) {
    case Role::Target: return "target";
    case Role::Drafter: return "drafter";
    case Role::Both: return "colocated";
  }
  return "?";
}

class Schedule {
 public:
  // UserError naming layout.target_ranks / layout.drafter_ranks and the world size when
  // T + D != world_size (or world_size != 1 when colocated).
  Schedule(int64_t target_ranks, int64_t drafter_ranks, bool colocated, int world_size)
      : T_(target_ranks), D_(drafter_ranks), colocated_(colocated) {
    if (T_ < 1 || D_ < 1)
      throw_user("layout.target_ranks={} and layout.drafter_ranks={} must both be at least 1", T_, D_);
    if (colocated_) {
      if (world_size != 1)
        throw_user("layout.colocated=true runs both roles in one process, but the launcher started {} "
                   "processes (world size {}); start 1 process or set layout.colocated=false",
                   world_size, world_size);
    } else if (T_ + D_ != world_size) {
      throw_user("layout.target_ranks={} + layout.drafter_ranks={} = {} ranks, but the launcher started "
                 "{} (world size {}); start {} processes or change the layout",
                 T_, D_, T_ + D_, world_size, world_size, T_ + D_);
    }
  }

  int64_t targets() const { return T_; }
  int64_t drafters() const { return D_; }
  bool colocated() const { return colocated_; }
  int world_size() const { return colocated_ ? 1 : static_cast<int>(T_ + D_); }

  // ---- rank <-> role ----
  Role role_of(int rank) const {
    if (colocated_) return Role::Both;
    return rank < T_ ? Role::Target : Role::Drafter;
  }
  bool is_target(int rank) const { return colocated_ || rank < T_; }
  bool is_drafter(int rank) const { return colocated_ || rank >= T_; }
  // index among the targets (0..T-1) / drafters (0..D-1); in a colocated run the one process
  // plays every index in turn, so these are for the distributed layout only.
  int64_t target_index(int rank) const { return rank; }
  int64_t drafter_index(int rank) const { return colocated_ ? 0 : rank - T_; }
  int target_rank(int64_t i) const { return colocated_ ? 0 : static_cast<int>(i); }
  int drafter_rank(int64_t j) const { return colocated_ ? 0 : static_cast<int>(T_ + j); }
  std::vector<int> drafter_ranks() const {
    std::vector<int> r;
    for (int64_t j = 0; j < (colocated_ ? 1 : D_); ++j) r.push_back(drafter_rank(j));
    return r;
  }
  // "rank 5 (drafter 0)"
  std::string name(int rank) const {
    if (colocated_) return fmt::format("rank {} (colocated)", rank);
    if (rank < 0 || rank >= world_size()) return fmt::format("rank {}", rank);
    return rank < T_ ? fmt::format("rank {} (target {})", rank, rank)
                     : fmt::format("rank {} (drafter {})", rank, rank - T_);
  }

  // ---- batches ----
  int64_t producer_index(int64_t k) const { return k % T_; }
  int64_t consumer_index(int64_t k) const { return k % D_; }
  int source_rank(int64_t k) const { return target_rank(producer_index(k)); }
  int dest_rank(int64_t k) const { return drafter_rank(consumer_index(k)); }

  // The batches k < n that target i produces / drafter j consumes, in increasing order.
  // In a colocated run every batch belongs to the one process.
  std::vector<int64_t> target_batches(int64_t i, int64_t n) const { return stride(colocated_ ? 0 : i, colocated_ ? 1 : T_, n); }
  std::vector<int64_t> drafter_batches(int64_t j, int64_t n) const { return stride(colocated_ ? 0 : j, colocated_ ? 1 : D_, n); }
  // Optimizer step of batch k: D x grad_accum consecutive batches per step.
  int64_t step_of(int64_t k, int64_t grad_accum) const { return k / (D_ * grad_accum); }

 private:
  static std::vector<int64_t> stride(int64_t first, int64_t step, int64_t n) {
    std::vector<int64_t> out;
    for (int64_t k = first; k < n; k += step) out.push_back(k);
    return out;
  }
  int64_t T_, D_;
  bool colocated_;
};

}  // namespace dflash::comm
