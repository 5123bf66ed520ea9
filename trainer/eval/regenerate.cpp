// Regeneration with the target (see regenerate.h): the continuous-batching loop on a
// TargetCache, the sampler, and the `dflash_rank regenerate` command (JSONL in, JSONL out).
#include "trainer/eval/regenerate.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <set>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/device.h"
#include "core/error.h"
#include "core/fault.h"
#include "core/files.h"
#include "core/json.h"
#include "trainer/model/target_cache.h"

namespace dflash::eval {

namespace {
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string human(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.0f}", x);
}
}  // namespace

double counter_uniform(uint64_t seed, uint64_t step) {
  uint64_t z = seed ^ (step * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL);
  for (int r = 0; r < 2; ++r) {  // two rounds of splitmix64's finaliser
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
  }
  return double(z >> 11) * 0x1.0p-53;
}

std::vector<int64_t> sample_rows(const at::Tensor& logits, double temperature, double top_p,
                                 const std::vector<double>& u) {
  c10::InferenceMode guard;
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor pick;
  if (temperature <= 0) {
    pick = logits.argmax(-1);
  } else {
    if (int64_t(u.size()) != n) throw std::logic_error("sample_rows: one uniform per row");
    at::Tensor probs = at::softmax(logits.to(at::kFloat) / temperature, -1);
    at::Tensor order;
    if (top_p < 1.0) {
      auto sorted = probs.sort(-1, /*descending=*/true);
      probs = std::get<0>(sorted);
      order = std::get<1>(sorted);
      // keep a token while the mass before it is < top_p (the most probable is always kept)
      at::Tensor before = probs.cumsum(-1) - probs;
      probs = probs * (before < top_p);
    }
    at::Tensor cdf = probs.cumsum(-1);                                   // [n, V]
    at::Tensor uu = at::tensor(u, at::kDouble).to(cdf.device(), at::kFloat).unsqueeze(1);
    at::Tensor target = uu * cdf.narrow(1, V - 1, 1);                    // [n, 1]
    // the first index whose cumulative mass exceeds u * total (never a zero-mass token)
    at::Tensor j = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).clamp_max(V - 1);
    pick = order.defined() ? order.gather(1, j).squeeze(1) : j.squeeze(1);
  }
  at::Tensor h = pick.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + n);
}

RegenStats regenerate(const model::TargetModel& model, const std::vector<RegenItem>& items,
                      const RegenOptions& o, const std::function<void(const RegenResult&)>& sink) {
  c10::InferenceMode guard;
  RegenStats st;
  if (items.empty()) return st;
  if (o.batch_size < 1) throw_user("regenerate: batch size must be >= 1, got {}", o.batch_size);
  if (o.max_new_tokens < 1) throw_user("regenerate: max new tokens must be >= 1, got {}", o.max_new_tokens);
  if (o.temperature < 0 || !(o.top_p > 0 && o.top_p <= 1))
    throw_user("regenerate: temperature must be >= 0 and top_p in (0, 1], got {} and {}", o.temperature, o.top_p);
  const int64_t V = model.config().vocab_size;
  int64_t longest = 0;
  for (const auto& it : items) {
    if (it.ids.empty()) throw_user("regenerate: prompt '{}' is empty", it.key);
    for (int64_t t : it.ids)
      if (t < 0 || t >= V) throw_user("regenerate: prompt '{}' has token id {} outside the vocabulary [0, {})", it.key, t, V);
    longest = std::max<int64_t>(longest, int64_t(it.ids.size()));
  }
  const int64_t B = std::min<int64_t>(o.batch_size, int64_t(items.size()));
  const int64_t refill = o.refill_rows > 0 ? std::min(o.refill_rows, B) : std::max<int64_t>(1, B / 16);
  const std::set<int64_t> stop(o.stop_ids.begin(), o.stop_ids.end());
  model::TargetCache cache(model, B, longest + o.max_new_tokens);

  struct Row {
    const RegenItem* item = nullptr;  // nullptr: free
    std::vector<int64_t> out;
  };
  std::vector<Row> rows(B);
  size_t next_item = 0;
  int64_t active = 0, done = 0;
  const auto t0 = Clock::now();
  auto last_progress = t0;

  // Appends token t to row b; finishes the row (sink, crop, free) when it stops.
  auto take = [&](int64_t b, int64_t t) -> void {
    Row& r = rows[b];
    r.out.push_back(t);
    ++st.new_tokens;
    const bool hit = stop.count(t) > 0;
    if (hit || int64_t(r.out.size()) >= o.max_new_tokens) {
      RegenResult res{r.item, std::move(r.out), hit};
      sink(res);
      r = Row{};
      cache.crop(b, 0);
      --active;
      ++done;
    }
  };
  auto uniforms = [&](const std::vector<int64_t>& which) {
    std::vector<double> u;
    if (o.temperature > 0)
      for (int64_t b : which) u.push_back(counter_uniform(rows[b].item->seed, rows[b].out.size()));
    return u;
  };

  while (done < int64_t(items.size())) {
    // Refill free rows when enough are free (or nothing else would run).
    const int64_t free_rows = B - active;
    if (next_item < items.size() && free_rows > 0 && (free_rows >= refill || active == 0)) {
      std::vector<std::vector<int64_t>> prompts(B);
      std::vector<int64_t> filled;
      for (int64_t b = 0; b < B && next_item < items.size(); ++b) {
        if (rows[b].item) continue;
        rows[b].item = &items[next_item++];
        prompts[b] = rows[b].item->ids;
        st.prompt_tokens += int64_t(prompts[b].size());
        filled.push_back(b);
        ++active;
      }
      auto step = cache.prefill(prompts, model::TargetCache::Logits::Last);
      ++st.prefills;
      auto next = sample_rows(step.logits, o.temperature, o.top_p, uniforms(filled));
      for (size_t j = 0; j < filled.size(); ++j) take(filled[j], next[j]);
    }
    if (active == 0) continue;
    // One decode step: every active row by its last token.
    std::vector<std::vector<int64_t>> tokens(B);
    std::vector<int64_t> ran;
    for (int64_t b = 0; b < B; ++b)
      if (rows[b].item) {
        tokens[b] = {rows[b].out.back()};
        ran.push_back(b);
      }
    auto step = cache.extend(tokens, model::TargetCache::Logits::Last);
    ++st.steps;
    auto next = sample_rows(step.logits, o.temperature, o.top_p, uniforms(ran));
    for (size_t j = 0; j < ran.size(); ++j) take(ran[j], next[j]);
    if (o.progress_s > 0 && since(last_progress) >= o.progress_s) {
      last_progress = Clock::now();
      const double s = since(t0);
      std::fprintf(stderr, "regenerate: %lld/%zu done, %lld active | %s new tokens in %.0f s | %s tok/s\n",
                   (long long)done, items.size(), (long long)active, human(double(st.new_tokens)).c_str(), s,
                   human(double(st.new_tokens) / std::max(s, 1e-9)).c_str());
    }
  }
  device::sync(model.device());
  st.items = int64_t(items.size());
  st.seconds = since(t0);
  return st;
}

// ---- the command -------------------------------------------------------------------------------

namespace {

constexpr const char* kUsage =
    "usage: dflash_rank regenerate --model DIR --in ITEMS.jsonl --out RESULTS.jsonl\n"
    "         [--batch-size 64] [--max-new-tokens 512] [--temperature 0] [--top-p 1]\n"
    "         [--stop-ids 2,0] [--device auto|cpu|cuda|cuda:N] [--dtype auto|bf16|f16|f32]\n"
    "         [--refill-rows N] [--progress-s 10] [--threads N] [--stats FILE.json]\n"
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
                                       "threads", "stats"};
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
      "{{\"items\": {}, \"new_tokens\": {}, \"prompt_tokens\": {}, \"steps\": {}, \"prefills\": {}, "
      "\"seconds\": {:.3f}, \"tokens_per_s\": {:.1f}, \"batch_size\": {}, \"device\": \"{}\", \"dtype\": \"{}\"}}\n",
      st.items, st.new_tokens, st.prompt_tokens, st.steps, st.prefills, st.seconds, st.tokens_per_s(),
      o.batch_size, dev.str(), c10::toString(dtype));
  if (kv.count("stats")) files::write_file_atomic(kv["stats"], summary);
  std::fprintf(stderr, "regenerate: %lld items, %s new tokens in %.1f s: %s tokens/s (batch %lld, %lld steps, %lld prefills)\n",
               (long long)st.items, human(double(st.new_tokens)).c_str(), st.seconds,
               human(st.tokens_per_s()).c_str(), (long long)o.batch_size, (long long)st.steps,
               (long long)st.prefills);
  return kExitOk;
}

}  // namespace dflash::eval
