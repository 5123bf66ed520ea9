// MPI implementation of Communicator (comm/communicator.h): CPU tensors over OpenMPI.
//
// Every operation is nonblocking (MPI_Isend/Irecv/Iallreduce/Ibarrier) and its wait polls
// MPI_Testall against the deadline, sleeping with a short backoff so that oversubscribed ranks
// (8 ranks on 2 cores in CI) leave the cores to whoever has work. Calls into MPI are serialised
// by one mutex (enough for MPI_THREAD_SERIALIZED; harmless under MPI_THREAD_MULTIPLE).
// Tags: every message of a (sender, receiver) pair carries tag 1 + (n mod 30000) where n
// counts the messages of that pair, so a message's header and data never mix with another's,
// whatever order receive handles are waited in. Large tensors travel in chunks of 1 GiB
// (MPI counts are int).
#include <mpi.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

#include <fmt/ranges.h>

#include "comm/communicator.h"
#include "comm/check.h"
#include "core/error.h"
#include "core/log.h"

namespace dflash::comm {
namespace {

constexpr int64_t kChunkBytes = int64_t(1) << 30;
constexpr int64_t kChunkElems = int64_t(1) << 28;

int tag_of(uint64_t seq) { return 1 + static_cast<int>(seq % 30000); }

class MpiCommunicator;

// Polls `reqs` until complete, the deadline, or an abort. Requests stay owned by the caller.
void poll(MpiCommunicator& c, std::vector<MPI_Request>& reqs, const BlockedOn& blocked);

class MpiGroup : public Group {
 public:
  MpiGroup(std::vector<int> ranks, MPI_Comm comm) : Group(std::move(ranks)), comm_(comm) {}
  ~MpiGroup() override {
    if (comm_ != MPI_COMM_NULL && mpi_active()) MPI_Comm_free(&comm_);
  }
  MPI_Comm comm() const { return comm_; }

 private:
  MPI_Comm comm_;
};

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(int rank, int world, double timeout_s)
      : Communicator(rank, world, timeout_s), send_seq_(world, 0), recv_seq_(world, 0) {
    BlockedOn b("MPI_Comm_dup (start-up)", kNoPeer, kNoBatch, timeout_s);
    DFLASH_CHECK_MPI(MPI_Comm_dup(MPI_COMM_WORLD, &comm_));
    DFLASH_CHECK_MPI(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
    abort_id_ = register_abort([this](const std::string& r) { abort(r); });
  }
  ~MpiCommunicator() override {
    unregister_abort(abort_id_);
    if (mpi_active() && !aborted_) MPI_Comm_free(&comm_);
  }

  at::Device device() const override { return at::Device(at::kCPU); }
  const char* backend() const override { return "mpi"; }

  std::shared_ptr<Group> new_group(const std::vector<int>& ranks) override;
  void all_reduce(Group& group, std::vector<at::Tensor>& tensors, ReduceOp op, int64_t batch) override;
  void barrier(Group* group) override;
  void abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> g(abort_mu_);
      if (abort_reason_.empty()) abort_reason_ = reason;
    }
    aborted_ = true;
  }

  // for handles
  std::mutex& mu() { return mu_; }
  MPI_Comm comm() const { return comm_; }
  void check_not_aborted(const BlockedOn& b) {
    if (!aborted_) return;
    std::lock_guard<std::mutex> g(abort_mu_);
    throw CommError(fmt::format("{}: communicator aborted ({})", b.what(), abort_reason_));
  }

 protected:
  HandlePtr do_isend(int peer, const Message& msg) override;
  HandlePtr do_irecv(int peer, int64_t expected_batch) override;

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  std::mutex mu_;
  std::vector<uint64_t> send_seq_, recv_seq_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mu_;
  std::string abort_reason_;
  int abort_id_ = -1;
};

void poll(MpiCommunicator& c, std::vector<MPI_Request>& reqs, const BlockedOn& blocked) {
  auto pause = std::chrono::microseconds(1);
  for (int spins = 0;; ++spins) {
    int done = 0;
    {
      std::lock_guard<std::mutex> g(c.mu());
      DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE));
    }
    if (done) return;
    c.check_not_aborted(blocked);
    if (blocked.expired()) {
      // requests stay posted: the communicator is unusable from here on
      std::string msg = blocked.timeout_message("the peer died, hangs, or is out of step");
      c.abort(msg);
      throw CommError(msg);
    }
    if (spins > 64) {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
  }
}

// Posts nonblocking transfers of `bytes` at `ptr` in chunks (send or receive).
void post_bytes(MpiCommunicator& c, bool send, void* ptr, int64_t bytes, int peer, int tag,
                std::vector<MPI_Request>& reqs) {
  auto* p = static_cast<uint8_t*>(ptr);
  for (int64_t off = 0; off < bytes; off += kChunkBytes) {
    int n = static_cast<int>(std::min(kChunkBytes, bytes - off));
    MPI_Request r;
    std::lock_guard<std::mutex> g(c.mu());
    if (send) DFLASH_CHECK_MPI(MPI_Isend(p + off, n, MPI_BYTE, peer, tag, c.comm(), &r));
    else DFLASH_CHECK_MPI(MPI_Irecv(p + off, n, MPI_BYTE, peer, tag, c.comm(), &r));
    reqs.push_back(r);
  }
}

class MpiSend : public Handle {
 public:
  MpiSend(MpiCommunicator& c, int peer, const Message& msg, int tag)
      : c_(c), peer_(peer), batch_(msg.batch), header_(kHeaderBytes) {
    for (const at::Tensor& t : msg.tensors) tensors_.push_back(t.to(at::kCPU).contiguous());
    Message cpu{msg.kind, msg.batch, tensors_};
    encode_header(header_of(cpu), header_.data());
    post_bytes(c_, true, header_.data(), kHeaderBytes, peer, tag, reqs_);
    for (const at::Tensor& t : tensors_)
      if (t.nbytes() > 0) post_bytes(c_, true, t.data_ptr(), static_cast<int64_t>(t.nbytes()), peer, tag, reqs_);
  }
  bool test() override {
    int done = 0;
    std::lock_guard<std::mutex> g(c_.mu());
    DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(reqs_.size()), reqs_.data(), &done, MPI_STATUSES_IGNORE));
    return done;
  }
  void wait() override {
    BlockedOn b("send", peer_, batch_, c_.timeout());
    poll(c_, reqs_, b);
  }

 private:
  MpiCommunicator& c_;
  int peer_;
  int64_t batch_;
  std::vector<uint8_t> header_;
  std::vector<at::Tensor> tensors_;
  std::vector<MPI_Request> reqs_;
};

class MpiRecv : public Handle {
 public:
  MpiRecv(MpiCommunicator& c, int peer, int64_t expected, int tag)
      : c_(c), peer_(peer), expected_(expected), tag_(tag), header_(kHeaderBytes) {
    post_bytes(c_, false, header_.data(), kHeaderBytes, peer, tag, header_req_);
  }
  bool test() override {
    if (!data_posted_) {
      int done = 0;
      {
        std::lock_guard<std::mutex> g(c_.mu());
        DFLASH_CHECK_MPI(MPI_Testall(1, header_req_.data(), &done, MPI_STATUSES_IGNORE));
      }
      if (!done) return false;
      post_data();
    }
    int done = 0;
    std::lock_guard<std::mutex> g(c_.mu());
    DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(data_reqs_.size()), data_reqs_.data(), &done, MPI_STATUSES_IGNORE));
    return done;
  }
  void wait() override {
    BlockedOn b("recv", peer_, expected_, c_.timeout());
    if (!data_posted_) {
      poll(c_, header_req_, b);
      post_data();
    }
    poll(c_, data_reqs_, b);
  }
  Message take() override {
    wait();
    return std::move(msg_);
  }

 private:
  void post_data() {
    Header h = decode_header(header_.data(), name_rank(peer_));
    if (expected_ != kNoBatch && h.batch != expected_)
      throw CommError(fmt::format("{}: got batch {} instead (schedule out of step)",
                                  describe_wait("recv", peer_, expected_), h.batch));
    msg_.kind = h.kind;
    msg_.batch = h.batch;
    for (const TensorSpec& s : h.specs) {
      at::Tensor t = at::empty(s.shape, at::TensorOptions().dtype(s.dtype));
      if (t.nbytes() > 0) post_bytes(c_, false, t.data_ptr(), static_cast<int64_t>(t.nbytes()), peer_, tag_, data_reqs_);
      msg_.tensors.push_back(std::move(t));
    }
    data_posted_ = true;
  }

  MpiCommunicator& c_;
  int peer_;
  int64_t expected_;
  int tag_;
  std::vector<uint8_t> header_;
  std::vector<MPI_Request> header_req_, data_reqs_;
  bool data_posted_ = false;
  Message msg_;
};

HandlePtr MpiCommunicator::do_isend(int peer, const Message& msg) {
  BlockedOn b("send", peer, msg.batch, 0);
  check_not_aborted(b);
  return std::make_unique<MpiSend>(*this, peer, msg, tag_of(send_seq_[peer]++));
}

HandlePtr MpiCommunicator::do_irecv(int peer, int64_t expected_batch) {
  BlockedOn b("recv", peer, expected_batch, 0);
  check_not_aborted(b);
  return std::make_unique<MpiRecv>(*this, peer, expected_batch, tag_of(recv_seq_[peer]++));
}

std::shared_ptr<Group> MpiCommunicator::new_group(const std::vector<int>& ranks) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    check_peer(ranks[i], "new_group");
    if (i > 0 && ranks[i] <= ranks[i - 1])
      throw std::invalid_argument(fmt::format("new_group: ranks must be sorted and unique, got [{}]",
                                              fmt::join(ranks, ", ")));
  }
  bool member = std::find(ranks.begin(), ranks.end(), rank_) != ranks.end();
  MPI_Comm sub = MPI_COMM_NULL;
  {
    // blocking collective: the watchdog bounds it
    BlockedOn b(fmt::format("new_group [{}] (MPI_Comm_split)", fmt::join(ranks, ", ")), kNoPeer, kNoBatch,
                timeout_s_);
    std::lock_guard<std::mutex> g(mu_);
    DFLASH_CHECK_MPI(MPI_Comm_split(comm_, member ? 0 : MPI_UNDEFINED, rank_, &sub));
    if (sub != MPI_COMM_NULL) DFLASH_CHECK_MPI(MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN));
  }
  return std::make_shared<MpiGroup>(ranks, sub);
}

MPI_Datatype mpi_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MPI_FLOAT;
    case at::kDouble: return MPI_DOUBLE;
    case at::kLong: return MPI_INT64_T;
    case at::kInt: return MPI_INT32_T;
    case at::kShort: return MPI_INT16_T;
    case at::kChar: return MPI_INT8_T;
    case at::kByte: return MPI_UINT8_T;
    default: return MPI_DATATYPE_NULL;
  }
}

void MpiCommunicator::all_reduce(Group& group, std::vector<at::Tensor>& tensors, ReduceOp op, int64_t batch) {
  auto* g = dynamic_cast<MpiGroup*>(&group);
  if (!g || g->comm() == MPI_COMM_NULL)
    throw std::invalid_argument(fmt::format("all_reduce: rank {} is not a member of {}", rank_, group.describe()));
  BlockedOn b(fmt::format("all_reduce over {}", group.describe()), kNoPeer, batch, timeout_s_);
  check_not_aborted(b);
  // bf16/fp16 (no MPI type) and non-contiguous tensors are reduced in a fp32 / contiguous copy
  std::vector<at::Tensor> work;
  std::vector<MPI_Request> reqs;
  for (at::Tensor& t : tensors) {
    bool is_float = at::isFloatingType(t.scalar_type());
    if (op == ReduceOp::Average && !is_float)
      throw std::invalid_argument(fmt::format("all_reduce: average of an integer tensor ({})",
                                              c10::toString(t.scalar_type())));
    at::Tensor w = t.to(at::kCPU);
    if (mpi_type(w.scalar_type()) == MPI_DATATYPE_NULL) w = w.to(at::kFloat);
    w = w.contiguous();
    if (w.data_ptr() == t.data_ptr() && !t.is_contiguous()) w = w.clone();
    work.push_back(w);
    auto* p = static_cast<uint8_t*>(w.data_ptr());
    int64_t n = w.numel();
    size_t es = w.element_size();
    for (int64_t off = 0; off < n; off += kChunkElems) {
      int cnt = static_cast<int>(std::min(kChunkElems, n - off));
      MPI_Request r;
      std::lock_guard<std::mutex> lk(mu_);
      DFLASH_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, p + off * es, cnt, mpi_type(w.scalar_type()), MPI_SUM,
                                      g->comm(), &r));
      reqs.push_back(r);
    }
  }
  poll(*this, reqs, b);
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (op == ReduceOp::Average) work[i].div_(group.size());
    if (work[i].data_ptr() != tensors[i].data_ptr()) tensors[i].copy_(work[i]);
  }
}

void MpiCommunicator::barrier(Group* group) {
  MPI_Comm c = comm_;
  std::string what = "barrier";
  if (group) {
    auto* g = dynamic_cast<MpiGroup*>(group);
    if (!g || g->comm() == MPI_COMM_NULL)
      throw std::invalid_argument(fmt::format("barrier: rank {} is not a member of {}", rank_, group->describe()));
    c = g->comm();
    what += " over " + group->describe();
  }
  BlockedOn b(what, kNoPeer, kNoBatch, timeout_s_);
  check_not_aborted(b);
  std::vector<MPI_Request> reqs(1);
  {
    std::lock_guard<std::mutex> lk(mu_);
    DFLASH_CHECK_MPI(MPI_Ibarrier(c, &reqs[0]));
  }
  poll(*this, reqs, b);
}

}  // namespace

std::unique_ptr<Communicator> make_mpi_communicator(const Identity& id, double startup_timeout_s) {
  ensure_mpi();
  int rank = 0, world = 1;
  DFLASH_CHECK_MPI(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  DFLASH_CHECK_MPI(MPI_Comm_size(MPI_COMM_WORLD, &world));
  if (rank != id.rank || world != id.world_size)
    throw CommError(fmt::format("MPI says rank {}/{}, the identity says {}", rank, world, id.describe()));
  return std::make_unique<MpiCommunicator>(rank, world, startup_timeout_s);
}

}  // namespace dflash::comm
