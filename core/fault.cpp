#include "core/fault.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"
#include "core/log.h"

namespace dflash::fault {

namespace {
const char* spec() {
  static const char* s = std::getenv("DFLASH_TEST_FAIL_AT");
  return s;
}
}  // namespace

bool armed() { return spec() && *spec(); }

void point(int rank, const std::string& where, const std::function<void(const std::string&)>& announce) {
  if (!armed()) return;
  int r = -1;
  char at[32] = {0}, kind[16] = {0};
  if (std::sscanf(spec(), "%d:%31[^:]:%15s", &r, at, kind) != 3)
    throw_user("environment variable DFLASH_TEST_FAIL_AT='{}' is not rank:point:kind", spec());
  if (r != rank || where != at) return;
  std::string k = kind;
  if (k != "throw" && k != "sigkill" && k != "stop" && k != "hang")
    throw_user("environment variable DFLASH_TEST_FAIL_AT: kind '{}' is not throw, sigkill, hang or stop", k);
  // a bare number is a batch of --comm-check (its tests read "at batch K")
  bool numeric = !where.empty() && where.find_first_not_of("0123456789") == std::string::npos;
  std::string label = numeric ? "batch " + where : where;
  log::warn("DFLASH_TEST_FAIL_AT: injecting '{}' at {}", k, label);
  if (announce) announce(k);
  if (k == "throw") throw std::runtime_error(fmt::format("injected failure (DFLASH_TEST_FAIL_AT) at {}", label));
  if (k == "sigkill") std::raise(SIGKILL);
  if (k == "stop") std::raise(SIGSTOP);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

}  // namespace dflash::fault
