// trainer/model/target_cache_static.h: the static KV cache of launch-lean decoding.
#include "trainer/model/target_cache_static.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "trainer/model/target_ops.h"

namespace dflash::model {

StaticKVCache::StaticKVCache(const TargetModel& model, int64_t rows, int64_t capacity)
    : model_(model), rows_(rows), capacity_(capacity) {
  c10::InferenceMode guard;
  if (rows < 1 || capacity < 1)
    throw_user("static cache: needs >= 1 row and capacity >= 1, got {} rows of {}", rows, capacity);
  if (model.hybrid())
    throw_user("static cache: {} targets have recurrent or expert layers; use the general TargetCache",
               model.config().model_type);
  if (!model.has_lm_head()) throw_user("static cache: the model was loaded without lm_head");
  const HfConfig& c = model.config();
  auto opt = at::TensorOptions().dtype(model.dtype()).device(model.device());
  for (int64_t l = 0; l < model.num_layers_loaded(); ++l) {
    // Zeros: a slot nobody wrote holds a finite value (see the header).
    k_.push_back(at::zeros({rows, capacity, c.num_key_value_heads, c.head_dim}, opt));
    v_.push_back(at::zeros({rows, capacity, c.num_key_value_heads, c.head_dim}, opt));
  }
  auto lopt = at::TensorOptions().dtype(at::kLong).device(model.device());
  len_ = at::zeros({rows}, lopt);
  row_ids_ = at::arange(rows, lopt);
}

at::Tensor StaticKVCache::prefill(const std::vector<int64_t>& which,
                                  const std::vector<std::vector<int64_t>>& prompts) {
  return prefill_capture(which, prompts, {}).logits;
}

TargetModel::Output StaticKVCache::prefill_capture(const std::vector<int64_t>& which,
                                                   const std::vector<std::vector<int64_t>>& prompts,
                                                   const std::vector<int64_t>& layer_ids) {
  c10::InferenceMode guard;
  DFLASH_CHECK(which.size() == prompts.size() && !which.empty(), "static cache: {} rows for {} prompts",
               which.size(), prompts.size());
  const HfConfig& c = model_.config();
  const at::Device dev = model_.device();
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  std::vector<int64_t> flat, slot, row_of, cu = {0}, last, lens;
  int64_t n_max = 0;
  for (size_t j = 0; j < which.size(); ++j) {
    const int64_t b = which[j], n = int64_t(prompts[j].size());
    if (b < 0 || b >= rows_) throw_user("static cache: row {} outside [0, {})", b, rows_);
    if (n < 1 || n > capacity_)
      throw_user("static cache: a prompt of {} tokens for row {} (capacity {})", n, b, capacity_);
    for (int64_t i = 0; i < n; ++i) {
      flat.push_back(prompts[j][i]);
      slot.push_back(i);
      row_of.push_back(b);
    }
    cu.push_back(int64_t(flat.size()));
    last.push_back(int64_t(flat.size()) - 1);
    lens.push_back(n);
    n_max = std::max(n_max, n);
  }
  auto on_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
  at::Tensor rows_t = on_dev(row_of), slot_t = on_dev(slot);
  at::Tensor cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(dev);
  at::Tensor kernel_meta;  // the causal kernel's tile metadata, shared by the layers
  TargetModel::Attention attend = [&](int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    k_[l].index_put_({rows_t, slot_t}, k);
    v_[l].index_put_({rows_t, slot_t}, v);
    return ops::varlen_causal_attention(q, k, v, cu, cu_dev, n_max, scale, &kernel_meta);
  };
  TargetModel::Output out = model_.forward_with(at::tensor(flat, at::kLong), at::tensor(slot, at::kLong), layer_ids,
                                                attend, at::tensor(last, at::kLong));
  len_.index_put_({on_dev(which)}, on_dev(lens));
  return out;
}

at::Tensor StaticKVCache::step(const at::Tensor& ids, int64_t window) {
  return verify(ids.view({rows_, 1}), window, {}).logits;
}

TargetModel::Output StaticKVCache::verify(const at::Tensor& ids, int64_t window, const std::vector<int64_t>& layer_ids) {
  c10::InferenceMode guard;
  DFLASH_CHECK(ids.dim() == 2 && ids.size(0) == rows_, "static cache: verify ids must be [rows, n]");
  DFLASH_CHECK(window >= 1 && window <= capacity_, "static cache: window {} outside [1, {}]", window, capacity_);
  const HfConfig& c = model_.config();
  const int64_t B = rows_, n = ids.size(1), nq = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int64_t g = nq / nkv;
  const double scale = 1.0 / std::sqrt(double(hd));
  // Token i of row b: position length(b) + i, flat slot b * capacity + length(b) + i; it sees
  // slots j <= length(b) + i.
  at::Tensor pos = len_.view({B, 1}) + at::arange(n, len_.options()).view({1, n});  // [B, n]
  at::Tensor flat_slot = (row_ids_.view({B, 1}) * capacity_ + pos).reshape({B * n});
  at::Tensor vis = at::arange(window, len_.options()).view({1, 1, window}) <= pos.view({B, n, 1});  // [B, n, window]
  // GQA folded into the query axis as (kv head, q head in group, token): the mask repeats per
  // group (one token: a broadcast row).
  at::Tensor mask = n == 1 ? vis.view({B, 1, 1, window})
                           : vis.unsqueeze(1).expand({B, g, n, window}).reshape({B, 1, g * n, window});
  TargetModel::Attention attend = [&](int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    k_[l].view({B * capacity_, nkv * hd}).index_copy_(0, flat_slot, k.reshape({B * n, nkv * hd}));
    v_[l].view({B * capacity_, nkv * hd}).index_copy_(0, flat_slot, v.reshape({B * n, nkv * hd}));
    at::Tensor ck = k_[l].narrow(1, 0, window).transpose(1, 2), cv = v_[l].narrow(1, 0, window).transpose(1, 2);
    at::Tensor qf = q.reshape({B, n, nkv, g, hd}).permute({0, 2, 3, 1, 4}).reshape({B, nkv, g * n, hd});
    at::Tensor o = at::scaled_dot_product_attention(qf, ck, cv, mask, 0.0, /*is_causal=*/false, scale);
    return o.view({B, nkv, g, n, hd}).permute({0, 3, 1, 2, 4}).reshape({B * n, nq, hd});
  };
  return model_.decode_with(ids.reshape({B * n}), pos.reshape({B * n}), attend, layer_ids);
}

}  // namespace dflash::model
