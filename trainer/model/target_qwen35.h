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
// Generation and verification run on TargetCache (target_cache.h) through forward_with:
// attention layers use its KV cache, linear layers a HybridRecurrentCache (below: the recurrent
// state and conv window per row are the cache).
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
  // As TargetModel's; `linear` is required when the model has linear_attention layers.
  TargetModel::Output forward_with(const at::Tensor& ids, const at::Tensor& positions,
                                   const std::vector<int64_t>& layer_ids,
                                   const TargetModel::Attention& attend, const at::Tensor& logit_rows,
                                   const TargetModel::LinearMixer* linear) const;
  const HfConfig& config() const { return cfg_; }

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

// The recurrent part of a TargetCache (target_cache.h) for a target with linear_attention
// layers: per row and layer the conv window and the delta-rule state, a snapshot of them taken
// before every extend (so that a crop inside the last extend restores the snapshot; the cache
// then replays the kept tokens), and the LinearMixer of one extend.
class HybridRecurrentCache {
 public:
  HybridRecurrentCache(const HybridTarget& model, int64_t rows);
  // The mixer for an extend over the rows `act` (in order), row act[j] holding tokens
  // [cu[j], cu[j + 1]) of the pass.
  TargetModel::LinearMixer mixer(const std::vector<int64_t>& act, const std::vector<int64_t>& cu);
  void snapshot();                // before an extend
  void restore(int64_t row);      // row back to the last snapshot
  void reset(int64_t row);        // row back to empty (zeros)
  bool empty() const { return state_.empty(); }

 private:
  const HybridTarget& model_;
  std::vector<DeltaNetState> state_, saved_;  // per linear layer (empty tensors elsewhere)
  std::vector<int64_t> linear_;               // the linear layer ids
};

// Drafter side for these families: embed_tokens and lm_head (the same tensor when tied),
// validated against config.json like a full load.
std::pair<at::Tensor, at::Tensor> load_hybrid_embeddings(const HfConfig& cfg, const std::string& dir,
                                                         at::ScalarType dtype, at::Device device);

}  // namespace dflash::model
