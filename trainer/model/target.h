// The frozen target model (Qwen3 / Llama-3 decoder-only transformer) in LibTorch: loading from a
// Hugging Face directory, a forward over one packed token stream of variable-length documents
// with hidden-state capture, full logits, a forward with a caller-supplied attention (the KV
// cache of target_cache.h builds on it), and greedy generation.
//
// Semantics (DFLASH.md §1.1, §7): capture id i = the output of 0-indexed decoder layer i (the
// residual stream after that layer's MLP add, before the final norm) = transformers'
// hidden_states[i + 1]. Documents in a packed stream never attend to each other and their
// positions restart at 0.
//
// Owns: the weights, on one device in one dtype, fused at load (q/k/v -> one [q+2kv, H] matrix,
// gate/up -> one [2I, H] matrix). Inference only: every entry point runs under
// c10::InferenceMode and returns inference tensors. Thread-safety: the weights are immutable
// after load; concurrent calls on one device are safe but share the device's current stream.
#pragma once

#include <cstdint>
#include <memory>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/hf_config.h"

namespace dflash::model {

class HybridTarget;  // qwen3_moe / qwen3_5 families (target_qwen35.h)

struct TargetLoadOptions {
  // Load only decoder layers [0, num_layers) (-1: all). A model loaded with fewer layers can
  // capture up to layer num_layers - 1 but has no final norm and no LM head (no logits).
  int64_t num_layers = -1;
  // Load model.norm and lm_head (needed for logits and generation).
  bool lm_head = true;
};

class TargetModel {
 public:
  // `dir`: a Hugging Face model directory (config.json + model.safetensors or a sharded index).
  // Weights are validated against config.json: missing and unexpected names are listed, and
  // each tensor's shape is checked; float weights of any stored float dtype are converted.
  static TargetModel load(const std::string& dir, at::ScalarType dtype, at::Device device,
                          const TargetLoadOptions& opts = {});

  // A model with random weights (benchmarks, GPU tests): embedding and input-side linear
  // weights ~ N(0, std^2); the residual-branch outputs (o_proj, down_proj) ~ N(0, std^2 / (2L))
  // (GPT-2's scaled init, which keeps the residual stream from exploding over L layers); norm
  // weights 1 + N(0, 0.1^2). Deterministic for a seed on one device type.
  static TargetModel random(const HfConfig& cfg, at::ScalarType dtype, at::Device device,
                            uint64_t seed, double std = 0.02);

  const HfConfig& config() const { return cfg_; }
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return device_; }
  int64_t num_layers_loaded() const;
  bool has_lm_head() const;

  // Outputs of decoder layers `layer_ids` (strictly increasing, each < num_layers_loaded),
  // concatenated along features in id order: [T, K * H] in the model dtype. Runs only up to
  // the last captured layer. `ids` [T] int64, `cu_seqlens` [n_docs + 1] int32/int64 (0, ...,
  // T), on any device.
  at::Tensor capture(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                     const std::vector<int64_t>& layer_ids) const;

  struct Output {
    at::Tensor captured;  // [T, K * H] (undefined if no layer ids)
    at::Tensor logits;    // [T, vocab] in float32
  };
  // The whole model: captured states and logits.
  Output forward(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                 const std::vector<int64_t>& layer_ids = {}) const;

  // Attention of one layer for a pass over T packed tokens: q [T, nq, hd], k/v [T, nkv, hd]
  // (RoPE and q/k norm applied; may be strided views) -> [T, nq, hd].
  using Attention = std::function<at::Tensor(int64_t layer, const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v)>;
  // The whole model over T tokens `ids` [T] int64 at `positions` [T] int64 (RoPE), with
  // `attend` as every layer's attention (target_cache.h: KV caches). Logits only of the tokens
  // `logit_rows` [R] int64 (undefined tensor: all T); captured states of all T tokens.
  // Token mixer of one linear_attention layer (qwen3_5 families): h [T, H] (after the input
  // norm) -> [T, H]; needed by forward_with on targets with such layers (target_cache.cpp).
  using LinearMixer = std::function<at::Tensor(int64_t layer, const at::Tensor& h)>;
  Output forward_with(const at::Tensor& ids, const at::Tensor& positions,
                      const std::vector<int64_t>& layer_ids, const Attention& attend,
                      const at::Tensor& logit_rows = {}, const LinearMixer* linear = nullptr) const;
  // One decode step of trusted tokens (the model's own samples): ids [T] int64 and positions
  // [T] int64 already on the model's device, `attend` as every layer's attention -> logits
  // [T, vocab] float32. No host reads (no id check, no sync), so the step can be captured in a
  // CUDA graph (trainer/eval/regenerate_static.cpp). Dense families only.
  at::Tensor decode_logits(const at::Tensor& ids, const at::Tensor& positions, const Attention& attend) const;
  // The same with the outputs of decoder layers `layer_ids` (validated) captured for every token:
  // logits [T, vocab] float32 and captured [T, K * H]. Dense families only.
  Output decode_with(const at::Tensor& ids, const at::Tensor& positions, const Attention& attend,
                     const std::vector<int64_t>& layer_ids) const;
  // The qwen3_moe / qwen3_5 implementation, or nullptr for the dense families.
  const HybridTarget* hybrid() const { return hybrid_.get(); }

  // Greedy decoding for a batch of prompts (token id lists of any lengths): up to
  // `max_new_tokens` new tokens each; with `stop_at_eos`, a sequence ends after the first of
  // config().eos_token_ids it produces (that token included). Returns only the new tokens.
  // Runs on target_cache.h (greedy_generate); rows are independent.
  std::vector<std::vector<int64_t>> generate(const std::vector<std::vector<int64_t>>& prompts,
                                             int64_t max_new_tokens, bool stop_at_eos) const;

  // The weights (fused), for tests, benchmarks and checkpoint writers. Dense families only
  // (layers() is empty for the families of target_qwen35.h; embed_tokens/lm_head work for all).
  struct Layer {
    at::Tensor input_norm, post_norm;  // [H]
    at::Tensor q_norm, k_norm;         // [head_dim] (qwen3 only)
    at::Tensor wqkv;                   // [(nq + 2 nkv) * head_dim, H]
    at::Tensor wo;                     // [H, nq * head_dim]
    at::Tensor w_gate_up;              // [2 I, H]
    at::Tensor w_down;                 // [H, I]
  };

  const std::vector<Layer>& layers() const { return layers_; }
  const at::Tensor& embed_tokens() const;
  const at::Tensor& final_norm() const;
  const at::Tensor& lm_head() const;

 private:
  struct Pass;
  at::Tensor run_layers(Pass& pass) const;
  at::Tensor final_logits(const at::Tensor& hidden) const;

  HfConfig cfg_;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  at::Tensor embed_;    // [V, H]
  at::Tensor norm_;     // [H] (undefined without lm_head)
  at::Tensor lm_head_;  // [V, H] (== embed_ when tied; undefined without lm_head)
  at::Tensor inv_freq_; // [head_dim / 2] float32 on device
  std::vector<Layer> layers_;
  std::shared_ptr<const HybridTarget> hybrid_;  // set: every call goes there (cfg_.family != Dense)
};

// Drafter side: the target's embed_tokens and lm_head only (the same tensor when
// tie_word_embeddings), frozen (no grad), validated against config.json.
struct TargetEmbeddings {
  at::Tensor embed_tokens;  // [V, H]
  at::Tensor lm_head;       // [V, H]
  bool tied = false;
  HfConfig config;
};
TargetEmbeddings load_target_embeddings(const std::string& dir, at::ScalarType dtype,
                                        at::Device device);

// DFLASH.md §1.1's default capture ids for a target of `num_layers` layers: k == 1 -> {L / 2};
// else round(1 + i (L - 4) / (k - 1)), i = 0..k-1 (round half to even, as Python's round).
// Qwen3-8B (36 layers, k = 5): [1, 9, 17, 25, 33]. The one copy of the rule (the drafter's
// make_spec uses it too). UserError when k < 1 or k > num_layers - 3 (ids would repeat or leave
// the target): give target.layer_ids explicitly then.
std::vector<int64_t> default_layer_ids(int64_t num_layers, int64_t k);

// The capture ids of a run: `explicit_ids` if non-empty (validated: strictly increasing,
// inside [0, num_hidden_layers)), else default_layer_ids(num_hidden_layers, num_features).
// UserError naming `what` (the config key) otherwise.
std::vector<int64_t> resolve_layer_ids(const HfConfig& cfg, const std::vector<int64_t>& explicit_ids,
                                       int64_t num_features, const std::string& what = "target.layer_ids");

// "auto" (bf16 on CUDA, float32 on CPU), "bfloat16"/"bf16", "float16"/"fp16", "float32"/"fp32".
at::ScalarType resolve_dtype(const std::string& name, at::Device device,
                             const std::string& what = "target.dtype");

// The safetensors names of a Hugging Face checkpoint of this config (decoder layers
// [0, num_layers), plus norm/lm_head if asked), in a stable order.
std::vector<std::string> target_weight_names(const HfConfig& cfg, int64_t num_layers, bool lm_head);

// Checks the weights of the model directory `dir` against `cfg` (config.json): names, float
// dtypes and shapes, from the safetensors headers only (nothing is allocated). UserError naming
// the directory, file and tensor. The run plan calls it so that a mismatch is refused before
// anything is written. Dense (qwen3, llama) targets only; the other families are checked at load.
void check_target_weights(const std::string& dir, const HfConfig& cfg);

}  // namespace dflash::model
