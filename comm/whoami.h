// --whoami: the identity and rendezvous check of dflash_rank.
//
// Owns: run_whoami(): every rank prints its identity; the ranks then meet (an MPI barrier
// under MPI, the TCP store rendezvous otherwise) and rank 0 logs the list of all ranks. Needs
// no layout, so it runs under any launcher with any number of processes.
// Thread-safety: call from main's thread only.
#pragma once

#include "comm/identity.h"

namespace dflash::comm {

// Returns the process exit code (0); throws CommError when the ranks do not meet within
// startup_timeout_s (comm.startup_timeout_s).
int run_whoami(const Identity& id, double startup_timeout_s);

}  // namespace dflash::comm
