// The typed target -> drafter message (trainer/roles/batch_message.h): pack/unpack round trip
// (every field bit-exact, through the wire header's encode/decode too), refusal of messages of
// another kind, batch, count, dtype or shape naming the sender, and, when started under
// `mpirun -np 2`, a round trip over a real MPI Communicator between two processes (each rank
// sends a batch to the other, which rebuilds the sender's batch from its seed and compares).
// Reference: the batch itself, regenerated from (seed, k); comparisons are on bytes.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <vector>

#include "comm/communicator.h"
#include "comm/identity.h"
#include "comm/watchdog.h"
#include "core/error.h"
#include "trainer/roles/batch_message.h"
#include "tests/mpi_test_main.h"

using namespace dflash;
using namespace dflash::roles;

namespace {

comm::Communicator* g_comm = nullptr;  // set under mpirun -np 2

// A batch of T tokens in documents of 5, 0 (empty) and T-5 tokens, features [T, F] of `dtype`.
BatchMessage make_batch(int64_t seed, int64_t k, int64_t T, int64_t F, at::ScalarType dtype) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed * 7919 + k));
  BatchMessage b;
  b.batch = k;
  b.ids = at::randint(0, 151936, {T}, gen, at::TensorOptions().dtype(at::kLong));
  b.loss_mask = at::randint(0, 2, {T}, gen, at::TensorOptions().dtype(at::kByte));
  b.cu_seqlens = at::tensor(std::vector<int64_t>{0, 5, 5, T}, at::kLong);
  b.features = at::randn({T, F}, gen, at::TensorOptions().dtype(at::kFloat)).to(dtype);
  // stop (roles/preempt.h): set on every third batch, so that both values travel
  b.stats = TargetStats{static_cast<double>(T), 0.1 + 1e-17 * static_cast<double>(k), 1.0 / 3.0, k % 3 == 2 ? 1.0 : 0.0};
  return b;
}

bool same_bytes(const at::Tensor& a_any, const at::Tensor& b) {
  at::Tensor a = a_any.cpu();
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;
  return at::equal(a.contiguous().view({-1}).view(at::kByte), b.contiguous().view({-1}).view(at::kByte));
}

void expect_same(const BatchMessage& got, const BatchMessage& want) {
  EXPECT_EQ(got.batch, want.batch);
  EXPECT_TRUE(same_bytes(got.ids, want.ids));
  EXPECT_TRUE(same_bytes(got.loss_mask, want.loss_mask));
  EXPECT_TRUE(same_bytes(got.cu_seqlens, want.cu_seqlens));
  EXPECT_TRUE(same_bytes(got.features, want.features));
  // what the drafter reads on the host arrives there (unpack copies a device message's ids,
  // mask and cu_seqlens on a side stream); the features stay where they were received
  EXPECT_TRUE(got.ids.device().is_cpu() && got.loss_mask.device().is_cpu() && got.cu_seqlens.device().is_cpu());
  // doubles travel as float64: exact
  EXPECT_EQ(got.stats.tokens, want.stats.tokens);
  EXPECT_EQ(got.stats.busy_s, want.stats.busy_s);
  EXPECT_EQ(got.stats.wait_s, want.stats.wait_s);
  EXPECT_EQ(got.stats.stop, want.stats.stop);
}

std::string error_of(comm::Message m, int64_t expected) {
  try {
    unpack(std::move(m), expected, "rank 1 (target 1)");
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(BatchMessage, RoundTripThroughTheWireHeader) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    const BatchMessage b = make_batch(3, 17, 40, 12, dtype);
    ASSERT_EQ(b.stats.stop, 1.0);  // batch 17: the stop flag set (make_batch)
    comm::Message m = pack(b, at::kCPU);
    EXPECT_EQ(m.kind, kBatchMessageKind);
    EXPECT_EQ(m.batch, 17);
    ASSERT_EQ(m.tensors.size(), static_cast<size_t>(kNumBatchTensors));
    // the header a receiver would decode describes the same tensors
    std::vector<uint8_t> wire(comm::kHeaderBytes);
    comm::encode_header(comm::header_of(m), wire.data());
    comm::Header h = comm::decode_header(wire.data(), "test");
    ASSERT_EQ(h.specs.size(), m.tensors.size());
    for (size_t i = 0; i < h.specs.size(); ++i) {
      EXPECT_EQ(h.specs[i].dtype, m.tensors[i].scalar_type());
      EXPECT_EQ(h.specs[i].shape, m.tensors[i].sizes().vec());
    }
    expect_same(unpack(std::move(m), 17, "test"), b);
    const BatchMessage c = make_batch(3, 18, 40, 12, dtype);  // stop flag clear
    expect_same(unpack(pack(c, at::kCPU), 18, "test"), c);
  }
}

TEST(BatchMessage, RefusesAMessageOutOfStepNamingTheSender) {
  const BatchMessage b = make_batch(3, 4, 16, 8, at::kFloat);
  std::string e = error_of(pack(b, at::kCPU), 6);  // another batch
  EXPECT_NE(e.find("expected batch 6 (5 tensors) from rank 1 (target 1), got kind 1 batch 4"), std::string::npos) << e;
  comm::Message m = pack(b, at::kCPU);
  m.kind = 7;
  EXPECT_NE(error_of(m, 4).find("got kind 7"), std::string::npos);
  m = pack(b, at::kCPU);
  m.tensors.pop_back();
  EXPECT_NE(error_of(m, 4).find("with 4 tensors"), std::string::npos);
  m = pack(b, at::kCPU);
  m.tensors[1] = m.tensors[1].to(at::kBool);  // loss mask of another dtype
  e = error_of(m, 4);
  EXPECT_NE(e.find("batch 4 from rank 1 (target 1): ids Long [16], loss_mask Bool [16]"), std::string::npos) << e;
  m = pack(b, at::kCPU);
  m.tensors[3] = m.tensors[3].narrow(0, 0, 15);  // features of fewer tokens than ids
  EXPECT_NE(error_of(m, 4).find("features Float [15, 8]"), std::string::npos);
  m = pack(b, at::kCPU);
  m.tensors[4] = m.tensors[4].narrow(0, 0, 2);  // stats of 2 values
  EXPECT_NE(error_of(m, 4).find("stats Double [2]"), std::string::npos);
  m = pack(b, at::kCPU);
  m.tensors[4] = m.tensors[4].narrow(0, 0, 3);  // the layout before the stop flag (a peer of another version)
  e = error_of(m, 4);
  EXPECT_NE(e.find("stats Double [3]; expected int64 [T], uint8 [T], int64 [n+1], [T, K*H], float64 [4]"),
            std::string::npos) << e;
}

TEST(BatchMessage, MpiRoundTripBetweenTwoRanks) {
  if (g_comm == nullptr) GTEST_SKIP() << "run under mpirun -np 2 for the MPI round trip";
  const int me = g_comm->rank(), peer = 1 - me;
  for (int64_t k = 0; k < 6; ++k) {
    // rank r sends its batches (seed r) to the other; tokens vary, batch 3 is empty of features
    const int64_t T = 8 + 13 * k, F = k == 3 ? 0 : 24;
    auto send = g_comm->isend(peer, pack(make_batch(me, k, T, F, at::kBFloat16), g_comm->device()));
    BatchMessage got = unpack(g_comm->recv(peer, k), k, comm::name_rank(peer));
    send->wait();
    expect_same(got, make_batch(peer, k, T, F, at::kBFloat16));
  }
}

int main(int argc, char** argv) {
  return dflash::test::mpi_test_main(argc, argv, g_comm, [](const comm::Identity& id) -> std::unique_ptr<comm::Communicator> {
    if (id.world_size == 1) return nullptr;
    if (id.world_size != 2) throw std::runtime_error("test_batch_message: run it with 1 or 2 ranks");
    return comm::make_mpi_communicator(id, 60);
  });
}
