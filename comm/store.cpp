#include "comm/store.h"

#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/ranges.h>

#include "core/error.h"
#include "comm/identity.h"
#include "comm/progress.h"
#include "comm/startup_watchdog.h"
#include "core/log.h"

namespace dflash::comm {
namespace {

using Clock = std::chrono::steady_clock;

Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string line;
  while (std::getline(ss, line)) out.push_back(line);
  return out;
}

}  // namespace

// ---- Store defaults -----------------------------------------------------------------------
void Store::wait(const std::vector<std::string>& keys, double timeout_s) {
  auto deadline = deadline_after(timeout_s);
  auto pause = std::chrono::milliseconds(5);
  while (!check(keys)) {
    if (Clock::now() > deadline) {
      std::vector<std::string> missing;
      for (const auto& k : keys)
        if (!check({k})) missing.push_back(k);
      throw CommError(fmt::format("store: key(s) {} did not appear within {:.1f} s",
                                  fmt::join(missing, ", "), timeout_s));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
}

void Store::set_string(const std::string& key, const std::string& value) {
  set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string Store::get_string(const std::string& key, double timeout_s) {
  std::vector<uint8_t> v = get(key, timeout_s);
  return std::string(v.begin(), v.end());
}

// ---- HashStore ----------------------------------------------------------------------------
struct HashStore::Impl {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, std::vector<uint8_t>> map;
};

HashStore::HashStore() : impl_(std::make_unique<Impl>()) {}
HashStore::~HashStore() = default;

void HashStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    impl_->map[key] = value;
  }
  impl_->cv.notify_all();
}

std::vector<uint8_t> HashStore::get(const std::string& key, double timeout_s) {
  wait({key}, timeout_s);
  std::lock_guard<std::mutex> g(impl_->mu);
  return impl_->map.at(key);
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> g(impl_->mu);
    auto it = impl_->map.find(key);
    if (it != impl_->map.end()) value = std::stoll(std::string(it->second.begin(), it->second.end()));
    value += delta;
    std::string s = std::to_string(value);
    impl_->map[key] = std::vector<uint8_t>(s.begin(), s.end());
  }
  impl_->cv.notify_all();
  return value;
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> g(impl_->mu);
  for (const auto& k : keys)
    if (!impl_->map.count(k)) return false;
  return true;
}

void HashStore::wait(const std::vector<std::string>& keys, double timeout_s) {
  std::unique_lock<std::mutex> g(impl_->mu);
  auto have_all = [&] {
    for (const auto& k : keys)
      if (!impl_->map.count(k)) return false;
    return true;
  };
  if (impl_->cv.wait_until(g, deadline_after(timeout_s), have_all)) return;
  std::vector<std::string> missing;
  for (const auto& k : keys)
    if (!impl_->map.count(k)) missing.push_back(k);
  throw CommError(fmt::format("store: key(s) {} did not appear within {:.1f} s", fmt::join(missing, ", "),
                              timeout_s));
}

// ---- TcpStore (c10d::TCPStore) --------------------------------------------------------------
struct TcpStore::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  std::string prefix;
  std::string where;
};

TcpStore::TcpStore(const std::string& host, int port, bool is_server, double timeout_s,
                   const std::string& prefix)
    : impl_(std::make_unique<Impl>()) {
  // c10d logs every failed connection attempt with a stack trace; our one line says it all
  // (TORCH_CPP_LOG_LEVEL set by the user wins)
  if (!std::getenv("TORCH_CPP_LOG_LEVEL")) {
    FLAGS_caffe2_log_level = 3;  // FATAL only
    c10::UpdateLoggingLevelsFromFlags();
  }
  impl_->prefix = prefix;
  impl_->where = fmt::format("{}:{}", host, port);
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(port);
  opts.isServer = is_server;
  opts.waitWorkers = false;  // our rendezvous waits, with a deadline and a list of who is missing
  opts.multiTenant = true;
  opts.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(host, opts);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("TCP store at {} (MASTER_ADDR:MASTER_PORT): cannot {} within {:.0f} s: {}",
                                impl_->where, is_server ? "serve" : "connect", timeout_s,
                                split_lines(e.what()).empty() ? "" : split_lines(e.what())[0]));
  }
}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  try {
    impl_->store->set(impl_->prefix + key, value);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("TCP store at {}: set '{}' failed: {}", impl_->where, key, e.what()));
  }
}

std::vector<uint8_t> TcpStore::get(const std::string& key, double timeout_s) {
  wait({key}, timeout_s);
  try {
    return impl_->store->get(impl_->prefix + key);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("TCP store at {}: get '{}' failed: {}", impl_->where, key, e.what()));
  }
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  try {
    return impl_->store->add(impl_->prefix + key, delta);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("TCP store at {}: add '{}' failed: {}", impl_->where, key, e.what()));
  }
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  std::vector<std::string> full;
  for (const auto& k : keys) full.push_back(impl_->prefix + k);
  try {
    return impl_->store->check(full);
  } catch (const std::exception& e) {
    throw CommError(fmt::format("TCP store at {}: lost the connection (the rank serving it may have "
                                "died): {}", impl_->where, split_lines(e.what()).empty() ? "" : split_lines(e.what())[0]));
  }
}

std::unique_ptr<Store> make_store(const Identity& id, double timeout_s) {
  if (id.master_addr.empty())
    throw_user("rendezvous needs MASTER_ADDR (the host of rank 0) in the environment ({} launch, world "
               "size {})", source_name(id.source), id.world_size);
  if (id.master_port <= 0)
    throw_user("rendezvous needs MASTER_PORT (a free TCP port on MASTER_ADDR) in the environment ({} "
               "launch, world size {})", source_name(id.source), id.world_size);
  bool server = id.rank == 0 && !id.agent_store;
  std::string prefix = fmt::format("dflash/a{}/", id.restart_count);
  log::debug("TCP store {}:{} ({}), keys under '{}'", id.master_addr, id.master_port,
             server ? "serving" : "client", prefix);
  // c10d retries the connection on its own; the phase bounds it to the deadline (+1 s for its
  // own, better message)
  StartupPhase phase(fmt::format("{} the TCP store at {}:{} (MASTER_ADDR:MASTER_PORT; rank 0 serves it)",
                                 server ? "serving" : "connecting to", id.master_addr, id.master_port), 1.0);
  try {
    return std::make_unique<TcpStore>(id.master_addr, id.master_port, server, timeout_s, prefix);
  } catch (const CommError& e) {
    if (server || id.agent_store) throw;
    // c10d's own connect timeout may come before the phase's deadline: name the store host's
    // state all the same (this node's board), never nobody
    std::string late = progress::diagnose();
    throw CommError(fmt::format("{}; {}", e.what(),
                                late.empty() ? "rank 0 serves it: is it running on MASTER_ADDR (see its log)?" : late));
  }
}

std::shared_ptr<Store> startup_store(const Identity& id, double timeout_s) {
  if (id.world_size == 1 || id.source == Source::Mpi) return nullptr;
  return make_store(id, timeout_s);
}

// ---- rendezvous -----------------------------------------------------------------------------
namespace {

constexpr const char* kFailed = "!failed: ";  // rank 0's verdict in place of the list

std::string rdzv_key(const std::string& tag, int r) { return fmt::format("rdzv/{}/rank/{}", tag, r); }

// Why rank 0 did not complete the rendezvous, as far as this (non-zero) rank can tell: the
// store's record of who checked in (when it still answers), this node's board, and what the
// board says about rank 0 itself. Names a rank only when the evidence says so.
std::string client_diagnosis(Store& store, const std::string& tag, int world_size, double timeout_s) {
  std::vector<int> absent;
  bool store_up = true;
  try {
    for (int r = 1; r < world_size; ++r)
      if (!store.check({rdzv_key(tag, r)})) absent.push_back(r);
  } catch (const CommError&) {
    store_up = false;
  }
  progress::Seen host = progress::seen(0);
  std::string late = progress::diagnose();
  std::string head;
  if (store_up) {
    head = fmt::format("rendezvous '{}': rank 0 did not complete it within {:.0f} s", tag, timeout_s);
    if (!absent.empty())
      head += fmt::format(" (the store has no record of rank{} {}: {} not arrive)", absent.size() > 1 ? "s" : "",
                          fmt::join(absent, ", "), absent.size() > 1 ? "they did" : "it did");
  } else if (host == progress::Seen::Dead || host == progress::Seen::NeverStarted) {
    head = fmt::format("rendezvous '{}': rank 0 (the store host) is gone", tag);
  } else if (host == progress::Seen::Ended) {
    head = fmt::format("rendezvous '{}': rank 0 (the store host) ended on an error of its own before it completed "
                       "(its line says why)", tag);
  } else {
    head = fmt::format("rendezvous '{}': lost the connection to the store (rank 0 serves it) before it completed", tag);
  }
  if (!late.empty()) return head + "; " + late;
  if (host == progress::Seen::Unknown && !store_up) return head + " (rank 0 may have died, or its node is unreachable: see its log)";
  return head;
}

}  // namespace

std::vector<std::string> rendezvous(Store& store, const std::string& tag, int rank, int world_size,
                                    const std::string& info, double timeout_s) {
  DFLASH_CHECK(info.find('\n') == std::string::npos, "rendezvous info must be one line: '{}'", info);
  auto key = [&](int r) { return rdzv_key(tag, r); };
  std::string all_key = fmt::format("rdzv/{}/all", tag);
  std::string seen_key = fmt::format("rdzv/{}/failure_read", tag);
  // a backstop: the code below reports better (rank 0 at timeout_s, the others at timeout_s + 1.5)
  StartupPhase phase(fmt::format("rendezvous '{}'", tag), 3.0);
  store.set_string(key(rank), info);
  if (rank != 0) {
    std::string all;
    try {
      // rank 0 gives its verdict at timeout_s: wait a little longer, so that it is rank 0 (which
      // knows who arrived) that names the missing ranks
      all = store.get_string(all_key, timeout_s + 1.5);
    } catch (const CommError&) {
      throw CommError(client_diagnosis(store, tag, world_size, timeout_s));
    }
    if (all.rfind(kFailed, 0) == 0) {
      try {
        store.add(seen_key, 1);  // rank 0 may stop serving now
      } catch (const CommError&) {
      }
      throw CommError(fmt::format("{} (reported by rank 0, which serves the store)", all.substr(std::strlen(kFailed))));
    }
    return split_lines(all);
  }
  auto deadline = deadline_after(timeout_s);
  std::vector<bool> arrived(world_size, false);
  auto pause = std::chrono::milliseconds(2);
  for (;;) {
    std::vector<int> missing;
    for (int r = 0; r < world_size; ++r) {
      if (!arrived[r]) arrived[r] = store.check({key(r)});
      if (!arrived[r]) missing.push_back(r);
    }
    if (missing.empty()) break;
    if (Clock::now() > deadline) {
      std::string late = progress::diagnose();  // how the missing ones stand, when on this node
      std::string msg = fmt::format("rendezvous '{}': rank{} {} of {} did not arrive within {:.0f} s "
                                    "(comm.startup_timeout_s){}{}", tag, missing.size() > 1 ? "s" : "",
                                    fmt::join(missing, ", "), world_size, timeout_s, late.empty() ? "" : "; ", late);
      // the verdict for the ranks that did arrive (they wait for the list), then keep serving
      // the store until they have read it (at most 2 s)
      int readers = world_size - static_cast<int>(missing.size()) - 1;
      try {
        store.set_string(all_key, kFailed + msg);
        auto until = deadline_after(std::min(2.0, timeout_s));
        while (store.add(seen_key, 0) < readers && Clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
      } catch (const CommError&) {
      }
      throw CommError(msg);
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  std::vector<std::string> infos(world_size);
  std::string joined;
  for (int r = 0; r < world_size; ++r) {
    infos[r] = store.get_string(key(r), timeout_s);
    joined += infos[r] + "\n";
  }
  store.set_string(all_key, joined);
  return infos;
}

void sign_off(Store& store, const std::string& tag, int rank, int world_size, double timeout_s) {
  const std::string key = fmt::format("{}/done", tag);
  store.add(key, 1);
  if (rank != 0) return;
  auto deadline = deadline_after(timeout_s);
  while (store.add(key, 0) < world_size) {
    if (Clock::now() > deadline)
      throw CommError(fmt::format("{}: not every rank read the rendezvous result within {:.0f} s", tag, timeout_s));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace dflash::comm
