// Test driver of the drafter for the Python reference tests (tests/drafter/test_drafter_ref.py).
//
//   drafter_tool case IN.safetensors OUT.safetensors
//     IN: the drafter spec in the metadata (see spec_from_meta), parameters under their export
//     names, target.embed / target.lm_head, batch.ids / batch.loss_mask / batch.features,
//     batch.doc_bounds [B, D+1] (-1 padded; absent: one document per row), blocks.anchor /
//     blocks.keep [B, N] (absent: sampled with metadata seed / batch_index / num_anchors).
//     Runs forward + backward in fp32 on the CPU; OUT: loss, grad.<name> of every parameter,
//     correct_per_pos / count_per_pos, tau_sum / tau_blocks, weight_sum, n_tokens, the blocks
//     used (blocks.*), the dense boolean mask (mask), and logits (metadata logits=1).
//   drafter_tool export IN.safetensors DIR      the parameters of IN (spec from its metadata) -> DIR
//   drafter_tool import DIR IN.safetensors OUT  import DIR for the target described by IN's
//     metadata (target_hidden_size / target_vocab_size / target_num_layers, default: the spec's),
//     then OUT: logits of IN's batch and blocks (fp32)
//   drafter_tool config8b OUT.json              config.json of a Qwen3-8B drafter (DFLASH.md §5)
// Errors: UserError -> message on stderr, exit 2.
#include <cstdio>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "attention/dflash_attention.h"
#include "core/error.h"
#include "core/parse.h"
#include "trainer/model/anchors.h"
#include "trainer/model/drafter.h"
#include "trainer/model/export.h"
#include "trainer/model/target.h"
#include "trainer/model/safetensors.h"

using namespace dflash;
using namespace dflash::model;

namespace {

std::string meta(const std::map<std::string, std::string>& m, const std::string& k, const std::string& def = "") {
  auto it = m.find(k);
  if (it != m.end()) return it->second;
  if (def.empty()) throw_user("input metadata: missing '{}'", k);
  return def;
}

DrafterSpec spec_from_meta(const std::map<std::string, std::string>& m) {
  DrafterSpec s;
  s.hidden_size = std::stoll(meta(m, "hidden_size"));
  s.intermediate_size = std::stoll(meta(m, "intermediate_size"));
  s.num_layers = std::stoll(meta(m, "num_hidden_layers"));
  s.num_heads = std::stoll(meta(m, "num_attention_heads"));
  s.num_kv_heads = std::stoll(meta(m, "num_key_value_heads"));
  s.head_dim = std::stoll(meta(m, "head_dim"));
  s.vocab_size = std::stoll(meta(m, "vocab_size"));
  s.rms_norm_eps = std::stod(meta(m, "rms_norm_eps"));
  s.rope_theta = std::stod(meta(m, "rope_theta"));
  s.block_size = std::stoll(meta(m, "block_size"));
  s.target_layer_ids = parse_int_list(meta(m, "target_layer_ids"), "input metadata: target_layer_ids");
  s.num_target_layers = std::stoll(meta(m, "num_target_layers"));
  s.mask_token_id = std::stoll(meta(m, "mask_token_id"));
  return s;
}

std::vector<DocBounds> docs_from(const st::SafeTensors& f) {
  if (!f.has("batch.doc_bounds")) return {};
  auto t = f.load("batch.doc_bounds", at::kLong, at::kCPU);
  std::vector<DocBounds> docs(t.size(0));
  for (int64_t b = 0; b < t.size(0); ++b)
    for (int64_t i = 0; i < t.size(1); ++i)
      if (t[b][i].item<int64_t>() >= 0) docs[b].push_back(t[b][i].item<int64_t>());
  return docs;
}

Drafter drafter_from(const st::SafeTensors& f) {
  Drafter drafter(spec_from_meta(f.metadata()), at::kCPU, at::kFloat);
  for (auto& [name, t] : drafter.named_parameters()) drafter.load_param(name, f.load(name, at::kFloat, at::kCPU));
  return drafter;
}

DrafterBatch batch_from(const st::SafeTensors& f) {
  const auto& m = f.metadata();
  DrafterBatch batch;
  batch.ids = f.load("batch.ids", at::kLong, at::kCPU);
  batch.loss_mask = f.load("batch.loss_mask", at::kLong, at::kCPU);
  batch.features = f.load("batch.features", at::kFloat, at::kCPU);
  batch.docs = docs_from(f);
  batch.global_batch_index = std::stoll(meta(m, "batch_index", "0"));
  return batch;
}

int run_export(const std::string& in_path, const std::string& dir) {
  auto f = st::SafeTensors::open(in_path);
  export_drafter(drafter_from(f), dir);
  return 0;
}

int run_import(const std::string& dir, const std::string& in_path, const std::string& out_path) {
  auto f = st::SafeTensors::open(in_path);
  const auto& m = f.metadata();
  TargetInfo t;
  t.config.hidden_size = std::stoll(meta(m, "target_hidden_size", meta(m, "hidden_size")));
  t.config.vocab_size = std::stoll(meta(m, "target_vocab_size", meta(m, "vocab_size")));
  t.config.num_hidden_layers = std::stoll(meta(m, "target_num_layers", meta(m, "num_target_layers")));
  auto drafter = import_drafter(dir, t, at::kCPU, at::kFloat);
  drafter.set_target_weights(f.load("target.embed", at::kFloat, at::kCPU), f.load("target.lm_head", at::kFloat, at::kCPU));
  auto batch = batch_from(f);
  auto blocks = blocks_from_anchors(f.load("blocks.anchor", at::kLong, at::kCPU), f.load("blocks.keep", at::kBool, at::kCPU),
                                    batch.docs, batch.ids.size(1), drafter.spec().block_size);
  at::NoGradGuard ng;
  st::save(out_path, {{"logits", drafter.logits(batch, blocks)}});
  return 0;
}

int run_case(const std::string& in_path, const std::string& out_path) {
  auto f = st::SafeTensors::open(in_path);
  const auto& m = f.metadata();
  auto drafter = drafter_from(f);
  const auto& spec = drafter.spec();
  drafter.set_target_weights(f.load("target.embed", at::kFloat, at::kCPU), f.load("target.lm_head", at::kFloat, at::kCPU));
  DrafterBatch batch = batch_from(f);

  StepOptions opt;
  opt.gamma = std::stod(meta(m, "gamma", "0"));
  opt.loss_chunk = std::stoll(meta(m, "loss_chunk", "5"));
  opt.recompute_loss = meta(m, "loss_mode", "fused") == "recompute";
  if (meta(m, "loss_mode", "fused") == "plain") opt.loss_chunk = 0;
  opt.num_anchors = std::stoll(meta(m, "num_anchors", "512"));
  opt.seed = std::stoull(meta(m, "seed", "42"));

  Blocks blocks;
  if (f.has("blocks.anchor")) {
    blocks = blocks_from_anchors(f.load("blocks.anchor", at::kLong, at::kCPU),
                                 f.load("blocks.keep", at::kBool, at::kCPU), batch.docs, batch.ids.size(1),
                                 spec.block_size);
  } else {
    AnchorOptions ao;
    ao.block_size = spec.block_size;
    ao.num_anchors = opt.num_anchors;
    ao.seed = opt.seed;
    ao.batch_index = batch.global_batch_index;
    blocks = sample_blocks(batch.loss_mask, batch.docs, ao);
  }

  auto out = drafter.forward_blocks(batch, blocks, opt);
  out.loss.backward();

  std::vector<std::pair<std::string, at::Tensor>> res;
  res.emplace_back("loss", out.loss.detach().to(at::kDouble).reshape({1}));
  for (auto& [name, t] : drafter.named_parameters()) {
    auto g = t.grad();
    res.emplace_back("grad." + name, g.defined() ? g.clone() : at::zeros_like(t).detach());
  }
  res.emplace_back("correct_per_pos", at::tensor(out.correct_per_pos, at::kDouble));
  res.emplace_back("count_per_pos", at::tensor(out.count_per_pos, at::kDouble));
  res.emplace_back("tau_sum", at::tensor({out.tau_sum}, at::kDouble));
  res.emplace_back("tau_inv_sum", at::tensor({out.tau_inv_sum}, at::kDouble));
  res.emplace_back("tau_blocks", at::tensor({out.tau_blocks}, at::kLong));
  res.emplace_back("weight_sum", at::tensor({out.weight_sum}, at::kDouble));
  res.emplace_back("n_tokens", at::tensor({out.n_tokens}, at::kLong));
  res.emplace_back("blocks.anchor", blocks.anchor);
  res.emplace_back("blocks.keep", blocks.keep);
  res.emplace_back("blocks.doc_begin", blocks.doc_begin);
  res.emplace_back("blocks.doc_end", blocks.doc_end);
  attention::MaskSpec ms{blocks.doc_begin, blocks.anchor, blocks.keep, batch.ids.size(1), spec.block_size};
  res.emplace_back("mask", attention::dense_bool_mask(ms));
  if (meta(m, "logits", "0") == "1") {
    at::NoGradGuard ng;
    res.emplace_back("logits", drafter.logits(batch, blocks));
  }
  st::save(out_path, res);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "";
    if (argc == 4 && cmd == "case") return run_case(argv[2], argv[3]);
    if (argc == 4 && cmd == "export") return run_export(argv[2], argv[3]);
    if (argc == 5 && cmd == "import") return run_import(argv[2], argv[3], argv[4]);
    if (argc == 3 && cmd == "config8b") {
      DrafterSpec s;
      s.hidden_size = 4096, s.intermediate_size = 12288, s.num_layers = 5, s.num_heads = 32, s.num_kv_heads = 8;
      s.head_dim = 128, s.vocab_size = 151936, s.block_size = 16, s.target_layer_ids = default_layer_ids(36, 5);
      s.num_target_layers = 36, s.mask_token_id = 151669, s.bos_token_id = 151643, s.eos_token_id = 151645;
      s.validate("qwen3-8b drafter");
      std::FILE* out = std::fopen(argv[2], "w");
      if (!out) throw_user("cannot write {}", argv[2]);
      std::fputs(drafter_config_json(s).c_str(), out);
      std::fclose(out);
      return 0;
    }
    std::fprintf(stderr, "usage: drafter_tool case|export|import|config8b ...\n");
    return 1;
  } catch (const UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
}
