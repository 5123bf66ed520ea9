// Start-up of a rank: identity, schedule, logging and watchdog. Every mode of dflash_rank
// (training, --comm-check, --whoami) calls start_rank() first.
//
// Owns: RankContext (who this process is and the schedule of its layout), start_rank(), and
// the mapping of the config's comm section onto comm::CommOptions.
// Thread-safety: call from main's thread only.
#pragma once

#include "comm/communicator.h"
#include "comm/identity.h"
#include "trainer/config.h"
#include "trainer/roles/schedule.h"

namespace dflash::roles {

struct RankContext {
  comm::Identity id;
  Schedule schedule;
};

// Detects the identity, checks the world size against the layout (UserError naming
// layout.target_ranks/drafter_ranks), sets the log prefix "[dflash r5/8 drafter]", the console
// rank and per-rank files (<run.dir>/logs/rank<N>.log), installs the watchdog and signal
// handlers. check_layout=false (--whoami) accepts any world size.
RankContext start_rank(const Config& cfg, bool check_layout = true);

// comm.backend, comm.timeout_s, comm.startup_timeout_s.
comm::CommOptions comm_options(const Config& cfg);

}  // namespace dflash::roles
