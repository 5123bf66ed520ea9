#include "comm/watchdog.h"

#include <mpi.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "core/fault.h"
#include "comm/identity.h"
#include "comm/preempt.h"
#include "comm/progress.h"
#include "core/log.h"

namespace dflash::comm {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Lock-free table of current waits: read by the signal handler and the watchdog thread.
struct Slot {
  std::atomic<bool> used{false};
  std::atomic<int64_t> deadline_ns{0};  // 0: none
  char text[480] = {0};
};
Slot g_slots[kMaxWaits];
char g_prefix[96] = "[dflash]";  // copied from log::prefix() for the signal handler
std::atomic<bool> g_ending{false};

std::mutex g_mu;
std::function<std::string(int)> g_namer;
std::map<int, std::function<void(const std::string&)>> g_aborts;
int g_next_abort = 0;

void refresh_prefix() {
  std::string p = log::prefix();
  std::snprintf(g_prefix, sizeof(g_prefix), "%s", p.c_str());
}

void write_str(const char* s) {
  size_t n = std::strlen(s);
  while (n > 0) {
    ssize_t w = ::write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void on_signal(int sig) {
  progress::mark_ending();  // ended by the launcher: never the culprit to the others (comm/progress.h)
  if (g_ending.load()) _exit(kExitComm);  // already failing (its own message is out): just go
  const char* name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP";
  bool any = false;
  for (Slot& s : g_slots) {
    if (!s.used.load(std::memory_order_acquire)) continue;
    any = true;
    write_str(g_prefix);
    write_str(" error: terminated by ");
    write_str(name);
    write_str(" (the launcher ends every rank when one fails) while blocked in ");
    write_str(s.text);
    write_str("\n");
  }
  if (!any) {
    write_str(g_prefix);
    write_str(" error: terminated by ");
    write_str(name);
    write_str(" while not blocked in a communication\n");
  }
  _exit(kExitComm);
}

// ---- preemption (comm/preempt.h): a separate handler, installed by arm_preemption() ----
std::atomic<int> g_preempt_signal{0};        // the first SIGTERM/SIGUSR1 after arming (0: none)
std::atomic<int64_t> g_preempt_since_ns{0};  // when it arrived
std::atomic<int64_t> g_preempt_deadline_ns{0};
std::atomic<int64_t> g_preempted_at{-1};
// Under Open MPI's mpirun (set by arm_preemption): a SIGTERM from mpirun is its own stop (a rank
// failed, Ctrl-C, kill of mpirun), and mpirun sends SIGKILL odls_base_sigkill_timeout (1) s later.
bool g_under_mpirun = false;
// Preemption signals closer together than this are one request (see on_preempt_signal).
constexpr int64_t kSameSignalNs = 250'000'000;

int64_t now_ns_signal_safe() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);  // async-signal-safe; steady_clock is CLOCK_MONOTONIC
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void on_preempt_signal(int sig, siginfo_t* info, void*) {
  // Under mpirun a SIGTERM from the parent (mpirun or its orted) is the launcher ending the job
  // (a rank failed, or mpirun itself was stopped) and SIGKILL follows within a second: no state
  // can be written, so it is handled as before preemption existed: one error line naming what this
  // rank was blocked on (the dead peer), exit 3. A SIGTERM from anyone else (scancel, a scheduler,
  // kill) is a preemption request.
  if (sig == SIGTERM && g_under_mpirun && info && info->si_pid == getppid()) on_signal(sig);
  const char* name = sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : sig == SIGINT ? "SIGINT" : "SIGHUP";
  int expected = 0;
  if ((sig != SIGTERM && sig != SIGUSR1) || !g_preempt_signal.compare_exchange_strong(expected, sig)) {
    // The same request delivered twice: GNU timeout signals its child and then its own process
    // group, and a job step's signal can reach a rank both directly and through its group; those
    // arrive within microseconds of each other. A second request is one that comes later.
    // (since 0: the first is being handled on another thread at this moment.)
    const int64_t since = g_preempt_since_ns.load();
    if ((sig == SIGTERM || sig == SIGUSR1) && (since == 0 || now_ns_signal_safe() - since < kSameSignalNs)) {
      write_str(g_prefix);
      write_str(" note: ");
      write_str(name);
      write_str(" again within 0.25 s of the first: the same request (delivered to the rank and to its process "
                "group), not a second one\n");
      return;
    }
    if (g_ending.load()) _exit(kExitComm);
    write_str(g_prefix);
    write_str(" error: ");
    write_str(name);
    write_str(sig == SIGTERM || sig == SIGUSR1 ? " again: exiting now, without a state\n" : ": exiting now, without a state\n");
    _exit(kExitComm);
  }
  g_preempt_since_ns.store(now_ns_signal_safe());
  write_str(g_prefix);
  write_str(" warn: received ");
  write_str(name);
  write_str(": the run saves a state at the next step boundary the ranks agree on, then exits with code 4 (a "
            "second signal exits now)");
  for (Slot& s : g_slots) {
    if (!s.used.load(std::memory_order_acquire)) continue;
    write_str("; blocked in ");
    write_str(s.text);
    break;
  }
  write_str("\n");
}

void preempt_deadline_loop() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const int sig = g_preempt_signal.load();
    if (sig == 0 || g_preempted_at.load() >= 0) continue;
    const int64_t waited = now_ns_signal_safe() - g_preempt_since_ns.load();
    if (waited > g_preempt_deadline_ns.load())
      fail_fast(kExitComm, fmt::format("preemption: no state was written within {:.0f} s (comm.timeout_s) of {}; "
                                       "exiting without one",
                                       g_preempt_deadline_ns.load() * 1e-9, sig == SIGTERM ? "SIGTERM" : "SIGUSR1"));
  }
}

void watchdog_loop(double grace_s) {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    int64_t now = now_ns();
    for (Slot& s : g_slots) {
      if (!s.used.load(std::memory_order_acquire)) continue;
      int64_t d = s.deadline_ns.load();
      if (d <= 0 || now < d + static_cast<int64_t>(grace_s * 1e9)) continue;
      std::string late = progress::diagnose();
      fail_fast(kExitComm, fmt::format("watchdog: {} did not finish {:.0f} s after its deadline; "
                                       "aborting{}{}", s.text, grace_s, late.empty() ? "" : "; ", late));
    }
  }
}

}  // namespace

void set_rank_namer(std::function<std::string(int)> namer) {
  std::lock_guard<std::mutex> g(g_mu);
  g_namer = std::move(namer);
  refresh_prefix();
}

std::string name_rank(int rank) {
  std::lock_guard<std::mutex> g(g_mu);
  if (g_namer) return g_namer(rank);
  return fmt::format("rank {}", rank);
}

std::string describe_wait(const std::string& op, int peer, int64_t batch) {
  std::string s = op;
  if (peer != kNoPeer) s += fmt::format(" with {}", name_rank(peer));
  if (batch != kNoBatch) s += fmt::format(", batch {}", batch);
  return s;
}

BlockedOn::BlockedOn(const std::string& op, int peer, int64_t batch, double timeout_s)
    : what_(describe_wait(op, peer, batch)), timeout_s_(timeout_s), start_ns_(now_ns()) {
  // start-up/fault hooks (comm/progress.h): the test hook for "b<K>", then "this rank waits"
  if (batch >= 0 && fault::armed()) progress::maybe_fail(progress::rank_from_env(), fmt::format("b{}", batch));
  progress::waiting(what_.c_str(), batch);
  for (int i = 0; i < kMaxWaits; ++i) {
    // claim by CAS on the deadline (0 = free), write the text, then publish with `used`
    if (!g_slots[i].used.load() && g_slots[i].deadline_ns.load() == 0) {
      int64_t want = timeout_s > 0 ? start_ns_ + static_cast<int64_t>(timeout_s * 1e9) : -1;
      int64_t zero = 0;
      if (!g_slots[i].deadline_ns.compare_exchange_strong(zero, want)) continue;
      std::snprintf(g_slots[i].text, sizeof(g_slots[i].text), "%s", what_.c_str());
      g_slots[i].used.store(true, std::memory_order_release);
      slot_ = i;
      break;
    }
  }
}

BlockedOn::~BlockedOn() {
  progress::waiting(nullptr);
  if (slot_ >= 0) {
    g_slots[slot_].used.store(false, std::memory_order_release);
    g_slots[slot_].deadline_ns.store(0);
  }
}

bool BlockedOn::expired() const { return timeout_s_ > 0 && elapsed_s() > timeout_s_; }

double BlockedOn::elapsed_s() const { return (now_ns() - start_ns_) * 1e-9; }

std::string BlockedOn::timeout_message(const std::string& detail) const {
  std::string late = progress::diagnose();  // who stopped making progress (comm/progress.h)
  return fmt::format("timed out after {:.1f} s in {}{}{}{}{}", elapsed_s(), what_, detail.empty() ? "" : ": ",
                     detail, late.empty() ? "" : "; ", late);
}

void BlockedOn::throw_timeout(const std::string& detail) const { throw CommError(timeout_message(detail)); }

int register_abort(std::function<void(const std::string&)> fn) {
  std::lock_guard<std::mutex> g(g_mu);
  int id = g_next_abort++;
  g_aborts[id] = std::move(fn);
  return id;
}

void unregister_abort(int id) {
  std::lock_guard<std::mutex> g(g_mu);
  g_aborts.erase(id);
}

void abort_all(const std::string& reason) {
  std::map<int, std::function<void(const std::string&)>> fns;
  {
    std::lock_guard<std::mutex> g(g_mu);
    fns.swap(g_aborts);
  }
  for (auto& kv : fns) {
    try {
      kv.second(reason);
    } catch (...) {
      // aborting is best effort; the process ends next
    }
  }
}

int exit_code_of(const std::exception& e) {
  if (dynamic_cast<const UserError*>(&e)) return kExitUser;
  if (dynamic_cast<const CommError*>(&e)) return kExitComm;
  return kExitInternal;
}

void fail_fast(int code, const std::string& message) {
  if (g_ending.exchange(true)) {
    // another thread is already ending the process
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  progress::publish("failed");  // the others' diagnosis does not blame this rank for ending
  log::error("{}", message);
  // Abort the communicators, but never wait long for it: ncclCommAbort can block while a kernel
  // waits for a dead peer, and the launcher must hear from us within its own deadline.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread([message, done] {
    abort_all(message);
    done->store(true);
  }).detach();
  for (int i = 0; i < 300 && !done->load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!done->load()) log::warn("communicators did not abort within 3 s; exiting anyway");
  std::fflush(nullptr);
  if (mpi_active()) {
    int size = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  }
  std::_Exit(code);
}

void fail_fast(const std::exception& e) {
  int code = exit_code_of(e);
  fail_fast(code, code == kExitInternal ? fmt::format("internal error: {}", e.what()) : e.what());
}

void install_watchdog(double grace_s) {
  refresh_prefix();
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
  static std::once_flag once;
  std::call_once(once, [grace_s] { std::thread(watchdog_loop, grace_s).detach(); });
}

void maybe_inject_failure(int rank, int64_t batch) { fault::point(rank, std::to_string(batch)); }

void arm_preemption(double deadline_s) {
  refresh_prefix();
  g_preempt_deadline_ns.store(static_cast<int64_t>(deadline_s * 1e9));
  g_under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_preempt_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  for (int sig : {SIGTERM, SIGUSR1, SIGINT, SIGHUP}) sigaction(sig, &sa, nullptr);
  static std::once_flag once;
  std::call_once(once, [] { std::thread(preempt_deadline_loop).detach(); });
}

bool preemption_requested() { return g_preempt_signal.load() != 0; }

void request_preemption() {
  int expected = 0;
  if (g_preempt_signal.compare_exchange_strong(expected, SIGUSR1)) g_preempt_since_ns.store(now_ns_signal_safe());
}

void mark_preempted(int64_t step) { g_preempted_at.store(step); }
int64_t preempted_at() { return g_preempted_at.load(); }

}  // namespace dflash::comm
