// Export and import of a DFlash drafter in the Hugging Face layout that SGLang and vLLM load
// (DFLASH.md §5; format documented in docs/checkpoint.md).
//
// Owns: the directory format. A drafter directory holds
//   config.json        architectures ["DFlashDraftModel"], auto_map, model_type "qwen3",
//                      block_size, num_target_layers, dflash_config {mask_token_id,
//                      target_layer_ids}, layer_types, and the Qwen3 fields
//   model.safetensors  the trainable tensors, names without prefix ("fc.weight", "layers.0...."),
//                      bf16; no embed_tokens / lm_head (the target's are shared)
//   dflash.py          the transformers modeling file (trainer/model/hf/dflash.py, embedded in
//                      the binary at build time) that auto_map names
// config.json may carry extra top-level fields that the serving engines ignore (ExportRecord:
// the target's identity, the data's template/thinking record, the code version).
// Export writes everything into `dir + ".tmp"` and renames it over `dir` when complete (an
// existing `dir` is replaced), so a reader never sees a half-written export.
// Import validates: config fields (types, presence, a drafter of this architecture, full
// attention only, no RoPE scaling), the fit to the target (hidden size, vocab, layer ids,
// num_target_layers, mask token id), and the tensors (exact name set, with or without a
// "model." prefix; shapes); every error is a UserError naming the file and the field or tensor.
// Thread-safety: plain functions; the caller must not train the drafter during export.
#pragma once

#include <string>

#include "trainer/model/drafter.h"

namespace dflash::model {

// What an export records beside the drafter (config.json fields "dflash_target", "dflash_data",
// "dflash_version"; docs/checkpoint.md). Empty members are not written.
struct ExportRecord {
  std::string target_path;        // the target's model directory as configured
  std::string target_model_type;  // its config.json model_type
  int64_t target_num_layers = 0, target_hidden_size = 0, target_vocab_size = 0;
  std::string data_json;          // a JSON value: the data's preparation record(s)
  std::string version;            // dflash's code version (core/version.h)
};

// The config.json text of `spec` (keys in DFLASH.md §5 order, then the record's fields).
std::string drafter_config_json(const DrafterSpec& spec, const ExportRecord& record = {});
// The text of dflash.py shipped with every export.
const char* dflash_modeling_py();

// Parses and validates a drafter config.json (not yet against a target).
DrafterSpec read_drafter_config(const std::string& config_path);

// Checks that `dir`'s tensors are exactly the ones `spec` has, with its shapes (header only:
// nothing is allocated), so that a config.json that does not match its weights is refused before
// a drafter is built from it.
void check_drafter_tensors(const std::string& dir, const DrafterSpec& spec);
// read_drafter_config(dir/config.json) + check_drafter_tensors.
DrafterSpec read_drafter_dir(const std::string& dir);

// Writes `dir` (see above). Tensors are converted to bf16 on the CPU.
void export_drafter(const Drafter& drafter, const std::string& dir, const ExportRecord& record = {});

// Reads `dir`'s config.json, checks it against `target`, and returns a drafter on `device` in
// `dtype` holding the directory's weights.
Drafter import_drafter(const std::string& dir, const TargetInfo& target, at::Device device,
                       at::ScalarType dtype);

// Loads the tensors of `dir` into an existing drafter whose spec must equal the directory's.
void load_drafter_weights(Drafter& drafter, const std::string& dir);

// The drafter a run starts from: drafter.init_from's directory (imported and checked against the
// target, and against the YAML drafter section: block_size, num_layers, mask token and target
// layer ids must agree when they are set), else a new drafter of make_spec(...) initialised by
// init_random(seed).
Drafter make_drafter(const TargetInfo& target, const DrafterConfig& cfg, const std::vector<int64_t>& layer_ids,
                     int64_t num_features, int64_t seed, at::Device device, at::ScalarType dtype);

}  // namespace dflash::model
