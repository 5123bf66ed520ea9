// Preemption: SIGTERM and SIGUSR1 ask a training run to save a state and exit (docs/environment.md
// "Signals", docs/comm.md "Preemption").
//
// Owns: the process-wide "stop requested" flag and its signal handler (in comm/watchdog.cpp,
// next to the other handlers, since it prints what the rank is blocked on from the same
// lock-free table). Before arm_preemption() SIGTERM ends the rank at once (exit 3, the
// watchdog's handler) and SIGUSR1 has its default action. After it:
//   - the first SIGTERM or SIGUSR1 sets the flag and prints one line (the signal, what the rank
//     was blocked on); the training roles agree at a step boundary, write a complete state and
//     every rank exits with kExitPreempted;
//   - a second SIGTERM/SIGUSR1 (or SIGINT/SIGHUP) ends the rank at once, exit 3, no state;
//   - if no state was written within `deadline_s` of the first signal (a peer is gone, the
//     agreement cannot complete), the rank ends the same way (fail_fast, exit 3).
// Thread-safety: the flag is a lock-free atomic; every function may be called from any thread.
#pragma once

#include <cstdint>

namespace dflash::comm {

// Exit code of a rank that stopped on a signal after its run's state was written (documented
// in docs/environment.md; the job can be resumed, and a requeued job auto-resumes).
constexpr int kExitPreempted = 4;

// Installs the handlers (idempotent; the deadline is taken from the last call).
void arm_preemption(double deadline_s);
// True once a SIGTERM/SIGUSR1 arrived after arm_preemption() (or request_preemption()).
bool preemption_requested();
// Sets the flag as a signal would (tests; a rank that learns of a stop from its peers).
void request_preemption();
// The training roles: the run stopped at a step boundary after writing the state of `step`
// (cancels the deadline). preempted_at() returns it (-1 if the run was not stopped).
void mark_preempted(int64_t step);
int64_t preempted_at();

}  // namespace dflash::comm
