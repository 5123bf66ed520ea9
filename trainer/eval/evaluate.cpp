// trainer/eval/evaluate.h: an evaluation run, its report, and `dflash_rank eval`.
#include "trainer/eval/evaluate.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <type_traits>
#include <set>
#include <thread>

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <fmt/ranges.h>

#include "core/device.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json.h"
#include "core/log.h"
#include "core/parse.h"
#include "trainer/eval/regenerate.h"
#include "trainer/eval/speculative_fixed.h"
#include "trainer/model/export.h"
#include "trainer/model/hf_config.h"

namespace dflash::eval {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bfloat16" : t == at::kHalf ? "float16" : t == at::kFloat ? "float32" : c10::toString(t);
}

std::string num(double v) { return std::isfinite(v) ? fmt::format("{:.6g}", v) : "null"; }

template <class T>
std::string list(const std::vector<T>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    if constexpr (std::is_floating_point_v<T>) s += num(v[i]);
    else s += std::to_string(v[i]);
  }
  return s + "]";
}

}  // namespace

double EvalReport::speedup() const {
  const double b = base_tokens_per_s(), s = spec_tokens_per_s();
  return b > 0 ? s / b : 0;
}

void summarize(EvalReport& r) {
  const EvalSettings& st = r.settings;
  const int64_t bs = st.block_size;
  r.steps = 0, r.spec_tokens = 0, r.spec_forwards = 0, r.base_tokens = 0, r.equal = 0;
  r.histogram.assign(bs, 0);
  r.accept_rate.assign(bs - 1, 0);
  double tau_sum = 0;
  for (auto& p : r.prompts) {
    for (auto a : p.spec.accepted) {
      r.histogram.at(a) += 1;
      for (int64_t k = 1; k <= a; ++k) r.accept_rate[k - 1] += 1;
      tau_sum += double(a + 1);
      ++r.steps;
    }
    r.spec_tokens += int64_t(p.spec.tokens.size());
    r.spec_forwards += p.spec.target_forwards;
    r.base_tokens += int64_t(p.baseline_tokens.size());
    p.equal = st.baseline && p.spec.tokens == p.baseline_tokens;
    r.equal += p.equal;
  }
  r.tau = r.steps ? tau_sum / double(r.steps) : 0;
  for (auto& x : r.accept_rate) x = r.steps ? x / double(r.steps) : 0;
}

EvalReport evaluate(const model::TargetModel& target, DraftProposer& proposer, const std::vector<Prompt>& prompts,
                    const EvalSettings& st) {
  c10::InferenceMode guard;
  if (st.batch_size < 1) throw_user("eval.batch_size must be >= 1, got {}", st.batch_size);
  EvalReport r;
  r.settings = st;
  const int64_t N = int64_t(prompts.size()), bs = st.block_size;
  DecodeOptions opt;
  opt.block_size = bs;
  opt.max_new_tokens = st.max_new_tokens;
  opt.temperature = st.temperature;
  opt.seed = st.seed;
  opt.stop_ids = st.stop_ids;
  static const bool want_fixed = env_choice(kEvalEngineEnv, "cache", {"cache", "fixed"}) == "fixed";
  auto* dflash = dynamic_cast<DFlashProposer*>(&proposer);
  const bool fixed = want_fixed && dflash && FixedSpeculativeDecoder::supports(target, opt);
  if (want_fixed && !fixed)
    log::info("eval: {}=fixed serves greedy decoding of dense targets with the DFlash drafter; this one runs on "
              "the cache engine", kEvalEngineEnv);
  r.engine = fixed ? "fixed" : "cache";
  auto speculate = [&](const std::vector<std::vector<int64_t>>& batch, const std::vector<int64_t>& ids,
                       const DecodeOptions& o) {
    if (fixed) {
      FixedSpeculativeDecoder dec(target, *dflash, batch, o);
      dec.run();
      r.graphs += dec.graphs();
      return dec.results();
    }
    SpeculativeDecoder dec(target, proposer, batch, ids, o);
    dec.run();
    return dec.results();
  };
  // The baseline on the same kind of engine: with the fixed engine, plain greedy decoding on the
  // static cache (regenerate.h's static loop, CUDA graphs); else plain_decode on TargetCache.
  auto plain = [&](const std::vector<std::vector<int64_t>>& batch, const std::vector<int64_t>& ids,
                   const DecodeOptions& o) {
    if (!fixed) return plain_decode(target, batch, ids, o);
    std::vector<RegenItem> items(batch.size());
    for (size_t j = 0; j < batch.size(); ++j) items[j].key = std::to_string(j), items[j].ids = batch[j];
    RegenOptions ro;
    ro.batch_size = int64_t(batch.size());
    ro.max_new_tokens = o.max_new_tokens;
    ro.stop_ids = o.stop_ids;
    ro.progress_s = 0;
    ro.engine = RegenOptions::Engine::Static;
    std::vector<RowResult> res(batch.size());
    regenerate(target, items, ro, [&](const RegenResult& g) {
      RowResult& x = res[size_t(g.item - items.data())];
      x.tokens = g.tokens;
      x.target_forwards = int64_t(g.tokens.size());  // a prefill, then one step per further token
    });
    return res;
  };
  if (st.warmup && N > 0) {  // untimed: first-call costs (allocator, BLAS/cuBLAS handles) out of the timings
    DecodeOptions w = opt;
    w.max_new_tokens = std::min<int64_t>(opt.max_new_tokens, 2 * bs);
    speculate({prompts[0].ids}, {0}, w);
    if (st.baseline) plain({prompts[0].ids}, {0}, w);
    device::sync(target.device());
  }
  r.prompts.resize(N);
  for (int64_t i = 0; i < N; ++i) r.prompts[i].label = prompts[i].label, r.prompts[i].prompt_tokens = int64_t(prompts[i].ids.size());
  const double t_all = now_s();
  for (int64_t b0 = 0; b0 < N; b0 += st.batch_size) {
    const int64_t n = std::min(st.batch_size, N - b0);
    std::vector<std::vector<int64_t>> batch;
    std::vector<int64_t> ids;
    for (int64_t i = b0; i < b0 + n; ++i) batch.push_back(prompts[i].ids), ids.push_back(i);
    double t0 = now_s();
    const std::vector<RowResult> res = speculate(batch, ids, opt);
    device::sync(target.device());
    r.spec_wall_s += now_s() - t0;
    for (int64_t j = 0; j < n; ++j) r.prompts[b0 + j].spec = res[j];
    if (st.baseline) {
      t0 = now_s();
      auto base = plain(batch, ids, opt);
      device::sync(target.device());
      r.base_wall_s += now_s() - t0;
      for (int64_t j = 0; j < n; ++j) r.prompts[b0 + j].baseline_tokens = base[j].tokens, r.base_forwards += base[j].target_forwards;
    }
    if (st.progress) {
      double ts = 0, steps = 0;
      int64_t toks = 0;
      for (int64_t i = 0; i < b0 + n; ++i)
        for (auto a : r.prompts[i].spec.accepted) ts += double(a + 1), steps += 1;
      for (int64_t i = 0; i < b0 + n; ++i) toks += int64_t(r.prompts[i].spec.tokens.size());
      log::info("eval: {}/{} prompts, tau {:.3f}, {} new tokens, {:.1f} s", b0 + n, N, steps > 0 ? ts / steps : 0.0,
                toks, now_s() - t_all);
    }
  }
  summarize(r);
  return r;
}

std::string EvalReport::to_json(const std::string& extra) const {
  const auto& s = settings;
  std::string j = "{\n  " + extra;
  j += fmt::format("\"engine\": {}, \"cuda_graphs\": {}, ", json::quote(engine), graphs);
  j += fmt::format("\"num_prompts\": {}, \"block_size\": {}, \"max_new_tokens\": {}, \"batch_size\": {}, "
                   "\"temperature\": {}, \"seed\": {}, \"stop_token_ids\": {},\n",
                   prompts.size(), s.block_size, s.max_new_tokens, s.batch_size, num(s.temperature), s.seed,
                   list(s.stop_ids));
  j += fmt::format("  \"tau\": {}, \"steps\": {}, \"acceptance_histogram\": {}, \"acceptance_rate_per_position\": {},\n",
                   num(tau), steps, list(histogram), list(accept_rate));
  j += fmt::format("  \"speculative\": {{\"generated_tokens\": {}, \"target_forwards\": {}, "
                   "\"target_forwards_per_token\": {}, \"wall_s\": {}, \"tokens_per_s\": {}}},\n",
                   spec_tokens, spec_forwards, num(spec_tokens ? double(spec_forwards) / double(spec_tokens) : 0),
                   num(spec_wall_s), num(spec_tokens_per_s()));
  if (s.baseline) {
    j += fmt::format("  \"baseline\": {{\"generated_tokens\": {}, \"target_forwards\": {}, "
                     "\"target_forwards_per_token\": {}, \"wall_s\": {}, \"tokens_per_s\": {}}},\n",
                     base_tokens, base_forwards, num(base_tokens ? double(base_forwards) / double(base_tokens) : 0),
                     num(base_wall_s), num(base_tokens_per_s()));
    j += fmt::format("  \"speedup\": {}, \"equal_outputs\": {}, \"equal_output_share\": {},\n", num(speedup()), equal,
                     num(prompts.empty() ? 0 : double(equal) / double(prompts.size())));
  } else {
    j += "  \"baseline\": null, \"speedup\": null, \"equal_outputs\": null, \"equal_output_share\": null,\n";
  }
  j += "  \"prompts\": [\n";
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto& p = prompts[i];
    j += fmt::format("    {{\"index\": {}, \"id\": {}, \"prompt_tokens\": {}, \"new_tokens\": {}, \"steps\": {}, "
                     "\"tau\": {}, \"equal_to_baseline\": {}, \"accepted\": {}, \"tokens\": {}}}{}\n",
                     i, json::quote(p.label), p.prompt_tokens, p.spec.tokens.size(), p.spec.accepted.size(),
                     num(p.spec.tau()), s.baseline ? (p.equal ? "true" : "false") : "null", list(p.spec.accepted),
                     list(p.spec.tokens), i + 1 < prompts.size() ? "," : "");
  }
  j += "  ]\n}\n";
  return j;
}

std::vector<std::string> EvalReport::summary_lines() const {
  const auto& s = settings;
  std::vector<std::string> v;
  std::string rates;
  for (size_t k = 0; k < accept_rate.size(); ++k) rates += fmt::format("{}{:.2f}", k ? " " : "", accept_rate[k]);
  v.push_back(fmt::format("eval: {} prompts x <= {} new tokens, block {}, {}, {}: tau {:.3f} over {} steps; "
                          "target forwards per token {:.3f}",
                          prompts.size(), s.max_new_tokens, s.block_size,
                          s.temperature > 0 ? fmt::format("temperature {}", s.temperature) : std::string("greedy"),
                          engine == "fixed" && graphs ? fmt::format("fixed engine ({} CUDA graphs)", graphs) : engine + " engine",
                          tau, steps, spec_tokens ? double(spec_forwards) / double(spec_tokens) : 0.0));
  v.push_back(fmt::format("eval: accepted drafts histogram (0..{}) [{}]; acceptance per block position 1..{} [{}]",
                          s.block_size - 1, fmt::join(histogram, " "), s.block_size - 1, rates));
  if (s.baseline)
    v.push_back(fmt::format("eval: speculative {:.2f} s ({:.1f} tok/s), plain decoding {:.2f} s ({:.1f} tok/s): "
                            "speedup {:.2f}x; outputs equal to plain decoding: {}/{}",
                            spec_wall_s, spec_tokens_per_s(), base_wall_s, base_tokens_per_s(), speedup(), equal,
                            prompts.size()));
  else
    v.push_back(fmt::format("eval: speculative {:.2f} s ({:.1f} tok/s); no baseline (eval.baseline=false)", spec_wall_s,
                            spec_tokens_per_s()));
  return v;
}

std::vector<int64_t> resolve_stop_ids(const EvalConfig& cfg, const model::HfConfig& tc, const std::string& dir) {
  std::set<int64_t> ids(cfg.stop_token_ids.begin(), cfg.stop_token_ids.end());
  if (cfg.stop_at_eos) {
    ids.insert(tc.eos_token_ids.begin(), tc.eos_token_ids.end());
    const std::string gen = files::join(dir, "generation_config.json");
    if (files::exists(gen)) {
      json::Value g = json::parse_file(gen);
      if (const json::Value* e = g.find("eos_token_id"); e && !e->is_null()) {
        if (e->is_array())
          for (const auto& x : e->as_array(gen + ": field 'eos_token_id'")) ids.insert(x.as_int(gen + ": field 'eos_token_id'"));
        else
          ids.insert(e->as_int(gen + ": field 'eos_token_id'"));
      }
    }
  }
  for (auto id : ids)
    if (id < 0 || id >= tc.vocab_size)
      throw_user("eval.stop_token_ids: {} is outside the target's vocabulary [0, {})", id, tc.vocab_size);
  return {ids.begin(), ids.end()};
}

EvalSettings make_settings(const Config& cfg, int64_t drafter_bs, std::vector<int64_t> stop_ids) {
  const EvalConfig& e = cfg.eval;
  EvalSettings s;
  s.block_size = e.block_size > 0 ? e.block_size : drafter_bs;
  if (e.block_size < 0 || s.block_size < 2 || s.block_size > drafter_bs)
    throw_user("eval.block_size must be 0 (the drafter's {}) or in [2, {}], got {}", drafter_bs, drafter_bs,
               e.block_size);
  if (e.max_new_tokens < 1) throw_user("eval.max_new_tokens must be >= 1, got {}", e.max_new_tokens);
  if (e.batch_size < 1) throw_user("eval.batch_size must be >= 1, got {}", e.batch_size);
  if (e.temperature < 0) throw_user("eval.temperature must be >= 0, got {}", e.temperature);
  if (e.max_prompts < 0) throw_user("eval.max_prompts must be >= 0, got {}", e.max_prompts);
  s.max_new_tokens = e.max_new_tokens;
  s.batch_size = e.batch_size;
  s.temperature = e.temperature;
  s.seed = uint64_t(e.seed >= 0 ? e.seed : cfg.run.seed);
  s.stop_ids = std::move(stop_ids);
  s.baseline = e.baseline;
  return s;
}

int run_eval_command(const Config& cfg) {
  const EvalConfig& e = cfg.eval;
  if (cfg.target.model_dir.empty()) throw_user("target.model_dir is not set (the target's Hugging Face directory)");
  if (e.drafter_dir.empty()) throw_user("eval.drafter_dir is not set (an exported drafter directory, e.g. <run.dir>/exports/final)");
  at::Device device = at::kCPU;
  if (e.device == "auto") device = at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  else {
    try {
      device = at::Device(e.device);
    } catch (const std::exception&) {
      throw_user("eval.device: '{}' is not a device (auto, cpu, cuda, cuda:N)", e.device);
    }
    if (device.is_cuda() && !at::hasCUDA()) throw_user("eval.device: '{}' but this build or machine has no CUDA", e.device);
  }
  if (device.is_cpu() && cfg.run.cpu_threads > 0) at::set_num_threads(int(cfg.run.cpu_threads));
  const at::ScalarType dtype = model::resolve_dtype(cfg.target.dtype, device, "target.dtype");
  const model::HfConfig tcfg = model::load_hf_config(cfg.target.model_dir);
  // Fit first (cheap, before any weights): the drafter's config against the target's.
  const std::string dcfg_path = files::join(e.drafter_dir, "config.json");
  if (!files::exists(dcfg_path)) throw_user("eval.drafter_dir: {} does not exist (expected a drafter export)", dcfg_path);
  model::DrafterSpec spec = model::read_drafter_config(dcfg_path);
  const model::TargetInfo tinfo = model::target_info(tcfg);
  spec.check_fits(tinfo, dcfg_path);
  EvalSettings st = make_settings(cfg, spec.block_size, resolve_stop_ids(e, tcfg, cfg.target.model_dir));
  PromptLimits lim;
  lim.vocab_size = tcfg.vocab_size;
  lim.max_positions = tcfg.max_position_embeddings;
  lim.max_new_tokens = st.max_new_tokens;
  lim.context_source = "max_position_embeddings of " + tcfg.path;
  lim.target_dir = cfg.target.model_dir;
  std::vector<Prompt> prompts = read_prompts(e.prompts, lim, e.max_prompts);

  const double t0 = now_s();
  model::TargetModel target = model::TargetModel::load(cfg.target.model_dir, dtype, device);
  model::Drafter drafter = model::import_drafter(e.drafter_dir, tinfo, device, dtype);
  log::info("eval: target {} ({} layers) and drafter {} ({} layers, block {}) on {} in {}, loaded in {:.1f} s; "
            "{} prompts from {}", cfg.target.model_dir, tcfg.num_hidden_layers, e.drafter_dir, spec.num_layers,
            spec.block_size, device.str(), dtype_name(dtype), now_s() - t0, prompts.size(), e.prompts);
  DFlashProposer proposer(drafter, target);
  EvalReport r = evaluate(target, proposer, prompts, st);
  for (const auto& line : r.summary_lines()) log::info("{}", line);
  const std::string out = e.out.empty() ? files::join(cfg.run.dir, "eval.json") : e.out;
  files::make_dirs(files::parent(out));
  std::string extra = fmt::format("\"target\": {}, \"drafter\": {}, \"prompts_file\": {}, \"device\": {}, \"dtype\": {},\n  ",
                                  json::quote(cfg.target.model_dir), json::quote(e.drafter_dir), json::quote(e.prompts),
                                  json::quote(device.str()), json::quote(dtype_name(dtype)));
  files::write_file_atomic(out, r.to_json(extra));
  log::info("eval: report written to {}", out);
  return kExitOk;
}

}  // namespace dflash::eval
