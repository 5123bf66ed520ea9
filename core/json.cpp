// Strict JSON reader (see target_json.h).
#include "core/json.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace dflash::json {

namespace {
constexpr int kMaxDepth = 256;

std::string found_desc(const Value& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return fmt::format("{} {}", Value::type_name(v.type()), s);
}
}  // namespace

class Parser {
 public:
  Parser(std::string_view text, const std::string& where) : s_(text), where_(where) {}

  Value parse_document() {
    skip_ws();
    Value v = parse_value(0);
    skip_ws();
    if (pos_ != s_.size()) fail("unexpected text after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw_user("{}: invalid JSON at byte {}: {}", where_, pos_, what);
  }
  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool eat(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect_literal(std::string_view lit) {
    if (s_.substr(pos_, lit.size()) != lit) fail(fmt::format("expected '{}'", lit));
    pos_ += lit.size();
  }

  Value parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 256");
    if (pos_ >= s_.size()) fail("unexpected end of text");
    Value v;
    char c = s_[pos_];
    if (c == '{') {
      v.type_ = Value::Type::Object;
      ++pos_;
      skip_ws();
      if (eat('}')) return v;
      while (true) {
        skip_ws();
        if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string key");
        std::string key = parse_string();
        for (const auto& kv : v.object_)
          if (kv.first == key) fail(fmt::format("duplicate key \"{}\"", key));
        skip_ws();
        if (!eat(':')) fail("expected ':'");
        skip_ws();
        Value member = parse_value(depth + 1);
        v.object_.emplace_back(std::move(key), std::move(member));
        skip_ws();
        if (eat(',')) continue;
        if (eat('}')) break;
        fail("expected ',' or '}'");
      }
    } else if (c == '[') {
      v.type_ = Value::Type::Array;
      ++pos_;
      skip_ws();
      if (eat(']')) return v;
      while (true) {
        skip_ws();
        v.array_.push_back(parse_value(depth + 1));
        skip_ws();
        if (eat(',')) continue;
        if (eat(']')) break;
        fail("expected ',' or ']'");
      }
    } else if (c == '"') {
      v.type_ = Value::Type::String;
      v.text_ = parse_string();
    } else if (c == 't') {
      expect_literal("true");
      v.type_ = Value::Type::Bool;
      v.bool_ = true;
    } else if (c == 'f') {
      expect_literal("false");
      v.type_ = Value::Type::Bool;
    } else if (c == 'n') {
      expect_literal("null");
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      v.type_ = Value::Type::Number;
      v.text_ = parse_number();
    } else {
      fail(fmt::format("unexpected character '{}'", c));
    }
    return v;
  }

  std::string parse_number() {
    size_t start = pos_;
    auto digit = [&] { return pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9'; };
    eat('-');
    if (!digit()) fail("expected a digit");
    if (s_[pos_] == '0') {
      ++pos_;
    } else {
      while (digit()) ++pos_;
    }
    if (eat('.')) {
      if (!digit()) fail("expected a digit after '.'");
      while (digit()) ++pos_;
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      if (!eat('+')) eat('-');
      if (!digit()) fail("expected a digit in the exponent");
      while (digit()) ++pos_;
    }
    return std::string(s_.substr(start, pos_ - start));
  }

  unsigned hex4() {
    if (pos_ + 4 > s_.size()) fail("truncated \\u escape");
    unsigned u = 0;
    for (int i = 0; i < 4; ++i) {
      char h = s_[pos_++];
      u <<= 4;
      if (h >= '0' && h <= '9') u |= unsigned(h - '0');
      else if (h >= 'a' && h <= 'f') u |= unsigned(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') u |= unsigned(h - 'A' + 10);
      else fail("bad hex digit in \\u escape");
    }
    return u;
  }

  static void put_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xC0 | (cp >> 6));
      out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += char(0xE0 | (cp >> 12));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    } else {
      out += char(0xF0 | (cp >> 18));
      out += char(0x80 | ((cp >> 12) & 0x3F));
      out += char(0x80 | ((cp >> 6) & 0x3F));
      out += char(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string() {
    ++pos_;  // opening quote
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') break;
      if (c < 0x20) fail("control character in string");
      if (c != '\\') {
        out += char(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned cp = hex4();
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!(eat('\\') && eat('u'))) fail("unpaired surrogate in \\u escape");
            unsigned lo = hex4();
            if (lo < 0xDC00 || lo > 0xDFFF) fail("bad low surrogate in \\u escape");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
            fail("unpaired surrogate in \\u escape");
          }
          put_utf8(out, cp);
          break;
        }
        default: fail(fmt::format("bad escape '\\{}'", e));
      }
    }
    return out;
  }

  std::string_view s_;
  const std::string& where_;
  size_t pos_ = 0;
};

const char* Value::type_name(Type t) {
  switch (t) {
    case Type::Null: return "null";
    case Type::Bool: return "boolean";
    case Type::Number: return "number";
    case Type::String: return "string";
    case Type::Array: return "array";
    case Type::Object: return "object";
  }
  return "?";
}

bool Value::is_integer() const {
  return type_ == Type::Number && text_.find_first_of(".eE") == std::string::npos;
}

bool Value::as_bool(const std::string& what) const {
  if (type_ != Type::Bool) throw_user("{}: expected a boolean, found {}", what, found_desc(*this));
  return bool_;
}

double Value::as_double(const std::string& what) const {
  if (type_ != Type::Number) throw_user("{}: expected a number, found {}", what, found_desc(*this));
  return std::strtod(text_.c_str(), nullptr);
}

int64_t Value::as_int(const std::string& what) const {
  if (!is_integer()) throw_user("{}: expected an integer, found {}", what, found_desc(*this));
  errno = 0;
  long long v = std::strtoll(text_.c_str(), nullptr, 10);
  if (errno == ERANGE) throw_user("{}: integer {} out of range", what, text_);
  return v;
}

uint64_t Value::as_uint(const std::string& what) const {
  if (!is_integer() || text_[0] == '-')
    throw_user("{}: expected a non-negative integer, found {}", what, found_desc(*this));
  errno = 0;
  unsigned long long v = std::strtoull(text_.c_str(), nullptr, 10);
  if (errno == ERANGE) throw_user("{}: integer {} out of range", what, text_);
  return v;
}

const std::string& Value::as_string(const std::string& what) const {
  if (type_ != Type::String) throw_user("{}: expected a string, found {}", what, found_desc(*this));
  return text_;
}

const std::vector<Value>& Value::as_array(const std::string& what) const {
  if (type_ != Type::Array) throw_user("{}: expected an array, found {}", what, found_desc(*this));
  return array_;
}

const std::vector<std::pair<std::string, Value>>& Value::as_object(const std::string& what) const {
  if (type_ != Type::Object) throw_user("{}: expected an object, found {}", what, found_desc(*this));
  return object_;
}

const Value* Value::find(const std::string& key) const {
  if (type_ != Type::Object) return nullptr;
  for (const auto& kv : object_)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

std::string Value::dump() const {
  switch (type_) {
    case Type::Null: return "null";
    case Type::Bool: return bool_ ? "true" : "false";
    case Type::Number: return text_;
    case Type::String: return quote(text_);
    case Type::Array: {
      std::string s = "[";
      for (size_t i = 0; i < array_.size(); ++i) s += (i ? "," : "") + array_[i].dump();
      return s + "]";
    }
    case Type::Object: {
      std::string s = "{";
      for (size_t i = 0; i < object_.size(); ++i)
        s += (i ? "," : "") + quote(object_[i].first) + ":" + object_[i].second.dump();
      return s + "}";
    }
  }
  return "";
}

Value parse(std::string_view text, const std::string& where) {
  return Parser(text, where).parse_document();
}

Value parse_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_user("{}: cannot open for reading", path);
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) throw_user("{}: read error", path);
  return parse(ss.str(), path);
}

std::string quote(std::string_view s) {
  std::string out = "\"";
  for (char ch : s) {
    unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += ch;
    }
  }
  return out + "\"";
}

}  // namespace dflash::json
