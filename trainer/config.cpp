#include "trainer/config.h"

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/files.h"
#include "trainer/config/validate.h"

namespace dflash {
namespace {

// ---- scalar conversion with messages that name the key ---------------------------------
std::string describe(const YAML::Node& n) {
  if (n.IsScalar()) return fmt::format("'{}'", n.Scalar());
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "nothing";
}

struct Where {
  const std::string& origin;
  std::string key;
};

[[noreturn]] void bad_type(const Where& w, const YAML::Node& n, const char* expected) {
  throw_user("{}: key '{}' expects {}, got {}", w.origin, w.key, expected, describe(n));
}

void convert(const Where& w, const YAML::Node& n, int64_t& out) {
  if (!n.IsScalar()) bad_type(w, n, "an integer");
  const std::string& s = n.Scalar();
  try {
    size_t pos = 0;
    long long v = std::stoll(s, &pos, 0);
    if (pos != s.size()) bad_type(w, n, "an integer");
    out = v;
  } catch (const std::logic_error&) {
    bad_type(w, n, "an integer");
  }
}

void convert(const Where& w, const YAML::Node& n, double& out) {
  if (!n.IsScalar()) bad_type(w, n, "a number");
  const std::string& s = n.Scalar();
  try {
    size_t pos = 0;
    double v = std::stod(s, &pos);
    if (pos != s.size()) bad_type(w, n, "a number");
    out = v;
  } catch (const std::logic_error&) {
    bad_type(w, n, "a number");
  }
}

void convert(const Where& w, const YAML::Node& n, bool& out) {
  if (!n.IsScalar()) bad_type(w, n, "true or false");
  const std::string& s = n.Scalar();
  if (s == "true" || s == "True" || s == "yes" || s == "on") out = true;
  else if (s == "false" || s == "False" || s == "no" || s == "off") out = false;
  else bad_type(w, n, "true or false");
}

void convert(const Where& w, const YAML::Node& n, std::string& out) {
  if (n.IsNull()) { out.clear(); return; }
  if (!n.IsScalar()) bad_type(w, n, "a string");
  out = n.Scalar();
}

template <class T>
void convert(const Where& w, const YAML::Node& n, std::vector<T>& out) {
  if (n.IsNull()) { out.clear(); return; }
  if (!n.IsSequence()) bad_type(w, n, "a list");
  std::vector<T> v(n.size());
  for (size_t i = 0; i < n.size(); ++i) convert(Where{w.origin, fmt::format("{}[{}]", w.key, i)}, n[i], v[i]);
  out = std::move(v);
}

// ---- visitors -----------------------------------------------------------------------------
// Collects the keys of one section.
struct KeyLister {
  std::vector<std::string> keys;
  template <class T> void operator()(const char* k, T&, const char*) { keys.emplace_back(k); }
  template <class S> void section(const char* k, S&) { keys.emplace_back(k); }
};

template <class S>
std::vector<std::string> keys_of(S& s) {
  KeyLister l;
  s.visit(l);
  return l.keys;
}

// "; did you mean 'x'?" for an unknown key `k` under `path`: the key of that exact name in another
// section ("lr" at the top: "train.lr"), else the closest key allowed there, else a key of
// another section with a close name.
std::string suggest(const std::string& path, const std::string& k, const std::vector<std::string>& allowed) {
  // the exact name in one other section first ("lr" at the top level: "train.lr")
  std::vector<std::string> exact, near;
  for (const auto& full : config_keys()) {
    const auto dot = full.rfind('.');
    if (dot == std::string::npos) continue;
    const std::string leaf = full.substr(dot + 1);
    if (leaf == k) exact.push_back(full);
    else if (!did_you_mean(k, {leaf}).empty()) near.push_back(full);
  }
  if (exact.size() == 1 && exact[0] != (path.empty() ? k : path + "." + k))
    return fmt::format("; did you mean '{}'?", exact[0]);
  std::vector<std::string> here;
  for (const auto& a : allowed) here.push_back(path.empty() ? a : path + "." + a);
  std::string s = did_you_mean(path.empty() ? k : path + "." + k, here);
  if (!s.empty()) return s;
  return near.size() == 1 ? fmt::format("; did you mean '{}'?", near[0]) : "";
}

template <class S>
void check_keys(const std::string& origin, const std::string& path, const YAML::Node& map, S& s) {
  std::vector<std::string> allowed = keys_of(s);
  std::set<std::string> set(allowed.begin(), allowed.end());
  for (const auto& kv : map) {
    std::string k = kv.first.Scalar();
    if (!set.count(k)) {
      std::string full = path.empty() ? k : path + "." + k;
      throw_user("{}: unknown key '{}'{} (allowed {}: {})", origin, full, suggest(path, k, allowed),
                 path.empty() ? "at the top level" : fmt::format("under '{}'", path),
                 fmt::join(allowed, ", "));
    }
  }
}

struct Loader {
  const std::string& origin;
  std::string path;
  YAML::Node node;
  template <class T> void operator()(const char* k, T& field, const char*) {
    YAML::Node c = node[k];
    if (!c) return;
    convert(Where{origin, path.empty() ? k : path + "." + k}, c, field);
  }
  template <class S> void section(const char* k, S& s) {
    YAML::Node c = node[k];
    if (!c || c.IsNull()) return;
    std::string p = path.empty() ? k : path + "." + k;
    if (!c.IsMap()) throw_user("{}: key '{}' expects a mapping, got {}", origin, p, describe(c));
    check_keys(origin, p, c, s);
    Loader sub{origin, p, c};
    s.visit(sub);
  }
};

// Applies one dotted override.
struct Setter {
  const std::string& origin;
  std::vector<std::string> parts;  // remaining path
  std::string done;                // path walked so far
  const YAML::Node& value;
  bool found = false;
  template <class T> void operator()(const char* k, T& field, const char*) {
    if (found || parts.size() != 1 || parts[0] != k) return;
    found = true;
    convert(Where{origin, done.empty() ? k : done + "." + k}, value, field);
  }
  template <class S> void section(const char* k, S& s) {
    if (found || parts.size() < 2 || parts[0] != k) return;
    found = true;
    Setter sub{origin, std::vector<std::string>(parts.begin() + 1, parts.end()),
               done.empty() ? k : done + "." + k, value};
    s.visit(sub);
    if (!sub.found) {
      const std::string key = sub.done + "." + fmt::format("{}", fmt::join(sub.parts, "."));
      throw_user("{}: unknown key '{}'{} (allowed under '{}': {})", origin, key, did_you_mean(key, config_keys()),
                 sub.done, fmt::join(keys_of(s), ", "));
    }
  }
};

template <class T> void emit_value(YAML::Emitter& e, const T& v) { e << v; }
void emit_value(YAML::Emitter& e, const std::string& v) { e << YAML::DoubleQuoted << v; }
void emit_value(YAML::Emitter& e, const double& v) {
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  e << s;
}
template <class T> void emit_value(YAML::Emitter& e, const std::vector<T>& v) {
  e << YAML::Flow << YAML::BeginSeq;
  for (const auto& x : v) emit_value(e, x);
  e << YAML::EndSeq;
}

struct Emitter {
  YAML::Emitter& e;
  template <class T> void operator()(const char* k, T& field, const char* doc) {
    e << YAML::Key << k << YAML::Value;
    emit_value(e, field);
    e << YAML::Comment(doc);
  }
  template <class S> void section(const char* k, S& s) {
    e << YAML::Key << k << YAML::Value << YAML::BeginMap;
    s.visit(*this);
    e << YAML::EndMap;
  }
};

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) out.push_back(item);
  return out;
}

// Collects every dotted key of the schema.
struct PathLister {
  std::string prefix;
  std::vector<std::string>* out;
  template <class T> void operator()(const char* k, T&, const char*) { out->push_back(prefix + k); }
  template <class S> void section(const char* k, S& s) {
    PathLister sub{prefix + k + ".", out};
    s.visit(sub);
  }
};

// One help line per section: its name and keys.
struct SectionLister {
  std::string text;
  template <class T> void operator()(const char*, T&, const char*) {}
  template <class S> void section(const char* k, S& s) {
    text += fmt::format("  {:<12}{}\n", k, fmt::join(keys_of(s), ", "));
  }
};

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& origin_name,
                    const std::vector<std::string>& overrides) {
  Config cfg;
  cfg.source_path = origin_name;
  cfg.overrides = overrides;
  const std::string origin = "config " + origin_name;
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw_user("{}: malformed YAML at line {}, column {}: {}", origin, e.mark.line + 1,
               e.mark.column + 1, e.msg);
  }
  if (root && !root.IsNull()) {
    if (!root.IsMap()) throw_user("{}: expected a mapping at the top level, got {}", origin, describe(root));
    check_duplicate_keys(root, origin);
    check_keys(origin, "", root, cfg);
    Loader l{origin, "", root};
    cfg.visit(l);
  }
  for (const std::string& ov : overrides) {
    auto eq = ov.find('=');
    if (eq == std::string::npos || eq == 0)
      throw_user("override '{}': expected key.path=value", ov);
    std::string key = ov.substr(0, eq);
    YAML::Node value;
    try {
      value = YAML::Load(ov.substr(eq + 1));
    } catch (const YAML::Exception& e) {
      throw_user("override '{}': malformed value: {}", ov, e.msg);
    }
    std::string where = fmt::format("override '{}'", ov);
    Setter s{where, split(key, '.'), "", value};
    cfg.visit(s);
    if (!s.found) {
      std::string dym = did_you_mean(key, config_keys());
      if (dym.empty() && key.find('.') == std::string::npos) dym = suggest("", key, keys_of(cfg));
      throw_user("{}: unknown key '{}'{} (allowed at the top level: {}; use section.key=value)", where, key, dym,
                 fmt::join(keys_of(cfg), ", "));
    }
    cfg.overridden[key] = ov;
  }
  validate_config(cfg);
  return cfg;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) {
    Config c = parse_config("", "(defaults)", overrides);
    c.source_path.clear();
    return c;
  }
  std::ifstream f(path);
  if (!f) {
    throw_user("config file '{}' {}", path,
               files::exists(path) ? "cannot be read" : "does not exist");
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config(ss.str(), path, overrides);
}

std::string key_origin(const Config& cfg, const std::string& key) {
  auto it = cfg.overridden.find(key);
  if (it != cfg.overridden.end()) return fmt::format("override '{}'", it->second);
  return fmt::format("config {}", cfg.source_path.empty() ? "(defaults)" : cfg.source_path);
}

std::vector<std::string> config_keys() {
  std::vector<std::string> out;
  Config c;
  PathLister l{"", &out};
  c.visit(l);
  return out;
}

std::string did_you_mean(const std::string& word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  size_t best = limit + 1;
  std::string pick;
  for (const auto& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best) best = d, pick = c;
  }
  return pick.empty() ? "" : fmt::format("; did you mean '{}'?", pick);
}

std::string config_sections_help() {
  Config c;
  SectionLister sec;
  c.visit(sec);
  return sec.text;
}

void check_paths(const Config& cfg) {
  auto need_dir = [&](const char* key, const std::string& path) {
    if (path.empty()) return;
    if (!files::exists(path))
      throw_user("{}: directory '{}' does not exist ({})", key, path, key_origin(cfg, key));
    if (!files::is_dir(path))
      throw_user("{}: '{}' is not a directory ({})", key, path, key_origin(cfg, key));
  };
  need_dir("target.model_dir", cfg.target.model_dir);
  need_dir("drafter.init_from", cfg.drafter.init_from);
  for (size_t i = 0; i < cfg.data.shards.size(); ++i)
    if (!files::exists(cfg.data.shards[i]))
      throw_user("data.shards[{}]: '{}' does not exist ({})", i, cfg.data.shards[i], key_origin(cfg, "data.shards"));
}

std::string to_yaml(const Config& cfg) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  Emitter em{e};
  const_cast<Config&>(cfg).visit(em);
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace dflash
