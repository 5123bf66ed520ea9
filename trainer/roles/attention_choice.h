// Which attention path the drafter runs: drafter.attention (auto | kernel | sdpa) resolved
// against this binary and this rank's device, once, in the run plan (trainer/roles/plan.h).
//
// Owns the one place where drafter.attention is turned into a backend (config.cpp only checks
// that the value is one of the three words):
//   auto    the block-sparse CUDA kernel when it is built into this binary, the device is CUDA
//           with compute capability 8.x or 9.0 (the kernel's mma.sync / wgmma code) and the head
//           dim is 64 or 128 (its tiles); else the SDPA reference path, saying why
//   kernel  the kernel, or a UserError naming the key and what is missing (exit 2)
//   sdpa    the reference path (the oracle of the tests), whatever the device
// drafter.attention_backward (auto | split | fused) picks the kernel's backward, each the same bits in every run:
//   auto    (the default) fused where it runs and data.max_seq_len >= kFusedHintSeqLen, else split, silently
//   split   a dQ pass and a dK/dV pass; where the fused one would run and data.max_seq_len >= kFusedHintSeqLen,
//           `why` says that fused is faster there
//   fused   one pass, which needs the kernel, an sm_90 GPU with the sm_90a code built in and head_dim 128, else a
//           UserError naming the key and what is missing
// `why` is the one line rank 0 prints in the run header ("attention kernel (auto: ...)").
// Thread-safety: choose_attention is a pure function; device_facts queries the device (with
// probe_fused it makes that device current and puts the previous one back).
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include "attention/dflash_attention.h"
#include "trainer/config.h"

namespace dflash::roles {

// From this data.max_seq_len on, drafter.attention_backward=auto runs the fused backward where it runs (and a run with
// split says that fused is faster there): with its fixed-point dQ the fused pass takes the drafter's attention layer
// (fwd + bwd) from 83.9-85.3 to 77.2-78.3 ms at 1 x 40000 and the whole drafter step from 944.9 to 909.4 ms (3.9%);
// at 4 x 3072 the layer from 7.7-8.3 to 8.3-8.4 ms, the step level (494.8, 495.0 ms); on an H100 (bench/RESULTS.md
// 2026-12-07 13:59, 15:10).
constexpr int64_t kFusedHintSeqLen = 16384;

struct AttentionChoice {
  attention::Backend backend = attention::Backend::Reference;
  bool fused_backward = false;  // the fused backward (attention_backward fused, or auto at long documents)
  std::string why;  // "kernel (drafter.attention=auto: CUDA sm_90, kernel built)"
};

// What the choice depends on, gathered by device_facts() (tests pass their own).
struct DeviceFacts {
  bool kernel_built = false;
  bool cuda = false;
  int major = 0, minor = 0;  // compute capability (CUDA only)
  bool fused_backward = false;  // attention::fused_backward_available(128) on the device (probed on demand)
};

// The facts of `device` in this process: attention::kernel_available(), the compute capability of a
// CUDA device, and, with probe_fused, whether the fused backward's sm_90a code runs there (a tiny launch
// on that device: asked for only when drafter.attention_backward is fused).
DeviceFacts device_facts(const c10::Device& device, bool probe_fused = false);

// Resolves cfg.drafter.attention for a drafter with `head_dim` on a device with `facts`.
// UserError (naming the key and its origin) when kernel is asked for and cannot run.
AttentionChoice choose_attention(const Config& cfg, const DeviceFacts& facts, int64_t head_dim);

}  // namespace dflash::roles
