#include "comm/communicator.h"

#include <c10/core/ScalarType.h>

#include <cstring>

#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"

namespace dflash::comm {
namespace {

// Stable wire codes for the dtypes a message can carry.
struct DtypeCode {
  at::ScalarType type;
  int32_t code;
};
constexpr DtypeCode kCodes[] = {
    {at::kFloat, 1}, {at::kBFloat16, 2}, {at::kHalf, 3}, {at::kLong, 4}, {at::kInt, 5},
    {at::kByte, 6},  {at::kBool, 7},     {at::kDouble, 8}, {at::kChar, 9}, {at::kShort, 10},
};

int32_t code_of(at::ScalarType t) {
  for (const auto& c : kCodes)
    if (c.type == t) return c.code;
  throw CommError(fmt::format("message: dtype {} cannot be sent (fp32, bf16, fp16, fp64, int64, int32, "
                              "int16, int8, uint8, bool can)", c10::toString(t)));
}

at::ScalarType type_of(int32_t code, const std::string& from) {
  for (const auto& c : kCodes)
    if (c.code == code) return c.type;
  throw CommError(fmt::format("message from {}: unknown dtype code {} in the header", from, code));
}

template <class T> void put(uint8_t*& p, T v) {
  std::memcpy(p, &v, sizeof(T));
  p += sizeof(T);
}
template <class T> T take_val(const uint8_t*& p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  p += sizeof(T);
  return v;
}

constexpr size_t kFixed = 4 + 4 + 4 + 4 + 8;
constexpr size_t kPerTensor = 4 + 4 + 8 * kMaxDims;
static_assert(kFixed + kMaxTensors * kPerTensor <= kHeaderBytes, "header does not fit");

// ---- loopback (a message to oneself) --------------------------------------------------------
class DoneHandle : public Handle {
 public:
  bool test() override { return true; }
  void wait() override {}
};

class LoopbackRecv : public Handle {
 public:
  explicit LoopbackRecv(Message m) : msg_(std::move(m)) {}
  bool test() override { return true; }
  void wait() override {}
  Message take() override { return std::move(msg_); }

 private:
  Message msg_;
};

}  // namespace

int64_t TensorSpec::nbytes() const {
  int64_t n = static_cast<int64_t>(c10::elementSize(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

void encode_header(const Header& h, uint8_t* out) {
  if (h.specs.size() > static_cast<size_t>(kMaxTensors))
    throw CommError(fmt::format("message of batch {}: {} tensors, at most {} fit in a header", h.batch,
                                h.specs.size(), kMaxTensors));
  std::memset(out, 0, kHeaderBytes);
  uint8_t* p = out;
  put<uint32_t>(p, kHeaderMagic);
  put<uint32_t>(p, kHeaderVersion);
  put<int32_t>(p, h.kind);
  put<int32_t>(p, static_cast<int32_t>(h.specs.size()));
  put<int64_t>(p, h.batch);
  for (const TensorSpec& s : h.specs) {
    if (s.shape.size() > static_cast<size_t>(kMaxDims))
      throw CommError(fmt::format("message of batch {}: a tensor of {} dimensions, at most {} fit in a header",
                                  h.batch, s.shape.size(), kMaxDims));
    put<int32_t>(p, code_of(s.dtype));
    put<int32_t>(p, static_cast<int32_t>(s.shape.size()));
    for (int d = 0; d < kMaxDims; ++d) put<int64_t>(p, d < static_cast<int>(s.shape.size()) ? s.shape[d] : 0);
  }
}

Header decode_header(const uint8_t* in, const std::string& from) {
  const uint8_t* p = in;
  uint32_t magic = take_val<uint32_t>(p);
  uint32_t version = take_val<uint32_t>(p);
  if (magic != kHeaderMagic || version != kHeaderVersion)
    throw CommError(fmt::format("message from {}: bad header (magic {:#x}, version {}; expected {:#x}, {}): "
                                "the peer is out of step or runs another dflash version",
                                from, magic, version, kHeaderMagic, kHeaderVersion));
  Header h;
  h.kind = take_val<int32_t>(p);
  int32_t n = take_val<int32_t>(p);
  h.batch = take_val<int64_t>(p);
  if (n < 0 || n > kMaxTensors)
    throw CommError(fmt::format("message from {}: header claims {} tensors", from, n));
  for (int i = 0; i < n; ++i) {
    TensorSpec s;
    s.dtype = type_of(take_val<int32_t>(p), from);
    int32_t nd = take_val<int32_t>(p);
    if (nd < 0 || nd > kMaxDims) throw CommError(fmt::format("message from {}: header claims {} dims", from, nd));
    for (int d = 0; d < kMaxDims; ++d) {
      int64_t v = take_val<int64_t>(p);
      if (d < nd) {
        if (v < 0) throw CommError(fmt::format("message from {}: negative size {} in the header", from, v));
        s.shape.push_back(v);
      }
    }
    h.specs.push_back(std::move(s));
  }
  return h;
}

Header header_of(const Message& m) {
  Header h;
  h.kind = m.kind;
  h.batch = m.batch;
  for (const at::Tensor& t : m.tensors) {
    DFLASH_CHECK(t.defined(), "message of batch {}: an undefined tensor", m.batch);
    h.specs.push_back(TensorSpec{t.scalar_type(), t.sizes().vec()});
  }
  return h;
}

Message Handle::take() {
  throw std::logic_error("Handle::take() is for receive handles only");
}

bool Group::contains(int rank) const {
  for (int r : ranks_)
    if (r == rank) return true;
  return false;
}

std::string Group::describe() const { return fmt::format("group [{}]", fmt::join(ranks_, ", ")); }

void Communicator::check_peer(int peer, const char* op) const {
  if (peer < 0 || peer >= world_)
    throw std::invalid_argument(fmt::format("{}: peer {} is not a rank of a world of {}", op, peer, world_));
}

HandlePtr Communicator::isend(int peer, const Message& msg) {
  check_peer(peer, "send");
  if (peer != rank_) return do_isend(peer, msg);
  Message copy{msg.kind, msg.batch, {}};
  for (const at::Tensor& t : msg.tensors) copy.tensors.push_back(t.clone());
  encode_header(header_of(copy), std::vector<uint8_t>(kHeaderBytes).data());  // same limits as the wire
  loopback_.push_back(std::move(copy));
  return std::make_unique<DoneHandle>();
}

HandlePtr Communicator::irecv(int peer, int64_t expected_batch) {
  check_peer(peer, "recv");
  if (peer != rank_) return do_irecv(peer, expected_batch);
  if (loopback_.empty())
    throw CommError(fmt::format("{}: nothing was sent to this rank itself before (colocated run out of "
                                "order; this would never complete)",
                                describe_wait("recv", peer, expected_batch)));
  Message m = std::move(loopback_.front());
  loopback_.pop_front();
  if (expected_batch != kNoBatch && m.batch != expected_batch)
    throw CommError(fmt::format("{}: got batch {} instead (schedule out of step)",
                                describe_wait("recv", peer, expected_batch), m.batch));
  return std::make_unique<LoopbackRecv>(std::move(m));
}

std::unique_ptr<Communicator> make_communicator(const CommOptions& opt, const Identity& id,
                                                [[maybe_unused]] std::shared_ptr<Store> store) {
  std::string b = opt.backend;
  if (b != "auto" && b != "nccl" && b != "mpi")
    throw_user("comm.backend '{}' is not one of: auto, nccl, mpi", b);
  if (b == "auto") b = id.gpu >= 0 ? "nccl" : "mpi";
  std::unique_ptr<Communicator> c;
  if (b == "nccl") {
#ifdef DFLASH_CUDA
    if (id.gpu < 0) throw_user("comm.backend=nccl needs a GPU, but this rank sees no CUDA device");
    c = make_nccl_communicator(id, opt.startup_timeout_s, std::move(store));
#else
    throw_user("comm.backend=nccl: this dflash was built without CUDA (use comm.backend=mpi)");
#endif
  } else {
    if (id.source != Source::Mpi && id.world_size > 1)
      throw_user("comm.backend=mpi needs an MPI launch (mpirun, or srun --mpi=pmix), but this run of {} "
                 "processes was started by {}; launch it with mpirun, or use GPUs (comm.backend=nccl)",
                 id.world_size, source_name(id.source));
    c = make_mpi_communicator(id, opt.startup_timeout_s);
  }
  log::debug("communicator: {} on {}", c->backend(), c->device().str());
  return c;
}

}  // namespace dflash::comm
