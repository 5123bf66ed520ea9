// A tiny key-value store for rendezvous, and the rendezvous itself.
//
// Owns: the Store interface (set, get with a deadline, add, check, wait with a deadline) and
// two implementations:
//  - TcpStore: LibTorch's own c10d::TCPStore (libtorch_cpu) on MASTER_ADDR:MASTER_PORT. Rank 0
//    serves it, the others connect; under torchrun (TORCHELASTIC_USE_AGENT_STORE=True) the
//    agent already serves one there and every rank connects as a client. Our keys live under
//    "dflash/a<TORCHELASTIC_RESTART_COUNT>/" so that a restarted attempt never reads the keys
//    of the previous one (torch 2.11's own workers use no prefix on the agent store).
//  - HashStore: in memory, for unit tests (several "ranks" as threads of one process).
// rendezvous(): every rank registers; rank 0 waits with a deadline; on timeout the error
// lists the ranks that never arrived.
// Thread-safety: HashStore is fully thread-safe; one TcpStore object serialises its own calls
// (c10d's client holds a lock), so it may be shared between threads.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dflash::comm {

struct Identity;

class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Waits up to timeout_s for the key; CommError naming the key on expiry.
  virtual std::vector<uint8_t> get(const std::string& key, double timeout_s) = 0;
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // True when every key exists (does not wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // Waits up to timeout_s for every key; CommError listing the missing keys on expiry.
  virtual void wait(const std::vector<std::string>& keys, double timeout_s);

  void set_string(const std::string& key, const std::string& value);
  std::string get_string(const std::string& key, double timeout_s);
};

class HashStore : public Store {
 public:
  HashStore();
  ~HashStore() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, double timeout_s) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, double timeout_s) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class TcpStore : public Store {
 public:
  // Serves the store when is_server, else connects (retrying until timeout_s).
  // CommError naming host:port when it cannot bind or connect.
  TcpStore(const std::string& host, int port, bool is_server, double timeout_s,
           const std::string& prefix);
  ~TcpStore() override;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, double timeout_s) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The store of this run from its identity: TcpStore on MASTER_ADDR:MASTER_PORT (rank 0 serves
// unless the torchrun agent does). UserError naming MASTER_ADDR/MASTER_PORT when absent. A
// client that cannot connect adds the board's word on rank 0 (stopped, dead, never started).
std::unique_ptr<Store> make_store(const Identity& id, double timeout_s);

// The one store of a run's start-up: make_store() for a launch without MPI of more than one
// rank, else none (MPI brings its own rendezvous). The start-up agreement (comm/agree.h) and
// the NCCL communicator share it, so that rank 0 serves one store on MASTER_PORT for the
// whole run.
std::shared_ptr<Store> startup_store(const Identity& id, double timeout_s);

// Every rank registers `info` under `tag`; rank 0 waits up to timeout_s for all, then
// publishes the list; the others wait for it. Returns every rank's info (index = rank).
// CommError on rank 0: "rendezvous 'tag': ranks 2, 5 of 8 did not arrive within 30 s" (+ this
// node's progress board on them); rank 0 publishes that verdict in place of the list and keeps
// serving until the others have read it (at most 2 s), so they end with the same line ("...
// (reported by rank 0, which serves the store)"). A rank that gets no verdict (it waits
// timeout_s + 1.5 s) names what it can tell: the ranks the store has no record of ("rendezvous
// 'tag': rank 0 did not complete it within 30 s (the store has no record of rank 2: ...)"), or,
// when the store is gone, rank 0 as "the store host is gone" only when the board shows it dead
// or never started (else "ended on an error of its own" or "lost the connection"), plus the
// board's diagnosis (comm/progress.h).
std::vector<std::string> rendezvous(Store& store, const std::string& tag, int rank, int world_size,
                                    const std::string& info, double timeout_s);

// After an exchange under `tag` (a rendezvous): every rank signs off, and rank 0 (which may
// serve the store) waits up to timeout_s until all world_size ranks have, so that it never
// takes the store down under a rank that is still reading. CommError on rank 0 on expiry.
void sign_off(Store& store, const std::string& tag, int rank, int world_size, double timeout_s);

}  // namespace dflash::comm
