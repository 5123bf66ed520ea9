#include "trainer/checkpoint/checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/log.h"
#include "core/files.h"
#include "trainer/model/safetensors.h"
#include "core/json.h"

namespace dflash::ckpt {
namespace {

constexpr const char* kLatest = "latest";
constexpr const char* kFormat = "dflash-train-state";
constexpr int64_t kVersion = 1;

using files::exists;
using files::list_dir;
using files::make_dirs;

// "step-00000200" -> 200; -1 if the name is not a complete-state name.
int64_t step_of(const std::string& name) {
  if (name.size() != 13 || name.rfind("step-", 0) != 0) return -1;
  for (size_t i = 5; i < name.size(); ++i)
    if (name[i] < '0' || name[i] > '9') return -1;
  return std::stoll(name.substr(5));
}

std::string sig_json(const RunSignature& s) {
  return fmt::format(
      "{{\"world_size\": {}, \"target_ranks\": {}, \"drafter_ranks\": {}, \"colocated\": {}, \"grad_accum\": {}, "
      "\"seed\": {}, \"batch_tokens\": {}, \"max_seq_len\": {}, \"data_docs\": {}, \"data_tokens\": {}}}",
      s.world_size, s.target_ranks, s.drafter_ranks, s.colocated ? "true" : "false", s.grad_accum, s.seed,
      s.batch_tokens, s.max_seq_len, s.data_docs, s.data_tokens);
}

std::string meta_json(const StateMeta& m) {
  std::vector<std::string> files;
  for (const auto& f : m.files) files.push_back(json::quote(f));
  return fmt::format(
      "{{\n  \"format\": \"{}\",\n  \"version\": {},\n  \"step\": {},\n  \"next_batch\": {},\n  \"total_steps\": {},\n"
      "  \"config_hash\": {},\n  \"signature\": {},\n  \"files\": [{}]\n}}\n",
      kFormat, kVersion, m.step, m.next_batch, m.total_steps, json::quote(m.config_hash), sig_json(m.sig),
      fmt::join(files, ", "));
}

StateMeta parse_meta(const std::string& path) {
  json::Value v = json::parse_file(path);
  auto get = [&](const json::Value& o, const char* k) -> const json::Value& {
    const json::Value* x = o.find(k);
    if (!x) throw_user("{}: missing key '{}'", path, k);
    return *x;
  };
  if (get(v, "format").as_string(path + ": format") != kFormat) throw_user("{}: not a dflash training state", path);
  const int64_t version = get(v, "version").as_int(path + ": version");
  if (version != kVersion) throw_user("{}: state format version {}, this build reads {}", path, version, kVersion);
  StateMeta m;
  m.step = get(v, "step").as_int(path + ": step");
  m.next_batch = get(v, "next_batch").as_int(path + ": next_batch");
  m.total_steps = get(v, "total_steps").as_int(path + ": total_steps");
  if (const json::Value* h = v.find("config_hash"); h && !h->is_null()) m.config_hash = h->as_string(path + ": config_hash");
  const json::Value& s = get(v, "signature");
  auto i = [&](const char* k) { return get(s, k).as_int(fmt::format("{}: signature.{}", path, k)); };
  m.sig.world_size = i("world_size");
  m.sig.target_ranks = i("target_ranks");
  m.sig.drafter_ranks = i("drafter_ranks");
  m.sig.colocated = get(s, "colocated").as_bool(path + ": signature.colocated");
  m.sig.grad_accum = i("grad_accum");
  m.sig.seed = i("seed");
  m.sig.batch_tokens = i("batch_tokens");
  m.sig.max_seq_len = i("max_seq_len");
  m.sig.data_docs = i("data_docs");
  m.sig.data_tokens = i("data_tokens");
  for (const auto& f : get(v, "files").as_array(path + ": files")) m.files.push_back(f.as_string(path + ": files[]"));
  return m;
}

}  // namespace

std::string checkpoints_dir(const std::string& run_dir) { return run_dir + "/checkpoints"; }
std::string state_dir(const std::string& run_dir, int64_t step) {
  return fmt::format("{}/step-{:08d}", checkpoints_dir(run_dir), step);
}
std::string state_tmp_dir(const std::string& run_dir, int64_t step) { return state_dir(run_dir, step) + ".tmp"; }
std::string export_dir(const std::string& run_dir, int64_t step) {
  return fmt::format("{}/exports/step-{:08d}", run_dir, step);
}
std::string final_export_dir(const std::string& run_dir) { return run_dir + "/exports/final"; }
std::string rank_file(int rank) { return fmt::format("rank-{:05d}.safetensors", rank); }

void write_rank_state(const std::string& tmp_dir, int rank, int64_t step, const optim::AdamW* opt) {
  make_dirs(tmp_dir);
  at::Tensor rng;
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  st::save(tmp_dir + "/" + rank_file(rank), {{"rng.cpu", rng}},
           {{"rank", std::to_string(rank)}, {"step", std::to_string(step)}});
  if (opt) {
    std::vector<std::pair<std::string, at::Tensor>> t;
    for (const auto& [n, p] : opt->params()) t.emplace_back("param." + n, p.detach());
    for (const auto& [n, s] : opt->state()) t.emplace_back("optim." + n, s);
    st::save(tmp_dir + "/" + kOptimizerFile, t,
             {{"step", std::to_string(step)}, {"optimizer_steps", std::to_string(opt->steps())}});
  }
}

void commit_state(const std::string& run_dir, const StateMeta& meta, const std::string& config_yaml,
                  int64_t keep_last) {
  const std::string tmp = state_tmp_dir(run_dir, meta.step);
  const std::string dir = state_dir(run_dir, meta.step);
  for (const auto& f : meta.files)
    if (f != kConfigFile && !exists(tmp + "/" + f))
      throw std::runtime_error(fmt::format("checkpoint {}: {} was not written", tmp, f));
  files::write_file_atomic(tmp + "/" + kConfigFile, config_yaml);
  files::write_file_atomic(tmp + "/" + kMetaFile, meta_json(meta));  // last: marks completeness
  if (exists(dir)) files::remove_tree(dir);  // a state of the same step from an earlier attempt
  files::rename_durable(tmp, dir);
  files::write_file_atomic(checkpoints_dir(run_dir) + "/" + kLatest,
                           fmt::format("step-{:08d}\n", meta.step));
  // Prune: keep the newest keep_last complete states; drop leftover tmp dirs of older steps.
  std::vector<int64_t> complete;
  for (const auto& n : list_dir(checkpoints_dir(run_dir))) {
    const int64_t s = step_of(n);
    if (s >= 0) {
      complete.push_back(s);
    } else if (n.size() > 4 && n.compare(n.size() - 4, 4, ".tmp") == 0) {
      const int64_t ts = step_of(n.substr(0, n.size() - 4));
      if (ts >= 0 && ts < meta.step) files::remove_tree(checkpoints_dir(run_dir) + "/" + n);
    }
  }
  std::sort(complete.begin(), complete.end());
  if (keep_last > 0) {
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < complete.size(); ++i)
      if (complete[i] != meta.step) files::remove_tree(state_dir(run_dir, complete[i]));
  }
}

std::optional<StateMeta> read_state(const std::string& dir) {
  const std::string meta_path = dir + "/" + kMetaFile;
  if (!exists(meta_path)) return std::nullopt;
  StateMeta m;
  try {
    m = parse_meta(meta_path);
  } catch (const UserError& e) {
    log::warn("ignoring checkpoint {}: {}", dir, e.what());
    return std::nullopt;
  }
  for (const auto& f : m.files) {
    if (!exists(dir + "/" + f)) {
      log::warn("ignoring checkpoint {}: {} is missing", dir, f);
      return std::nullopt;
    }
  }
  return m;
}

std::optional<StateMeta> find_latest_state(const std::string& run_dir, std::string* dir_out) {
  const std::string cdir = checkpoints_dir(run_dir);
  std::string named;
  if (exists(cdir + "/" + kLatest)) {
    std::string s = files::read_file(cdir + "/" + kLatest);
    while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
    named = s;
  }
  if (step_of(named) >= 0) {
    if (auto m = read_state(cdir + "/" + named)) {
      // `latest` is rewritten after the rename, so a newer complete state can exist only if the
      // process died in between: prefer the newest complete one.
      int64_t best = m->step;
      for (const auto& n : list_dir(cdir)) best = std::max(best, step_of(n));
      if (best == m->step) {
        if (dir_out) *dir_out = cdir + "/" + named;
        return m;
      }
    } else {
      log::warn("checkpoint {}/{} named by {}/latest is incomplete; looking for the newest complete state", cdir,
                named, cdir);
    }
  }
  std::vector<std::string> names = list_dir(cdir);
  std::sort(names.begin(), names.end(), [](const std::string& a, const std::string& b) { return step_of(a) > step_of(b); });
  for (const auto& n : names) {
    if (step_of(n) < 0) continue;
    if (auto m = read_state(cdir + "/" + n)) {
      if (dir_out) *dir_out = cdir + "/" + n;
      return m;
    }
  }
  return std::nullopt;
}

void check_resumable(const StateMeta& meta, const RunSignature& now, const std::string& dir) {
  std::vector<std::string> diffs;
  const RunSignature& was = meta.sig;
  auto cmp = [&](const char* what, int64_t a, int64_t b) {
    if (a != b) diffs.push_back(fmt::format("{}: state {}, this run {}", what, a, b));
  };
  cmp("world size", was.world_size, now.world_size);
  cmp("layout.target_ranks", was.target_ranks, now.target_ranks);
  cmp("layout.drafter_ranks", was.drafter_ranks, now.drafter_ranks);
  if (was.colocated != now.colocated)
    diffs.push_back(fmt::format("layout.colocated: state {}, this run {}", was.colocated, now.colocated));
  cmp("train.grad_accum", was.grad_accum, now.grad_accum);
  cmp("run.seed", was.seed, now.seed);
  cmp("data.batch_tokens", was.batch_tokens, now.batch_tokens);
  cmp("data.max_seq_len", was.max_seq_len, now.max_seq_len);
  cmp("documents in data.shards", was.data_docs, now.data_docs);
  cmp("tokens in data.shards", was.data_tokens, now.data_tokens);
  if (!diffs.empty())
    throw_user("cannot resume from {}: it was written by a run with another layout or data stream ({}); resume "
               "with the same settings, or start a new run.dir",
               dir, fmt::join(diffs, "; "));
}

void load_rank_state(const std::string& dir, int rank, optim::AdamW* opt, int64_t step) {
  const std::string rf = dir + "/" + rank_file(rank);
  if (!exists(rf)) throw_user("cannot resume from {}: {} is missing (written by another layout?)", dir, rank_file(rank));
  auto r = st::SafeTensors::open(rf);
  at::Tensor rng = r.load("rng.cpu", at::kByte, at::kCPU);
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  if (!opt) return;
  const std::string of = dir + "/" + kOptimizerFile;
  auto o = st::SafeTensors::open(of);
  at::NoGradGuard ng;
  std::vector<std::string> missing;
  for (const auto& [n, p] : opt->params()) {
    if (!o.has("param." + n)) {
      missing.push_back(n);
      continue;
    }
    std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
    at::Tensor t = o.load("param." + n, p.scalar_type(), p.device(), &shape);
    st::check_finite(t, of, "param." + n);
    p.detach().copy_(t);
  }
  if (!missing.empty()) throw_user("cannot resume from {}: parameters [{}] are missing", of, fmt::join(missing, ", "));
  // Moments and masters are fp32 on their parameter's device; names load_state does not expect
  // are passed on (to the CPU) so that its error lists them.
  optim::NamedTensors state;
  std::set<std::string> taken;
  for (const auto& [n, p] : opt->params()) {
    for (const char* prefix : {"exp_avg.", "exp_avg_sq.", "master."}) {
      const std::string key = std::string("optim.") + prefix + n;
      if (!o.has(key)) continue;
      state.emplace_back(key.substr(6), o.load(key, at::kFloat, p.device()));
      st::check_finite(state.back().second, of, key);
      taken.insert(key);
    }
  }
  for (const auto& name : o.names())
    if (name.rfind("optim.", 0) == 0 && !taken.count(name))
      state.emplace_back(name.substr(6), o.load(name, at::kFloat, at::kCPU));
  const auto& md = o.metadata();
  int64_t opt_steps = step;
  if (auto it = md.find("optimizer_steps"); it != md.end()) opt_steps = std::stoll(it->second);
  opt->load_state(state, opt_steps, of);
}

}  // namespace dflash::ckpt
