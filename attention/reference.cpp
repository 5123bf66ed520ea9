// The reference path of DFlash attention: one additive mask per step (built here, shared by all
// layers through Prepared) and LibTorch's scaled-dot-product attention. Also the dense boolean
// mask that tests and the kernel's checks compare against. See dflash_attention.h for the layout.
#include "attention/reference.h"

#include <limits>

#include <ATen/ATen.h>

namespace dflash::attention::detail {

// visible[b, q, key] for keys [0, kv_total). Key `sink` (>= kv_len, a padding key) is made
// visible to the rows of keep=false blocks so that every row sees exactly one key at least;
// its K and V are zero, so those rows yield exactly 0 in the forward and 0 gradients.
at::Tensor visibility(const MaskSpec& spec, int64_t kv_total, at::Device device, int64_t sink) {
  const int64_t B = spec.ctx_begin.size(0), N = spec.ctx_begin.size(1);
  const int64_t bs = spec.block_size, C = spec.ctx_len, Q = N * bs;
  auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  auto cb = spec.ctx_begin.to(device, at::kLong);
  auto ce = spec.ctx_end.to(device, at::kLong);
  auto keep = spec.keep.to(device, at::kBool);
  auto qblk = at::arange(Q, lopt).div(bs, "floor");               // [Q] block of each query
  auto rb = cb.index_select(1, qblk).view({B, Q, 1});              // [B,Q,1]
  auto re = ce.index_select(1, qblk).view({B, Q, 1});
  auto rk = keep.index_select(1, qblk).view({B, Q, 1});
  auto key = at::arange(kv_total, lopt).view({1, 1, kv_total});
  auto ctx = key.ge(rb).logical_and(key.lt(re)).logical_and_(key.lt(C));  // STRICT: < anchor
  auto kblk = (key - C).div(bs, "floor");
  auto blk = kblk.eq(qblk.view({1, Q, 1})).logical_and_(key.ge(C)).logical_and_(key.lt(C + Q));
  auto vis = ctx.logical_or_(blk).logical_and_(rk);  // [B, Q, KV]
  if (sink >= 0) vis.logical_or_(rk.logical_not().logical_and(key.eq(sink)));
  return vis;
}

at::Tensor additive_mask(const MaskSpec& spec, int64_t kv_pad, int64_t sink, at::ScalarType dtype,
                         at::Device device) {
  auto vis = visibility(spec, kv_pad, device, sink);
  auto mask = at::zeros(vis.sizes(), at::TensorOptions().dtype(dtype).device(device));
  mask.masked_fill_(vis.logical_not(), -std::numeric_limits<double>::infinity());
  return mask.unsqueeze(1);  // [B, 1, Q, KV_pad], broadcast over heads
}

at::Tensor reference_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const Prepared& p) {
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(3);
  const int64_t pad = p.kv_pad - p.kv_len;
  // Padding keys (zeros) after the real ones: multiple of 128 (cuDNN backward NaN issue with
  // kv_len % 128 == 64, pytorch#196678) and the sink key of rows that see nothing.
  auto kp = pad > 0 ? at::constant_pad_nd(k, {0, 0, 0, pad}) : k;
  auto vp = pad > 0 ? at::constant_pad_nd(v, {0, 0, 0, pad}) : v;
  if (hq != hkv) {  // GQA: every kv head serves hq/hkv consecutive query heads
    const int64_t g = hq / hkv;
    auto expand = [&](const at::Tensor& t) {
      return t.unsqueeze(2).expand({t.size(0), hkv, g, t.size(2), d}).reshape({t.size(0), hq, t.size(2), d});
    };
    kp = expand(kp);
    vp = expand(vp);
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  return at::scaled_dot_product_attention(q, kp, vp, p.dense_mask, 0.0, false, scale);
}

}  // namespace dflash::attention::detail
