// The drafter's products and row selection with hand-written backwards (drafter_ops.cpp), used
// by Drafter's forward (drafter.cpp). The RoPE / SwiGLU / q-k norm functions, which tests call
// too, are declared in drafter.h and defined beside these.
//
// Each computes what autograd would through at::linear / index_select, with fewer passes in the
// backward: the input gradients of products that read one input accumulate in the GEMMs (beta 1)
// instead of separate [rows, H] additions; selected rows scatter back by a gather.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model {

// Rows `sel` (sorted, unique, int64) of x [R, H]; inv [R] int64: the position of each row in sel,
// or sel.size(0) for a row not selected. The backward gathers from [g; 0] with inv.
at::Tensor select_rows(const at::Tensor& x, const at::Tensor& sel, const at::Tensor& inv);

// A layer's q, k and v before their norms: {h wq^T, [ctx; h] wk^T, [ctx; h] wv^T}, h [B, Q, H],
// context [B, S, H] (concatenated along the sequence). The backward returns d_ctx and d_h as views
// of one [B, S + Q, H] buffer = dk wk + dv wv with dq wq added into its block rows.
std::vector<at::Tensor> attn_projections(const at::Tensor& context, const at::Tensor& h, const at::Tensor& wq,
                                         const at::Tensor& wk, const at::Tensor& wv);

// {x wa^T, x wb^T} (x [..., K]); the backward's dx = dya wa + dyb wb in two GEMMs, the second
// accumulating into the first's output.
std::vector<at::Tensor> linear_pair(const at::Tensor& x, const at::Tensor& wa, const at::Tensor& wb);

}  // namespace dflash::model
