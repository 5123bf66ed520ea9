// target_family_bench: capture-forward speed of the qwen3_moe and qwen3_5 targets
// (trainer/model/target_qwen35.h) with random weights at real shapes.
//
//   target_family_bench [--config qwen3-30b-a3b|qwen3.5-9b|tiny-moe|tiny-qwen35]
//                       [--shapes 8x2048,4x4096] [--iters 5] [--json FILE] [--profile]
//   --profile (qwen3_5): the Gated DeltaNet's sections of one forward, timed by device marks
//
// The model is built with only the layers the capture runs (the default DFlash ids, 5 features:
// Qwen3-30B-A3B [1, 12, 23, 34, 45] -> 46 layers; Qwen3.5-9B [1, 8, 15, 22, 29] -> 30 layers),
// bf16 on CUDA (float32 on CPU), B packed documents of S tokens. Prints tokens/s, TFLOP/s and
// MFU against a bf16 8192^3 matmul measured in the same run.
//
// Model FLOPs per token (no recomputation, the routed experts only):
//   matrix products: 2 x (weights a token multiplies with) summed over the layers run:
//     attention layer: H (q rows [x2 with the output gate] + 2 kv) + q H;
//     linear layer: H (2 key_dim + 2 value_dim + 2 nv) + value_dim H;
//     dense MLP 3 H I; MoE: router H E + top_k 3 H I_moe (+ shared 3 H I_s + H);
//   causal attention: 4 q_dim (S + 1) / 2 per attention layer;
//   gated delta rule: 6 dk dv per value head per linear layer (read, update, output of S).
// Shapes of Qwen3.5-9B: transformers' Qwen3_5TextConfig defaults, documented there as the
// Qwen3.5-9B configuration (H 4096, 32 layers 3:1 linear:full, 16/4 heads x 256, partial RoPE
// 0.25, linear 16 key / 32 value heads x 128, I 12288, vocab 248320); not checked against the hub.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "bench/bench_common.h"
#include "core/error.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/target.h"
#include "trainer/model/target_deltanet.h"
#include "trainer/metrics/timeline.h"

using dflash::throw_user;
using namespace dflash::bench;
using dflash::model::HfConfig;
using dflash::model::TargetModel;

namespace {

// Wall clock + synchronise per run, as bench/target_family_bench_hf.py times transformers.
constexpr Timing kTiming = Timing::Wall;

std::string config_json(const std::string& which) {
  if (which == "qwen3-30b-a3b")
    return R"({"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe","hidden_size":2048,)"
           R"("num_hidden_layers":48,"num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,)"
           R"("intermediate_size":6144,"moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8,)"
           R"("norm_topk_prob":true,"decoder_sparse_step":1,"mlp_only_layers":[],"vocab_size":151936,)"
           R"("max_position_embeddings":40960,"rms_norm_eps":1e-06,"rope_theta":1000000,"tie_word_embeddings":false})";
  if (which == "qwen3.5-9b")
    return R"({"architectures":["Qwen3_5ForCausalLM"],"model_type":"qwen3_5_text","hidden_size":4096,)"
           R"("num_hidden_layers":32,"num_attention_heads":16,"num_key_value_heads":4,"head_dim":256,)"
           R"("intermediate_size":12288,"vocab_size":248320,"linear_num_key_heads":16,"linear_num_value_heads":32,)"
           R"("linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,)"
           R"("full_attention_interval":4,"rms_norm_eps":1e-06,)"
           R"("rope_parameters":{"rope_type":"default","rope_theta":10000000,"partial_rotary_factor":0.25}})";
  if (which == "tiny-moe")
    return R"({"model_type":"qwen3_moe","hidden_size":128,"num_hidden_layers":8,"num_attention_heads":4,)"
           R"("num_key_value_heads":2,"head_dim":32,"moe_intermediate_size":64,"num_experts":8,)"
           R"("num_experts_per_tok":2,"vocab_size":1000})";
  if (which == "tiny-qwen35")
    return R"({"model_type":"qwen3_5_text","hidden_size":128,"num_hidden_layers":8,"num_attention_heads":4,)"
           R"("num_key_value_heads":2,"head_dim":64,"intermediate_size":256,"vocab_size":1000,)"
           R"("linear_num_key_heads":2,"linear_num_value_heads":4,"linear_key_head_dim":32,"linear_value_head_dim":32})";
  throw_user("unknown --config '{}' (qwen3-30b-a3b, qwen3.5-9b, tiny-moe, tiny-qwen35)", which);
}

// --profile: the Gated DeltaNet's sections (target_deltanet.h hook) timed by device marks over
// one forward, summed over the layers.
struct SectionRecorder {
  dflash::metrics::Timeline* tl = nullptr;
  std::vector<std::pair<std::string, int64_t>> marks;  // section ("" = end), mark id
};
SectionRecorder g_rec;
void record_section(const char* name) { g_rec.marks.emplace_back(name ? name : "", g_rec.tl->mark()); }

void profile_deltanet(const at::Device& dev, double fwd_s, const std::function<void()>& fwd) {
  dflash::metrics::Timeline tl(dev);
  g_rec = SectionRecorder{&tl, {}};
  dflash::model::set_deltanet_section_hook(record_section);
  const int64_t begin = tl.mark();
  fwd();
  const int64_t end = tl.mark();
  dflash::model::set_deltanet_section_hook(nullptr);
  std::vector<std::pair<std::string, double>> sums;
  double in_deltanet = 0;
  for (size_t i = 0; i + 1 < g_rec.marks.size(); ++i) {
    const auto& [name, id] = g_rec.marks[i];
    if (name.empty()) continue;
    const double t = tl.seconds(id, g_rec.marks[i + 1].second);
    in_deltanet += t;
    auto it = std::find_if(sums.begin(), sums.end(), [&](const auto& p) { return p.first == name; });
    if (it == sums.end()) sums.emplace_back(name, t);
    else it->second += t;
  }
  const double total = tl.seconds(begin, end);
  std::printf("  profile of one forward (%.1f ms with the marks; timed %.1f ms): Gated DeltaNet sections, all layers\n",
              total * 1e3, fwd_s * 1e3);
  for (const auto& [name, t] : sums)
    std::printf("    %-14s %8.1f ms %6.1f%%\n", name.c_str(), t * 1e3, 100 * t / total);
  std::printf("    %-14s %8.1f ms %6.1f%%\n", "rest", (total - in_deltanet) * 1e3, 100 * (total - in_deltanet) / total);
  g_rec = SectionRecorder{};
}

double flop_per_token(const HfConfig& c, int64_t layers, int64_t S) {
  const double H = double(c.hidden_size);
  double f = 0;
  for (int64_t l = 0; l < layers; ++l) {
    double w = 0;
    if (c.is_linear_layer(l)) {
      w += H * (2.0 * c.linear_key_dim() + 2.0 * c.linear_value_dim() + 2.0 * c.linear_num_value_heads) +
           double(c.linear_value_dim()) * H;
      f += 6.0 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
    } else {
      w += H * (c.q_dim() * (c.attn_output_gate ? 2.0 : 1.0) + 2.0 * c.kv_dim()) + c.q_dim() * H;
      f += 4.0 * c.q_dim() * double(S + 1) / 2.0;
    }
    if (c.is_moe_layer(l) || (c.num_experts > 0 && c.family == dflash::model::TargetFamily::Qwen35)) {
      w += H * c.num_experts + c.num_experts_per_tok * 3.0 * H * c.moe_intermediate_size;
      if (c.shared_expert_intermediate_size > 0) w += 3.0 * H * c.shared_expert_intermediate_size + H;
    } else {
      w += 3.0 * H * c.intermediate_size;
    }
    f += 2.0 * w;
  }
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string config = "qwen3-30b-a3b", json;
    std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 2048}, {4, 4096}};
    int iters = 5;
    bool profile = false;
    for (int i = 1; i < argc; ++i) {
      std::string k = argv[i];
      if (k == "--profile") {
        profile = true;
        continue;
      }
      if (i + 1 >= argc) throw_user("option {} needs a value", k);
      std::string v = argv[++i];
      if (k == "--config") config = v;
      else if (k == "--json") json = v;
      else if (k == "--iters") iters = std::stoi(v);
      else if (k == "--shapes") shapes = parse_shapes(v);
      else throw_user("unknown option {} (--config, --shapes, --iters, --json, --profile)", k);
    }
    c10::InferenceMode guard;
    const at::Device dev = bench_device();
    const at::ScalarType dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
    HfConfig full = dflash::model::parse_hf_config(config_json(config), config);
    std::vector<int64_t> ids_cap = dflash::model::default_layer_ids(full.num_hidden_layers, 5);
    HfConfig c = full;
    c.num_hidden_layers = ids_cap.back() + 1;  // only the layers the capture runs
    if (!c.layer_types.empty()) c.layer_types.resize(c.num_hidden_layers);
    const int64_t n = dev.is_cuda() ? 8192 : 512;
    const double peak = matmul_flops(dev, dtype, n, iters, kTiming);
    auto t0 = std::chrono::steady_clock::now();
    TargetModel m = TargetModel::random(c, dtype, dev, 1234);
    sync(dev);
    std::printf("target_family_bench: %s (%s), %s on %s, capture ids [%s], %ld layers run, init %.1f s\n",
                config.c_str(), c.model_type.c_str(), c10::toString(dtype), dev.str().c_str(),
                fmt::format("{}", fmt::join(ids_cap, ", ")).c_str(), long(c.num_hidden_layers),
                seconds_since(t0));
    std::printf("matmul %ld^3: %.1f TFLOP/s\n%-10s %10s %12s %10s %8s\n", long(n), peak / 1e12, "shape",
                "ms/fwd", "tokens/s", "TFLOP/s", "MFU");
    std::string rows;
    for (auto [B, S] : shapes) {
      const int64_t T = B * S;
      at::Tensor ids = at::randint(0, c.vocab_size, {T}, at::TensorOptions().dtype(at::kLong).device(dev));
      at::Tensor cu = at::arange(0, T + 1, S, at::kInt).to(dev);
      at::Tensor out = m.capture(ids, cu, ids_cap);
      if (!at::isfinite(out).all().item<bool>()) throw std::runtime_error("non-finite captured states");
      const double s = time_median(dev, iters, [&] { m.capture(ids, cu, ids_cap); }, kTiming);
      if (profile && c.family == dflash::model::TargetFamily::Qwen35)
        profile_deltanet(dev, s, [&] { m.capture(ids, cu, ids_cap); });
      if (dev.is_cuda() && c.family == dflash::model::TargetFamily::Qwen35) {
        // the other setting of each Gated DeltaNet knob, in the same run: time and captured-state difference
        auto other = [&](const char* what, const char* env, bool now, void (*set)(bool)) {
          set(!now);
          at::Tensor alt = m.capture(ids, cu, ids_cap).to(at::kFloat);
          const double s_alt = time_median(dev, std::min(iters, 3), [&] { m.capture(ids, cu, ids_cap); }, kTiming);
          set(now);
          at::Tensor base = out.to(at::kFloat), d = (alt - base).abs();
          std::printf("  %s %s (%s=%d): %.1f ms/fwd against %.1f; captured states: max |diff| / max |default| "
                      "%.2e, mean |diff| / mean |default| %.2e\n", what, now ? "off" : "on", env, now ? 0 : 1,
                      s_alt * 1e3, s * 1e3, d.max().item<double>() / base.abs().max().item<double>(),
                      d.mean().item<double>() / base.abs().mean().item<double>());
        };
        other("delta rule's float32 products on TF32", dflash::model::kDeltaNetTf32Env, dflash::model::deltanet_tf32(),
              dflash::model::set_deltanet_tf32);
        other("fused q/k/v grid and gated-norm kernels", dflash::model::kDeltaNetFusedEnv,
              dflash::model::deltanet_fused(dev), dflash::model::set_deltanet_fused);
      }
      const double fl = flop_per_token(c, c.num_hidden_layers, S) * T / s;
      std::printf("%-10s %10.1f %12.0f %10.1f %7.1f%%\n", fmt::format("{}x{}", B, S).c_str(), s * 1e3, T / s,
                  fl / 1e12, 100.0 * fl / peak);
      rows += fmt::format("{}{{\"shape\":\"{}x{}\",\"ms\":{:.3f},\"tokens_per_s\":{:.1f},\"tflops\":{:.2f},"
                          "\"mfu\":{:.4f},\"first_call_ms\":0}}", rows.empty() ? "" : ",", B, S, s * 1e3,
                          T / s, fl / 1e12, fl / peak);
      std::fflush(stdout);
    }
    if (!json.empty())
      std::ofstream(json) << fmt::format("{{\"config\":\"{}\",\"layers\":{},\"matmul_tflops\":{:.2f},\"rows\":[{}]}}\n",
                                         config, c.num_hidden_layers, peak / 1e12, rows);
    return 0;
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "target_family_bench: error: %s\n", e.what());
    return dflash::kExitUser;
  }
}
