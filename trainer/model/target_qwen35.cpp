// HybridTarget (target_qwen35.h): packed forward with capture, logits, greedy generation.
#include "trainer/model/target_qwen35.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "trainer/model/target_ops.h"

namespace dflash::model {

// One pass: packed documents (training capture, forward) or the tokens of a TargetCache extend
// (forward_with: the cache's attention and linear mixers).
struct HybridTarget::Pass {
  at::Tensor ids;            // [T] int64 on device
  at::Tensor cos, sin;       // [T, rotary_dim / 2] float32
  std::vector<int64_t> cu;   // packed: host offsets
  at::Tensor cu_dev, pos;    // packed: int32 offsets, int64 positions, on device
  int64_t max_len = 0;
  int64_t run_layers = 0;
  std::vector<int64_t> capture_ids;
  at::Tensor captured;
  const TargetModel::Attention* attend = nullptr;   // forward_with
  const TargetModel::LinearMixer* mix = nullptr;    // forward_with
};

namespace {

std::vector<int64_t> host_cu(const at::Tensor& cu_seqlens, int64_t T) {
  if (cu_seqlens.dim() != 1 || cu_seqlens.numel() < 2 ||
      (cu_seqlens.scalar_type() != at::kLong && cu_seqlens.scalar_type() != at::kInt))
    throw_user("target forward: cu_seqlens must be a 1-D int32/int64 tensor [n_docs + 1], got {} of shape [{}]",
               c10::toString(cu_seqlens.scalar_type()), fmt::join(cu_seqlens.sizes(), ", "));
  at::Tensor h = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> cu(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
  if (cu.front() != 0 || cu.back() != T)
    throw_user("target forward: cu_seqlens must start at 0 and end at the token count {}, got {} .. {}",
               T, cu.front(), cu.back());
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw_user("target forward: cu_seqlens must be strictly increasing (document {} is empty or "
                 "negative: {} -> {})", i - 1, cu[i - 1], cu[i]);
  return cu;
}

void check_ids(const at::Tensor& ids, const HfConfig& c) {
  if (ids.dim() != 1 || ids.scalar_type() != at::kLong)
    throw_user("target forward: ids must be a 1-D int64 tensor, got {} of shape [{}]",
               c10::toString(ids.scalar_type()), fmt::join(ids.sizes(), ", "));
  if (ids.numel() == 0) throw_user("target forward: no tokens");
  auto [lo, hi] = at::aminmax(ids);
  int64_t l = lo.item<int64_t>(), h = hi.item<int64_t>();
  if (l < 0 || h >= c.vocab_size)
    throw_user("target forward: token id {} is outside the vocabulary [0, {})", l < 0 ? l : h, c.vocab_size);
  for (auto [key, id] : {std::pair{"image_token_id", c.image_token_id}, std::pair{"video_token_id", c.video_token_id}})
    if (id && (ids == *id).any().item<bool>())
      throw_user("target forward: the tokens hold {} {} of {}: vision inputs are not supported "
                 "(text-only targets; pixel_values are never read)", key, *id, c.path);
}

void check_layer_ids(const std::vector<int64_t>& ids, int64_t loaded) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= loaded)
      throw_user("target capture: layer id {} is outside [0, {}) (loaded decoder layers)", ids[i], loaded);
    if (i && ids[i] <= ids[i - 1])
      throw_user("target capture: layer ids must be strictly increasing, got {} after {}", ids[i], ids[i - 1]);
  }
}

// RoPE over the leading cos.size(1) * 2 dims of every head, the rest passed through.
at::Tensor partial_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rd = cos.size(1) * 2, hd = x.size(-1);
  if (rd == hd) return ops::rope(x, cos, sin);
  return at::cat({ops::rope(x.narrow(-1, 0, rd), cos, sin), x.narrow(-1, rd, hd - rd)}, -1);
}

}  // namespace

DeltaNetSpec HybridTarget::dn_spec() const {
  DeltaNetSpec s;
  s.nk = cfg_.linear_num_key_heads;
  s.nv = cfg_.linear_num_value_heads;
  s.dk = cfg_.linear_key_head_dim;
  s.dv = cfg_.linear_value_head_dim;
  s.kernel = cfg_.linear_conv_kernel_dim;
  s.eps = cfg_.rms_norm_eps;
  return s;
}

at::Tensor HybridTarget::norm(const at::Tensor& x, const at::Tensor& w) const {
  if (!cfg_.zero_centered_norm) return ops::rms_norm(x, w, cfg_.rms_norm_eps);
  if (x.is_cuda())  // w holds 1 + w in the model dtype
    return std::get<0>(at::_fused_rms_norm(x.contiguous(), {x.size(-1)}, w, cfg_.rms_norm_eps));
  // As transformers: normalise and scale in float32, then cast.
  at::Tensor xf = x.to(at::kFloat);
  return (xf * at::rsqrt(xf.pow(2).mean(-1, true) + cfg_.rms_norm_eps) * w).to(x.scalar_type());
}

at::Tensor HybridTarget::attention(const Layer& w, int64_t l, const at::Tensor& h, Pass& pass) const {
  const HfConfig& c = cfg_;
  const int64_t T = h.size(0), nq = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const double scale = 1.0 / std::sqrt(double(hd));
  at::Tensor qkv = at::mm(h, w.wqkv.t());
  at::Tensor q, k, v, gate;
  if (!c.attn_output_gate && !c.zero_centered_norm && c.rotary_dim == hd) {
    std::tie(q, k, v) = ops::qkv_heads(qkv, nq, nkv, hd, w.q_norm, w.k_norm, c.rms_norm_eps, pass.cos, pass.sin);
  } else {
    const int64_t qrows = nq * hd * (c.attn_output_gate ? 2 : 1);
    at::Tensor qg = qkv.narrow(1, 0, qrows).view({T, nq, qrows / nq});
    q = qg.narrow(2, 0, hd);
    if (c.attn_output_gate) gate = qg.narrow(2, hd, hd).reshape({T, nq * hd});
    k = qkv.narrow(1, qrows, nkv * hd).view({T, nkv, hd});
    v = qkv.narrow(1, qrows + nkv * hd, nkv * hd).view({T, nkv, hd});
    q = partial_rope(norm(q, w.q_norm), pass.cos, pass.sin);
    k = partial_rope(norm(k, w.k_norm), pass.cos, pass.sin);
  }
  at::Tensor attn = pass.attend ? (*pass.attend)(l, q, k, v)
                                : ops::varlen_causal_attention(q, k, v, pass.cu, pass.cu_dev, pass.max_len, scale);
  attn = attn.reshape({T, nq * hd});
  if (gate.defined()) attn = attn * at::sigmoid(gate);
  return at::mm(attn, w.wo.t());
}

at::Tensor HybridTarget::run_layers(Pass& pass) const {
  const HfConfig& c = cfg_;
  const int64_t H = c.hidden_size;
  const DeltaNetSpec dn = dn_spec();
  const MoeSpec ms{c.num_experts_per_tok, c.norm_topk_prob};
  at::Tensor x = at::embedding(embed_, pass.ids);
  size_t next_capture = 0;
  for (int64_t l = 0; l < pass.run_layers; ++l) {
    const Layer& w = layers_[l];
    at::Tensor h = norm(x, w.input_norm);
    if (w.linear) {
      x.add_(pass.mix ? (*pass.mix)(l, h) : deltanet_forward(h, pass.cu, w.dn, dn));
    } else {
      x.add_(attention(w, l, h, pass));
    }
    h = norm(x, w.post_norm);
    if (w.moe)
      x.add_(moe_forward(h, w.experts, ms));
    else
      x.addmm_(ops::silu_mul(at::mm(h, w.w_gate_up.t()), w.w_down.size(1)), w.w_down.t());
    if (next_capture < pass.capture_ids.size() && pass.capture_ids[next_capture] == l) {
      pass.captured.narrow(1, int64_t(next_capture) * H, H).copy_(x);
      ++next_capture;
    }
  }
  return x;
}

at::Tensor HybridTarget::final_logits(const at::Tensor& hidden) const {
  if (!lm_head_.defined())
    throw_user("target model: logits need the final norm and lm_head, which were not loaded");
  return at::mm(norm(hidden, norm_), lm_head_.t()).to(at::kFloat);
}

HybridTarget::Pass HybridTarget::make_pass(const at::Tensor& ids_in, const at::Tensor& cu_seqlens) const {
  check_ids(ids_in, cfg_);
  Pass pass;
  const int64_t T = ids_in.size(0);
  pass.ids = ids_in.to(device_);
  pass.cu = host_cu(cu_seqlens, T);
  for (size_t b = 0; b + 1 < pass.cu.size(); ++b) pass.max_len = std::max(pass.max_len, pass.cu[b + 1] - pass.cu[b]);
  pass.cu_dev = at::tensor(pass.cu, at::kLong).to(at::kInt).to(device_);
  pass.pos = ops::positions_from_cu(pass.cu, T).to(device_);
  std::tie(pass.cos, pass.sin) = ops::rope_cos_sin(pass.pos, inv_freq_);
  return pass;
}

at::Tensor HybridTarget::capture(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                                 const std::vector<int64_t>& layer_ids) const {
  c10::InferenceMode guard;
  if (layer_ids.empty()) throw_user("target capture: no layer ids");
  check_layer_ids(layer_ids, num_layers_loaded());
  Pass pass = make_pass(ids, cu_seqlens);
  pass.capture_ids = layer_ids;
  pass.captured = at::empty({ids.size(0), int64_t(layer_ids.size()) * cfg_.hidden_size},
                            at::TensorOptions().dtype(dtype_).device(device_));
  pass.run_layers = layer_ids.back() + 1;
  run_layers(pass);
  return pass.captured;
}

TargetModel::Output HybridTarget::forward(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                                          const std::vector<int64_t>& layer_ids) const {
  c10::InferenceMode guard;
  check_layer_ids(layer_ids, num_layers_loaded());
  if (!lm_head_.defined()) {
    if (layer_ids.empty()) throw_user("target forward: no lm_head loaded and no layers to capture");
    return {capture(ids, cu_seqlens, layer_ids), {}};
  }
  Pass pass = make_pass(ids, cu_seqlens);
  TargetModel::Output out;
  if (!layer_ids.empty()) {
    pass.capture_ids = layer_ids;
    pass.captured = at::empty({ids.size(0), int64_t(layer_ids.size()) * cfg_.hidden_size},
                              at::TensorOptions().dtype(dtype_).device(device_));
    out.captured = pass.captured;
  }
  pass.run_layers = num_layers_loaded();
  out.logits = final_logits(run_layers(pass));
  return out;
}

TargetModel::Output HybridTarget::forward_with(const at::Tensor& ids, const at::Tensor& positions,
                                               const std::vector<int64_t>& layer_ids,
                                               const TargetModel::Attention& attend,
                                               const at::Tensor& logit_rows,
                                               const TargetModel::LinearMixer* linear) const {
  c10::InferenceMode guard;
  if (!lm_head_.defined()) throw_user("target forward: the model was loaded without lm_head");
  check_ids(ids, cfg_);
  check_layer_ids(layer_ids, num_layers_loaded());
  for (const auto& w : layers_)
    DFLASH_CHECK(!w.linear || linear, "forward_with: a {} target needs a LinearMixer", cfg_.model_type);
  const int64_t T = ids.size(0);
  Pass pass;
  pass.ids = ids.to(device_);
  std::tie(pass.cos, pass.sin) = ops::rope_cos_sin(positions.to(device_), inv_freq_);
  pass.attend = &attend;
  pass.mix = linear;
  pass.capture_ids = layer_ids;
  TargetModel::Output out;
  if (!layer_ids.empty()) {
    pass.captured = at::empty({T, int64_t(layer_ids.size()) * cfg_.hidden_size},
                              at::TensorOptions().dtype(dtype_).device(device_));
    out.captured = pass.captured;
  }
  pass.run_layers = num_layers_loaded();
  at::Tensor x = run_layers(pass);
  if (logit_rows.defined()) x = x.index_select(0, logit_rows.to(device_));
  out.logits = x.size(0) ? final_logits(x) : at::empty({0, cfg_.vocab_size}, x.options().dtype(at::kFloat));
  return out;
}

// ---- the recurrent cache of TargetCache --------------------------------------------------------

HybridRecurrentCache::HybridRecurrentCache(const HybridTarget& model, int64_t rows) : model_(model) {
  c10::InferenceMode guard;
  const auto& layers = model.layers();
  const HfConfig& c = model.config();
  auto opt = layers.empty() ? at::TensorOptions() : model.embed_tokens().options();
  for (int64_t l = 0; l < int64_t(layers.size()); ++l) {
    if (!layers[l].linear) continue;
    linear_.push_back(l);
    state_.resize(layers.size());
    DeltaNetState& s = state_[l];
    s.conv = at::zeros({rows, c.linear_conv_dim(), c.linear_conv_kernel_dim - 1}, opt);
    s.rec = at::zeros({rows, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                      opt.dtype(at::kFloat));
  }
  saved_ = state_;
  for (int64_t l : linear_) saved_[l] = {state_[l].conv.clone(), state_[l].rec.clone()};
}

TargetModel::LinearMixer HybridRecurrentCache::mixer(const std::vector<int64_t>& act, const std::vector<int64_t>& cu) {
  at::Tensor rows = at::tensor(act, at::kLong).to(model_.embed_tokens().device());
  const HfConfig& c = model_.config();
  DeltaNetSpec s;
  s.nk = c.linear_num_key_heads;
  s.nv = c.linear_num_value_heads;
  s.dk = c.linear_key_head_dim;
  s.dv = c.linear_value_head_dim;
  s.kernel = c.linear_conv_kernel_dim;
  s.eps = c.rms_norm_eps;
  return [this, rows, cu, s](int64_t l, const at::Tensor& h) {
    return deltanet_forward(h, cu, model_.layers()[l].dn, s, &state_[l], rows);
  };
}

void HybridRecurrentCache::snapshot() {
  for (int64_t l : linear_) {
    saved_[l].conv.copy_(state_[l].conv);
    saved_[l].rec.copy_(state_[l].rec);
  }
}

void HybridRecurrentCache::restore(int64_t row) {
  for (int64_t l : linear_) {
    state_[l].conv[row].copy_(saved_[l].conv[row]);
    state_[l].rec[row].copy_(saved_[l].rec[row]);
  }
}

void HybridRecurrentCache::reset(int64_t row) {
  for (int64_t l : linear_) {
    state_[l].conv[row].zero_();
    state_[l].rec[row].zero_();
  }
}

}  // namespace dflash::model
