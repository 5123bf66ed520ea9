// The rank loops' profiled window (roles.h: step_profiler, announce_profile).
#include "core/files.h"
#include "core/log.h"
#include "trainer/roles/roles.h"

namespace dflash::roles {

metrics::StepProfiler step_profiler(const RoleContext& ctx, const char* role) {
  return metrics::StepProfiler(ctx.cfg.log.profile_start, ctx.cfg.log.profile_steps,
                               files::join(ctx.cfg.run.dir, "profile"), ctx.rank.id.rank, role, ctx.plan.device);
}

void announce_profile(const std::string& line) {
  if (!line.empty()) log::info("{}", line);
}

}  // namespace dflash::roles
