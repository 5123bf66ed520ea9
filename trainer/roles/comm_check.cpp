// trainer/roles/comm_check.h: --comm-check, the communication self-test over the run's schedule.
#include "trainer/roles/comm_check.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <deque>

#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"
#include "comm/watchdog.h"

namespace dflash::roles {
using comm::CommOptions;
using comm::Group;
using comm::HandlePtr;
using comm::Message;
using comm::ReduceOp;
namespace {

constexpr int32_t kKindCheck = 7;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t message_bytes(const Message& m) {
  int64_t n = 0;
  for (const auto& t : m.tensors) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// Bit-exact comparison (bytes, so -0.0 != 0.0 and NaN payloads count).
void verify(const Message& got, const Message& want, int from) {
  auto fail = [&](const std::string& what) {
    throw std::runtime_error(fmt::format("comm-check: batch {} from {}: {}", want.batch, comm::name_rank(from), what));
  };
  if (got.kind != want.kind || got.batch != want.batch)
    fail(fmt::format("header kind {} batch {}, expected kind {} batch {}", got.kind, got.batch, want.kind, want.batch));
  if (got.tensors.size() != want.tensors.size())
    fail(fmt::format("{} tensors, expected {}", got.tensors.size(), want.tensors.size()));
  for (size_t i = 0; i < want.tensors.size(); ++i) {
    at::Tensor g = got.tensors[i].cpu().contiguous();
    const at::Tensor& w = want.tensors[i];
    if (g.scalar_type() != w.scalar_type() || g.sizes() != w.sizes())
      fail(fmt::format("tensor {}: {} [{}], expected {} [{}]", i, c10::toString(g.scalar_type()),
                       fmt::join(g.sizes().vec(), ", "), c10::toString(w.scalar_type()),
                       fmt::join(w.sizes().vec(), ", ")));
    if (w.numel() == 0) continue;
    at::Tensor gb = g.view({-1}).view(at::kByte), wb = w.contiguous().view({-1}).view(at::kByte);
    if (!at::equal(gb, wb)) fail(fmt::format("tensor {} ({}) differs in its bytes", i, c10::toString(w.scalar_type())));
  }
}

}  // namespace

Message make_check_batch(int64_t seed, int64_t k) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed * 1000003 + k));
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  int64_t rows = (k * 7) % 13;  // 0 rows for some batches: 0-byte tensors
  Message m;
  m.kind = kKindCheck;
  m.batch = k;
  m.tensors.push_back(at::randn({rows, 64}, gen, f32));
  m.tensors.push_back(at::randn({(k % 5) + 1, 33}, gen, f32).to(at::kBFloat16));
  m.tensors.push_back(at::randn({5, (k % 3) * 17}, gen, f32).to(at::kHalf));
  m.tensors.push_back(at::randint(-(int64_t(1) << 40), int64_t(1) << 40, {(k % 11) + 100}, gen,
                                  at::TensorOptions().dtype(at::kLong)));
  m.tensors.push_back(at::randint(-100000, 100000, {3, 4, 5}, gen, at::TensorOptions().dtype(at::kInt)));
  m.tensors.push_back(at::randint(0, 256, {rows * 3 + 1}, gen, at::TensorOptions().dtype(at::kByte)));
  m.tensors.push_back(at::randint(0, 2, {17}, gen, at::TensorOptions().dtype(at::kByte)).to(at::kBool));
  m.tensors.push_back(at::empty({0, 4}, f32));
  m.tensors.push_back(at::randn({256, 256}, gen, f32));  // 256 KB: something to measure
  return m;
}

int run_comm_check(const RankContext& ctx, const Config& cfg, int64_t batches) {
  const comm::Identity& id = ctx.id;
  const Schedule& s = ctx.schedule;
  DFLASH_CHECK(batches >= 0, "--comm-check needs a batch count >= 0, got {}", batches);
  const CommOptions opt = comm_options(cfg);
  auto comm = comm::make_communicator(opt, id);
  at::Device dev = comm->device();
  std::shared_ptr<Group> drafters = comm->new_group(s.drafter_ranks());
  comm->barrier();
  comm->set_timeout(opt.timeout_s);
  log::info("comm-check: {} batches from {} target(s) to {} drafter(s) over {} ({}), timeout {} s", batches,
            s.targets(), s.drafters(), comm->backend(), dev.str(), opt.timeout_s);

  auto t0 = std::chrono::steady_clock::now();
  int64_t bytes_sent = 0, bytes_recv = 0, reductions = 0;
  const int64_t rounds = batches / s.drafters();  // all-reduces: every drafter has this many batches
  auto to_dev = [&](Message m) {
    for (auto& t : m.tensors) t = t.to(dev);
    return m;
  };
  auto reduce_round = [&](int64_t j, int64_t round, int64_t k) {
    // integer-valued floats: sums are exact in fp32 (< 2^24) and bf16 (small values)
    double f = static_cast<double>((j + 1) * (round + 1));
    std::vector<at::Tensor> ts{at::full({1000}, f, at::TensorOptions().dtype(at::kFloat).device(dev)),
                               at::full({7}, (j + 1) * (round + 1), at::TensorOptions().dtype(at::kLong).device(dev))};
    comm->all_reduce(*drafters, ts, ReduceOp::Sum, k);
    const int64_t D = s.drafters();
    double want = static_cast<double>((round + 1) * D * (D + 1) / 2);
    if (!at::equal(ts[0].cpu(), at::full({1000}, want, at::TensorOptions().dtype(at::kFloat))) ||
        !at::equal(ts[1].cpu(), at::full({7}, static_cast<int64_t>(want), at::TensorOptions().dtype(at::kLong))))
      throw std::runtime_error(fmt::format("comm-check: all_reduce round {} over {} is not exact: got {}, want {}",
                                           round, drafters->describe(), ts[0][0].item<float>(), want));
    std::vector<at::Tensor> avg{at::full({33}, 2.0 * j, at::TensorOptions().dtype(at::kBFloat16).device(dev))};
    comm->all_reduce(*drafters, avg, ReduceOp::Average, k);
    if (!at::equal(avg[0].cpu(), at::full({33}, static_cast<double>(D - 1), at::TensorOptions().dtype(at::kBFloat16))))
      throw std::runtime_error(fmt::format("comm-check: average all_reduce round {} is not exact: got {}, want {}",
                                           round, avg[0][0].item<float>(), D - 1));
    ++reductions;
  };

  if (s.colocated()) {
    for (int64_t k = 0; k < batches; ++k) {
      comm::maybe_inject_failure(id.rank, k);
      Message m = make_check_batch(cfg.run.seed, k);
      comm->send(0, to_dev(m));
      Message got = comm->recv(0, k);
      verify(got, m, 0);
      bytes_sent += message_bytes(m);
      bytes_recv += message_bytes(got);
      reduce_round(0, k, k);
    }
  } else if (s.is_target(id.rank)) {
    std::deque<HandlePtr> inflight;  // up to 2 sends in flight, as the pipeline's prefetch
    for (int64_t k : s.target_batches(s.target_index(id.rank), 0, batches)) {
      comm::maybe_inject_failure(id.rank, k);
      Message m = to_dev(make_check_batch(cfg.run.seed, k));
      bytes_sent += message_bytes(m);
      inflight.push_back(comm->isend(s.drafter_of(k), m));
      while (inflight.size() > 2) {
        inflight.front()->wait();
        inflight.pop_front();
      }
    }
    for (auto& h : inflight) h->wait();
  } else {
    int64_t j = s.drafter_index(id.rank);
    std::vector<int64_t> mine = s.drafter_batches(j, 0, batches);
    HandlePtr next;
    if (!mine.empty()) next = comm->irecv(s.target_of(mine[0]), mine[0]);
    for (size_t i = 0; i < mine.size(); ++i) {
      int64_t k = mine[i];
      comm::maybe_inject_failure(id.rank, k);
      Message got = next->take();
      // prefetch the next batch while checking this one
      if (i + 1 < mine.size()) next = comm->irecv(s.target_of(mine[i + 1]), mine[i + 1]);
      verify(got, make_check_batch(cfg.run.seed, k), s.target_of(k));
      bytes_recv += message_bytes(got);
      if (static_cast<int64_t>(i) < rounds) reduce_round(j, static_cast<int64_t>(i), k);
    }
  }
  comm->barrier();
  double secs = seconds_since(t0);
  // totals over the world (one all-reduce over every rank)
  std::vector<int> everyone;
  for (int r = 0; r < id.world_size; ++r) everyone.push_back(r);
  auto world = comm->new_group(everyone);
  std::vector<at::Tensor> totals{at::tensor({bytes_sent, bytes_recv, reductions}, at::TensorOptions().dtype(at::kLong)).to(dev)};
  comm->all_reduce(*world, totals, ReduceOp::Sum);
  at::Tensor tot = totals[0].cpu();
  int64_t sent = tot[0].item<int64_t>(), recv = tot[1].item<int64_t>();
  if (sent != recv)
    throw std::runtime_error(fmt::format("comm-check: {} bytes sent but {} received", sent, recv));
  log::info("comm-check OK: {} batches, {:.1f} MB from {} target(s) to {} drafter(s) in {:.2f} s = {:.1f} MB/s "
            "({}, {}), {} exact all-reduce rounds per drafter",
            batches, sent / 1e6, s.targets(), s.drafters(), secs, secs > 0 ? sent / 1e6 / secs : 0.0,
            comm->backend(), dev.str(), s.colocated() ? batches : rounds);
  return kExitOk;
}

}  // namespace dflash::roles
