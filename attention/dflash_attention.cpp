// attention/dflash_attention.h: validation of the mask spec, the dispatch between the reference
// path (attention/reference.cpp) and the CUDA kernel, and the dense boolean mask.
#include "attention/dflash_attention.h"

#include <ATen/ATen.h>

#include "attention/reference.h"
#include "core/error.h"

// The kernel's entry points exist when attention/kernel_cuda.cpp is built (CUDA builds).
#if DFLASH_ATTENTION_KERNEL
#define DFLASH_HAVE_KERNEL 1
#include "attention/kernel.h"
#else
#define DFLASH_HAVE_KERNEL 0
#endif

namespace dflash::attention {
namespace {

std::string dims(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

void validate(const MaskSpec& s) {
  if (!s.ctx_begin.defined() || !s.ctx_end.defined() || !s.keep.defined())
    throw_user("attention MaskSpec: ctx_begin, ctx_end and keep must all be set");
  if (s.ctx_begin.dim() != 2)
    throw_user("attention MaskSpec.ctx_begin: expected [B, N], got {} dims", s.ctx_begin.dim());
  auto shape = s.ctx_begin.sizes();
  if (s.ctx_end.sizes() != shape || s.keep.sizes() != shape)
    throw_user("attention MaskSpec: ctx_begin {}, ctx_end {} and keep {} must have the same shape [B, N]",
               dims(s.ctx_begin.sizes()), dims(s.ctx_end.sizes()), dims(s.keep.sizes()));
  if (s.ctx_begin.scalar_type() != at::kLong || s.ctx_end.scalar_type() != at::kLong)
    throw_user("attention MaskSpec: ctx_begin and ctx_end must be int64, got {} and {}",
               c10::toString(s.ctx_begin.scalar_type()), c10::toString(s.ctx_end.scalar_type()));
  if (s.keep.scalar_type() != at::kBool)
    throw_user("attention MaskSpec.keep: must be bool, got {}", c10::toString(s.keep.scalar_type()));
  if (s.block_size <= 0) throw_user("attention MaskSpec.block_size: must be > 0, got {}", s.block_size);
  if (s.ctx_len < 0) throw_user("attention MaskSpec.ctx_len: must be >= 0, got {}", s.ctx_len);
  if (s.ctx_begin.numel() == 0) return;
  // Ranges are checked for kept blocks only (dropped blocks see nothing whatever they hold).
  auto keep = s.keep.cpu();
  auto cb = s.ctx_begin.cpu().masked_select(keep);
  auto ce = s.ctx_end.cpu().masked_select(keep);
  if (cb.numel() == 0) return;
  if (cb.min().item<int64_t>() < 0)
    throw_user("attention MaskSpec.ctx_begin: negative value {}", cb.min().item<int64_t>());
  if (ce.max().item<int64_t>() > s.ctx_len)
    throw_user("attention MaskSpec.ctx_end: {} exceeds ctx_len {}", ce.max().item<int64_t>(), s.ctx_len);
  if ((ce < cb).any().item<bool>())
    throw_user("attention MaskSpec: ctx_end < ctx_begin for some kept block");
}

}  // namespace

#if !DFLASH_HAVE_KERNEL
bool kernel_available() { return false; }
bool fused_backward_available(int64_t) { return false; }
void set_fused_backward(bool) {}
#endif

Prepared prepare(const MaskSpec& spec, Backend backend, at::ScalarType dtype, at::Device device) {
  validate(spec);
  Prepared p;
  p.spec = spec;
  p.backend = backend;
  const int64_t q_len = spec.ctx_begin.size(1) * spec.block_size;
  p.kv_len = spec.ctx_len + q_len;
  if (backend == Backend::Kernel) {
    if (!kernel_available())
      throw_user("attention: the CUDA block-sparse kernel is not built into this binary "
                 "(drafter.attention=kernel); use drafter.attention=sdpa");
#if DFLASH_HAVE_KERNEL
    p.kernel_meta = kernel_prepare_meta(spec, device);
#endif
    return p;
  }
  // Keys of each SDPA entry padded to a multiple of 128; if some row sees nothing (a dropped
  // block, or a block that fills the last query group) it needs one visible padding key (the
  // sink, zero K and V) so that it yields 0 instead of NaN.
  auto l = detail::make_layout(spec, detail::group_queries_setting());
  const int64_t kv_entry = spec.ctx_len + l.G * l.bs;
  const bool any_dropped = l.ng * l.G > l.N || (spec.keep.numel() > 0 && !spec.keep.all().item<bool>());
  p.kv_pad = (kv_entry + 127) / 128 * 128;
  if (any_dropped && p.kv_pad == kv_entry) p.kv_pad += 128;
  const int64_t sink = any_dropped ? kv_entry : -1;
  p.dense_mask = detail::additive_mask(spec, l, p.kv_pad, sink, dtype, device);
  return p;
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Prepared& p) {
  const auto& s = p.spec;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    throw_user("attention: q, k, v must be 4-d [B, H, L, d]; got {}, {}, {}", dims(q.sizes()), dims(k.sizes()), dims(v.sizes()));
  const int64_t B = s.ctx_begin.size(0), q_len = s.ctx_begin.size(1) * s.block_size;
  if (q.size(0) != B || q.size(2) != q_len)
    throw_user("attention: q {} does not fit the mask (B={}, N*bs={})", dims(q.sizes()), B, q_len);
  if (k.sizes() != v.sizes() || k.size(0) != B || k.size(2) != p.kv_len || k.size(3) != q.size(3))
    throw_user("attention: k {} / v {} do not fit q {} and the mask (kv_len={})", dims(k.sizes()), dims(v.sizes()),
               dims(q.sizes()), p.kv_len);
  if (q.size(1) % k.size(1) != 0)
    throw_user("attention: {} query heads are not a multiple of {} kv heads", q.size(1), k.size(1));
  if (p.backend == Backend::Kernel) {
#if DFLASH_HAVE_KERNEL
    return kernel_attend(q, k, v, p);
#else
    throw_user("attention: the CUDA block-sparse kernel is not built into this binary");
#endif
  }
  if (p.dense_mask.scalar_type() != q.scalar_type())
    throw_user("attention: mask prepared for {} but q is {}", c10::toString(p.dense_mask.scalar_type()),
               c10::toString(q.scalar_type()));
  return detail::reference_attend(q, k, v, p);
}

at::Tensor dense_bool_mask(const MaskSpec& spec) {
  validate(spec);
  auto l = detail::make_layout(spec, 0);  // one group: the plain layout [context | all blocks]
  return detail::visibility(spec, l, spec.ctx_len + l.N * l.bs, spec.ctx_begin.device(), -1);
}

}  // namespace dflash::attention
