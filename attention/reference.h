// Internals of the reference (LibTorch SDPA) path of attention/dflash_attention.h; not a public
// API. Owns nothing: pure functions of their arguments, reentrant.
#pragma once

#include "attention/dflash_attention.h"

namespace dflash::attention::detail {

// Boolean visibility [B, N*bs, kv_total] of `spec` on `device`; keys >= C + N*bs are padding
// (invisible) except `sink` (if >= 0), which rows of keep=false blocks see.
at::Tensor visibility(const MaskSpec& spec, int64_t kv_total, at::Device device, int64_t sink);

// Additive mask [B, 1, N*bs, kv_pad]: 0 where visible, -inf elsewhere, in `dtype`.
at::Tensor additive_mask(const MaskSpec& spec, int64_t kv_pad, int64_t sink, at::ScalarType dtype,
                         at::Device device);

at::Tensor reference_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const Prepared& p);

}  // namespace dflash::attention::detail
