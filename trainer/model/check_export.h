// `dflash_rank check-export DIR --target TARGET`: verifies an exported drafter against the target
// it will be served with, before a serving engine loads it (those report little: docs/serving.md).
//
// Owns the checks, each refusing with a UserError that names the field: the export's config.json
// reads as a dflash drafter (export.h's read_drafter_config); hidden_size, vocab_size and
// num_target_layers equal the target's; dflash_config.target_layer_ids strictly ascending (the
// engines collect features in layer order) and inside the target; mask_token_id < the target's
// vocab; head_dim x num_attention_heads / num_key_value_heads consistent with the tensors;
// model.safetensors holds exactly the expected names with their shapes, all in the config's dtype;
// the record fields (dflash_target) agree with the target when present. Warnings (printed, not
// refused): a target dtype other than the drafter's (serve with --dtype bfloat16), a captured
// last layer (SGLang cannot capture it), a target model_type other than the recorded one.
// Thread-safety: a plain function.
#pragma once

#include <string>
#include <vector>

namespace dflash::model {

struct ExportCheck {
  std::vector<std::string> facts;     // what was checked, for the report
  std::vector<std::string> warnings;  // served anyway, but worth knowing
};

ExportCheck check_export(const std::string& export_dir, const std::string& target_dir);

}  // namespace dflash::model
