// Numbers from command-line text: a comma-separated list of integers ("2,0,151645"), one integer.
// Bad text is a user error naming `what` (e.g. "--stop-ids") and the part that is not a number.
// The value of an environment knob among fixed choices.
//
// Owns nothing; stateless. Thread-safety: any.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash {

// "1,2,3" -> {1, 2, 3}; "" -> {}; a part that is not a whole integer (e.g. "1,x", "2.5", "1,,2")
// throws UserError "<what>: '<part>' is not an integer".
std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what);

// Exactly one integer; else UserError "<what>: '<text>' is not an integer".
int64_t parse_int(const std::string& text, const std::string& what);

// The environment variable `name`, or `fallback` when unset; a value not in `choices` throws
// UserError "<name>=<value>: expected a, b or c".
std::string env_choice(const char* name, const char* fallback, const std::vector<std::string>& choices);

}  // namespace dflash
