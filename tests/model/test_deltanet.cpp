// The Gated DeltaNet pieces of trainer/model/target_deltanet.h against independent references,
// CPU float64 (so the only differences are rounding: tolerance 1e-9 relative; a wrong block,
// sign or missed term is O(1)):
//  - unit_lower_inverse against at::linalg_solve_triangular(t, I, unitriangular) for power-of-two
//    and odd sizes, with junk on and above the diagonal (it must not be read);
//  - gated_delta_rule_chunked (the default inverse path) against the rule token by token as the
//    header states it (S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q), with an
//    initial state, lengths that are not a multiple of the chunk, and padded positions;
//  - gated_delta_rule_recurrent (CPU: its ATen form; the CUDA kernel is test_deltanet_gpu's) on
//    heads-first grids with per-document lengths against the same token-by-token rule.
// The transformers comparison of the whole layer is tests/model/test_target_qwen35.py.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "trainer/model/target_deltanet.h"

using namespace dflash::model;

namespace {

double rel(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / std::max(1e-300, b.abs().max().item<double>());
}

TEST(UnitLowerInverse, MatchesTriangularSolve) {
  at::manual_seed(3);
  for (int64_t n : {1, 2, 3, 7, 16, 50, 64}) {
    at::Tensor t = at::rand({3, 5, n, n}, at::kDouble) * 2 - 1;  // junk everywhere, |entries| <= 1
    at::Tensor eye = at::eye(n, at::kDouble).expand({3, 5, n, n});
    at::Tensor ref = at::linalg_solve_triangular(t, eye, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
    at::Tensor got = unit_lower_inverse(t);
    ASSERT_EQ(got.sizes(), t.sizes());
    EXPECT_LT(rel(got, ref), 1e-9) << "n = " << n;
    // and it is an inverse of I + strictly_lower(t)
    at::Tensor lt = at::eye(n, at::kDouble) + t.tril(-1);
    EXPECT_LT(rel(at::matmul(lt, got), eye), 1e-9) << "n = " << n;
  }
}

TEST(GatedDeltaRule, ChunkedMatchesTokenByToken) {
  at::manual_seed(5);
  const int64_t B = 2, nv = 3, dk = 8, dv = 6;
  for (int64_t L : {1, 5, 64, 75, 130}) {
    for (int64_t C : {16, 64, 128}) {
      auto o = at::TensorOptions().dtype(at::kDouble);
      at::Tensor q = at::randn({B, L, nv, dk}, o), k = at::randn({B, L, nv, dk}, o);
      k = k / k.norm(2, -1, true);
      at::Tensor v = at::randn({B, L, nv, dv}, o);
      at::Tensor g = -at::rand({B, L, nv}, o) * 0.5, beta = at::rand({B, L, nv}, o);
      // the last 3 positions of row 1 are padding (k = v = g = beta = 0)
      if (L > 3) {
        for (auto* x : {&k, &v, &g, &beta}) x->select(0, 1).narrow(0, L - 3, 3).zero_();
      }
      at::Tensor S0 = at::randn({B, nv, dk, dv}, o) * 0.1;
      auto [out, S] = gated_delta_rule_chunked(q, k, v, g, beta, std::min(C, L), S0);
      // token by token
      at::Tensor s = S0.clone(), ref = at::empty({B, L, nv, dv}, o);
      for (int64_t t = 0; t < L; ++t) {
        at::Tensor kt = k.select(1, t), vt = v.select(1, t), qt = q.select(1, t);  // [B, nv, d]
        s = s * g.select(1, t).exp().unsqueeze(-1).unsqueeze(-1);
        at::Tensor pred = at::matmul(s.transpose(-1, -2), kt.unsqueeze(-1)).squeeze(-1);  // S^T k [B, nv, dv]
        at::Tensor delta = beta.select(1, t).unsqueeze(-1) * (vt - pred);
        s = s + kt.unsqueeze(-1) * delta.unsqueeze(-2);
        ref.select(1, t).copy_(at::matmul(s.transpose(-1, -2), qt.unsqueeze(-1)).squeeze(-1));
      }
      EXPECT_LT(rel(out, ref), 1e-9) << "L = " << L << ", chunk " << C;
      EXPECT_LT(rel(S, s), 1e-9) << "L = " << L << ", chunk " << C;
    }
  }
}

// The rule token by token as the header states it, for one sequence and head: q, k [L, dk], v
// [L, dv], g, beta [L], s [dk, dv] (updated). Returns o [L, dv].
at::Tensor token_by_token(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor& s) {
  at::Tensor o = at::empty({q.size(0), v.size(1)}, q.options());
  for (int64_t t = 0; t < q.size(0); ++t) {
    s = s * g[t].exp();
    at::Tensor delta = beta[t] * (v[t] - at::matmul(s.t(), k[t]));
    s = s + at::outer(k[t], delta);
    o[t].copy_(at::matmul(s.t(), q[t]));
  }
  return o;
}

TEST(GatedDeltaRule, RecurrentMatchesTokenByToken) {
  at::manual_seed(7);
  const int64_t D = 3, nv = 2, dk = 8, dv = 6, Lp = 40;
  const std::vector<int64_t> lens = {40, 1, 23};
  auto o = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({D, nv, Lp, dk}, o), k = at::randn({D, nv, Lp, dk}, o);
  k = k / k.norm(2, -1, true);
  at::Tensor v = at::randn({D, nv, Lp, dv}, o);
  // junk past each document's end: the lengths must keep it out
  at::Tensor g = -at::rand({D, nv, Lp}, o) * 0.5, beta = at::rand({D, nv, Lp}, o);
  at::Tensor S0 = at::randn({D, nv, dk, dv}, o) * 0.1;
  at::Tensor lt = at::tensor(lens, at::kLong);
  for (bool with_initial : {false, true}) {
    auto [out, S] = gated_delta_rule_recurrent(q, k, v, g, beta, lt, with_initial ? S0 : at::Tensor());
    ASSERT_EQ(out.sizes(), at::IntArrayRef({D, nv, Lp, dv}));
    for (int64_t d = 0; d < D; ++d) {
      for (int64_t h = 0; h < nv; ++h) {
        const int64_t L = lens[d];
        at::Tensor s = with_initial ? S0[d][h].clone() : at::zeros({dk, dv}, o);
        at::Tensor ref = token_by_token(q[d][h].narrow(0, 0, L), k[d][h].narrow(0, 0, L), v[d][h].narrow(0, 0, L),
                                        g[d][h].narrow(0, 0, L), beta[d][h].narrow(0, 0, L), s);
        EXPECT_LT(rel(out[d][h].narrow(0, 0, L), ref), 1e-9) << "document " << d << ", head " << h;
        if (L < Lp) EXPECT_EQ(out[d][h].narrow(0, L, Lp - L).abs().max().item<double>(), 0.0) << "zeros past the end";
        EXPECT_LT(rel(S[d][h], s), 1e-9) << "document " << d << ", head " << h;
      }
    }
  }
}

}  // namespace
