// What a run tells its user and records about itself (internal to trainer/roles/):
//   - the header printed once by rank 0 at start: code version, launch, layout, target, drafter,
//     data (with its preparation record), and where the run directory, metrics, TensorBoard
//     events, checkpoints and exports are;
//   - the data's preparation record: every prepare_info.json next to data.shards (written by
//     tools/prepare_data.py), copied into <run.dir>/prepare_info.json and, in summary, into each
//     export's config.json ("dflash_data"), with the target's identity ("dflash_target");
//   - the lines printed at the end: where the export is, and the commands that check, evaluate
//     and serve it (SGLang / vLLM flags of DFLASH.md §6).
// Thread-safety: plain functions of immutable inputs.
#pragma once

#include <string>
#include <vector>

#include "trainer/roles/startup.h"
#include "trainer/config.h"
#include "trainer/model/export.h"
#include "trainer/roles/plan.h"

namespace dflash::roles {

// The header lines (without the log prefix).
std::vector<std::string> run_header(const Config& cfg, const RankContext& ctx, const RunPlan& plan);

// The prepare_info.json files of the configured shards (a shard file's directory, or a shard
// directory), deduplicated, in data.shards order.
std::vector<std::string> prepare_info_files(const Config& cfg);
// Writes <run.dir>/prepare_info.json: the one record as it is, several as a JSON list; nothing
// without a record.
void copy_data_record(const Config& cfg);
// The fields an export records (model/export.h ExportRecord).
model::ExportRecord export_record(const Config& cfg, const RunPlan& plan);

// The closing lines after the final export to `export_dir`.
std::vector<std::string> finish_lines(const Config& cfg, const RunPlan& plan, const std::string& export_dir);

}  // namespace dflash::roles
