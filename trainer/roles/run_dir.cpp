// The run directory's identity, lock and start-of-launch decisions (run_dir.h).
#include "trainer/roles/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <optional>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"
#include "core/log.h"
#include "core/version.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/optim/adamw.h"

namespace dflash::roles {
namespace {

constexpr const char* kRunFile = "run.json";
constexpr const char* kLockFile = "run.lock";
constexpr const char* kFormat = "dflash-run";
constexpr int64_t kVersion = 1;

struct RunJson {
  std::string run_id, config_hash, code_version, created, config_yaml;
  std::vector<std::string> history;
};

std::string path_of(const Config& cfg, const char* name) { return files::join(cfg.run.dir, name); }

std::optional<RunJson> read_run_json(const std::string& path) {
  if (!files::exists(path)) return std::nullopt;
  json::Value v = json::parse_file(path);
  auto str = [&](const char* k) -> std::string {
    const json::Value* x = v.find(k);
    if (!x) throw_user("{}: missing key '{}' (not written by dflash? move it away or pass run.overwrite=true)", path, k);
    return x->as_string(fmt::format("{}: {}", path, k));
  };
  if (str("format") != kFormat) throw_user("{}: not a dflash run record", path);
  RunJson r;
  r.run_id = str("run_id");
  r.config_hash = str("config_hash");
  r.code_version = str("code_version");
  r.created = str("created");
  r.config_yaml = str("config");
  if (const json::Value* h = v.find("history"))
    for (const auto& e : h->as_array(path + ": history")) r.history.push_back(e.as_string(path + ": history[]"));
  return r;
}

std::string utc_now() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string new_run_id() {
  std::random_device rd;
  const uint64_t a = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  const uint64_t t = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  return fmt::format("{:016x}", a ^ (t * 0x9e3779b97f4a7c15ull) ^ static_cast<uint64_t>(getpid()));
}

std::string changes_text(const std::vector<ConfigChange>& ch, size_t max_shown = 6) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ch.size() && i < max_shown; ++i)
    parts.push_back(fmt::format("{} {} -> {}", ch[i].key, ch[i].before, ch[i].after));
  if (ch.size() > max_shown) parts.push_back(fmt::format("and {} more", ch.size() - max_shown));
  return fmt::format("{}", fmt::join(parts, ", "));
}

// Keys whose change the state's own signature check reports (ckpt::check_resumable): left to it,
// since no flag can accept them (the batch stream would differ).
bool signature_key(const std::string& k) {
  return k.rfind("layout.", 0) == 0 || k == "train.grad_accum" || k == "run.seed" || k == "data.batch_tokens" ||
         k == "data.max_seq_len";
}

bool has_run_content(const Config& cfg) {
  struct stat st {};
  if (::stat(path_of(cfg, "metrics.jsonl").c_str(), &st) == 0 && st.st_size > 0) return true;  // empty: no step yet
  for (const char* sub : {"checkpoints", "exports"})
    if (!files::list_dir(path_of(cfg, sub)).empty()) return true;
  return false;
}

std::string free_sibling(const std::string& dir) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  for (int i = 2; i < 1000; ++i) {
    std::string c = fmt::format("{}-{}", d, i);
    if (!files::exists(c)) return c;
  }
  return d + "-new";
}

// The config a state directory was written with ("" if absent).
std::string state_config(const std::string& state_dir) {
  const std::string p = files::join(state_dir, ckpt::kConfigFile);
  return files::exists(p) ? files::read_file(p) : "";
}

double number_of(const std::map<std::string, std::string>& flat, const std::string& key, double def) {
  auto it = flat.find(key);
  if (it == flat.end()) return def;
  try {
    return std::stod(it->second);
  } catch (const std::exception&) {
    return def;
  }
}

}  // namespace

RunDirDecision inspect_run_dir(const Config& cfg, bool resume_flag) {
  RunDirDecision d;
  const std::string& dir = cfg.run.dir;
  const std::string run_file = path_of(cfg, kRunFile);
  std::optional<RunJson> rj = read_run_json(run_file);
  std::string state_dir;
  std::optional<ckpt::StateMeta> state = ckpt::find_latest_state(dir, &state_dir);
  // run.json alone (a launch that failed before its first step, e.g. on NaN weights) holds no
  // work to lose: the directory is free again.
  const bool occupied = state || has_run_content(cfg);
  if (rj && !occupied) rj.reset();
  if (rj) {
    d.run_id = rj->run_id;
    d.created = rj->created;
    d.history = rj->history;
    d.before_yaml = reresolved_yaml(rj->config_yaml, run_file);  // an older build's run: its new keys at defaults
  } else if (state) {
    d.before_yaml = state_config(state_dir);
    if (!d.before_yaml.empty()) d.before_yaml = reresolved_yaml(d.before_yaml, state_dir);
  }
  const std::string now_yaml = to_yaml(cfg);

  const char* restarts = std::getenv("SLURM_RESTART_COUNT");
  if (cfg.run.overwrite && !resume_flag && restarts != nullptr && std::atoi(restarts) > 0 && rj && state &&
      identity_hash_of_yaml(d.before_yaml, run_file) == identity_hash(cfg)) {
    d.kind = RunDirDecision::Kind::AutoResume;
    d.resume = true;
    d.overwrite_ignored = fmt::format("run.overwrite=true ignored: this is restart {} of SLURM job {} and {} holds "
                                      "a state of this same run (a job that started over at every requeue would "
                                      "never finish)",
                                      restarts, std::getenv("SLURM_JOB_ID") ? std::getenv("SLURM_JOB_ID") : "?", dir);
    return d;
  }
  if (cfg.run.overwrite) {
    if (resume_flag)
      throw_user("--resume and run.overwrite=true contradict each other: --resume continues the run in {}, "
                 "run.overwrite deletes it; pass one of them",
                 dir);
    d.kind = occupied ? RunDirDecision::Kind::Overwrite : RunDirDecision::Kind::New;
    d.run_id.clear();
    d.history.clear();
    return d;
  }
  if (resume_flag) {
    d.kind = RunDirDecision::Kind::Resume;
    d.resume = true;  // make_plan refuses when there is no complete state
    if (!d.before_yaml.empty()) {
      std::vector<ConfigChange> changes;
      for (const auto& c : identity_changes(d.before_yaml, now_yaml, rj ? run_file : state_dir))
        if (!signature_key(c.key)) changes.push_back(c);
      if (!changes.empty() && !cfg.run.accept_changes)
        throw_user("--resume: this launch changes the run in {}: {}; resume with the run's settings (they are in "
                   "{}), add run.accept_changes=true to continue with the new ones (a changed step count or "
                   "learning rate recomputes the schedule from the resumed step on), or start a new run in {}",
                   dir, changes_text(changes), rj ? run_file : files::join(state_dir, ckpt::kConfigFile),
                   free_sibling(dir));
      d.accepted = changes;
    }
    return d;
  }
  if (!occupied) return d;  // a new run
  const std::string hash = identity_hash(cfg);
  // the recorded config under this build's rules, not run.json's config_hash: a build that adds a key or takes one out
  // of the identity must not turn a requeued run into "another run"
  if (rj && identity_hash_of_yaml(d.before_yaml, run_file) == hash) {
    d.kind = state ? RunDirDecision::Kind::AutoResume : RunDirDecision::Kind::SameRunRestart;
    d.resume = state.has_value();
    return d;
  }
  std::string what;
  if (rj) {
    what = fmt::format("run {} (created {}, code {})", rj->run_id, rj->created, rj->code_version);
    const auto ch = identity_changes(d.before_yaml, now_yaml, run_file);
    if (!ch.empty()) what += fmt::format(" whose config differs: {}", changes_text(ch, 4));
  } else {
    what = "a run without run.json (from an older dflash, or files put there by hand)";
  }
  throw_user("run.dir {} holds another run: {}{}; to continue it add --resume{}, to start a new run choose another "
             "run.dir (e.g. {}) or pass run.overwrite=true (deletes its checkpoints/, exports/ and metrics.jsonl)",
             dir, what, state ? fmt::format(", with a state at step {}", state->step) : "",
             rj ? " (run.accept_changes=true to take the changed settings)" : "", free_sibling(dir));
}

void prepare_run_dir(const Config& cfg, const RunDirDecision& d, const RunPlan& plan) {
  const std::string& dir = cfg.run.dir;
  files::make_dirs(dir);
  // The lock: held for the life of this process (released by the kernel when it ends, however).
  static int lock_fd = -1;
  if (lock_fd < 0) {
    const std::string lp = path_of(cfg, kLockFile);
    lock_fd = ::open(lp.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0) throw_user("cannot create {}: {}", lp, std::strerror(errno));
    if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      std::string holder;
      char buf[256] = {0};
      if (::pread(lock_fd, buf, sizeof(buf) - 1, 0) > 0) holder = fmt::format(" ({})", std::string(buf));
      ::close(lock_fd);
      lock_fd = -1;
      throw_user("run.dir {} is in use by another launch{}; wait for it to end, or choose another run.dir", dir,
                 holder);
    }
    char host[128] = {0};
    ::gethostname(host, sizeof(host) - 1);
    const std::string who = fmt::format("pid {} on {}", getpid(), host);
    if (::ftruncate(lock_fd, 0) == 0 && ::pwrite(lock_fd, who.data(), who.size(), 0) < 0) {
      // informative only
    }
  }
  using K = RunDirDecision::Kind;
  if (d.kind == K::Overwrite) {
    for (const char* p : {"checkpoints", "exports", "metrics.jsonl", kRunFile}) files::remove_tree(path_of(cfg, p));
    log::warn("run.overwrite: deleted the previous run's checkpoints/, exports/ and metrics.jsonl in {}", dir);
  }
  // Stale temporaries of a crashed launch (a state or export that never completed).
  const std::string ck = ckpt::checkpoints_dir(dir), ex = path_of(cfg, "exports");
  for (const auto& [parent, suffixes] : {std::pair<std::string, std::vector<std::string>>{ck, {".tmp"}},
                                        std::pair<std::string, std::vector<std::string>>{ex, {".tmp", ".old"}}}) {
    for (const auto& n : files::list_dir(parent)) {
      for (const auto& sfx : suffixes) {
        if (n.size() > sfx.size() && n.compare(n.size() - sfx.size(), sfx.size(), sfx) == 0) {
          log::info("removing stale {}/{} (left by a launch that ended before completing it)", parent, n);
          files::remove_tree(files::join(parent, n));
        }
      }
    }
  }
  RunJson r;
  r.run_id = d.run_id.empty() ? new_run_id() : d.run_id;
  r.created = d.created.empty() || d.kind == K::Overwrite ? utc_now() : d.created;
  r.code_version = version();
  r.config_hash = identity_hash(cfg);
  r.config_yaml = to_yaml(cfg);
  r.history = d.history;
  std::string event;
  switch (d.kind) {
    case K::New: event = "new run"; break;
    case K::Overwrite: event = "new run (run.overwrite: the previous run was deleted)"; break;
    case K::SameRunRestart: event = "launched again with the same config, no state yet: started from step 0"; break;
    case K::AutoResume: event = fmt::format("launched again with the same config: auto-resumed from {}", plan.resume_dir); break;
    case K::Resume: event = fmt::format("--resume from {}", plan.resume_dir); break;
  }
  if (!d.accepted.empty()) {
    event += fmt::format(", accepting changes (run.accept_changes): {}", changes_text(d.accepted, 100));
    // The consequence, in numbers: the learning rate of the resumed step before and after.
    const auto before = flatten_config_yaml(d.before_yaml, "the run's config");
    const int64_t s = plan.start_step;
    const int64_t old_total = plan.resume ? plan.resume->total_steps : plan.total_steps;
    const double lr_before = optim::LrSchedule::cosine(number_of(before, "train.lr", cfg.train.lr),
                                                       number_of(before, "train.warmup_ratio", cfg.train.warmup_ratio),
                                                       std::max<int64_t>(1, old_total))
                                 .at(s);
    const double lr_after = optim::LrSchedule::cosine(cfg.train.lr, cfg.train.warmup_ratio, plan.total_steps).at(s);
    log::warn("run.accept_changes: continuing {} at step {} with {}; the run now has {} steps (was {}) and the "
              "learning rate at step {} is {:g} (was {:g})",
              dir, s, changes_text(d.accepted, 100), plan.total_steps, old_total, s, lr_after, lr_before);
  }
  r.history.push_back(fmt::format("{} {} (code {})", utc_now(), event, version()));
  std::vector<std::string> hist;
  for (const auto& h : r.history) hist.push_back("    " + json::quote(h));
  const std::string text = fmt::format(
      "{{\n  \"format\": \"{}\",\n  \"version\": {},\n  \"run_id\": {},\n  \"config_hash\": {},\n"
      "  \"code_version\": {},\n  \"created\": {},\n  \"history\": [\n{}\n  ],\n  \"config\": {}\n}}\n",
      kFormat, kVersion, json::quote(r.run_id), json::quote(r.config_hash), json::quote(r.code_version),
      json::quote(r.created), fmt::join(hist, ",\n"), json::quote(r.config_yaml));
  files::write_file_atomic(path_of(cfg, kRunFile), text);
  if (!d.overwrite_ignored.empty()) log::warn("{}", d.overwrite_ignored);
  if (d.kind == K::AutoResume && plan.start_step >= plan.total_steps)
    log::info("auto-resume: {} holds the final state of this run (run {}, step {} of {}): nothing to train, the "
              "final export is written again (run.overwrite=true starts over)",
              dir, r.run_id, plan.start_step, plan.total_steps);
  else if (d.kind == K::AutoResume)
    log::info("auto-resume: {} holds a state of this run (run {}, same config); resuming from {} (run.overwrite=true "
              "starts over)",
              dir, r.run_id, plan.resume_dir);
  else if (d.kind == K::SameRunRestart)
    log::info("{}: the same run (run {}) launched again before its first state; starting from step 0", dir, r.run_id);
}

}  // namespace dflash::roles
