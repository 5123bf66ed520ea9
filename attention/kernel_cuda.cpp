// LibTorch face of the block-sparse DFlash attention kernel (attention/kernel.h): validates
// tensors once with messages naming the tensor, builds the metadata, fills the plain parameter
// struct, and wraps forward + backward in an autograd Function. Built only with CUDA.
#include "attention/kernel.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/autograd/custom_function.h>

#include <fmt/ranges.h>

#include <cmath>

#include "core/device.h"
#include "core/error.h"

namespace dflash::attention {

bool kernel_available() { return true; }

namespace {

void* stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Requires bf16, 4 dims, on CUDA; returns a view usable by the kernels (last dim contiguous,
// row stride a multiple of 8 elements, 16-byte aligned base), copying only when needed.
at::Tensor checked(const at::Tensor& t, const char* name) {
  if (!t.defined()) throw_user("attention kernel: tensor {} is undefined", name);
  if (t.dim() != 4)
    throw_user("attention kernel: {} must have 4 dims [B, H, L, d], got {}", name, t.dim());
  if (!t.is_cuda()) throw_user("attention kernel: {} must be a CUDA tensor", name);
  if (t.scalar_type() != at::kBFloat16)
    throw_user("attention kernel: {} must be bfloat16, got {}", name,
               std::string(c10::toString(t.scalar_type())));
  const bool ok = t.stride(3) == 1 && t.stride(2) % 8 == 0 && t.stride(1) % 8 == 0 &&
                  t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  return ok ? t : t.contiguous();
}

void set_strides(const at::Tensor& t, int64_t& sb, int64_t& sh, int64_t& sr) {
  sb = t.stride(0);
  sh = t.stride(1);
  sr = t.stride(2);
}

struct Shapes {
  int B, Hq, Hkv, q_len, kv_len, d;
};

Shapes validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& meta) {
  Shapes s{};
  s.B = (int)q.size(0);
  s.Hq = (int)q.size(1);
  s.q_len = (int)q.size(2);
  s.d = (int)q.size(3);
  s.Hkv = (int)k.size(1);
  s.kv_len = (int)k.size(2);
  if (k.sizes() != v.sizes())
    throw_user("attention kernel: k {} and v {} must have the same shape", fmt::join(k.sizes(), "x"),
               fmt::join(v.sizes(), "x"));
  if (k.size(0) != s.B || k.size(3) != s.d)
    throw_user("attention kernel: k {} does not match q {} in batch or head dim",
               fmt::join(k.sizes(), "x"), fmt::join(q.sizes(), "x"));
  if (s.Hkv <= 0 || s.Hq % s.Hkv != 0)
    throw_user("attention kernel: q heads {} must be a multiple of k/v heads {}", s.Hq, s.Hkv);
  if (s.d != 64 && s.d != 128) throw_user("attention kernel: head dim must be 64 or 128, got {}", s.d);
  if (s.B <= 0 || s.q_len <= 0 || s.kv_len <= 0)
    throw_user("attention kernel: empty q {} or k {}", fmt::join(q.sizes(), "x"), fmt::join(k.sizes(), "x"));
  if (q.device() != k.device() || q.device() != v.device())
    throw_user("attention kernel: q, k, v must be on one device");
  if (!meta.defined() || meta.scalar_type() != at::kInt || !meta.is_cuda() ||
      meta.numel() != kernel_meta_numel(s.B, s.q_len, s.kv_len) || meta.device() != q.device())
    throw_user("attention kernel: kernel_meta does not match these shapes (B {}, q_len {}, kv_len "
               "{}): build it with kernel_prepare_meta of the same mask spec on this device",
               s.B, s.q_len, s.kv_len);
  return s;
}

AttnParams make_params(const Shapes& s, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, const at::Tensor& meta) {
  AttnParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  set_strides(q, p.q_sb, p.q_sh, p.q_sr);
  set_strides(k, p.k_sb, p.k_sh, p.k_sr);
  set_strides(v, p.v_sb, p.v_sh, p.v_sr);
  p.B = s.B;
  p.Hq = s.Hq;
  p.Hkv = s.Hkv;
  p.q_len = s.q_len;
  p.kv_len = s.kv_len;
  p.d = s.d;
  p.scale = 1.0f / std::sqrt((float)s.d);
  p.meta = meta_view(meta.data_ptr<int32_t>(), s.B, s.q_len, s.kv_len);
  return p;
}

std::tuple<at::Tensor, at::Tensor> forward_impl(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& meta) {
  const Shapes s = validate(q, k, v, meta);
  c10::cuda::CUDAGuard guard(q.device());
  // O in [B, q_len, Hq, d] memory seen as [B, Hq, q_len, d]: the caller's transpose back to
  // [B, q_len, Hq * d] (the o_proj input) is then a view, and so is its gradient's way back here.
  at::Tensor o = at::empty({s.B, s.q_len, s.Hq, s.d}, q.options()).transpose(1, 2);
  at::Tensor lse = at::empty({s.B, s.Hq, s.q_len}, q.options().dtype(at::kFloat));
  AttnParams p = make_params(s, q, k, v, meta);
  p.o = o.data_ptr();
  set_strides(o, p.o_sb, p.o_sh, p.o_sr);
  p.lse = lse.data_ptr<float>();
  launch_attn_fwd(p, stream_of(q));
  return {o, lse};
}

// dq, dk, dv of the kernel's backward; all inputs already checked().
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_impl(const at::Tensor& q, const at::Tensor& k,
                                                             const at::Tensor& v, const at::Tensor& o,
                                                             const at::Tensor& lse, const at::Tensor& dout,
                                                             const at::Tensor& meta) {
  const Shapes s = validate(q, k, v, meta);
  c10::cuda::CUDAGuard guard(q.device());
  // The gradients in the inputs' memory layout (the drafter's q, k, v are [B, L, H, d] memory seen
  // as [B, H, L, d]), so that the autograd graph's transposes above stay views.
  at::Tensor dq = at::empty_like(q, at::MemoryFormat::Preserve);
  at::Tensor dk = at::empty_like(k, at::MemoryFormat::Preserve);
  at::Tensor dv = at::empty_like(v, at::MemoryFormat::Preserve);
  at::Tensor delta = at::empty({s.B, s.Hq, s.q_len}, q.options().dtype(at::kFloat));
  AttnParams p = make_params(s, q, k, v, meta);
  p.o = const_cast<void*>(o.data_ptr());
  set_strides(o, p.o_sb, p.o_sh, p.o_sr);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dout = dout.data_ptr();
  set_strides(dout, p.do_sb, p.do_sh, p.do_sr);
  p.delta = delta.data_ptr<float>();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  set_strides(dq, p.dq_sb, p.dq_sh, p.dq_sr);
  set_strides(dk, p.dk_sb, p.dk_sh, p.dk_sr);
  set_strides(dv, p.dv_sb, p.dv_sh, p.dv_sr);
  at::Tensor dq_accum;  // the fused backward's fp32 dQ sum (zeroed by the backward itself)
  if (backward_accumulates_dq(s.d)) {
    dq_accum = at::empty({dq_accum_numel(s.B, s.Hq, s.q_len, s.d)}, q.options().dtype(at::kFloat));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  launch_attn_bwd(p, stream_of(q));
  return {dq, dk, dv};
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct KernelAttention : public torch::autograd::Function<KernelAttention> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& meta) {
    auto [o, lse] = forward_impl(q, k, v, meta);
    ctx->save_for_backward({q, k, v, o, lse, meta});
    return o;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};  // output unused
    const at::Tensor dout = checked(grads[0], "grad of attention output");
    auto [dq, dk, dv] = backward_impl(saved[0], saved[1], saved[2], saved[3], saved[4], dout, saved[5]);
    return {dq, dk, dv, at::Tensor()};
  }
};

void check_spec_shapes(const Prepared& p, const at::Tensor& q, const at::Tensor& k) {
  const int64_t N = p.spec.ctx_end.defined() ? p.spec.ctx_end.size(-1) : -1;
  const int64_t q_len = N * p.spec.block_size, kv_len = p.spec.ctx_len + q_len;
  if (q.size(2) != q_len || k.size(2) != kv_len)
    throw_user("attention kernel: q length {} / k length {} do not match the mask (N {} blocks of "
               "{}, context {}: expected {} / {})",
               q.size(2), k.size(2), N, p.spec.block_size, p.spec.ctx_len, q_len, kv_len);
}

}  // namespace

at::Tensor kernel_prepare_meta(const MaskSpec& spec, at::Device device) {
  if (!device.is_cuda()) throw_user("attention kernel: kernel_prepare_meta needs a CUDA device");
  auto need = [&](const at::Tensor& t, const char* name) {
    if (!t.defined() || t.dim() != 2) throw_user("attention mask: {} must be a [B, N] tensor", name);
  };
  need(spec.ctx_begin, "ctx_begin");
  need(spec.ctx_end, "ctx_end");
  need(spec.keep, "keep");
  if (spec.ctx_begin.sizes() != spec.ctx_end.sizes() || spec.keep.sizes() != spec.ctx_end.sizes())
    throw_user("attention mask: ctx_begin {}, ctx_end {} and keep {} must have one shape [B, N]",
               fmt::join(spec.ctx_begin.sizes(), "x"), fmt::join(spec.ctx_end.sizes(), "x"),
               fmt::join(spec.keep.sizes(), "x"));
  if (spec.block_size <= 0) throw_user("attention mask: block_size must be positive, got {}", spec.block_size);
  if (spec.ctx_len < 0) throw_user("attention mask: ctx_len must be >= 0, got {}", spec.ctx_len);
  const int64_t B = spec.ctx_end.size(0), N = spec.ctx_end.size(1);
  if (B <= 0 || N <= 0) throw_user("attention mask: need at least one row and one block, got B {} N {}", B, N);
  const int64_t q_len = N * spec.block_size, kv_len = spec.ctx_len + q_len;
  if (kv_len >= (int64_t(1) << 30)) throw_user("attention mask: {} keys is too many for the kernel", kv_len);
  c10::cuda::CUDAGuard guard(device);
  auto opt = at::TensorOptions().device(device);
  // uploads that do not wait for the step's queued work (the spec is usually on the host)
  at::Tensor cb = device::to_device(spec.ctx_begin.to(at::kInt), device).contiguous();
  at::Tensor ce = device::to_device(spec.ctx_end.to(at::kInt), device).contiguous();
  at::Tensor keep = device::to_device(spec.keep.to(at::kByte), device).contiguous();
  at::Tensor meta = at::empty({kernel_meta_numel(B, q_len, kv_len)}, opt.dtype(at::kInt));
  MetaParams mp;
  mp.ctx_begin = cb.data_ptr<int32_t>();
  mp.ctx_end = ce.data_ptr<int32_t>();
  mp.keep = keep.data_ptr<uint8_t>();
  mp.out = meta.data_ptr<int32_t>();
  mp.B = (int)B;
  mp.N = (int)N;
  mp.block_size = (int)spec.block_size;
  mp.ctx_len = (int)spec.ctx_len;
  launch_build_meta(mp, c10::cuda::getCurrentCUDAStream(device.index()).stream());
  return meta;
}

std::tuple<at::Tensor, at::Tensor> kernel_forward(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const Prepared& p) {
  const at::Tensor qc = checked(q, "q"), kc = checked(k, "k"), vc = checked(v, "v");
  check_spec_shapes(p, qc, kc);
  return forward_impl(qc, kc, vc, p.kernel_meta);
}

at::Tensor kernel_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const Prepared& p) {
  const at::Tensor qc = checked(q, "q"), kc = checked(k, "k"), vc = checked(v, "v");
  check_spec_shapes(p, qc, kc);
  return KernelAttention::apply(qc, kc, vc, p.kernel_meta);
}

at::Tensor kernel_causal_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& cu_dev, double scale, at::Tensor& meta) {
  for (const auto* t : {&q, &k, &v})
    if (t->dim() != 3) throw_user("causal attention kernel: q, k, v must be [T, heads, d], got {} dims", t->dim());
  const int64_t T = q.size(0);
  if (k.size(0) != T || v.size(0) != T)
    throw_user("causal attention kernel: q has {} tokens, k {} and v {}", T, k.size(0), v.size(0));
  if (T >= (int64_t(1) << 30)) throw_user("causal attention kernel: {} tokens is too many", T);
  if (!cu_dev.defined() || cu_dev.dim() != 1 || cu_dev.numel() < 2 || cu_dev.scalar_type() != at::kInt ||
      cu_dev.device() != q.device())
    throw_user("causal attention kernel: cu_seqlens must be int32 [n_docs + 1] on {}", q.device().str());
  // [T, H, d] seen as [1, H, T, d]: batch 1, head stride and row stride as they are
  auto as4 = [](const at::Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };
  const at::Tensor qc = checked(as4(q), "q"), kc = checked(as4(k), "k"), vc = checked(as4(v), "v");
  c10::cuda::CUDAGuard guard(q.device());
  if (!meta.defined()) {
    meta = at::empty({kernel_meta_numel(1, T, T)}, cu_dev.options());
    CausalMetaParams mp;
    mp.cu = cu_dev.data_ptr<int32_t>();
    mp.out = meta.data_ptr<int32_t>();
    mp.n_docs = int(cu_dev.numel() - 1);
    mp.T = int(T);
    launch_build_causal_meta(mp, stream_of(q));
  }
  const Shapes s = validate(qc, kc, vc, meta);
  at::Tensor out = at::empty({T, s.Hq, s.d}, q.options());
  at::Tensor o = as4(out);
  at::Tensor lse = at::empty({1, s.Hq, T}, q.options().dtype(at::kFloat));
  AttnParams p = make_params(s, qc, kc, vc, meta);
  p.scale = float(scale);
  p.o = o.data_ptr();
  set_strides(o, p.o_sb, p.o_sh, p.o_sr);
  p.lse = lse.data_ptr<float>();
  launch_attn_fwd(p, stream_of(q));
  return out;
}

}  // namespace dflash::attention
