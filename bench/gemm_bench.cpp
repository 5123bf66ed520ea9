// gemm_bench: the GEMMs of the target's capture forward and of the drafter step, timed as LibTorch
// runs them (at::mm: cuBLAS's default choice) beside every algorithm cuBLASLt's heuristic offers
// for the same product (up to --algos of them), so that a table says how much a per-shape choice
// of algorithm would gain. Random bf16 operands; TFLOP/s = 2 m n k / time.
//
//   gemm_bench [--set target|drafter|all] [--iters N] [--algos N] [--tokens T]
//
// Row-major semantics: C[m, n] = op(A) op(B); A is stored [m, k] (or [k, m] with tA), B [k, n]
// (or [n, k] with tB). "NT" is a forward linear (x W^T), "NN" its input gradient (dy W), "TN" its
// weight gradient (dy^T x).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "bench/bench_common.h"
#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cublasLt.h>
#endif

namespace {

using namespace dflash;

struct Case {
  std::string name;
  int64_t m, n, k;
  bool tA, tB;
  bool fp32_out = false;
};

std::vector<Case> target_cases(int64_t T) {
  return {{"target qkv (NT)", T, 6144, 4096, false, true},
          {"target o_proj (NT)", T, 4096, 4096, false, true},
          {"target gate_up (NT)", T, 24576, 4096, false, true},
          {"target down (NT)", T, 4096, 12288, false, true}};
}

std::vector<Case> drafter_cases() {
  const int64_t P = 32768, KV = 45056, C = 12288;  // 4 x 512 x 16 draft rows, 4 x (3072 + 8192), 4 x 3072
  return {{"q/o fwd (NT)", P, 4096, 4096, false, true},
          {"k/v fwd (NT)", KV, 1024, 4096, false, true},
          {"gate/up fwd (NT)", P, 12288, 4096, false, true},
          {"down fwd (NT)", P, 4096, 12288, false, true},
          {"fc fwd (NT)", C, 4096, 20480, false, true},
          {"lm_head chunk fp32 (NT)", 2048, 151936, 4096, false, true, true},
          {"q/o dX (NN)", P, 4096, 4096, false, false},
          {"k/v dX (NN)", KV, 4096, 1024, false, false},
          {"gate/up dX (NN)", P, 4096, 12288, false, false},
          {"down dX (NN)", P, 12288, 4096, false, false},
          {"lm_head chunk dX (NN)", 2048, 4096, 151936, false, false},
          {"q/o dW (TN)", 4096, 4096, P, true, false},
          {"k/v dW (TN)", 1024, 4096, KV, true, false},
          {"gate/up dW (TN)", 12288, 4096, P, true, false},
          {"down dW (TN)", 4096, 12288, P, true, false},
          {"fc dW (TN)", 4096, 20480, C, true, false}};
}

#ifdef DFLASH_CUDA
void lt_check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) throw_user("gemm_bench: {} failed with cuBLAS status {}", what, int(s));
}

struct LtProblem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr;
  ~LtProblem() {
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

// Column-major view: C^T [n, m] = op(B)^T [n, k] * op(A)^T [k, m]; cuBLAS's first operand is B's memory.
void lt_setup(LtProblem& p, const Case& c) {
  lt_check(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  cublasOperation_t opb = c.tB ? CUBLAS_OP_T : CUBLAS_OP_N, opa = c.tA ? CUBLAS_OP_T : CUBLAS_OP_N;
  lt_check(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &opb, sizeof(opb)), "TRANSA");
  lt_check(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &opa, sizeof(opa)), "TRANSB");
  // first operand (B's memory): op N -> [n, k] col-major ld n; op T -> [k, n] ld k
  if (!c.tB) lt_check(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, c.n, c.k, c.n), "layout B");
  else lt_check(cublasLtMatrixLayoutCreate(&p.la, CUDA_R_16BF, c.k, c.n, c.k), "layout B");
  // second operand (A's memory): op N -> [k, m] ld k; op T -> [m, k] ld m
  if (!c.tA) lt_check(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, c.k, c.m, c.k), "layout A");
  else lt_check(cublasLtMatrixLayoutCreate(&p.lb, CUDA_R_16BF, c.m, c.k, c.m), "layout A");
  lt_check(cublasLtMatrixLayoutCreate(&p.lc, c.fp32_out ? CUDA_R_32F : CUDA_R_16BF, c.n, c.m, c.n), "layout C");
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::string set = "all";
  int iters = 10, algos = 16;
  int64_t tokens = 16384;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw_user("gemm_bench: {} needs a value", a);
      return argv[++i];
    };
    if (a == "--set") set = next();
    else if (a == "--iters") iters = int(parse_int(next(), "--iters"));
    else if (a == "--algos") algos = int(parse_int(next(), "--algos"));
    else if (a == "--tokens") tokens = parse_int(next(), "--tokens");
    else throw_user("gemm_bench: unknown argument '{}' (--set target|drafter|all, --iters, --algos, --tokens)", a);
  }
  const at::Device dev = bench::bench_device();
  if (!dev.is_cuda()) {
    std::printf("gemm_bench: no CUDA device; nothing to measure\n");
    return 0;
  }
#ifdef DFLASH_CUDA
  std::vector<Case> cases;
  if (set == "target" || set == "all") cases = target_cases(tokens);
  if (set == "drafter" || set == "all")
    for (auto& c : drafter_cases()) cases.push_back(c);
  auto opt = at::TensorOptions().dtype(at::kBFloat16).device(dev);
  (void)at::empty({1}, opt);  // CUDA and its caching allocator initialised before the handle's workspace
  cublasLtHandle_t lt = at::cuda::getCurrentCUDABlasLtHandle();
  const size_t ws_bytes = size_t(64) << 20;
  auto ws = at::empty({int64_t(ws_bytes)}, opt.dtype(at::kByte));
  auto stream = at::cuda::getCurrentCUDAStream().stream();

  std::printf("| GEMM | m | n | k | at::mm ms | TFLOP/s | best cuBLASLt ms | TFLOP/s | gain | best of | heuristic #0 ms |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  double sum_default = 0, sum_best = 0;
  for (const Case& c : cases) {
    at::Tensor A = c.tA ? at::randn({c.k, c.m}, opt) : at::randn({c.m, c.k}, opt);
    at::Tensor B = c.tB ? at::randn({c.n, c.k}, opt) : at::randn({c.k, c.n}, opt);
    at::Tensor opA = c.tA ? A.t() : A, opB = c.tB ? B.t() : B;
    at::Tensor C = at::empty({c.m, c.n}, opt.dtype(c.fp32_out ? at::kFloat : at::kBFloat16));
    const double flop = 2.0 * double(c.m) * double(c.n) * double(c.k);
    // as the model calls it: a fresh output each time (the caching allocator makes that free)
    const double t_def = c.fp32_out ? bench::time_median(dev, iters, [&] { (void)at::mm(opA, opB, at::kFloat); })
                                    : bench::time_median(dev, iters, [&] { (void)at::mm(opA, opB); });
    LtProblem p;
    lt_setup(p, c);
    cublasLtMatmulPreference_t pref;
    lt_check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
    lt_check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                  sizeof(ws_bytes)),
             "workspace");
    std::vector<cublasLtMatmulHeuristicResult_t> res(algos);
    int got = 0;
    lt_check(cublasLtMatmulAlgoGetHeuristic(lt, p.desc, p.la, p.lb, p.lc, p.lc, pref, algos, res.data(), &got),
             "AlgoGetHeuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    const float alpha = 1.f, beta = 0.f;
    double best = 1e30, first = 0;
    int best_i = -1;
    for (int i = 0; i < got; ++i) {
      auto run = [&] {
        lt_check(cublasLtMatmul(lt, p.desc, &alpha, B.data_ptr(), p.la, A.data_ptr(), p.lb, &beta, C.data_ptr(), p.lc,
                                C.data_ptr(), p.lc, &res[i].algo, ws.data_ptr(), ws_bytes, stream),
                 "Matmul");
      };
      double t = bench::time_median(dev, iters, run);
      if (i == 0) first = t;
      if (t < best) best = t, best_i = i;
    }
    sum_default += t_def;
    sum_best += std::min(best, t_def);
    std::printf("| %s | %ld | %ld | %ld | %.3f | %.0f | %.3f | %.0f | %.3fx | #%d of %d | %.3f |\n", c.name.c_str(),
                long(c.m), long(c.n), long(c.k), t_def * 1e3, flop / t_def / 1e12, best * 1e3, flop / best / 1e12,
                t_def / best, best_i, got, first * 1e3);
    std::fflush(stdout);
  }
  std::printf("\nsum over the rows: at::mm %.3f ms, best of (at::mm, cuBLASLt) %.3f ms (%.3fx)\n", sum_default * 1e3,
              sum_best * 1e3, sum_default / sum_best);
#endif
  return 0;
}
