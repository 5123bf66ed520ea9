// NCCL implementation of Communicator (comm/communicator.h): CUDA tensors, one GPU per rank.
//
// - Start-up: rank 0's ncclUniqueId travels by MPI_Bcast under MPI, otherwise through the TCP
//   store (after a rendezvous that names missing ranks). Communicators are nonblocking
//   (config.blocking = 0): init, split and every group end are polled with
//   ncclCommGetAsyncError against the deadline.
// - Streams: point-to-point operations run on this communicator's p2p stream, collectives on
//   its collective stream, with their own NCCL communicators (ncclCommSplit; the world's
//   barrier too), so a collective is never queued behind a receive that waits for a peer which
//   itself waits for that collective. Each operation first waits (event) for the caller's
//   current stream, so inputs produced there are ready; results are ready on the caller's
//   current stream when wait()/all_reduce() return. Tensors handed to NCCL are recordStream()ed
//   onto our streams, so the caching allocator never reuses them too early.
// - All-reduce: iall_reduce posts one NCCL group (ncclAllReduce per tensor, non-contiguous ones
//   through a contiguous copy) on the collective stream after the caller's current stream, and
//   records an event; its wait() polls that event, makes the waiter's current stream wait for
//   it and copies the copies back. The state (tensors, event) stays with the communicator until
//   the event completed, whether or not the handle was waited (as sends).
// - Pattern rule (NCCL, unlike MPI): one stream per direction class means a rank should not
//   post receives behind its own unmatched sends to the same peer when that peer does the same
//   (both sides sending first deadlocks once messages exceed NCCL's buffers). The pipeline's
//   one-way target -> drafter stream, and ping-pong, are safe.
// - Messages: a header (kHeaderBytes) in one group, the tensors (bytes) in a second group.
//   A receiver learns the shapes from the header, so it posts the data receive after the
//   header has arrived. Receives are posted in the order of the irecv calls, over all peers:
//   the header receive of irecv n is posted only after the data receive of irecv n-1. NCCL
//   matches a pair's operations in order, without tags; and with one global order, the p2p
//   stream of every rank is ordered by the global batch index k, on senders and receivers
//   alike, so the smallest outstanding k can always complete (no cycle of ranks each waiting
//   behind a later batch, whatever T, D and the prefetch depth). Pending receives progress
//   whenever the communicator is called or waits (including during all_reduce), and on test().
// - Deadlines: every wait polls cudaEventQuery + ncclCommGetAsyncError; on expiry or an error
//   all communicators are aborted (ncclCommAbort) and a CommError names op, peer and batch.
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "comm/check.h"
#include "core/error.h"
#include "core/log.h"
#include "comm/store.h"

namespace dflash::comm {
namespace {

ncclDataType_t nccl_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return ncclFloat32;
    case at::kHalf: return ncclFloat16;
    case at::kBFloat16: return ncclBfloat16;
    case at::kDouble: return ncclFloat64;
    case at::kLong: return ncclInt64;
    case at::kInt: return ncclInt32;
    case at::kByte: return ncclUint8;
    case at::kChar: return ncclInt8;
    case at::kBool: return ncclUint8;
    default:
      throw std::invalid_argument(fmt::format("all_reduce: dtype {} is not supported by NCCL", c10::toString(t)));
  }
}

void record_stream(const at::Tensor& t, const c10::cuda::CUDAStream& s) {
  if (t.numel() > 0) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), s);
}

class NcclCommunicator;

class NcclGroup : public Group {
 public:
  NcclGroup(std::vector<int> ranks, ncclComm_t comm) : Group(std::move(ranks)), comm_(comm) {}
  ncclComm_t comm() const { return comm_; }
  ncclComm_t comm_;  // owned by the communicator (aborted/destroyed with it)
};

struct Event {
  cudaEvent_t ev = nullptr;
  Event() { DFLASH_CHECK_CUDA(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming)); }
  ~Event() {
    if (ev) cudaEventDestroy(ev);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// A receive in progress (state shared by its handle and the per-peer queue).
struct RecvState {
  int peer;
  int64_t expected;
  bool header_posted = false, data_posted = false;
  at::Tensor header_dev, header_host;
  Event header_done, data_done;
  Message msg;
};

// A send in progress: kept alive by the communicator until its event completes.
struct SendState {
  int peer;
  int64_t batch;
  std::vector<at::Tensor> tensors;
  at::Tensor header_dev, header_host;
  Event done;
};

// An all-reduce in progress (iall_reduce): likewise kept until its event completes.
struct CollState {
  std::string what;  // "all_reduce over group [..]"
  int64_t batch;
  std::vector<at::Tensor> tensors, work;  // the caller's; what NCCL reduces (contiguous)
  Event done;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(const Identity& id, double startup_timeout_s, std::shared_ptr<Store> store);
  ~NcclCommunicator() override;

  at::Device device() const override { return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(gpu_)); }
  const char* backend() const override { return "nccl"; }
  std::shared_ptr<Group> new_group(const std::vector<int>& ranks) override;
  HandlePtr iall_reduce(Group& group, std::vector<at::Tensor> tensors, ReduceOp op, int64_t batch) override;
  void barrier(Group* group) override;
  void abort(const std::string& reason) override;

  // for handles
  void wait_event(cudaEvent_t ev, const BlockedOn& b);
  void progress_recvs();  // posts what it can of the receive queue, in order
  void finish_recv(RecvState& st, const BlockedOn& b);
  bool recv_done(RecvState& st);
  void wait_send(SendState& st, const BlockedOn& b) { wait_event(st.done.ev, b); }
  void finish_coll(CollState& st);

 protected:
  HandlePtr do_isend(int peer, const Message& msg) override;
  HandlePtr do_irecv(int peer, int64_t expected_batch) override;

 private:
  void init(const Identity& id, double startup_timeout_s);
  void mark_failed(const std::string& reason);
  void wait_ready(ncclComm_t c, const BlockedOn& b);   // after init/split/group end
  void check_async(const BlockedOn& b);                // any comm in error -> abort + throw
  [[noreturn]] void fail(const BlockedOn& b, const std::string& detail);
  void post_header(RecvState& st);
  void post_data(RecvState& st);
  void reap_sends();  // and finished collectives
  c10::cuda::CUDAStream caller_stream() const { return c10::cuda::getCurrentCUDAStream(gpu_); }
  void stream_wait_caller(const c10::cuda::CUDAStream& s);

  int gpu_;
  c10::cuda::CUDAStream stream_;       // point to point
  c10::cuda::CUDAStream coll_stream_;  // collectives
  std::shared_ptr<Group> world_group_;  // a split of the world for barrier()
  ncclComm_t world_comm_ = nullptr;
  std::vector<ncclComm_t> comms_;  // world + groups, for abort
  std::mutex comms_mu_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;
  int abort_id_ = -1;
  std::shared_ptr<Store> store_;  // the run's start-up store, or our own; kept while we live
  std::deque<std::shared_ptr<RecvState>> recvs_;  // pending receives, in irecv order
  bool in_progress_ = false;
  std::deque<std::shared_ptr<SendState>> sends_;
  std::deque<std::shared_ptr<CollState>> colls_;
};

class NcclSendHandle : public Handle {
 public:
  NcclSendHandle(NcclCommunicator& c, std::shared_ptr<SendState> st) : c_(c), st_(std::move(st)) {}
  bool test() override { return cudaEventQuery(st_->done.ev) == cudaSuccess; }
  void wait() override {
    BlockedOn b("send", st_->peer, st_->batch, c_.timeout());
    c_.wait_send(*st_, b);
  }

 private:
  NcclCommunicator& c_;
  std::shared_ptr<SendState> st_;
};

class NcclCollHandle : public Handle {
 public:
  NcclCollHandle(NcclCommunicator& c, std::shared_ptr<CollState> st) : c_(c), st_(std::move(st)) {}
  bool test() override {
    c_.progress_recvs();
    const cudaError_t q = cudaEventQuery(st_->done.ev);
    if (q != cudaErrorNotReady) DFLASH_CHECK_CUDA(q);
    return q == cudaSuccess;
  }
  void wait() override {
    if (waited_) return;
    c_.finish_coll(*st_);
    waited_ = true;
  }

 private:
  NcclCommunicator& c_;
  std::shared_ptr<CollState> st_;
  bool waited_ = false;
};

class NcclRecvHandle : public Handle {
 public:
  NcclRecvHandle(NcclCommunicator& c, std::shared_ptr<RecvState> st) : c_(c), st_(std::move(st)) {}
  bool test() override {
    c_.progress_recvs();
    return c_.recv_done(*st_);
  }
  void wait() override {
    BlockedOn b("recv", st_->peer, st_->expected, c_.timeout());
    c_.finish_recv(*st_, b);
  }
  Message take() override {
    wait();
    return std::move(st_->msg);
  }

 private:
  NcclCommunicator& c_;
  std::shared_ptr<RecvState> st_;
};

// ---- construction -------------------------------------------------------------------------
ncclConfig_t nonblocking_config() {
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  return cfg;
}

NcclCommunicator::NcclCommunicator(const Identity& id, double startup_timeout_s, std::shared_ptr<Store> store)
    : Communicator(id.rank, id.world_size, startup_timeout_s),
      gpu_(id.gpu),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(id.gpu))),
      coll_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, static_cast<c10::DeviceIndex>(id.gpu))),
      store_(std::move(store)) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  try {
    init(id, startup_timeout_s);
  } catch (...) {
    abort("start-up failed");  // no destructor runs for a half-built object: free the comms here
    throw;
  }
  abort_id_ = register_abort([this](const std::string& r) { abort(r); });
}

void NcclCommunicator::init(const Identity& id, double startup_timeout_s) {
  ncclUniqueId uid;
  if (rank_ == 0) DFLASH_CHECK_NCCL(ncclGetUniqueId(&uid), nullptr);
  if (mpi_active()) {
    BlockedOn b("MPI_Bcast of the ncclUniqueId (start-up)", 0, kNoBatch, startup_timeout_s);
    DFLASH_CHECK_MPI(MPI_Bcast(&uid, sizeof(uid), MPI_BYTE, 0, MPI_COMM_WORLD));
  } else if (world_ > 1) {
    if (!store_) store_ = make_store(id, startup_timeout_s);
    rendezvous(*store_, "nccl", rank_, world_, fmt::format("{} gpu {}", id.host, gpu_), startup_timeout_s);
    if (rank_ == 0) {
      store_->set("nccl/unique_id", std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&uid),
                                                         reinterpret_cast<uint8_t*>(&uid) + sizeof(uid)));
    } else {
      std::vector<uint8_t> v = store_->get("nccl/unique_id", startup_timeout_s);
      DFLASH_CHECK(v.size() == sizeof(uid), "ncclUniqueId of {} bytes in the store, expected {}", v.size(), sizeof(uid));
      std::memcpy(&uid, v.data(), sizeof(uid));
    }
  }
  ncclConfig_t cfg = nonblocking_config();
  BlockedOn b("ncclCommInitRankConfig (start-up)", kNoPeer, kNoBatch, startup_timeout_s);
  DFLASH_CHECK_NCCL(ncclCommInitRankConfig(&world_comm_, world_, uid, rank_, &cfg), world_comm_);
  {
    std::lock_guard<std::mutex> g(comms_mu_);
    comms_.push_back(world_comm_);
  }
  wait_ready(world_comm_, b);
  std::vector<int> all;
  for (int r = 0; r < world_; ++r) all.push_back(r);
  world_group_ = new_group(all);
}

NcclCommunicator::~NcclCommunicator() {
  unregister_abort(abort_id_);
  in_progress_ = true;  // post nothing more
  bool dangling = false;  // receives whose messages never came: their kernels would never end
  for (const auto& st : recvs_) dangling = dangling || !st->data_posted;
  if (!aborted_ && !dangling) {
    // finish what is in flight (bounded), then free the communicators
    try {
      BlockedOn b("shutdown", kNoPeer, kNoBatch, timeout_s_);
      Event e, f;
      DFLASH_CHECK_CUDA(cudaEventRecord(e.ev, stream_.stream()));
      DFLASH_CHECK_CUDA(cudaEventRecord(f.ev, coll_stream_.stream()));
      wait_event(e.ev, b);
      wait_event(f.ev, b);
    } catch (const std::exception& e) {
      log::warn("NCCL shutdown: {}", e.what());
    }
  }
  std::lock_guard<std::mutex> g(comms_mu_);
  for (auto it = comms_.rbegin(); it != comms_.rend(); ++it) ncclCommAbort(*it);  // abort also frees
  comms_.clear();
}

// ---- polling ------------------------------------------------------------------------------
void NcclCommunicator::mark_failed(const std::string& reason) {
  if (!aborted_.exchange(true)) abort_reason_ = reason;
}

void NcclCommunicator::abort(const std::string& reason) {
  mark_failed(reason);
  std::lock_guard<std::mutex> g(comms_mu_);
  for (auto it = comms_.rbegin(); it != comms_.rend(); ++it) ncclCommAbort(*it);
  comms_.clear();
}

// A deadline or an async error: the communicator is unusable from here on. ncclCommAbort can
// block while a kernel waits for a dead peer (seen on H200: > 5 s), so it is left to
// fail_fast's bounded abort_all (or the destructor); the error goes out at once.
void NcclCommunicator::fail(const BlockedOn& b, const std::string& detail) {
  std::string msg = b.timeout_message(detail);
  mark_failed(msg);
  throw CommError(msg);
}

void NcclCommunicator::check_async(const BlockedOn& b) {
  if (aborted_) throw CommError(fmt::format("{}: communicator aborted ({})", b.what(), abort_reason_));
  std::string msg;
  {
    std::lock_guard<std::mutex> g(comms_mu_);
    for (ncclComm_t c : comms_) {
      ncclResult_t st = ncclSuccess;
      ncclResult_t rc = ncclCommGetAsyncError(c, &st);
      if (rc != ncclSuccess) st = rc;
      if (st != ncclSuccess && st != ncclInProgress) {
        msg = fmt::format("{}: NCCL error: {} ({})", b.what(), ncclGetErrorString(st), ncclGetLastError(c));
        break;
      }
    }
  }
  if (msg.empty()) return;
  mark_failed(msg);
  throw CommError(msg);
}

void NcclCommunicator::wait_ready(ncclComm_t c, const BlockedOn& b) {
  auto pause = std::chrono::microseconds(1);
  for (int spins = 0;; ++spins) {
    if (aborted_) throw CommError(fmt::format("{}: communicator aborted ({})", b.what(), abort_reason_));
    ncclResult_t st = ncclSuccess;
    ncclResult_t rc = ncclCommGetAsyncError(c, &st);
    if (rc != ncclSuccess) st = rc;
    if (st == ncclSuccess) return;
    if (st != ncclInProgress) {
      std::string msg = fmt::format("{}: NCCL error: {} ({})", b.what(), ncclGetErrorString(st), ncclGetLastError(c));
      mark_failed(msg);
      throw CommError(msg);
    }
    if (b.expired()) fail(b, "NCCL did not finish (a peer died, hangs, or is out of step)");
    if (spins > 64) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
}

void NcclCommunicator::wait_event(cudaEvent_t ev, const BlockedOn& b) {
  auto pause = std::chrono::microseconds(1);
  for (int spins = 0;; ++spins) {
    cudaError_t q = cudaEventQuery(ev);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) DFLASH_CHECK_CUDA(q);
    check_async(b);
    if (spins % 16 == 0) progress_recvs();  // let prefetched receives start while we wait
    if (b.expired()) fail(b, "the peer died, hangs, or is out of step");
    if (spins > 64) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(200));
    }
  }
}

void NcclCommunicator::stream_wait_caller(const c10::cuda::CUDAStream& s) {
  Event e;
  DFLASH_CHECK_CUDA(cudaEventRecord(e.ev, caller_stream().stream()));
  DFLASH_CHECK_CUDA(cudaStreamWaitEvent(s.stream(), e.ev, 0));
}

void NcclCommunicator::reap_sends() {
  while (!sends_.empty() && cudaEventQuery(sends_.front()->done.ev) == cudaSuccess) sends_.pop_front();
  while (!colls_.empty() && cudaEventQuery(colls_.front()->done.ev) == cudaSuccess) colls_.pop_front();
}

// ---- point to point -----------------------------------------------------------------------
HandlePtr NcclCommunicator::do_isend(int peer, const Message& msg) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  BlockedOn b("send", peer, msg.batch, timeout_s_);
  if (aborted_) check_async(b);
  reap_sends();
  progress_recvs();
  auto st = std::make_shared<SendState>();
  st->peer = peer;
  st->batch = msg.batch;
  for (const at::Tensor& t : msg.tensors) st->tensors.push_back(t.to(device()).contiguous());
  Message m{msg.kind, msg.batch, st->tensors};
  st->header_host = at::empty({static_cast<int64_t>(kHeaderBytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  encode_header(header_of(m), st->header_host.data_ptr<uint8_t>());
  st->header_dev = at::empty({static_cast<int64_t>(kHeaderBytes)}, at::TensorOptions().dtype(at::kByte).device(device()));
  stream_wait_caller(stream_);
  DFLASH_CHECK_CUDA(cudaMemcpyAsync(st->header_dev.data_ptr(), st->header_host.data_ptr(), kHeaderBytes,
                                    cudaMemcpyHostToDevice, stream_.stream()));
  DFLASH_CHECK_NCCL(ncclGroupStart(), world_comm_);
  DFLASH_CHECK_NCCL(ncclSend(st->header_dev.data_ptr(), kHeaderBytes, ncclUint8, peer, world_comm_, stream_.stream()), world_comm_);
  DFLASH_CHECK_NCCL(ncclGroupEnd(), world_comm_);
  wait_ready(world_comm_, b);
  bool any = false;
  for (const at::Tensor& t : st->tensors) any = any || t.nbytes() > 0;
  if (any) {
    DFLASH_CHECK_NCCL(ncclGroupStart(), world_comm_);
    for (const at::Tensor& t : st->tensors)
      if (t.nbytes() > 0)
        DFLASH_CHECK_NCCL(ncclSend(t.data_ptr(), t.nbytes(), ncclUint8, peer, world_comm_, stream_.stream()), world_comm_);
    DFLASH_CHECK_NCCL(ncclGroupEnd(), world_comm_);
    wait_ready(world_comm_, b);
  }
  for (const at::Tensor& t : st->tensors) record_stream(t, stream_);
  record_stream(st->header_dev, stream_);
  DFLASH_CHECK_CUDA(cudaEventRecord(st->done.ev, stream_.stream()));
  sends_.push_back(st);
  return std::make_unique<NcclSendHandle>(*this, st);
}

HandlePtr NcclCommunicator::do_irecv(int peer, int64_t expected_batch) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  auto st = std::make_shared<RecvState>();
  st->peer = peer;
  st->expected = expected_batch;
  recvs_.push_back(st);
  progress_recvs();
  return std::make_unique<NcclRecvHandle>(*this, st);
}

void NcclCommunicator::post_header(RecvState& st) {
  BlockedOn b("recv", st.peer, st.expected, timeout_s_);
  {
    c10::cuda::CUDAStreamGuard sg(stream_);  // header buffers belong to our stream
    st.header_dev = at::empty({static_cast<int64_t>(kHeaderBytes)}, at::TensorOptions().dtype(at::kByte).device(device()));
  }
  st.header_host = at::empty({static_cast<int64_t>(kHeaderBytes)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  DFLASH_CHECK_NCCL(ncclGroupStart(), world_comm_);
  DFLASH_CHECK_NCCL(ncclRecv(st.header_dev.data_ptr(), kHeaderBytes, ncclUint8, st.peer, world_comm_, stream_.stream()), world_comm_);
  DFLASH_CHECK_NCCL(ncclGroupEnd(), world_comm_);
  wait_ready(world_comm_, b);
  DFLASH_CHECK_CUDA(cudaMemcpyAsync(st.header_host.data_ptr(), st.header_dev.data_ptr(), kHeaderBytes,
                                    cudaMemcpyDeviceToHost, stream_.stream()));
  DFLASH_CHECK_CUDA(cudaEventRecord(st.header_done.ev, stream_.stream()));
  st.header_posted = true;
}

void NcclCommunicator::post_data(RecvState& st) {
  BlockedOn b("recv", st.peer, st.expected, timeout_s_);
  Header h = decode_header(st.header_host.data_ptr<uint8_t>(), name_rank(st.peer));
  if (st.expected != kNoBatch && h.batch != st.expected) {
    std::string msg = fmt::format("{}: got batch {} instead (schedule out of step)", b.what(), h.batch);
    mark_failed(msg);
    throw CommError(msg);
  }
  st.msg.kind = h.kind;
  st.msg.batch = h.batch;
  for (const TensorSpec& s : h.specs)  // allocated on the caller's stream, where they are used
    st.msg.tensors.push_back(at::empty(s.shape, at::TensorOptions().dtype(s.dtype).device(device())));
  stream_wait_caller(stream_);
  bool any = false;
  for (const at::Tensor& t : st.msg.tensors) any = any || t.nbytes() > 0;
  if (any) {
    DFLASH_CHECK_NCCL(ncclGroupStart(), world_comm_);
    for (const at::Tensor& t : st.msg.tensors)
      if (t.nbytes() > 0)
        DFLASH_CHECK_NCCL(ncclRecv(t.data_ptr(), t.nbytes(), ncclUint8, st.peer, world_comm_, stream_.stream()), world_comm_);
    DFLASH_CHECK_NCCL(ncclGroupEnd(), world_comm_);
    wait_ready(world_comm_, b);
  }
  for (const at::Tensor& t : st.msg.tensors) record_stream(t, stream_);
  DFLASH_CHECK_CUDA(cudaEventRecord(st.data_done.ev, stream_.stream()));
  st.data_posted = true;
}

void NcclCommunicator::progress_recvs() {
  if (in_progress_ || aborted_) return;  // no re-entry from the waits inside post_*
  in_progress_ = true;
  struct Reset {
    bool& f;
    ~Reset() { f = false; }
  } reset{in_progress_};
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  while (!recvs_.empty() && recvs_.front()->data_posted) recvs_.pop_front();  // handles keep them
  for (auto& st : recvs_) {
    if (st->data_posted) continue;
    if (!st->header_posted) post_header(*st);
    if (cudaEventQuery(st->header_done.ev) != cudaSuccess) return;  // later ones wait their turn
    post_data(*st);
  }
  while (!recvs_.empty() && recvs_.front()->data_posted) recvs_.pop_front();
}

bool NcclCommunicator::recv_done(RecvState& st) {
  return st.data_posted && cudaEventQuery(st.data_done.ev) == cudaSuccess;
}

void NcclCommunicator::finish_recv(RecvState& st, const BlockedOn& b) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  while (!st.data_posted) {
    // the oldest receive whose header is not in yet (possibly from another peer)
    progress_recvs();
    if (st.data_posted) break;
    DFLASH_CHECK(!recvs_.empty(), "receive queue is empty but batch {} is pending", st.expected);
    wait_event(recvs_.front()->header_done.ev, b);
  }
  wait_event(st.data_done.ev, b);
  DFLASH_CHECK_CUDA(cudaStreamWaitEvent(caller_stream().stream(), st.data_done.ev, 0));
}

// ---- collectives --------------------------------------------------------------------------
std::shared_ptr<Group> NcclCommunicator::new_group(const std::vector<int>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    check_peer(ranks[i], "new_group");
    if (i > 0 && ranks[i] <= ranks[i - 1])
      throw std::invalid_argument(fmt::format("new_group: ranks must be sorted and unique, got [{}]",
                                              fmt::join(ranks, ", ")));
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  bool member = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  BlockedOn b(fmt::format("new_group [{}] (ncclCommSplit)", fmt::join(ranks, ", ")), kNoPeer, kNoBatch, timeout_s_);
  ncclComm_t sub = nullptr;
  ncclConfig_t cfg = nonblocking_config();
  DFLASH_CHECK_NCCL(ncclCommSplit(world_comm_, member ? 0 : NCCL_SPLIT_NOCOLOR, rank_, &sub, &cfg), world_comm_);
  wait_ready(world_comm_, b);
  if (sub) {
    {
      std::lock_guard<std::mutex> g(comms_mu_);
      comms_.push_back(sub);
    }
    wait_ready(sub, b);
  }
  return std::make_shared<NcclGroup>(ranks, sub);
}

HandlePtr NcclCommunicator::iall_reduce(Group& group, std::vector<at::Tensor> tensors, ReduceOp op, int64_t batch) {
  auto* g = dynamic_cast<NcclGroup*>(&group);
  if (!g || !g->comm())
    throw std::invalid_argument(fmt::format("all_reduce: rank {} is not a member of {}", rank_, group.describe()));
  // checked before anything is posted: a collective posted here and not on the others would
  // put the group out of step
  for (const at::Tensor& t : tensors) {
    if (op == ReduceOp::Average && !at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(fmt::format("all_reduce: average of an integer tensor ({})", c10::toString(t.scalar_type())));
    DFLASH_CHECK(t.device() == device(), "all_reduce: tensor on {}, the communicator is on {}", t.device().str(), device().str());
    nccl_type(t.scalar_type());  // throws for a dtype NCCL lacks
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  auto st = std::make_shared<CollState>();
  st->what = fmt::format("all_reduce over {}", group.describe());
  st->batch = batch;
  BlockedOn b(st->what, kNoPeer, batch, timeout_s_);  // bounds the enqueue (wait_ready)
  if (aborted_) check_async(b);
  reap_sends();
  progress_recvs();
  for (at::Tensor& t : tensors) st->work.push_back(t.is_contiguous() ? t : t.contiguous());  // on the caller's stream
  st->tensors = std::move(tensors);
  stream_wait_caller(coll_stream_);
  DFLASH_CHECK_NCCL(ncclGroupStart(), g->comm());
  for (at::Tensor& w : st->work)
    if (w.numel() > 0)
      DFLASH_CHECK_NCCL(ncclAllReduce(w.data_ptr(), w.data_ptr(), w.numel(), nccl_type(w.scalar_type()),
                                      op == ReduceOp::Sum ? ncclSum : ncclAvg, g->comm(), coll_stream_.stream()), g->comm());
  DFLASH_CHECK_NCCL(ncclGroupEnd(), g->comm());
  wait_ready(g->comm(), b);
  for (at::Tensor& w : st->work) record_stream(w, coll_stream_);
  DFLASH_CHECK_CUDA(cudaEventRecord(st->done.ev, coll_stream_.stream()));
  colls_.push_back(st);
  return std::make_unique<NcclCollHandle>(*this, st);
}

void NcclCommunicator::finish_coll(CollState& st) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(gpu_));
  BlockedOn b(st.what, kNoPeer, st.batch, timeout_s_);
  wait_event(st.done.ev, b);
  DFLASH_CHECK_CUDA(cudaStreamWaitEvent(caller_stream().stream(), st.done.ev, 0));
  for (size_t i = 0; i < st.tensors.size(); ++i)
    if (st.work[i].data_ptr() != st.tensors[i].data_ptr()) st.tensors[i].copy_(st.work[i]);
}

void NcclCommunicator::barrier(Group* group) {
  if (!group) group = world_group_.get();
  std::vector<at::Tensor> one{at::ones({1}, at::TensorOptions().dtype(at::kInt).device(device()))};
  all_reduce(*group, one, ReduceOp::Sum, kNoBatch);
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(const Identity& id, double startup_timeout_s,
                                                     std::shared_ptr<Store> store) {
  return std::make_unique<NcclCommunicator>(id, startup_timeout_s, std::move(store));
}

}  // namespace dflash::comm
