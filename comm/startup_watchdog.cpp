// The start-up deadline thread and its phases (comm/startup_watchdog.h).
#include "comm/startup_watchdog.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "comm/progress.h"
#include "core/error.h"
#include "core/log.h"

namespace dflash::comm {
namespace {

constexpr int kSlots = 8;

struct Phase {
  std::atomic<bool> used{false};
  std::atomic<int64_t> deadline_ns{0};
  double grace_s = 0;
  char what[160] = {0};
};
Phase g_phases[kSlots];
std::mutex g_mu;
std::atomic<double> g_timeout{0};
std::atomic<bool> g_started{false};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

[[noreturn]] void expire(const Phase& p) {
  std::string prefix = log::prefix();
  if (prefix == "[dflash]") {  // identity not known yet: the launcher's rank
    int r = progress::rank_from_env();
    if (r >= 0) prefix = fmt::format("[dflash r{}]", r);
  }
  std::string diag = progress::diagnose();
  std::string line = fmt::format("{} error: start-up: {} did not complete within {:.0f} s (comm.startup_timeout_s){}{}\n",
                                 prefix, p.what, g_timeout.load(), diag.empty() ? "" : "; ", diag);
  std::fflush(nullptr);
  ssize_t ignored = ::write(2, line.data(), line.size());
  (void)ignored;
  _exit(kExitComm);
}

// SIGTERM/SIGINT/SIGHUP before install_watchdog() (comm/watchdog.h) takes them over: the
// launcher ends this rank because another failed. One line, the board marks this rank as ending
// on its own (never the culprit to the others), exit 3. Async-signal-safe.
char g_sig_prefix[48] = "[dflash]";

void on_startup_signal(int sig) {
  progress::mark_ending();
  const char* name = sig == SIGTERM ? "SIGTERM" : sig == SIGINT ? "SIGINT" : "SIGHUP";
  char line[200];
  int n = std::snprintf(line, sizeof(line), "%s error: terminated by %s during the start-up (the launcher ends every "
                        "rank when one fails)\n", g_sig_prefix, name);
  if (n > 0) {
    ssize_t ignored = ::write(2, line, static_cast<size_t>(std::min<int>(n, sizeof(line) - 1)));
    (void)ignored;
  }
  _exit(kExitComm);
}

void install_startup_signals() {
  int r = progress::rank_from_env();
  if (r >= 0) std::snprintf(g_sig_prefix, sizeof(g_sig_prefix), "[dflash r%d]", r);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_startup_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction old;
    // a signal the caller ignores (nohup) stays ignored
    if (sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, nullptr);
  }
}

void loop() {
  for (;;) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    int64_t now = now_ns();
    for (const Phase& p : g_phases) {
      if (!p.used.load(std::memory_order_acquire)) continue;
      int64_t d = p.deadline_ns.load();
      if (d > 0 && now > d + static_cast<int64_t>(p.grace_s * 1e9)) expire(p);
    }
  }
}

}  // namespace

void startup_begin(double timeout_s) {
  g_timeout = std::isfinite(timeout_s) && timeout_s > 0 ? timeout_s : 0.0;
  progress::open_from_env();
  install_startup_signals();
  progress::maybe_fail(progress::rank_from_env(), "init");
  if (!g_started.exchange(true)) std::thread(loop).detach();
}

double startup_timeout() { return g_timeout.load(); }

StartupPhase::StartupPhase(std::string what, double grace_s) {
  progress::publish(what.c_str());
  progress::waiting(what.c_str());
  std::lock_guard<std::mutex> g(g_mu);
  for (int i = 0; i < kSlots; ++i) {
    Phase& p = g_phases[i];
    if (p.used.load()) continue;
    std::snprintf(p.what, sizeof(p.what), "%s", what.c_str());
    p.grace_s = grace_s;
    double t = g_timeout.load();
    p.deadline_ns = t > 0 ? now_ns() + static_cast<int64_t>(t * 1e9) : 0;
    p.used.store(true, std::memory_order_release);
    slot_ = i;
    return;
  }
}

StartupPhase::~StartupPhase() {
  progress::waiting(nullptr);
  // left by an exception: this rank is about to report its error and end (never the culprit
  // to the others, also not in the moment before fail_fast marks it)
  progress::publish(std::uncaught_exceptions() > 0 ? "gave up" : "start-up (between phases)");
  if (slot_ < 0) return;
  std::lock_guard<std::mutex> g(g_mu);
  g_phases[slot_].used.store(false, std::memory_order_release);
  g_phases[slot_].deadline_ns = 0;
}

}  // namespace dflash::comm
