// Numbers from command-line text (see parse.h).
#include "core/parse.h"

#include <cstdlib>
#include <stdexcept>

#include "core/error.h"

namespace dflash {

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = text.find(',', i);
    if (j == std::string::npos) j = text.size();
    std::string tok = text.substr(i, j - i);
    try {
      size_t used = 0;
      out.push_back(std::stoll(tok, &used));
      if (used != tok.size()) throw std::invalid_argument(tok);
    } catch (const std::exception&) {
      throw_user("{}: '{}' is not an integer", what, tok);
    }
    i = j + 1;
  }
  return out;
}

int64_t parse_int(const std::string& text, const std::string& what) {
  std::vector<int64_t> v = parse_int_list(text, what);
  if (v.size() != 1) throw_user("{}: '{}' is not an integer", what, text);
  return v[0];
}

std::string env_choice(const char* name, const char* fallback, const std::vector<std::string>& choices) {
  const char* e = std::getenv(name);
  std::string v = e ? e : fallback, list;
  size_t i = 0;
  for (const std::string& c : choices) {
    if (v == c) return v;
    list += (i == 0 ? "" : (i + 1 == choices.size() ? " or " : ", ")) + c;
    ++i;
  }
  throw_user("{}={}: expected {}", name, v, list);
}

}  // namespace dflash
