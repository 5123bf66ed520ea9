// Moving tensors between ranks: the Communicator interface and its message format.
//
// Owns: the message (a small header: kind, global batch index, count, dtypes, shapes; then
// the tensors), point-to-point send/recv (blocking and asynchronous), all-reduce (sum,
// average; blocking and asynchronous) over a group of chosen ranks, barrier, abort. Two
// implementations:
//  - MPI  (mpi_communicator.cpp): CPU tensors over OpenMPI, nonblocking calls polled with
//    MPI_Test against the deadline. Works with or without GPUs; the tests run it on CPU.
//  - NCCL (nccl_communicator.cpp, only with CUDA): CUDA tensors; sends and receives in
//    ncclGroupStart/End on the communicator's own CUDA stream, ordered against the caller's
//    current stream with events; nonblocking communicators (config.blocking=0), so every wait
//    polls ncclCommGetAsyncError and aborts on the deadline.
//
// How the pipeline uses it (every call is bounded by timeout(); on expiry or an async error
// the communicator is aborted and a CommError names the op, the peer and the batch):
//
//   auto comm = make_communicator(cfg.comm, identity);          // collective: every rank
//   auto drafters = comm->new_group(schedule.drafter_ranks());   // collective: every rank
//   // target rank: batch k to drafter rank dest (tensors on comm->device())
//   comm->send(dest, Message{kKindFeatures, k, {hidden, ids, mask}});
//   // drafter rank: prefetch batch k+D while training on k
//   auto next = comm->irecv(src, k + D);  ...train on k...  Message m = next->take();
//   // gradients in buckets, each posted as soon as the backward has produced it (every rank
//   // posts the same buckets in the same order), all waited for before the optimizer
//   std::vector<HandlePtr> hs;
//   for (auto& bucket : buckets) hs.push_back(comm->iall_reduce(*drafters, bucket, ReduceOp::Average, k));
//   for (auto& h : hs) h->wait();
//   comm->all_reduce(*drafters, stats, ReduceOp::Sum, k);         // = iall_reduce(...)->wait()
//   comm->set_timeout(cfg.comm.timeout_s);                       // after the first step
//
// Ordering: messages between one (sender, receiver) pair arrive in the order they were sent;
// the n-th irecv from a peer gets the n-th message that peer sent to this rank, whatever
// order the handles are waited in. A message to oneself (colocated runs) goes through an
// in-process queue (tensors are cloned).
// Collectives (all_reduce, iall_reduce, barrier, new_group) must be POSTED in the same order
// on every rank of their group: the n-th collective a rank posts on a group meets the n-th
// collective of every other member (MPI and NCCL match them by order, not by name). Their
// handles may be waited in any order.
// Received tensors are on device() and ready to use on the caller's current stream.
//
// Thread-safety: one thread at a time may call a Communicator (and its handles); abort() may
// be called from any thread. Handles belong to their Communicator and must not outlive it. A
// handle may be destroyed without wait(): its destructor neither throws nor blocks, and the
// communicator keeps the buffers of what is still in flight until the transfer has ended.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "comm/identity.h"
#include "comm/store.h"
#include "comm/watchdog.h"

namespace dflash::comm {

struct Message {
  int32_t kind = 0;     // what the tensors are (the pipeline defines the kinds)
  int64_t batch = -1;   // global batch index k (for ordering checks and error messages)
  std::vector<at::Tensor> tensors;
};

enum class ReduceOp { Sum, Average };

// ---- wire header ------------------------------------------------------------------------
// Fixed size, so both sides know how many bytes the first transfer of a message has.
constexpr int kMaxTensors = 24;
constexpr int kMaxDims = 8;
constexpr size_t kHeaderBytes = 2048;
constexpr uint32_t kHeaderMagic = 0x64464c31;  // "dFL1"
constexpr uint32_t kHeaderVersion = 1;

struct TensorSpec {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t nbytes() const;
};
struct Header {
  int32_t kind = 0;
  int64_t batch = -1;
  std::vector<TensorSpec> specs;
};
// Encodes into exactly kHeaderBytes; CommError on a dtype or rank the format cannot carry.
void encode_header(const Header& h, uint8_t* out);
// CommError naming `from` on a bad magic/version/count (a peer out of step or corrupt data).
Header decode_header(const uint8_t* in, const std::string& from);
Header header_of(const Message& m);

// ---- handles ----------------------------------------------------------------------------
class Handle {
 public:
  virtual ~Handle() = default;
  // Makes progress without blocking; true once complete (iall_reduce: the result is delivered
  // by wait(), which then returns at once).
  virtual bool test() = 0;
  // Blocks until complete, at most the communicator's timeout() counted from this call; on
  // expiry or an asynchronous error the communicator is aborted and a CommError names the op,
  // the peer or group and the batch. Waiting again after it returned is a no-op.
  virtual void wait() = 0;
  // irecv only: waits, then hands over the received message (once).
  virtual Message take();
};
using HandlePtr = std::unique_ptr<Handle>;

// A sub-group of ranks for collectives (MPI sub-communicator or ncclCommSplit).
class Group {
 public:
  virtual ~Group() = default;
  const std::vector<int>& ranks() const { return ranks_; }
  bool contains(int rank) const;
  int size() const { return static_cast<int>(ranks_.size()); }
  std::string describe() const;  // "group [5, 6, 7]"

 protected:
  explicit Group(std::vector<int> ranks) : ranks_(std::move(ranks)) {}
  std::vector<int> ranks_;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  int rank() const { return rank_; }
  int world_size() const { return world_; }
  virtual at::Device device() const = 0;
  virtual const char* backend() const = 0;

  // Deadline of every blocking wait (starts as comm.startup_timeout_s).
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  double timeout() const { return timeout_s_; }

  HandlePtr isend(int peer, const Message& msg);
  // expected_batch (optional): checked against the header; used in error messages.
  HandlePtr irecv(int peer, int64_t expected_batch = kNoBatch);
  void send(int peer, const Message& msg) { isend(peer, msg)->wait(); }
  Message recv(int peer, int64_t expected_batch = kNoBatch) { return irecv(peer, expected_batch)->take(); }

  // Collective over the whole world: every rank calls it with the same ranks (sorted, unique).
  // Ranks outside get a Group that contains() nothing of theirs and must not use it.
  virtual std::shared_ptr<Group> new_group(const std::vector<int>& ranks) = 0;
  // Asynchronous all-reduce, in place on `tensors`, over every rank of `group` (this rank must
  // be a member; std::invalid_argument otherwise, for an average of an integer tensor, and
  // (NCCL) for a tensor on another device: all checked before anything is posted). Integer
  // tensors support Sum only. The tensors' current values (on the caller's current stream) are
  // reduced; the caller must neither read nor write them until the handle's wait() returned,
  // after which the result is ready on the caller's current stream (of the wait() call).
  // Every member must post its collectives on a group in the same order (header). `batch`
  // names the step in error messages.
  virtual HandlePtr iall_reduce(Group& group, std::vector<at::Tensor> tensors, ReduceOp op,
                                int64_t batch = kNoBatch) = 0;
  // The same, blocking: iall_reduce(...)->wait().
  void all_reduce(Group& group, std::vector<at::Tensor>& tensors, ReduceOp op, int64_t batch = kNoBatch) {
    iall_reduce(group, tensors, op, batch)->wait();
  }
  // nullptr: the whole world.
  virtual void barrier(Group* group = nullptr) = 0;
  // Aborts pending and future operations; safe from any thread. Later calls throw CommError.
  virtual void abort(const std::string& reason) = 0;

 protected:
  Communicator(int rank, int world, double timeout_s) : rank_(rank), world_(world), timeout_s_(timeout_s) {}
  virtual HandlePtr do_isend(int peer, const Message& msg) = 0;
  virtual HandlePtr do_irecv(int peer, int64_t expected_batch) = 0;
  void check_peer(int peer, const char* op) const;

  int rank_;
  int world_;
  double timeout_s_;
  std::deque<Message> loopback_;  // messages to self, in order
};

struct CommOptions {
  std::string backend = "auto";  // auto | nccl | mpi (comm.backend)
  double timeout_s = 120;
  double startup_timeout_s = 600;
};

// The communicator of this run. auto: NCCL when this rank has a GPU, MPI otherwise. MPI needs
// an MPI launch (mpirun, srun --mpi=pmix) unless the world is one process. Collective: every
// rank calls it. UserError for a backend this build or launch cannot provide.
// `store`: the run's start-up store (comm/store.h startup_store()), if one is open already;
// NCCL without MPI exchanges its unique id through it (else it opens its own).
std::unique_ptr<Communicator> make_communicator(const CommOptions& opt, const Identity& id,
                                                std::shared_ptr<Store> store = nullptr);

// Backend constructors (make_communicator picks one).
std::unique_ptr<Communicator> make_mpi_communicator(const Identity& id, double startup_timeout_s);
#ifdef DFLASH_CUDA
std::unique_ptr<Communicator> make_nccl_communicator(const Identity& id, double startup_timeout_s,
                                                     std::shared_ptr<Store> store = nullptr);
#endif

}  // namespace dflash::comm
