// The reference path of DFlash attention: one additive mask per step (built here, shared by all
// layers through Prepared) and LibTorch's scaled-dot-product attention. Also the dense boolean
// mask that tests and the kernel's checks compare against. See dflash_attention.h for the layout.
//
// Query grouping: the N blocks of a row are cut into groups of G consecutive blocks; one SDPA
// batch entry per (row, group) holds the group's G*bs queries and the keys [context C | the
// group's own G*bs block keys | padding]. A query's visible keys all lie in its entry (its
// context and its own block), so the result is exact, while the keys of the other N-G blocks,
// which no query of the group sees, are not computed at all: the dense work drops from
// Q x (C + Q) to Q x (C + G*bs) per row. G = N (one group) is the plain dense mask.
#include "attention/reference.h"

#include <cstdlib>
#include <limits>

#include <ATen/ATen.h>

namespace dflash::attention::detail {

int64_t group_queries_setting() {
  const char* env = std::getenv(kGroupQueriesEnv);
  if (!env || !*env) return kDefaultGroupQueries;
  return std::max<int64_t>(0, std::atoll(env));
}

Layout make_layout(const MaskSpec& spec, int64_t group_queries) {
  Layout l;
  l.B = spec.ctx_begin.size(0);
  l.N = spec.ctx_begin.size(1);
  l.bs = spec.block_size;
  l.C = spec.ctx_len;
  int64_t G = group_queries > 0 ? std::max<int64_t>(1, group_queries / l.bs) : l.N;
  G = std::max<int64_t>(1, std::min(G, l.N));
  l.G = G;
  l.ng = l.N == 0 ? 1 : (l.N + G - 1) / G;
  return l;
}

at::Tensor visibility(const MaskSpec& spec, const Layout& l, int64_t kv_total, at::Device device, int64_t sink) {
  const int64_t B = l.B, G = l.G, ng = l.ng, bs = l.bs, C = l.C, Qg = G * bs, pad = ng * G - l.N;
  auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  auto cb = spec.ctx_begin.to(device, at::kLong);
  auto ce = spec.ctx_end.to(device, at::kLong);
  auto keep = spec.keep.to(device, at::kBool);
  if (pad > 0) {  // blocks that fill the last group: dropped
    cb = at::constant_pad_nd(cb, {0, pad});
    ce = at::constant_pad_nd(ce, {0, pad});
    keep = at::constant_pad_nd(keep, {0, pad}, 0);
  }
  auto jl = at::arange(Qg, lopt).div(bs, "floor");  // block of each query inside its group
  auto per_row = [&](const at::Tensor& t) { return t.view({B * ng, G}).index_select(1, jl).view({B * ng, Qg, 1}); };
  auto rb = per_row(cb), re = per_row(ce), rk = per_row(keep);
  auto key = at::arange(kv_total, lopt).view({1, 1, kv_total});
  auto ctx = key.ge(rb).logical_and(key.lt(re)).logical_and_(key.lt(C));  // STRICT: < anchor
  auto kblk = (key - C).div(bs, "floor");
  auto blk = kblk.eq(jl.view({1, Qg, 1})).logical_and_(key.ge(C)).logical_and_(key.lt(C + Qg));
  auto vis = ctx.logical_or_(blk).logical_and_(rk);  // [B*ng, Qg, kv_total]
  if (sink >= 0) vis.logical_or_(rk.logical_not().logical_and(key.eq(sink)));
  return vis;
}

at::Tensor additive_mask(const MaskSpec& spec, const Layout& l, int64_t kv_pad, int64_t sink, at::ScalarType dtype,
                         at::Device device) {
  auto vis = visibility(spec, l, kv_pad, device, sink);
  auto mask = at::zeros(vis.sizes(), at::TensorOptions().dtype(dtype).device(device));
  mask.masked_fill_(vis.logical_not(), -std::numeric_limits<double>::infinity());
  return mask.unsqueeze(1);  // [B*ng, 1, G*bs, kv_pad], broadcast over heads
}

at::Tensor reference_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Prepared& p) {
  const int64_t B = q.size(0), hq = q.size(1), Q = q.size(2), d = q.size(3), hkv = k.size(1), g = hq / hkv;
  const int64_t C = p.spec.ctx_len, bs = p.spec.block_size;
  const int64_t ng = p.dense_mask.size(0) / B, Qg = p.dense_mask.size(2), kvp = p.dense_mask.size(3);
  const int64_t qpad = ng * Qg - Q, kpad = kvp - C - Qg;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  (void)bs;
  // Keys of each (row, group) entry: [context | own blocks | zero padding], GQA heads expanded
  // (query head h uses kv head h / g). Padding keys: a multiple of 128 (cuDNN backward NaN issue
  // with kv_len % 128 == 64, pytorch#196678) and the sink key of rows that see nothing.
  auto entry = [&](const at::Tensor& t) {
    auto ctx = t.narrow(2, 0, C).unsqueeze(1).unsqueeze(3).expand({B, ng, hkv, g, C, d});
    auto blk = t.narrow(2, C, Q);
    if (qpad > 0) blk = at::constant_pad_nd(blk, {0, 0, 0, qpad});
    auto blk_e = blk.view({B, hkv, ng, Qg, d}).permute({0, 2, 1, 3, 4}).unsqueeze(3).expand({B, ng, hkv, g, Qg, d});
    std::vector<at::Tensor> parts = {ctx, blk_e};
    if (kpad > 0) parts.push_back(at::zeros({B, ng, hkv, g, kpad, d}, t.options()));
    return at::cat(parts, 4).view({B * ng, hq, kvp, d});
  };
  auto kk = entry(k), vv = entry(v);
  auto qq = qpad > 0 ? at::constant_pad_nd(q, {0, 0, 0, qpad}) : q;
  if (ng > 1) qq = qq.view({B, hq, ng, Qg, d}).permute({0, 2, 1, 3, 4}).reshape({B * ng, hq, Qg, d});
  auto o = at::scaled_dot_product_attention(qq, kk, vv, p.dense_mask, 0.0, false, scale);
  if (ng > 1) o = o.view({B, ng, hq, Qg, d}).permute({0, 2, 1, 3, 4}).reshape({B, hq, ng * Qg, d});
  return qpad > 0 ? o.narrow(2, 0, Q) : o;
}

}  // namespace dflash::attention::detail
