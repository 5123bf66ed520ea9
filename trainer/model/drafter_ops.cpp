// trainer/model/drafter_ops.h and the RoPE / SwiGLU / q-k norm functions of drafter.h: the
// drafter's autograd Functions (each with a hand-written backward) and the fused kernels' glue.
#include "trainer/model/drafter_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#include "trainer/model/drafter.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "trainer/model/drafter_kernels.h"
#include "trainer/model/target_kernels_dtype.h"
#endif

namespace dflash::model {
namespace {

bool use_kernels(const at::Tensor& x, bool fused) {
#ifdef DFLASH_CUDA
  return fused && x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf);
#else
  (void)x, (void)fused;
  return false;
#endif
}

// x * cos + rotate_half(x) * sin. RoPE is linear in x, so the backward needs only the (shared)
// tables: dx = g * cos + rotate_half^T(g * sin), rotate_half^T(z) = [z2, -z1]. Nothing per layer
// is saved (the unfused form keeps x and rotate_half(x) of every layer).
at::Tensor rotate_half(const at::Tensor& x, bool transpose) {
  const int64_t half = x.size(-1) / 2;
  auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
  return transpose ? at::cat({x2, x1.neg()}, -1) : at::cat({x2.neg(), x1}, -1);
}

// x [B, L, heads, d], cos/sin [B, L, 1, d]: the kernel's rows are the B * L positions.
at::Tensor rope_kernel(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin, bool transpose) {
#ifdef DFLASH_CUDA
  auto x = x_in.contiguous();
  auto c = cos.contiguous(), s = sin.contiguous();
  DFLASH_CHECK(x.dim() == 4 && c.dim() == 4 && c.size(0) == x.size(0) && c.size(1) == x.size(1) &&
                   c.size(3) == x.size(3) && c.scalar_type() == x.scalar_type() && s.sizes() == c.sizes(),
               "drafter RoPE kernel: x [B, L, h, d] and cos/sin [B, L, 1, d] of x's dtype expected");
  auto y = at::empty_like(x);
  kernels::rope(x.data_ptr(), y.data_ptr(), x.size(0) * x.size(1), static_cast<int>(x.size(2)),
                static_cast<int>(x.size(3)), c.data_ptr(), s.data_ptr(), transpose, kernels::dtype_of(x),
                at::cuda::getCurrentCUDAStream());
  return y;
#else
  (void)cos, (void)sin, (void)transpose;
  return x_in;
#endif
}

struct Rope : public torch::autograd::Function<Rope> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin, bool fused) {
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["fused"] = fused;
    if (use_kernels(x, fused) && x.size(-1) <= 512) return rope_kernel(x, cos, sin, false);
    return x * cos + rotate_half(x, false) * sin;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1], &g = grads[0];
    if (use_kernels(g, ctx->saved_data["fused"].toBool()) && g.size(-1) <= 512)
      return {rope_kernel(g, cos, sin, true), at::Tensor(), at::Tensor(), at::Tensor()};
    return {g * cos + rotate_half(g * sin, true), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// RoPE(RMSNorm_w(x)) per head of 128 in one kernel each way (drafter_kernels.h), saving x, w, the
// tables and rstd; used where the kernels run and the shapes fit (norm_rope below).
struct HeadNormRope : public torch::autograd::Function<HeadNormRope> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x_in, const at::Tensor& w,
                            const at::Tensor& cos, const at::Tensor& sin, double eps) {
#ifdef DFLASH_CUDA
    auto x = x_in.contiguous();
    const int64_t R = x.size(0) * x.size(1);
    const int heads = static_cast<int>(x.size(2));
    auto y = at::empty_like(x);
    auto rstd = at::empty({R * heads}, x.options().dtype(at::kFloat));
    kernels::head_norm_rope_fwd(x.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), R, heads, w.data_ptr(),
                                static_cast<float>(eps), cos.data_ptr(), sin.data_ptr(), kernels::dtype_of(x),
                                at::cuda::getCurrentCUDAStream());
    ctx->save_for_backward({x, w, cos, sin, rstd});
    return y;
#else
    (void)ctx, (void)w, (void)cos, (void)sin, (void)eps;
    return x_in;
#endif
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
#ifdef DFLASH_CUDA
    auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &cos = saved[2], &sin = saved[3], &rstd = saved[4];
    auto gy = grads[0].contiguous();
    const int64_t R = x.size(0) * x.size(1);
    const int heads = static_cast<int>(x.size(2));
    auto dx = at::empty_like(x);
    auto partial = at::empty({kernels::head_norm_rope_bwd_blocks(R * heads), x.size(3)}, x.options().dtype(at::kFloat));
    kernels::head_norm_rope_bwd(x.data_ptr(), gy.data_ptr(), rstd.data_ptr<float>(), dx.data_ptr(),
                                partial.data_ptr<float>(), R, heads, w.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                kernels::dtype_of(x), at::cuda::getCurrentCUDAStream());
    return {dx, partial.sum(0).to(w.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor()};
#else
    (void)ctx, (void)grads;
    return {};
#endif
  }
};

// silu(g) * u, saving only g and u (the unfused form also keeps silu(g) for the backward).
struct SiluMul : public torch::autograd::Function<SiluMul> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u,
                            bool fused) {
    ctx->save_for_backward({g, u});
    ctx->saved_data["fused"] = fused;
#ifdef DFLASH_CUDA
    if (use_kernels(g, fused) && g.sizes() == u.sizes() && g.scalar_type() == u.scalar_type()) {
      auto gc = g.contiguous(), uc = u.contiguous();
      auto out = at::empty_like(gc);
      kernels::swiglu_fwd(gc.data_ptr(), uc.data_ptr(), out.data_ptr(), gc.numel(), kernels::dtype_of(gc),
                          at::cuda::getCurrentCUDAStream());
      return out;
    }
#endif
    return at::silu(g) * u;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &g = saved[0], &u = saved[1], &go = grads[0];
#ifdef DFLASH_CUDA
    if (use_kernels(g, ctx->saved_data["fused"].toBool()) && go.scalar_type() == g.scalar_type()) {
      auto gc = g.contiguous(), uc = u.contiguous(), oc = go.contiguous();
      auto dg = at::empty_like(gc), du = at::empty_like(uc);
      kernels::swiglu_bwd(gc.data_ptr(), uc.data_ptr(), oc.data_ptr(), dg.data_ptr(), du.data_ptr(), gc.numel(),
                          kernels::dtype_of(gc), at::cuda::getCurrentCUDAStream());
      return {dg, du, at::Tensor()};
    }
#endif
    auto sig = at::sigmoid(g);
    auto dsilu = sig * (1 + g * (1 - sig));  // d/dg [g sigmoid(g)]
    return {go * u * dsilu, go * (g * sig), at::Tensor()};
  }
};

// The two projections that read one input, x @ wa^T and x @ wb^T, whose backward writes
// dx = dya wa + dyb wb with the second GEMM accumulating into the first's output (beta 1): no
// separate pass adding two [rows, H] gradients, as autograd does for an input read by two linears.
// x [..., K] with unit column stride (rows of it contiguous), wa [Na, K], wb [Nb, K].
struct LinearPair : public torch::autograd::Function<LinearPair> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                                                const at::Tensor& wa, const at::Tensor& wb) {
    ctx->save_for_backward({x, wa, wb});
    return {at::linear(x, wa), at::linear(x, wb)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &wa = saved[1], &wb = saved[2];
    const int64_t K = x.size(-1);
    const at::Tensor x2 = x.reshape({-1, K});
    const at::Tensor ga = grads[0].defined() ? grads[0].reshape({-1, wa.size(0)}) : at::Tensor();
    const at::Tensor gb = grads[1].defined() ? grads[1].reshape({-1, wb.size(0)}) : at::Tensor();
    at::Tensor dx, dwa, dwb;
    if (ctx->needs_input_grad(0)) {
      if (ga.defined()) dx = at::mm(ga, wa);
      if (gb.defined()) dx = dx.defined() ? dx.addmm_(gb, wb) : at::mm(gb, wb);
      if (dx.defined()) dx = dx.view(x.sizes());
    }
    if (ctx->needs_input_grad(1) && ga.defined()) dwa = at::mm(ga.t(), x2);
    if (ctx->needs_input_grad(2) && gb.defined()) dwb = at::mm(gb.t(), x2);
    return {dx, dwa, dwb};
  }
};

// A layer's q, k and v: q = h wq^T from the block tokens h [B, Q, H], k and v from the context
// followed by h, kv_in = [ctx; h] [B, S + Q, H]. The backward accumulates every product that reads
// the same rows into one buffer d_kv [B, S + Q, H] = dk wk + dv wv, with dq wq added into its
// block rows (GEMMs with beta 1), and hands out views of it: d_ctx = d_kv[:, :S], d_h =
// d_kv[:, S:]. Autograd would run two more [rows, H] additions per layer (k's and v's input
// gradients, then h's from q and from the concatenation; the latter on strided halves).
struct AttnProjections : public torch::autograd::Function<AttnProjections> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& context,
                                                const at::Tensor& h, const at::Tensor& wq, const at::Tensor& wk,
                                                const at::Tensor& wv) {
    const at::Tensor kv_in = at::cat({context, h}, 1);  // context first, then the block tokens
    ctx->save_for_backward({h, kv_in, wq, wk, wv});
    ctx->saved_data["S"] = context.size(1);
    return {at::linear(h, wq), at::linear(kv_in, wk), at::linear(kv_in, wv)};
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &h = saved[0], &kv_in = saved[1], &wq = saved[2], &wk = saved[3], &wv = saved[4];
    const int64_t S = ctx->saved_data["S"].toInt(), B = h.size(0), Q = h.size(1), H = h.size(2);
    const int64_t L = S + Q;
    auto rows = [](const at::Tensor& g, int64_t n) { return g.reshape({-1, n}); };
    const at::Tensor dq = grads[0].defined() ? rows(grads[0], wq.size(0)) : at::zeros({B * Q, wq.size(0)}, h.options());
    const at::Tensor dk = grads[1].defined() ? rows(grads[1], wk.size(0)) : at::zeros({B * L, wk.size(0)}, h.options());
    const at::Tensor dv = grads[2].defined() ? rows(grads[2], wv.size(0)) : at::zeros({B * L, wv.size(0)}, h.options());
    at::Tensor d_ctx, d_h, dwq, dwk, dwv;
    if (ctx->needs_input_grad(0) || ctx->needs_input_grad(1)) {
      at::Tensor dkv = at::mm(dk, wk);  // [B * L, H]
      dkv.addmm_(dv, wv);
      at::Tensor dkv3 = dkv.view({B, L, H});
      // the block rows of each batch row are one [Q, H] matrix with row stride H: accumulate dq wq there
      const at::Tensor dq3 = dq.view({B, Q, wq.size(0)});
      for (int64_t b = 0; b < B; ++b) dkv3[b].narrow(0, S, Q).addmm_(dq3[b], wq);
      d_ctx = dkv3.narrow(1, 0, S);
      d_h = dkv3.narrow(1, S, Q);
    }
    const at::Tensor kv2 = kv_in.reshape({-1, H});
    if (ctx->needs_input_grad(2)) dwq = at::mm(dq.t(), h.reshape({-1, H}));
    if (ctx->needs_input_grad(3)) dwk = at::mm(dk.t(), kv2);
    if (ctx->needs_input_grad(4)) dwv = at::mm(dv.t(), kv2);
    return {d_ctx, d_h, dwq, dwk, dwv};
  }
};

// Rows `sel` (sorted, unique) of x [R, H]. The backward gathers where ATen's index_select
// backward runs index_add_ into zeros (1.2 ms per recipe-shape step on an H200, the gather
// ~0.25 ms): dx = [g; 0].index_select(0, inv), inv[r] = the position of row r in sel, or
// sel.size(0) (the zero row) for a row not selected. Exact copies either way.
struct SelectRows : public torch::autograd::Function<SelectRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& sel,
                            const at::Tensor& inv) {
    ctx->save_for_backward({inv});
    return x.index_select(0, sel);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor inv = ctx->get_saved_variables()[0];
    const at::Tensor& g = grads[0];
    const at::Tensor padded = at::cat({g, at::zeros({1, g.size(1)}, g.options())}, 0);
    return {padded.index_select(0, inv), at::Tensor(), at::Tensor()};
  }
};
}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool fused) {
  return Rope::apply(x, cos, sin, fused);
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u, bool fused) { return SiluMul::apply(g, u, fused); }

at::Tensor norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                     const at::Tensor& sin, bool fused) {
  auto aligned = [](const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; };
  if (use_kernels(x, fused) && x.dim() == 4 && x.size(3) == 128 && w.numel() == 128 &&
      w.scalar_type() == x.scalar_type() && cos.scalar_type() == x.scalar_type() && cos.is_contiguous() &&
      sin.is_contiguous() && w.is_contiguous() && cos.dim() == 4 && cos.size(0) == x.size(0) &&
      cos.size(1) == x.size(1) && cos.size(3) == 128 && sin.sizes() == cos.sizes() && aligned(cos) && aligned(sin) &&
      aligned(w) && (!x.is_contiguous() || aligned(x)))
    return HeadNormRope::apply(x, w, cos, sin, eps);
  return apply_rope(at::rms_norm(x, {x.size(-1)}, w, eps), cos, sin, fused);
}

at::Tensor select_rows(const at::Tensor& x, const at::Tensor& sel, const at::Tensor& inv) {
  return SelectRows::apply(x, sel, inv);
}

std::vector<at::Tensor> attn_projections(const at::Tensor& context, const at::Tensor& h, const at::Tensor& wq,
                                         const at::Tensor& wk, const at::Tensor& wv) {
  return AttnProjections::apply(context, h, wq, wk, wv);
}

std::vector<at::Tensor> linear_pair(const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb) {
  return LinearPair::apply(x, wa, wb);
}

}  // namespace dflash::model
