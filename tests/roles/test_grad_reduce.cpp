// The drafter's bucketed gradient reduction (trainer/roles/grad_reduce.h).
// - Buckets: the arithmetic of plan_buckets (one process).
// - Under `mpirun -np 2` (MPI, CPU; CTest) or with DFLASH_TEST_BACKEND=nccl on a GPU (one rank
//   suffices: the hooks run on the autograd engine's device thread there): a small model's
//   gradients reduced by the hooks during the backward equal, bit for bit, one all_reduce of every
//   gradient after it (comm.grad_bucket_mb = 0, the oracle). Two ranks: each element is a + b
//   however the gradients are cut into buckets, so equality is exact. Also with two micro-batches
//   (grad_accum 2: the first backward unarmed), and a CommError raised inside a hook comes out of
//   backward() as that CommError.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdio>
#include <cstdlib>
#include <thread>

#include "comm/communicator.h"
#include "comm/identity.h"
#include "comm/watchdog.h"
#include "core/error.h"
#include "trainer/roles/grad_reduce.h"
#include "tests/mpi_test_main.h"

using namespace dflash;
using roles::GradReducer;
using roles::plan_buckets;

namespace {

comm::Communicator* g_comm = nullptr;
std::string g_backend = "mpi";

using Buckets = std::vector<std::vector<size_t>>;

}  // namespace

TEST(GradBuckets, ReverseOrderFilledUpToTheCap) {
  // parameters 0..5 of these sizes; the backward finishes 5 first
  const std::vector<int64_t> nb = {100, 40, 60, 30, 30, 50};
  EXPECT_EQ(plan_buckets(nb, 100), (Buckets{{5, 4}, {3, 2}, {1}, {0}}));
  EXPECT_EQ(plan_buckets(nb, 110), (Buckets{{5, 4, 3}, {2, 1}, {0}}));
  EXPECT_EQ(plan_buckets(nb, 1000), (Buckets{{5, 4, 3, 2, 1, 0}}));  // all in one
  EXPECT_EQ(plan_buckets(nb, 1), (Buckets{{5}, {4}, {3}, {2}, {1}, {0}}));
}

TEST(GradBuckets, ParameterLargerThanTheCapIsABucketOfItsOwn) {
  EXPECT_EQ(plan_buckets({10, 10, 500, 10, 10}, 25), (Buckets{{4, 3}, {2}, {1, 0}}));
  EXPECT_EQ(plan_buckets({500, 10}, 25), (Buckets{{1}, {0}}));
  EXPECT_EQ(plan_buckets({10, 500}, 25), (Buckets{{1}, {0}}));
  EXPECT_EQ(plan_buckets({0, 0, 7}, 5), (Buckets{{2}, {1, 0}}));  // empty parameters ride along
  EXPECT_TRUE(plan_buckets({}, 5).empty());
  EXPECT_EQ(roles::bucket_cap_bytes(64), int64_t(64) << 20);
  EXPECT_EQ(roles::bucket_cap_bytes(0.05), 52429);
}

namespace {

// Parameters of a small model: "unused" gets no gradient (first, so that it falls in the last
// bucket: the others are posted by the hooks), the rest a chain of products.
std::vector<std::pair<std::string, at::Tensor>> make_params(at::Device dev) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<std::pair<std::string, at::Tensor>> ps;
  for (auto [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"unused", {3}}, {"w0", {16, 8}}, {"n0", {16}}, {"w1", {32, 16}}, {"n1", {32}}, {"w2", {8, 32}}}) {
    at::Tensor t = (at::randn(shape, gen) * 0.3).to(dev);
    t.set_requires_grad(true);
    ps.emplace_back(name, t);
  }
  return ps;
}

// A rank-dependent micro-batch's loss.
at::Tensor loss_of(const std::vector<std::pair<std::string, at::Tensor>>& p, int64_t micro) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(100 + 10 * g_comm->rank() + micro);
  const at::Tensor x = at::randn({4, 8}, gen).to(p[1].second.device());
  at::Tensor h = at::tanh(x.mm(p[1].second.t()) * p[2].second);
  h = at::tanh(h.mm(p[3].second.t()) * p[4].second);
  h = h.mm(p[5].second.t());
  return (h * h).mean();
}

// The oracle: every gradient (zeros where none) in one all_reduce after the backward.
void reduce_at_once(const std::vector<std::pair<std::string, at::Tensor>>& ps, comm::Group& g) {
  std::vector<at::Tensor> grads;
  for (const auto& [n, t] : ps) {
    if (!t.grad().defined()) t.mutable_grad() = at::zeros_like(t);
    grads.push_back(t.grad());
  }
  g_comm->all_reduce(g, grads, comm::ReduceOp::Average, 5);
}

void expect_same_grads(const std::vector<std::pair<std::string, at::Tensor>>& a,
                       const std::vector<std::pair<std::string, at::Tensor>>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(a[i].second.grad().defined()) << a[i].first;
    const at::Tensor x = a[i].second.grad().cpu(), y = b[i].second.grad().cpu();
    if (g_comm->world_size() <= 2) {
      // (a + b) / 2 in any order: bit for bit
      EXPECT_TRUE(at::equal(x, y)) << a[i].first;
    } else {
      // with 3+ ranks the backend picks its algorithm by message size, so a bucket may be summed
      // in another order: fp32 rounding of a sum of world_size terms (relative 2^-24 per add), far
      // below what a wrong divisor or a missing rank would change (>= 1/world_size of the mean)
      EXPECT_TRUE(at::allclose(x, y, /*rtol=*/1e-5, /*atol=*/1e-7)) << a[i].first << ": " << (x - y).abs().max().item<float>();
    }
  }
}

std::shared_ptr<comm::Group> world_group(comm::Communicator& c) {
  std::vector<int> all;
  for (int r = 0; r < c.world_size(); ++r) all.push_back(r);
  return c.new_group(all);
}

}  // namespace

TEST(GradReducer, HooksDuringTheBackwardEqualOneAllReduceAfterIt) {
  if (!g_comm) GTEST_SKIP() << "run under mpirun -np 2 (or DFLASH_TEST_BACKEND=nccl on a GPU)";
  auto g = world_group(*g_comm);
  for (int64_t accum : {1, 2}) {
    auto hooked = make_params(g_comm->device());
    auto plain = make_params(g_comm->device());
    // fp32: unused 12 B, w0 512, n0 64, w1 2048, n1 128, w2 1024 -> {w2}, {n1}, {w1}, {n0, w0, unused}
    GradReducer r(hooked, *g_comm, *g, /*cap_bytes=*/600);
    ASSERT_EQ(r.buckets(), (Buckets{{5}, {4}, {3}, {2, 1, 0}}));
    for (int64_t m = 0; m < accum; ++m) {
      if (m == accum - 1) r.arm(5);
      loss_of(hooked, m).div(static_cast<double>(accum)).backward();
      loss_of(plain, m).div(static_cast<double>(accum)).backward();
    }
    // every bucket but the last (unused never gets a gradient) was posted by a hook, before
    // backward() returned; finish() posts the last one with zeros for unused
    EXPECT_EQ(r.posted_by_hooks(), r.num_buckets() - 1) << "grad_accum " << accum;
    r.finish();
    EXPECT_FALSE(r.armed());
    reduce_at_once(plain, *g);
    expect_same_grads(hooked, plain);
    const bool same = r.hook_thread() == std::this_thread::get_id();
    std::printf("[ hooks    ] %s: ran on %s\n", g_comm->device().str().c_str(),
                same ? "the thread that called backward()" : "another thread (the autograd engine's device thread)");
  }
}

TEST(GradReducer, ACommErrorInAHookComesOutOfBackward) {
  if (!g_comm) GTEST_SKIP() << "run under mpirun -np 2 (or DFLASH_TEST_BACKEND=nccl on a GPU)";
  auto c2 = comm::make_communicator(comm::CommOptions{g_backend, 60, 60}, comm::detect());
  auto g = world_group(*c2);
  c2->abort("aborted by the test");
  auto ps = make_params(c2->device());
  {
    GradReducer r(ps, *c2, *g, 600);
    r.arm(9);
    try {
      loss_of(ps, 0).backward();
      ADD_FAILURE() << "backward returned";
    } catch (const CommError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("all_reduce over group"), std::string::npos) << m;
      EXPECT_NE(m.find("batch 9"), std::string::npos) << m;
      EXPECT_NE(m.find("aborted by the test"), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;  // one line, as main prints it
    }
  }  // destroyed with nothing waited: no hang, no throw
  g_comm->barrier();
}

int main(int argc, char** argv) {
  if (const char* b = std::getenv("DFLASH_TEST_BACKEND")) g_backend = b;
  return dflash::test::mpi_test_main(argc, argv, g_comm, [](const comm::Identity& id) {
    return id.world_size > 1 || g_backend == "nccl" ? comm::make_communicator(comm::CommOptions{g_backend, 60, 60}, id)
                                                    : nullptr;
  });
}
