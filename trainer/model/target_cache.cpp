// trainer/model/target_cache.h: the target's per-row KV cache and greedy decoding on it.
#include "trainer/model/target_cache.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "trainer/model/target_ops.h"
#include "trainer/model/target_qwen35.h"

namespace dflash::model {

int64_t cached_keys(int64_t n, int64_t capacity) { return std::min(capacity, (n + 63) / 64 * 64); }

std::vector<int64_t> attended_rows(const std::vector<int64_t>& active, int64_t rows) {
  int64_t n = 1;
  while (n < int64_t(active.size())) n *= 2;
  int64_t idle = std::min(n, rows) - int64_t(active.size());  // idle rows to add
  std::vector<char> on(rows, 0);
  for (int64_t b : active) on[b] = 1;
  std::vector<int64_t> att;
  for (int64_t b = 0; b < rows; ++b) {
    if (!on[b]) {
      if (idle == 0) continue;
      --idle;
    }
    att.push_back(b);
  }
  return att;
}

TargetCache::TargetCache(const TargetModel& model, int64_t rows, int64_t capacity,
                         std::vector<int64_t> capture_ids)
    : model_(model), rows_(rows), capacity_(capacity), capture_ids_(std::move(capture_ids)) {
  if (!model.has_lm_head()) throw_user("target cache: the model was loaded without lm_head");
  reset(rows, capacity);
}

void TargetCache::allocate(int64_t rows, int64_t capacity) {
  c10::InferenceMode guard;
  const HfConfig& c = model_.config();
  auto opt = at::TensorOptions().dtype(model_.dtype()).device(model_.device());
  kbuf_.clear(), vbuf_.clear(), k_.clear(), v_.clear();  // free the old buffers first
  for (int64_t l = 0; l < model_.num_layers_loaded(); ++l) {
    // Zeros, not empty: the invariant of target_cache.h starts here.
    kbuf_.push_back(at::zeros({rows, capacity, c.num_key_value_heads, c.head_dim}, opt));
    vbuf_.push_back(at::zeros({rows, capacity, c.num_key_value_heads, c.head_dim}, opt));
  }
  ++allocations_;
}

void TargetCache::reset(int64_t rows, int64_t capacity) {
  c10::InferenceMode guard;
  if (rows < 1 || capacity < 1)
    throw_user("target cache: needs >= 1 row and capacity >= 1, got {} rows of {}", rows, capacity);
  const bool fits = !kbuf_.empty() && rows <= kbuf_.front().size(0) && capacity <= kbuf_.front().size(1);
  if (!fits) {
    allocate(rows, capacity);
  } else {
    // The slots in use before the reset hold K/V; the view of the new rows x capacity is zeroed
    // as a whole (one memset per tensor; slots outside the view are never read).
    for (size_t l = 0; l < kbuf_.size(); ++l) {
      kbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity).zero_();
      vbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity).zero_();
    }
  }
  rows_ = rows, capacity_ = capacity;
  k_.clear(), v_.clear();
  for (size_t l = 0; l < kbuf_.size(); ++l) {
    const bool whole = rows == kbuf_[l].size(0) && capacity == kbuf_[l].size(1);
    k_.push_back(whole ? kbuf_[l] : kbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity));
    v_.push_back(whole ? vbuf_[l] : vbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity));
  }
  len_.assign(rows, 0);
  rec_.reset();
  base_.clear(), last_.clear();
  if (model_.hybrid()) {
    auto rec = std::make_shared<HybridRecurrentCache>(*model_.hybrid(), rows);
    if (!rec->empty()) rec_ = rec;
    base_.assign(rows, 0);
    last_.assign(rows, {});
  }
}

TargetCache::Step TargetCache::prefill(const std::vector<std::vector<int64_t>>& prompts, Logits logits) {
  if (int64_t(prompts.size()) != rows_)
    throw_user("target cache: prefill of {} prompts into a cache of {} rows", prompts.size(), rows_);
  for (int64_t b = 0; b < rows_; ++b)
    if (!prompts[b].empty() && len_[b] != 0)
      throw_user("target cache: prefill of row {} that already holds {} tokens", b, len_[b]);
  return extend(prompts, logits);
}

TargetCache::Step TargetCache::extend(const std::vector<std::vector<int64_t>>& tokens, Logits logits) {
  c10::InferenceMode guard;
  if (int64_t(tokens.size()) != rows_)
    throw_user("target cache: extend with {} token lists for {} rows", tokens.size(), rows_);
  const HfConfig& c = model_.config();
  const at::Device dev = model_.device();
  const int64_t nq = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const double scale = 1.0 / std::sqrt(double(hd));

  // Pack the tokens of the rows that run; slot of a token = its position in its row.
  Step st;
  st.offsets.assign(rows_ + 1, 0);
  std::vector<int64_t> flat, slot, row_of, arow_of, idx, act, cu = {0}, last;
  bool fresh = true;  // every row that runs is empty: packed causal attention, no cache reads
  int64_t n_max = 0, used = 0;
  for (int64_t b = 0; b < rows_; ++b) {
    const int64_t n = int64_t(tokens[b].size());
    st.offsets[b + 1] = st.offsets[b] + n;
    if (n == 0) continue;
    if (len_[b] + n > capacity_)
      throw_user("target cache: row {} would hold {} tokens, more than its capacity {}", b, len_[b] + n,
                 capacity_);
    fresh &= len_[b] == 0;
    for (int64_t i = 0; i < n; ++i) {
      flat.push_back(tokens[b][i]);
      slot.push_back(len_[b] + i);
      row_of.push_back(b);
      arow_of.push_back(int64_t(act.size()));
      idx.push_back(i);
    }
    act.push_back(b);
    cu.push_back(int64_t(flat.size()));
    last.push_back(int64_t(flat.size()) - 1);
    n_max = std::max(n_max, n);
    used = std::max(used, len_[b] + n);
  }
  if (flat.empty()) {
    if (logits != Logits::None) st.logits = at::empty({0, c.vocab_size}, at::TensorOptions().device(dev));
    return st;
  }
  used = cached_keys(used, capacity_);  // the slots past a row's length are masked zeros
  auto on_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
  at::Tensor ids = at::tensor(flat, at::kLong);
  at::Tensor pos = at::tensor(slot, at::kLong);
  at::Tensor rows_t = on_dev(row_of), slot_t = on_dev(slot);
  auto store = [&](int64_t l, const at::Tensor& k, const at::Tensor& v) {
    k_[l].index_put_({rows_t, slot_t}, k);
    v_[l].index_put_({rows_t, slot_t}, v);
  };

  TargetModel::Attention attend;
  at::Tensor kernel_meta;  // the causal kernel's tile metadata, shared by the layers
  if (fresh) {
    at::Tensor cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(dev);
    attend = [&, cu_dev](int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
      store(l, k, v);
      return ops::varlen_causal_attention(q, k, v, cu, cu_dev, n_max, scale, &kernel_meta);
    };
  } else {
    // The attention runs over attended_rows(act): the active rows and idle ones whose queries
    // are all padding.
    const std::vector<int64_t> att = attended_rows(act, rows_);
    const int64_t A = int64_t(att.size());
    {
      std::vector<int64_t> at_of(rows_, -1);
      for (int64_t a = 0; a < A; ++a) at_of[att[a]] = a;
      for (size_t t = 0; t < arow_of.size(); ++t) arow_of[t] = at_of[row_of[t]];
    }
    // Query i of attended row a (row b) sees slots [0, len_b + i]; padded queries (i >= n_b)
    // see the row's first slot only (a row of all -inf would give NaN; their output is dropped).
    const int64_t g = nq / nkv;
    std::vector<int64_t> lim(A * n_max);
    for (int64_t a = 0; a < A; ++a) {
      const int64_t b = att[a], n = int64_t(tokens[b].size());
      for (int64_t i = 0; i < n_max; ++i) lim[a * n_max + i] = i < n ? len_[b] + i : 0;
    }
    at::Tensor mask = at::arange(used, at::TensorOptions().dtype(at::kLong).device(dev)).view({1, 1, used}) <=
                      on_dev(lim).view({A, n_max, 1});  // [A, n_max, used]
    mask = mask.unsqueeze(1).expand({A, g, n_max, used}).reshape({A, 1, g * n_max, used});
    at::Tensor arow_t = on_dev(arow_of), idx_t = on_dev(idx);
    at::Tensor act_t = A == rows_ ? at::Tensor() : on_dev(att);
    attend = [&, mask, arow_t, idx_t, act_t, A, g](int64_t l, const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v) {
      store(l, k, v);
      at::Tensor ck = k_[l].narrow(1, 0, used), cv = v_[l].narrow(1, 0, used);
      if (act_t.defined()) ck = ck.index_select(0, act_t), cv = cv.index_select(0, act_t);
      // Padded queries [A, n_max, nq, hd] (zeros where a row has fewer tokens), GQA folded into
      // the query axis: kv head j serves q heads j*g .. j*g+g-1.
      at::Tensor qp = at::zeros({A, n_max, nq, hd}, q.options());
      qp.index_put_({arow_t, idx_t}, q);
      at::Tensor qf = qp.view({A, n_max, nkv, g, hd}).permute({0, 2, 3, 1, 4}).reshape({A, nkv, g * n_max, hd});
      at::Tensor o = at::scaled_dot_product_attention(qf, ck.transpose(1, 2), cv.transpose(1, 2), mask, 0.0,
                                                      /*is_causal=*/false, scale);
      o = o.view({A, nkv, g, n_max, hd}).permute({0, 3, 1, 2, 4}).reshape({A, n_max, nq, hd});
      return o.index({arow_t, idx_t});  // [T, nq, hd]
    };
  }
  at::Tensor logit_rows;  // undefined: all
  if (logits == Logits::Last) logit_rows = at::tensor(last, at::kLong);
  if (logits == Logits::None) logit_rows = at::empty({0}, at::kLong);
  TargetModel::LinearMixer mix;
  if (rec_) {
    rec_->snapshot();
    base_ = len_;
    last_ = tokens;
    mix = rec_->mixer(act, cu);
  }
  TargetModel::Output out = model_.forward_with(ids, pos, capture_ids_, attend, logit_rows, rec_ ? &mix : nullptr);
  for (int64_t b = 0; b < rows_; ++b) len_[b] += int64_t(tokens[b].size());
  if (logits != Logits::None) st.logits = out.logits;
  st.captured = out.captured;
  return st;
}

void TargetCache::crop(int64_t row, int64_t len) {
  std::vector<int64_t> lens = len_;
  lens.at(row) = len;
  crop(lens);
}

void TargetCache::crop(const std::vector<int64_t>& lens_in) {
  c10::InferenceMode guard;
  if (int64_t(lens_in.size()) != rows_)
    throw_user("target cache: crop with {} lengths for {} rows", lens_in.size(), rows_);
  for (int64_t b = 0; b < rows_; ++b)
    if (lens_in[b] < 0 || lens_in[b] > len_[b])
      throw_user("target cache: cannot crop row {} of {} tokens to {}", b, len_[b], lens_in[b]);
  std::vector<int64_t> lens = lens_in;
  // Recurrent layers cannot drop tokens: restore the state from before the last extend, crop
  // to there and replay the kept tokens of that extend.
  std::vector<std::vector<int64_t>> replay;
  bool any_replay = false;
  if (rec_) {
    replay.assign(rows_, {});
    for (int64_t b = 0; b < rows_; ++b) {
      if (lens[b] == len_[b]) continue;
      if (lens[b] == 0) {
        rec_->reset(b);
      } else if (lens[b] >= base_[b]) {
        rec_->restore(b);
        replay[b].assign(last_[b].begin(), last_[b].begin() + (lens[b] - base_[b]));
        any_replay = any_replay || !replay[b].empty();
        lens[b] = base_[b];
      } else {
        throw_user("target cache: row {} of a {} target can be cropped to 0 or inside its last "
                   "extend ([{}, {}]), not to {}", b, model_.config().model_type, base_[b], len_[b], lens[b]);
      }
    }
  }
  std::vector<int64_t> r, s;
  for (int64_t b = 0; b < rows_; ++b)
    for (int64_t t = lens[b]; t < len_[b]; ++t) r.push_back(b), s.push_back(t);
  len_ = lens;
  if (!r.empty()) {
    const at::Device dev = model_.device();
    at::Tensor rt = at::tensor(r, at::kLong).to(dev), slots = at::tensor(s, at::kLong).to(dev);
    at::Tensor zero = at::zeros({}, k_.front().options());
    for (size_t l = 0; l < k_.size(); ++l) {
      k_[l].index_put_({rt, slots}, zero);
      v_[l].index_put_({rt, slots}, zero);
    }
  }
  if (any_replay) extend(replay, Logits::None);
}

std::vector<std::vector<int64_t>> greedy_generate(const TargetModel& model,
                                                  const std::vector<std::vector<int64_t>>& prompts,
                                                  int64_t max_new_tokens,
                                                  const std::vector<int64_t>& stop_ids) {
  c10::InferenceMode guard;
  const int64_t B = int64_t(prompts.size());
  std::vector<std::vector<int64_t>> out(B);
  if (B == 0 || max_new_tokens <= 0) return out;
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    if (prompts[b].empty()) throw_user("target generate: prompt {} is empty", b);
    longest = std::max<int64_t>(longest, int64_t(prompts[b].size()));
  }
  const std::set<int64_t> stop(stop_ids.begin(), stop_ids.end());
  TargetCache cache(model, B, longest + max_new_tokens);
  at::Tensor next = cache.prefill(prompts, TargetCache::Logits::Last).logits.argmax(-1).to(at::kCPU);
  std::vector<int64_t> rows(B);  // rows[j]: the row of logits row j
  for (int64_t b = 0; b < B; ++b) rows[b] = b;
  std::vector<bool> done(B, false);
  while (true) {
    std::vector<std::vector<int64_t>> step(B);
    const int64_t* nx = next.data_ptr<int64_t>();
    for (size_t j = 0; j < rows.size(); ++j) {
      const int64_t b = rows[j], t = nx[j];
      out[b].push_back(t);
      if (stop.count(t) || int64_t(out[b].size()) >= max_new_tokens) done[b] = true;
      else step[b] = {t};
    }
    rows.clear();
    for (int64_t b = 0; b < B; ++b)
      if (!done[b]) rows.push_back(b);
    if (rows.empty()) break;
    next = cache.extend(step, TargetCache::Logits::All).logits.argmax(-1).to(at::kCPU);
  }
  return out;
}

}  // namespace dflash::model
