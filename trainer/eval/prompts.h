// The prompts file of an evaluation: JSONL, one pre-tokenised prompt per line,
//   {"input_ids": [151644, 872, ...]}            (optional "id": a string or integer label)
// as tools/prepare_prompts.py writes it (chat JSONL rendered with the target's chat template,
// add_generation_prompt=True). Chat lines ({"messages": [...]}) need a tokenizer, which the C++
// side does not have: they are rejected with the exact command that renders them. Blank lines
// are skipped.
//
// Owns: parsing and validation; every error is a UserError naming the file, the 1-based line and
// the field (not JSON, not an object, missing/empty/non-integer input_ids, an id outside the
// vocabulary, a prompt that does not leave max_new_tokens of room in the model's context).
// Thread-safety: stateless.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::eval {

struct Prompt {
  std::vector<int64_t> ids;
  std::string label;  // "id" field, or the line number
  int64_t line = 0;   // 1-based line of the file
};

struct PromptLimits {
  int64_t vocab_size = 0;        // ids must be in [0, vocab_size)
  int64_t max_positions = 0;     // prompt + max_new_tokens must fit (<= 0: unchecked)
  int64_t max_new_tokens = 0;
  std::string context_source;    // names where max_positions comes from (messages)
  std::string target_dir = "TARGET_DIR";  // for the prepare_prompts.py command of the chat message
};

// Reads `path`; `max_prompts` > 0 keeps only the first that many. At least one prompt.
std::vector<Prompt> read_prompts(const std::string& path, const PromptLimits& limits, int64_t max_prompts = 0);

}  // namespace dflash::eval
