// Which run a resolved Config describes: the keys that make two configs "the same run", a hash
// of them, and the differences between two resolved configs (docs/training.md "Run directories").
//
// Owns the rule: a run is identified by every key of the resolved config except those that
// only change how it is watched or where it runs: the sections log, comm, checkpoint and eval, and
// run.name, run.dir (a moved directory is the same run), run.cpu_threads, run.overwrite,
// run.accept_changes, and the keys that pick how the same math runs: drafter.attention,
// drafter.attention_backward, drafter.loss_chunk (rounding and speed differ, the run does not). Two launches with the same
// identity are the same run (a requeued job auto-resumes); anything else is another run.
// Schedule keys are the identity keys that move the step count, the learning-rate schedule or
// the batch stream (train.max_steps, train.epochs, train.lr, train.warmup_ratio, run.seed,
// layout.*, train.grad_accum, data.*): changing them on --resume is refused unless accepted.
// Thread-safety: stateless functions.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "trainer/config.h"

namespace dflash {

// key -> value text of every leaf of a resolved config's YAML (lists in flow form "[a, b]").
std::map<std::string, std::string> flatten_config_yaml(const std::string& yaml, const std::string& origin);

// True for keys that belong to the run's identity / its schedule (see above).
bool is_identity_key(const std::string& key);
bool is_schedule_key(const std::string& key);

// "key: value" lines of the identity keys, sorted; and its 64-bit FNV-1a hash as 16 hex digits.
std::string identity_text(const std::map<std::string, std::string>& flat);
std::string identity_hash(const Config& cfg);
std::string identity_hash_of_yaml(const std::string& yaml, const std::string& origin);
// A resolved config recorded by an older build, parsed and resolved again by this one: keys added
// since take their defaults, so that a new key (at its default) does not make it another run. As
// written if this build refuses it (a removed key, a value no longer valid).
std::string reresolved_yaml(const std::string& yaml, const std::string& origin);

struct ConfigChange {
  std::string key, before, after;
};
// Identity keys whose values differ between two resolved configs (as YAML), sorted by key.
std::vector<ConfigChange> identity_changes(const std::string& before_yaml, const std::string& after_yaml,
                                           const std::string& origin);

}  // namespace dflash
