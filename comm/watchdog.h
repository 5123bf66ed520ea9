// Never hang: what this rank is blocked on, the deadline of every blocking wait, and the one
// place that ends a failed rank (fail_fast).
//
// Owns:
//  - BlockedOn: an RAII record "op, peer, batch, deadline" for every blocking wait. The
//    communicators poll their own deadlines with it and throw CommError naming the op, the
//    peer and the global batch index; a backstop watchdog thread catches waits that cannot be
//    polled (MPI_Comm_split, MPI_Bcast during start-up) and ends the rank the same way.
//  - The SIGTERM/SIGINT handler: launchers (mpirun, srun, torchrun) terminate the survivors
//    when one rank dies; the handler prints what this rank was blocked on, then exits with
//    kExitComm. Only async-signal-safe calls are made there (write, _exit).
//  - fail_fast(e): log e on this rank, abort every registered communicator, then
//    MPI_Abort under MPI (so mpirun tears everyone down) or _Exit with the error's code.
// Thread-safety: everything here may be called from any thread. At most kMaxWaits waits are
// recorded at once (more are still bounded by their own polling, only not by the watchdog).
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>

namespace dflash::comm {

constexpr int kNoPeer = -1;
constexpr int64_t kNoBatch = -1;
constexpr int kMaxWaits = 16;

// How messages name a rank: "rank 5 (drafter 0)". Set once the layout is known.
void set_rank_namer(std::function<std::string(int)> namer);
std::string name_rank(int rank);

// "recv from rank 1 (target 1), batch 17"
std::string describe_wait(const std::string& op, int peer, int64_t batch);

class BlockedOn {
 public:
  // timeout_s <= 0: no deadline (only for waits that are bounded elsewhere).
  BlockedOn(const std::string& op, int peer, int64_t batch, double timeout_s);
  ~BlockedOn();
  BlockedOn(const BlockedOn&) = delete;
  BlockedOn& operator=(const BlockedOn&) = delete;

  bool expired() const;
  double elapsed_s() const;
  // "timed out after 10.0 s (comm.timeout_s) in recv from rank 1 (target 1), batch 17: <detail>"
  std::string timeout_message(const std::string& detail = "") const;
  [[noreturn]] void throw_timeout(const std::string& detail = "") const;
  const std::string& what() const { return what_; }

 private:
  std::string what_;
  double timeout_s_;
  int64_t start_ns_;
  int slot_ = -1;
};

// Communicators register their abort function (called once, from fail_fast, the watchdog or
// a deadline); the returned id unregisters it when the communicator is destroyed.
int register_abort(std::function<void(const std::string& reason)> fn);
void unregister_abort(int id);
void abort_all(const std::string& reason);

// 2 for UserError, 3 for CommError, 1 otherwise (comm/error.h).
int exit_code_of(const std::exception& e);

// Logs e (every rank, stderr), aborts the communicators, ends the process (MPI_Abort under
// MPI with world size > 1, else _Exit). Never returns.
[[noreturn]] void fail_fast(const std::exception& e);
// Same for a code + message (the watchdog thread uses it).
[[noreturn]] void fail_fast(int code, const std::string& message);

// Installs SIGTERM/SIGINT/SIGHUP handlers (print what we were blocked on, _exit(kExitComm))
// and starts the backstop thread: a wait past its deadline + grace_s ends the rank.
void install_watchdog(double grace_s = 5.0);

// Test hook (env DFLASH_TEST_FAIL_AT=rank:batch:kind, kind = throw | sigkill | hang): called
// by the self-test before it handles `batch` on `rank`. Documented in docs/environment.md.
void maybe_inject_failure(int rank, int64_t batch);

}  // namespace dflash::comm
