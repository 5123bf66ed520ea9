// The wire header of a message (comm/communicator.h) and the error plumbing of
// comm/watchdog.h: round trip of every dtype and rank, limits, a corrupt header naming the
// peer, exit codes, and the deadline message naming op, peer and batch.
#include <gtest/gtest.h>

#include <thread>

#include "comm/communicator.h"
#include "core/error.h"
#include "comm/watchdog.h"

using namespace dflash::comm;

TEST(Header, RoundTripEveryDtypeAndRank) {
  Header h;
  h.kind = 5;
  h.batch = (int64_t(1) << 40) + 3;
  std::vector<at::ScalarType> types = {at::kFloat, at::kBFloat16, at::kHalf, at::kLong, at::kInt,
                                       at::kByte,  at::kBool,     at::kDouble, at::kChar, at::kShort};
  for (size_t i = 0; i < types.size(); ++i) {
    std::vector<int64_t> shape;
    for (size_t d = 0; d < i % 9; ++d) shape.push_back(static_cast<int64_t>(d * 3 + i));  // 0..8 dims, zeros too
    h.specs.push_back(TensorSpec{types[i], shape});
  }
  std::vector<uint8_t> buf(kHeaderBytes);
  encode_header(h, buf.data());
  Header g = decode_header(buf.data(), "rank 1");
  EXPECT_EQ(g.kind, h.kind);
  EXPECT_EQ(g.batch, h.batch);
  ASSERT_EQ(g.specs.size(), h.specs.size());
  for (size_t i = 0; i < h.specs.size(); ++i) {
    EXPECT_EQ(g.specs[i].dtype, h.specs[i].dtype) << i;
    EXPECT_EQ(g.specs[i].shape, h.specs[i].shape) << i;
  }
}

TEST(Header, NbytesOfSpecs) {
  EXPECT_EQ((TensorSpec{at::kBFloat16, {3, 4}}).nbytes(), 24);
  EXPECT_EQ((TensorSpec{at::kLong, {0, 7}}).nbytes(), 0);
  EXPECT_EQ((TensorSpec{at::kFloat, {}}).nbytes(), 4);  // a scalar
}

TEST(Header, LimitsAreErrors) {
  std::vector<uint8_t> buf(kHeaderBytes);
  Header many;
  many.specs.assign(kMaxTensors + 1, TensorSpec{at::kFloat, {1}});
  EXPECT_THROW(encode_header(many, buf.data()), dflash::CommError);
  Header deep;
  deep.specs.push_back(TensorSpec{at::kFloat, std::vector<int64_t>(kMaxDims + 1, 1)});
  EXPECT_THROW(encode_header(deep, buf.data()), dflash::CommError);
  Header complex;
  complex.specs.push_back(TensorSpec{at::kComplexFloat, {2}});
  EXPECT_THROW(encode_header(complex, buf.data()), dflash::CommError);
}

TEST(Header, CorruptHeaderNamesThePeer) {
  std::vector<uint8_t> buf(kHeaderBytes, 0xab);
  try {
    decode_header(buf.data(), "rank 3 (target 3)");
    FAIL() << "decoded garbage";
  } catch (const dflash::CommError& e) {
    EXPECT_NE(std::string(e.what()).find("rank 3 (target 3)"), std::string::npos) << e.what();
  }
}

TEST(Header, OfMessage) {
  Message m{2, 9, {at::zeros({2, 3}, at::kHalf), at::empty({0}, at::kLong)}};
  Header h = header_of(m);
  ASSERT_EQ(h.specs.size(), 2u);
  EXPECT_EQ(h.specs[0].dtype, at::kHalf);
  EXPECT_EQ(h.specs[0].shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(h.specs[1].nbytes(), 0);
}

TEST(Watchdog, ExitCodes) {
  EXPECT_EQ(exit_code_of(dflash::UserError("x")), dflash::kExitUser);
  EXPECT_EQ(exit_code_of(dflash::CommError("x")), dflash::kExitComm);
  EXPECT_EQ(exit_code_of(std::runtime_error("x")), dflash::kExitInternal);
}

TEST(Watchdog, DeadlineMessageNamesOpPeerBatch) {
  set_rank_namer([](int r) { return "rank " + std::to_string(r) + " (drafter 0)"; });
  BlockedOn b("recv", 5, 41, 0.05);
  EXPECT_FALSE(b.expired());
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  EXPECT_TRUE(b.expired());
  try {
    b.throw_timeout("peer silent");
    FAIL();
  } catch (const dflash::CommError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("in recv with rank 5 (drafter 0), batch 41: peer silent"), std::string::npos) << m;
  }
  BlockedOn forever("barrier", kNoPeer, kNoBatch, 0);
  EXPECT_FALSE(forever.expired());
  EXPECT_EQ(forever.what(), "barrier");
  set_rank_namer({});
}

TEST(Watchdog, AbortCallbacksRunOnce) {
  int calls = 0;
  std::string why;
  int id = register_abort([&](const std::string& r) { ++calls; why = r; });
  int gone = register_abort([&](const std::string&) { calls += 100; });
  unregister_abort(gone);
  abort_all("peer died");
  abort_all("again");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(why, "peer died");
  unregister_abort(id);
}
