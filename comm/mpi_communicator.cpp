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
// All-reduce: MPI_Iallreduce per tensor (per chunk of 2^28 elements), in place; iall_reduce
// returns once they are posted and its handle's wait() completes them (all_reduce = iall_reduce
// + wait). Without a progress thread Open MPI advances a collective only inside MPI calls, so a
// caller that posts early and waits late calls test() now and then.
// Teardown: a handle destroyed before its transfer completed (a timeout, an abort, an exception
// that dropped it) hands its requests and buffers to the communicator, which cancels the
// receives (a late message must not land in freed memory, and MPI_Finalize must not find a
// pending receive) and keeps the buffers of the rest (sends, collectives, receives whose message
// was already arriving) for as long as MPI may still use them: until they complete, else until
// the process ends.
#include <mpi.h>

#include <ATen/ATen.h>

#include <algorithm>
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

// Requests and the buffers they read or write.
struct Pending {
  std::vector<MPI_Request> reqs;
  std::vector<uint8_t> header;
  std::vector<at::Tensor> tensors;
  // receives: cancelled when abandoned. A send is left to complete (the message was sent; Open
  // MPI cannot cancel sends anyway), and MPI forbids cancelling collectives.
  bool cancel = false;
  bool done() const {
    return std::all_of(reqs.begin(), reqs.end(), [](MPI_Request r) { return r == MPI_REQUEST_NULL; });
  }
};

// Cancels the unfinished receives of `p` and completes what can be (a cancelled or finished
// request becomes MPI_REQUEST_NULL); true when nothing is left. The caller serialises MPI calls.
// Never throws: it runs in destructors, also while a CommError unwinds the stack.
bool settle(Pending& p) noexcept {
  for (MPI_Request& r : p.reqs) {
    if (r == MPI_REQUEST_NULL) continue;
    if (p.cancel) MPI_Cancel(&r);  // ends at once unless its message is already arriving
    int done = 0;
    MPI_Test(&r, &done, MPI_STATUS_IGNORE);
  }
  return p.done();
}

// What outlives its communicator unfinished (sends a dead or late peer never received): MPI may
// still read these buffers, so they are never freed (the process is about to end: these only
// exist after a timeout or an abort).
void keep_until_exit(std::vector<Pending>&& left) {
  static std::mutex mu;
  static auto* kept = new std::vector<Pending>();  // deliberately never destroyed
  std::lock_guard<std::mutex> g(mu);
  for (Pending& p : left) kept->push_back(std::move(p));
}

// The requests of one handle and their buffers. Destroyed unfinished, it hands them to the
// communicator (MpiCommunicator::abandon) instead of freeing buffers that MPI may still use.
class Transfer {
 public:
  explicit Transfer(MpiCommunicator& c) : c_(c) {}
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  Pending p;

 private:
  MpiCommunicator& c_;
};

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
    if (!mpi_active()) return;  // finalised first: MPI has let go of every buffer
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Pending> left;
    for (Pending& p : abandoned_)
      if (!settle(p)) left.push_back(std::move(p));
    abandoned_.clear();
    if (!left.empty()) keep_until_exit(std::move(left));
    // An aborted communicator is not freed (its peers may be dead or out of step); MPI_Finalize
    // releases it. What is still pending on it keeps its buffers (keep_until_exit).
    if (!aborted_) MPI_Comm_free(&comm_);
  }

  at::Device device() const override { return at::Device(at::kCPU); }
  const char* backend() const override { return "mpi"; }

  std::shared_ptr<Group> new_group(const std::vector<int>& ranks) override;
  HandlePtr iall_reduce(Group& group, std::vector<at::Tensor> tensors, ReduceOp op, int64_t batch) override;
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
  // Takes the unfinished requests of a handle being destroyed: cancels the receives, keeps the
  // buffers of the rest while they are pending (past the communicator: keep_until_exit).
  void abandon(Pending&& p) noexcept {
    if (!mpi_active()) return;
    std::lock_guard<std::mutex> g(mu_);
    if (!settle(p)) abandoned_.push_back(std::move(p));
  }
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
  std::vector<Pending> abandoned_;  // under mu_
};

Transfer::~Transfer() {
  if (!p.done()) c_.abandon(std::move(p));
}

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
      // the communicator is unusable from here on; the requests stay with their handle, whose
      // destruction cancels or keeps them (MpiCommunicator::abandon)
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
      : c_(c), peer_(peer), batch_(msg.batch), x_(c) {
    x_.p.header.resize(kHeaderBytes);
    for (const at::Tensor& t : msg.tensors) x_.p.tensors.push_back(t.to(at::kCPU).contiguous());
    Message cpu{msg.kind, msg.batch, x_.p.tensors};
    encode_header(header_of(cpu), x_.p.header.data());
    post_bytes(c_, true, x_.p.header.data(), kHeaderBytes, peer, tag, x_.p.reqs);
    for (const at::Tensor& t : x_.p.tensors)
      if (t.nbytes() > 0) post_bytes(c_, true, t.data_ptr(), static_cast<int64_t>(t.nbytes()), peer, tag, x_.p.reqs);
  }
  bool test() override {
    int done = 0;
    std::lock_guard<std::mutex> g(c_.mu());
    DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(x_.p.reqs.size()), x_.p.reqs.data(), &done, MPI_STATUSES_IGNORE));
    return done;
  }
  void wait() override {
    BlockedOn b("send", peer_, batch_, c_.timeout());
    poll(c_, x_.p.reqs, b);
  }

 private:
  MpiCommunicator& c_;
  int peer_;
  int64_t batch_;
  Transfer x_;  // the header and the tensors (CPU, contiguous) until MPI is done with them
};

class MpiRecv : public Handle {
 public:
  MpiRecv(MpiCommunicator& c, int peer, int64_t expected, int tag)
      : c_(c), peer_(peer), expected_(expected), tag_(tag), head_(c), data_(c) {
    head_.p.header.resize(kHeaderBytes);
    head_.p.cancel = data_.p.cancel = true;
    post_bytes(c_, false, head_.p.header.data(), kHeaderBytes, peer, tag, head_.p.reqs);
  }
  bool test() override {
    if (!data_posted_) {
      int done = 0;
      {
        std::lock_guard<std::mutex> g(c_.mu());
        DFLASH_CHECK_MPI(MPI_Testall(1, head_.p.reqs.data(), &done, MPI_STATUSES_IGNORE));
      }
      if (!done) return false;
      post_data();
    }
    int done = 0;
    std::lock_guard<std::mutex> g(c_.mu());
    std::vector<MPI_Request>& reqs = data_.p.reqs;
    DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE));
    return done;
  }
  void wait() override {
    BlockedOn b("recv", peer_, expected_, c_.timeout());
    if (!data_posted_) {
      poll(c_, head_.p.reqs, b);
      post_data();
    }
    poll(c_, data_.p.reqs, b);
  }
  Message take() override {
    wait();
    data_.p.tensors.clear();  // complete: the message owns them
    return std::move(msg_);
  }

 private:
  void post_data() {
    Header h = decode_header(head_.p.header.data(), name_rank(peer_));
    if (expected_ != kNoBatch && h.batch != expected_)
      throw CommError(fmt::format("{}: got batch {} instead (schedule out of step)",
                                  describe_wait("recv", peer_, expected_), h.batch));
    msg_.kind = h.kind;
    msg_.batch = h.batch;
    for (const TensorSpec& s : h.specs) {
      at::Tensor t = at::empty(s.shape, at::TensorOptions().dtype(s.dtype));
      data_.p.tensors.push_back(t);  // before posting: the transfer owns what MPI writes into
      msg_.tensors.push_back(t);
      if (t.nbytes() > 0)
        post_bytes(c_, false, t.data_ptr(), static_cast<int64_t>(t.nbytes()), peer_, tag_, data_.p.reqs);
    }
    data_posted_ = true;
  }

  MpiCommunicator& c_;
  int peer_;
  int64_t expected_;
  int tag_;
  Transfer head_, data_;  // the header's receive; the tensors' receives (posted once the header is in)
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

// An all-reduce in flight: its requests and what MPI reads and writes (the caller's tensors
// where they are contiguous and of an MPI type, else fp32 / contiguous copies), held by a
// Transfer, so that a handle dropped unwaited (a timeout, an exception) leaves them to the
// communicator instead of freeing memory MPI still writes into. wait() divides for Average and
// copies the copies back (MPI's sum is the whole reduction; nothing runs in the background).
class MpiAllReduce : public Handle {
 public:
  MpiAllReduce(MpiCommunicator& c, std::string what, int64_t batch, std::vector<at::Tensor> out, ReduceOp op,
               int group_size)
      : c_(c), what_(std::move(what)), batch_(batch), out_(std::move(out)), op_(op), n_(group_size), x_(c) {}
  Transfer& transfer() { return x_; }
  bool test() override {
    if (delivered_) return true;
    int done = 0;
    std::lock_guard<std::mutex> g(c_.mu());
    DFLASH_CHECK_MPI(MPI_Testall(static_cast<int>(x_.p.reqs.size()), x_.p.reqs.data(), &done, MPI_STATUSES_IGNORE));
    return done;
  }
  void wait() override {
    if (delivered_) return;
    BlockedOn b(what_, kNoPeer, batch_, c_.timeout());
    poll(c_, x_.p.reqs, b);
    std::vector<at::Tensor>& work = x_.p.tensors;
    for (size_t i = 0; i < out_.size(); ++i) {
      if (op_ == ReduceOp::Average) work[i].div_(n_);
      if (work[i].data_ptr() != out_[i].data_ptr()) out_[i].copy_(work[i]);
    }
    delivered_ = true;
  }

 private:
  MpiCommunicator& c_;
  std::string what_;
  int64_t batch_;
  std::vector<at::Tensor> out_;  // the caller's tensors
  ReduceOp op_;
  int n_;
  Transfer x_;  // the requests and the tensors MPI reduces in (also past a timeout)
  bool delivered_ = false;
};

HandlePtr MpiCommunicator::iall_reduce(Group& group, std::vector<at::Tensor> tensors, ReduceOp op, int64_t batch) {
  auto* g = dynamic_cast<MpiGroup*>(&group);
  if (!g || g->comm() == MPI_COMM_NULL)
    throw std::invalid_argument(fmt::format("all_reduce: rank {} is not a member of {}", rank_, group.describe()));
  std::string what = fmt::format("all_reduce over {}", group.describe());
  BlockedOn b(what, kNoPeer, batch, 0);  // posting does not block; wait() has the deadline
  check_not_aborted(b);
  // checked before anything is posted: a collective posted here and not on the others would
  // put the group out of step
  for (const at::Tensor& t : tensors)
    if (op == ReduceOp::Average && !at::isFloatingType(t.scalar_type()))
      throw std::invalid_argument(fmt::format("all_reduce: average of an integer tensor ({})",
                                              c10::toString(t.scalar_type())));
  // bf16/fp16 (no MPI type) and non-contiguous tensors are reduced in a fp32 / contiguous copy
  std::vector<at::Tensor> work;
  for (at::Tensor& t : tensors) {
    at::Tensor w = t.to(at::kCPU);
    if (mpi_type(w.scalar_type()) == MPI_DATATYPE_NULL) w = w.to(at::kFloat);
    w = w.contiguous();
    if (w.data_ptr() == t.data_ptr() && !t.is_contiguous()) w = w.clone();
    work.push_back(w);
  }
  auto h = std::make_unique<MpiAllReduce>(*this, std::move(what), batch, std::move(tensors), op, group.size());
  Pending& x = h->transfer().p;
  x.tensors = std::move(work);  // before posting: the transfer owns what MPI writes into
  for (at::Tensor& w : x.tensors) {
    auto* p = static_cast<uint8_t*>(w.data_ptr());
    int64_t n = w.numel();
    size_t es = w.element_size();
    for (int64_t off = 0; off < n; off += kChunkElems) {
      int cnt = static_cast<int>(std::min(kChunkElems, n - off));
      MPI_Request r;
      std::lock_guard<std::mutex> lk(mu_);
      DFLASH_CHECK_MPI(MPI_Iallreduce(MPI_IN_PLACE, p + off * es, cnt, mpi_type(w.scalar_type()), MPI_SUM,
                                      g->comm(), &r));
      x.reqs.push_back(r);
    }
  }
  return h;
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
  Transfer x(*this);
  x.p.reqs.resize(1, MPI_REQUEST_NULL);
  {
    std::lock_guard<std::mutex> lk(mu_);
    DFLASH_CHECK_MPI(MPI_Ibarrier(c, &x.p.reqs[0]));
  }
  poll(*this, x.p.reqs, b);
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
