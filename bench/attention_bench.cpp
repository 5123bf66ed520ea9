// Benchmark of the block-sparse DFlash attention kernel against the SDPA-with-mask path (bf16
// additive mask, LibTorch's default SDPA backend: cuDNN on H200), on one GPU, two shapes:
//   train: 4 rows x (C = 3072 context, 512 blocks of 16), 32 q / 8 kv heads, head dim 128
//   long : 1 row, 2048 blocks of 16 (32768 queries) against 40000 context keys (72768 keys)
// Anchors are uniform over the context and sorted (notes/attention.md §0). Prints forward and
// forward+backward medians (CUDA events) and useful TFLOP/s: forward 4*d*Hq per visible
// (query, key) pair, backward 2.5x that (FlashAttention's convention).
//
// Usage: attention_bench [--out DIR] [--iters N] [--only train|long] [--no-sdpa] [--variants]
//   --variants also times each tile variant of each kernel stage (raw launches)
//   --out DIR writes DIR/spec_<shape>.txt (the masks, read by bench/attention_bench_flex.py)
//   and DIR/kernel_results.tsv.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "attention/dflash_attention.h"
#if DFLASH_ATTENTION_KERNEL
#include <cuda_runtime.h>

#include "attention/kernel.h"
#endif

using namespace dflash::attention;

#if DFLASH_ATTENTION_KERNEL
namespace {

struct Shape {
  std::string name;
  int B, Hq, Hkv, N, bs, C, d;
};

MaskSpec make_spec(const Shape& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> cb(s.B * s.N, 0), ce(s.B * s.N);
  for (int b = 0; b < s.B; ++b) {
    std::vector<int64_t> a(s.N);
    for (auto& x : a) x = 1 + (int64_t)(rng() % (uint64_t)s.C);  // anchors in [1, C]
    std::sort(a.begin(), a.end());
    std::copy(a.begin(), a.end(), ce.begin() + b * s.N);
  }
  MaskSpec m;
  m.ctx_begin = at::tensor(cb, at::kLong).view({s.B, s.N});
  m.ctx_end = at::tensor(ce, at::kLong).view({s.B, s.N});
  m.keep = at::ones({s.B, s.N}, at::kBool);
  m.ctx_len = s.C;
  m.block_size = s.bs;
  return m;
}

double visible_pairs(const MaskSpec& m) {
  auto cb = m.ctx_begin.accessor<int64_t, 2>(), ce = m.ctx_end.accessor<int64_t, 2>();
  double n = 0;
  for (int64_t b = 0; b < m.ctx_end.size(0); ++b)
    for (int64_t j = 0; j < m.ctx_end.size(1); ++j)
      n += (double)m.block_size * (double)(ce[b][j] - cb[b][j] + m.block_size);
  return n;
}

template <typename F>
double median_ms(F&& f, int iters) {
  for (int i = 0; i < 2; ++i) f();
  std::vector<double> t;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  for (int i = 0; i < iters; ++i) {
    cudaEventRecord(e0);
    f();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    t.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Additive bf16 mask [B, 1, q_len, kv_pad] (kv padded to a multiple of 128, pytorch#196678).
at::Tensor additive_mask(const MaskSpec& m, int64_t kv_pad, at::Device dev) {
  const int64_t B = m.ctx_end.size(0), N = m.ctx_end.size(1), bs = m.block_size, C = m.ctx_len;
  auto opt = at::TensorOptions().device(dev);
  auto q = at::arange(N * bs, opt.dtype(at::kLong));
  auto kv = at::arange(kv_pad, opt.dtype(at::kLong));
  auto blk = q.div(bs, "floor");
  auto cb = m.ctx_begin.to(dev).index_select(1, blk).unsqueeze(-1);  // [B, q, 1]
  auto ce = m.ctx_end.to(dev).index_select(1, blk).unsqueeze(-1);
  auto kp = m.keep.to(dev).index_select(1, blk).unsqueeze(-1);
  auto kvr = kv.view({1, 1, -1});
  auto ctx = kvr.ge(cb).logical_and(kvr.lt(ce));
  auto own = kvr.ge(C).logical_and(kvr.lt(C + N * bs))
                 .logical_and((kvr - C).div(bs, "floor").eq(blk.view({1, -1, 1})));
  auto vis = ctx.logical_or(own).logical_and(kp);
  (void)B;
  return at::zeros(vis.sizes(), opt.dtype(at::kBFloat16))
      .masked_fill(vis.logical_not(), -INFINITY)
      .unsqueeze(1);
}

// Per-stage times of the raw launches for each tile variant (env DFLASH_ATTN_*_VARIANT).
void time_variants(const Shape& s, const Prepared& prep, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, const at::Tensor& dout, double fwd_flop, int iters) {
  auto [o, lse] = kernel_forward(q, k, v, prep);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto delta = at::empty_like(lse);
  AttnParams p;
  p.B = q.size(0); p.Hq = q.size(1); p.Hkv = k.size(1); p.q_len = q.size(2); p.kv_len = k.size(2);
  p.d = q.size(3);
  p.scale = 1.0f / std::sqrt((float)p.d);
  p.meta = meta_view(prep.kernel_meta.data_ptr<int32_t>(), p.B, p.q_len, p.kv_len);
  auto st = [](const at::Tensor& t, int64_t& a, int64_t& b, int64_t& c) {
    a = t.stride(0); b = t.stride(1); c = t.stride(2);
  };
  p.q = q.data_ptr(); st(q, p.q_sb, p.q_sh, p.q_sr);
  p.k = k.data_ptr(); st(k, p.k_sb, p.k_sh, p.k_sr);
  p.v = v.data_ptr(); st(v, p.v_sb, p.v_sh, p.v_sr);
  p.o = o.data_ptr(); st(o, p.o_sb, p.o_sh, p.o_sr);
  p.dout = dout.data_ptr(); st(dout, p.do_sb, p.do_sh, p.do_sr);
  p.dq = dq.data_ptr(); st(dq, p.dq_sb, p.dq_sh, p.dq_sr);
  p.dk = dk.data_ptr(); st(dk, p.dk_sb, p.dk_sh, p.dk_sr);
  p.dv = dv.data_ptr(); st(dv, p.dv_sb, p.dv_sh, p.dv_sr);
  p.lse = lse.data_ptr<float>();
  p.delta = delta.data_ptr<float>();
  // the fused backward's fp32 sum (dK/dV variant 7; not re-zeroed between its timed launches)
  auto dq_accum = at::zeros({dq_accum_numel(p.B, p.Hq, p.q_len, p.d)}, q.options().dtype(at::kFloat));
  p.dq_accum = dq_accum.data_ptr<float>();
  void* stream = nullptr;  // legacy default stream, same as the events
  const double unit = fwd_flop / 2;  // FLOP of one (q,k) matmul pass over the visible pairs
  for (const char* var : {"1", "2", "3", "4", "5", "7", "8", "13"}) {
    setenv("DFLASH_ATTN_FWD_VARIANT", var, 1);
    const double ms = median_ms([&] { launch_attn_fwd(p, stream); }, iters);
    std::printf("[%s] fwd variant %s: %.2f ms, %.0f TFLOP/s (2 matmuls)\n", s.name.c_str(), var, ms,
                2 * unit / ms * 1e-9);
  }
  unsetenv("DFLASH_ATTN_FWD_VARIANT");
  const double dl = median_ms([&] { launch_attn_bwd_stage(p, 0, stream); }, iters);
  std::printf("[%s] bwd delta: %.3f ms\n", s.name.c_str(), dl);
  for (const char* var : {"1", "2", "3", "4", "7", "8"}) {
    setenv("DFLASH_ATTN_DQ_VARIANT", var, 1);
    const double ms = median_ms([&] { launch_attn_bwd_stage(p, 1, stream); }, iters);
    std::printf("[%s] bwd dQ variant %s: %.2f ms, %.0f TFLOP/s raw (3 matmuls)\n", s.name.c_str(), var,
                ms, 3 * unit / ms * 1e-9);
  }
  unsetenv("DFLASH_ATTN_DQ_VARIANT");
  for (const char* var : {"1", "2", "3", "7"}) {
    setenv("DFLASH_ATTN_DKV_VARIANT", var, 1);
    const bool fused = backward_accumulates_dq(p.d);  // 7: dK, dV and dQ in one pass, then dQ's conversion
    const double ms = median_ms([&] { launch_attn_bwd_stage(p, 2, stream); }, iters);
    std::printf("[%s] bwd dK/dV variant %s: %.2f ms, %.0f TFLOP/s raw (%s)\n", s.name.c_str(), var, ms,
                (fused ? 5 : 4) * unit / ms * 1e-9, fused ? "5 matmuls: dQ too, and its conversion" : "4 matmuls");
  }
  unsetenv("DFLASH_ATTN_DKV_VARIANT");
  std::fflush(stdout);
}

struct Row {
  std::string shape, impl;
  double fwd_ms, fb_ms, fwd_tf, fb_tf;
};

void write_spec(const std::string& path, const Shape& s, const MaskSpec& m) {
  std::ofstream f(path + ".tmp");
  f << s.B << " " << s.Hq << " " << s.Hkv << " " << s.N << " " << s.bs << " " << s.C << " " << s.d
    << "\n";
  for (auto* t : {&m.ctx_begin, &m.ctx_end}) {
    auto a = t->contiguous().view(-1);
    for (int64_t i = 0; i < a.numel(); ++i) f << a[i].item<int64_t>() << (i + 1 < a.numel() ? " " : "\n");
  }
  f.close();
  std::rename((path + ".tmp").c_str(), path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_dir, only;
  int iters = 10;
  bool run_sdpa = true, variants = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--out") && i + 1 < argc) out_dir = argv[++i];
    else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!std::strcmp(argv[i], "--no-sdpa")) run_sdpa = false;
    else if (!std::strcmp(argv[i], "--variants")) variants = true;
    else {
      std::fprintf(stderr, "usage: %s [--out DIR] [--iters N] [--only train|long] [--no-sdpa] [--variants]\n", argv[0]);
      return 2;
    }
  }
  if (!at::hasCUDA()) {
    std::printf("attention_bench: no CUDA device; nothing to measure\n");
    return 0;
  }
  const at::Device dev(at::kCUDA, 0);
  std::vector<Shape> shapes = {{"train", 4, 32, 8, 512, 16, 3072, 128},
                               {"long", 1, 32, 8, 2048, 16, 40000, 128}};
  std::vector<Row> rows;
  for (const Shape& s : shapes) {
    if (!only.empty() && only != s.name) continue;
    const MaskSpec spec = make_spec(s, 2026);
    if (!out_dir.empty()) write_spec(out_dir + "/spec_" + s.name + ".txt", s, spec);
    const double pairs = visible_pairs(spec) * s.Hq;
    const double fwd_flop = 4.0 * s.d * pairs, fb_flop = 3.5 * fwd_flop;
    auto opt = at::TensorOptions().device(dev).dtype(at::kBFloat16);
    const int64_t ql = (int64_t)s.N * s.bs, kl = s.C + ql;
    at::manual_seed(0);
    auto q = at::randn({s.B, s.Hq, ql, s.d}, opt), k = at::randn({s.B, s.Hkv, kl, s.d}, opt),
         v = at::randn({s.B, s.Hkv, kl, s.d}, opt), dout = at::randn({s.B, s.Hq, ql, s.d}, opt);

    Prepared prep;
    prep.spec = spec;
    prep.backend = Backend::Kernel;
    prep.kv_len = kl;
    const double meta_ms = median_ms([&] { prep.kernel_meta = kernel_prepare_meta(spec, dev); }, iters);
    auto qg = q.detach().requires_grad_(true), kg = k.detach().requires_grad_(true),
         vg = v.detach().requires_grad_(true);
    at::Tensor ko;
    const double kf = median_ms([&] { ko = std::get<0>(kernel_forward(q, k, v, prep)); }, iters);
    const double kfb = median_ms([&] {
      qg.mutable_grad() = at::Tensor();
      kg.mutable_grad() = at::Tensor();
      vg.mutable_grad() = at::Tensor();
      kernel_attend(qg, kg, vg, prep).backward(dout);
    }, iters);
    rows.push_back({s.name, "kernel", kf, kfb, fwd_flop / kf * 1e-9, fb_flop / kfb * 1e-9});
    std::printf("[%s] useful pairs %.4g, fwd %.3f TFLOP, fwd+bwd %.3f TFLOP; metadata build %.3f ms\n",
                s.name.c_str(), pairs, fwd_flop * 1e-12, fb_flop * 1e-12, meta_ms);
    std::fflush(stdout);
    if (variants) time_variants(s, prep, q, k, v, dout, fwd_flop, iters);

    if (run_sdpa) {
      const int64_t kv_pad = (kl + 127) / 128 * 128;
      auto mask = additive_mask(spec, kv_pad, dev);
      const int64_t G = s.Hq / s.Hkv;
      auto sdpa = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv) {
        auto ke = at::constant_pad_nd(kk.repeat_interleave(G, 1), {0, 0, 0, kv_pad - kl});
        auto ve = at::constant_pad_nd(vv.repeat_interleave(G, 1), {0, 0, 0, kv_pad - kl});
        return at::scaled_dot_product_attention(qq, ke, ve, mask);
      };
      at::Tensor so;
      const double sf = median_ms([&] { so = sdpa(q, k, v); }, std::max(3, iters / 2));
      auto qs = q.detach().requires_grad_(true), ks = k.detach().requires_grad_(true),
           vs = v.detach().requires_grad_(true);
      const double sfb = median_ms([&] {
        qs.mutable_grad() = at::Tensor();
        ks.mutable_grad() = at::Tensor();
        vs.mutable_grad() = at::Tensor();
        sdpa(qs, ks, vs).backward(dout);
      }, std::max(3, iters / 2));
      rows.push_back({s.name, "sdpa+mask", sf, sfb, fwd_flop / sf * 1e-9, fb_flop / sfb * 1e-9});
      auto rel = [](const at::Tensor& a, const at::Tensor& b) {
        return ((a.to(at::kFloat) - b.to(at::kFloat)).norm() / b.to(at::kFloat).norm()).item<double>();
      };
      std::printf("[%s] kernel vs sdpa+mask rel diff: O %.2e dQ %.2e dK %.2e dV %.2e; NaN in kernel: %d\n",
                  s.name.c_str(), rel(ko, so), rel(qg.grad(), qs.grad()), rel(kg.grad(), ks.grad()),
                  rel(vg.grad(), vs.grad()),
                  (int)(ko.isnan().any().item<bool>() || qg.grad().isnan().any().item<bool>() ||
                        kg.grad().isnan().any().item<bool>() || vg.grad().isnan().any().item<bool>()));
      std::fflush(stdout);
    }
  }
  if (!out_dir.empty()) {
    const std::string path = out_dir + "/kernel_results.tsv";
    std::ofstream f(path + ".tmp");
    for (const Row& r : rows)
      f << r.shape << "\t" << r.impl << "\t" << r.fwd_ms << "\t" << r.fb_ms << "\t" << r.fwd_tf << "\t"
        << r.fb_tf << "\n";
    f.close();
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
  std::printf("\n| shape | impl | fwd ms | fwd+bwd ms | fwd TFLOP/s | fwd+bwd TFLOP/s |\n|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %.2f | %.2f | %.0f | %.0f |\n", r.shape.c_str(), r.impl.c_str(), r.fwd_ms,
                r.fb_ms, r.fwd_tf, r.fb_tf);
  return 0;
}
#else
int main() {
  std::printf("attention_bench: built without the CUDA kernel; nothing to measure\n");
  return 0;
}
#endif
