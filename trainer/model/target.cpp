// Target model: load, packed forward with capture, logits, forward_with (see target.h).
#include "trainer/model/target.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <functional>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "trainer/model/safetensors.h"
#include "trainer/model/target_cache.h"
#include "trainer/model/target_ops.h"
#include "trainer/model/target_pass.h"
#include "trainer/model/target_qwen35.h"

namespace dflash::model {


// ---- weight names and loading ---------------------------------------------------------------

namespace {

std::string layer_prefix(int64_t i) { return fmt::format("model.layers.{}.", i); }

bool is_float(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble;
}

std::vector<int64_t> expected_shape(const HfConfig& c, const std::string& name) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  auto ends = [&](const char* suffix) {
    std::string s(suffix);
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return {c.vocab_size, H};
  if (name == "model.norm.weight" || ends("input_layernorm.weight") ||
      ends("post_attention_layernorm.weight"))
    return {H};
  if (ends("q_norm.weight") || ends("k_norm.weight")) return {hd};
  if (ends("q_proj.weight")) return {c.q_dim(), H};
  if (ends("k_proj.weight") || ends("v_proj.weight")) return {c.kv_dim(), H};
  if (ends("o_proj.weight")) return {H, c.q_dim()};
  if (ends("gate_proj.weight") || ends("up_proj.weight")) return {I, H};
  if (ends("down_proj.weight")) return {H, I};
  return {};
}

// Opens the checkpoint, checks names, dtypes and shapes of every tensor against the config.
st::SafeTensors open_checked(const std::string& dir, const HfConfig& cfg) {
  st::SafeTensors file = st::SafeTensors::open(dir);
  std::vector<std::string> expected =
      target_weight_names(cfg, cfg.num_hidden_layers, /*lm_head=*/!cfg.tie_word_embeddings);
  std::vector<std::string> tolerated;
  for (const auto& n : file.names()) {
    // Old checkpoints store RoPE buffers; a tied checkpoint may still store lm_head.weight.
    bool rotary = n.size() >= 19 && n.compare(n.size() - 19, 19, "rotary_emb.inv_freq") == 0;
    if (rotary || (cfg.tie_word_embeddings && n == "lm_head.weight")) tolerated.push_back(n);
  }
  std::vector<std::string> all = expected;
  all.insert(all.end(), tolerated.begin(), tolerated.end());
  try {
    file.expect_names(all);
  } catch (const UserError& e) {
    throw_user("model '{}' (config {}, {} layers, tie_word_embeddings {}): {}", dir, cfg.path,
               cfg.num_hidden_layers, cfg.tie_word_embeddings, e.what());
  }
  for (const auto& n : expected) {
    const st::TensorInfo& ti = file.info(n);
    if (!is_float(ti.dtype))
      throw_user("model '{}': tensor '{}' in '{}' has dtype {}, expected a float type (BF16, F16, "
                 "F32)", dir, n, ti.file, c10::toString(ti.dtype));
    std::vector<int64_t> want = expected_shape(cfg, n);
    if (ti.shape != want)
      throw_user("model '{}': tensor '{}' in '{}' has shape [{}], but config {} implies [{}]", dir,
                 n, ti.file, fmt::join(ti.shape, ", "), cfg.path, fmt::join(want, ", "));
  }
  if (cfg.tie_word_embeddings && file.has("lm_head.weight")) {
    const st::TensorInfo& ti = file.info("lm_head.weight");
    if (ti.shape != expected_shape(cfg, "lm_head.weight"))
      throw_user("model '{}': tensor 'lm_head.weight' in '{}' has shape [{}], expected [{}, {}]",
                 dir, ti.file, fmt::join(ti.shape, ", "), cfg.vocab_size, cfg.hidden_size);
  }
  return file;
}

// Copies (name -> destination) pairs, several at a time on CUDA (host-side copies from the
// mapping overlap with host-to-device transfers).
void run_loads(const st::SafeTensors& file,
               const std::vector<std::pair<std::string, at::Tensor>>& jobs, at::Device device) {
  const size_t threads = device.is_cuda() ? std::min<size_t>(8, jobs.size()) : 1;
  if (threads <= 1) {
    for (const auto& [name, dst] : jobs) file.load_into(name, dst);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    try {
      c10::InferenceMode guard;
      for (size_t i = next++; i < jobs.size(); i = next++) file.load_into(jobs[i].first, jobs[i].second);
    } catch (...) {
      std::lock_guard<std::mutex> lk(error_mu);
      if (!error) error = std::current_exception();
      next = jobs.size();
    }
  };
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads; ++t) pool.emplace_back(worker);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

}  // namespace

std::vector<std::string> target_weight_names(const HfConfig& cfg, int64_t num_layers, bool lm_head) {
  std::vector<std::string> n = {"model.embed_tokens.weight"};
  for (int64_t i = 0; i < num_layers; ++i) {
    std::string p = layer_prefix(i);
    for (const char* s : {"input_layernorm.weight", "post_attention_layernorm.weight",
                          "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
      n.push_back(p + s);
    if (cfg.qk_norm) {
      n.push_back(p + "self_attn.q_norm.weight");
      n.push_back(p + "self_attn.k_norm.weight");
    }
  }
  if (num_layers == cfg.num_hidden_layers) n.push_back("model.norm.weight");
  if (lm_head) n.push_back("lm_head.weight");
  return n;
}

void check_target_weights(const std::string& dir, const HfConfig& cfg) {
  if (cfg.family != TargetFamily::Dense) return;  // the hybrid families check their weights at load
  (void)open_checked(dir, cfg);
}

TargetModel TargetModel::load(const std::string& dir, at::ScalarType dtype, at::Device device,
                              const TargetLoadOptions& opts) {
  c10::InferenceMode guard;
  if (!is_float(dtype)) throw_user("target model: dtype {} is not a float type", c10::toString(dtype));
  TargetModel m;
  m.cfg_ = load_hf_config(dir);
  m.dtype_ = dtype;
  m.device_ = device;
  if (m.cfg_.family != TargetFamily::Dense) {  // qwen3_moe, qwen3_5, qwen3_5_moe
    m.hybrid_ = HybridTarget::load(m.cfg_, dir, dtype, device, opts);
    return m;
  }
  const HfConfig& c = m.cfg_;
  int64_t L = opts.num_layers < 0 ? c.num_hidden_layers : opts.num_layers;
  if (L > c.num_hidden_layers)
    throw_user("target model '{}': asked for {} layers, config {} has {}", dir, L, c.path,
               c.num_hidden_layers);
  bool want_head = opts.lm_head && L == c.num_hidden_layers;
  st::SafeTensors file = open_checked(dir, c);

  auto opt = at::TensorOptions().dtype(dtype).device(device);
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  std::vector<std::pair<std::string, at::Tensor>> jobs;
  m.embed_ = at::empty({c.vocab_size, H}, opt);
  jobs.emplace_back("model.embed_tokens.weight", m.embed_);
  m.layers_.resize(L);
  for (int64_t i = 0; i < L; ++i) {
    Layer& w = m.layers_[i];
    std::string p = layer_prefix(i);
    w.input_norm = at::empty({H}, opt);
    w.post_norm = at::empty({H}, opt);
    w.wqkv = at::empty({qd + 2 * kvd, H}, opt);
    w.wo = at::empty({H, qd}, opt);
    w.w_gate_up = at::empty({2 * I, H}, opt);
    w.w_down = at::empty({H, I}, opt);
    jobs.emplace_back(p + "input_layernorm.weight", w.input_norm);
    jobs.emplace_back(p + "post_attention_layernorm.weight", w.post_norm);
    jobs.emplace_back(p + "self_attn.q_proj.weight", w.wqkv.narrow(0, 0, qd));
    jobs.emplace_back(p + "self_attn.k_proj.weight", w.wqkv.narrow(0, qd, kvd));
    jobs.emplace_back(p + "self_attn.v_proj.weight", w.wqkv.narrow(0, qd + kvd, kvd));
    jobs.emplace_back(p + "self_attn.o_proj.weight", w.wo);
    jobs.emplace_back(p + "mlp.gate_proj.weight", w.w_gate_up.narrow(0, 0, I));
    jobs.emplace_back(p + "mlp.up_proj.weight", w.w_gate_up.narrow(0, I, I));
    jobs.emplace_back(p + "mlp.down_proj.weight", w.w_down);
    if (c.qk_norm) {
      w.q_norm = at::empty({hd}, opt);
      w.k_norm = at::empty({hd}, opt);
      jobs.emplace_back(p + "self_attn.q_norm.weight", w.q_norm);
      jobs.emplace_back(p + "self_attn.k_norm.weight", w.k_norm);
    }
  }
  if (want_head) {
    m.norm_ = at::empty({H}, opt);
    jobs.emplace_back("model.norm.weight", m.norm_);
    if (c.tie_word_embeddings) {
      m.lm_head_ = m.embed_;
    } else {
      m.lm_head_ = at::empty({c.vocab_size, H}, opt);
      jobs.emplace_back("lm_head.weight", m.lm_head_);
    }
  }
  // Largest first, so that the parallel copies finish together.
  std::stable_sort(jobs.begin(), jobs.end(),
                   [](const auto& a, const auto& b) { return a.second.numel() > b.second.numel(); });
  run_loads(file, jobs, device);
  for (const auto& [name, dst] : jobs) st::check_finite(dst, file.info(name).file, name);
  m.inv_freq_ = rope_inv_freq(c).to(device);
  return m;
}

TargetModel TargetModel::random(const HfConfig& cfg, at::ScalarType dtype, at::Device device,
                                uint64_t seed, double std) {
  c10::InferenceMode guard;
  TargetModel m;
  m.cfg_ = cfg;
  m.dtype_ = dtype;
  m.device_ = device;
  if (cfg.family != TargetFamily::Dense) {
    m.hybrid_ = HybridTarget::random(cfg, dtype, device, seed, std);
    return m;
  }
  at::Generator gen = at::globalContext().defaultGenerator(device);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  auto opt = at::TensorOptions().dtype(dtype).device(device);
  auto lin = [&](std::vector<int64_t> shape) { return at::normal(0.0, std, shape, gen, opt); };
  auto norm = [&](int64_t n) { return at::normal(1.0, 0.1, {n}, gen, opt); };
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
  const double out_scale = 1.0 / std::sqrt(2.0 * double(cfg.num_hidden_layers));
  m.embed_ = lin({cfg.vocab_size, H});
  for (int64_t i = 0; i < cfg.num_hidden_layers; ++i) {
    Layer w;
    w.input_norm = norm(H);
    w.post_norm = norm(H);
    if (cfg.qk_norm) {
      w.q_norm = norm(cfg.head_dim);
      w.k_norm = norm(cfg.head_dim);
    }
    w.wqkv = lin({cfg.q_dim() + 2 * cfg.kv_dim(), H});
    w.wo = lin({H, cfg.q_dim()}).mul_(out_scale);
    w.w_gate_up = lin({2 * I, H});
    w.w_down = lin({H, I}).mul_(out_scale);
    m.layers_.push_back(std::move(w));
  }
  m.norm_ = norm(H);
  m.lm_head_ = cfg.tie_word_embeddings ? m.embed_ : lin({cfg.vocab_size, H});
  m.inv_freq_ = rope_inv_freq(cfg).to(device);
  return m;
}

// ---- accessors (dispatching to the hybrid families) ---------------------------------------------

int64_t TargetModel::num_layers_loaded() const {
  return hybrid_ ? hybrid_->num_layers_loaded() : int64_t(layers_.size());
}
bool TargetModel::has_lm_head() const { return hybrid_ ? hybrid_->has_lm_head() : lm_head_.defined(); }
const at::Tensor& TargetModel::embed_tokens() const { return hybrid_ ? hybrid_->embed_tokens() : embed_; }
const at::Tensor& TargetModel::final_norm() const { return hybrid_ ? hybrid_->final_norm() : norm_; }
const at::Tensor& TargetModel::lm_head() const { return hybrid_ ? hybrid_->lm_head() : lm_head_; }

// ---- forward ---------------------------------------------------------------------------------

// One pass over a set of tokens (target_pass.h).
struct TargetModel::Pass : TargetPass {};

at::Tensor TargetModel::run_layers(Pass& pass) const {
  const HfConfig& c = cfg_;
  const int64_t T = pass.ids.size(0);
  const int64_t I = c.intermediate_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  const double eps = c.rms_norm_eps;

  at::Tensor x = at::embedding(embed_, pass.ids);  // [T, H], the residual stream
  for (int64_t l = 0; l < pass.run_layers; ++l) {
    const Layer& w = layers_[l];
    at::Tensor h = ops::rms_norm(x, w.input_norm, eps);
    at::Tensor qkv = at::mm(h, w.wqkv.t());  // [T, (nq + 2 nkv) hd]
    auto [q, k, v] = ops::qkv_heads(qkv, nq, nkv, hd, w.q_norm, w.k_norm, eps, pass.cos, pass.sin);

    at::Tensor attn = pass.attention(l, q, k, v);
    x.addmm_(attn.reshape({T, nq * hd}), w.wo.t());
    h = ops::rms_norm(x, w.post_norm, eps);
    at::Tensor gu = at::mm(h, w.w_gate_up.t());  // [T, 2I]
    x.addmm_(ops::silu_mul(gu, I), w.w_down.t());
    pass.after_layer(l, x);
  }
  return x;
}

at::Tensor TargetModel::final_logits(const at::Tensor& hidden) const {
  if (!lm_head_.defined())
    throw_user("target model: logits need the final norm and lm_head, which were not loaded");
  return at::mm(ops::rms_norm(hidden, norm_, cfg_.rms_norm_eps), lm_head_.t()).to(at::kFloat);
}

TargetModel::Output TargetModel::forward(const at::Tensor& ids_in, const at::Tensor& cu_seqlens,
                                         const std::vector<int64_t>& layer_ids) const {
  if (hybrid_) return hybrid_->forward(ids_in, cu_seqlens, layer_ids);
  c10::InferenceMode guard;
  check_target_ids(ids_in, cfg_.vocab_size);
  check_capture_layer_ids(layer_ids, num_layers_loaded());
  Pass pass;
  pass.pack(ids_in, cu_seqlens, inv_freq_, device_);
  Output out;
  out.captured = pass.capture_into(layer_ids, cfg_.hidden_size, at::TensorOptions().dtype(dtype_).device(device_));
  if (!lm_head_.defined()) {
    if (layer_ids.empty()) throw_user("target forward: no lm_head loaded and no layers to capture");
    pass.run_layers = layer_ids.back() + 1;
    run_layers(pass);
    return out;
  }
  pass.run_layers = num_layers_loaded();
  at::Tensor x = run_layers(pass);
  out.logits = final_logits(x);
  return out;
}

at::Tensor TargetModel::capture(const at::Tensor& ids_in, const at::Tensor& cu_seqlens,
                                const std::vector<int64_t>& layer_ids) const {
  if (hybrid_) return hybrid_->capture(ids_in, cu_seqlens, layer_ids);
  c10::InferenceMode guard;
  if (layer_ids.empty()) throw_user("target capture: no layer ids");
  check_target_ids(ids_in, cfg_.vocab_size);
  check_capture_layer_ids(layer_ids, num_layers_loaded());
  Pass pass;
  pass.pack(ids_in, cu_seqlens, inv_freq_, device_);
  pass.capture_into(layer_ids, cfg_.hidden_size, at::TensorOptions().dtype(dtype_).device(device_));
  pass.run_layers = layer_ids.back() + 1;
  run_layers(pass);
  return pass.captured;
}

TargetModel::Output TargetModel::forward_with(const at::Tensor& ids_in, const at::Tensor& positions,
                                              const std::vector<int64_t>& layer_ids,
                                              const Attention& attend,
                                              const at::Tensor& logit_rows,
                                              const LinearMixer* linear) const {
  if (hybrid_) return hybrid_->forward_with(ids_in, positions, layer_ids, attend, logit_rows, linear);
  c10::InferenceMode guard;
  if (!lm_head_.defined()) throw_user("target forward: the model was loaded without lm_head");
  check_target_ids(ids_in, cfg_.vocab_size);
  check_capture_layer_ids(layer_ids, num_layers_loaded());
  const int64_t T = ids_in.size(0);
  DFLASH_CHECK(positions.dim() == 1 && positions.size(0) == T, "forward_with: {} positions for {} tokens",
               positions.numel(), T);
  Pass pass;
  pass.at_positions(ids_in, positions, inv_freq_, device_, attend);
  Output out;
  out.captured = pass.capture_into(layer_ids, cfg_.hidden_size, at::TensorOptions().dtype(dtype_).device(device_));
  pass.run_layers = num_layers_loaded();
  at::Tensor x = run_layers(pass);
  if (logit_rows.defined()) x = x.index_select(0, logit_rows.to(device_));
  out.logits = x.size(0) ? final_logits(x) : at::empty({0, cfg_.vocab_size}, x.options().dtype(at::kFloat));
  return out;
}

at::Tensor TargetModel::decode_logits(const at::Tensor& ids, const at::Tensor& positions,
                                      const Attention& attend) const {
  return decode_with(ids, positions, attend, {}).logits;
}

TargetModel::Output TargetModel::decode_with(const at::Tensor& ids, const at::Tensor& positions,
                                             const Attention& attend, const std::vector<int64_t>& layer_ids) const {
  if (hybrid_) throw std::logic_error("decode_logits: dense families only");
  if (!lm_head_.defined()) throw_user("target forward: the model was loaded without lm_head");
  check_capture_layer_ids(layer_ids, num_layers_loaded());
  Pass pass;
  pass.ids = ids;
  std::tie(pass.cos, pass.sin) = ops::rope_cos_sin(positions, inv_freq_);
  pass.attend = &attend;
  Output out;
  out.captured = pass.capture_into(layer_ids, cfg_.hidden_size, at::TensorOptions().dtype(dtype_).device(device_));
  pass.run_layers = num_layers_loaded();
  out.logits = final_logits(run_layers(pass));
  return out;
}

std::vector<std::vector<int64_t>> TargetModel::generate(
    const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens,
    bool stop_at_eos) const {
  return greedy_generate(*this, prompts, max_new_tokens,
                         stop_at_eos ? cfg_.eos_token_ids : std::vector<int64_t>{});
}

// ---- run settings ------------------------------------------------------------------------------

std::vector<int64_t> default_layer_ids(int64_t num_layers, int64_t k) {
  if (k < 1) throw_user("target.num_features must be >= 1, got {}", k);
  if (k == 1) return {num_layers / 2};
  if (num_layers < 5 || k > num_layers - 3)
    throw_user("cannot pick {} capture layers between layer 1 and layer {} of a {}-layer target; "
               "give target.layer_ids explicitly", k, num_layers - 3, num_layers);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < k; ++i)
    ids.push_back(int64_t(std::nearbyint(1.0 + double(i) * double(num_layers - 4) / double(k - 1))));
  return ids;
}

std::vector<int64_t> resolve_layer_ids(const HfConfig& cfg, const std::vector<int64_t>& explicit_ids,
                                       int64_t num_features, const std::string& what) {
  if (explicit_ids.empty()) return default_layer_ids(cfg.num_hidden_layers, num_features);
  for (size_t i = 0; i < explicit_ids.size(); ++i) {
    if (explicit_ids[i] < 0 || explicit_ids[i] >= cfg.num_hidden_layers)
      throw_user("{}: layer id {} is outside [0, {}) (num_hidden_layers of {})", what,
                 explicit_ids[i], cfg.num_hidden_layers, cfg.path);
    if (i && explicit_ids[i] <= explicit_ids[i - 1])
      throw_user("{}: layer ids must be strictly increasing, got {} after {}", what,
                 explicit_ids[i], explicit_ids[i - 1]);
  }
  return explicit_ids;
}

at::ScalarType resolve_dtype(const std::string& name, at::Device device, const std::string& what) {
  if (name == "auto") return device.is_cuda() ? at::kBFloat16 : at::kFloat;
  if (name == "bfloat16" || name == "bf16") return at::kBFloat16;
  if (name == "float16" || name == "fp16" || name == "half") return at::kHalf;
  if (name == "float32" || name == "fp32" || name == "float") return at::kFloat;
  throw_user("{}: unknown dtype '{}' (auto, bfloat16, float16, float32)", what, name);
}

// ---- drafter side ----------------------------------------------------------------------------

TargetEmbeddings load_target_embeddings(const std::string& dir, at::ScalarType dtype,
                                        at::Device device) {
  c10::InferenceMode guard(false);
  TargetEmbeddings e;
  e.config = load_hf_config(dir);
  if (e.config.family != TargetFamily::Dense) {
    std::tie(e.embed_tokens, e.lm_head) = load_hybrid_embeddings(e.config, dir, dtype, device);
    e.tied = e.config.tie_word_embeddings;
    e.embed_tokens.requires_grad_(false);
    e.lm_head.requires_grad_(false);
    return e;
  }
  st::SafeTensors file = open_checked(dir, e.config);
  const std::vector<int64_t> shape = {e.config.vocab_size, e.config.hidden_size};
  e.embed_tokens = file.load("model.embed_tokens.weight", dtype, device, &shape);
  e.tied = e.config.tie_word_embeddings;
  e.lm_head = e.tied ? e.embed_tokens : file.load("lm_head.weight", dtype, device, &shape);
  st::check_finite(e.embed_tokens, file.info("model.embed_tokens.weight").file, "model.embed_tokens.weight");
  if (!e.tied) st::check_finite(e.lm_head, file.info("lm_head.weight").file, "lm_head.weight");
  e.embed_tokens.requires_grad_(false);
  e.lm_head.requires_grad_(false);
  return e;
}

}  // namespace dflash::model
