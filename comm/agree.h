// Start-up agreement: before anything is written, every rank reports how its start-up went
// (OK, or an exit code and a one-line cause) and learns every other rank's report, so that a
// failure on one rank makes every rank exit at once, naming the rank and the cause, instead of
// the others waiting for it until a deadline.
//
// Owns: agree(). The same reports give the same result under every launcher:
//  - an MPI launch (mpirun, srun --mpi=pmix): through a Communicator (MPI): a sum all-reduce
//    of a [world, kReportBytes] int32 table in which each rank fills only its own row;
//  - any other launch (torchrun-style env, SLURM without MPI): through the run's c10d store
//    (startup_store()): a rendezvous() of the reports, then sign_off(), so that rank 0, which
//    may serve the store, outlives every reader.
// Deadline: timeout_s (comm.startup_timeout_s). A rank that never reports (it failed earlier,
// or never started) ends the others with a CommError naming it (rendezvous) or naming the
// all-reduce that timed out (MPI; mpirun then ends the job anyway).
// Thread-safety: call from main's thread, on every rank, with the same tag.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "comm/identity.h"
#include "comm/store.h"

namespace dflash::comm {

struct Report {
  int code = 0;      // 0: OK; else the exit code this rank ends with (core/error.h)
  std::string what;  // the cause (newlines become " | "; cut to kReportBytes for the others)
  bool ok() const { return code == 0; }
};

constexpr size_t kReportBytes = 1024;

// Every rank's report, index = rank. `store`: startup_store()'s store, needed (non-null) when
// the launch is not MPI and the world has more than one rank.
std::vector<Report> agree(const Identity& id, const std::string& tag, const Report& mine, double timeout_s,
                          Store* store);

}  // namespace dflash::comm
