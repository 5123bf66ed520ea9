// Hugging Face config.json of a target model (model_type "qwen3" or "llama"), parsed strictly.
//
// Owns: a plain value struct. Missing optional keys take transformers' defaults for that model
// type; keys that would change the computation in ways we do not implement (attention/MLP
// biases, sliding windows, RoPE types other than default/llama3, activations other than SiLU)
// are UserErrors naming the file and key. Both the transformers 4 layout (top-level rope_theta,
// rope_scaling) and the transformers 5 layout (rope_parameters) are read.
// Thread-safety: plain data, functions are stateless.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model {

struct RopeConfig {
  std::string type = "default";  // "default" or "llama3"
  double theta = 10000.0;
  // llama3 only:
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
};

struct HfConfig {
  std::string path;        // the config.json it came from (for messages)
  std::string model_type;  // "qwen3" or "llama"
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  RopeConfig rope;
  bool tie_word_embeddings = false;
  bool qk_norm = false;  // per-head RMSNorm on q and k before RoPE (qwen3)
  std::optional<int64_t> bos_token_id;
  std::vector<int64_t> eos_token_ids;  // empty: none
  std::string torch_dtype;             // as written ("bfloat16", ...), may be empty

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
};

// `path`: a model directory (reads path/config.json) or a config.json file.
HfConfig load_hf_config(const std::string& path);
// From JSON text; `where` names the source in messages.
HfConfig parse_hf_config(const std::string& text, const std::string& where);

// RoPE inverse frequencies [head_dim / 2], float32 on CPU, computed as transformers does
// (default and llama3 types).
at::Tensor rope_inv_freq(const HfConfig& cfg);

}  // namespace dflash::model
