// comm_bench: point-to-point bandwidth and latency of dflash messages, next to all-reduce bus
// bandwidth, between 2 processes (one GPU each over NCCL, or CPU over MPI).
//
//   mpirun -np 2 build/bench/comm_bench [--backend nccl|mpi|auto] [--min-mb 1] [--max-mb 1024]
//                                       [--iters 20] [--warmup 3]
//
// Columns (per message size S, one uint8 tensor of S bytes in a dflash Message):
//   latency_ms   half of a ping-pong round trip (send + recv back), the one-way time of one message
//   stream_GB/s  S x N / time for N messages sent back to back (4 in flight), as the target ->
//                drafter stream does, timed on the receiver from a barrier to the last message:
//                the sustained throughput of the pipeline's transport
//   ar_ms, ar_busGB/s  all_reduce (sum) of S bytes of fp32 over both ranks; bus bandwidth =
//                S / time x 2(n-1)/n (nccl-tests' definition, n = 2 ranks)
// Rank 0 prints the table. Times are wall clock after the operation's wait() returned (which
// includes the GPU work: waits poll the completion events).
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <string>

#include "comm/communicator.h"
#include "core/error.h"
#include "comm/identity.h"
#include "core/log.h"
#include "comm/watchdog.h"

using namespace dflash::comm;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Opts {
  std::string backend = "auto";
  double min_mb = 1, max_mb = 1024;
  int iters = 20, warmup = 3;
};

Opts parse(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) dflash::throw_user("{} needs a value", a);
      return argv[++i];
    };
    if (a == "--backend") o.backend = val();
    else if (a == "--min-mb") o.min_mb = std::stod(val());
    else if (a == "--max-mb") o.max_mb = std::stod(val());
    else if (a == "--iters") o.iters = std::stoi(val());
    else if (a == "--warmup") o.warmup = std::stoi(val());
    else dflash::throw_user("unknown option '{}' (--backend, --min-mb, --max-mb, --iters, --warmup)", a);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Opts o = parse(argc, argv);
    Identity id = detect();
    dflash::log::set_identity(id.rank, id.world_size, "bench");
    install_watchdog();
    if (id.world_size != 2) dflash::throw_user("comm_bench runs with 2 processes (mpirun -np 2), got {}", id.world_size);
    auto comm = make_communicator(CommOptions{o.backend, 120, 300}, id);
    comm->set_timeout(120);
    auto world = comm->new_group({0, 1});
    int me = id.rank, peer = 1 - id.rank;
    if (me == 0)
      std::printf("comm_bench: %s on %s, 2 ranks, %d iterations after %d warm-up\n"
                  "%10s %12s %12s %10s %12s\n",
                  comm->backend(), comm->device().str().c_str(), o.iters, o.warmup, "size_MB", "latency_ms",
                  "stream_GB/s", "ar_ms", "ar_busGB/s");
    for (double mb = o.min_mb; mb <= o.max_mb + 1e-9; mb *= 4) {
      int64_t bytes = static_cast<int64_t>(mb * (1 << 20));
      int iters = bytes >= (int64_t(512) << 20) ? std::max(3, o.iters / 4) : o.iters;
      at::Tensor payload = at::zeros({bytes}, at::TensorOptions().dtype(at::kByte).device(comm->device()));
      Message msg{1, 0, {payload}};
      // ---- ping-pong latency
      double t0 = 0;
      for (int i = 0; i < o.warmup + iters; ++i) {
        if (i == o.warmup) {
          comm->barrier();
          t0 = now_s();
        }
        msg.batch = i;
        if (me == 0) {
          comm->send(peer, msg);
          comm->recv(peer, i);
        } else {
          Message m = comm->recv(peer, i);
          comm->send(peer, m);
        }
      }
      double lat = (now_s() - t0) / iters / 2;
      // ---- streaming bandwidth (rank 0 -> rank 1, 4 in flight), timed from a barrier to the
      // last message received, after warm-up messages outside the timed part
      for (int i = 0; i < o.warmup; ++i) {
        msg.batch = 1000000 + i;
        if (me == 0) comm->send(peer, msg);
        else comm->recv(peer, msg.batch);
      }
      comm->barrier();
      t0 = now_s();
      if (me == 0) {
        std::deque<HandlePtr> inflight;
        for (int i = 0; i < iters; ++i) {
          msg.batch = 2000000 + i;
          inflight.push_back(comm->isend(peer, msg));
          while (inflight.size() > 4) {
            inflight.front()->wait();
            inflight.pop_front();
          }
        }
        for (auto& h : inflight) h->wait();
      } else {
        std::deque<HandlePtr> pending;
        for (int i = 0; i < iters; ++i) pending.push_back(comm->irecv(peer, 2000000 + i));
        for (int i = 0; i < iters; ++i) {
          pending.front()->take();
          pending.pop_front();
        }
      }
      double t_end = now_s();
      std::vector<at::Tensor> tv{at::tensor({me == 1 ? t_end - t0 : 0.0},
                                            at::TensorOptions().dtype(at::kDouble)).to(comm->device())};
      comm->all_reduce(*world, tv, ReduceOp::Sum);
      double stream_s = tv[0].cpu().item<double>();
      double stream_gbs = bytes * double(iters) / stream_s / 1e9;
      // ---- all-reduce
      at::Tensor f = at::ones({bytes / 4}, at::TensorOptions().dtype(at::kFloat).device(comm->device()));
      std::vector<at::Tensor> ar{f};
      for (int i = 0; i < o.warmup; ++i) comm->all_reduce(*world, ar, ReduceOp::Sum);
      comm->barrier();
      t0 = now_s();
      for (int i = 0; i < iters; ++i) comm->all_reduce(*world, ar, ReduceOp::Sum);
      double ar_s = (now_s() - t0) / iters;
      double bus = bytes / ar_s / 1e9 * 2.0 * (2 - 1) / 2;
      if (me == 0)
        std::printf("%10.0f %12.3f %12.1f %10.3f %12.1f\n", mb, lat * 1e3, stream_gbs, ar_s * 1e3, bus);
      std::fflush(stdout);
    }
    comm->barrier();
    comm.reset();
    finalize_mpi();
    return 0;
  } catch (const std::exception& e) {
    fail_fast(e);
  }
}
