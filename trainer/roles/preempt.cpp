// The preemption protocol of the training roles (preempt.h).
#include "trainer/roles/preempt.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"

namespace dflash::roles {

int64_t stop_lag(const Config& cfg, const RunPlan& p) {
  return p.colocated ? 1 : std::max<int64_t>(1, cfg.data.prefetch) + 2;
}

ControlReader::ControlReader(comm::Communicator& c, int leader_rank, const RunPlan& p, int64_t lag)
    : comm_(c), leader_(leader_rank), p_(p), lag_(lag), next_(p.start_step) {}

void ControlReader::take_next() {
  comm::Message m = comm_.recv(leader_, next_);
  if ((m.kind != kControlContinue && m.kind != kControlStop) || m.batch != next_ || !m.tensors.empty())
    throw CommError(fmt::format("expected control message {} from {}, got kind {} batch {} with {} tensors", next_,
                                comm::name_rank(leader_), m.kind, m.batch, m.tensors.size()));
  if (m.kind == kControlStop && stop_after_ < 0) {
    stop_after_ = std::min(p_.total_steps - 1, next_ + lag_ - 1);  // as the drafters computed it
    log::info("preemption: the drafters stop after step {}; producing its batches, then exiting", stop_after_ + 1);
  }
  ++next_;
}

void ControlReader::before_step(int64_t t) {
  while (next_ <= t - lag_ && next_ < p_.total_steps) take_next();
}

void ControlReader::drain() {
  for (;;) {
    const int64_t last = stop_after_ >= 0 ? stop_after_ : p_.total_steps - 1;
    if (next_ > last) return;
    take_next();
  }
}

}  // namespace dflash::roles
