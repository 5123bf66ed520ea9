// HybridTarget (target_qwen35.h): weight names, validation against config.json, loading and
// random initialisation.
#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"
#include "trainer/model/safetensors.h"
#include "trainer/model/target_qwen35.h"

namespace dflash::model {

namespace {

struct Job {
  std::string name;
  std::vector<int64_t> shape;  // as stored
  at::Tensor dst;              // undefined: validate only
};

bool is_float(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf || t == at::kFloat || t == at::kDouble;
}

// Raw tensors that need a transform after loading (zero-centred norms, float32 gates).
struct Post {
  at::Tensor raw;
  std::function<void(const at::Tensor&)> apply;
};

struct Emitter {
  Emitter(const HfConfig& cfg, at::TensorOptions o, bool fused) : c(cfg), opt(o), fused_experts(fused) {}
  const HfConfig& c;
  at::TensorOptions opt;
  bool fused_experts;
  std::vector<Job> jobs;
  std::vector<Post> posts;
  bool alloc = true;

  at::Tensor make(const std::vector<int64_t>& shape) {
    return alloc ? at::empty(shape, opt) : at::Tensor();
  }
  void add(const std::string& name, std::vector<int64_t> shape, const at::Tensor& dst) {
    jobs.push_back({name, std::move(shape), dst});
  }
  // A norm weight: zero-centred families store w and compute with 1 + w (float32 on CPU, as
  // transformers multiplies in float32; the model dtype on CUDA for the fused kernel).
  void norm(const std::string& name, int64_t n, at::Tensor& dst, bool zero_centered) {
    if (!alloc) return add(name, {n}, {});
    if (!zero_centered) {
      dst = make({n});
      return add(name, {n}, dst);
    }
    at::Tensor raw = make({n});
    add(name, {n}, raw);
    at::Tensor* out = &dst;
    bool cuda = opt.device().is_cuda();
    posts.push_back({raw, [out, cuda](const at::Tensor& r) {
                       at::Tensor w1 = r.to(at::kFloat) + 1.0;
                       *out = cuda ? w1.to(r.scalar_type()) : w1;
                     }});
  }
  void as_float(const std::string& name, int64_t n, at::Tensor& dst) {
    if (!alloc) return add(name, {n}, {});
    at::Tensor raw = make({n});
    add(name, {n}, raw);
    at::Tensor* out = &dst;
    posts.push_back({raw, [out](const at::Tensor& r) { *out = r.to(at::kFloat); }});
  }
  at::Tensor rows(const at::Tensor& t, int64_t start, int64_t n) { return t.defined() ? t.narrow(0, start, n) : t; }

  void layer(int64_t l, HybridTarget::Layer& w) {
    const int64_t H = c.hidden_size, hd = c.head_dim;
    const std::string p = fmt::format("{}layers.{}.", c.weight_prefix, l);
    const bool zc = c.zero_centered_norm;
    w.linear = c.is_linear_layer(l);
    w.moe = c.is_moe_layer(l) || (c.num_experts > 0 && c.family == TargetFamily::Qwen35);
    norm(p + "input_layernorm.weight", H, w.input_norm, zc);
    norm(p + "post_attention_layernorm.weight", H, w.post_norm, zc);
    if (w.linear) {
      const int64_t cd = c.linear_conv_dim(), vd = c.linear_value_dim(), nv = c.linear_num_value_heads;
      const std::string a = p + "linear_attn.";
      w.dn.w_in = make({cd + vd + 2 * nv, H});
      add(a + "in_proj_qkv.weight", {cd, H}, rows(w.dn.w_in, 0, cd));
      add(a + "in_proj_z.weight", {vd, H}, rows(w.dn.w_in, cd, vd));
      add(a + "in_proj_b.weight", {nv, H}, rows(w.dn.w_in, cd + vd, nv));
      add(a + "in_proj_a.weight", {nv, H}, rows(w.dn.w_in, cd + vd + nv, nv));
      w.dn.conv = make({cd, c.linear_conv_kernel_dim});
      add(a + "conv1d.weight", {cd, 1, c.linear_conv_kernel_dim},
          w.dn.conv.defined() ? w.dn.conv.unsqueeze(1) : at::Tensor());
      as_float(a + "A_log", nv, w.dn.A_log);
      as_float(a + "dt_bias", nv, w.dn.dt_bias);
      w.dn.norm = make({c.linear_value_head_dim});
      add(a + "norm.weight", {c.linear_value_head_dim}, w.dn.norm);
      w.dn.w_out = make({H, vd});
      add(a + "out_proj.weight", {H, vd}, w.dn.w_out);
    } else {
      const int64_t qrows = c.q_dim() * (c.attn_output_gate ? 2 : 1), kvd = c.kv_dim();
      const std::string a = p + "self_attn.";
      w.wqkv = make({qrows + 2 * kvd, H});
      add(a + "q_proj.weight", {qrows, H}, rows(w.wqkv, 0, qrows));
      add(a + "k_proj.weight", {kvd, H}, rows(w.wqkv, qrows, kvd));
      add(a + "v_proj.weight", {kvd, H}, rows(w.wqkv, qrows + kvd, kvd));
      w.wo = make({H, c.q_dim()});
      add(a + "o_proj.weight", {H, c.q_dim()}, w.wo);
      norm(a + "q_norm.weight", hd, w.q_norm, zc);
      norm(a + "k_norm.weight", hd, w.k_norm, zc);
    }
    const std::string m = p + "mlp.";
    if (!w.moe) {
      const int64_t I = c.intermediate_size;
      w.w_gate_up = make({2 * I, H});
      add(m + "gate_proj.weight", {I, H}, rows(w.w_gate_up, 0, I));
      add(m + "up_proj.weight", {I, H}, rows(w.w_gate_up, I, I));
      w.w_down = make({H, I});
      add(m + "down_proj.weight", {H, I}, w.w_down);
      return;
    }
    const int64_t E = c.num_experts, I = c.moe_intermediate_size;
    MoeWeights& x = w.experts;
    x.router = make({E, H});
    add(m + "gate.weight", {E, H}, x.router);
    x.w_gate_up = make({E, 2 * I, H});
    x.w_down = make({E, H, I});
    if (fused_experts) {
      add(m + "experts.gate_up_proj", {E, 2 * I, H}, x.w_gate_up);
      add(m + "experts.down_proj", {E, H, I}, x.w_down);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const std::string pe = fmt::format("{}experts.{}.", m, e);
        at::Tensor gu = x.w_gate_up.defined() ? x.w_gate_up[e] : at::Tensor();
        add(pe + "gate_proj.weight", {I, H}, rows(gu, 0, I));
        add(pe + "up_proj.weight", {I, H}, rows(gu, I, I));
        add(pe + "down_proj.weight", {H, I}, x.w_down.defined() ? x.w_down[e] : at::Tensor());
      }
    }
    if (c.shared_expert_intermediate_size > 0) {
      const int64_t Is = c.shared_expert_intermediate_size;
      x.shared_gate_up = make({2 * Is, H});
      add(m + "shared_expert.gate_proj.weight", {Is, H}, rows(x.shared_gate_up, 0, Is));
      add(m + "shared_expert.up_proj.weight", {Is, H}, rows(x.shared_gate_up, Is, Is));
      x.shared_down = make({H, Is});
      add(m + "shared_expert.down_proj.weight", {H, Is}, x.shared_down);
      x.shared_gate = make({1, H});
      add(m + "shared_expert_gate.weight", {1, H}, x.shared_gate);
    }
  }
};

// Opens and validates the checkpoint: names (vision / mtp / rotary buffers ignored), dtypes,
// shapes. Returns the file and whether experts are stored fused.
std::pair<st::SafeTensors, bool> open_checked(const HfConfig& c, const std::string& dir) {
  st::SafeTensors file = st::SafeTensors::open(dir);
  bool fused = false;
  if (c.num_experts > 0)
    for (int64_t l = 0; l < c.num_hidden_layers && !fused; ++l)
      fused = file.has(fmt::format("{}layers.{}.mlp.experts.gate_up_proj", c.weight_prefix, l));
  Emitter all{c, {}, fused};
  all.alloc = false;
  std::vector<HybridTarget::Layer> dummy(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) all.layer(l, dummy[l]);
  all.add(c.weight_prefix + "embed_tokens.weight", {c.vocab_size, c.hidden_size}, {});
  all.add(c.weight_prefix + "norm.weight", {c.hidden_size}, {});
  if (!c.tie_word_embeddings) all.add("lm_head.weight", {c.vocab_size, c.hidden_size}, {});
  std::vector<std::string> names;
  for (const auto& j : all.jobs) names.push_back(j.name);
  std::map<std::string, int> ignored;
  for (const auto& n : file.names()) {
    bool rotary = n.size() >= 19 && n.compare(n.size() - 19, 19, "rotary_emb.inv_freq") == 0;
    if (rotary || (c.tie_word_embeddings && n == "lm_head.weight")) names.push_back(n);
    if (n.rfind("model.visual.", 0) == 0) ++ignored["vision (model.visual.*)"];
    if (n.rfind("mtp.", 0) == 0) ++ignored["multi-token prediction (mtp.*)"];
  }
  try {
    file.expect_names(names, {"model.visual.", "mtp."});
  } catch (const UserError& e) {
    throw_user("model '{}' (config {}, model_type {}, {} layers, experts {}): {}", dir, c.path,
               c.model_type, c.num_hidden_layers, fused ? "fused" : "per-expert", e.what());
  }
  for (const auto& j : all.jobs) {
    const st::TensorInfo& ti = file.info(j.name);
    if (!is_float(ti.dtype))
      throw_user("model '{}': tensor '{}' in '{}' has dtype {}, expected a float type (BF16, F16, F32)",
                 dir, j.name, ti.file, c10::toString(ti.dtype));
    if (ti.shape != j.shape)
      throw_user("model '{}': tensor '{}' in '{}' has shape [{}], but config {} implies [{}]", dir,
                 j.name, ti.file, fmt::join(ti.shape, ", "), c.path, fmt::join(j.shape, ", "));
  }
  for (const auto& [what, n] : ignored)
    log::info("target model '{}': ignoring {} {} weights (text model only)", dir, n, what);
  return {std::move(file), fused};
}

}  // namespace

std::shared_ptr<const HybridTarget> HybridTarget::load(const HfConfig& c, const std::string& dir,
                                                       at::ScalarType dtype, at::Device device,
                                                       const TargetLoadOptions& opts) {
  c10::InferenceMode guard;
  auto m = std::make_shared<HybridTarget>();
  m->cfg_ = c;
  m->dtype_ = dtype;
  m->device_ = device;
  const int64_t L = opts.num_layers < 0 ? c.num_hidden_layers : opts.num_layers;
  if (L > c.num_hidden_layers)
    throw_user("target model '{}': asked for {} layers, config {} has {}", dir, L, c.path, c.num_hidden_layers);
  auto [file, fused] = open_checked(c, dir);
  Emitter em{c, at::TensorOptions().dtype(dtype).device(device), fused};
  m->layers_.resize(L);
  for (int64_t l = 0; l < L; ++l) em.layer(l, m->layers_[l]);
  m->embed_ = em.make({c.vocab_size, c.hidden_size});
  em.add(c.weight_prefix + "embed_tokens.weight", {c.vocab_size, c.hidden_size}, m->embed_);
  if (opts.lm_head && L == c.num_hidden_layers) {
    em.norm(c.weight_prefix + "norm.weight", c.hidden_size, m->norm_, c.zero_centered_norm);
    if (c.tie_word_embeddings) {
      m->lm_head_ = m->embed_;
    } else {
      m->lm_head_ = em.make({c.vocab_size, c.hidden_size});
      em.add("lm_head.weight", {c.vocab_size, c.hidden_size}, m->lm_head_);
    }
  }
  for (const auto& j : em.jobs) file.load_into(j.name, j.dst);
  for (auto& p : em.posts) p.apply(p.raw);
  m->inv_freq_ = rope_inv_freq(c).to(device);
  return m;
}

std::shared_ptr<const HybridTarget> HybridTarget::random(const HfConfig& c, at::ScalarType dtype,
                                                         at::Device device, uint64_t seed, double std) {
  c10::InferenceMode guard;
  auto m = std::make_shared<HybridTarget>();
  m->cfg_ = c;
  m->dtype_ = dtype;
  m->device_ = device;
  {
    at::Generator gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  Emitter em{c, at::TensorOptions().dtype(dtype).device(device), /*fused=*/true};
  m->layers_.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) em.layer(l, m->layers_[l]);
  m->embed_ = em.make({c.vocab_size, c.hidden_size});
  em.add("embed", {}, m->embed_);
  em.norm("norm", c.hidden_size, m->norm_, c.zero_centered_norm);
  m->lm_head_ = c.tie_word_embeddings ? m->embed_ : em.make({c.vocab_size, c.hidden_size});
  if (!c.tie_word_embeddings) em.add("lm_head", {}, m->lm_head_);
  // The same scheme as TargetModel::random: N(0, std^2) inputs, residual outputs scaled by
  // 1/sqrt(2L), norms around their neutral value; A_log ~ log U(1, 16), dt_bias 1.
  const double out_scale = 1.0 / std::sqrt(2.0 * double(c.num_hidden_layers));
  for (auto& j : em.jobs) {
    const std::string& n = j.name;
    auto ends = [&](const char* s) { return n.size() >= strlen(s) && n.compare(n.size() - strlen(s), strlen(s), s) == 0; };
    if (ends("A_log")) j.dst.uniform_(1.0, 16.0).log_();
    else if (ends("dt_bias")) j.dst.fill_(1.0);
    else if (ends("norm.weight") || ends("layernorm.weight") || n == "norm")
      j.dst.normal_(c.zero_centered_norm && !ends("linear_attn.norm.weight") ? 0.0 : 1.0, 0.1);
    else if (ends("conv1d.weight")) j.dst.normal_(0.0, 0.3);
    else {
      j.dst.normal_(0.0, std);
      if (ends("o_proj.weight") || ends("down_proj") || ends("down_proj.weight") || ends("out_proj.weight"))
        j.dst.mul_(out_scale);
    }
  }
  for (auto& p : em.posts) p.apply(p.raw);
  m->inv_freq_ = rope_inv_freq(c).to(device);
  return m;
}

std::pair<at::Tensor, at::Tensor> load_hybrid_embeddings(const HfConfig& c, const std::string& dir,
                                                         at::ScalarType dtype, at::Device device) {
  auto [file, fused] = open_checked(c, dir);
  (void)fused;
  const std::vector<int64_t> shape = {c.vocab_size, c.hidden_size};
  at::Tensor embed = file.load(c.weight_prefix + "embed_tokens.weight", dtype, device, &shape);
  at::Tensor head = c.tie_word_embeddings ? embed : file.load("lm_head.weight", dtype, device, &shape);
  return {embed, head};
}

}  // namespace dflash::model
