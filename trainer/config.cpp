#include "trainer/config.h"

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
  throw_user("config {}: key '{}' expects {}, got {}", w.origin, w.key, expected, describe(n));
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

template <class S>
void check_keys(const std::string& origin, const std::string& path, const YAML::Node& map, S& s) {
  std::vector<std::string> allowed = keys_of(s);
  std::set<std::string> set(allowed.begin(), allowed.end());
  for (const auto& kv : map) {
    std::string k = kv.first.Scalar();
    if (!set.count(k)) {
      std::string full = path.empty() ? k : path + "." + k;
      throw_user("config {}: unknown key '{}'; allowed {}: {}", origin, full,
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
    if (!c.IsMap()) throw_user("config {}: key '{}' expects a mapping, got {}", origin, p, describe(c));
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
      throw_user("{}: unknown key '{}'; allowed under '{}': {}", origin,
                 sub.done + "." + fmt::format("{}", fmt::join(sub.parts, ".")), sub.done,
                 fmt::join(keys_of(s), ", "));
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

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& origin,
                    const std::vector<std::string>& overrides) {
  Config cfg;
  ConfigOrigin where_from{origin, {}};
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw_user("config {}: malformed YAML at line {}, column {}: {}", origin, e.mark.line + 1,
               e.mark.column + 1, e.msg);
  }
  if (root && !root.IsNull()) {
    if (!root.IsMap()) throw_user("config {}: expected a mapping at the top level, got {}", origin, describe(root));
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
      throw_user("{}: unknown key '{}'; allowed at the top level: {} (use section.key=value)", where,
                 key, fmt::join(keys_of(cfg), ", "));
    }
    where_from.overrides[key] = ov;
  }
  validate_config(cfg, where_from);
  return cfg;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  if (path.empty()) return parse_config("", "(defaults)", overrides);
  std::ifstream f(path);
  if (!f) {
    throw_user("config file '{}' {}", path,
               files::exists(path) ? "cannot be read" : "does not exist");
  }
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_config(ss.str(), path, overrides);
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
