// trainer/roles/schedule.h: roles of a layout and the batch walks.
#include "trainer/roles/schedule.h"

#include <fmt/format.h>

#include "core/error.h"

namespace dflash::roles {
namespace {

// The k in [begin, end) with k mod step == first (0 <= first < step), increasing.
std::vector<int64_t> walk(int64_t first, int64_t step, int64_t begin, int64_t end) {
  std::vector<int64_t> out;
  if (begin < 0) begin = 0;
  int64_t k = begin + ((first - begin % step) % step + step) % step;  // first own batch >= begin
  for (; k < end; k += step) out.push_back(k);
  return out;
}

}  // namespace

const char* role_name(Role r) {
  switch (r) {
    case Role::Target: return "target";
    case Role::Drafter: return "drafter";
    case Role::Both: return "colocated";
  }
  return "?";
}

Schedule::Schedule(int64_t target_ranks, int64_t drafter_ranks, bool colocated, int world_size)
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

Role Schedule::role_of(int rank) const {
  if (colocated_) return Role::Both;
  return rank < T_ ? Role::Target : Role::Drafter;
}

std::vector<int> Schedule::drafter_ranks() const {
  std::vector<int> r;
  for (int64_t j = 0; j < drafters(); ++j) r.push_back(drafter_rank(j));
  return r;
}

std::string Schedule::name(int rank) const {
  if (colocated_) return fmt::format("rank {} (colocated)", rank);
  if (rank < 0 || rank >= world_size()) return fmt::format("rank {}", rank);
  return rank < T_ ? fmt::format("rank {} (target {})", rank, rank)
                   : fmt::format("rank {} (drafter {})", rank, rank - T_);
}

std::vector<int64_t> Schedule::target_batches(int64_t i, int64_t begin, int64_t end) const {
  return walk(colocated_ ? 0 : i, targets(), begin, end);
}

std::vector<int64_t> Schedule::drafter_batches(int64_t j, int64_t begin, int64_t end) const {
  return walk(colocated_ ? 0 : j, drafters(), begin, end);
}

}  // namespace dflash::roles
