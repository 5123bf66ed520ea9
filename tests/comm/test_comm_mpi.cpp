// Multi-process tests of a Communicator, run by ctest under `mpirun -np 2|3|8` over MPI (see
// CMakeLists.txt), and by bench/gpu/comm.sh under `mpirun -np 2` over NCCL on two GPUs
// (DFLASH_TEST_BACKEND=nccl). Every rank runs every test; a test fails on the rank that sees
// the problem. Tensors are generated on the CPU, moved to the communicator's device to be sent,
// and compared on the CPU after they arrive.
// References are independent of the transport: the receiver regenerates the sender's tensors
// from (seed, batch, index) and compares their bytes (random bytes, so every bit pattern of a
// dtype, NaNs included, must survive); all-reduce inputs are small integers stored in floats,
// whose sums are exact in fp32/bf16/fp16, so the expected values are computed in closed form.
#include <gtest/gtest.h>
#include <mpi.h>

#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "comm/identity.h"
#include "comm/watchdog.h"
#include "tests/mpi_test_main.h"

using namespace dflash::comm;

namespace {

Communicator* g_comm = nullptr;
std::string g_backend = "mpi";
at::Device dev() { return g_comm->device(); }
Message on_dev(Message m) {
  for (auto& t : m.tensors) t = t.to(dev());
  return m;
}
int R() { return g_comm->rank(); }
int W() { return g_comm->world_size(); }

// Random bytes viewed as `dtype` (bool: 0/1), deterministic in (seed, index).
at::Tensor pattern(at::ScalarType dtype, std::vector<int64_t> shape, int64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed));
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  if (dtype == at::kBool) return at::randint(0, 2, shape, gen, at::TensorOptions().dtype(at::kByte)).to(at::kBool);
  at::Tensor bytes = at::randint(0, 256, {numel * es}, gen, at::TensorOptions().dtype(at::kByte));
  return bytes.view(dtype).view(shape);
}

bool same_bytes(const at::Tensor& a_any, const at::Tensor& b) {
  at::Tensor a = a_any.cpu();
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;
  return at::equal(a.contiguous().view({-1}).view(at::kByte), b.contiguous().view({-1}).view(at::kByte));
}

const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong,
                                             at::kInt,   at::kByte,     at::kBool};

// The tensors of message `batch` from `src`: every dtype, sizes from 0 elements up.
Message ring_message(int src, int64_t batch) {
  Message m;
  m.kind = 3;
  m.batch = batch;
  int64_t i = 0;
  for (at::ScalarType t : kDtypes) {
    int64_t n = (batch + i) % 4 == 0 ? 0 : (batch * 37 + i * 1001) % 5000;
    m.tensors.push_back(pattern(t, {n}, src * 100000 + batch * 100 + i));
    ++i;
  }
  m.tensors.push_back(pattern(at::kFloat, {3, 0, 5}, 1));  // 0 bytes with a shape
  m.tensors.push_back(pattern(at::kBFloat16, {2, 3, 4, 5}, src + batch));
  return m;
}

void expect_message(const Message& got, const Message& want) {
  ASSERT_EQ(got.kind, want.kind);
  ASSERT_EQ(got.batch, want.batch);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t i = 0; i < want.tensors.size(); ++i)
    EXPECT_TRUE(same_bytes(got.tensors[i], want.tensors[i]))
        << "batch " << want.batch << " tensor " << i << " (" << c10::toString(want.tensors[i].scalar_type()) << ")";
}

}  // namespace

// Every rank sends 20 messages to its right neighbour and receives 20 from its left one,
// with all 20 sends and receives outstanding; receive handles are waited newest first, so a
// message may only match its own handle (not the order of waits). Two phases (even senders,
// then odd senders), so that no rank has sends and receives queued towards the same peer at
// once: the one-way pattern of the pipeline, which NCCL needs (nccl_communicator.cpp).
TEST(CommMpi, RingMessagesAllDtypesInOrder) {
  const int n = 20;
  int right = (R() + 1) % W(), left = (R() - 1 + W()) % W();
  for (int phase = 0; phase < 2; ++phase) {
    std::vector<HandlePtr> sends, recvs;
    int64_t base = phase * n;
    if (R() % 2 == phase)
      for (int64_t b = 0; b < n; ++b) sends.push_back(g_comm->isend(right, on_dev(ring_message(R(), base + b))));
    if (left % 2 == phase && left != R())
      for (int64_t b = 0; b < n; ++b) recvs.push_back(g_comm->irecv(left, base + b));
    for (int64_t b = static_cast<int64_t>(recvs.size()) - 1; b >= 0; --b)
      expect_message(recvs[b]->take(), ring_message(left, base + b));
    for (auto& h : sends) h->wait();
    g_comm->barrier();
  }
}

// Messages of 0 bytes up to 256 MB from rank 0 to rank 1 (a blocking send/recv pair).
TEST(CommMpi, LargeMessagesZeroTo256MB) {
  if (W() < 2) GTEST_SKIP();
  std::vector<int64_t> sizes = {0, 1, 4096, int64_t(1) << 20, int64_t(256) << 20};
  int64_t b = 0;
  for (int64_t bytes : sizes) {
    Message m;
    m.kind = 9;
    m.batch = b;
    m.tensors.push_back(pattern(at::kFloat, {bytes / 4}, 7 + b));
    m.tensors.push_back(pattern(at::kBFloat16, {3, 5}, 8 + b));
    m.tensors.push_back(pattern(at::kLong, {bytes > 4096 ? 1000 : 0}, 9 + b));
    if (R() == 0) g_comm->send(1, on_dev(m));
    if (R() == 1) {
      expect_message(g_comm->recv(0, b), m);
    }
    ++b;
  }
  Message empty{1, b, {}};  // a message without tensors
  if (R() == 0) g_comm->send(1, empty);
  if (R() == 1) {
    EXPECT_TRUE(g_comm->recv(0, b).tensors.empty());
  }
  g_comm->barrier();
}

// Sum and average over sub-groups (even ranks, all but rank 0, the world): exact.
TEST(CommMpi, AllReduceOverSubGroupsIsExact) {
  std::vector<std::vector<int>> groups(3);
  for (int r = 0; r < W(); ++r) {
    if (r % 2 == 0) groups[0].push_back(r);
    if (r > 0) groups[1].push_back(r);
    groups[2].push_back(r);
  }
  for (const auto& ranks : groups) {
    if (ranks.empty()) continue;
    auto g = g_comm->new_group(ranks);  // collective over the world: every rank calls it
    if (!g->contains(R())) continue;
    int64_t n = g->size();
    int64_t sum_r = 0;
    for (int r : ranks) sum_r += r + 1;
    for (at::ScalarType t : {at::kFloat, at::kBFloat16, at::kHalf, at::kDouble, at::kLong, at::kInt}) {
      // element i of rank r holds (r+1)*(i%5+1): the sum is (i%5+1)*sum_r, exact in every dtype
      at::Tensor idx = at::arange(0, 1001, at::kLong).remainder(5).add(1);
      std::vector<at::Tensor> ts{(idx * (R() + 1)).to(t).to(dev())};
      g_comm->all_reduce(*g, ts, ReduceOp::Sum, 17);
      EXPECT_TRUE(at::equal(ts[0].cpu(), (idx * sum_r).to(t))) << c10::toString(t) << " over " << g->describe();
    }
    // average of 2*(r+1)*n: = 2*sum_r, an integer
    std::vector<at::Tensor> avg{at::full({64}, 2.0 * (R() + 1) * n, at::kBFloat16).to(dev()),
                                at::full({3, 3}, 2.0 * (R() + 1) * n, at::kFloat).to(dev()).t()};  // non-contiguous
    g_comm->all_reduce(*g, avg, ReduceOp::Average, 18);
    EXPECT_TRUE(at::equal(avg[0].cpu(), at::full({64}, 2.0 * sum_r, at::kBFloat16))) << g->describe();
    EXPECT_TRUE(at::equal(avg[1].cpu(), at::full({3, 3}, 2.0 * sum_r, at::kFloat))) << g->describe();
    g_comm->barrier(g.get());
  }
  g_comm->barrier();
}

TEST(CommMpi, MisuseIsReported) {
  std::vector<int> first{0};
  auto g = g_comm->new_group(first);
  std::vector<at::Tensor> ints{at::ones({4}, at::kLong).to(dev())};
  if (R() != 0) {
    EXPECT_THROW(g_comm->all_reduce(*g, ints, ReduceOp::Sum), std::invalid_argument);
    EXPECT_THROW(g_comm->iall_reduce(*g, ints, ReduceOp::Sum), std::invalid_argument);
  } else {
    EXPECT_THROW(g_comm->all_reduce(*g, ints, ReduceOp::Average), std::invalid_argument);
    // checked before anything is posted: a float tensor before the integer one posts nothing
    // either (the group would be out of step otherwise: the next collective below would not match)
    EXPECT_THROW(g_comm->iall_reduce(*g, {at::ones({4}, at::kFloat).to(dev()), ints[0]}, ReduceOp::Average),
                 std::invalid_argument);
    std::vector<at::Tensor> one{at::ones({3}, at::kFloat).to(dev())};
    g_comm->all_reduce(*g, one, ReduceOp::Sum);
    EXPECT_TRUE(at::equal(one[0].cpu(), at::ones({3}, at::kFloat)));
  }
  EXPECT_THROW(g_comm->isend(W(), Message{}), std::invalid_argument);
  EXPECT_THROW(g_comm->new_group({1, 0}), std::invalid_argument);
  g_comm->barrier();
}

// iall_reduce: five collectives in flight at once, waited in another order than they were posted
// (the last first), over fp32, bf16, a non-contiguous view, int64 (Sum), empty tensors and an
// Average; integer-valued data, so every expected value is exact. test() becomes true without
// wait(); a second wait() is a no-op.
TEST(CommMpi, IallReduceManyInFlightWaitedOutOfOrder) {
  std::vector<int> all;
  for (int r = 0; r < W(); ++r) all.push_back(r);
  auto g = g_comm->new_group(all);
  const int64_t n = W(), r1 = R() + 1, sum_r = n * (n + 1) / 2;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  struct Posted {
    std::vector<at::Tensor> ts;
    at::Tensor base;  // the storage of the non-contiguous view ts[2]
    HandlePtr h;
  };
  std::vector<Posted> posted;
  for (int64_t i = 0; i < 4; ++i) {
    Posted p;
    const at::Tensor idx = at::arange(0, 1000 + i, at::kLong).remainder(7).add(1);  // 1..7
    p.ts.push_back((idx * r1 * (i + 1)).to(at::kFloat).to(dev()));
    p.ts.push_back((idx.narrow(0, 0, 300).remainder(3).add(1) * r1).to(at::kBFloat16).to(dev()));  // sums <= 108
    p.base = at::full({8, 6}, static_cast<double>(r1 * (i + 1)), f32).to(dev());
    p.ts.push_back(p.base.narrow(1, 1, 3));  // [8, 3] of rows of 6: not contiguous
    p.ts.push_back((at::arange(0, 17, at::kLong) + r1 * 1000003 + i).to(dev()));
    p.ts.push_back(at::empty({0}, f32).to(dev()));
    p.ts.push_back(at::empty({3, 0}, at::TensorOptions().dtype(at::kBFloat16)).to(dev()));
    p.h = g_comm->iall_reduce(*g, p.ts, ReduceOp::Sum, 30 + i);
    posted.push_back(std::move(p));
  }
  Posted avg;  // the average of 2n(r+1) is 2 * sum_r
  avg.ts = {at::full({64}, 2.0 * static_cast<double>(n * r1), f32).to(dev()),
            at::full({33}, 2.0 * static_cast<double>(n * r1), at::TensorOptions().dtype(at::kBFloat16)).to(dev())};
  avg.h = g_comm->iall_reduce(*g, avg.ts, ReduceOp::Average, 34);
  // test() alone completes a collective (every rank posted them all)
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!posted[0].h->test() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_TRUE(posted[0].h->test());
  avg.h->wait();
  EXPECT_TRUE(at::equal(avg.ts[0].cpu(), at::full({64}, 2.0 * static_cast<double>(sum_r), f32)));
  EXPECT_TRUE(at::equal(avg.ts[1].cpu(),
                        at::full({33}, 2.0 * static_cast<double>(sum_r), at::TensorOptions().dtype(at::kBFloat16))));
  for (int64_t i = 3; i >= 0; --i) {
    Posted& p = posted[static_cast<size_t>(i)];
    p.h->wait();
    p.h->wait();  // no-op
    const at::Tensor idx = at::arange(0, 1000 + i, at::kLong).remainder(7).add(1);
    EXPECT_TRUE(at::equal(p.ts[0].cpu(), (idx * sum_r * (i + 1)).to(at::kFloat))) << "round " << i;
    EXPECT_TRUE(at::equal(p.ts[1].cpu(), (idx.narrow(0, 0, 300).remainder(3).add(1) * sum_r).to(at::kBFloat16)))
        << "round " << i;
    at::Tensor want = at::full({8, 6}, static_cast<double>(r1 * (i + 1)), f32);  // outside the view: untouched
    want.narrow(1, 1, 3).fill_(static_cast<double>(sum_r * (i + 1)));
    EXPECT_TRUE(at::equal(p.base.cpu(), want)) << "round " << i;
    EXPECT_TRUE(at::equal(p.ts[3].cpu(), at::arange(0, 17, at::kLong) * n + sum_r * 1000003 + n * i)) << "round " << i;
    EXPECT_EQ(p.ts[4].numel(), 0);
    EXPECT_EQ(p.ts[5].sizes(), at::IntArrayRef({3, 0}));
  }
  g_comm->barrier();
}

// An all-reduce that another member never posts: the rank that waits gets a CommError within its
// deadline naming the op, the group and the batch, and its communicator is aborted (a second
// communicator, so the shared one stays usable). The missing rank then posts late, so that the
// abandoned collective completes (MPI cannot cancel collectives; its buffers were kept) and
// every rank ends cleanly.
TEST(CommMpi, IallReduceTimeoutNamesGroupAndBatch) {
  if (W() < 2) GTEST_SKIP();
  Identity id = detect();
  auto c3 = make_communicator(CommOptions{g_backend, 60, 60}, id);
  auto g = c3->new_group({0, 1});  // collective over the world
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  if (R() == 1) {
    c3->set_timeout(0.5);
    HandlePtr h = c3->iall_reduce(*g, {at::ones({256}, f32).to(dev())}, ReduceOp::Sum, 77);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      h->wait();  // rank 0 has not posted it
      ADD_FAILURE() << "wait returned";
    } catch (const dflash::CommError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("timed out"), std::string::npos) << m;
      EXPECT_NE(m.find("all_reduce over group [0, 1], batch 77"), std::string::npos) << m;
    }
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
    EXPECT_THROW(c3->iall_reduce(*g, {at::ones({2}, f32).to(dev())}, ReduceOp::Sum), dflash::CommError);  // aborted
  }  // rank 1's handle is destroyed unwaited here
  g_comm->barrier();  // rank 1 gave up
  if (R() == 0) {
    std::vector<at::Tensor> late{at::ones({256}, f32).to(dev())};
    c3->all_reduce(*g, late, ReduceOp::Sum, 77);  // meets rank 1's abandoned one (rank 1 progresses in the barrier)
    EXPECT_TRUE(at::equal(late[0].cpu(), at::full({256}, 2.0, f32)));
  }
  g_comm->barrier();
}

// A receive nobody answers ends with a CommError naming the op, peer and batch, and leaves
// that communicator aborted (a second one, so the shared one stays usable). Over MPI the message
// then comes late, to a receive that was abandoned (its handle is gone): it must not land in the
// freed buffer of that handle (the receive was cancelled), and every rank still ends cleanly
// (MPI_Finalize with no receive pending).
TEST(CommMpi, TimeoutNamesPeerAndBatch) {
  if (W() < 2) GTEST_SKIP();
  Identity id = detect();
  auto c2 = make_communicator(CommOptions{g_backend, 60, 60}, id);
  c2->set_timeout(0.5);
  if (R() == 1) {
    try {
      c2->recv(0, 123);  // rank 0 never sends batch 123
      ADD_FAILURE() << "recv returned";
    } catch (const dflash::CommError& e) {
      std::string m = e.what();
      EXPECT_NE(m.find("recv with rank 0, batch 123"), std::string::npos) << m;
      EXPECT_NE(m.find("timed out"), std::string::npos) << m;
    }
    EXPECT_THROW(c2->send(0, Message{}), dflash::CommError);  // aborted
  }
  g_comm->barrier();  // rank 1 gave up on batch 123
  if (R() == 0 && g_backend == "mpi") {
    // too late; nobody waits for its completion either (the handle is dropped at once)
    c2->isend(1, Message{3, 123, {at::arange(0, 512, at::kFloat)}});
  }
  g_comm->barrier();  // rank 1 makes MPI progress here, when the late message arrives
}

int main(int argc, char** argv) {
  if (const char* b = std::getenv("DFLASH_TEST_BACKEND")) g_backend = b;
  return dflash::test::mpi_test_main(argc, argv, g_comm, [](const Identity& id) {
    if (g_backend == "nccl" && id.gpu < 0) throw std::runtime_error("DFLASH_TEST_BACKEND=nccl but this rank sees no GPU");
    return make_communicator(CommOptions{g_backend, 60, 60}, id);
  });
}
