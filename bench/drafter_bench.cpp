// Drafter training-step benchmark (forward + backward; with --optimizer also the AdamW step over
// fp32 masters: the full step) with Qwen3-8B drafter shapes:
// H 4096, 32/8 heads, head_dim 128, intermediate 12288, 5 layers, vocab 151936, K = 5 target
// layers, 512 anchors per sequence, block size 16. Prints one table row per case: time (forward,
// backward, AdamW: the stream's time between marks of a step that runs as in training, without a
// sync between its parts; the step: host wall time from an idle device to the end of the update,
// block sampling included), drafted positions/s, target tokens/s, model TFLOP/s, MFU against a
// bf16 matmul measured in the same run, and peak memory.
//
// FLOPs (notes/performance.md, no recomputation counted), P = drafted positions (B x N x 16):
//   draft layers 6 x L x 192.94M x P; frozen lm_head 4 x 622.33M x P; context tokens
//   B x S x (6 x L x 8.39M + 4 x 83.89M); attention 3 x L x 16384 x (visible query-key pairs).
//
//   drafter_bench [--seq 2048,3072] [--rows 1,2,4] [--anchors 512] [--iters 5] [--warmup 2]
//                 [--full] (adds: unfused loss, dense mask, kernel attention where available)
//                 [--budget-s T] (skip the remaining cases once T seconds have passed)
//                 [--attention sdpa,kernel] (the main case's paths, in this order; default: kernel
//                  where it is built and a GPU runs it (the training default), then sdpa; kernel
//                  where it is not built prints "not built")
//                 [--optimizer] (adds AdamW: clip + update of fp32 masters, as training does)
//                 [--profile] (one more step of the first case under the Kineto profiler: device
//                  kernel time by kind of work and the top kernels, trainer/metrics/profile.h)
//                 [--profile-trace FILE] (with --profile: that step's Chrome trace, to find where
//                  the device waits)
//                 [--smoke] (tiny shapes on the CPU: checks that the program runs)
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

#include "attention/dflash_attention.h"
#include "attention/reference.h"
#include "core/device.h"
#include "core/error.h"
#include "core/parse.h"
#include "trainer/model/anchors.h"
#include "trainer/metrics/profile.h"
#include "trainer/metrics/timeline.h"
#include "trainer/model/drafter.h"
#include "trainer/optim/adamw.h"

using namespace dflash;
using namespace dflash::model;

namespace {

using Clock = std::chrono::steady_clock;

double matmul_tflops(at::Device dev, at::ScalarType dt) {
  const int64_t n = dev.is_cuda() ? 8192 : 256;
  auto a = at::randn({n, n}, at::TensorOptions().dtype(dt).device(dev));
  auto b = at::randn({n, n}, at::TensorOptions().dtype(dt).device(dev));
  for (int i = 0; i < 3; ++i) at::mm(a, b);
  device::sync(dev);
  const int reps = dev.is_cuda() ? 30 : 3;
  auto t0 = Clock::now();
  for (int i = 0; i < reps; ++i) at::mm(a, b);
  device::sync(dev);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  return 2.0 * n * n * n * reps / s / 1e12;
}

struct Case {
  int64_t S, B;
  bool fused;
  int64_t group_queries;  // reference attention: queries per SDPA entry (0: dense mask)
  attention::Backend backend;
};

std::string name_of(const Case& c) {
  std::string att = c.backend == attention::Backend::Kernel
                        ? "kernel"
                        : (c.group_queries > 0 ? "sdpa-g" + std::to_string(c.group_queries) : "sdpa-dense");
  return att + (c.fused ? " fused" : " plain");
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> seqs = {2048, 3072}, rows = {1, 2, 4};
  int64_t anchors = 512, iters = 5, warmup = 2;
  bool full = false, smoke = false, with_opt = false, profile = false;
  std::string profile_trace;
  std::vector<std::string> paths;
  double budget_s = 0;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw_user("{} needs a value", a);
        return argv[++i];
      };
      if (a == "--seq") seqs = parse_int_list(next(), "--seq");
      else if (a == "--rows") rows = parse_int_list(next(), "--rows");
      else if (a == "--anchors") anchors = parse_int(next(), "--anchors");
      else if (a == "--iters") iters = parse_int(next(), "--iters");
      else if (a == "--warmup") warmup = parse_int(next(), "--warmup");
      else if (a == "--full") full = true;
      else if (a == "--budget-s") budget_s = std::stod(next());
      else if (a == "--smoke") smoke = true;
      else if (a == "--optimizer") with_opt = true;
      else if (a == "--profile") profile = true;
      else if (a == "--profile-trace") profile_trace = next();
      else if (a == "--attention") {
        const std::string v = next();
        for (size_t p = 0; p <= v.size();) {
          size_t q = v.find(',', p);
          if (q == std::string::npos) q = v.size();
          paths.push_back(v.substr(p, q - p));
          if (paths.back() != "sdpa" && paths.back() != "kernel")
            throw_user("--attention: sdpa or kernel, got '{}'", paths.back());
          p = q + 1;
        }
      }
      else throw_user("unknown argument {}", a);
    }
  } catch (const UserError& e) {
    std::fprintf(stderr, "drafter_bench: error: %s\n", e.what());
    return kExitUser;
  }
#ifdef DFLASH_CUDA
  const bool cuda = !smoke && c10::cuda::device_count() > 0;
#else
  const bool cuda = false;
#endif
  if (!cuda && !smoke) {
    std::printf("drafter_bench: no CUDA device; run with --smoke for a CPU check\n");
    return 0;
  }
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  const at::ScalarType dt = cuda ? at::kBFloat16 : at::kFloat;

  DrafterSpec spec;
  if (smoke) {
    spec.hidden_size = 64, spec.intermediate_size = 96, spec.num_heads = 4, spec.num_kv_heads = 2, spec.head_dim = 16;
    spec.vocab_size = 512, spec.num_layers = 2, spec.num_target_layers = 8, spec.target_layer_ids = {1, 3, 5};
    spec.mask_token_id = 511;
    seqs = {96}, rows = {1, 2}, anchors = 4, iters = 2, warmup = 1, full = paths.empty();
  } else {
    spec.hidden_size = 4096, spec.intermediate_size = 12288, spec.num_heads = 32, spec.num_kv_heads = 8;
    spec.head_dim = 128, spec.vocab_size = 151936, spec.num_layers = 5, spec.num_target_layers = 36;
    spec.target_layer_ids = {1, 9, 17, 25, 33}, spec.mask_token_id = 151669;
  }
  spec.block_size = 16;
  const int64_t H = spec.hidden_size, V = spec.vocab_size, L = spec.num_layers, bs = spec.block_size;
  const int64_t K = spec.num_features();

  Drafter drafter(spec, dev, dt);
  {
    at::NoGradGuard ng;
    for (auto& [n, t] : drafter.named_parameters()) {
      auto w = t;
      if (w.dim() == 1) w.fill_(1.0);
      else w.normal_(0.0, 0.02);
    }
  }
  auto topt = at::TensorOptions().dtype(dt).device(dev);
  drafter.set_target_weights(at::randn({V, H}, topt), at::randn({V, H}, topt).mul_(0.02));
  const double mm = matmul_tflops(dev, dt);

  // Per-parameter FLOP constants (model FLOPs, as in notes/performance.md).
  const double qd = spec.num_heads * spec.head_dim, kvd = spec.num_kv_heads * spec.head_dim;
  const double layer_w = 2 * H * qd + 2 * H * kvd + 3.0 * H * spec.intermediate_size;  // q,o,k,v,mlp
  const double kv_w = 2 * H * kvd, fc_w = static_cast<double>(K) * H * H, head_w = static_cast<double>(V) * H;
  const double pair_flops = 4.0 * spec.head_dim * spec.num_heads;

  std::printf("drafter_bench: %s, H %ld, heads %ld/%ld, I %ld, layers %ld, vocab %ld, K %ld, %ld anchors, bs %ld\n",
              cuda ? "cuda bf16" : "cpu fp32 (smoke)", (long)H, (long)spec.num_heads, (long)spec.num_kv_heads,
              (long)spec.intermediate_size, (long)L, (long)V, (long)K, (long)anchors, (long)bs);
  std::printf("bf16 matmul %ldx%ldx%ld: %.1f TFLOP/s (MFU denominator)\n\n", (long)(cuda ? 8192 : 256),
              (long)(cuda ? 8192 : 256), (long)(cuda ? 8192 : 256), mm);
  // The optimizer of training (trainer/roles/drafter_role.cpp): fp32 masters, clip 1.0.
  std::unique_ptr<optim::AdamW> opt_ptr;
  if (with_opt) {
    opt_ptr = std::make_unique<optim::AdamW>(drafter.named_parameters(), optim::AdamWOptions{});
    std::printf("optimizer: %s AdamW (%s)\n", opt_ptr->impl_name(), optim::kOptimFusedEnv);
  }
  if (with_opt) {
    std::printf("| S | B | attention / loss | fwd ms | bwd ms | opt ms | step ms | draft pos/s | target tok/s | TFLOP/s | MFU | peak GiB |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  } else {
    std::printf("| S | B | attention / loss | fwd ms | bwd ms | total ms | draft pos/s | target tok/s | TFLOP/s | MFU | peak GiB |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  }
  std::fflush(stdout);

  // Most important first (a time budget may cut the tail): the bar case (largest S and B, the
  // default attention, fused loss), then the other path, the unfused loss, the other shapes, the
  // dense mask and other query groupings.
  std::vector<Case> cases;
  const int64_t Smax = seqs.back(), Bmax = rows.back();
  const int64_t g0 = attention::detail::kDefaultGroupQueries;
  auto ref = attention::Backend::Reference;
  if (paths.empty()) {  // the training default first (drafter.attention=auto), its oracle beside it
    if (cuda && attention::kernel_available()) paths.push_back("kernel");
    paths.push_back("sdpa");
  }
  bool kernel_missing = false;
  for (const auto& path : paths) {
    if (path == "sdpa") cases.push_back({Smax, Bmax, true, g0, ref});
    else if (cuda && attention::kernel_available()) cases.push_back({Smax, Bmax, true, 0, attention::Backend::Kernel});
    else kernel_missing = true;
  }
  if (kernel_missing) std::printf("| %ld | %ld | kernel fused | not built into this binary (or no CUDA) |\n", (long)Smax, (long)Bmax);
  if (full) cases.push_back({Smax, rows.size() > 1 ? rows[rows.size() - 2] : Bmax, false, g0, ref});
  for (auto it = seqs.rbegin(); it != seqs.rend(); ++it)
    for (auto B : rows)
      if (!(*it == Smax && B == Bmax)) cases.push_back({*it, B, true, g0, ref});
  if (full) {
    cases.push_back({Smax, Bmax, true, 0, ref});
    for (int64_t g : {512, 2048}) cases.push_back({Smax, Bmax, true, g, ref});
    cases.push_back({Smax, rows.front(), false, g0, ref});
  }
  const auto t_start = Clock::now();
  std::string profile_text;  // printed after the table

  for (const auto& c : cases) {
    if (budget_s > 0 && std::chrono::duration<double>(Clock::now() - t_start).count() > budget_s) {
      std::printf("| %ld | %ld | %s | skipped: time budget (--budget-s %.0f) spent |\n", (long)c.S, (long)c.B,
                  name_of(c).c_str(), budget_s);
      continue;
    }
    setenv("DFLASH_SDPA_GROUP_QUERIES", std::to_string(c.group_queries).c_str(), 1);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + c.S * 10 + c.B);
    DrafterBatch batch;
    batch.ids = at::randint(0, V - 1, {c.B, c.S}, gen, at::kLong);
    batch.loss_mask = at::ones({c.B, c.S}, at::kLong);
    batch.loss_mask.narrow(1, 0, c.S / 10).zero_();  // a prompt: 10% without loss
    batch.features = at::randn({c.B, c.S, K * H}, topt);
    StepOptions opt;
    opt.attention = c.backend;
    opt.num_anchors = anchors;
    opt.loss_chunk = c.fused ? 2048 : 0;
    opt.defer_metrics = true;  // as the trainer: read after the backward is queued
    AnchorOptions ao;  // the blocks Drafter::forward samples (for the FLOP count below)
    ao.block_size = bs;
    ao.num_anchors = anchors;
    ao.seed = opt.seed;
    ao.min_blocks = opt.min_blocks;
    double fwd = 0, bwd = 0, opt_s = 0, wall = 0, peak = 0, steady = 0;
    // One step as the trainer runs it: no sync between its parts (the loss and metrics are read
    // once the backward is queued, the gradient norm once AdamW is); returns the stream marks
    // before it, after the forward, after the backward and after the update. The parts' times are
    // the stream's between marks, the step's the host's wall time from an idle device (block
    // sampling included) to the end of the update. Drafter::forward samples the blocks as the
    // trainer's step does, after queueing the context (the host prepares while the device runs).
    metrics::Timeline tl(dev);
    auto one_step = [&](int64_t it) {
      std::array<int64_t, 4> m{};
      batch.global_batch_index = it;
      m[0] = tl.mark();
      auto out = drafter.forward(batch, opt);
      m[1] = tl.mark();
      out.loss.backward();
      m[2] = tl.mark();
      out.finish();
      if (opt_ptr) {
        opt_ptr->step(1e-6, 1.0);  // a tiny lr: the weights stay what the FLOP count assumes
        opt_ptr->zero_grad();
      }
      m[3] = tl.mark();
      return m;
    };
    double flops = 0, P = 0;
    std::string err;
    try {
      device::empty_cache(dev);
      device::reset_peak(dev);
      for (int64_t it = 0; it < warmup + iters; ++it) {
        device::sync(dev);
        auto t0 = Clock::now();
        const std::array<int64_t, 4> m = one_step(it);
        const int64_t m0 = m[0], m1 = m[1], m2 = m[2], m3 = m[3];
        device::sync(dev);
        auto t3 = Clock::now();
        for (auto& p : drafter.parameters()) p.mutable_grad().reset();
        if (it >= warmup) {
          fwd += tl.seconds(m0, m1);
          bwd += tl.seconds(m1, m2);
          opt_s += tl.seconds(m2, m3);
          wall += std::chrono::duration<double>(t3 - t0).count();
        }
        tl.drop_before(m3 + 1);
        if (it == 0) {  // FLOPs of this anchor set (the same count every step up to the anchors)
          ao.batch_index = it;
          auto blocks = sample_blocks(batch.loss_mask, {}, ao);
          auto keep = blocks.keep.to(at::kDouble);
          auto vis = ((blocks.anchor - blocks.doc_begin).to(at::kDouble) + bs) * bs * keep;
          const double pairs = vis.sum().item<double>();
          P = static_cast<double>(c.B * blocks.num_blocks() * bs);
          flops = 6.0 * L * layer_w * P + 4.0 * head_w * P + c.B * c.S * (6.0 * L * kv_w + 4.0 * fc_w) +
                  3.0 * L * pair_flops * pairs;
        }
      }
      // Steady state: `iters` more steps back to back, as the trainer runs them (no device sync
      // between steps: a step's host work overlaps the previous step's AdamW update, whose norm
      // the host has already read).
      if (with_opt) {
        device::sync(dev);
        const auto s0 = Clock::now();
        for (int64_t it = 0; it < iters; ++it) {
          const std::array<int64_t, 4> m = one_step(warmup + iters + 1 + it);
          tl.drop_before(m[0]);
        }
        device::sync(dev);
        steady = std::chrono::duration<double>(Clock::now() - s0).count() / static_cast<double>(iters);
      }
      peak = device::peak_memory_gib(dev);
    } catch (const std::exception& e) {
      err = e.what();
      err = err.substr(0, std::min<size_t>(err.find('\n'), 120));
      for (auto& p : drafter.parameters()) p.mutable_grad().reset();
    }
    if (!err.empty()) {
      std::printf("| %ld | %ld | %s | failed: %s |\n", (long)c.S, (long)c.B, name_of(c).c_str(), err.c_str());
      std::fflush(stdout);
      continue;
    }
    if (profile && profile_text.empty()) {
      // One more step of this case (the first that ran: the bar case) under the profiler.
      double wall_ms = 0;
      try {
        device::sync(dev);
        std::vector<metrics::ProfiledOp> ops = metrics::profile_ops([&] {
          auto t0 = Clock::now();
          one_step(warmup + iters);
          device::sync(dev);
          wall_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        }, cuda, profile_trace);
        for (auto& p : drafter.parameters()) p.mutable_grad().reset();
        profile_text = metrics::format_profile(metrics::summarize(std::move(ops), 15), wall_ms,
                                             fmt::format("profile of one step, {} x {} {}{}", c.B, c.S, name_of(c),
                                                         opt_ptr ? " + AdamW" : ""));
      } catch (const std::exception& e) {
        profile_text = fmt::format("profile: failed: {}\n", e.what());
      }
    }
    fwd /= iters, bwd /= iters, opt_s /= iters, wall /= iters;
    const double tot = wall;  // the optimizer's FLOPs are not counted (elementwise)
    const double tf = flops / tot / 1e12;
    if (with_opt) {
      std::printf("| %ld | %ld | %s | %.1f | %.1f | %.1f | %.1f | %.0f | %.0f | %.1f | %.1f%% | %.1f |\n", (long)c.S,
                  (long)c.B, name_of(c).c_str(), fwd * 1e3, bwd * 1e3, opt_s * 1e3, tot * 1e3, P / tot, c.B * c.S / tot,
                  tf, 100 * tf / mm, peak);
      std::printf("steady %ldx%ld %s: %.1f ms per step, %.0f target tok/s, MFU %.1f%% (%ld steps back to back, no device "
                  "sync between them, as the trainer runs them)\n",
                  (long)c.B, (long)c.S, name_of(c).c_str(), steady * 1e3, c.B * c.S / steady,
                  100 * flops / steady / 1e12 / mm, (long)iters);
    } else {
      std::printf("| %ld | %ld | %s | %.1f | %.1f | %.1f | %.0f | %.0f | %.1f | %.1f%% | %.1f |\n", (long)c.S, (long)c.B,
                  name_of(c).c_str(), fwd * 1e3, bwd * 1e3, tot * 1e3, P / tot, c.B * c.S / tot, tf, 100 * tf / mm, peak);
    }
    std::fflush(stdout);
  }
  if (!profile_text.empty()) std::printf("\n%s", profile_text.c_str());
  return 0;
}
