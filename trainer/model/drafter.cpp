// trainer/model/drafter.h: the DFlash drafter's parameters, forward and loss of one batch.
#include "trainer/model/drafter.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "core/device.h"
#include "core/error.h"
#include "core/parse.h"
#include "trainer/config.h"
#include "trainer/model/drafter_ops.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/loss.h"
#include "trainer/model/target.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace dflash::model {
namespace {

// The fused CUDA kernels of drafter_kernels.h run for the q/k norm + RoPE, RoPE and SwiGLU on
// CUDA tensors of 16-bit dtype when `fused` (the step's default: unless DFLASH_DRAFTER_FUSED=0,
// read once); the ATen chains are the fallback and the oracle.
bool fused_default() {
  static const bool on = env_choice("DFLASH_DRAFTER_FUSED", "1", {"0", "1"}) == "1";
  return on;
}

uint64_t fnv1a(const std::string& s, uint64_t h) {
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

at::Tensor rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  return at::rms_norm(x, {x.size(-1)}, w, eps);
}

// cos, sin [B, L, 1, d] of the rotate-half RoPE for integer positions [B, L].
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& pos, int64_t d, double theta,
                                              at::ScalarType dtype) {
  auto fopt = at::TensorOptions().dtype(at::kFloat).device(pos.device());
  auto inv = at::pow(theta, at::arange(0, d, 2, fopt.dtype(at::kLong)).to(at::kFloat) / static_cast<double>(d))
                 .reciprocal();
  auto freqs = pos.to(at::kFloat).unsqueeze(-1) * inv;  // [B, L, d/2]
  auto emb = at::cat({freqs, freqs}, -1).unsqueeze(2);  // [B, L, 1, d]
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

}  // namespace

TargetInfo target_info(const HfConfig& c) {
  TargetInfo t;
  t.config = c;
  t.mask_token_id = ((c.model_type == "qwen3" || c.model_type == "qwen3_moe") && c.vocab_size == 151936) ? 151669 : -1;
  t.num_heads = c.num_attention_heads;
  t.num_kv_heads = c.num_key_value_heads;
  t.head_dim = c.head_dim;
  t.intermediate_size = c.intermediate_size;
  if (c.family == TargetFamily::Qwen35) {
    // The released Qwen3.5/3.6 drafters (z-lab, configs as quoted publicly): for the targets'
    // 256-wide gated attention heads, Qwen3 attention of 32 heads x 128 with 8 kv heads for dense
    // targets (Qwen3.6-27B) and 4 for MoE ones (Qwen3.6-35B-A3B); smaller (test) targets keep
    // their own head shape. MLP width: the target's intermediate_size, or 3 H for MoE targets
    // without one (35B-A3B: 6144). MASK 248070 (DFLASH.md §1.3).
    if (c.head_dim > 128) {
      t.num_heads = 32;
      t.head_dim = 128;
      t.num_kv_heads = c.num_experts > 0 ? 4 : 8;
    }
    if (t.intermediate_size <= 0) t.intermediate_size = 3 * c.hidden_size;
    if (c.vocab_size == 248320) t.mask_token_id = 248070;
  }
  return t;
}

// ---- spec -------------------------------------------------------------------------------------

void DrafterSpec::validate(const std::string& where) const {
  // Sizes in [1, max]: a drafter beyond these is a corrupt or mistyped config.json, refused before
  // anything is allocated from it.
  auto positive = [&](const char* name, int64_t v, int64_t max) {
    if (v <= 0) throw_user("{}: {} must be > 0, got {}", where, name, v);
    if (v > max) throw_user("{}: {} must be at most {}, got {} (corrupt config?)", where, name, max, v);
  };
  positive("hidden_size", hidden_size, int64_t{1} << 16);
  positive("intermediate_size", intermediate_size, int64_t{1} << 20);
  positive("num_hidden_layers", num_layers, 256);
  positive("num_attention_heads", num_heads, 1024);
  positive("num_key_value_heads", num_kv_heads, 1024);
  positive("head_dim", head_dim, 1024);
  positive("vocab_size", vocab_size, int64_t{1} << 24);
  positive("num_target_layers", num_target_layers, 1024);
  if (block_size > 256) throw_user("{}: block_size must be at most 256, got {}", where, block_size);
  if (num_heads % num_kv_heads != 0)
    throw_user("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", where, num_heads,
               num_kv_heads);
  if (head_dim % 2 != 0) throw_user("{}: head_dim must be even for RoPE, got {}", where, head_dim);
  if (block_size < 2) throw_user("{}: block_size must be >= 2, got {}", where, block_size);
  if (target_layer_ids.empty()) throw_user("{}: dflash_config.target_layer_ids is empty", where);
  std::set<int64_t> seen;
  for (auto id : target_layer_ids) {
    if (id < 0 || id >= num_target_layers)
      throw_user("{}: dflash_config.target_layer_ids holds {}, outside [0, num_target_layers={})", where, id,
                 num_target_layers);
    if (!seen.insert(id).second) throw_user("{}: dflash_config.target_layer_ids holds {} twice", where, id);
  }
  if (mask_token_id < 0 || mask_token_id >= vocab_size)
    throw_user("{}: dflash_config.mask_token_id {} is outside the vocabulary [0, {})", where, mask_token_id,
               vocab_size);
  if (!std::isfinite(rms_norm_eps) || !(rms_norm_eps > 0) || rms_norm_eps >= 1)
    throw_user("{}: rms_norm_eps must be a finite number in (0, 1), got {}", where, rms_norm_eps);
  if (!std::isfinite(rope_theta) || !(rope_theta > 0) || rope_theta > 1e12)
    throw_user("{}: rope_theta must be a finite number in (0, 1e12], got {}", where, rope_theta);
}

void DrafterSpec::check_fits(const TargetInfo& target, const std::string& where) const {
  const HfConfig& t = target.config;
  if (hidden_size != t.hidden_size)
    throw_user("{}: hidden_size {} does not match the target's hidden_size {}", where, hidden_size, t.hidden_size);
  if (vocab_size != t.vocab_size)
    throw_user("{}: vocab_size {} does not match the target's vocab_size {}", where, vocab_size, t.vocab_size);
  for (auto id : target_layer_ids)
    if (id < 0 || id >= t.num_hidden_layers)
      throw_user("{}: dflash_config.target_layer_ids holds {}, but the target has {} layers", where, id,
                 t.num_hidden_layers);
  if (num_target_layers != t.num_hidden_layers)
    throw_user("{}: num_target_layers {} does not match the target's num_hidden_layers {}", where,
               num_target_layers, t.num_hidden_layers);
  if (mask_token_id < 0 || mask_token_id >= t.vocab_size)
    throw_user("{}: dflash_config.mask_token_id {} is outside the target's vocabulary [0, {})", where,
               mask_token_id, t.vocab_size);
}

std::vector<std::pair<std::string, std::vector<int64_t>>> DrafterSpec::param_shapes() const {
  const int64_t H = hidden_size, qd = num_heads * head_dim, kvd = num_kv_heads * head_dim, I = intermediate_size;
  std::vector<std::pair<std::string, std::vector<int64_t>>> s = {
      {"fc.weight", {H, num_features() * H}}, {"hidden_norm.weight", {H}}, {"norm.weight", {H}}};
  for (int64_t i = 0; i < num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    s.push_back({p + "input_layernorm.weight", {H}});
    s.push_back({p + "post_attention_layernorm.weight", {H}});
    s.push_back({p + "self_attn.q_proj.weight", {qd, H}});
    s.push_back({p + "self_attn.k_proj.weight", {kvd, H}});
    s.push_back({p + "self_attn.v_proj.weight", {kvd, H}});
    s.push_back({p + "self_attn.o_proj.weight", {H, qd}});
    s.push_back({p + "self_attn.q_norm.weight", {head_dim}});
    s.push_back({p + "self_attn.k_norm.weight", {head_dim}});
    s.push_back({p + "mlp.gate_proj.weight", {I, H}});
    s.push_back({p + "mlp.up_proj.weight", {I, H}});
    s.push_back({p + "mlp.down_proj.weight", {H, I}});
  }
  return s;
}

DrafterSpec make_spec(const TargetInfo& target, const DrafterConfig& cfg, const std::vector<int64_t>& layer_ids,
                      int64_t num_features) {
  const HfConfig& c = target.config;
  DrafterSpec s;
  s.hidden_size = c.hidden_size;
  s.intermediate_size = target.intermediate_size;
  s.num_layers = cfg.num_layers;
  s.num_heads = target.num_heads;
  s.num_kv_heads = target.num_kv_heads;
  s.head_dim = target.head_dim;
  s.vocab_size = c.vocab_size;
  s.rms_norm_eps = c.rms_norm_eps;
  s.rope_theta = c.rope.theta;
  if (c.max_position_embeddings > 0) s.max_position_embeddings = c.max_position_embeddings;
  s.block_size = cfg.block_size;
  s.num_target_layers = c.num_hidden_layers;
  s.target_layer_ids = layer_ids.empty() ? default_layer_ids(c.num_hidden_layers, num_features) : layer_ids;
  s.mask_token_id = cfg.mask_token_id >= 0 ? cfg.mask_token_id : target.mask_token_id;
  if (s.mask_token_id < 0)
    throw_user("drafter.mask_token_id: the target defines no MASK token; set drafter.mask_token_id "
               "(Qwen3: 151669)");
  s.bos_token_id = c.bos_token_id.value_or(-1);
  s.eos_token_id = c.eos_token_ids.empty() ? -1 : c.eos_token_ids.front();
  if (cfg.num_layers < 1) throw_user("drafter.num_layers must be >= 1, got {}", cfg.num_layers);
  if (cfg.block_size < 2) throw_user("drafter.block_size must be >= 2, got {}", cfg.block_size);
  for (auto id : s.target_layer_ids)
    if (id < 0 || id >= c.num_hidden_layers)
      throw_user("target.layer_ids holds {}, but the target has {} layers", id, c.num_hidden_layers);
  if (s.mask_token_id >= c.vocab_size)
    throw_user("drafter.mask_token_id {} is outside the target's vocabulary [0, {})", s.mask_token_id,
               c.vocab_size);
  s.validate("drafter config");
  return s;
}

double resolve_gamma(int64_t bs, double configured) {
  if (configured > 0) return configured;
  if (configured < 0) throw_user("drafter.gamma must be >= 0, got {}", configured);
  switch (bs) {
    case 16: return 7.0;
    case 10: return 5.0;
    case 8: return 4.0;
    default:
      throw_user("drafter.gamma: DFLASH.md gives gamma only for block sizes 16, 10 and 8; set drafter.gamma for "
                 "block_size {}", bs);
  }
}

double StepOutput::accuracy() const {
  double c = 0, n = 0;
  for (size_t k = 0; k < correct_per_pos.size(); ++k) c += correct_per_pos[k], n += count_per_pos[k];
  return n > 0 ? c / n : 0.0;
}


// ---- module -----------------------------------------------------------------------------------

Drafter::Drafter(DrafterSpec spec, at::Device device, at::ScalarType dtype)
    : spec_(std::move(spec)), device_(device), dtype_(dtype) {
  spec_.validate("drafter");
  auto opt = at::TensorOptions().dtype(dtype_).device(device_);
  for (auto& [name, shape] : spec_.param_shapes()) {
    auto t = at::zeros(shape, opt);
    t.set_requires_grad(true);
    params_.emplace_back(name, t);
  }
  fc_ = param("fc.weight");
  hidden_norm_ = param("hidden_norm.weight");
  norm_ = param("norm.weight");
  for (int64_t i = 0; i < spec_.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer l;
    l.in_norm = param(p + "input_layernorm.weight");
    l.post_norm = param(p + "post_attention_layernorm.weight");
    l.q = param(p + "self_attn.q_proj.weight");
    l.k = param(p + "self_attn.k_proj.weight");
    l.v = param(p + "self_attn.v_proj.weight");
    l.o = param(p + "self_attn.o_proj.weight");
    l.q_norm = param(p + "self_attn.q_norm.weight");
    l.k_norm = param(p + "self_attn.k_norm.weight");
    l.gate = param(p + "mlp.gate_proj.weight");
    l.up = param(p + "mlp.up_proj.weight");
    l.down = param(p + "mlp.down_proj.weight");
    layers_.push_back(l);
  }
}

std::vector<at::Tensor> Drafter::parameters() const {
  std::vector<at::Tensor> v;
  for (auto& p : params_) v.push_back(p.second);
  return v;
}

const at::Tensor& Drafter::param(const std::string& name) const {
  for (auto& p : params_)
    if (p.first == name) return p.second;
  throw_user("drafter: no parameter named '{}'", name);
}

void Drafter::load_param(const std::string& name, const at::Tensor& value) {
  const auto& p = param(name);
  if (p.sizes() != value.sizes()) {
    auto dims = [](at::IntArrayRef a) {
      std::string s = "[";
      for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
      return s + "]";
    };
    throw_user("drafter: parameter '{}' has shape {}, the value has shape {}", name, dims(p.sizes()),
               dims(value.sizes()));
  }
  at::NoGradGuard ng;
  const_cast<at::Tensor&>(p).copy_(value);
}

void Drafter::init_random(uint64_t seed) {
  at::NoGradGuard ng;
  for (auto& [name, t] : params_) {
    if (t.dim() == 1) {
      t.fill_(1.0);
      continue;
    }
    auto gen = at::make_generator<at::CPUGeneratorImpl>(fnv1a(name, 0xcbf29ce484222325ull ^ seed));
    auto cpu = at::empty(t.sizes(), at::kFloat);
    cpu.normal_(0.0, spec_.initializer_range, gen);
    t.copy_(cpu);
  }
}

void Drafter::set_target_weights(const at::Tensor& embed_tokens, const at::Tensor& lm_head) {
  const int64_t V = spec_.vocab_size, H = spec_.hidden_size;
  for (auto [name, t] : {std::pair{"embed_tokens", &embed_tokens}, std::pair{"lm_head", &lm_head}})
    if (t->dim() != 2 || t->size(0) != V || t->size(1) != H)
      throw_user("drafter: the target's {} must be [{}, {}] (vocab, hidden), got rank {} with {} rows", name, V, H,
                 t->dim(), t->dim() > 0 ? t->size(0) : 0);
  embed_ = embed_tokens.detach().to(device_, dtype_);
  lm_head_ = lm_head.is_same(embed_tokens) ? embed_ : lm_head.detach().to(device_, dtype_);
}

at::Tensor Drafter::context(const DrafterBatch& batch) const {
  if (!embed_.defined()) throw_user("drafter: set_target_weights() was not called");
  const auto& s = spec_;
  const int64_t B = batch.ids.size(0), S = batch.ids.size(1), H = s.hidden_size;
  if (batch.features.dim() != 3 || batch.features.size(0) != B || batch.features.size(1) != S ||
      batch.features.size(2) != s.num_features() * H)
    throw_user("drafter batch: features must be [B={}, S={}, K*H={}] ({} target layers x hidden {}), got rank {} "
               "[{}, {}, {}]",
               B, S, s.num_features() * H, s.num_features(), H, batch.features.dim(), batch.features.size(0),
               batch.features.dim() > 1 ? batch.features.size(1) : -1,
               batch.features.dim() > 2 ? batch.features.size(2) : -1);

  // Context: C = hidden_norm(fc(features)), once per forward, shared by all layers.
  auto feats = batch.features.to(device_, dtype_);
  auto ctx = rms(at::linear(feats, fc_), hidden_norm_, s.rms_norm_eps);  // [B, S, H]
  return ctx;
}

at::Tensor Drafter::hidden(const DrafterBatch& batch, const Blocks& blocks, const BlockInputs& in,
                           attention::Backend backend) const {
  return hidden(context(batch), batch, blocks, in, backend);
}

at::Tensor Drafter::hidden(const at::Tensor& ctx, const DrafterBatch& batch, const Blocks& blocks,
                           const BlockInputs& in, attention::Backend backend) const {
  if (!embed_.defined()) throw_user("drafter: set_target_weights() was not called");
  const auto& s = spec_;
  const int64_t B = batch.ids.size(0), S = batch.ids.size(1), N = blocks.num_blocks(), bs = blocks.block_size;
  const int64_t Q = N * bs, H = s.hidden_size, hq = s.num_heads, hkv = s.num_kv_heads, d = s.head_dim;
  DFLASH_CHECK(ctx.dim() == 3 && ctx.size(0) == B && ctx.size(1) == S && ctx.size(2) == H,
               "drafter: the context must be context(batch), [B={}, S={}, H={}]", B, S, H);
  if (bs != s.block_size) throw_user("blocks: block size {} differs from the drafter's {}", bs, s.block_size);

  // Mask (once per step, shared by all layers): context [doc_begin, anchor), own block.
  attention::MaskSpec ms;
  ms.ctx_begin = blocks.doc_begin;
  ms.ctx_end = blocks.anchor;
  ms.keep = blocks.keep;
  ms.ctx_len = S;
  ms.block_size = bs;
  auto prep = attention::prepare(ms, backend, dtype_, device_);

  // host inputs uploaded without waiting for the context's fc GEMM queued before
  auto ids = device::to_device(in.input_ids, device_);
  auto qpos = device::to_device(in.positions, device_);
  auto kvpos = at::cat({device::to_device(in.ctx_positions, device_), qpos}, 1);  // [B, S + Q]
  auto [cos_q, sin_q] = rope_tables(qpos, d, s.rope_theta, dtype_);
  auto [cos_k, sin_k] = rope_tables(kvpos, d, s.rope_theta, dtype_);

  auto x = at::embedding(embed_, ids);  // [B, Q, H]
  // x + a w^T as one GEMM whose epilogue adds x (beta 1): no pass of its own for the residual add
  auto add_linear = [](const at::Tensor& res, const at::Tensor& a, const at::Tensor& w) {
    return at::addmm(res.reshape({-1, res.size(-1)}), a.reshape({-1, a.size(-1)}), w.t()).view(res.sizes());
  };
  for (const auto& L : layers_) {
    auto h = rms(x, L.in_norm, s.rms_norm_eps);
    auto qkv = attn_projections(ctx, h, L.q, L.k, L.v);  // q from h; k, v from [ctx; h]
    auto q = norm_rope(qkv[0].view({B, Q, hq, d}), L.q_norm, s.rms_norm_eps, cos_q, sin_q, fused_default())
                 .transpose(1, 2);
    auto k = norm_rope(qkv[1].view({B, S + Q, hkv, d}), L.k_norm, s.rms_norm_eps, cos_k, sin_k, fused_default())
                 .transpose(1, 2);
    auto v = qkv[2].view({B, S + Q, hkv, d}).transpose(1, 2);
    auto o = attention::attend(q, k, v, prep).transpose(1, 2).reshape({B, Q, hq * d});
    x = add_linear(x, o, L.o);
    auto h2 = rms(x, L.post_norm, s.rms_norm_eps);
    auto gu = linear_pair(h2, L.gate, L.up);
    x = add_linear(x, swiglu(gu[0], gu[1], fused_default()), L.down);
  }
  return rms(x, norm_, s.rms_norm_eps);
}

at::Tensor Drafter::logits(const DrafterBatch& batch, const Blocks& blocks, attention::Backend backend) const {
  auto in = build_block_inputs(batch.ids, batch.loss_mask, batch.docs, blocks, spec_.mask_token_id);
  return at::matmul(hidden(batch, blocks, in, backend), lm_head_.t());
}

void Drafter::warm_up_kernels(at::Device device, at::ScalarType dtype) {
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor kvpos = at::cat({at::arange(0, 8, lopt).view({1, 8}), at::arange(0, 16, lopt).view({1, 16})}, 1);
  (void)rope_tables(kvpos, 128, 1e6, dtype);
}

namespace {

// `b` with its ids and loss mask on the host (what the block sampling and inputs read), read
// before the context is queued: a device -> host copy after it would wait for the fc GEMM.
DrafterBatch with_host_ids(const DrafterBatch& b) {
  DrafterBatch h = b;
  h.ids = b.ids.to(at::kCPU);
  h.loss_mask = b.loss_mask.to(at::kCPU);
  return h;
}

}  // namespace

// forward and forward_blocks queue the context (the features' fc GEMM and norm, which do not
// depend on the blocks) first, then do the step's host work (block sampling, block inputs,
// weights, loss positions, the mask's records) while the device computes it.
StepOutput Drafter::forward(const DrafterBatch& batch, const StepOptions& opt) const {
  const DrafterBatch hb = with_host_ids(batch);
  const at::Tensor ctx = context(hb);
  AnchorOptions ao;
  ao.block_size = spec_.block_size;
  ao.num_anchors = opt.num_anchors;
  ao.seed = opt.seed;
  ao.batch_index = batch.global_batch_index;
  ao.min_blocks = opt.min_blocks;
  return forward_with_context(hb, ctx, sample_blocks(hb.loss_mask, hb.docs, ao), opt);
}

StepOutput Drafter::forward_blocks(const DrafterBatch& batch, const Blocks& blocks, const StepOptions& opt) const {
  const DrafterBatch hb = with_host_ids(batch);
  const at::Tensor ctx = context(hb);
  return forward_with_context(hb, ctx, blocks, opt);
}

StepOutput Drafter::forward_with_context(const DrafterBatch& batch, const at::Tensor& ctx, const Blocks& blocks,
                                         const StepOptions& opt) const {
  const int64_t bs = spec_.block_size;
  const double gamma = resolve_gamma(bs, opt.gamma);
  auto in = build_block_inputs(batch.ids, batch.loss_mask, batch.docs, blocks, spec_.mask_token_id);
  const int64_t B = in.weight.size(0), Q = in.weight.size(1), N = Q / bs;

  // Loss positions: w > 0 only (offset 0, dropped blocks, past the document end, prompt tokens
  // carry no loss and never reach the LM head). Host work (while the device computes the
  // context), uploaded before the layers are queued, so that nothing below waits for the device.
  auto w = in.weight.reshape({-1});                                              // CPU float
  auto wd = (in.weight.to(at::kDouble) * decay(bs, gamma).to(at::kDouble).repeat({N}).view({1, Q})).reshape({-1});
  auto sel = w.gt(0).nonzero().squeeze(1);                                       // CPU int64
  StepOutput out;
  out.weight_sum = wd.sum().item<double>();
  out.n_tokens = sel.size(0);
  out.n_blocks = blocks.keep.sum().item<int64_t>();
  auto coef = device::to_device((wd.index_select(0, sel) / (out.weight_sum + 1e-6)).to(at::kFloat), device_);
  auto labels = device::to_device(in.labels.reshape({-1}).index_select(0, sel), device_);
  auto sel_dev = device::to_device(sel, device_);
  auto inv = at::full({B * Q}, out.n_tokens, at::kLong);  // SelectRows: row -> its place in sel
  {  // a plain loop: ATen's CPU index_put_ took ~6 ms for the 30K rows of a recipe-shape step
    const at::Tensor sc = sel.contiguous();
    const int64_t* sp = sc.data_ptr<int64_t>();
    int64_t* ip = inv.data_ptr<int64_t>();
    for (int64_t i = 0; i < out.n_tokens; ++i) ip[sp[i]] = i;
  }
  auto inv_dev = device::to_device(inv, device_);

  auto h = hidden(ctx, batch, blocks, in, opt.attention);  // [B, Q, H]
  auto hs = select_rows(h.reshape({B * Q, h.size(2)}), sel_dev, inv_dev);
  DFLASH_CHECK(opt.loss_chunk >= 0, "StepOptions::loss_chunk = {}, expected > 0 (fused) or 0 (plain)", opt.loss_chunk);
  CeResult ce = opt.loss_chunk > 0 ? fused_linear_ce(hs, lm_head_, labels, coef, opt.loss_chunk,
                                                     opt.recompute_loss ? CeMode::Recompute : CeMode::GradInForward)
                                   : plain_linear_ce(hs, lm_head_, labels, coef);
  out.loss = ce.loss;
  out.pending = {ce.correct, sel, w.gt(0), at::Tensor(), nullptr, B, N, bs};
  if (!opt.defer_metrics) {
    out.finish();
    return out;
  }
#ifdef DFLASH_CUDA
  if (ce.correct.is_cuda()) {
    // What finish() reads, copied now: queued behind the forward only, so that finish() (run once
    // the backward is queued) waits for the forward's end, not for the backward's. The pinned
    // blocks stay reserved until the copies are done (the host allocator records them).
    auto to_pinned = [](const at::Tensor& t) {
      auto h = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
      h.copy_(t, /*non_blocking=*/true);
      return h;
    };
    out.pending.loss_host = to_pinned(ce.loss.detach());
    out.pending.correct = to_pinned(ce.correct);
    auto ready = std::make_shared<c10::Event>(c10::DeviceType::CUDA);
    ready->record(at::cuda::getCurrentCUDAStream());
    out.pending.ready = std::move(ready);
  }
#endif
  return out;
}

void StepOutput::finish() {
  if (!pending.correct.defined()) return;
  const Pending p = std::move(pending);
  pending = Pending{};
  if (p.ready) p.ready->synchronize();  // the copies queued at the forward's end
  loss_value = p.loss_host.defined() ? p.loss_host.item<double>() : loss.detach().item<double>();
  auto correct = at::zeros({p.B * p.N * p.bs}, at::kBool);
  correct.index_put_({p.sel}, p.correct.to(at::kCPU));
  auto m = block_metrics(correct.view({p.B, p.N, p.bs}), p.valid.view({p.B, p.N, p.bs}));
  correct_per_pos = std::move(m.correct_per_pos);
  count_per_pos = std::move(m.count_per_pos);
  tau_sum = m.tau_sum;
  tau_inv_sum = m.tau_inv_sum;
  tau_blocks = m.tau_blocks;
}

}  // namespace dflash::model
