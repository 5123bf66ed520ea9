// `dflash_rank regenerate` (regenerate.h): items JSONL in, one result line per finished item
// out (appended, flushed at once), a stats JSON; the decoding itself is regenerate().
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/fault.h"
#include "core/files.h"
#include "core/json.h"
#include "trainer/eval/regenerate_loops.h"

namespace dflash::eval {

using namespace regen_detail;

// ---- the command -------------------------------------------------------------------------------

namespace {

constexpr const char* kUsage =
    "usage: dflash_rank regenerate --model DIR --in ITEMS.jsonl --out RESULTS.jsonl\n"
    "         [--batch-size 64] [--max-new-tokens 512] [--temperature 0] [--top-p 1]\n"
    "         [--stop-ids 2,0] [--device auto|cpu|cuda|cuda:N] [--dtype auto|bf16|f16|f32]\n"
    "         [--refill-rows N] [--progress-s 10] [--threads N] [--stats FILE.json]\n"
    "         [--engine auto|static|cache] [--check-every 8] [--cuda-graphs on|off] [--window-bucket 256]\n"
    "  --engine: static (dense targets; default) keeps the rows' state on the device and reads it every\n"
    "    --check-every steps; its decode step is a CUDA graph on CUDA unless --cuda-graphs off;\n"
    "    cache: the general KV cache, one host read per step (targets with recurrent/expert layers)\n"
    "  ITEMS.jsonl: {\"key\": \"17:0\", \"input_ids\": [...], \"seed\": 123} per line (tools/regenerate.py)\n"
    "  RESULTS.jsonl: appended, one {\"key\", \"tokens\", \"stopped\"} line per item as it finishes";

std::vector<int64_t> parse_int_list(const std::string& s, const std::string& what) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find(',', i);
    if (j == std::string::npos) j = s.size();
    std::string tok = s.substr(i, j - i);
    try {
      size_t used = 0;
      out.push_back(std::stoll(tok, &used));
      if (used != tok.size()) throw std::invalid_argument(tok);
    } catch (const std::exception&) {
      throw_user("regenerate: {}: '{}' is not an integer", what, tok);
    }
    i = j + 1;
  }
  return out;
}

int64_t parse_int(const std::string& s, const std::string& what) {
  std::vector<int64_t> v = parse_int_list(s, what);
  if (v.size() != 1) throw_user("regenerate: {}: '{}' is not an integer", what, s);
  return v[0];
}

double parse_num(const std::string& s, const std::string& what) {
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    if (used == s.size()) return v;
  } catch (const std::exception&) {
  }
  throw_user("regenerate: {}: '{}' is not a number", what, s);
}

std::vector<RegenItem> read_items(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw_user("regenerate: cannot read items file '{}'", path);
  std::vector<RegenItem> items;
  std::set<std::string> keys;
  std::string line;
  for (int64_t n = 1; std::getline(f, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = fmt::format("regenerate: {}:{}", path, n);
    json::Value v = json::parse(line, where);
    const json::Value* k = v.find("key");
    const json::Value* ids = v.find("input_ids");
    if (!v.is_object() || !k || !ids)
      throw_user("{}: expected an object with \"key\" and \"input_ids\"", where);
    RegenItem it;
    it.key = k->as_string(where + " key");
    for (const auto& t : ids->as_array(where + " input_ids")) it.ids.push_back(t.as_int(where + " input_ids"));
    if (const json::Value* s = v.find("seed")) it.seed = s->as_uint(where + " seed");
    if (!keys.insert(it.key).second) throw_user("{}: key '{}' appears twice", where, it.key);
    items.push_back(std::move(it));
  }
  return items;
}

}  // namespace

int regenerate_command(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  const std::set<std::string> known = {"model", "in", "out", "batch-size", "max-new-tokens", "temperature",
                                       "top-p", "stop-ids", "device", "dtype", "refill-rows", "progress-s",
                                       "threads", "stats", "engine", "check-every", "cuda-graphs",
                                       "window-bucket"};
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--help" || a == "-h") return std::puts(kUsage), kExitOk;
    if (a.rfind("--", 0) != 0 || !known.count(a.substr(2)))
      throw_user("regenerate: unknown argument '{}' (--help: usage)", a);
    if (i + 1 >= argc) throw_user("regenerate: {} needs a value (--help: usage)", a);
    kv[a.substr(2)] = argv[++i];
  }
  for (const char* req : {"model", "in", "out"})
    if (!kv.count(req)) throw_user("regenerate: --{} is required (--help: usage)", req);
  auto get = [&](const std::string& k, const std::string& def) { return kv.count(k) ? kv[k] : def; };

  RegenOptions o;
  o.batch_size = parse_int(get("batch-size", "64"), "--batch-size");
  o.max_new_tokens = parse_int(get("max-new-tokens", "512"), "--max-new-tokens");
  o.temperature = parse_num(get("temperature", "0"), "--temperature");
  o.top_p = parse_num(get("top-p", "1"), "--top-p");
  o.refill_rows = parse_int(get("refill-rows", "0"), "--refill-rows");
  o.progress_s = parse_num(get("progress-s", "10"), "--progress-s");
  o.check_every = parse_int(get("check-every", "8"), "--check-every");
  o.window_bucket = parse_int(get("window-bucket", "256"), "--window-bucket");
  const std::string engine = get("engine", "auto"), graphs = get("cuda-graphs", "on");
  if (engine == "auto") o.engine = RegenOptions::Engine::Auto;
  else if (engine == "static") o.engine = RegenOptions::Engine::Static;
  else if (engine == "cache") o.engine = RegenOptions::Engine::Cache;
  else throw_user("regenerate: --engine '{}': expected auto, static or cache", engine);
  if (graphs != "on" && graphs != "off") throw_user("regenerate: --cuda-graphs '{}': expected on or off", graphs);
  o.cuda_graphs = graphs == "on";
  if (int threads = int(parse_int(get("threads", "0"), "--threads")); threads > 0) at::set_num_threads(threads);

  std::string dev_name = get("device", "auto");
  at::Device dev = at::kCPU;
  if (dev_name == "auto") {
    dev = at::hasCUDA() ? at::Device("cuda:0") : at::Device(at::kCPU);
  } else {
    try {
      dev = at::Device(dev_name);
    } catch (const std::exception&) {
      throw_user("regenerate: unknown --device '{}' (auto, cpu, cuda, cuda:N)", dev_name);
    }
    if (dev.is_cuda() && !at::hasCUDA()) throw_user("regenerate: --device {} but no CUDA device is present", dev_name);
  }
  std::string dt = get("dtype", "auto");
  if (dt == "f32") dt = "float32";
  if (dt == "f16") dt = "float16";
  at::ScalarType dtype = model::resolve_dtype(dt, dev, "--dtype");

  std::vector<RegenItem> items = read_items(kv["in"]);
  auto model = model::TargetModel::load(kv["model"], dtype, dev);
  o.stop_ids = kv.count("stop-ids") ? parse_int_list(kv["stop-ids"], "--stop-ids") : model.config().eos_token_ids;

  std::FILE* out = std::fopen(kv["out"].c_str(), "a");
  if (!out) throw_user("regenerate: cannot open '{}' for appending", kv["out"]);
  std::fprintf(stderr, "regenerate: %zu items on %s (%s), batch %lld, up to %lld new tokens, %s, stop ids [%s]\n",
               items.size(), dev.str().c_str(), c10::toString(dtype), (long long)o.batch_size,
               (long long)o.max_new_tokens,
               o.temperature > 0 ? fmt::format("temperature {} top-p {}", o.temperature, o.top_p).c_str() : "greedy",
               fmt::format("{}", fmt::join(o.stop_ids, ", ")).c_str());
  int64_t written = 0;
  RegenStats st = regenerate(model, items, o, [&](const RegenResult& r) {
    // One line per item, flushed at once: a killed run loses at most the line being written.
    std::string line = fmt::format("{{\"key\": {}, \"tokens\": [{}], \"stopped\": {}}}\n", json::quote(r.item->key),
                                   fmt::join(r.tokens, ", "), r.stopped ? "true" : "false");
    if (std::fputs(line.c_str(), out) < 0 || std::fflush(out) != 0)
      throw_user("regenerate: cannot write to '{}'", kv["out"]);
    ++written;
    if (fault::armed()) fault::point(0, fmt::format("item{}", written));  // the resume test's hook (core/fault.h)
  });
  std::fclose(out);
  std::string summary = fmt::format(
      "{{\"items\": {}, \"new_tokens\": {}, \"prompt_tokens\": {}, \"steps\": {}, \"prefills\": {}, \"prefill_s\": {:.3f}, "
      "\"seconds\": {:.3f}, \"tokens_per_s\": {:.1f}, \"batch_size\": {}, \"device\": \"{}\", \"dtype\": \"{}\", "
      "\"engine\": \"{}\", \"cuda_graphs\": {}, \"graphs\": {}, \"host_reads\": {}, \"check_every\": {}}}\n",
      st.items, st.new_tokens, st.prompt_tokens, st.steps, st.prefills, st.prefill_s, st.seconds, st.tokens_per_s(),
      o.batch_size, dev.str(), c10::toString(dtype), st.engine, o.cuda_graphs && dev.is_cuda() && st.engine == "static" ? "true" : "false", st.graphs,
      st.host_reads, o.check_every);
  if (kv.count("stats")) files::write_file_atomic(kv["stats"], summary);
  std::fprintf(stderr, "regenerate: %lld items, %s new tokens in %.1f s: %s tokens/s (batch %lld, %lld steps, %lld prefills, "
               "%s engine, %lld host reads, %lld CUDA graphs)\n",
               (long long)st.items, human(double(st.new_tokens)).c_str(), st.seconds,
               human(st.tokens_per_s()).c_str(), (long long)o.batch_size, (long long)st.steps,
               (long long)st.prefills, st.engine.c_str(), (long long)st.host_reads, (long long)st.graphs);
  return kExitOk;
}

}  // namespace dflash::eval
