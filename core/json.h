// A small strict JSON reader and string quoting, for safetensors headers, config.json and
// model.safetensors.index.json (the CI machine has no JSON library we may rely on).
//
// Owns: parsed JSON values (plain value types, copyable). Strict RFC 8259: no comments, no
// trailing commas, no NaN/Infinity, no duplicate object keys, nesting at most 256 deep, the
// whole text must be one value. Numbers keep their source text so that 64-bit integers (byte
// offsets) convert exactly. Errors are UserErrors naming `where` (a file name) and the byte
// offset. Thread-safety: stateless functions; values are immutable once parsed.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dflash::json {

class Value {
 public:
  enum class Type { Null, Bool, Number, String, Array, Object };

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::Null; }
  bool is_bool() const { return type_ == Type::Bool; }
  bool is_number() const { return type_ == Type::Number; }
  bool is_string() const { return type_ == Type::String; }
  bool is_array() const { return type_ == Type::Array; }
  bool is_object() const { return type_ == Type::Object; }
  // A number written without fraction or exponent.
  bool is_integer() const;

  // Accessors throw UserError("{what}: expected ..., found ...") on a type mismatch.
  bool as_bool(const std::string& what) const;
  double as_double(const std::string& what) const;
  int64_t as_int(const std::string& what) const;    // integer, fits int64
  uint64_t as_uint(const std::string& what) const;  // non-negative integer, fits uint64
  const std::string& as_string(const std::string& what) const;
  const std::vector<Value>& as_array(const std::string& what) const;
  const std::vector<std::pair<std::string, Value>>& as_object(const std::string& what) const;

  // Object member or nullptr (also nullptr when this is not an object).
  const Value* find(const std::string& key) const;

  static const char* type_name(Type t);
  // The JSON text of this value (compact), for error messages and round trips.
  std::string dump() const;

 private:
  friend class Parser;
  Type type_ = Type::Null;
  bool bool_ = false;
  std::string text_;  // string contents, or a number's source text
  std::vector<Value> array_;
  std::vector<std::pair<std::string, Value>> object_;
};

// Parses `text`; `where` names the source (a file) in error messages.
Value parse(std::string_view text, const std::string& where);
// Reads and parses a whole file (UserError naming it if unreadable).
Value parse_file(const std::string& path);

// `s` as a JSON string literal, with quotes and escapes.
std::string quote(std::string_view s);

}  // namespace dflash::json
