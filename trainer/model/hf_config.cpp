// config.json parsing for the supported target families (see hf_config.h).
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

constexpr const char* kSupported =
    "model_type \"qwen3\" (Qwen3ForCausalLM), \"llama\" (LlamaForCausalLM), \"qwen3_moe\" "
    "(Qwen3MoeForCausalLM), \"qwen3_5\" / \"qwen3_5_text\" (Qwen3_5ForConditionalGeneration, "
    "Qwen3_5ForCausalLM), \"qwen3_5_moe\" / \"qwen3_5_moe_text\" (Qwen3_5MoeForConditionalGeneration, "
    "Qwen3_5MoeForCausalLM)";

struct Family {
  const char* model_type;
  TargetFamily family;
  bool wrapper;  // the text model is under "text_config", weights under model.language_model.
  std::vector<std::string> architectures;
};

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"qwen3", TargetFamily::Dense, false, {"Qwen3ForCausalLM", "Qwen3Model"}},
      {"llama", TargetFamily::Dense, false, {"LlamaForCausalLM", "LlamaModel"}},
      {"qwen3_moe", TargetFamily::Qwen3Moe, false, {"Qwen3MoeForCausalLM", "Qwen3MoeModel"}},
      {"qwen3_5", TargetFamily::Qwen35, true, {"Qwen3_5ForConditionalGeneration"}},
      {"qwen3_5_text", TargetFamily::Qwen35, false, {"Qwen3_5ForCausalLM", "Qwen3_5TextModel"}},
      {"qwen3_5_moe", TargetFamily::Qwen35, true, {"Qwen3_5MoeForConditionalGeneration"}},
      {"qwen3_5_moe_text", TargetFamily::Qwen35, false, {"Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextModel"}},
  };
  return f;
}

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

void read_rope(const json::Value& root, const std::string& where, HfConfig& c, bool partial_ok) {
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
    if (v.is_array() && k != "mrope_section")
      throw_user("{}: RoPE parameter '{}' (a list) is not supported", w, k);
  }
  if (const json::Value* t = params->find("rope_theta"); t && !t->is_null())
    c.rope.theta = check_positive_finite(t->as_double(w + ".rope_theta"), w + ".rope_theta", kMaxTheta);
  std::string type = "default";
  if (const json::Value* t = params->find("rope_type"); t && !t->is_null())
    type = t->as_string(w + ".rope_type");
  else if (const json::Value* t2 = params->find("type"); t2 && !t2->is_null())
    type = t2->as_string(w + ".type");
  if (const json::Value* p = params->find("partial_rotary_factor"); p && !p->is_null()) {
    double f = p->as_double(w + ".partial_rotary_factor");
    if (f != 1.0 && !partial_ok) throw_user("{}.partial_rotary_factor != 1 is not supported", w);
    if (!(f > 0 && f <= 1)) throw_user("{}.partial_rotary_factor must be in (0, 1], found {}", w, f);
    c.rotary_dim = int64_t(double(c.head_dim) * f);  // int(), as transformers
  }
  // Multimodal RoPE (qwen3_5): with text-only input all three position streams are the token
  // position, so every frequency sees the same position and it reduces to ordinary RoPE.
  if (!partial_ok && (params->find("mrope_section") || params->find("mrope_interleaved")))
    throw_user("{}: multimodal RoPE (mrope_section) is only supported for qwen3_5 targets", w);
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

namespace {

// The qwen3_moe / qwen3_5 keys (read from the text config `r`).
void read_family_keys(const Reader& r, const json::Value& top, HfConfig& c) {
  const std::string& where = r.where;
  const bool moe = c.family == TargetFamily::Qwen3Moe || c.model_type.rfind("qwen3_5_moe", 0) == 0;
  if (moe) {
    // transformers 5 writes num_local_experts (attribute_map), released checkpoints num_experts.
    c.num_experts = r.get("num_experts") ? r.pos_int("num_experts") : r.pos_int("num_local_experts");
    c.num_experts_per_tok = r.pos_int("num_experts_per_tok");
    c.moe_intermediate_size = r.pos_int("moe_intermediate_size");
    if (c.num_experts_per_tok > c.num_experts)
      throw_user("{}: num_experts_per_tok {} exceeds num_experts {}", where, c.num_experts_per_tok,
                 c.num_experts);
  }
  if (c.family == TargetFamily::Qwen3Moe) {
    c.norm_topk_prob = r.boolean("norm_topk_prob", false);
    c.decoder_sparse_step = r.pos_int("decoder_sparse_step", 1);
    if (const json::Value* m = r.get("mlp_only_layers"))
      for (const auto& v : m->as_array(r.what("mlp_only_layers"))) {
        int64_t l = v.as_int(r.what("mlp_only_layers"));
        if (l < 0 || l >= c.num_hidden_layers)
          throw_user("{}: mlp_only_layers holds {}, outside [0, {})", where, l, c.num_hidden_layers);
        c.mlp_only_layers.push_back(l);
      }
    if (r.get("shared_expert_intermediate_size") && r.pos_int("shared_expert_intermediate_size") > 0)
      throw_user("{}: shared_expert_intermediate_size is not supported for qwen3_moe", where);
    return;
  }
  // qwen3_5 family
  c.zero_centered_norm = true;
  c.attn_output_gate = r.boolean("attn_output_gate", true);
  if (moe) {
    c.norm_topk_prob = true;  // Qwen3_5MoeTopKRouter always renormalises
    c.shared_expert_intermediate_size = r.pos_int("shared_expert_intermediate_size");
    if (const json::Value* m = r.get("mlp_only_layers"); m && !m->as_array(r.what("mlp_only_layers")).empty())
      throw_user("{}: mlp_only_layers is not supported for {}", where, c.model_type);
  }
  c.linear_conv_kernel_dim = r.pos_int("linear_conv_kernel_dim", 4);
  c.linear_key_head_dim = r.pos_int("linear_key_head_dim", 128);
  c.linear_value_head_dim = r.pos_int("linear_value_head_dim", 128);
  c.linear_num_key_heads = r.pos_int("linear_num_key_heads", 16);
  c.linear_num_value_heads = r.pos_int("linear_num_value_heads", 32);
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0)
    throw_user("{}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}", where,
               c.linear_num_value_heads, c.linear_num_key_heads);
  if (const json::Value* lt = r.get("layer_types")) {
    for (const auto& v : lt->as_array(r.what("layer_types"))) {
      const std::string& t = v.as_string(r.what("layer_types"));
      if (t != "full_attention" && t != "linear_attention")
        throw_user("{}: layer_types holds '{}', not supported (full_attention, linear_attention)",
                   where, t);
      c.layer_types.push_back(t);
    }
    if (int64_t(c.layer_types.size()) != c.num_hidden_layers)
      throw_user("{}: layer_types has {} entries, num_hidden_layers is {}", where,
                 c.layer_types.size(), c.num_hidden_layers);
  } else {
    int64_t every = r.pos_int("full_attention_interval", 4);
    for (int64_t i = 0; i < c.num_hidden_layers; ++i)
      c.layer_types.push_back((i + 1) % every ? "linear_attention" : "full_attention");
  }
  if (const json::Value* v = top.find("vision_config"); v && !v->is_null()) c.has_vision = true;
  for (auto [key, dst] : {std::pair{"image_token_id", &c.image_token_id},
                          std::pair{"video_token_id", &c.video_token_id}})
    if (const json::Value* v = top.find(key); v && !v->is_null() && c.weight_prefix != "model.")
      *dst = v->as_int(fmt::format("{}: key '{}'", where, key));
}

}  // namespace

bool HfConfig::is_moe_layer(int64_t l) const {
  if (num_experts <= 0) return false;
  for (int64_t m : mlp_only_layers)
    if (m == l) return false;
  return (l + 1) % decoder_sparse_step == 0;
}

HfConfig parse_hf_config(const std::string& text, const std::string& where) {
  json::Value root = json::parse(text, where);
  root.as_object(where);
  HfConfig c;
  c.path = where;
  const json::Value* mt = root.find("model_type");
  if (!mt || mt->is_null()) throw_user("{}: no 'model_type' (supported: {})", where, kSupported);
  c.model_type = mt->as_string(fmt::format("{}: key 'model_type'", where));
  const Family* fam = nullptr;
  for (const auto& f : families())
    if (c.model_type == f.model_type) fam = &f;
  if (!fam)
    throw_user("{}: model_type '{}' is not supported (supported: {})", where, c.model_type,
               kSupported);
  c.family = fam->family;
  if (const json::Value* a = root.find("architectures"); a && !a->is_null()) {
    for (const auto& v : a->as_array(fmt::format("{}: key 'architectures'", where))) {
      const std::string& s = v.as_string(fmt::format("{}: key 'architectures'", where));
      if (std::find(fam->architectures.begin(), fam->architectures.end(), s) == fam->architectures.end())
        throw_user("{}: architecture '{}' is not supported for model_type '{}' (supported: {})",
                   where, s, c.model_type, kSupported);
    }
  }
  // The text model's keys: top level, or text_config of a multimodal wrapper.
  const json::Value* text_node = &root;
  std::string text_where = where;
  if (fam->wrapper) {
    text_node = root.find("text_config");
    if (!text_node || !text_node->is_object())
      throw_user("{}: model_type '{}' needs a 'text_config' object", where, c.model_type);
    text_where = where + " text_config";
    c.weight_prefix = "model.language_model.";
  }
  Reader r{*text_node, text_where};
  Reader top{root, where};
  const bool qwen = c.model_type != "llama";
  const bool q35 = c.family == TargetFamily::Qwen35;
  c.qk_norm = qwen;
  c.hidden_size = r.pos_int("hidden_size", std::nullopt, kMaxWidth);
  c.num_hidden_layers = r.pos_int("num_hidden_layers", std::nullopt, kMaxLayers);
  c.num_attention_heads = r.pos_int("num_attention_heads", std::nullopt, kMaxHeads);
  c.num_key_value_heads = r.pos_int("num_key_value_heads", c.num_attention_heads, kMaxHeads);
  int64_t hd_default = c.model_type == "qwen3" ? 128 : q35 ? 256 : c.hidden_size / c.num_attention_heads;
  c.head_dim = r.pos_int("head_dim", std::max<int64_t>(1, hd_default), kMaxHeads);
  // MoE families use intermediate_size only for their dense layers (absent in qwen3_5_moe).
  if (c.family == TargetFamily::Dense || c.model_type.rfind("qwen3_5_text", 0) == 0 || c.model_type == "qwen3_5")
    c.intermediate_size = r.pos_int("intermediate_size", std::nullopt, kMaxFfn);
  else
    c.intermediate_size = r.get("intermediate_size") ? r.pos_int("intermediate_size", std::nullopt, kMaxFfn)
                          : c.family == TargetFamily::Qwen3Moe ? 6144 : 0;  // transformers' default
  c.vocab_size = r.pos_int("vocab_size");
  c.max_position_embeddings = r.pos_int("max_position_embeddings", qwen ? 32768 : 2048);
  c.rms_norm_eps = r.number("rms_norm_eps", 1e-6);
  if (!std::isfinite(c.rms_norm_eps) || !(c.rms_norm_eps > 0) || c.rms_norm_eps >= 1)
    throw_user("{} must be a finite number in (0, 1), found {}", r.what("rms_norm_eps"), c.rms_norm_eps);
  // A wrapper's tie_word_embeddings is its own top-level key (transformers reads that one).
  c.tie_word_embeddings = fam->wrapper ? top.boolean("tie_word_embeddings", r.boolean("tie_word_embeddings", false))
                                       : r.boolean("tie_word_embeddings", false);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    throw_user("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", text_where,
               c.num_attention_heads, c.num_key_value_heads);
  if (c.head_dim % 2 != 0) throw_user("{}: head_dim {} must be even for RoPE", text_where, c.head_dim);
  if (const json::Value* act = r.get("hidden_act"); act && act->as_string(r.what("hidden_act")) != "silu")
    throw_user("{}: hidden_act '{}' is not supported (only silu)", text_where, act->as_string(""));
  if (r.boolean("attention_bias", false))
    throw_user("{}: attention_bias true is not supported", text_where);
  if (r.boolean("mlp_bias", false)) throw_user("{}: mlp_bias true is not supported", text_where);
  if (r.boolean("use_sliding_window", false))
    throw_user("{}: use_sliding_window true is not supported", text_where);
  if (!q35) {
    if (const json::Value* lt = r.get("layer_types")) {
      for (const auto& v : lt->as_array(r.what("layer_types")))
        if (v.as_string(r.what("layer_types")) != "full_attention")
          throw_user("{}: layer type '{}' is not supported for model_type '{}' (only full_attention)",
                     text_where, v.as_string(""), c.model_type);
    }
  }
  if (const json::Value* tp = r.get("pretraining_tp"); tp && tp->as_int(r.what("pretraining_tp")) != 1)
    throw_user("{}: pretraining_tp != 1 is not supported", text_where);
  c.rotary_dim = c.head_dim;
  if (q35) {
    c.rotary_dim = int64_t(double(c.head_dim) * r.number("partial_rotary_factor", 0.25));
  }
  read_rope(*text_node, text_where, c, /*partial_ok=*/q35);
  if (c.rotary_dim % 2 != 0 || c.rotary_dim <= 0)
    throw_user("{}: rotary dims {} (head_dim * partial_rotary_factor) must be even and positive",
               text_where, c.rotary_dim);
  if (c.family != TargetFamily::Dense) read_family_keys(r, root, c);
  auto read_ids = [&](const Reader& rd) {
    if (const json::Value* b = rd.get("bos_token_id")) c.bos_token_id = b->as_int(rd.what("bos_token_id"));
    if (const json::Value* e = rd.get("eos_token_id")) {
      c.eos_token_ids.clear();
      if (e->is_array()) {
        for (const auto& v : e->as_array(rd.what("eos_token_id")))
          c.eos_token_ids.push_back(v.as_int(rd.what("eos_token_id")));
      } else {
        c.eos_token_ids.push_back(e->as_int(rd.what("eos_token_id")));
      }
    }
  };
  read_ids(r);
  if (fam->wrapper) read_ids(top);
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (const json::Value* d = r.get(key); d && d->is_string()) c.torch_dtype = d->as_string(key);
    if (const json::Value* d = top.get(key); d && d->is_string()) c.torch_dtype = d->as_string(key);
  }
  return c;
}

HfConfig load_hf_config(const std::string& path) {
  std::string file = files::is_dir(path) ? files::join(path, "config.json") : path;
  if (!files::exists(file)) throw_user("model config '{}' does not exist", file);
  json::Value v = json::parse_file(file);
  return parse_hf_config(v.dump(), file);
}

at::Tensor rope_inv_freq(const HfConfig& cfg) {
  const int64_t dim = cfg.rotary_dim > 0 ? cfg.rotary_dim : cfg.head_dim;
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
