// target_bench: speed of the target model's capture forward, and of loading a checkpoint.
//
//   target_bench forward [--shapes 8x2048,4x4096] [--iters 8] [--config qwen3-8b|tiny]
//                        [--json FILE]
//       Random bf16 weights (CUDA; float32 on CPU), capture of layer ids [1, 9, 17, 25, 33]
//       (the default DFlash ids for 36 layers; tiny: [0, 1]) over B packed documents of S tokens.
//       Prints tokens/s, TFLOP/s and MFU against a bf16 8192^3 matmul measured in the same run.
//   target_bench attention [--shapes ...]
//       Packed causal attention alone: FlashAttention-2 varlen, the DFlash kernel's causal mode
//       (the default backend on Hopper) and cuDNN's varlen attention.
//   target_bench write-checkpoint DIR [--shards 5] [--config ...]
//       Writes a random model as a Hugging Face checkpoint (config.json, shards, index).
//   target_bench load DIR [--cache cold,warm] [--json FILE]
//       Time to read the checkpoint's files (read(2), 64 MiB blocks) and to load the model onto
//       the device (TargetModel::load), each after evicting the files from the page cache
//       (fdatasync + posix_fadvise DONTNEED: "cold") and/or with the files cached ("warm").
//
// FLOPs counted (notes/performance.md), per token, model FLOPs, no recomputation:
//   2 * layers_run * (weights of one decoder layer)            matrix products
//   + layers_run * 2 * 2 * nq * head_dim * (S + 1) / 2         causal attention, QK^T and PV
// where layers_run = last captured id + 1 (capture stops there; no final norm, no LM head).
// Qwen3-8B: 192,937,984 weights per layer, 34 layers run: 13.69 GFLOP/token at S = 2048.
// MFU = achieved FLOP/s / measured bf16 matmul FLOP/s. Times: median of --iters after 2
// warm-up runs (CUDA events).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "bench/bench_common.h"
#include "core/error.h"
#include "trainer/model/hf_config.h"
#include "trainer/model/safetensors.h"
#include "trainer/model/target.h"
#include "trainer/model/target_ops.h"
#if DFLASH_ATTENTION_KERNEL
#include "attention/kernel.h"
#endif

namespace fs = std::filesystem;
using dflash::throw_user;
using namespace dflash::bench;
using dflash::model::HfConfig;
using dflash::model::TargetModel;

namespace {

// ---- helpers ------------------------------------------------------------------------------------

std::string qwen3_config_json(const std::string& which) {
  if (which == "qwen3-8b")
    return R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":4096,)"
           R"("num_hidden_layers":36,"num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,)"
           R"("intermediate_size":12288,"vocab_size":151936,"max_position_embeddings":40960,)"
           R"("rms_norm_eps":1e-06,"rope_theta":1000000,"tie_word_embeddings":false,)"
           R"("bos_token_id":151643,"eos_token_id":151645,"hidden_act":"silu",)"
           R"("attention_bias":false,"torch_dtype":"bfloat16"})";
  if (which == "tiny")
    return R"({"architectures":["Qwen3ForCausalLM"],"model_type":"qwen3","hidden_size":128,)"
           R"("num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,)"
           R"("intermediate_size":256,"vocab_size":1000,"rms_norm_eps":1e-06,"rope_theta":1000000,)"
           R"("tie_word_embeddings":false,"torch_dtype":"bfloat16"})";
  throw_user("unknown --config '{}' (qwen3-8b, tiny)", which);
}

std::vector<int64_t> capture_ids_for(const HfConfig& c) {
  if (c.num_hidden_layers == 36) return {1, 9, 17, 25, 33};
  return {0, c.num_hidden_layers - 2};
}

struct Args {
  std::string cmd, dir, config = "qwen3-8b", json;
  std::vector<std::string> cache = {"cold", "warm"};
  std::vector<std::pair<int64_t, int64_t>> shapes = {{8, 2048}, {4, 4096}};
  int iters = 8;
  int shards = 5;
};

Args parse(int argc, char** argv) {
  Args a;
  if (argc < 2) throw_user("usage: target_bench forward|write-checkpoint DIR|load DIR [options]");
  a.cmd = argv[1];
  int i = 2;
  if (a.cmd == "write-checkpoint" || a.cmd == "load") {
    if (argc < 3) throw_user("target_bench {}: needs a directory", a.cmd);
    a.dir = argv[i++];
  }
  for (; i < argc; ++i) {
    std::string k = argv[i];
    if (i + 1 >= argc) throw_user("option {} needs a value", k);
    std::string v = argv[++i];
    if (k == "--config") a.config = v;
    else if (k == "--json") a.json = v;
    else if (k == "--iters") a.iters = std::stoi(v);
    else if (k == "--shards") a.shards = std::stoi(v);
    else if (k == "--cache") {
      a.cache.clear();
      size_t p = 0;
      while (p <= v.size()) {
        size_t e = v.find(',', p);
        if (e == std::string::npos) e = v.size();
        std::string c = v.substr(p, e - p);
        if (c != "cold" && c != "warm") throw_user("--cache: '{}' is not cold or warm", c);
        a.cache.push_back(c);
        p = e + 1;
      }
    }
    else if (k == "--shapes") a.shapes = parse_shapes(v);
    else throw_user("unknown option {}", k);
  }
  return a;
}

void write_json(const std::string& path, const std::string& body) {
  if (path.empty()) return;
  std::ofstream(path) << body << "\n";
}

// ---- forward ------------------------------------------------------------------------------------

// Time of each operation of one decoder layer (layer 0's weights) at B x S, to see where a
// layer's time goes; the sum is compared with the measured per-layer time.
void breakdown(const TargetModel& m, int64_t B, int64_t S, int iters, double peak) {
  namespace ops = dflash::model::ops;
  const HfConfig& c = m.config();
  at::Device dev = m.device();
  const int64_t T = B * S, H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim;
  const int64_t nq = c.num_attention_heads, nkv = c.num_key_value_heads;
  const auto& w = m.layers()[0];
  auto opt = at::TensorOptions().dtype(m.dtype()).device(dev);
  at::Tensor x = at::randn({T, H}, opt);
  at::Tensor h = ops::rms_norm(x, w.input_norm, c.rms_norm_eps);
  at::Tensor qkv = at::mm(h, w.wqkv.t());
  std::vector<int64_t> cu;
  for (int64_t b = 0; b <= B; ++b) cu.push_back(b * S);
  at::Tensor cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(dev);
  auto [cos, sin] = ops::rope_cos_sin(ops::positions_from_cu(cu, T).to(dev),
                                      dflash::model::rope_inv_freq(c).to(dev));
  auto [q, k, v] = ops::qkv_heads(qkv, nq, nkv, hd, w.q_norm, w.k_norm, c.rms_norm_eps, cos, sin);
  const double scale = 1.0 / std::sqrt(double(hd));
  at::Tensor meta;  // the kernel backend's tile metadata, built once per pass as in the model
  at::Tensor attn = ops::varlen_causal_attention(q, k, v, cu, cu_dev, S, scale, &meta);
  const std::string attn_name = std::string("attention: ") + ops::causal_backend_name(ops::causal_backend(q));
  at::Tensor gu = at::mm(h, w.w_gate_up.t());
  at::Tensor act = ops::silu_mul(gu, I);
  at::Tensor cap = at::empty({T, 5 * H}, opt);
  struct Item {
    const char* name;
    double flops;
    std::function<void()> fn;
  };
  std::vector<Item> items = {
      {"rms_norm (x2 per layer)", 0, [&] { ops::rms_norm(x, w.input_norm, c.rms_norm_eps); }},
      {"qkv GEMM", 2.0 * T * H * w.wqkv.size(0), [&] { at::mm(h, w.wqkv.t()); }},
      {"q/k norm + RoPE", 0, [&] {
         ops::qkv_heads(qkv, nq, nkv, hd, w.q_norm, w.k_norm, c.rms_norm_eps, cos, sin);
       }},
      {attn_name.c_str(), 4.0 * nq * hd * double(S + 1) / 2 * T,
       [&] { ops::varlen_causal_attention(q, k, v, cu, cu_dev, S, scale, &meta); }},
      {"o_proj addmm_", 2.0 * T * H * nq * hd,
       [&] { x.addmm_(attn.reshape({T, nq * hd}), w.wo.t()); }},
      {"gate_up GEMM", 2.0 * T * H * 2 * I, [&] { at::mm(h, w.w_gate_up.t()); }},
      {"silu_mul", 0, [&] { ops::silu_mul(gu, I); }},
      {"down addmm_", 2.0 * T * H * I, [&] { x.addmm_(act, w.w_down.t()); }},
      {"capture copy (1 of 5)", 0, [&] { cap.narrow(1, H, H).copy_(x); }},
  };
  std::printf("\nbreakdown of one layer at %ldx%ld (median of %d):\n", long(B), long(S), iters);
  std::printf("%-44s %9s %9s\n", "op", "ms", "TFLOP/s");
  double total = 0;
  for (auto& it : items) {
    double s = time_median(dev, iters, it.fn);
    double n = std::string(it.name).rfind("rms_norm", 0) == 0 ? 2 : 1;
    total += n * s;
    std::printf("%-44s %9.3f %9.1f\n", it.name, s * 1e3, it.flops ? it.flops / s / 1e12 : 0.0);
  }
  std::printf("%-44s %9.3f   (matmul ceiling %.0f TFLOP/s)\n", "sum (rms_norm twice)", total * 1e3,
              peak / 1e12);
  // Not in the layer: the same attention on q/k/v copied into contiguous [T, heads, hd] tensors
  // (the model passes strided views of the qkv GEMM's output): what the layout costs.
  at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  at::Tensor meta_c;
  const double flops_attn = 4.0 * nq * hd * double(S + 1) / 2 * T;
  const double s_c = time_median(dev, iters, [&] { ops::varlen_causal_attention(qc, kc, vc, cu, cu_dev, S, scale, &meta_c); });
  std::printf("%-44s %9.3f %9.1f\n", "(attention on contiguous q/k/v copies)", s_c * 1e3, flops_attn / s_c / 1e12);
}

int forward(const Args& a) {
  c10::InferenceMode guard;
  at::Device dev = bench_device();
  at::ScalarType dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  HfConfig c = dflash::model::parse_hf_config(qwen3_config_json(a.config), a.config);
  std::vector<int64_t> ids_cap = capture_ids_for(c);
  const int64_t layers_run = ids_cap.back() + 1;
  const int64_t H = c.hidden_size, I = c.intermediate_size;
  // Weights of the matrix products of one layer (norm weights are not matrix FLOPs).
  const double layer_weights =
      double(H) * (c.q_dim() + 2 * c.kv_dim()) + double(c.q_dim()) * H + 3.0 * H * I;

  // Matmul ceiling in the same run.
  const double peak = matmul_flops(dev, dtype, dev.is_cuda() ? 8192 : 1024, a.iters);
  auto t0 = std::chrono::steady_clock::now();
  TargetModel m = TargetModel::random(c, dtype, dev, 1234);
  sync(dev);
  double init_s = seconds_since(t0);

  std::printf("target_bench forward: %s, %s on %s, capture ids [%s], %ld layers run\n",
              a.config.c_str(), c10::toString(dtype), dev.str().c_str(),
              fmt::format("{}", fmt::join(ids_cap, ", ")).c_str(), long(layers_run));
  std::printf("matmul %s %ld^3: %.1f TFLOP/s; random model init %.1f s\n", c10::toString(dtype),
              long(dev.is_cuda() ? 8192 : 1024), peak / 1e12, init_s);
  std::string rows;
  std::string table = fmt::format("{:<10} {:>10} {:>12} {:>10} {:>8} {:>14}\n", "shape",
                                  "ms/fwd", "tokens/s", "TFLOP/s", "MFU", "first call ms");
  for (auto [B, S] : a.shapes) {
    const int64_t T = B * S;
    at::Tensor ids = at::randint(0, c.vocab_size, {T}, at::TensorOptions().dtype(at::kLong).device(dev));
    at::Tensor cu = at::arange(0, T + 1, S, at::kInt).to(dev);
    auto tf = std::chrono::steady_clock::now();
    at::Tensor out = m.capture(ids, cu, ids_cap);
    sync(dev);
    double first_ms = seconds_since(tf) * 1e3;
    if (!at::isfinite(out).all().item<bool>()) throw std::runtime_error("non-finite captured states");
    double s = time_median(dev, a.iters, [&] { m.capture(ids, cu, ids_cap); });
    const double flop_tok = 2.0 * layers_run * layer_weights +
                            layers_run * 4.0 * c.q_dim() * double(S + 1) / 2.0;
    const double tps = T / s, flops = flop_tok * T / s;
    table += fmt::format("{:<10} {:>10.1f} {:>12.0f} {:>10.1f} {:>7.1f}% {:>14.0f}\n",
                         fmt::format("{}x{}", B, S), s * 1e3, tps, flops / 1e12,
                         100.0 * flops / peak, first_ms);
    rows += fmt::format("{}{{\"shape\":\"{}x{}\",\"ms\":{:.3f},\"tokens_per_s\":{:.1f},"
                        "\"tflops\":{:.2f},\"mfu\":{:.4f},\"first_call_ms\":{:.1f},"
                        "\"gflop_per_token\":{:.4f}}}",
                        rows.empty() ? "" : ",", B, S, s * 1e3, tps, flops / 1e12, flops / peak,
                        first_ms, flop_tok / 1e9);
  }
  std::printf("%s", table.c_str());
  write_json(a.json, fmt::format("{{\"matmul_tflops\":{:.2f},\"rows\":[{}]}}", peak / 1e12, rows));
  std::fflush(stdout);
  if (!a.shapes.empty()) breakdown(m, a.shapes[0].first, a.shapes[0].second, a.iters, peak);
  return 0;
}

// The packed causal attention of one Qwen3-8B layer at B x S: FlashAttention-2 varlen, the DFlash
// kernel's causal mode (DFLASH_TARGET_ATTENTION=auto on Hopper) and cuDNN's varlen attention:
// time and max-norm distance to flash (the GPU tests check both against fp32).
int attention(const Args& a) {
  c10::InferenceMode guard;
  at::Device dev = bench_device();
  if (!dev.is_cuda()) {
    std::printf("target_bench attention: needs CUDA\n");
    return 0;
  }
  const int64_t nq = 32, nkv = 8, hd = 128;
  const double scale = 1.0 / std::sqrt(double(hd));
  std::printf("target_bench attention: packed causal, %ld q / %ld kv heads, head_dim %ld, bf16\n",
              long(nq), long(nkv), long(hd));
  std::printf("%-10s %-8s %9s %9s %s\n", "shape", "backend", "ms", "TFLOP/s", "max-norm diff to flash");
  for (auto [B, S] : a.shapes) {
    const int64_t T = B * S;
    auto opt = at::TensorOptions().dtype(at::kBFloat16).device(dev);
    at::Tensor q = at::randn({T, nq, hd}, opt), k = at::randn({T, nkv, hd}, opt),
               v = at::randn({T, nkv, hd}, opt);
    std::vector<int64_t> cu;
    for (int64_t i = 0; i <= B; ++i) cu.push_back(i * S);
    at::Tensor cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(dev);
    const double flops = 4.0 * nq * hd * double(S + 1) / 2 * T;
    auto flash = [&] {
      return std::get<0>(at::_flash_attention_forward(q, k, v, cu_dev, cu_dev, S, S, 0.0, true,
                                                      false, scale));
    };
    at::Tensor ref = flash().to(at::kFloat);
    double s_flash = time_median(dev, a.iters, flash);
    std::string shape = fmt::format("{}x{}", B, S);
    std::printf("%-10s %-8s %9.3f %9.1f\n", shape.c_str(), "flash", s_flash * 1e3,
                flops / s_flash / 1e12);
#if DFLASH_ATTENTION_KERNEL
    {
      at::Tensor meta;
      auto kern = [&] { return dflash::attention::kernel_causal_varlen(q, k, v, cu_dev, scale, meta); };
      at::Tensor o = kern().to(at::kFloat);
      const double err = (o - ref).abs().max().item<double>() / ref.abs().max().item<double>();
      const double s_k = time_median(dev, a.iters, kern);
      std::printf("%-10s %-8s %9.3f %9.1f %.2e  (%.2fx flash)\n", shape.c_str(), "kernel", s_k * 1e3,
                  flops / s_k / 1e12, err, s_flash / s_k);
    }
#endif
    try {
      auto cudnn = [&] {
        return std::get<0>(at::_cudnn_attention_forward(q, k, v, {}, cu_dev, cu_dev, S, S, false,
                                                        0.0, true, false, scale));
      };
      at::Tensor o = cudnn().to(at::kFloat);
      double err = o.sizes() == ref.sizes()
                       ? (o - ref).abs().max().item<double>() / ref.abs().max().item<double>()
                       : -1.0;
      double s_cudnn = time_median(dev, a.iters, cudnn);
      std::printf("%-10s %-8s %9.3f %9.1f %.2e%s\n", shape.c_str(), "cudnn", s_cudnn * 1e3,
                  flops / s_cudnn / 1e12, err, err < 0 ? " (output shape differs)" : "");
    } catch (const std::exception& e) {
      std::string msg = e.what();
      std::printf("%-10s %-8s unavailable: %s\n", shape.c_str(), "cudnn",
                  msg.substr(0, 160).c_str());
    }
  }
  return 0;
}

// ---- checkpoint writing and loading -------------------------------------------------------------

int write_checkpoint(const Args& a) {
  c10::InferenceMode guard;
  at::Device dev = bench_device();
  std::string cfg_text = qwen3_config_json(a.config);
  HfConfig c = dflash::model::parse_hf_config(cfg_text, a.config);
  TargetModel m = TargetModel::random(c, at::kBFloat16, dev, 4321);
  fs::create_directories(a.dir);
  std::ofstream(fs::path(a.dir) / "config.json") << cfg_text << "\n";

  // HF names, unfused, in HF order.
  std::vector<std::pair<std::string, at::Tensor>> all;
  all.emplace_back("model.embed_tokens.weight", m.embed_tokens());
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), I = c.intermediate_size;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const auto& w = m.layers()[i];
    std::string p = fmt::format("model.layers.{}.", i);
    all.emplace_back(p + "input_layernorm.weight", w.input_norm);
    all.emplace_back(p + "self_attn.q_proj.weight", w.wqkv.narrow(0, 0, qd));
    all.emplace_back(p + "self_attn.k_proj.weight", w.wqkv.narrow(0, qd, kvd));
    all.emplace_back(p + "self_attn.v_proj.weight", w.wqkv.narrow(0, qd + kvd, kvd));
    all.emplace_back(p + "self_attn.o_proj.weight", w.wo);
    all.emplace_back(p + "self_attn.q_norm.weight", w.q_norm);
    all.emplace_back(p + "self_attn.k_norm.weight", w.k_norm);
    all.emplace_back(p + "post_attention_layernorm.weight", w.post_norm);
    all.emplace_back(p + "mlp.gate_proj.weight", w.w_gate_up.narrow(0, 0, I));
    all.emplace_back(p + "mlp.up_proj.weight", w.w_gate_up.narrow(0, I, I));
    all.emplace_back(p + "mlp.down_proj.weight", w.w_down);
  }
  all.emplace_back("model.norm.weight", m.final_norm());
  all.emplace_back("lm_head.weight", m.lm_head());
  double total = 0;
  for (auto& [n, t] : all) total += double(t.numel()) * t.element_size();

  auto t0 = std::chrono::steady_clock::now();
  std::string weight_map;
  size_t next = 0;
  for (int s = 0; s < a.shards; ++s) {
    std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, a.shards);
    std::vector<std::pair<std::string, at::Tensor>> part;
    double bytes = 0;
    while (next < all.size() && (s == a.shards - 1 || bytes < total / a.shards)) {
      bytes += double(all[next].second.numel()) * all[next].second.element_size();
      part.push_back(all[next]);
      weight_map += fmt::format("{}\"{}\":\"{}\"", weight_map.empty() ? "" : ",", all[next].first, file);
      ++next;
    }
    dflash::st::save((fs::path(a.dir) / file).string(), part, {{"format", "pt"}}, /*durable=*/false);
  }
  std::ofstream(fs::path(a.dir) / "model.safetensors.index.json")
      << fmt::format("{{\"metadata\":{{\"total_size\":{:.0f}}},\"weight_map\":{{{}}}}}\n", total,
                     weight_map);
  std::printf("wrote %s: %.2f GB in %d shards, %.1f s\n", a.dir.c_str(), total / 1e9, a.shards,
              seconds_since(t0));
  return 0;
}

std::vector<std::string> checkpoint_files(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

void evict(const std::vector<std::string>& files) {
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

double read_files(const std::vector<std::string>& files, double* bytes_out) {
  std::vector<char> buf(64 << 20);
  double bytes = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (const auto& f : files) {
    int fd = ::open(f.c_str(), O_RDONLY);
    if (fd < 0) throw_user("cannot open {}", f);
    ssize_t n;
    while ((n = ::read(fd, buf.data(), buf.size())) > 0) bytes += double(n);
    ::close(fd);
  }
  *bytes_out = bytes;
  return seconds_since(t0);
}

int load(const Args& a) {
  at::Device dev = bench_device();
  at::ScalarType dtype = dev.is_cuda() ? at::kBFloat16 : at::kFloat;
  std::vector<std::string> files = checkpoint_files(a.dir);
  double bytes = 0;
  std::map<std::string, double> r;
  for (const std::string& state : a.cache) {
    if (state == "cold") evict(files);
    r["read_" + state] = read_files(files, &bytes);
    if (state == "cold") evict(files);
    auto t0 = std::chrono::steady_clock::now();
    {
      TargetModel m = TargetModel::load(a.dir, dtype, dev);
      sync(dev);
      r["load_" + state] = seconds_since(t0);
    }
  }
  std::printf("target_bench load: %s, %zu files, %.2f GB, onto %s as %s\n", a.dir.c_str(),
              files.size(), bytes / 1e9, dev.str().c_str(), c10::toString(dtype));
  std::printf("%-6s %10s %10s %12s %12s %8s\n", "cache", "read s", "load s", "read GB/s",
              "load GB/s", "ratio");
  std::string js = fmt::format("{{\"gb\":{:.3f}", bytes / 1e9);
  for (const std::string& state : a.cache) {
    double rd = r["read_" + state], ld = r["load_" + state];
    std::printf("%-6s %10.2f %10.2f %12.2f %12.2f %8.2f\n", state.c_str(), rd, ld,
                bytes / rd / 1e9, bytes / ld / 1e9, ld / rd);
    js += fmt::format(",\"read_{}_s\":{:.3f},\"load_{}_s\":{:.3f}", state, rd, state, ld);
  }
  write_json(a.json, js + "}");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Args a = parse(argc, argv);
    if (a.cmd == "forward") return forward(a);
    if (a.cmd == "write-checkpoint") return write_checkpoint(a);
    if (a.cmd == "load") return load(a);
    if (a.cmd == "attention") return attention(a);
    throw_user("unknown command '{}' (forward, write-checkpoint, load)", a.cmd);
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "target_bench: error: %s\n", e.what());
    return dflash::kExitUser;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "target_bench: internal error: %s\n", e.what());
    return dflash::kExitInternal;
  }
}
