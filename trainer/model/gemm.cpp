// trainer/model/gemm.h: per-shape cuBLASLt algorithms, timed at the first product of a class.
#include "trainer/model/gemm.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#endif

namespace dflash::model::gemm {

bool tuning_enabled() {
  static const bool on = env_choice(kGemmTuneEnv, "auto", {"auto", "0", "1"}) != "0";
  return on;
}

namespace {

std::mutex g_mu;
TuneStats g_stats;

#ifdef DFLASH_CUDA
constexpr size_t kWorkspace = size_t(32) << 20;

// A 2-D operand as cuBLASLt reads it: row-major [rows, cols] with unit column stride (trans
// false), or the transpose of a row-major [cols, rows] (trans true); ld is the row stride of
// that row-major memory.
struct Operand {
  bool trans = false;
  int64_t ld = 0;
  int align = 1;  // bytes, the largest power of two <= 256 dividing the address
};

std::optional<Operand> operand(const at::Tensor& t) {
  Operand o;
  if (t.stride(1) == 1 && t.stride(0) >= t.size(1)) o.trans = false, o.ld = t.stride(0);
  else if (t.stride(0) == 1 && t.stride(1) >= t.size(0)) o.trans = true, o.ld = t.stride(1);
  else return std::nullopt;
  const auto addr = reinterpret_cast<uintptr_t>(t.data_ptr());
  o.align = 256;
  while (o.align > 1 && addr % static_cast<uintptr_t>(o.align) != 0) o.align /= 2;
  return o;
}

void lt_ok(cublasStatus_t s, const char* what) {
  DFLASH_CHECK(s == CUBLAS_STATUS_SUCCESS, "gemm: cuBLASLt {} failed with status {}", what, static_cast<int>(s));
}

// One product's descriptors. Row-major C[m, n] = A[m, k] B[k, n] is column-major
// C^T[n, m] = B^T[n, k] A^T[k, m]: cuBLASLt's first operand is B's memory, its second A's.
struct Problem {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  Problem(int64_t m, int64_t n, int64_t k, const Operand& A, const Operand& B, int64_t ldc, cudaDataType dt) {
    lt_ok(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
    const cublasOperation_t op_first = B.trans ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = A.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    lt_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)), "TRANSA");
    lt_ok(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)), "TRANSB");
    if (!B.trans) lt_ok(cublasLtMatrixLayoutCreate(&first, dt, n, k, B.ld), "layout");
    else lt_ok(cublasLtMatrixLayoutCreate(&first, dt, k, n, B.ld), "layout");
    if (!A.trans) lt_ok(cublasLtMatrixLayoutCreate(&second, dt, k, m, A.ld), "layout");
    else lt_ok(cublasLtMatrixLayoutCreate(&second, dt, m, k, A.ld), "layout");
    lt_ok(cublasLtMatrixLayoutCreate(&out, dt, n, m, ldc), "layout");
  }
  ~Problem() {
    if (out) cublasLtMatrixLayoutDestroy(out);
    if (second) cublasLtMatrixLayoutDestroy(second);
    if (first) cublasLtMatrixLayoutDestroy(first);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
  Problem(const Problem&) = delete;
  Problem& operator=(const Problem&) = delete;
};

using Key = std::tuple<int, int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t, int64_t, int, bool, int, int, int>;

struct Choice {
  bool lt = false;  // false: at::mm
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;
  int64_t m = 0;  // the m it was timed at
};

std::map<Key, Choice>& table() {
  static std::map<Key, Choice> t;
  return t;
}

void run_aten(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (accumulate) const_cast<at::Tensor&>(c).addmm_(a, b);
  else at::mm_out(const_cast<at::Tensor&>(c), a, b);
}

void run_lt(const Problem& p, const Choice& ch, const at::Tensor& c, const at::Tensor& a, const at::Tensor& b,
            bool accumulate, cudaStream_t stream) {
  const float alpha = 1.f, beta = accumulate ? 1.f : 0.f;
  at::Tensor ws;
  if (ch.workspace > 0) ws = at::empty({static_cast<int64_t>(ch.workspace)}, c.options().dtype(at::kByte));
  lt_ok(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), p.desc, &alpha, b.data_ptr(), p.first, a.data_ptr(),
                       p.second, &beta, c.data_ptr(), p.out, c.data_ptr(), p.out, &ch.algo,
                       ws.defined() ? ws.data_ptr() : nullptr, ch.workspace, stream),
        "Matmul");
}

// The shorter of 2 timed runs after one untimed (a few ms each: the whole timing of a class stays
// well under the 0.1 s a class may add to the first step).
template <typename F>
double time_runs(F fn, cudaStream_t stream) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  fn();
  std::vector<float> ms;
  for (int i = 0; i < 2; ++i) {
    cudaEventRecord(e0, stream);
    fn();
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float t = 0;
    cudaEventElapsedTime(&t, e0, e1);
    ms.push_back(t);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return std::min(ms[0], ms[1]) * 1e-3;
}

// Times at::mm and the heuristic's candidates for this product (into a scratch output when
// accumulating, so that c is written once, below, by the choice).
Choice tune(const Problem& p, const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate,
            const Operand& A, const Operand& B, const Operand& C, int64_t m, cudaStream_t stream) {
  Choice best;
  best.m = m;
  at::Tensor out = accumulate ? at::empty_like(c) : c;
  double best_s = time_runs([&] { run_aten(out, a, b, accumulate); }, stream);
  cublasLtMatmulPreference_t pref;
  lt_ok(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  const uint32_t al_first = static_cast<uint32_t>(B.align), al_second = static_cast<uint32_t>(A.align),
                 al_out = static_cast<uint32_t>(C.align);
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace, sizeof(kWorkspace));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_first, sizeof(al_first));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_second, sizeof(al_second));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_out, sizeof(al_out));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_out, sizeof(al_out));
  cublasLtMatmulHeuristicResult_t res[8];
  int got = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), p.desc, p.first,
                                                           p.second, p.out, p.out, pref, 8, res, &got);
  cublasLtMatmulPreferenceDestroy(pref);
  if (hs != CUBLAS_STATUS_SUCCESS) got = 0;
  for (int i = 0; i < got; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    Choice ch;
    ch.lt = true, ch.algo = res[i].algo, ch.workspace = res[i].workspaceSize, ch.m = m;
    const double s = time_runs([&] { run_lt(p, ch, out, a, b, accumulate, stream); }, stream);
    if (s < best_s) best_s = s, best = ch;
  }
  return best;
}
#endif

}  // namespace

TuneStats tune_stats() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_stats;
}

void mm_out(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  DFLASH_CHECK(a.dim() == 2 && b.dim() == 2 && c.dim() == 2 && a.size(1) == b.size(0) && c.size(0) == a.size(0) &&
                   c.size(1) == b.size(1),
               "gemm::mm_out: c [m, n] = a [m, k] @ b [k, n] expected");
#ifdef DFLASH_CUDA
  const int64_t m = a.size(0), n = b.size(1), k = a.size(1);
  const at::ScalarType dt = a.scalar_type();
  const bool eligible = tuning_enabled() && a.is_cuda() && (dt == at::kBFloat16 || dt == at::kHalf) &&
                        b.scalar_type() == dt && c.scalar_type() == dt && m >= kMinTuned && n >= kMinTuned &&
                        k >= kMinTuned && b.device() == a.device() && c.device() == a.device();
  std::optional<Operand> A, B, C;
  if (eligible) A = operand(a), B = operand(b), C = operand(c);
  if (!eligible || !A || !B || !C || C->trans || A->align < 16 || B->align < 16 || C->align < 16) {
    run_aten(c, a, b, accumulate);
    return;
  }
  const c10::cuda::CUDAGuard guard(a.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const Key key{static_cast<int>(a.device().index()), (m + 1023) / 1024 * 1024, n, k, A->trans, B->trans, A->ld,
                B->ld, C->ld, static_cast<int>(dt), accumulate, A->align, B->align, C->align};
  const Problem p(m, n, k, *A, *B, C->ld, dt == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F);
  Choice ch;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = table().find(key);
    if (it != table().end()) {
      ch = it->second;
    } else {
      cudaStreamCaptureStatus cap = cudaStreamCaptureStatusNone;
      cudaStreamIsCapturing(stream, &cap);
      if (cap != cudaStreamCaptureStatusNone || g_stats.classes >= kMaxClasses) {
        ch.lt = false;  // no timing while capturing a graph or past the table's size
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        ch = tune(p, c, a, b, accumulate, *A, *B, *C, m, stream);
        table().emplace(key, ch);
        g_stats.classes += 1;
        g_stats.lt_classes += ch.lt ? 1 : 0;
        g_stats.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
  }
  if (ch.lt && ch.m != m) {  // another m of the class: the algorithm must support it
    cublasLtMatmulHeuristicResult_t r{};
    if (cublasLtMatmulAlgoCheck(at::cuda::getCurrentCUDABlasLtHandle(), p.desc, p.first, p.second, p.out, p.out,
                                &ch.algo, &r) != CUBLAS_STATUS_SUCCESS ||
        r.workspaceSize > kWorkspace)
      ch.lt = false;
    else
      ch.workspace = std::max(ch.workspace, r.workspaceSize);
  }
  if (ch.lt) run_lt(p, ch, c, a, b, accumulate, stream);
  else run_aten(c, a, b, accumulate);
#else
  if (accumulate) const_cast<at::Tensor&>(c).addmm_(a, b);
  else at::mm_out(const_cast<at::Tensor&>(c), a, b);
#endif
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (!a.is_cuda() || !tuning_enabled()) return at::mm(a, b);
  at::Tensor c = at::empty({a.size(0), b.size(1)}, a.options());
  mm_out(c, a, b, false);
  return c;
}

namespace {

// Rows of x [..., K] as a 2-D [M, K] operand with unit column stride.
at::Tensor rows_of(const at::Tensor& x) {
  at::Tensor r = x.reshape({-1, x.size(-1)});
  return r.stride(1) == 1 ? r : r.contiguous();
}

struct TunedLinear : public torch::autograd::Function<TunedLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    ctx->save_for_backward({x, w});
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    return gemm::mm(rows_of(x), w.t()).view(shape);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    at::Tensor dx, dw;
    if (!grads[0].defined()) return {dx, dw};
    const at::Tensor g = rows_of(grads[0]);  // [M, N]
    if (ctx->needs_input_grad(0)) dx = gemm::mm(g, w).view(x.sizes());
    if (ctx->needs_input_grad(1)) dw = gemm::mm(g.t(), rows_of(x));
    return {dx, dw};
  }
};

}  // namespace

at::Tensor linear(const at::Tensor& x, const at::Tensor& w) {
  if (!x.is_cuda() || !tuning_enabled() || x.dim() < 2 || w.dim() != 2) return at::linear(x, w);
  return TunedLinear::apply(x, w);
}

}  // namespace dflash::model::gemm
