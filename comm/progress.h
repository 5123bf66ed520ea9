// Who is late: every rank publishes where it stands (phase, step, batch, what it waits for) on
// a node-local board, so that on a timeout the survivors name the rank that stopped making
// progress instead of the peer they happened to wait for (the idea of NCCL's flight recorder
// and c10d's desync report).
//
// Owns:
//  - the board: one small record per rank in a shared-memory file
//    /dev/shm/dflash-<job>/rank<R> (mmap'ed; an update is a few stores under a sequence
//    counter, no system call), <job> from the launcher's job id (PMIX_NAMESPACE under mpirun and
//    srun --mpi=pmix, SLURM_JOB_ID.SLURM_STEP_ID, torchrun's run id or MASTER_ADDR:MASTER_PORT).
//    No board for a single process. Each rank removes its record when it ends normally; a
//    record left by a killed rank is found dead and ignored by the next run of the same job id;
//    a job directory whose ranks are all gone is removed by the next job (never a young one
//    that another job is making right now).
//  - mark_ending(): the rank ends on its own (the launcher's signal): never blamed by the others.
//  - publish(): the rank's phase ("start", "MPI_Init", "plan", "train", ...), step and batch;
//    waiting(): set by every BlockedOn (comm/watchdog.h) while the rank is blocked.
//  - diagnose(): read every record of this node and name the culprit(s), in this order:
//    stopped (SIGSTOP: /proc state T), dead (the process is gone), not started (no record, when
//    every rank runs on this node), then ranks that are not blocked in a communication but made
//    no progress while the others wait for them. Ranks on other nodes are not visible; the
//    sentence says so when it cannot name anyone.
//  - the test hook DFLASH_TEST_FAIL_AT=rank:phase:kind (phase = init | plan | b<K>, kind =
//    throw | sigkill | hang | stop) for the fault tests (docs/environment.md).
// Thread-safety: publish/waiting from any thread of the rank (last writer wins); diagnose from
// any thread. Nothing here allocates in a signal handler.
#pragma once

#include <cstdint>
#include <string>

namespace dflash::comm::progress {

// Opens this rank's record (before MPI_Init: the rank, world and local world size come from the
// launcher's environment). Idempotent; a no-op without a launcher or when /dev/shm is unusable.
void open_from_env();

// Where this rank stands. step/batch < 0: unknown or not applicable.
void publish(const char* phase, int64_t step = -1, int64_t batch = -1);

// Set while the rank is blocked in a communication ("recv from rank 1 (target 1), batch 17");
// nullptr when the wait ends (waits nest: a count). batch >= 0 becomes the record's batch.
void waiting(const char* what, int64_t batch = -1);

// One sentence naming the rank(s) that stopped making progress, e.g. "progress: rank 3
// (drafter 1) is stopped (SIGSTOP or a debugger; pid 4711) in 'recv' batch 17; the others wait
// for it", or "" when nothing can be said. This rank is excluded, and is marked as giving up (it
// is about to end), so that the others never blame it.
std::string diagnose();

// Marks this rank as ending on its own (the launcher's SIGTERM, an error being reported), so
// that the others never name it as the culprit. Async-signal-safe (one atomic store).
void mark_ending();

// What this node's board says about one rank (the rendezvous asks about rank 0, the store host):
// Unknown (no board, or the rank may run on another node), NeverStarted (every rank runs here
// and it has no record), Running, Stopped (SIGSTOP or a debugger), Dead (gone without ending on
// its own: kill -9, a crash), Ended (it ended on its own: an error it reported, the launcher's
// signal, a normal end).
enum class Seen { Unknown, NeverStarted, Running, Stopped, Dead, Ended };
Seen seen(int rank);

// Removes this rank's record (normal end).
void close();

// The test hook: fails on this rank when DFLASH_TEST_FAIL_AT names it and `phase`: "init"
// (before MPI_Init), "plan" (after the plan agreement), "b<K>" (the first wait on batch K:
// a target's send, a drafter's receive). Throws UserError on a malformed spec.
void maybe_fail(int rank, const std::string& phase);

// This rank by the launcher's environment (-1 when there is none): OMPI_COMM_WORLD_RANK,
// PMIX_RANK, RANK, SLURM_PROCID.
int rank_from_env();

}  // namespace dflash::comm::progress
