// Gated DeltaNet (see target_deltanet.h).
#include "trainer/model/target_deltanet.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "trainer/model/target_kernels_dtype.h"
#endif

namespace dflash::model {

namespace {

at::Tensor l2norm(const at::Tensor& x) {  // float32, over the last dim, eps 1e-6 (as FLA)
  return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6);
}

// q, k [N, nk, dk], v [N, nv, dv] in the model dtype -> float32, normalised, q scaled, q and k
// expanded to nv heads.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prepare_qkv(const at::Tensor& qkv, const DeltaNetSpec& s) {
  const int64_t N = qkv.size(0), kd = s.nk * s.dk;
  at::Tensor q = l2norm(qkv.narrow(1, 0, kd).reshape({N, s.nk, s.dk}).to(at::kFloat));
  at::Tensor k = l2norm(qkv.narrow(1, kd, kd).reshape({N, s.nk, s.dk}).to(at::kFloat));
  at::Tensor v = qkv.narrow(1, 2 * kd, s.value_dim()).reshape({N, s.nv, s.dv}).to(at::kFloat);
  q = q * (1.0 / std::sqrt(double(s.dk)));
  if (s.nv != s.nk) {
    q = q.repeat_interleave(s.nv / s.nk, 1);
    k = k.repeat_interleave(s.nv / s.nk, 1);
  }
  return {q, k, v};
}

// beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias), float32, [N, nv].
std::pair<at::Tensor, at::Tensor> gates(const at::Tensor& proj, const DeltaNetWeights& w, const DeltaNetSpec& s) {
  const int64_t off = s.conv_dim() + s.value_dim();
  at::Tensor b = proj.narrow(1, off, s.nv), a = proj.narrow(1, off + s.nv, s.nv);
  at::Tensor beta = at::sigmoid(b).to(at::kFloat);
  at::Tensor g = -at::exp(w.A_log) * at::softplus(a.to(at::kFloat) + w.dt_bias);
  return {beta, g};
}

// Gated RMSNorm over dv and out_proj: o [N, nv, dv] (model dtype), z from proj.
// The gated RMSNorm alone: o [N, nv, dv] (model dtype) -> [N, value_dim].
at::Tensor gated_norm(const at::Tensor& o, const at::Tensor& proj, const DeltaNetWeights& w, const DeltaNetSpec& s) {
  const int64_t N = o.size(0);
  at::Tensor z = proj.narrow(1, s.conv_dim(), s.value_dim()).reshape({N, s.nv, s.dv});
  at::Tensor of = o.to(at::kFloat);
  at::Tensor n = (of * at::rsqrt(of.pow(2).mean(-1, true) + s.eps)).to(o.scalar_type());
  at::Tensor y = ((w.norm * n).to(at::kFloat) * at::silu(z.to(at::kFloat))).to(o.scalar_type());
  return y.reshape({N, s.value_dim()});
}

at::Tensor gated_out(const at::Tensor& o, const at::Tensor& proj, const DeltaNetWeights& w,
                     const DeltaNetSpec& s) {
  return at::mm(gated_norm(o, proj, w, s), w.w_out.t());
}

// An environment knob read on first use, as the index of its value in `choices` (the first is the
// default), which a benchmark or test may set at run time.
struct EnvKnob {
  const char* env;
  std::vector<std::string> choices;
  std::atomic<int> v{-1};  // -1: not read yet
  int get() {
    int x = v.load();
    if (x < 0) {
      const std::string c = env_choice(env, choices.front().c_str(), choices);
      x = int(std::find(choices.begin(), choices.end(), c) - choices.begin());
      v.store(x);
    }
    return x;
  }
  void set(int x) { v.store(x); }
};
// "auto" (index 0, the default) picks by device; then the order of g_rule's choices is DeltaNetRule's.
EnvKnob g_rule{kDeltaNetSolveEnv, {"auto", "inverse", "trsm", "recurrent"}};
EnvKnob g_tf32{kDeltaNetTf32Env, {"0", "1"}}, g_fused{kDeltaNetFusedEnv, {"auto", "0", "1"}};

std::atomic<DeltaNetSectionHook> g_hook{nullptr};

void section(const char* name) {
  if (DeltaNetSectionHook h = g_hook.load(std::memory_order_relaxed)) h(name);
}

int64_t chunk_size() {
  static const int64_t c = std::stoi(env_choice(kDeltaNetChunkEnv, "64", {"16", "32", "64", "128"}));
  return c;
}

}  // namespace

DeltaNetRule deltanet_rule(const at::Device& device) {
  const int x = g_rule.get();
  if (x == 0) return device.is_cuda() ? DeltaNetRule::Recurrent : DeltaNetRule::Inverse;
  return DeltaNetRule(x - 1);
}
void set_deltanet_rule(DeltaNetRule rule) { g_rule.set(1 + int(rule)); }
bool deltanet_tf32() { return g_tf32.get() == 1; }
void set_deltanet_tf32(bool on) { g_tf32.set(on); }
bool deltanet_fused(const at::Device& device) {
  const int x = g_fused.get();
  return x == 0 ? device.is_cuda() : x == 2;
}
void set_deltanet_fused(bool on) { g_fused.set(on ? 2 : 1); }
void reset_deltanet_knobs() { g_rule.set(-1), g_fused.set(-1), g_tf32.set(-1); }
void set_deltanet_section_hook(DeltaNetSectionHook hook) { g_hook.store(hook); }

at::Tensor unit_lower_inverse(const at::Tensor& t_in) {
  const int64_t n = t_in.size(-1);
  int64_t p = 1;
  while (p < n) p *= 2;
  std::vector<int64_t> shape(t_in.sizes().begin(), t_in.sizes().end());
  at::Tensor t = t_in.reshape({-1, n, n});
  const int64_t bt = t.size(0);
  if (p != n) {  // [T 0; 0 I] has the inverse [T^-1 0; 0 I]: pad, invert, cut
    at::Tensor tp = at::zeros({bt, p, p}, t.options());
    tp.narrow(1, 0, n).narrow(2, 0, n).copy_(t);
    t = tp;
  } else {
    t = t.contiguous();
  }
  // Bottom-up over block sizes b = 1, 2, 4, ...: the diagonal b-blocks of m are inverted (b = 1:
  // the unit diagonal); each pair of them closes into a 2b-block by
  //   [A 0; C D]^-1 = [A^-1 0; -D^-1 C A^-1  D^-1]
  // with C the strictly lower block of t, all pairs of a level as one batched product.
  at::Tensor m = at::eye(p, t.options()).expand({bt, p, p}).contiguous();
  for (int64_t b = 1; b < p; b *= 2) {
    const int64_t nb = p / (2 * b);
    auto blocks = [&](const at::Tensor& x) {  // the diagonal 2b-blocks, a view [bt, nb, 2b, 2b]
      return x.view({bt, nb, 2 * b, nb, 2 * b}).diagonal(0, 1, 3).permute({0, 3, 1, 2});
    };
    at::Tensor tb = blocks(t), mb = blocks(m);
    at::Tensor a_inv = mb.narrow(2, 0, b).narrow(3, 0, b);
    at::Tensor d_inv = mb.narrow(2, b, b).narrow(3, b, b);
    at::Tensor c = tb.narrow(2, b, b).narrow(3, 0, b);
    mb.narrow(2, b, b).narrow(3, 0, b).copy_(at::matmul(d_inv, at::matmul(c, a_inv)).neg_());
  }
  if (p != n) m = m.narrow(1, 0, n).narrow(2, 0, n);
  return m.reshape(shape);
}

namespace {

// The rule on heads-first, padded inputs: q, k [B, nv, Lp, dk], v [B, nv, Lp, dv], g, beta
// [B, nv, Lp], float32 contiguous, Lp a multiple of C, padded positions k = v = g = beta = 0.
// Returns o [B, nv, Lp, dv] (contiguous) and the final state [B, nv, dk, dv].
std::pair<at::Tensor, at::Tensor> chunked_heads_first(at::Tensor q, at::Tensor k, const at::Tensor& v,
                                                      const at::Tensor& g, const at::Tensor& beta, int64_t C,
                                                      const at::Tensor& initial) {
  // float32 products on TF32 tensor cores on CUDA (see set_deltanet_tf32), restored on return
  struct Tf32Scope {
    bool set = false;
    at::Float32Precision before = at::Float32Precision::NONE;
    explicit Tf32Scope(bool on) {
      if (!on) return;
      auto& ctx = at::globalContext();
      before = ctx.float32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL);
      ctx.setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, at::Float32Precision::TF32);
      set = true;
    }
    ~Tf32Scope() {
      if (set) at::globalContext().setFloat32Precision(at::Float32Backend::CUDA, at::Float32Op::MATMUL, before);
    }
  } tf32(q.is_cuda() && deltanet_tf32());
  const int64_t B = q.size(0), nv = q.size(1), Lp = q.size(2), dk = q.size(3), dv = v.size(3);
  const int64_t N = Lp / C;
  section("chunk_intra");
  at::Tensor k_beta = (k * beta.unsqueeze(-1)).view({B, nv, N, C, dk});
  at::Tensor v_beta = (v * beta.unsqueeze(-1)).view({B, nv, N, C, dv});
  q = q.view({B, nv, N, C, dk});
  k = k.view({B, nv, N, C, dk});
  at::Tensor cum = g.view({B, nv, N, C}).cumsum(-1);
  at::Tensor upper = at::ones({C, C}, q.options().dtype(at::kBool)).triu(1);
  // decay[i, j] = exp(cum_i - cum_j) for j <= i (the decay from token j to token i), 0 above.
  at::Tensor decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2))
                         .masked_fill(upper, -std::numeric_limits<float>::infinity())
                         .exp();
  at::Tensor ut = at::matmul(k_beta, k.transpose(-1, -2)) * decay;
  at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * decay;
  at::Tensor ecum = cum.exp().unsqueeze(-1);
  // (I + strictly_lower(ut))^-1 applied to beta v and to the decayed beta k (the UT transform).
  section("chunk_inverse");
  at::Tensor u, w;
  if (deltanet_rule(q.device()) == DeltaNetRule::Trsm) {
    u = at::linalg_solve_triangular(ut, v_beta, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
    w = at::linalg_solve_triangular(ut, k_beta * ecum, false, true, true);
  } else {  // one inverse for both right-hand sides: batched small trsm is slow on CUDA
    at::Tensor inv = unit_lower_inverse(ut);
    u = at::matmul(inv, v_beta);
    w = at::matmul(inv, k_beta * ecum);
  }
  section("chunk_intra");
  at::Tensor last = cum.narrow(-1, C - 1, 1);  // [B, nv, N, 1]
  at::Tensor qd = q * ecum;
  at::Tensor kd = k * (last - cum).exp().unsqueeze(-1);
  at::Tensor chunk_decay = last.exp().unsqueeze(-1);  // [B, nv, N, 1, 1]
  // The sequential part: per chunk only the state update, vn_i = u_i - w_i S_i and
  // S_{i+1} = exp(last_i) S_i + kd_i^T vn_i (one baddbmm each); the states S_i and the vn_i are
  // kept, and every chunk's output o_i = qd_i S_i + intra_i vn_i is two batched products after the loop.
  const int64_t BH = B * nv;
  section("chunk_loop");
  at::Tensor S = initial.defined() ? initial.to(q.scalar_type()).reshape({BH, dk, dv}).clone()
                                   : at::zeros({BH, dk, dv}, q.options());
  at::Tensor states = at::empty({B, nv, N, dk, dv}, q.options());
  at::Tensor vns = at::empty({B, nv, N, C, dv}, q.options());
  at::Tensor decay_bh = chunk_decay.reshape({BH, N, 1, 1});
  for (int64_t i = 0; i < N; ++i) {
    states.select(2, i).copy_(S.view({B, nv, dk, dv}));
    at::Tensor vn = at::baddbmm(u.select(2, i).reshape({BH, C, dv}), w.select(2, i).reshape({BH, C, dk}), S,
                                /*beta=*/1, /*alpha=*/-1);
    vns.select(2, i).copy_(vn.view({B, nv, C, dv}));
    S = at::baddbmm(S * decay_bh.select(1, i), kd.select(2, i).reshape({BH, C, dk}).transpose(1, 2), vn);
  }
  section("chunk_out");
  at::Tensor out = at::matmul(qd, states).add_(at::matmul(intra, vns));  // [B, nv, N, C, dv]
  S = S.view({B, nv, dk, dv});
  return {out.view({B, nv, Lp, dv}), S};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> gated_delta_rule_chunked(const at::Tensor& q_in, const at::Tensor& k_in,
                                                           const at::Tensor& v_in, const at::Tensor& g_in,
                                                           const at::Tensor& beta_in, int64_t C,
                                                           const at::Tensor& initial) {
  const int64_t L = q_in.size(1), pad = (C - L % C) % C;
  auto heads_first = [&](const at::Tensor& t) {  // [B, L, nv, ...] -> [B, nv, Lp, ...] padded
    at::Tensor x = t.transpose(1, 2);
    if (pad) {
      std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
      shape[2] = pad;
      x = at::cat({x, at::zeros(shape, x.options())}, 2);
    }
    return x.contiguous();
  };
  auto [o, S] = chunked_heads_first(heads_first(q_in), heads_first(k_in), heads_first(v_in), heads_first(g_in),
                                    heads_first(beta_in), C, initial);
  return {o.narrow(2, 0, L).transpose(1, 2), S};  // [B, L, nv, dv]
}

std::pair<at::Tensor, at::Tensor> gated_delta_rule_recurrent(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& g,
                                                             const at::Tensor& beta, const at::Tensor& lens,
                                                             const at::Tensor& initial) {
  const int64_t D = q.size(0), nv = q.size(1), Lp = q.size(2), dk = q.size(3), dv = v.size(3);
  DFLASH_CHECK(q.dim() == 4 && k.sizes() == q.sizes() && v.dim() == 4 && v.size(0) == D && v.size(1) == nv &&
                   v.size(2) == Lp && g.sizes() == at::IntArrayRef({D, nv, Lp}) && beta.sizes() == g.sizes() &&
                   lens.numel() == D,
               "gated_delta_rule_recurrent: q, k [D, nv, Lp, dk], v [D, nv, Lp, dv], g, beta [D, nv, Lp], lens [D]");
  DFLASH_CHECK(!initial.defined() || initial.sizes() == at::IntArrayRef({D, nv, dk, dv}),
               "gated_delta_rule_recurrent: initial must be [D, nv, dk, dv]");
#ifdef DFLASH_CUDA
  if (q.is_cuda()) {
    DFLASH_CHECK(dk <= 256, "gated_delta_rule_recurrent: dk {} > 256", dk);
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
    at::Tensor qc = f32(q), kc = f32(k), vc = f32(v), gc = f32(g), bc = f32(beta);
    at::Tensor lc = lens.to(at::kLong).contiguous();
    at::Tensor init = initial.defined() ? f32(initial) : at::Tensor();
    at::Tensor o = at::empty({D, nv, Lp, dv}, qc.options());
    at::Tensor fin = at::empty({D, nv, dk, dv}, qc.options());
    kernels::deltanet_recurrent(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), gc.data_ptr<float>(),
                                bc.data_ptr<float>(), lc.data_ptr<int64_t>(), D, int(nv), Lp, int(dk), int(dv),
                                init.defined() ? init.data_ptr<float>() : nullptr, o.data_ptr<float>(),
                                fin.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    return {o, fin};
  }
#endif
  // One position at a time for all documents and heads; a document past its end keeps its state.
  const auto opt = q.options();
  at::Tensor S = initial.defined() ? initial.to(q.scalar_type()).clone() : at::zeros({D, nv, dk, dv}, opt);
  at::Tensor o = at::zeros({D, nv, Lp, dv}, opt);
  at::Tensor valid = at::arange(Lp, lens.options()).unsqueeze(0).lt(lens.unsqueeze(1)).to(q.scalar_type());
  const int64_t steps = D ? std::min<int64_t>(Lp, lens.max().item<int64_t>()) : 0;
  for (int64_t p = 0; p < steps; ++p) {
    at::Tensor m = valid.select(1, p).view({D, 1, 1});                           // [D, 1, 1]
    at::Tensor gt = at::exp(g.select(2, p)).unsqueeze(-1) * m + (1 - m);          // [D, nv, 1]
    at::Tensor kt = k.select(2, p), qt = q.select(2, p), vt = v.select(2, p);     // [D, nv, d]
    at::Tensor kv = at::matmul(kt.unsqueeze(-2), S).squeeze(-2) * gt;             // (g S)^T k [D, nv, dv]
    at::Tensor u = beta.select(2, p).unsqueeze(-1) * m * (vt - kv);
    S = S * gt.unsqueeze(-1) + kt.unsqueeze(-1) * u.unsqueeze(-2);
    o.select(2, p).copy_(at::matmul(qt.unsqueeze(-2), S).squeeze(-2) * m);
  }
  return {o, S};
}

namespace {

// The grid slots of a packed batch on the device: dest[t] = d * Lmax + p (the documents' grid),
// conv_dest[t] the slot in the conv's grid with K - 1 leading rows, slots[t] = d * Lp + p (the
// rule's grid, Lmax padded to a multiple of the chunk), lens[d]. Every linear layer of one forward
// has the same documents: the last index is kept per thread and reused, so the host builds and
// uploads it once per forward, not once per layer (a blocking upload also waits for the stream),
// and the upload is from pinned memory, without a stream sync.
struct GridIndex {
  std::vector<int64_t> cu;
  int64_t K = 0, Lmax = 0, C = 0, Lp = 0;  // C: the chunk, Lp: Lmax rounded up to it
  c10::Device device = c10::Device(c10::kCPU);
  at::Tensor dest, conv_dest, slots, lens;
};

const GridIndex& grid_index(const std::vector<int64_t>& cu, int64_t K, const c10::Device& device) {
  thread_local GridIndex last;
  if (last.dest.defined() && last.cu == cu && last.K == K && last.device == device) return last;
  const int64_t D = int64_t(cu.size()) - 1, T = cu.back();
  int64_t Lmax = 0;
  for (int64_t d = 0; d < D; ++d) Lmax = std::max(Lmax, cu[d + 1] - cu[d]);
  const int64_t C = std::min<int64_t>(chunk_size(), Lmax), Lp = C > 0 ? (Lmax + C - 1) / C * C : 0;
  at::Tensor host = at::empty({3 * T + D}, at::kLong);
  int64_t* dest = host.data_ptr<int64_t>();
  int64_t* conv_dest = dest + T;
  int64_t* slots = dest + 2 * T;
  int64_t* lens = dest + 3 * T;
  for (int64_t d = 0; d < D; ++d) {
    lens[d] = cu[d + 1] - cu[d];
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) {
      dest[t] = d * Lmax + (t - cu[d]);
      conv_dest[t] = d * (Lmax + K - 1) + (K - 1) + (t - cu[d]);
      slots[t] = d * Lp + (t - cu[d]);
    }
  }
  at::Tensor dev = device.is_cuda() ? host.pin_memory().to(device, /*non_blocking=*/true) : host;
  last = GridIndex{cu, K, Lmax, C, Lp, device, dev.narrow(0, 0, T), dev.narrow(0, T, T), dev.narrow(0, 2 * T, T),
                   dev.narrow(0, 3 * T, D)};
  return last;
}

// The state a cache keeps of each document's row: the final recurrent state, and the last K - 1
// conv inputs ext[d, n_d .. n_d + K - 2].
void save_state(DeltaNetState& state, const at::Tensor& rows, const at::Tensor& S, const at::Tensor& ext,
                const std::vector<int64_t>& cu, int64_t K) {
  const int64_t D = int64_t(cu.size()) - 1;
  state.rec.index_copy_(0, rows, S);
  at::Tensor win = at::empty({D, K - 1, ext.size(2)}, ext.options());
  for (int64_t d = 0; d < D; ++d) win[d].copy_(ext[d].narrow(0, cu[d + 1] - cu[d], K - 1));
  state.conv.index_copy_(0, rows, win.transpose(1, 2).to(state.conv.scalar_type()));
}

// deltanet_qkv_grid (target_kernels.h): the CUDA kernel, or on CPU the same arithmetic in ATen
// (so the fused path's glue is tested without a GPU: tests/model/test_deltanet_gpu).
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_grid(const at::Tensor& conv, const at::Tensor& lens_t,
                                                        int64_t Lp, const DeltaNetSpec& s) {
  const int64_t D = conv.size(0), Lmax = conv.size(2);
  const double scale = 1.0 / std::sqrt(double(s.dk));
  auto f32 = conv.options().dtype(at::kFloat);
  at::Tensor q = at::empty({D, s.nv, Lp, s.dk}, f32), k = at::empty({D, s.nv, Lp, s.dk}, f32);
  at::Tensor v = at::empty({D, s.nv, Lp, s.dv}, f32);
#ifdef DFLASH_CUDA
  if (conv.is_cuda()) {
    kernels::deltanet_qkv_grid(conv.data_ptr(), D, s.conv_dim(), Lmax, Lp, lens_t.data_ptr<int64_t>(), int(s.nk),
                               int(s.nv), int(s.dk), int(s.dv), float(scale), q.data_ptr<float>(),
                               k.data_ptr<float>(), v.data_ptr<float>(), kernels::dtype_of(conv), at::cuda::getCurrentCUDAStream());
    return {q, k, v};
  }
#endif
  at::Tensor x = at::silu(conv).to(at::kFloat);  // rounded to the model dtype first, as the kernel
  at::Tensor valid = at::arange(Lp, lens_t.options()).unsqueeze(0).lt(lens_t.unsqueeze(1));  // [D, Lp]
  auto heads = [&](int64_t c0, int64_t n, int64_t hd) {  // [D, n, Lp, hd], zeros past each document
    at::Tensor t = x.narrow(1, c0, n * hd).view({D, n, hd, Lmax}).transpose(2, 3);
    t = at::constant_pad_nd(t, {0, 0, 0, Lp - Lmax});
    return t * valid.view({D, 1, Lp, 1}).to(at::kFloat);
  };
  const int64_t kd = s.nk * s.dk, ratio = s.nv / s.nk;
  at::Tensor qh = heads(0, s.nk, s.dk), kh = heads(kd, s.nk, s.dk);
  qh = qh * at::rsqrt((qh * qh).sum(-1, true) + 1e-6) * scale;
  kh = kh * at::rsqrt((kh * kh).sum(-1, true) + 1e-6);
  q.copy_(qh.repeat_interleave(ratio, 1));
  k.copy_(kh.repeat_interleave(ratio, 1));
  v.copy_(heads(2 * kd, s.nv, s.dv));
  return {q, k, v};
}

// deltanet_gated_out (target_kernels.h): the CUDA kernel, or on CPU the same in ATen.
at::Tensor gated_out_grid(const at::Tensor& o, const GridIndex& gi, const at::Tensor& proj, const DeltaNetWeights& w,
                          const DeltaNetSpec& s, const at::ScalarType dtype) {
  const int64_t T = gi.dest.size(0);
  at::Tensor wn = w.norm.to(dtype).contiguous();
#ifdef DFLASH_CUDA
  if (o.is_cuda()) {
    at::Tensor y = at::empty({T, s.value_dim()}, proj.options());
    at::Tensor z = proj.narrow(1, s.conv_dim(), s.value_dim());
    kernels::deltanet_gated_out(o.data_ptr<float>(), gi.dest.data_ptr<int64_t>(), T, int(s.nv), int(s.dv), gi.Lp,
                                gi.Lmax, z.data_ptr(), proj.stride(0), wn.data_ptr(), float(s.eps), y.data_ptr(),
                                kernels::dtype_of(proj), at::cuda::getCurrentCUDAStream());
    return y;
  }
#endif
  at::Tensor rows = o.permute({0, 2, 1, 3}).reshape({o.size(0) * gi.Lp, s.nv, s.dv}).index_select(0, gi.slots);
  DeltaNetWeights wd = w;
  wd.norm = wn;
  return gated_norm(rows.to(dtype), proj, wd, s);
}

// The rule as deltanet_rule(device) says, on heads-first grids [D, nv, Lp, ...] (Lp = gi.Lp, zeros past
// each document): -> o [D, nv, Lp, dv] and the final states.
std::pair<at::Tensor, at::Tensor> rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& g, const at::Tensor& beta, const GridIndex& gi,
                                       const at::Tensor& S0) {
  if (deltanet_rule(q.device()) != DeltaNetRule::Recurrent) return chunked_heads_first(q, k, v, g, beta, gi.C, S0);
  section("rule");
  return gated_delta_rule_recurrent(q, k, v, g, beta, gi.lens, S0);
}

// After the conv (DFLASH_TARGET_DELTANET_FUSED=1): one kernel from the conv output to q, k, v
// in the rule's heads-first padded grid (SiLU, L2 norms, scale, head expansion, zeros past each
// document), the rule, and one kernel from its output grid to the gated norm of each token (the
// un-grid, the rounding to the model dtype, RMSNorm, weight, SiLU(z)); the same arithmetic as
// the ATen path, without its ~30 passes over [T, nv, d] float32 tensors.
at::Tensor fused_rest(const at::Tensor& x, const std::vector<int64_t>& cu, const DeltaNetWeights& w,
                      const DeltaNetSpec& s, DeltaNetState* state, const at::Tensor& rows, const at::Tensor& proj,
                      const at::Tensor& ext, const at::Tensor& conv, const GridIndex& gi) {
  const int64_t D = int64_t(cu.size()) - 1;
  section("qkv_gates");
  auto [q, k, v] = qkv_grid(conv, gi.lens, gi.Lp, s);
  auto [beta, g] = gates(proj, w, s);  // [T, nv] float32
  section("to_grid");
  auto grid_hf = [&](const at::Tensor& t) {  // [T, nv] -> [D, nv, Lp], zeros past each document
    at::Tensor grid = at::zeros({D * gi.Lp, s.nv}, t.options());
    grid.index_copy_(0, gi.slots, t);
    return grid.view({D, gi.Lp, s.nv}).transpose(1, 2).contiguous();
  };
  at::Tensor S0 = state ? state->rec.index_select(0, rows) : at::Tensor();
  auto [o, S] = rule(q, k, v, grid_hf(g), grid_hf(beta), gi, S0);
  section("out");
  if (state) save_state(*state, rows, S, ext, cu, s.kernel);
  at::Tensor out = at::mm(gated_out_grid(o, gi, proj, w, s, x.scalar_type()), w.w_out.t());
  section(nullptr);
  return out;
}

}  // namespace

at::Tensor deltanet_forward(const at::Tensor& x, const std::vector<int64_t>& cu, const DeltaNetWeights& w,
                            const DeltaNetSpec& s, DeltaNetState* state, const at::Tensor& rows_in) {
  const int64_t Cd = s.conv_dim(), K = s.kernel;
  const int64_t D = int64_t(cu.size()) - 1;
  section("in_proj");
  at::Tensor proj = at::mm(x, w.w_in.t());
  at::Tensor mixed = proj.narrow(1, 0, Cd);
  at::Tensor rows = rows_in.defined() ? rows_in : at::arange(D, at::TensorOptions().dtype(at::kLong).device(x.device()));

  // Documents as rows of a zero-padded grid [D, Lmax, ...]: dest[t] = d * Lmax + (t - cu[d]).
  const GridIndex& gi = grid_index(cu, K, x.device());
  const int64_t Lmax = gi.Lmax;
  const at::Tensor dest_t = gi.dest, conv_dest_t = gi.conv_dest;
  auto to_grid = [&](const at::Tensor& t) {
    std::vector<int64_t> shape = {D * Lmax};
    shape.insert(shape.end(), t.sizes().begin() + 1, t.sizes().end());
    at::Tensor grid = at::zeros(shape, t.options());
    grid.index_copy_(0, dest_t, t);
    shape[0] = Lmax;
    shape.insert(shape.begin(), D);
    return grid.view(shape);
  };

  // Causal depthwise conv per document over [its K - 1 previous inputs (zeros for a new
  // document, the cached window otherwise) ; its tokens]: out[i] = sum_j conv[:, j] ext[i + j].
  // One grouped (depthwise) at::conv1d in the model dtype (cuDNN on CUDA, float32 accumulation;
  // transformers' torch path does the same), a cross-correlation: out[i] = sum_j w[:, j] ext[i + j].
  section("conv");
  at::Tensor ext = at::zeros({D * (Lmax + K - 1), Cd}, x.options());
  ext.index_copy_(0, conv_dest_t, mixed);
  ext = ext.view({D, Lmax + K - 1, Cd});
  if (state) ext.narrow(1, 0, K - 1).copy_(state->conv.index_select(0, rows).transpose(1, 2));
  const int64_t one = 1, zero = 0;
  at::Tensor conv = at::conv1d(ext.transpose(1, 2), w.conv.to(x.scalar_type()).unsqueeze(1), std::nullopt,
                               /*stride=*/at::IntArrayRef(one), /*padding=*/at::IntArrayRef(zero),
                               /*dilation=*/at::IntArrayRef(one), /*groups=*/Cd);  // [D, Cd, Lmax]
  if (deltanet_fused(x.device()) && s.dk <= 256 && s.dv <= 256 && s.nv % s.nk == 0)
    return fused_rest(x, cu, w, s, state, rows, proj, ext, conv.contiguous(), gi);
  at::Tensor conv_out = at::silu(conv).transpose(1, 2).reshape({D * Lmax, Cd}).index_select(0, dest_t);
  section("qkv_gates");
  auto [q, k, v] = prepare_qkv(conv_out, s);
  auto [beta, g] = gates(proj, w, s);

  at::Tensor S0 = state ? state->rec.index_select(0, rows) : at::Tensor();
  section("to_grid");
  at::Tensor qg = to_grid(q), kg = to_grid(k), vg = to_grid(v), gg = to_grid(g), bg = to_grid(beta);
  // [D, Lmax, nv, ...] -> heads first, padded to the rule's grid [D, nv, Lp, ...]
  auto hf = [&](const at::Tensor& t) {
    at::Tensor h = t.transpose(1, 2);
    std::vector<int64_t> pad(2 * (h.dim() - 2), 0);
    pad.back() = gi.Lp - Lmax;  // (constant_pad_nd pads the last dims first)
    return at::constant_pad_nd(h, pad).contiguous();
  };
  auto [o_grid, S] = rule(hf(qg), hf(kg), hf(vg), hf(gg), hf(bg), gi, S0);
  section("out");
  at::Tensor o = o_grid.narrow(2, 0, Lmax).transpose(1, 2).reshape({D * Lmax, s.nv, s.dv}).index_select(0, dest_t)
                     .to(x.scalar_type());

  if (state) save_state(*state, rows, S, ext, cu, K);
  at::Tensor y = gated_out(o, proj, w, s);
  section(nullptr);
  return y;
}

}  // namespace dflash::model
