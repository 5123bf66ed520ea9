// The plan of a training run, resolved identically on every rank from the config, the target's
// config.json, the data and (with --resume) the latest complete state.
//
// Owns: the numbers every rank must agree on without talking: batches per optimizer step
// G = D x grad_accum, the total number of steps and batches, the first step and batch (0, or
// the resumed state's cursor), the captured layer ids, the drafter's spec, and the run
// signature that guards resumes. Also the per-rank device/dtype choice and the FLOP model used
// for MFU. Thread-safety: a RunPlan is an immutable value after make_plan().
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config.h"
#include "trainer/data/dataset.h"
#include "trainer/model/drafter.h"
#include "trainer/model/hf_config.h"
#include "trainer/roles/schedule.h"

namespace dflash::roles {

struct RunPlan {
  std::shared_ptr<data::Dataset> data;
  model::HfConfig target_config;
  model::TargetInfo target_info;
  model::DrafterSpec spec;
  std::vector<int64_t> layer_ids;  // captured target layers (the spec's target_layer_ids)
  double gamma = 0;

  int64_t target_ranks = 1, drafter_ranks = 1;  // the schedule's targets() and drafters()
  bool colocated = false;
  int64_t grad_accum = 1;
  int64_t batches_per_step = 1;  // G = D x grad_accum (Schedule::batches_per_step)
  int64_t total_steps = 0;
  int64_t total_batches = 0;     // total_steps x G
  int64_t start_step = 0;
  int64_t start_batch = 0;       // start_step x G

  ckpt::RunSignature signature;
  std::optional<ckpt::StateMeta> resume;
  std::string resume_dir;

  at::Device device = at::kCPU;
  at::ScalarType target_dtype = at::kFloat;
  at::ScalarType drafter_dtype = at::kFloat;
};

// Resolves the plan; UserError (on every rank, since every rank calls it) for bad data, a
// drafter config that does not fit the target, data too small for one step, a resume state of
// another layout, or --resume with no state.
RunPlan make_plan(const Config& cfg, const Schedule& schedule, int world_size, int gpu, bool resume);

// Approximate FLOPs of one drafter forward+backward on a row of S context tokens and Q = N x bs
// draft positions (docs/training.md "MFU"): 3 x forward, forward = fc + per-layer projections,
// attention over S + Q keys, SwiGLU MLP, and the LM head.
double drafter_step_flops(const model::DrafterSpec& spec, int64_t S, int64_t Q);

}  // namespace dflash::roles
