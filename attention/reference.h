// Internals of the reference (LibTorch SDPA) path of attention/dflash_attention.h; not a public
// API. Owns nothing: pure functions of their arguments, reentrant.
#pragma once

#include "attention/dflash_attention.h"

namespace dflash::attention::detail {

// Environment knob: query rows per SDPA batch entry of the reference path (rounded down to whole
// blocks; 0 = one entry per row, the plain dense mask). Read at every prepare().
constexpr const char* kGroupQueriesEnv = "DFLASH_SDPA_GROUP_QUERIES";
constexpr int64_t kDefaultGroupQueries = 1024;
int64_t group_queries_setting();

// Blocks per group G and number of groups ng (N padded to ng*G with dropped blocks).
struct Layout {
  int64_t B = 0, N = 0, bs = 0, C = 0, G = 0, ng = 1;
};
Layout make_layout(const MaskSpec& spec, int64_t group_queries);

// Boolean visibility [B*ng, G*bs, kv_total] of `spec` in the grouped layout on `device`: keys
// [0, C) context, [C, C + G*bs) the group's blocks, the rest padding (invisible) except `sink`
// (if >= 0), which the rows of dropped blocks see.
at::Tensor visibility(const MaskSpec& spec, const Layout& l, int64_t kv_total, at::Device device, int64_t sink);

// Additive mask [B*ng, 1, G*bs, kv_pad]: 0 where visible, -inf elsewhere, in `dtype`.
at::Tensor additive_mask(const MaskSpec& spec, const Layout& l, int64_t kv_pad, int64_t sink, at::ScalarType dtype,
                         at::Device device);

at::Tensor reference_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Prepared& p);

}  // namespace dflash::attention::detail
