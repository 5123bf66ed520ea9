// AdamW with fp32 master weights and fp32 moments, global gradient-norm clipping, and the
// learning-rate schedule of DFLASH.md §3 (linear warm-up, then cosine to 0).
//
// Owns: per trainable parameter an fp32 master (the parameter itself when it is fp32, an fp32
// copy when it is bf16/fp16: the parameter is then overwritten by the rounded master after each
// update), exp_avg and exp_avg_sq (fp32, on the parameter's device), and the step count.
// The update is torch.optim.AdamW's single-tensor algorithm, operation for operation:
//   p *= 1 - lr*wd;  m = lerp(m, g, 1-b1);  v = b2*v + (1-b2)*g*g;
//   p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
// Gradients are taken in fp32 (a bf16 gradient converted), clipped like
// torch.nn.utils.clip_grad_norm_ (coef = max_norm/(norm+1e-6), clamped to 1), then applied.
// Gradient averaging across drafter ranks and accumulation are the caller's (roles/).
// Three implementations of the same update (DFLASH_OPTIM_FUSED=auto|0|1|aten, read at
// construction; auto: fused when every parameter is on one CUDA device, single-tensor otherwise):
//   - single-tensor (0): the ATen ops above, one tensor at a time (~10 passes over each tensor);
//     bit for bit torch.optim.AdamW(foreach=False) + clip_grad_norm_(foreach=False) on CPU;
//   - dflash kernels (auto/1 when every parameter is a contiguous CUDA tensor; adamw_kernels.h):
//     one multi-tensor launch for the gradients' sum of squares (read in their own dtype, no fp32
//     copy; per-chunk fp32 partial sums, then one block adds them in a fixed order: deterministic)
//     that leaves the norm and the clip coefficient on the device, one multi-tensor launch for the
//     update (grad * coef, the ops above in fp32 per element, master, m, v and the rounded bf16
//     parameter written in the same pass): ~30 bytes per bf16 parameter. Bias corrections come
//     from the step count on the host (kernel arguments). The gradients are left unclipped (the
//     other paths scale an fp32 gradient in place);
//   - ATen fused (aten; 1 and auto where the kernels do not apply): the fp32 gradients as one
//     _foreach_copy_ (buffers of this step only), their norms as one _foreach_norm, the update as
//     ATen's multi-tensor _fused_adamw_ over the fp32 masters (the kernel torch.optim.AdamW(fused=True)
//     runs) with the clip folded in as its gradient scale (g / (1/coef), a device scalar), the bf16
//     copies as one _foreach_copy_ (~44 bytes per bf16 parameter). Kept as the oracle of the
//     kernels' GPU test and the A/B of bench/gpu/fused.sh.
// Both fused forms are the same arithmetic in another order: within ~1e-7 relative of the
// single-tensor form per step (tests/optim/test_optim_reference.py runs the CPU ones,
// tests/optim/test_optim_gpu.cpp the kernels against aten and float64). Every form reads the host
// once per step(): the norm, after the update is queued.
// Thread-safety: one thread; the parameters must not be used concurrently with step().
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::optim {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

inline constexpr const char* kOptimFusedEnv = "DFLASH_OPTIM_FUSED";

struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

class AdamW {
 public:
  // `params`: trainable leaf tensors with unique names (fp32, bf16 or fp16; any device).
  AdamW(NamedTensors params, AdamWOptions opt);

  // Clips the global gradient norm to `max_norm` (<= 0: no clipping), then one update at `lr`.
  // Parameters without a gradient are skipped (as torch does). Returns the gradient norm
  // before clipping (fp32 computation, as torch's).
  double step(double lr, double max_norm);
  // Gradient norm only (no update); used for metrics when clipping is off.
  double grad_norm() const;
  void zero_grad();

  int64_t steps() const { return steps_; }
  // Which update runs (DFLASH_OPTIM_FUSED): fused() is true for both multi-tensor forms.
  enum class Impl { Single, Aten, Kernels };
  Impl impl() const { return impl_; }
  bool fused() const { return impl_ != Impl::Single; }
  const char* impl_name() const;
  const NamedTensors& params() const { return params_; }
  const AdamWOptions& options() const { return opt_; }

  // Optimizer state for a checkpoint: "exp_avg.<name>", "exp_avg_sq.<name>", and
  // "master.<name>" for parameters whose master is a separate fp32 copy.
  NamedTensors state() const;
  // Restores state() and the step count; `origin` (a file) names errors: a missing, unexpected
  // or misshapen tensor is a UserError listing them.
  void load_state(const NamedTensors& state, int64_t steps, const std::string& origin);

 private:
  struct Slot {
    at::Tensor master;  // fp32; same storage as the parameter when it is fp32
    at::Tensor exp_avg, exp_avg_sq;
    bool separate_master = false;
  };
  double step_kernels(double lr, double max_norm);
  void update_single(const std::vector<at::Tensor>& grads, double lr);
  void update_fused(const std::vector<at::Tensor>& grads, double lr, const at::Tensor& grad_scale);

  NamedTensors params_;
  std::vector<Slot> slots_;
  AdamWOptions opt_;
  int64_t steps_ = 0;
  Impl impl_ = Impl::Single;
  at::Tensor step_count_;  // Aten: the step as a float32 scalar on the parameters' device
  at::Tensor partials_;    // Kernels: per-chunk gradient sums of squares (float32)
  at::Tensor norm_coef_;   // Kernels: [norm, clip coefficient] (float32, on the device)
  at::Tensor norm_host_;   // Kernels: the norm, copied to pinned host memory before the update runs
};

// The learning rate at 0-based optimizer step s (DFLASH.md §3):
//   W = int(warmup_ratio * total); s < W: lr * (s + 1) / W;
//   else lr * 0.5 * (1 + cos(pi * (s - W) / (total - W)))   (lr when total == W).
struct LrSchedule {
  double lr = 0;
  int64_t total = 1;
  int64_t warmup = 0;
  static LrSchedule cosine(double lr, double warmup_ratio, int64_t total_steps);
  double at(int64_t step) const;
};

}  // namespace dflash::optim
