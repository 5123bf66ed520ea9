// The decoder of the target families beyond dense Qwen3/Llama: qwen3_moe (attention layers with
// sparse MoE MLPs, some dense by mlp_only_layers / decoder_sparse_step) and qwen3_5 /
// qwen3_5_moe (the hybrid: a layer_types pattern of Gated DeltaNet "linear_attention" layers
// and gated, partial-RoPE "full_attention" layers; zero-centred RMSNorm (scale 1 + w); dense
// SwiGLU or MoE + shared-expert MLPs). TargetModel (target.h) dispatches here by model_type;
// the semantics of capture, forward and generate are TargetModel's.
//
// Weights come from Hugging Face names under cfg.weight_prefix ("model." or, for the
// multimodal wrappers Qwen3_5(Moe)ForConditionalGeneration, "model.language_model."); vision
// ("model.visual.*") and multi-token-prediction ("mtp.*") weights are ignored with one info
// line each. Experts load from per-expert names (mlp.experts.{e}.{gate,up,down}_proj.weight,
// as released checkpoints and transformers' save_pretrained write them) or from the fused
// mlp.experts.gate_up_proj [E, 2I, H] / mlp.experts.down_proj [E, H, I].
//
// Generation: attention layers keep a KV cache, linear layers their recurrent state and conv
// window (the state is the cache), all per sequence.
//
// Owns: the weights (one device, one dtype; fused at load). Thread-safety: const after load.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/model/hf_config.h"
#include "trainer/model/target.h"
#include "trainer/model/target_deltanet.h"
#include "trainer/model/target_moe.h"

namespace dflash::model {

class HybridTarget {
 public:
  struct Layer {
    bool linear = false, moe = false;
    at::Tensor input_norm, post_norm;  // [H]; zero-centred families: 1 + w (float32 on CPU)
    // full_attention
    at::Tensor wqkv;            // [q rows (x2 with the output gate, per head [q | gate]) + 2 kv, H]
    at::Tensor wo;              // [H, nq hd]
    at::Tensor q_norm, k_norm;  // [hd]
    // linear_attention
    DeltaNetWeights dn;
    // MLP: dense or MoE
    at::Tensor w_gate_up, w_down;
    MoeWeights experts;
  };

  static std::shared_ptr<const HybridTarget> load(const HfConfig& cfg, const std::string& dir,
                                                  at::ScalarType dtype, at::Device device,
                                                  const TargetLoadOptions& opts);
  static std::shared_ptr<const HybridTarget> random(const HfConfig& cfg, at::ScalarType dtype,
                                                    at::Device device, uint64_t seed, double std);

  int64_t num_layers_loaded() const { return int64_t(layers_.size()); }
  bool has_lm_head() const { return lm_head_.defined(); }
  const std::vector<Layer>& layers() const { return layers_; }
  const at::Tensor& embed_tokens() const { return embed_; }
  const at::Tensor& final_norm() const { return norm_; }
  const at::Tensor& lm_head() const { return lm_head_; }

  // As TargetModel's.
  at::Tensor capture(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                     const std::vector<int64_t>& layer_ids) const;
  TargetModel::Output forward(const at::Tensor& ids, const at::Tensor& cu_seqlens,
                              const std::vector<int64_t>& layer_ids) const;
  std::vector<std::vector<int64_t>> generate(const std::vector<std::vector<int64_t>>& prompts,
                                             int64_t max_new_tokens, bool stop_at_eos) const;

  struct Cache;  // generation state (target_qwen35.cpp)

 private:
  struct Pass;
  at::Tensor run_layers(Pass& pass) const;
  at::Tensor final_logits(const at::Tensor& hidden) const;
  at::Tensor norm(const at::Tensor& x, const at::Tensor& w) const;
  at::Tensor attention(const Layer& w, int64_t l, const at::Tensor& h, Pass& pass) const;
  Pass make_pass(const at::Tensor& ids, const at::Tensor& cu_seqlens) const;
  DeltaNetSpec dn_spec() const;

  HfConfig cfg_;
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_ = at::kCPU;
  at::Tensor embed_, norm_, lm_head_, inv_freq_;
  std::vector<Layer> layers_;
};

// Drafter side for these families: embed_tokens and lm_head (the same tensor when tied),
// validated against config.json like a full load.
std::pair<at::Tensor, at::Tensor> load_hybrid_embeddings(const HfConfig& cfg, const std::string& dir,
                                                         at::ScalarType dtype, at::Device device);

}  // namespace dflash::model
