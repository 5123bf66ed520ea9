// Hugging Face config.json of a target model, parsed strictly: model_type "qwen3", "llama"
// (dense), "qwen3_moe" (sparse MoE MLPs), "qwen3_5" / "qwen3_5_moe" (hybrid Gated DeltaNet +
// gated attention; the multimodal wrapper whose text part is under "text_config") and their
// text-only forms "qwen3_5_text" / "qwen3_5_moe_text".
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

// Which decoder implementation a config needs.
enum class TargetFamily {
  Dense,    // qwen3, llama: trainer/model/target.cpp
  Qwen3Moe, // qwen3_moe: trainer/model/target_qwen35.cpp (attention layers + MoE MLPs)
  Qwen35,   // qwen3_5*, qwen3_5_moe*: trainer/model/target_qwen35.cpp (hybrid)
};

struct HfConfig {
  std::string path;        // the config.json it came from (for messages)
  std::string model_type;  // as written (top level)
  TargetFamily family = TargetFamily::Dense;
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

  // ---- qwen3_moe / qwen3_5 families (defaults leave the dense families unchanged) ----
  // Weight-name prefix of the decoder: "model." or "model.language_model." (multimodal wrapper).
  std::string weight_prefix = "model.";
  bool has_vision = false;           // a vision_config is present (its weights are ignored)
  std::optional<int64_t> image_token_id, video_token_id;  // wrapper only: ids we refuse
  int64_t rotary_dim = 0;            // leading dims of each head RoPE rotates (head_dim * partial_rotary_factor)
  bool zero_centered_norm = false;   // RMSNorm scales by (1 + w) (qwen3_5)
  bool attn_output_gate = false;     // q_proj also yields a per-head sigmoid gate (qwen3_5)
  // MoE (num_experts > 0): router softmax -> top-k -> optional renormalisation.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;          // dense layers among sparse ones
  int64_t shared_expert_intermediate_size = 0;   // > 0: sigmoid-gated shared expert (qwen3_5_moe)
  // Per layer "full_attention" or "linear_attention" (empty: all full attention).
  std::vector<std::string> layer_types;
  // Gated DeltaNet (linear_attention layers).
  int64_t linear_conv_kernel_dim = 4;
  int64_t linear_key_head_dim = 0, linear_value_head_dim = 0;
  int64_t linear_num_key_heads = 0, linear_num_value_heads = 0;

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }
  bool is_linear_layer(int64_t l) const {
    return !layer_types.empty() && layer_types[size_t(l)] == "linear_attention";
  }
  // transformers' rule: an MoE MLP unless listed in mlp_only_layers or off the sparse step.
  bool is_moe_layer(int64_t l) const;
  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
};

// `path`: a model directory (reads path/config.json) or a config.json file.
HfConfig load_hf_config(const std::string& path);
// From JSON text; `where` names the source in messages.
HfConfig parse_hf_config(const std::string& text, const std::string& where);

// RoPE inverse frequencies [rotary_dim / 2], float32 on CPU, computed as transformers does
// (default and llama3 types; rotary_dim < head_dim for partial RoPE).
at::Tensor rope_inv_freq(const HfConfig& cfg);

}  // namespace dflash::model
