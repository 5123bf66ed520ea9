// target_tool: a small CLI over trainer/model for the Python reference tests (tests/model/).
//
//   target_tool st-copy IN OUT [--dtype bf16|f16|f32]
//       read IN (a .safetensors file or checkpoint directory) with our reader, write every
//       tensor (converted to --dtype if given, else as stored) to OUT with our writer.
//   target_tool dump --model DIR --ids 1,2,3,... --cu 0,3,... [--layers 0,2,...] [--capture-only]
//                    [--num-layers N] [--device cpu|cuda] [--dtype f32|bf16] --out FILE
//       run the target model (default CPU, float32) over one packed stream; write "captured"
//       [T, K*H] (if --layers) and "logits" [T, V] (unless --capture-only, which also stops
//       after the last captured layer) to FILE (safetensors).
//   target_tool generate --model DIR --prompts "1,2,3;4,5" --max-new N [--stop-at-eos]
//                        [--device cpu|cuda] [--dtype f32|bf16]
//       greedy generation; prints one line of comma-separated new tokens per prompt.
//   target_tool embeddings --model DIR --out FILE
//       the drafter-side load: writes "embed_tokens", "lm_head" and "tied" (u8) to FILE.
//
// Exit codes as dflash_rank: 0 ok, 2 bad input (UserError, one line on stderr), 1 internal.
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/parse.h"
#include "trainer/model/safetensors.h"
#include "trainer/model/target.h"

namespace {

using dflash::throw_user;

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return at::kBFloat16;
  if (s == "f16") return at::kHalf;
  if (s == "f32") return at::kFloat;
  throw_user("unknown --dtype '{}' (bf16, f16, f32)", s);
}

int st_copy(const std::vector<std::string>& args) {
  if (args.size() < 2) throw_user("usage: target_tool st-copy IN OUT [--dtype bf16|f16|f32]");
  bool convert = false;
  at::ScalarType dtype = at::kFloat;
  for (size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--dtype" && i + 1 < args.size()) {
      convert = true;
      dtype = parse_dtype(args[++i]);
    } else {
      throw_user("st-copy: unknown argument '{}'", args[i]);
    }
  }
  auto st = dflash::st::SafeTensors::open(args[0]);
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& name : st.names()) {
    const auto& info = st.info(name);
    out.emplace_back(name, st.load(name, convert ? dtype : info.dtype, at::kCPU, &info.shape));
  }
  dflash::st::save(args[1], out, st.metadata());
  return 0;
}

struct Opts {
  std::map<std::string, std::string> kv;
  std::set<std::string> flags;
  std::string get(const std::string& k) const {
    auto it = kv.find(k);
    if (it == kv.end()) throw_user("missing option --{}", k);
    return it->second;
  }
};

Opts parse_opts(const std::vector<std::string>& args, const std::set<std::string>& flag_names) {
  Opts o;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].rfind("--", 0) != 0) throw_user("unexpected argument '{}'", args[i]);
    std::string k = args[i].substr(2);
    if (flag_names.count(k)) {
      o.flags.insert(k);
    } else {
      if (i + 1 >= args.size()) throw_user("option --{} needs a value", k);
      o.kv[k] = args[++i];
    }
  }
  return o;
}

at::Tensor to_tensor(const std::vector<int64_t>& v) { return at::tensor(v, at::kLong); }

int dump(const std::vector<std::string>& args) {
  Opts o = parse_opts(args, {"capture-only"});
  dflash::model::TargetLoadOptions lo;
  if (o.kv.count("num-layers")) lo.num_layers = std::stoll(o.get("num-layers"));
  at::Device dev = o.kv.count("device") ? at::Device(o.get("device")) : at::Device(at::kCPU);
  at::ScalarType dt = o.kv.count("dtype") ? parse_dtype(o.get("dtype")) : at::kFloat;
  auto model = dflash::model::TargetModel::load(o.get("model"), dt, dev, lo);
  at::Tensor ids = to_tensor(dflash::parse_int_list(o.get("ids"), "--ids"));
  at::Tensor cu = to_tensor(dflash::parse_int_list(o.get("cu"), "--cu"));
  std::vector<int64_t> layers = o.kv.count("layers") ? dflash::parse_int_list(o.get("layers"), "--layers")
                                                     : std::vector<int64_t>{};
  std::vector<std::pair<std::string, at::Tensor>> out;
  if (o.flags.count("capture-only")) {
    auto t0 = std::chrono::steady_clock::now();
    out.emplace_back("captured", model.capture(ids, cu.to(at::kInt), layers).cpu());
    std::fprintf(stderr, "capture: %.3f s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } else {
    auto r = model.forward(ids, cu, layers);
    if (r.captured.defined()) out.emplace_back("captured", r.captured.cpu());
    out.emplace_back("logits", r.logits.cpu());
  }
  dflash::st::save(o.get("out"), out);
  return 0;
}

int generate(const std::vector<std::string>& args) {
  Opts o = parse_opts(args, {"stop-at-eos"});
  at::Device dev = o.kv.count("device") ? at::Device(o.get("device")) : at::Device(at::kCPU);
  at::ScalarType dt = o.kv.count("dtype") ? parse_dtype(o.get("dtype")) : at::kFloat;
  auto model = dflash::model::TargetModel::load(o.get("model"), dt, dev);
  std::vector<std::vector<int64_t>> prompts;
  std::string all = o.get("prompts");
  size_t i = 0;
  while (i <= all.size()) {
    size_t j = all.find(';', i);
    if (j == std::string::npos) j = all.size();
    prompts.push_back(dflash::parse_int_list(all.substr(i, j - i), "--prompts"));
    i = j + 1;
  }
  auto res = model.generate(prompts, std::stoll(o.get("max-new")), o.flags.count("stop-at-eos") > 0);
  for (const auto& r : res) std::printf("%s\n", fmt::format("{}", fmt::join(r, ",")).c_str());
  return 0;
}

int embeddings(const std::vector<std::string>& args) {
  Opts o = parse_opts(args, {});
  auto e = dflash::model::load_target_embeddings(o.get("model"), at::kFloat, at::kCPU);
  if (e.embed_tokens.requires_grad() || e.lm_head.requires_grad())
    throw std::runtime_error("embeddings must be frozen");
  if (e.tied && e.embed_tokens.data_ptr() != e.lm_head.data_ptr())
    throw std::runtime_error("tied embeddings must share storage");
  dflash::st::save(o.get("out"), {{"embed_tokens", e.embed_tokens},
                                  {"lm_head", e.tied ? e.lm_head.clone() : e.lm_head},
                                  {"tied", at::tensor({uint8_t(e.tied)}, at::kByte)}});
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) throw_user("usage: target_tool st-copy|dump|generate ...");
    std::string cmd = argv[1];
    std::vector<std::string> args(argv + 2, argv + argc);
    if (cmd == "st-copy") return st_copy(args);
    if (cmd == "dump") return dump(args);
    if (cmd == "generate") return generate(args);
    if (cmd == "embeddings") return embeddings(args);
    throw_user("unknown command '{}'", cmd);
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "target_tool: error: %s\n", e.what());
    return dflash::kExitUser;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "target_tool: internal error: %s\n", e.what());
    return dflash::kExitInternal;
  }
}
