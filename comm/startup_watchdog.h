// Start-up deadlines from the first instruction: everything a rank waits for before it trains
// (MPI_Init, the identity exchange, the plan agreement, the store and its rendezvous, the
// communicator) is bounded by comm.startup_timeout_s, also the calls that cannot be polled.
//
// Owns:
//  - startup_begin(): the first thing a rank does. Opens the progress board (comm/progress.h)
//    from the launcher's environment, runs the test hook DFLASH_TEST_FAIL_AT=rank:init:kind,
//    and starts a thread that ends the rank when an armed phase passes its deadline.
//  - StartupPhase: an RAII "this rank now waits for <what>" with the deadline startup_timeout_s
//    (+ grace_s for phases that poll their own deadline and report it better themselves). At
//    the deadline the thread prints ONE line and _exit(3)s (kExitComm), e.g.
//    "[dflash r0/4] error: start-up: MPI_Init did not complete within 5 s
//    (comm.startup_timeout_s); progress: rank 2 is stopped (SIGSTOP or a debugger; pid 4711) in
//    'start'; the others wait for it". No stack trace, no MPI_Abort (MPI may be half-initialised).
// Thread-safety: phases may be armed from any thread; one thread at a time per phase object.
#pragma once

#include <cstdint>
#include <string>

namespace dflash::comm {

// timeout_s <= 0 or NaN: no start-up deadline (the thread still runs, nothing expires).
void startup_begin(double timeout_s);
double startup_timeout();

class StartupPhase {
 public:
  explicit StartupPhase(std::string what, double grace_s = 0);
  ~StartupPhase();
  StartupPhase(const StartupPhase&) = delete;
  StartupPhase& operator=(const StartupPhase&) = delete;

 private:
  int slot_ = -1;
};

}  // namespace dflash::comm
