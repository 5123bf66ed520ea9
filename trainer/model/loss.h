// The DFlash training loss (DFLASH.md §2.4) on top of the target's frozen LM head, and the
// metrics derived from it.
//
// Owns: the fused linear + cross-entropy (an autograd Function) that applies the LM head in
// chunks of `chunk` positions so that the [positions, vocab] logits never exist for a whole step,
// the unfused equivalent (full logits, plain autograd; a check and a benchmark baseline), and the
// per-position accuracy and acceptance-length estimate τ.
//
// Loss = Σ_i coef_i · CE(logits_i, label_i), coef_i = w_i d_i / (Σ w d + 1e-6) (the caller passes
// coef). The LM head is frozen: no weight gradient is ever produced.
// Fused modes: GradInForward (default when the hidden states need a gradient) computes each
// chunk's logits once in the forward and, since the loss is a scalar end point, already the
// gradient of the hidden states (softmax - onehot)·coef @ W; the backward only scales it by the
// incoming scalar gradient. Recompute saves the hidden states and the log-sum-exp instead and
// recomputes each chunk's logits in the backward (2 more LM-head matmuls). Both hold at most one
// chunk of logits (in fp32) at a time.
// Per chunk the logits are one fp32 GEMM (bf16/fp16 inputs, fp32 output on CUDA). On CUDA with
// bf16/fp16 hidden states the work between that GEMM and the gradient GEMM is two kernels
// (model/ce_kernels.h): one read of the logits for lse, the weighted CE and argmax == label (ties:
// the smallest index, as torch.max), one read that writes (softmax - onehot)·coef in the hidden
// dtype, which the GEMM g @ W turns into the chunk's rows of the hidden gradient in place; no
// host read. Elsewhere (CPU, fp32), or with DFLASH_CE_FUSED=0 (read once; docs/environment.md),
// the same quantities come from ATen ops (the two agree within float32 rounding of the sums:
// tests/drafter/test_ce_gpu.cpp).
// τ (acceptance length estimate): per kept block with a label at offset 1, accepted = the
// number of leading offsets k = 1, 2, ... whose position has a label (w > 0) and whose argmax is
// right (the walk stops at the first miss or the first unlabelled position, e.g. the document's
// end); τ_block = 1 + accepted. The sums kept are Σ τ_block and Σ 1/τ_block over those blocks.
// Why both: the blocks sit at uniformly random anchors, so the plain mean of τ_block weighs every
// POSITION alike, while serving weighs every STEP alike, and a step that accepts r tokens skips
// the next r − 1 positions: well-predicted stretches are counted r times per step in the mean.
// Serving visits a position with density about 1/τ_block there, so served τ ≈ the harmonic mean
// N / Σ 1/τ_block (exact where the acceptance is locally constant, slightly below elsewhere);
// that is the training estimate reported (tau_est), the plain mean only beside it
// (docs/training.md "tau_est"). Both measure DFLASH.md §6's τ (accepted drafts + 1) under greedy
// verification on the training targets.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model {

enum class CeMode { GradInForward, Recompute };

// The per-chunk elementwise work of fused_linear_ce. Auto: the CUDA kernels where available
// (ce_cuda_available) unless DFLASH_CE_FUSED=0, else ATen; Aten: always the ATen ops; Cuda:
// always the CUDA kernels (a check failure where not available). For tests and benchmarks.
enum class CeImpl { Auto, Aten, Cuda };

inline constexpr const char* kCeFusedEnv = "DFLASH_CE_FUSED";
// The CUDA kernels' logits dtype: "fp32" (default) or "bf16" (the hidden states' 16-bit dtype:
// half the logits traffic, the rounding of the Python reference's bf16 LM head).
inline constexpr const char* kCeLogitsEnv = "DFLASH_CE_LOGITS";

// Whether the CUDA kernels can serve these hidden states: a CUDA build, a CUDA tensor, bf16 or fp16.
bool ce_cuda_available(const at::Tensor& hidden);

struct CeResult {
  at::Tensor loss;     // scalar float32, differentiable w.r.t. hidden
  at::Tensor correct;  // [M] bool: argmax == label (no gradient)
};

// hidden [M, H] (any float dtype), weight [V, H] (same dtype, frozen), labels [M] int64,
// coef [M] float32. chunk > 0. labels and coef on hidden's device.
CeResult fused_linear_ce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         const at::Tensor& coef, int64_t chunk, CeMode mode = CeMode::GradInForward,
                         CeImpl impl = CeImpl::Auto);

// The same numbers with full logits and autograd (memory: M x V floats).
CeResult plain_linear_ce(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                         const at::Tensor& coef);

// d_k = exp(-(k-1)/γ) for k = 0..bs-1 (k = 0 carries no weight anyway), float32 [bs].
at::Tensor decay(int64_t block_size, double gamma);

struct BlockMetrics {
  std::vector<double> correct_per_pos;  // [bs]
  std::vector<double> count_per_pos;    // [bs]
  double tau_sum = 0;      // Σ over measured blocks of 1 + accepted
  double tau_inv_sum = 0;  // Σ over measured blocks of 1 / (1 + accepted)
  int64_t tau_blocks = 0;
};

// correct, valid: [B, N, bs] bool (correct only meaningful where valid).
BlockMetrics block_metrics(const at::Tensor& correct, const at::Tensor& valid);

}  // namespace dflash::model
