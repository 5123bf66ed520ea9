// trainer/eval/prompts.h: the JSONL prompts file of an evaluation.
#include "trainer/eval/prompts.h"

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"

namespace dflash::eval {

std::vector<Prompt> read_prompts(const std::string& path, const PromptLimits& lim, int64_t max_prompts) {
  if (path.empty()) throw_user("eval.prompts is not set (a JSONL file of {{\"input_ids\": [...]}} lines)");
  if (!files::exists(path)) throw_user("eval.prompts: {} does not exist", path);
  const std::string text = files::read_file(path);
  std::vector<Prompt> out;
  size_t pos = 0;
  int64_t line = 0;
  while (pos < text.size() && (max_prompts <= 0 || int64_t(out.size()) < max_prompts)) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string s = text.substr(pos, end - pos);
    pos = end + 1;
    ++line;
    if (s.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line);
    json::Value v;
    try {
      v = json::parse(s, where);
    } catch (const UserError& e) {
      throw_user("{}: not a JSON line ({})", where, e.what());
    }
    if (!v.is_object()) throw_user("{}: expected a JSON object {{\"input_ids\": [...]}}, got {}", where,
                                   json::Value::type_name(v.type()));
    const json::Value* ids = v.find("input_ids");
    if (!ids) {
      if (v.find("messages") || v.find("conversations"))
        throw_user("{}: a chat prompt (field 'messages'); dflash_rank has no tokenizer. Render the file with the "
                   "target's chat template first: python tools/prepare_prompts.py --model {} --in {} "
                   "--out PROMPTS.jsonl, then set eval.prompts=PROMPTS.jsonl", where, lim.target_dir, path);
      throw_user("{}: missing field 'input_ids' (a list of token ids)", where);
    }
    if (!ids->is_array()) throw_user("{}: field 'input_ids' must be a list of token ids, got {}", where,
                                     json::Value::type_name(ids->type()));
    Prompt p;
    p.line = line;
    for (const auto& t : ids->as_array(where)) {
      if (!t.is_integer())
        throw_user("{}: field 'input_ids' holds {}, expected integer token ids", where, t.dump());
      int64_t id = t.as_int(where + ": field 'input_ids'");
      if (id < 0 || id >= lim.vocab_size)
        throw_user("{}: field 'input_ids' holds {}, outside the target's vocabulary [0, {})", where, id,
                   lim.vocab_size);
      p.ids.push_back(id);
    }
    if (p.ids.empty()) throw_user("{}: field 'input_ids' is empty", where);
    if (lim.max_positions > 0 && int64_t(p.ids.size()) + lim.max_new_tokens > lim.max_positions)
      throw_user("{}: field 'input_ids' has {} tokens; with eval.max_new_tokens {} that is {} positions, more than "
                 "the model's context of {} ({})", where, p.ids.size(), lim.max_new_tokens,
                 int64_t(p.ids.size()) + lim.max_new_tokens, lim.max_positions, lim.context_source);
    if (const json::Value* id = v.find("id")) {
      if (id->is_string()) p.label = id->as_string(where);
      else if (id->is_integer()) p.label = std::to_string(id->as_int(where));
      else throw_user("{}: field 'id' must be a string or an integer, got {}", where, id->dump());
    } else {
      p.label = "line " + std::to_string(line);
    }
    out.push_back(std::move(p));
  }
  if (out.empty()) throw_user("eval.prompts: {} holds no prompts", path);
  return out;
}

}  // namespace dflash::eval
