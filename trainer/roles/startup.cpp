// trainer/roles/startup.h: start_rank() and the comm options of a config.
#include "trainer/roles/startup.h"

#include <fmt/format.h>

#include "comm/startup_watchdog.h"
#include "comm/watchdog.h"
#include "core/log.h"

namespace dflash::roles {

comm::CommOptions comm_options(const Config& cfg) {
  return comm::CommOptions{cfg.comm.backend, cfg.comm.timeout_s, cfg.comm.startup_timeout_s};
}

RankContext start_rank(const Config& cfg, bool check_layout) {
  comm::startup_begin(cfg.comm.startup_timeout_s);  // before any blocking call (comm/startup_watchdog.h)
  log::set_level(log::parse_level(cfg.log.level));
  comm::Identity id = comm::detect();
  Schedule schedule = check_layout ? Schedule(cfg.layout.target_ranks, cfg.layout.drafter_ranks, cfg.layout.colocated,
                                              id.world_size)
                                   : Schedule(1, 1, id.world_size == 1, id.world_size == 1 ? 1 : 2);
  std::string role = check_layout ? role_name(schedule.role_of(id.rank)) : "";
  log::set_identity(id.rank, id.world_size, role);
  log::set_console_rank(static_cast<int>(cfg.log.console_rank));
  if (cfg.log.per_rank_files) log::open_file(fmt::format("{}/logs/rank{}.log", cfg.run.dir, id.rank));
  if (check_layout) comm::set_rank_namer([schedule](int r) { return schedule.name(r); });
  else comm::set_rank_namer({});
  comm::install_watchdog();
  log::debug("identity: {}", id.describe());
  return RankContext{id, schedule};
}

}  // namespace dflash::roles
