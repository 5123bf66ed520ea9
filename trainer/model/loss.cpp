// trainer/model/loss.h: fused chunked LM head + cross-entropy, and the block metrics.
#include "trainer/model/loss.h"

#include <atomic>
#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "trainer/model/ce_kernels.h"
#include "trainer/model/target_kernels_dtype.h"
#endif

namespace dflash::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// One chunk: fp32 logits of rows [c0, c0+n), then (in place) exp(logit - max).
struct ChunkStats {
  at::Tensor expd;  // [n, V] float32: exp(logits - max)
  at::Tensor lse;   // [n]
  at::Tensor ce;    // [n]
  at::Tensor argmax;
  at::Tensor scale;
};

// fp32 logits h @ W^T: on CUDA straight from the bf16 GEMM (mm.dtype, fp32 output), otherwise
// by a conversion of the product.
at::Tensor logits_fp32(const at::Tensor& h, const at::Tensor& weight) {
  if (h.scalar_type() == at::kFloat) return at::mm(h, weight.t());
  static std::atomic<bool> mm_dtype_ok{true};
  if (h.is_cuda() && mm_dtype_ok) {
    try {
      return at::mm(h, weight.t(), at::kFloat);
    } catch (const c10::Error&) {
      mm_dtype_ok = false;  // not supported for this dtype/build: convert instead
    }
  }
  return at::mm(h, weight.t()).to(at::kFloat);
}

ChunkStats chunk_stats(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& lab) {
  auto lf = logits_fp32(h, weight);
  ChunkStats s;
  auto tgt = lf.gather(1, lab.unsqueeze(1)).squeeze(1);
  auto [mx, am] = lf.max(1);
  lf.sub_(mx.unsqueeze(1)).exp_();
  s.lse = lf.sum(1).log_().add_(mx);
  s.ce = s.lse - tgt;
  s.argmax = am;
  s.expd = lf;
  s.scale = at::exp(mx - s.lse);  // softmax = expd * scale[:, None]
  return s;
}

// In place: p <- p * row_scale[:, None] - onehot(label) * coef[:, None] (one pass over p; with
// p = exp(logits - max) and row_scale = coef / sum, this is (softmax - onehot) * coef); returns
// p @ W in W's dtype.
at::Tensor grad_from_probs(at::Tensor& p, const at::Tensor& lab, const at::Tensor& row_scale, const at::Tensor& coef,
                           const at::Tensor& weight) {
  p.mul_(row_scale.unsqueeze(1));
  p.scatter_add_(1, lab.unsqueeze(1), coef.neg().unsqueeze(1).to(p.scalar_type()));
  return at::mm(p.to(weight.scalar_type()), weight);
}

#ifdef DFLASH_CUDA
// The CUDA kernels' path (ce_kernels.h); labels int64 and coef float32, both contiguous on
// hidden's device (fused_linear_ce makes them so).
namespace cuda_path {

// DFLASH_CE_LOGITS, read at the first call: "fp32" (default) or "bf16" (the GEMM writes the
// logits in the hidden states' 16-bit dtype; the kernels still compute in float32).
bool half_logits() {
  static const bool on = env_choice(kCeLogitsEnv, "fp32", {"fp32", "bf16"}) == "bf16";
  return on;
}

at::Tensor logits_for_kernels(const at::Tensor& h, const at::Tensor& weight) {
  auto lf = half_logits() ? at::mm(h, weight.t()) : logits_fp32(h, weight);
  DFLASH_CHECK(lf.stride(1) == 1, "linear CE: logits with unit column stride expected");
  return lf;
}

// g <- (softmax(lf) - onehot(lab))·coef in g's dtype (g [n, V] contiguous), then rows [c0, c0 + n)
// of grad_h <- g @ W, written in place by the GEMM (grad_h contiguous, so the rows are too).
void chunk_grad(const at::Tensor& lf, const at::Tensor& labels, const at::Tensor& lse, const at::Tensor& coef,
                int64_t c0, at::Tensor& g, const at::Tensor& weight, at::Tensor& grad_h, cudaStream_t stream) {
  const int64_t n = lf.size(0), V = lf.size(1);
  kernels::ce_grad(lf.data_ptr(), kernels::dtype_of(lf), n, V, lf.stride(0), labels.data_ptr<int64_t>() + c0,
                   lse.data_ptr<float>() + c0, coef.data_ptr<float>() + c0, g.data_ptr(), kernels::dtype_of(g), stream);
  auto rows = grad_h.narrow(0, c0, n);
  at::mm_out(rows, g.narrow(0, 0, n), weight);
}

// The forward over all chunks: fills lse [M] and correct [M], and grad_h when defined; returns the loss.
at::Tensor forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& coef,
                   int64_t chunk, at::Tensor& lse, at::Tensor& correct, at::Tensor& grad_h) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = hidden.size(0), V = weight.size(0);
  auto wce = at::empty({M}, hidden.options().dtype(at::kFloat));  // coef_i · CE_i
  at::Tensor g;
  if (grad_h.defined()) g = at::empty({std::min(chunk, M), V}, hidden.options());
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t n = std::min(chunk, M - c0);
    auto lf = logits_for_kernels(hidden.narrow(0, c0, n), weight);
    kernels::ce_stats(lf.data_ptr(), kernels::dtype_of(lf), n, V, lf.stride(0), labels.data_ptr<int64_t>() + c0,
                      coef.data_ptr<float>() + c0, lse.data_ptr<float>() + c0, wce.data_ptr<float>() + c0,
                      correct.data_ptr<bool>() + c0, stream);
    if (g.defined()) chunk_grad(lf, labels, lse, coef, c0, g, weight, grad_h, stream);
  }
  return wce.sum();
}

// Recompute's backward: the hidden gradient from the saved lse, with gs = coef · (incoming gradient).
at::Tensor backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels, const at::Tensor& gs,
                    const at::Tensor& lse, int64_t chunk) {
  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = hidden.size(0), V = weight.size(0);
  auto grad_h = at::empty(hidden.sizes(), hidden.options());
  auto g = at::empty({std::min(chunk, M), V}, hidden.options());
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t n = std::min(chunk, M - c0);
    chunk_grad(logits_for_kernels(hidden.narrow(0, c0, n), weight), labels, lse, gs, c0, g, weight, grad_h, stream);
  }
  return grad_h;
}

}  // namespace cuda_path
#endif

struct FusedLinearCe : public torch::autograd::Function<FusedLinearCe> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const at::Tensor& labels, const at::Tensor& coef, int64_t chunk, bool recompute,
                               bool cuda_kernels) {
    const int64_t M = hidden.size(0);
    auto correct = at::empty({M}, labels.options().dtype(at::kBool));
    const bool want_grad = hidden.requires_grad();
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["recompute"] = recompute;
    ctx->saved_data["cuda_kernels"] = cuda_kernels;
#ifdef DFLASH_CUDA
    if (cuda_kernels) {
      at::Tensor grad_h;
      if (want_grad && !recompute) grad_h = at::empty(hidden.sizes(), hidden.options());  // contiguous
      auto lse = at::empty({M}, hidden.options().dtype(at::kFloat));
      auto loss = cuda_path::forward(hidden, weight, labels, coef, chunk, lse, correct, grad_h);
      return finish(ctx, {hidden, weight, labels, coef, lse}, grad_h, recompute, loss, correct);
    }
#endif
    auto loss = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor grad_h, lse;
    if (want_grad && !recompute) grad_h = at::empty_like(hidden);
    if (want_grad && recompute) lse = at::empty({M}, hidden.options().dtype(at::kFloat));
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t n = std::min(chunk, M - c0);
      auto lab = labels.narrow(0, c0, n);
      auto cf = coef.narrow(0, c0, n);
      auto s = chunk_stats(hidden.narrow(0, c0, n), weight, lab);
      loss.add_((s.ce * cf).sum());
      correct.narrow(0, c0, n).copy_(s.argmax.eq(lab));
      if (grad_h.defined()) grad_h.narrow(0, c0, n).copy_(grad_from_probs(s.expd, lab, s.scale * cf, cf, weight));
      if (lse.defined()) lse.narrow(0, c0, n).copy_(s.lse);
    }
    return finish(ctx, {hidden, weight, labels, coef, lse}, grad_h, recompute, loss, correct);
  }

  // What both paths keep for the backward: the recompute inputs, or the finished hidden gradient.
  static variable_list finish(AutogradContext* ctx, const variable_list& recompute_inputs, const at::Tensor& grad_h,
                              bool recompute, const at::Tensor& loss, const at::Tensor& correct) {
    ctx->save_for_backward(recompute ? recompute_inputs : variable_list{grad_h});
    ctx->mark_non_differentiable({correct});
    return {loss, correct};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0];  // scalar
    auto saved = ctx->get_saved_variables();
    at::Tensor grad_h;
    if (!ctx->saved_data["recompute"].toBool()) {
      grad_h = saved[0] * g.to(saved[0].scalar_type());
    } else {
      const int64_t chunk = ctx->saved_data["chunk"].toInt();
      auto hidden = saved[0], weight = saved[1], labels = saved[2], coef = saved[3], lse = saved[4];
      const int64_t M = hidden.size(0);
      auto gs = coef * g.to(at::kFloat);  // on the device: no host read of g
#ifdef DFLASH_CUDA
      if (ctx->saved_data["cuda_kernels"].toBool())
        return {cuda_path::backward(hidden, weight, labels, gs, lse, chunk), at::Tensor(), at::Tensor(), at::Tensor(),
                at::Tensor(), at::Tensor(), at::Tensor()};
#endif
      grad_h = at::empty_like(hidden);
      for (int64_t c0 = 0; c0 < M; c0 += chunk) {
        const int64_t n = std::min(chunk, M - c0);
        auto lab = labels.narrow(0, c0, n);
        auto p = logits_fp32(hidden.narrow(0, c0, n), weight);
        p.sub_(lse.narrow(0, c0, n).unsqueeze(1)).exp_();
        auto gsc = gs.narrow(0, c0, n);
        grad_h.narrow(0, c0, n).copy_(grad_from_probs(p, lab, gsc, gsc, weight));  // p is already softmax
      }
    }
    return {grad_h, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_ce_args(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                   const at::Tensor& coef) {
  DFLASH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
               "linear CE: hidden [M, H] and weight [V, H] expected");
  DFLASH_CHECK(labels.dim() == 1 && labels.size(0) == hidden.size(0) && coef.sizes() == labels.sizes(),
               "linear CE: labels and coef must be [M]");
  DFLASH_CHECK(hidden.scalar_type() == weight.scalar_type(), "linear CE: hidden and weight dtypes differ");
}

// DFLASH_CE_FUSED, read at the first call.
bool cuda_kernels_enabled() {
  static const bool on = env_choice(kCeFusedEnv, "1", {"0", "1"}) == "1";
  return on;
}

}  // namespace

bool ce_cuda_available(const at::Tensor& hidden) {
#ifdef DFLASH_CUDA
  return hidden.is_cuda() && (hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kHalf);
#else
  (void)hidden;
  return false;
#endif
}

CeResult fused_linear_ce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         const at::Tensor& coef, int64_t chunk, CeMode mode, CeImpl impl) {
  check_ce_args(hidden, weight, labels, coef);
  DFLASH_CHECK(chunk > 0, "linear CE: chunk must be > 0");
  const bool cuda_kernels =
      impl == CeImpl::Cuda || (impl == CeImpl::Auto && ce_cuda_available(hidden) && cuda_kernels_enabled());
  if (!cuda_kernels) {
    auto out = FusedLinearCe::apply(hidden, weight.detach(), labels, coef.to(at::kFloat), chunk,
                                    mode == CeMode::Recompute, false);
    return {out[0], out[1]};
  }
  DFLASH_CHECK(ce_cuda_available(hidden),
               "linear CE: the CUDA kernels need bf16/fp16 hidden states on a GPU, got {} on {}",
               c10::toString(hidden.scalar_type()), hidden.device().str());
  DFLASH_CHECK(weight.device() == hidden.device() && labels.device() == hidden.device() &&
                   coef.device() == hidden.device(),
               "linear CE: weight, labels and coef must be on the hidden states' device {}", hidden.device().str());
  DFLASH_CHECK(labels.scalar_type() == at::kLong, "linear CE: labels must be int64");
  DFLASH_CHECK(weight.size(0) >= 1 && weight.size(0) <= (int64_t(1) << 27), "linear CE: vocabulary {} out of range",
               weight.size(0));
  auto out = FusedLinearCe::apply(hidden, weight.detach(), labels.contiguous(), coef.to(at::kFloat).contiguous(), chunk,
                                  mode == CeMode::Recompute, true);
  return {out[0], out[1]};
}

CeResult plain_linear_ce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         const at::Tensor& coef) {
  check_ce_args(hidden, weight, labels, coef);
  auto logits = at::matmul(hidden, weight.detach().t()).to(at::kFloat);
  auto logp = at::log_softmax(logits, 1);
  auto ce = logp.gather(1, labels.unsqueeze(1)).squeeze(1).neg();
  CeResult r;
  r.loss = (ce * coef.to(at::kFloat)).sum();
  r.correct = logits.argmax(1).eq(labels);
  return r;
}

at::Tensor decay(int64_t block_size, double gamma) {
  auto k = at::arange(block_size, at::kDouble);
  return at::exp(-(k - 1) / gamma).to(at::kFloat);
}

BlockMetrics block_metrics(const at::Tensor& correct_in, const at::Tensor& valid_in) {
  auto valid = valid_in.to(at::kCPU, at::kBool);
  auto hit = correct_in.to(at::kCPU, at::kBool).logical_and(valid);
  const int64_t bs = valid.size(2);
  BlockMetrics m;
  auto c = hit.to(at::kDouble).sum(at::IntArrayRef{0, 1});
  auto n = valid.to(at::kDouble).sum(at::IntArrayRef{0, 1});
  for (int64_t k = 0; k < bs; ++k) {
    m.correct_per_pos.push_back(c[k].item<double>());
    m.count_per_pos.push_back(n[k].item<double>());
  }
  if (bs < 2) return m;
  auto measured = valid.select(2, 1);                               // [B, N]
  auto run = hit.narrow(2, 1, bs - 1).to(at::kLong).cumprod(2);    // leading hits
  auto accepted = run.sum(2);                                       // [B, N]
  m.tau_blocks = measured.sum().item<int64_t>();
  auto tau_block = (accepted.to(at::kDouble) + 1).masked_select(measured);
  m.tau_sum = tau_block.sum().item<double>();
  m.tau_inv_sum = tau_block.reciprocal().sum().item<double>();
  return m;
}

}  // namespace dflash::model
