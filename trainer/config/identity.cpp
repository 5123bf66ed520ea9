// The identity of a run from its resolved config (identity.h).
#include "trainer/config/identity.h"

#include <cinttypes>
#include <cstdio>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "core/error.h"

namespace dflash {
namespace {

void flatten(const YAML::Node& n, const std::string& path, std::map<std::string, std::string>& out) {
  if (n.IsMap()) {
    for (const auto& kv : n) flatten(kv.second, path.empty() ? kv.first.Scalar() : path + "." + kv.first.Scalar(), out);
    return;
  }
  if (n.IsSequence()) {
    std::string s = "[";
    for (size_t i = 0; i < n.size(); ++i) s += (i ? ", " : "") + (n[i].IsScalar() ? n[i].Scalar() : std::string("?"));
    out[path] = s + "]";
    return;
  }
  out[path] = n.IsScalar() ? n.Scalar() : "";
}

bool starts_with(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

}  // namespace

std::map<std::string, std::string> flatten_config_yaml(const std::string& yaml, const std::string& origin) {
  std::map<std::string, std::string> out;
  try {
    flatten(YAML::Load(yaml), "", out);
  } catch (const YAML::Exception& e) {
    throw_user("{}: malformed resolved config: {}", origin, e.msg);
  }
  return out;
}

bool is_identity_key(const std::string& k) {
  if (starts_with(k, "log.") || starts_with(k, "comm.") || starts_with(k, "checkpoint.") || starts_with(k, "eval."))
    return false;  // eval: evaluation during training watches the run, the losses are the same (tests/eval)
  // how the same math is executed: the attention path, its backward and the LM head's chunking change rounding
  // and speed, not the run (a run may move to a card without the kernel; a new default must not strand a run)
  if (k == "drafter.attention" || k == "drafter.attention_backward" || k == "drafter.loss_chunk") return false;
  return k != "run.name" && k != "run.dir" && k != "run.cpu_threads" && k != "run.overwrite" &&
         k != "run.accept_changes";
}

bool is_schedule_key(const std::string& k) {
  return k == "train.max_steps" || k == "train.epochs" || k == "train.lr" || k == "train.warmup_ratio" ||
         k == "train.grad_accum" || k == "run.seed" || starts_with(k, "layout.") || starts_with(k, "data.");
}

std::string identity_text(const std::map<std::string, std::string>& flat) {
  std::string s;
  for (const auto& [k, v] : flat)
    if (is_identity_key(k)) s += k + ": " + v + "\n";
  return s;
}

namespace {
std::string fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return fmt::format("{:016x}", h);
}
}  // namespace

std::string identity_hash_of_yaml(const std::string& yaml, const std::string& origin) {
  return fnv1a(identity_text(flatten_config_yaml(yaml, origin)));
}

std::string identity_hash(const Config& cfg) { return identity_hash_of_yaml(to_yaml(cfg), "resolved config"); }

std::string reresolved_yaml(const std::string& yaml, const std::string& origin) {
  try {
    return to_yaml(parse_config(yaml, origin, {}));
  } catch (const UserError&) {
    return yaml;  // a key this build no longer has, or a value it refuses: compared as written
  }
}

std::vector<ConfigChange> identity_changes(const std::string& before_yaml, const std::string& after_yaml,
                                           const std::string& origin) {
  auto a = flatten_config_yaml(before_yaml, origin), b = flatten_config_yaml(after_yaml, "this run's config");
  std::vector<ConfigChange> out;
  for (const auto& [k, v] : b) {
    if (!is_identity_key(k)) continue;
    auto it = a.find(k);
    const std::string before = it == a.end() ? "(absent)" : it->second;
    if (before != v) out.push_back({k, before, v});
  }
  for (const auto& [k, v] : a)
    if (is_identity_key(k) && !b.count(k)) out.push_back({k, v, "(absent)"});
  return out;
}

}  // namespace dflash
