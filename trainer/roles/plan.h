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

#include "comm/schedule.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config.h"
#include "trainer/data/dataset.h"
#include "trainer/model/drafter.h"
#include "trainer/model/hf_config.h"

namespace dflash::roles {

// Message kinds on the target -> drafter stream.
constexpr int32_t kBatchMessage = 1;
// A batch message carries: ids [T] int64, loss_mask [T] uint8, cu_seqlens [n+1] int64,
// features [T, K*H], stats [4] float64 = {tokens, target busy seconds, target wait seconds, 1 if the
// target was signalled to stop (roles/preempt.h) else 0}.
constexpr int kNumBatchTensors = 5;

struct RunPlan {
  std::shared_ptr<data::Dataset> data;
  model::HfConfig target_config;
  model::TargetInfo target_info;
  model::DrafterSpec spec;
  std::vector<int64_t> layer_ids;  // captured target layers (the spec's target_layer_ids)
  double gamma = 0;

  int64_t target_ranks = 1, drafter_ranks = 1;
  bool colocated = false;
  int64_t grad_accum = 1;
  int64_t batches_per_step = 1;  // G = D x grad_accum
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

  // Batches of step s trained by drafter index j, in increasing order.
  std::vector<int64_t> drafter_step_batches(int64_t step, int64_t j) const;
};

// Resolves the plan; UserError (on every rank, since every rank calls it) for bad data, a
// drafter config that does not fit the target, data too small for one step, a resume state of
// another layout, or --resume with no state.
RunPlan make_plan(const Config& cfg, const comm::Schedule& schedule, int world_size, int gpu, bool resume);

// Approximate FLOPs of one drafter forward+backward on a row of S context tokens and Q = N x bs
// draft positions (docs/training.md "MFU"): 3 x forward, forward = fc + per-layer projections,
// attention over S + Q keys, SwiGLU MLP, and the LM head.
double drafter_step_flops(const model::DrafterSpec& spec, int64_t S, int64_t Q);

}  // namespace dflash::roles
