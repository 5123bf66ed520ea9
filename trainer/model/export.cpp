// trainer/model/export.h: Hugging Face export and import of the drafter (DFLASH.md §5).
#include "trainer/model/export.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/files.h"
#include "trainer/config.h"
#include "trainer/model/safetensors.h"
#include "core/json.h"

namespace dflash::model {
namespace {

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

void make_dirs(const std::string& path) {
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty() || exists(cur)) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST)
      throw_user("export: cannot create directory {}: {}", cur, std::strerror(errno));
  }
}

std::string num(double v) {
  // Shortest round-trip text; integral values without a fraction (rope_theta 1000000).
  return fmt::format("{}", v);
}

std::string int_list(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string opt_id(int64_t id) { return id >= 0 ? std::to_string(id) : "null"; }

// ---- config reading -----------------------------------------------------------------------------

struct Reader {
  const json::Value& root;
  std::string file;
  const json::Value& get(const std::string& key) const {
    const json::Value* v = root.find(key);
    if (!v) throw_user("{}: missing field '{}'", file, key);
    return *v;
  }
  int64_t i(const std::string& key) const { return get(key).as_int(file + ": field '" + key + "'"); }
  double d(const std::string& key) const { return get(key).as_double(file + ": field '" + key + "'"); }
  std::string what(const std::string& key) const { return file + ": field '" + key + "'"; }
};

std::vector<std::string> expected_names(const DrafterSpec& s) {
  std::vector<std::string> v;
  for (auto& [n, shape] : s.param_shapes()) v.push_back(n);
  return v;
}

}  // namespace

const char* dflash_modeling_py() {
  return
#include "dflash_py.inc"
      ;
}

std::string drafter_config_json(const DrafterSpec& s, const ExportRecord& rec) {
  std::string layer_types = "[";
  for (int64_t i = 0; i < s.num_layers; ++i) layer_types += (i ? ", " : "") + std::string("\"full_attention\"");
  layer_types += "]";
  std::string j = "{\n";
  auto add = [&](const std::string& key, const std::string& value) {
    j += fmt::format("  {}: {},\n", json::quote(key), value);
  };
  add("architectures", "[\"DFlashDraftModel\"]");
  add("auto_map", "{\"AutoModel\": \"dflash.DFlashDraftModel\"}");
  add("model_type", "\"qwen3\"");
  add("block_size", std::to_string(s.block_size));
  add("num_target_layers", std::to_string(s.num_target_layers));
  add("dflash_config", fmt::format("{{\"mask_token_id\": {}, \"target_layer_ids\": {}}}", s.mask_token_id,
                                   int_list(s.target_layer_ids)));
  add("hidden_size", std::to_string(s.hidden_size));
  add("intermediate_size", std::to_string(s.intermediate_size));
  add("num_hidden_layers", std::to_string(s.num_layers));
  add("num_attention_heads", std::to_string(s.num_heads));
  add("num_key_value_heads", std::to_string(s.num_kv_heads));
  add("head_dim", std::to_string(s.head_dim));
  add("hidden_act", "\"silu\"");
  add("rms_norm_eps", num(s.rms_norm_eps));
  add("rope_theta", num(s.rope_theta));
  add("rope_scaling", "null");
  add("max_position_embeddings", std::to_string(s.max_position_embeddings));
  add("attention_bias", "false");
  add("attention_dropout", "0.0");
  add("layer_types", layer_types);
  add("use_sliding_window", "false");
  add("sliding_window", "null");
  add("max_window_layers", std::to_string(s.num_layers));
  add("tie_word_embeddings", "false");
  add("vocab_size", std::to_string(s.vocab_size));
  add("bos_token_id", opt_id(s.bos_token_id));
  add("eos_token_id", opt_id(s.eos_token_id));
  add("initializer_range", num(s.initializer_range));
  add("use_cache", "true");
  add("torch_dtype", "\"bfloat16\"");
  if (!rec.target_path.empty() || !rec.target_model_type.empty()) {
    add("dflash_target", fmt::format("{{\"path\": {}, \"model_type\": {}, \"num_hidden_layers\": {}, "
                                     "\"hidden_size\": {}, \"vocab_size\": {}}}",
                                     json::quote(rec.target_path), json::quote(rec.target_model_type),
                                     rec.target_num_layers, rec.target_hidden_size, rec.target_vocab_size));
  }
  if (!rec.data_json.empty()) add("dflash_data", rec.data_json);
  if (!rec.version.empty()) add("dflash_version", json::quote(rec.version));
  j += "  \"dtype\": \"bfloat16\"\n}\n";
  return j;
}

DrafterSpec read_drafter_config(const std::string& path) {
  auto root = json::parse_file(path);
  root.as_object(path);
  Reader r{root, path};
  bool arch_ok = false;
  for (auto& a : r.get("architectures").as_array(r.what("architectures")))
    if (a.as_string(r.what("architectures")) == "DFlashDraftModel") arch_ok = true;
  if (!arch_ok) throw_user("{}: field 'architectures' must contain \"DFlashDraftModel\"", path);
  if (const auto* mt = root.find("model_type"); mt && mt->as_string(r.what("model_type")) != "qwen3")
    throw_user("{}: field 'model_type' is \"{}\"; dflash drafters are \"qwen3\"", path, mt->as_string(""));
  DrafterSpec s;
  s.hidden_size = r.i("hidden_size");
  s.intermediate_size = r.i("intermediate_size");
  s.num_layers = r.i("num_hidden_layers");
  s.num_heads = r.i("num_attention_heads");
  s.num_kv_heads = r.i("num_key_value_heads");
  s.head_dim = root.find("head_dim") ? r.i("head_dim") : (s.num_heads > 0 ? s.hidden_size / s.num_heads : 0);
  s.vocab_size = r.i("vocab_size");
  s.rms_norm_eps = r.d("rms_norm_eps");
  if (const auto* rp = root.find("rope_parameters"); rp && rp->is_object() && rp->find("rope_theta")) {
    s.rope_theta = rp->find("rope_theta")->as_double(r.what("rope_parameters.rope_theta"));
    if (const auto* rt = rp->find("rope_type"); rt && rt->as_string(r.what("rope_parameters.rope_type")) != "default")
      throw_user("{}: field 'rope_parameters.rope_type' must be \"default\" (no RoPE scaling)", path);
  } else {
    s.rope_theta = r.d("rope_theta");
  }
  if (const auto* rs = root.find("rope_scaling"); rs && !rs->is_null())
    throw_user("{}: field 'rope_scaling' must be null (dflash drafters use plain RoPE)", path);
  if (const auto* mp = root.find("max_position_embeddings")) s.max_position_embeddings = mp->as_int(r.what("max_position_embeddings"));
  if (const auto* ir = root.find("initializer_range")) s.initializer_range = ir->as_double(r.what("initializer_range"));
  for (const char* k : {"bos_token_id", "eos_token_id"})
    if (const auto* v = root.find(k); v && v->is_integer())
      (std::string(k) == "bos_token_id" ? s.bos_token_id : s.eos_token_id) = v->as_int(r.what(k));
  s.num_target_layers = r.i("num_target_layers");
  const auto& dc = r.get("dflash_config");
  if (!dc.is_object()) throw_user("{}: field 'dflash_config' must be an object", path);
  const auto* ids = dc.find("target_layer_ids");
  if (!ids) throw_user("{}: missing field 'dflash_config.target_layer_ids'", path);
  for (auto& v : ids->as_array(r.what("dflash_config.target_layer_ids")))
    s.target_layer_ids.push_back(v.as_int(r.what("dflash_config.target_layer_ids")));
  const auto* mask = dc.find("mask_token_id");
  if (!mask) throw_user("{}: missing field 'dflash_config.mask_token_id'", path);
  s.mask_token_id = mask->as_int(r.what("dflash_config.mask_token_id"));
  if (const auto* b = root.find("block_size"))
    s.block_size = b->as_int(r.what("block_size"));
  else if (const auto* b2 = dc.find("block_size"))
    s.block_size = b2->as_int(r.what("dflash_config.block_size"));
  else
    throw_user("{}: missing field 'block_size' (top level or in dflash_config)", path);
  if (const auto* lt = root.find("layer_types")) {
    const auto& arr = lt->as_array(r.what("layer_types"));
    if (static_cast<int64_t>(arr.size()) != s.num_layers)
      throw_user("{}: field 'layer_types' has {} entries for {} layers", path, arr.size(), s.num_layers);
    for (auto& t : arr)
      if (t.as_string(r.what("layer_types")) != "full_attention")
        throw_user("{}: field 'layer_types' holds \"{}\"; only \"full_attention\" layers are supported", path,
                   t.as_string(""));
  }
  if (const auto* sw = root.find("use_sliding_window"); sw && sw->is_bool() && sw->as_bool(""))
    throw_user("{}: field 'use_sliding_window' is true; sliding-window drafters are not supported", path);
  if (const auto* ab = root.find("attention_bias"); ab && ab->is_bool() && ab->as_bool(""))
    throw_user("{}: field 'attention_bias' is true; dflash drafters have no biases", path);
  s.validate(path);
  return s;
}

void export_drafter(const Drafter& drafter, const std::string& dir_in, const ExportRecord& record) {
  std::string dir = dir_in;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  const std::string tmp = dir + ".tmp";
  files::remove_tree(tmp);
  make_dirs(tmp);
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (auto& [name, t] : drafter.named_parameters())
    tensors.emplace_back(name, t.detach().to(at::kCPU, at::kBFloat16).contiguous());
  st::save(tmp + "/model.safetensors", tensors, {{"format", "pt"}});
  files::write_file_atomic(tmp + "/config.json", drafter_config_json(drafter.spec(), record));
  files::write_file_atomic(tmp + "/dflash.py", dflash_modeling_py());
  files::fsync_dir(tmp);
  if (exists(dir)) {
    const std::string old = dir + ".old";
    files::remove_tree(old);
    files::rename_durable(dir, old);
    files::rename_durable(tmp, dir);
    files::remove_tree(old);
  } else {
    files::rename_durable(tmp, dir);
  }
}

void check_drafter_tensors(const std::string& dir, const DrafterSpec& spec) {
  auto f = st::SafeTensors::open(dir);
  std::string prefix;
  if (!f.has("fc.weight") && f.has("model.fc.weight")) prefix = "model.";
  std::vector<std::string> want;
  for (auto& n : expected_names(spec)) want.push_back(prefix + n);
  f.expect_names(want);
  for (auto& [name, shape] : spec.param_shapes()) {
    const st::TensorInfo& ti = f.info(prefix + name);
    if (ti.shape != shape)
      throw_user("drafter {}: tensor '{}' in {} has shape [{}], but {}/config.json implies [{}] (from hidden_size {}, "
                 "intermediate_size {}, num_attention_heads {}, num_key_value_heads {}, head_dim {}, {} target_layer_ids)",
                 dir, prefix + name, ti.file, fmt::join(ti.shape, ", "), dir, fmt::join(shape, ", "), spec.hidden_size,
                 spec.intermediate_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_features());
  }
}

DrafterSpec read_drafter_dir(const std::string& dir) {
  const std::string cfg = dir + "/config.json";
  if (!exists(cfg)) throw_user("drafter {}: {} does not exist", dir, cfg);
  DrafterSpec spec = read_drafter_config(cfg);
  check_drafter_tensors(dir, spec);
  return spec;
}

void load_drafter_weights(Drafter& drafter, const std::string& dir) {
  auto f = st::SafeTensors::open(dir);
  const auto& spec = drafter.spec();
  auto names = expected_names(spec);
  std::string prefix;
  if (!f.has("fc.weight") && f.has("model.fc.weight")) prefix = "model.";
  std::vector<std::string> want;
  for (auto& n : names) want.push_back(prefix + n);
  f.expect_names(want);
  for (auto& [name, shape] : spec.param_shapes()) {
    at::Tensor t = f.load(prefix + name, drafter.dtype(), drafter.device(), &shape);
    st::check_finite(t, f.info(prefix + name).file, prefix + name);
    drafter.load_param(name, t);
  }
}

Drafter import_drafter(const std::string& dir, const TargetInfo& target, at::Device device, at::ScalarType dtype) {
  const std::string cfg = dir + "/config.json";
  if (!exists(cfg)) throw_user("drafter import: {} does not exist", cfg);
  auto spec = read_drafter_dir(dir);  // config and tensor shapes checked before allocating
  spec.check_fits(target, cfg);
  Drafter d(spec, device, dtype);
  load_drafter_weights(d, dir);
  return d;
}

Drafter make_drafter(const TargetInfo& target, const DrafterConfig& cfg, const std::vector<int64_t>& layer_ids,
                     int64_t num_features, int64_t seed, at::Device device, at::ScalarType dtype) {
  if (cfg.init_from.empty()) {
    Drafter d(make_spec(target, cfg, layer_ids, num_features), device, dtype);
    d.init_random(static_cast<uint64_t>(seed));
    return d;
  }
  Drafter d = import_drafter(cfg.init_from, target, device, dtype);
  const auto& s = d.spec();
  const std::string where = "drafter.init_from (" + cfg.init_from + ")";
  if (s.block_size != cfg.block_size)
    throw_user("{}: block_size {} differs from drafter.block_size {}", where, s.block_size, cfg.block_size);
  if (s.num_layers != cfg.num_layers)
    throw_user("{}: num_hidden_layers {} differs from drafter.num_layers {}", where, s.num_layers, cfg.num_layers);
  if (cfg.mask_token_id >= 0 && s.mask_token_id != cfg.mask_token_id)
    throw_user("{}: mask_token_id {} differs from drafter.mask_token_id {}", where, s.mask_token_id, cfg.mask_token_id);
  if (!layer_ids.empty() && s.target_layer_ids != layer_ids)
    throw_user("{}: target_layer_ids differ from target.layer_ids", where);
  return d;
}

}  // namespace dflash::model
