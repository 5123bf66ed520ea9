// The DFlash drafter (DFLASH.md §1-§2): parameters, forward, and the training loss of one batch.
//
// Owns: the trainable parameters (plain at::Tensors with requires_grad, named exactly as the
// export names of DFLASH.md §5: "fc.weight", "layers.0.self_attn.q_proj.weight", ...), and
// references to the target's frozen embedding and LM head (set_target_weights; never trained,
// never exported). Forward per batch: C = hidden_norm(fc(features)); block inputs embedded with the
// target's embedding; N layers with KV injection (context through k_proj/v_proj only, prepended
// to the block's keys/values), q/k RMSNorm per head before RoPE, GQA, the DFlash mask (one mask per
// step shared by every layer), SwiGLU; final norm; the target's lm_head with a fused chunked
// cross-entropy (trainer/model/loss.h).
// Lifetime: one Drafter per drafter rank, alive for the run. Thread-safety: not thread-safe; one
// thread drives it (autograd may run its backward on other threads, as LibTorch does).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include "attention/dflash_attention.h"
#include "trainer/model/anchors.h"
#include "trainer/model/hf_config.h"

namespace dflash {
struct DrafterConfig;
}

namespace dflash::model {

// The target as the drafter sees it: its config.json, and what config.json does not say
// directly: the MASK id and the attention/MLP shape of a drafter for this target.
struct TargetInfo {
  HfConfig config;
  int64_t mask_token_id = -1;  // the tokenizer's MASK id if known (Qwen3: 151669), else -1
  // The drafter's heads, kv heads, head dim and MLP width: the target's own, except for the
  // families whose released drafters differ (Qwen3.5/3.6, see target_info()).
  int64_t num_heads = 0, num_kv_heads = 0, head_dim = 0, intermediate_size = 0;
};

// mask_token_id: 151669 for a Qwen3 target with the 151936-row vocabulary (the "<|MASK|>" id
// DFLASH.md §1.3 uses), 248070 for Qwen3.5/3.6 with 248320 rows, else -1 (drafter.mask_token_id
// must be set).
TargetInfo target_info(const HfConfig& cfg);

// Two elementwise steps of every drafter layer, differentiable, saving only their inputs:
// rotate-half RoPE of x [B, L, heads, d] with cos/sin [B, L, 1, d] (x's dtype), and the SwiGLU
// gate silu(g) * u. fused: the one-pass CUDA kernels (trainer/model/drafter_kernels.h) where x is
// a 16-bit CUDA tensor, else the ATen chains; the step uses fused unless DFLASH_DRAFTER_FUSED=0.
at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool fused);
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u, bool fused);
// apply_rope(RMSNorm_w(x)) of the per-head q/k norm (x [B, L, heads, d], w [d]); fused with
// head_dim 128: one kernel each way (the normed x is never stored), else the two steps above.
at::Tensor norm_rope(const at::Tensor& x, const at::Tensor& w, double eps, const at::Tensor& cos,
                     const at::Tensor& sin, bool fused);

// Shape and constants of a drafter; exactly the fields of the exported config.json.
struct DrafterSpec {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 5;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  int64_t max_position_embeddings = 40960;
  int64_t block_size = 16;
  std::vector<int64_t> target_layer_ids;
  int64_t num_target_layers = 0;
  int64_t mask_token_id = -1;
  int64_t bos_token_id = -1;
  int64_t eos_token_id = -1;
  double initializer_range = 0.02;

  int64_t num_features() const { return static_cast<int64_t>(target_layer_ids.size()); }
  // Internal consistency (positive sizes, heads divide, ids distinct); UserError naming the field,
  // prefixed by `where` (e.g. the config file).
  void validate(const std::string& where) const;
  // Fits the target (hidden size, vocab, layer ids < target layers, mask id inside the vocab).
  void check_fits(const TargetInfo& target, const std::string& where) const;
  // Parameter names and shapes in export order.
  std::vector<std::pair<std::string, std::vector<int64_t>>> param_shapes() const;
};

// The spec of a new drafter for `target` from the YAML drafter section and the target section's
// layer ids (empty: target.h's default_layer_ids with num_features).
DrafterSpec make_spec(const TargetInfo& target, const DrafterConfig& cfg,
                      const std::vector<int64_t>& layer_ids, int64_t num_features);

// γ of the loss decay: `configured` if > 0, else 7 / 5 / 4 for block size 16 / 10 / 8.
double resolve_gamma(int64_t block_size, double configured);

// One batch as the pipeline delivers it.
struct DrafterBatch {
  at::Tensor ids;        // [B, S] int64, any device
  at::Tensor loss_mask;  // [B, S] bool or integer, any device
  at::Tensor features;   // [B, S, K*H] the target's captured states (any float dtype/device;
                         // converted to the drafter's)
  std::vector<DocBounds> docs;  // per row, see anchors.h (empty: one document per row)
  int64_t global_batch_index = 0;
};

struct StepOptions {
  attention::Backend attention = attention::Backend::Reference;
  int64_t num_anchors = 512;
  uint64_t seed = 42;
  double gamma = 0;        // 0: resolve_gamma's default
  // The contract of the loss chunk, stated here only: > 0 is the number of draft positions per
  // chunk of the fused LM head + cross-entropy (loss.h; what training runs, drafter.loss_chunk,
  // which the config requires to be > 0); 0 selects the plain loss (all [positions, vocab]
  // logits at once, through autograd: the tests' and benchmarks' reference); < 0 is refused.
  int64_t loss_chunk = 2048;
  int64_t min_blocks = 0;     // pad N to at least this (steady shapes)
  bool recompute_loss = false;  // fused CE: recompute logits in the backward (loss.h CeMode)
  // The host reads of the step (the loss value, the per-position metrics) left to
  // StepOutput::finish(), which the caller runs once the backward is queued: forward() then
  // returns without waiting for the device, and the device never idles between forward and
  // backward while the host computes metrics. On CUDA the forward also queues non-blocking
  // copies of the loss and of the per-position argmax hits into pinned host memory, with an
  // event after them: finish() waits for that event (the end of the forward), not for the
  // backward queued after it. false: forward() calls finish() itself.
  bool defer_metrics = false;
};

// Result of one batch. The sums are what data-parallel ranks all-reduce.
struct StepOutput {
  at::Tensor loss;             // scalar (float32), differentiable: Σ CE·w·d / (Σ w·d + 1e-6)
  double weight_sum = 0;       // Σ w·d
  int64_t n_tokens = 0;        // Σ w (supervised positions)
  int64_t n_blocks = 0;        // kept blocks
  std::vector<double> correct_per_pos;  // [bs] argmax == label at offset k (w > 0)
  std::vector<double> count_per_pos;    // [bs] positions with w > 0 at offset k
  double tau_sum = 0;          // Σ over measured blocks of 1 + accepted length (loss.h)
  double tau_inv_sum = 0;      // Σ over measured blocks of 1 / (1 + accepted length)
  int64_t tau_blocks = 0;
  double loss_value = 0;       // loss.item(), for logging
  double accuracy() const;      // Σ correct / Σ count
  // Fills loss_value and the per-position/τ fields from the device (waits for the loss and the
  // argmax of every position: with `pending.ready`, for that event only); once, a no-op
  // afterwards (StepOptions::defer_metrics).
  void finish();

  // What finish() reads: argmax == label per loss position (device, or pinned host memory being
  // filled by a copy that `ready` follows), the positions (host int64 into the [B * N * bs] block
  // grid), which grid positions carry a label, and the grid's shape. loss_host: the loss copied
  // to pinned host memory (with `ready`), else undefined (finish() reads `loss` itself).
  struct Pending {
    at::Tensor correct, sel, valid, loss_host;
    std::shared_ptr<c10::Event> ready;  // recorded after the copies; null: nothing in flight
    int64_t B = 0, N = 0, bs = 0;
  } pending;
};

class Drafter {
 public:
  // Parameters allocated (zeros) on `device` in `dtype`, requires_grad = true.
  Drafter(DrafterSpec spec, at::Device device, at::ScalarType dtype);

  // normal(0, initializer_range) for every linear weight, ones for norms. Each tensor is drawn on
  // the CPU from its own generator seeded by (seed, parameter name), so the result depends only
  // on the seed and the shapes.
  void init_random(uint64_t seed);
  // The target's embed_tokens and lm_head weights [V, H] (may be the same tensor for a tied
  // target). Stored as given, converted to the drafter's device/dtype, never trained.
  void set_target_weights(const at::Tensor& embed_tokens, const at::Tensor& lm_head);

  const DrafterSpec& spec() const { return spec_; }
  at::Device device() const { return device_; }
  at::ScalarType dtype() const { return dtype_; }
  // Tiny versions of the step's ATen ops that no other part of a rank runs before its first step
  // (the RoPE tables: arange, pow, reciprocal, div, cat, cos, sin; the positions' cat), on
  // `device`: CUDA loads a kernel's module at its first launch (~35 ms for pow's, bench/RESULTS.md),
  // so that this runs under the weights' load (core/device.h WarmUp), not in the first step.
  static void warm_up_kernels(at::Device device, at::ScalarType dtype);
  // Trainable parameters, in export order, names as in DFLASH.md §5.
  const std::vector<std::pair<std::string, at::Tensor>>& named_parameters() const { return params_; }
  std::vector<at::Tensor> parameters() const;
  const at::Tensor& param(const std::string& name) const;  // UserError if unknown
  // Copies `value` into the parameter (shape must match; UserError otherwise).
  void load_param(const std::string& name, const at::Tensor& value);

  // The training forward of one batch: samples blocks from (seed, global_batch_index), then
  // as forward_blocks. Order of work: the batch's ids and loss mask come to the host first, then
  // the context (context()) is queued on the device, and only then does the host sample the
  // blocks and build their inputs, while the device computes the context.
  StepOutput forward(const DrafterBatch& batch, const StepOptions& opt) const;
  // Same with explicit blocks (tests, evaluation); the context is queued before the host builds
  // the block inputs, as in forward().
  StepOutput forward_blocks(const DrafterBatch& batch, const Blocks& blocks, const StepOptions& opt) const;

  // The context C = hidden_norm(fc(features)) [B, S, H] of the batch, shared by every layer;
  // depends on the features only (not on the blocks). Checks the features' shape.
  at::Tensor context(const DrafterBatch& batch) const;
  // The final hidden states norm(h) of every block position, [B, N*bs, H]; the first form
  // computes the context itself, the second takes context(batch).
  at::Tensor hidden(const DrafterBatch& batch, const Blocks& blocks, const BlockInputs& in,
                    attention::Backend backend) const;
  at::Tensor hidden(const at::Tensor& ctx, const DrafterBatch& batch, const Blocks& blocks, const BlockInputs& in,
                    attention::Backend backend) const;
  // Logits of every block position [B, N*bs, V] (evaluation and tests; small shapes only).
  at::Tensor logits(const DrafterBatch& batch, const Blocks& blocks,
                    attention::Backend backend = attention::Backend::Reference) const;

 private:
  struct Layer {
    at::Tensor in_norm, post_norm, q, k, v, o, q_norm, k_norm, gate, up, down;
  };
  // forward_blocks' body once the context is queued (ctx = context(batch)); `batch`'s ids and
  // loss mask on the host.
  StepOutput forward_with_context(const DrafterBatch& batch, const at::Tensor& ctx, const Blocks& blocks,
                                  const StepOptions& opt) const;
  DrafterSpec spec_;
  at::Device device_;
  at::ScalarType dtype_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  at::Tensor fc_, hidden_norm_, norm_;
  std::vector<Layer> layers_;
  at::Tensor embed_, lm_head_;
};

}  // namespace dflash::model
