// config.json parsing for qwen3/llama targets (see hf_config.h).
#include "trainer/model/hf_config.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"

namespace dflash::model {

namespace {

// Upper bounds of the sizes in a config.json (the largest public models are far below them).
constexpr int64_t kMaxSize = int64_t{1} << 24;  // vocab_size, max_position_embeddings
constexpr int64_t kMaxWidth = int64_t{1} << 16;  // hidden_size
constexpr int64_t kMaxFfn = int64_t{1} << 20;    // intermediate_size
constexpr int64_t kMaxLayers = 1024;             // num_hidden_layers
constexpr int64_t kMaxHeads = 1024;              // heads, head_dim
constexpr double kMaxTheta = 1e12;               // rope_theta

// A finite number in (0, max]; UserError naming the key otherwise.
double check_positive_finite(double v, const std::string& what, double max) {
  if (!std::isfinite(v) || v <= 0 || v > max)
    throw_user("{} must be a finite number in (0, {:g}], found {}", what, max, v);
  return v;
}

constexpr const char* kSupported = "model_type \"qwen3\" (Qwen3ForCausalLM) and \"llama\" (LlamaForCausalLM)";

struct Reader {
  const json::Value& root;
  const std::string& where;

  std::string what(const std::string& key) const { return fmt::format("{}: key '{}'", where, key); }
  const json::Value* get(const std::string& key) const {
    const json::Value* v = root.find(key);
    return (v && !v->is_null()) ? v : nullptr;
  }
  // In [1, max]: a size beyond any real model is a corrupt or mistyped config.json, refused
  // before anything is allocated from it.
  int64_t pos_int(const std::string& key, std::optional<int64_t> def = std::nullopt, int64_t max = kMaxSize) const {
    const json::Value* v = get(key);
    if (!v) {
      if (def) return *def;
      throw_user("{}: required key '{}' is missing", where, key);
    }
    int64_t x = v->as_int(what(key));
    if (x <= 0) throw_user("{} must be positive, found {}", what(key), x);
    if (x > max) throw_user("{} must be at most {}, found {} (corrupt config?)", what(key), max, x);
    return x;
  }
  double number(const std::string& key, double def) const {
    const json::Value* v = get(key);
    return v ? v->as_double(what(key)) : def;
  }
  bool boolean(const std::string& key, bool def) const {
    const json::Value* v = get(key);
    return v ? v->as_bool(what(key)) : def;
  }
};

void read_rope(const json::Value& root, const std::string& where, HfConfig& c) {
  // transformers 5: rope_parameters {rope_type, rope_theta, ...}; transformers 4: top-level
  // rope_theta and an optional rope_scaling {type|rope_type, factor, ...}.
  const json::Value* params = root.find("rope_parameters");
  const json::Value* scaling = root.find("rope_scaling");
  std::string src = "rope_parameters";
  if (!params || params->is_null()) {
    params = scaling;
    src = "rope_scaling";
  }
  if (const json::Value* t = root.find("rope_theta"); t && !t->is_null())
    c.rope.theta = t->as_double(fmt::format("{}: key 'rope_theta'", where));
  check_positive_finite(c.rope.theta, fmt::format("{}: key 'rope_theta'", where), kMaxTheta);
  if (!params || params->is_null()) return;
  std::string w = fmt::format("{}: key '{}'", where, src);
  const auto& obj = params->as_object(w);
  for (const auto& [k, v] : obj) {
    if (v.is_object())
      throw_user("{}: per-layer-type RoPE parameters ('{}') are not supported", w, k);
  }
  if (const json::Value* t = params->find("rope_theta"); t && !t->is_null())
    c.rope.theta = check_positive_finite(t->as_double(w + ".rope_theta"), w + ".rope_theta", kMaxTheta);
  std::string type = "default";
  if (const json::Value* t = params->find("rope_type"); t && !t->is_null())
    type = t->as_string(w + ".rope_type");
  else if (const json::Value* t2 = params->find("type"); t2 && !t2->is_null())
    type = t2->as_string(w + ".type");
  if (const json::Value* p = params->find("partial_rotary_factor");
      p && !p->is_null() && p->as_double(w + ".partial_rotary_factor") != 1.0)
    throw_user("{}.partial_rotary_factor != 1 is not supported", w);
  c.rope.type = type;
  if (type == "default") return;
  if (type != "llama3")
    throw_user("{}: RoPE type '{}' is not supported (supported: default, llama3)", w, type);
  auto need = [&](const char* key) -> const json::Value& {
    const json::Value* v = params->find(key);
    if (!v || v->is_null()) throw_user("{}: llama3 RoPE needs '{}'", w, key);
    return *v;
  };
  c.rope.factor = need("factor").as_double(w + ".factor");
  c.rope.low_freq_factor = need("low_freq_factor").as_double(w + ".low_freq_factor");
  c.rope.high_freq_factor = need("high_freq_factor").as_double(w + ".high_freq_factor");
  const json::Value* om = params->find("original_max_position_embeddings");
  c.rope.original_max_position_embeddings =
      (om && !om->is_null()) ? om->as_int(w + ".original_max_position_embeddings")
                             : c.max_position_embeddings;
  for (double v : {c.rope.factor, c.rope.low_freq_factor, c.rope.high_freq_factor})
    if (!std::isfinite(v)) throw_user("{}: llama3 RoPE factors must be finite", w);
  if (c.rope.factor <= 0 || c.rope.low_freq_factor <= 0 ||
      c.rope.high_freq_factor <= c.rope.low_freq_factor || c.rope.original_max_position_embeddings <= 0)
    throw_user("{}: llama3 RoPE needs factor > 0, 0 < low_freq_factor < high_freq_factor and "
               "original_max_position_embeddings > 0", w);
}

}  // namespace

HfConfig parse_hf_config(const std::string& text, const std::string& where) {
  json::Value root = json::parse(text, where);
  root.as_object(where);
  Reader r{root, where};
  HfConfig c;
  c.path = where;
  const json::Value* mt = r.get("model_type");
  if (!mt) throw_user("{}: no 'model_type' (supported: {})", where, kSupported);
  c.model_type = mt->as_string(r.what("model_type"));
  if (c.model_type != "qwen3" && c.model_type != "llama")
    throw_user("{}: model_type '{}' is not supported (supported: {})", where, c.model_type,
               kSupported);
  const char* arch = c.model_type == "qwen3" ? "Qwen3ForCausalLM" : "LlamaForCausalLM";
  if (const json::Value* a = r.get("architectures")) {
    for (const auto& v : a->as_array(r.what("architectures"))) {
      const std::string& s = v.as_string(r.what("architectures"));
      if (s != arch && s != (c.model_type == "qwen3" ? "Qwen3Model" : "LlamaModel"))
        throw_user("{}: architecture '{}' is not supported for model_type '{}' (supported: {})",
                   where, s, c.model_type, kSupported);
    }
  }
  const bool qwen = c.model_type == "qwen3";
  c.qk_norm = qwen;
  c.hidden_size = r.pos_int("hidden_size", std::nullopt, kMaxWidth);
  c.num_hidden_layers = r.pos_int("num_hidden_layers", std::nullopt, kMaxLayers);
  c.num_attention_heads = r.pos_int("num_attention_heads", std::nullopt, kMaxHeads);
  c.num_key_value_heads = r.pos_int("num_key_value_heads", c.num_attention_heads, kMaxHeads);
  c.head_dim = r.pos_int("head_dim", std::max<int64_t>(1, qwen ? 128 : c.hidden_size / c.num_attention_heads), kMaxHeads);
  c.intermediate_size = r.pos_int("intermediate_size", std::nullopt, kMaxFfn);
  c.vocab_size = r.pos_int("vocab_size");
  c.max_position_embeddings = r.pos_int("max_position_embeddings", qwen ? 32768 : 2048);
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  if (!std::isfinite(c.rms_norm_eps) || !(c.rms_norm_eps > 0) || c.rms_norm_eps >= 1)
    throw_user("{} must be a finite number in (0, 1), found {}", r.what("rms_norm_eps"), c.rms_norm_eps);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw_user("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where,
               c.num_attention_heads, c.num_key_value_heads);
  if (c.head_dim % 2 != 0) throw_user("{}: head_dim {} must be even for RoPE", where, c.head_dim);
  if (const json::Value* act = r.get("hidden_act"); act && act->as_string(r.what("hidden_act")) != "silu")
    throw_user("{}: hidden_act '{}' is not supported (only silu)", where, act->as_string(""));
  if (r.boolean("attention_bias", false))
    throw_user("{}: attention_bias true is not supported", where);
  if (r.boolean("mlp_bias", false)) throw_user("{}: mlp_bias true is not supported", where);
  if (r.boolean("use_sliding_window", false))
    throw_user("{}: use_sliding_window true is not supported", where);
  if (const json::Value* lt = r.get("layer_types")) {
    for (const auto& v : lt->as_array(r.what("layer_types")))
      if (v.as_string(r.what("layer_types")) != "full_attention")
        throw_user("{}: layer type '{}' is not supported (only full_attention)", where,
                   v.as_string(""));
  }
  if (const json::Value* tp = r.get("pretraining_tp"); tp && tp->as_int(r.what("pretraining_tp")) != 1)
    throw_user("{}: pretraining_tp != 1 is not supported", where);
  read_rope(root, where, c);
  if (const json::Value* b = r.get("bos_token_id")) c.bos_token_id = b->as_int(r.what("bos_token_id"));
  if (const json::Value* e = r.get("eos_token_id")) {
    if (e->is_array()) {
      for (const auto& v : e->as_array(r.what("eos_token_id")))
        c.eos_token_ids.push_back(v.as_int(r.what("eos_token_id")));
    } else {
      c.eos_token_ids.push_back(e->as_int(r.what("eos_token_id")));
    }
  }
  for (const char* key : {"torch_dtype", "dtype"})
    if (const json::Value* d = r.get(key); d && d->is_string()) c.torch_dtype = d->as_string(key);
  return c;
}

HfConfig load_hf_config(const std::string& path) {
  std::string file = files::is_dir(path) ? files::join(path, "config.json") : path;
  if (!files::exists(file)) throw_user("model config '{}' does not exist", file);
  json::Value v = json::parse_file(file);
  return parse_hf_config(v.dump(), file);
}

at::Tensor rope_inv_freq(const HfConfig& cfg) {
  const int64_t dim = cfg.head_dim;
  // As transformers: 1 / theta ** (arange(0, dim, 2).float() / dim), in float32.
  at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / double(dim);
  at::Tensor inv = at::reciprocal(at::pow(cfg.rope.theta, exponent));
  if (cfg.rope.type != "llama3") return inv;
  const RopeConfig& r = cfg.rope;
  const double old_len = double(r.original_max_position_embeddings);
  const double low_wavelen = old_len / r.low_freq_factor;
  const double high_wavelen = old_len / r.high_freq_factor;
  at::Tensor wavelen = at::reciprocal(inv) * (2 * M_PI);
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  at::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  at::Tensor medium = at::logical_and(wavelen >= high_wavelen, wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

}  // namespace dflash::model
