// Sparse MoE MLP (see target_moe.h).
#include "trainer/model/target_moe.h"

#include <string>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/parse.h"
#include "trainer/model/target_ops.h"

namespace dflash::model {

namespace {

bool grouped_backend() {
  static const bool grouped = env_choice(kMoeBackendEnv, "grouped", {"grouped", "loop"}) == "grouped";
  return grouped;
}

// SwiGLU of x [N, H] through gate_up [2I, H] and down [H, I].
at::Tensor swiglu(const at::Tensor& x, const at::Tensor& gate_up, const at::Tensor& down) {
  return at::mm(ops::silu_mul(at::mm(x, gate_up.t()), down.size(1)), down.t());
}

}  // namespace

at::Tensor moe_forward(const at::Tensor& x, const MoeWeights& w, const MoeSpec& spec) {
  const int64_t T = x.size(0), H = x.size(1), E = w.router.size(0), k = spec.top_k;
  // Router, as transformers: logits in the model dtype, softmax in float32, top-k,
  // renormalisation in float32, then the weights back in the model dtype.
  at::Tensor probs = at::softmax(at::mm(x, w.router.t()), -1, at::kFloat);
  auto [topv, topi] = at::topk(probs, k, -1);
  if (spec.norm_topk_prob) topv = topv / topv.sum(-1, /*keepdim=*/true);
  topv = topv.to(x.scalar_type());

  // (token, expert) pairs sorted by expert; a token's pairs are rows t*k .. t*k+k-1 unsorted.
  at::Tensor flat = topi.reshape({-1});
  at::Tensor order = at::argsort(flat, /*stable=*/true);
  at::Tensor rows = x.index_select(0, at::floor_divide(order, k));  // [T k, H]
  at::Tensor counts = at::bincount(flat, {}, E);
  at::Tensor y;
  const bool grouped = x.is_cuda() && x.scalar_type() == at::kBFloat16 && grouped_backend();
  if (grouped) {
    // One grouped GEMM per projection; no host synchronisation.
    at::Tensor offs = at::cumsum(counts, 0, at::kInt);
    at::Tensor gu = at::_grouped_mm(rows, w.w_gate_up.transpose(1, 2), offs);
    y = at::_grouped_mm(ops::silu_mul(gu, w.w_down.size(2)), w.w_down.transpose(1, 2), offs);
  } else {
    y = at::empty({T * k, H}, x.options());
    at::Tensor c = counts.to(at::kCPU);
    const int64_t* cp = c.data_ptr<int64_t>();
    for (int64_t e = 0, s = 0; e < E; s += cp[e], ++e) {
      if (cp[e] == 0) continue;
      y.narrow(0, s, cp[e]).copy_(swiglu(rows.narrow(0, s, cp[e]), w.w_gate_up[e], w.w_down[e]));
    }
  }
  y.mul_(topv.reshape({-1}).index_select(0, order).unsqueeze(1));
  at::Tensor unsorted = at::empty_like(y);
  unsorted.index_copy_(0, order, y);
  at::Tensor out = unsorted.view({T, k, H}).sum(1);
  if (w.shared_gate_up.defined()) {
    at::Tensor gate = at::sigmoid(at::mm(x, w.shared_gate.t()));  // [T, 1]
    out.add_(gate * swiglu(x, w.shared_gate_up, w.shared_down));
  }
  return out;
}

}  // namespace dflash::model
