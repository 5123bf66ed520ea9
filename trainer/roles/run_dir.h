// Run directories that cannot be mixed up (docs/training.md "Run directories").
//
// Owns: <run.dir>/run.json, the record of which run a directory belongs to (run id, the
// identity hash of its resolved config (trainer/config/identity.h), that config as YAML, the code
// version, a history of launches), <run.dir>/run.lock (held by world rank 0 while a launch
// runs, so that two launches never write the same directory), and the decision a launch makes
// from what it finds there:
//   - nothing of a run (no state, metrics.jsonl or export; a run.json alone, left by a launch
//     that failed before its first step, does not count): a new run;
//   - run.overwrite=true: a new run; the old run.json, checkpoints/, exports/, metrics.jsonl go;
//   - --resume: continue from the newest complete state; refused if an identity key changed
//     (naming each change) unless run.accept_changes=true (the consequence is logged);
//   - no flag, run.json of the same identity hash: the same run launched again (a requeued job):
//     auto-resume from its newest complete state, or start it from step 0 if it has none;
//   - no flag, anything else: refused, saying how to resume (--resume) or where to start instead.
// At start, stale checkpoints/*.tmp and exports/*.tmp / *.old directories are removed.
// Thread-safety: call from the rank's main thread.
#pragma once

#include <string>
#include <vector>

#include "trainer/config.h"
#include "trainer/config/identity.h"
#include "trainer/roles/plan.h"

namespace dflash::roles {

struct RunDirDecision {
  enum class Kind { New, Overwrite, SameRunRestart, AutoResume, Resume };
  Kind kind = Kind::New;
  bool resume = false;                 // make_plan's `resume`
  std::string run_id;                  // empty for a new run (world rank 0 creates one)
  std::string created;                 // of the existing run
  std::vector<std::string> history;    // of the existing run.json
  std::vector<ConfigChange> accepted;  // identity changes taken with run.accept_changes
  std::string before_yaml;             // the run's config before this launch ("" if none)
  std::string overwrite_ignored;       // why run.overwrite=true was not applied ("" if it was or unset)
};

// Every rank, before make_plan; reads only. UserError (one line) when the launch is refused.
// run.overwrite=true is not applied in a requeued SLURM job (SLURM_RESTART_COUNT > 0) whose
// directory holds a state of this same run: the job auto-resumes (one that started over at
// every requeue would never finish).
RunDirDecision inspect_run_dir(const Config& cfg, bool resume_flag);

// World rank 0 only, after every rank's plan succeeded: creates run.dir, takes run.lock (a
// UserError if another launch holds it), deletes the old run with run.overwrite, removes stale
// .tmp directories, writes run.json, and logs what it decided.
void prepare_run_dir(const Config& cfg, const RunDirDecision& d, const RunPlan& plan);

}  // namespace dflash::roles
