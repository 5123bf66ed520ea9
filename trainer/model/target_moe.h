// Sparse mixture-of-experts MLP of the qwen3_moe and qwen3_5_moe targets: a softmax router over
// num_experts, the top-k experts per token (optionally renormalised), experts as SwiGLU MLPs,
// and (qwen3_5_moe) a shared SwiGLU expert scaled by sigmoid(shared_expert_gate(x)).
//
// Token dispatch: the T * k (token, expert) pairs are sorted by expert (a stable sort, so the
// order inside an expert is token order); each projection is then one grouped GEMM over the
// per-expert row ranges (CUDA bf16: at::_grouped_mm) or one matmul per non-empty expert (CPU and
// other dtypes); the k results of a token are summed in routing order. No per-token loop.
//
// Owns: the expert weights of one layer (stacked [E, ...], on one device). Thread-safety: const
// after load.
#pragma once

#include <cstdint>

#include <ATen/core/Tensor.h>

namespace dflash::model {

struct MoeWeights {
  at::Tensor router;          // [E, H]
  at::Tensor w_gate_up;       // [E, 2 I, H]  (gate rows first, then up)
  at::Tensor w_down;          // [E, H, I]
  // Shared expert (undefined if none).
  at::Tensor shared_gate_up;  // [2 Is, H]
  at::Tensor shared_down;     // [H, Is]
  at::Tensor shared_gate;     // [1, H]
};

struct MoeSpec {
  int64_t top_k = 0;
  bool norm_topk_prob = false;
};

// Environment knob: "grouped" (default; at::_grouped_mm on CUDA bf16) or "loop" (one matmul per
// expert, the CPU path) for the expert projections. Read once per process.
constexpr const char* kMoeBackendEnv = "DFLASH_TARGET_MOE";

// x [T, H] -> [T, H] (x's dtype).
at::Tensor moe_forward(const at::Tensor& x, const MoeWeights& w, const MoeSpec& spec);

}  // namespace dflash::model
