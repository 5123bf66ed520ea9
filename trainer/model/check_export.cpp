// trainer/model/check_export.h: an export against its target, field by field.
#include "trainer/model/check_export.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"
#include "trainer/model/drafter.h"
#include "trainer/model/export.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/safetensors.h"

namespace dflash::model {
namespace {

const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    default: return "other";
  }
}

}  // namespace

ExportCheck check_export(const std::string& dir, const std::string& target_dir) {
  ExportCheck r;
  const std::string cfg_path = files::join(dir, "config.json");
  if (!files::is_dir(dir)) throw_user("check-export: export directory '{}' does not exist", dir);
  if (!files::exists(cfg_path)) throw_user("check-export: {} does not exist", cfg_path);
  if (!files::is_dir(target_dir)) throw_user("check-export: --target: directory '{}' does not exist", target_dir);
  const DrafterSpec s = read_drafter_config(cfg_path);
  const HfConfig tc = load_hf_config(target_dir);
  const std::string tfile = files::join(target_dir, "config.json");
  auto mismatch = [&](const char* field, int64_t mine, const char* theirs_field, int64_t theirs) {
    if (mine != theirs)
      throw_user("check-export: {}: field '{}' is {}, but the target ({}) has {} {}", cfg_path, field, mine, tfile,
                 theirs_field, theirs);
  };
  mismatch("hidden_size", s.hidden_size, "hidden_size", tc.hidden_size);
  mismatch("vocab_size", s.vocab_size, "vocab_size", tc.vocab_size);
  mismatch("num_target_layers", s.num_target_layers, "num_hidden_layers", tc.num_hidden_layers);
  for (size_t i = 0; i < s.target_layer_ids.size(); ++i) {
    const int64_t id = s.target_layer_ids[i];
    if (id < 0 || id >= tc.num_hidden_layers)
      throw_user("check-export: {}: field 'dflash_config.target_layer_ids' holds {}, outside the target's layers "
                 "[0, {})", cfg_path, id, tc.num_hidden_layers);
    if (i > 0 && id <= s.target_layer_ids[i - 1])
      throw_user("check-export: {}: field 'dflash_config.target_layer_ids' [{}] is not strictly ascending (the "
                 "serving engines collect the features in layer order)", cfg_path, fmt::join(s.target_layer_ids, ", "));
  }
  if (s.mask_token_id < 0 || s.mask_token_id >= tc.vocab_size)
    throw_user("check-export: {}: field 'dflash_config.mask_token_id' {} is outside the target's vocabulary [0, {})",
               cfg_path, s.mask_token_id, tc.vocab_size);
  if (s.num_heads % s.num_kv_heads != 0)
    throw_user("check-export: {}: field 'num_attention_heads' {} is not a multiple of 'num_key_value_heads' {}",
               cfg_path, s.num_heads, s.num_kv_heads);
  // Tensors: exact names, shapes from the config, one dtype equal to the config's.
  const json::Value root = json::parse_file(cfg_path);
  std::string want_dtype = "bfloat16";
  for (const char* k : {"dtype", "torch_dtype"})
    if (const auto* v = root.find(k); v && v->is_string()) { want_dtype = v->as_string(k); break; }
  auto f = st::SafeTensors::open(dir);
  std::string prefix = !f.has("fc.weight") && f.has("model.fc.weight") ? "model." : "";
  std::vector<std::string> names;
  for (const auto& [n, shape] : s.param_shapes()) names.push_back(prefix + n);
  f.expect_names(names);
  for (const auto& [n, shape] : s.param_shapes()) {
    const auto& info = f.info(prefix + n);
    if (info.shape != shape)
      throw_user("check-export: {}: tensor '{}' has shape [{}], config.json (hidden_size, head_dim, "
                 "num_attention_heads, num_key_value_heads, intermediate_size) gives [{}]", dir, prefix + n,
                 fmt::join(info.shape, ", "), fmt::join(shape, ", "));
    if (dtype_name(info.dtype) != want_dtype)
      throw_user("check-export: {}: tensor '{}' is {}, but config.json field 'dtype' says {}", dir, prefix + n,
                 dtype_name(info.dtype), want_dtype);
  }
  // The record of the target it was trained for, when the export has one.
  if (const auto* t = root.find("dflash_target"); t && t->is_object()) {
    if (const auto* mt = t->find("model_type"); mt && mt->is_string() && mt->as_string("") != tc.model_type)
      r.warnings.push_back(fmt::format("the export was trained for a '{}' target ({}), this target is '{}'",
                                       mt->as_string(""), t->find("path") ? t->find("path")->dump() : "?",
                                       tc.model_type));
  }
  if (!tc.torch_dtype.empty() && tc.torch_dtype != want_dtype)
    r.warnings.push_back(fmt::format("the target's config says dtype {}, the drafter is {}: launch SGLang with "
                                     "--dtype {} (with auto each model takes its own)",
                                     tc.torch_dtype, want_dtype, want_dtype));
  if (!s.target_layer_ids.empty() && s.target_layer_ids.back() == tc.num_hidden_layers - 1)
    r.warnings.push_back(fmt::format("target layer {} is the target's last layer, which SGLang cannot capture",
                                     tc.num_hidden_layers - 1));
  r.facts.push_back(fmt::format("hidden_size {} = target's", s.hidden_size));
  r.facts.push_back(fmt::format("vocab_size {} = target's; mask_token_id {} inside it", s.vocab_size, s.mask_token_id));
  r.facts.push_back(fmt::format("target_layer_ids [{}] ascending, inside the target's {} layers (num_target_layers {})",
                                fmt::join(s.target_layer_ids, ", "), tc.num_hidden_layers, s.num_target_layers));
  r.facts.push_back(fmt::format("{} layers, {} heads / {} kv heads x head_dim {}, block_size {}", s.num_layers,
                                s.num_heads, s.num_kv_heads, s.head_dim, s.block_size));
  r.facts.push_back(fmt::format("{} tensors with the expected names and shapes, all {}", names.size(), want_dtype));
  return r;
}

}  // namespace dflash::model
