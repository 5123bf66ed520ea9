// trainer/eval/draft.h: the DFlash drafter's inference side with a context-only KV cache.
#include "trainer/eval/draft.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "trainer/model/target_cache.h"

namespace dflash::eval {
namespace {

at::Tensor rms(const at::Tensor& x, const at::Tensor& w, double eps) { return at::rms_norm(x, {x.size(-1)}, w, eps); }

// Rotate-half RoPE of x [..., L, heads, d] at positions pos (broadcastable to [..., L]), with the
// tables in x's dtype as the training forward builds them (trainer/model/drafter.cpp).
at::Tensor rope(const at::Tensor& x, const at::Tensor& pos, const at::Tensor& inv_freq) {
  at::Tensor f = pos.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [..., L, d/2]
  at::Tensor emb = at::cat({f, f}, -1).unsqueeze(-2);          // [..., L, 1, d]
  at::Tensor cos = emb.cos().to(x.scalar_type()), sin = emb.sin().to(x.scalar_type());
  const int64_t half = x.size(-1) / 2;
  at::Tensor rot = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
  return x * cos + rot * sin;
}

}  // namespace

DFlashProposer::DFlashProposer(const model::Drafter& drafter, const model::TargetModel& target)
    : drafter_(drafter), target_(target) {
  const auto& s = drafter.spec();
  if (drafter.device() != target.device() || drafter.dtype() != target.dtype())
    throw_user("draft proposer: the drafter is on {} in {}, the target on {} in {}", drafter.device().str(),
               c10::toString(drafter.dtype()), target.device().str(), c10::toString(target.dtype()));
  if (!target.has_lm_head()) throw_user("draft proposer: the target was loaded without lm_head");
  if (s.hidden_size != target.config().hidden_size || s.vocab_size != target.config().vocab_size)
    throw_user("draft proposer: drafter hidden/vocab {}/{} != target {}/{}", s.hidden_size, s.vocab_size,
               target.config().hidden_size, target.config().vocab_size);
  fc_ = drafter.param("fc.weight");
  hidden_norm_ = drafter.param("hidden_norm.weight");
  norm_ = drafter.param("norm.weight");
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    auto w = [&](const char* n) { return drafter.param(p + n); };
    layers_.push_back({w("input_layernorm.weight"), w("post_attention_layernorm.weight"),
                       w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight"),
                       w("self_attn.o_proj.weight"), w("self_attn.q_norm.weight"), w("self_attn.k_norm.weight"),
                       w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight")});
  }
  auto fopt = at::TensorOptions().dtype(at::kFloat).device(drafter.device());
  inv_freq_ = at::pow(s.rope_theta, at::arange(0, s.head_dim, 2, fopt.dtype(at::kLong)).to(at::kFloat) /
                                        double(s.head_dim))
                  .reciprocal();
}

void DFlashProposer::reset(int64_t rows, int64_t capacity) {
  c10::InferenceMode guard;
  const auto& s = drafter_.spec();
  len_.assign(rows, 0);
  capacity_ = capacity;
  const bool fits = !kbuf_.empty() && rows <= kbuf_.front().size(0) && capacity <= kbuf_.front().size(1);
  if (!fits) {  // new buffers (zeros: the invariant of draft.h)
    kbuf_.clear(), vbuf_.clear(), k_.clear(), v_.clear();
    auto opt = at::TensorOptions().dtype(drafter_.dtype()).device(drafter_.device());
    for (int64_t l = 0; l < s.num_layers; ++l) {
      kbuf_.push_back(at::zeros({rows, capacity, s.num_kv_heads, s.head_dim}, opt));
      vbuf_.push_back(at::zeros({rows, capacity, s.num_kv_heads, s.head_dim}, opt));
    }
    ++allocations_;
  } else {  // reuse: zero the part that the new batch sees
    for (size_t l = 0; l < kbuf_.size(); ++l) {
      kbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity).zero_();
      vbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity).zero_();
    }
  }
  k_.clear(), v_.clear();
  for (size_t l = 0; l < kbuf_.size(); ++l) {
    k_.push_back(kbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity));
    v_.push_back(vbuf_[l].narrow(0, 0, rows).narrow(1, 0, capacity));
  }
}

void DFlashProposer::add_context(const at::Tensor& features, const std::vector<int64_t>& offsets) {
  c10::InferenceMode guard;
  const auto& s = drafter_.spec();
  const int64_t rows = int64_t(len_.size());
  DFLASH_CHECK(int64_t(offsets.size()) == rows + 1, "add_context: {} offsets for {} rows", offsets.size(), rows);
  const int64_t T = offsets.back();
  if (T == 0) return;
  DFLASH_CHECK(features.dim() == 2 && features.size(0) >= T && features.size(1) == s.num_features() * s.hidden_size,
               "add_context: features of rank {} ({} columns) for {} tokens of {} x {}", features.dim(), features.size(-1), T, s.num_features(),
               s.hidden_size);
  std::vector<int64_t> row_of, pos;
  for (int64_t b = 0; b < rows; ++b) {
    const int64_t n = offsets[b + 1] - offsets[b];
    if (len_[b] + n > capacity_)
      throw_user("draft cache: row {} would hold {} context positions, capacity {}", b, len_[b] + n, capacity_);
    for (int64_t i = 0; i < n; ++i) row_of.push_back(b), pos.push_back(len_[b] + i);
  }
  const at::Device dev = drafter_.device();
  write_context(features.narrow(0, 0, T), at::tensor(row_of, at::kLong).to(dev), at::tensor(pos, at::kLong).to(dev));
  for (int64_t b = 0; b < rows; ++b) len_[b] += offsets[b + 1] - offsets[b];
}

void DFlashProposer::write_context(const at::Tensor& features, const at::Tensor& rows_t, const at::Tensor& pos_t) {
  const auto& s = drafter_.spec();
  const int64_t T = features.size(0);
  // C = hidden_norm(fc(features)) (DFLASH.md §1.1), then each layer's context keys and values.
  at::Tensor c = rms(at::linear(features.to(drafter_.dtype()), fc_), hidden_norm_, s.rms_norm_eps);
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    at::Tensor k = rms(at::linear(c, L.k).view({T, s.num_kv_heads, s.head_dim}), L.k_norm, s.rms_norm_eps);
    k = rope(k, pos_t, inv_freq_);
    at::Tensor v = at::linear(c, L.v).view({T, s.num_kv_heads, s.head_dim});
    k_[l].index_put_({rows_t, pos_t}, k);
    v_[l].index_put_({rows_t, pos_t}, v);
  }
}

void DFlashProposer::add_context_rows(const at::Tensor& features, const at::Tensor& start) {
  c10::InferenceMode guard;
  const auto& s = drafter_.spec();
  const int64_t rows = int64_t(len_.size()), n = features.size(1);
  DFLASH_CHECK(features.dim() == 3 && features.size(0) == rows && features.size(2) == s.num_features() * s.hidden_size,
               "add_context_rows: features must be [{}, n, {}]", rows, s.num_features() * s.hidden_size);
  at::Tensor pos = (start.view({rows, 1}) + at::arange(n, start.options()).view({1, n})).reshape({rows * n});
  at::Tensor row_of = at::arange(rows, start.options()).view({rows, 1}).expand({rows, n}).reshape({rows * n});
  write_context(features.reshape({rows * n, features.size(2)}), row_of, pos);
}

at::Tensor DFlashProposer::block_tokens(const at::Tensor& ids_t, const at::Tensor& pos_t, const at::Tensor& mask,
                                        const std::function<std::pair<at::Tensor, at::Tensor>(size_t)>& context) {
  const auto& s = drafter_.spec();
  const int64_t A = ids_t.size(0), bs = ids_t.size(1), H = s.hidden_size, hq = s.num_heads, hkv = s.num_kv_heads;
  const int64_t d = s.head_dim, g = hq / hkv;
  at::Tensor x = at::embedding(target_.embed_tokens(), ids_t);  // [A, bs, H]
  for (size_t l = 0; l < layers_.size(); ++l) {
    const Layer& L = layers_[l];
    at::Tensor h = rms(x, L.in_norm, s.rms_norm_eps);
    at::Tensor q = rope(rms(at::linear(h, L.q).view({A, bs, hq, d}), L.q_norm, s.rms_norm_eps), pos_t, inv_freq_);
    at::Tensor kb = rope(rms(at::linear(h, L.k).view({A, bs, hkv, d}), L.k_norm, s.rms_norm_eps), pos_t, inv_freq_);
    at::Tensor vb = at::linear(h, L.v).view({A, bs, hkv, d});
    auto [kc, vc] = context(l);
    at::Tensor k = at::cat({kc, kb}, 1).transpose(1, 2);  // [A, hkv, ctx + bs, d]; block k/v not stored
    at::Tensor v = at::cat({vc, vb}, 1).transpose(1, 2);
    // GQA folded into the query axis: kv head i serves q heads i*g .. i*g+g-1.
    at::Tensor qf = q.view({A, bs, hkv, g, d}).permute({0, 2, 3, 1, 4}).reshape({A, hkv, g * bs, d});
    at::Tensor o = at::scaled_dot_product_attention(qf, k, v, mask, 0.0, /*is_causal=*/false, 1.0 / std::sqrt(double(d)));
    o = o.view({A, hkv, g, bs, d}).permute({0, 3, 1, 2, 4}).reshape({A, bs, hq * d});
    x = x + at::linear(o, L.o);
    at::Tensor h2 = rms(x, L.post_norm, s.rms_norm_eps);
    x = x + at::linear(at::silu(at::linear(h2, L.gate)) * at::linear(h2, L.up), L.down);
  }
  at::Tensor hf = rms(x.narrow(1, 1, bs - 1), norm_, s.rms_norm_eps).reshape({A * (bs - 1), H});
  return at::mm(hf, target_.lm_head().t()).argmax(-1).view({A, bs - 1});
}

at::Tensor DFlashProposer::propose_block(const at::Tensor& last, const at::Tensor& start, int64_t ctx, int64_t bs,
                                         const std::function<std::pair<at::Tensor, at::Tensor>(size_t)>& context) {
  const auto& s = drafter_.spec();
  const int64_t A = last.size(0), g = s.num_heads / s.num_kv_heads;
  DFLASH_CHECK(bs >= 2 && bs <= s.block_size, "propose: block size {} outside [2, {}]", bs, s.block_size);
  at::Tensor ids = at::full({A, bs}, s.mask_token_id, last.options());
  ids.select(1, 0).copy_(last);
  at::Tensor pos = start.view({A, 1}) + at::arange(bs, start.options()).view({1, bs});
  // Visible keys of row j: context slots [0, start_j), then the whole block (non-causal).
  at::Tensor ctx_vis = at::arange(ctx, start.options()).view({1, ctx}) < start.view({A, 1});
  at::Tensor mask = at::cat({ctx_vis, at::ones({A, bs}, ctx_vis.options())}, 1);  // [A, ctx + bs]
  mask = mask.view({A, 1, 1, ctx + bs}).expand({A, 1, g * bs, ctx + bs});
  return block_tokens(ids, pos, mask, context);
}

at::Tensor DFlashProposer::propose_rows(const at::Tensor& last, const at::Tensor& start, int64_t window, int64_t bs) {
  c10::InferenceMode guard;
  DFLASH_CHECK(window >= 0 && window <= capacity_, "propose: window {} outside [0, {}]", window, capacity_);
  return propose_block(last, start, window, bs, [&](size_t l) {
    return std::pair{k_[l].narrow(1, 0, window), v_[l].narrow(1, 0, window)};
  });
}

std::vector<std::vector<int64_t>> DFlashProposer::propose(const std::vector<int64_t>& rows,
                                                          const std::vector<int64_t>& last,
                                                          const std::vector<int64_t>& start, int64_t bs) {
  c10::InferenceMode guard;
  const int64_t A = int64_t(rows.size()), R = int64_t(len_.size());
  if (A == 0) return {};
  for (int64_t j = 0; j < A; ++j)  // the context must end right before the block: positions [0, start)
    DFLASH_CHECK(len_.at(rows[j]) == start[j], "propose: row {} holds {} context positions, block starts at {}",
                 rows[j], len_[rows[j]], start[j]);
  // The block runs for model::attended_rows(rows) (the shapes of a cached attention,
  // target_cache.h): an idle row drafts after its own context and its tokens are dropped.
  const std::vector<int64_t> prow = model::attended_rows(rows, R);
  const int64_t P = int64_t(prow.size());
  std::vector<int64_t> slot_of(R, -1);  // row -> index into rows (-1: not requested)
  for (int64_t j = 0; j < A; ++j) slot_of[rows[j]] = j;
  std::vector<int64_t> plast, pstart;
  int64_t ctx = 0;
  for (int64_t b : prow) {
    const int64_t j = slot_of[b];
    plast.push_back(j >= 0 ? last[j] : drafter_.spec().mask_token_id);
    pstart.push_back(j >= 0 ? start[j] : len_[b]);
    ctx = std::max(ctx, pstart.back());
  }
  ctx = model::cached_keys(ctx, capacity_);  // the slots past a row's start are masked zeros
  const at::Device dev = drafter_.device();
  auto on_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
  at::Tensor rows_t = on_dev(prow);
  const bool all_rows = P == R;
  at::Tensor tok = propose_block(on_dev(plast), on_dev(pstart), ctx, bs, [&](size_t l) {
                     at::Tensor kc = k_[l].narrow(1, 0, ctx), vc = v_[l].narrow(1, 0, ctx);
                     if (!all_rows) kc = kc.index_select(0, rows_t), vc = vc.index_select(0, rows_t);
                     return std::pair{kc, vc};
                   }).to(at::kCPU).contiguous();
  std::vector<std::vector<int64_t>> out(A);
  const int64_t* t = tok.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) {
    const int64_t j = slot_of[prow[p]];
    if (j >= 0) out[j].assign(t + p * (bs - 1), t + (p + 1) * (bs - 1));
  }
  return out;
}

}  // namespace dflash::eval
