// GPU tests of the attention kernel's causal mode for packed documents (the target's prefill:
// attention::kernel_causal_varlen, used by model::ops::varlen_causal_attention) against a dense
// fp32 reference written here (per document: softmax(q k^T * scale + causal mask) v).
//
// Tolerance: the kernel's relative Frobenius error against the fp32 reference must be at most
// 2x that of FlashAttention-2 varlen (at::_flash_attention_forward, bf16, the backend the kernel
// replaces) on the same inputs, plus 1e-6. Both round inputs, P and O to bf16, so flash's error is
// the yardstick of "bf16 rounding only"; a wrong document boundary, a missed diagonal or a tile
// straddling two documents that mixes them gives errors near 1.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/error.h"
#include "trainer/model/target_ops.h"
#if DFLASH_ATTENTION_KERNEL
#include "attention/kernel.h"
#endif

namespace dflash::attention {
namespace {

#if DFLASH_ATTENTION_KERNEL
bool have_gpu() { return at::hasCUDA(); }
#else
bool have_gpu() { return false; }
#endif

struct CausalCase {
  const char* name;
  std::vector<int64_t> docs;  // document lengths, packed in this order
  int Hq, Hkv, d;
  bool fused_qkv;  // q, k, v as strided views of one [T, (Hq + 2 Hkv) d] projection
};
[[maybe_unused]] void PrintTo(const CausalCase& c, std::ostream* os) { *os << c.name; }

[[maybe_unused]] double rel_err(const at::Tensor& a, const at::Tensor& ref) {
  return (a.to(at::kFloat) - ref).norm().item<double>() / (ref.norm().item<double>() + 1e-30);
}

// fp32 causal attention inside each document, with dense per-document masks.
[[maybe_unused]] at::Tensor reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const std::vector<int64_t>& cu, double scale) {
  const int64_t G = q.size(1) / k.size(1);
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  for (size_t j = 0; j + 1 < cu.size(); ++j) {
    const int64_t s = cu[j], n = cu[j + 1] - s;
    auto qf = q.narrow(0, s, n).to(at::kFloat).transpose(0, 1);  // [Hq, n, d]
    auto kf = k.narrow(0, s, n).to(at::kFloat).repeat_interleave(G, 1).transpose(0, 1);
    auto vf = v.narrow(0, s, n).to(at::kFloat).repeat_interleave(G, 1).transpose(0, 1);
    auto sc = at::matmul(qf, kf.transpose(-1, -2)) * scale;
    auto causal = at::ones({n, n}, q.options().dtype(at::kBool)).tril();
    sc = sc.masked_fill(causal.logical_not(), -INFINITY);
    out.narrow(0, s, n).copy_(at::matmul(at::softmax(sc, -1), vf).transpose(0, 1));
  }
  return out;
}

class CausalKernel : public ::testing::TestWithParam<CausalCase> {};

TEST_P(CausalKernel, MatchesFp32WithinTwiceFlashError) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device or kernel not built";
#if DFLASH_ATTENTION_KERNEL
  const CausalCase c = GetParam();
  at::manual_seed(7 + c.d + int64_t(c.docs.size()));
  const at::Device dev(at::kCUDA, 0);
  std::vector<int64_t> cu{0};
  for (int64_t n : c.docs) cu.push_back(cu.back() + n);
  const int64_t T = cu.back();
  int64_t max_len = 0;
  for (int64_t n : c.docs) max_len = std::max(max_len, n);
  auto opt = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  at::Tensor q, k, v;
  if (c.fused_qkv) {
    auto qkv = at::randn({T, (c.Hq + 2 * c.Hkv) * c.d}, opt);
    q = qkv.narrow(1, 0, c.Hq * c.d).view({T, c.Hq, c.d});
    k = qkv.narrow(1, c.Hq * c.d, c.Hkv * c.d).view({T, c.Hkv, c.d});
    v = qkv.narrow(1, (c.Hq + c.Hkv) * c.d, c.Hkv * c.d).view({T, c.Hkv, c.d});
  } else {
    q = at::randn({T, c.Hq, c.d}, opt);
    k = at::randn({T, c.Hkv, c.d}, opt);
    v = at::randn({T, c.Hkv, c.d}, opt);
  }
  const double scale = 1.0 / std::sqrt(double(c.d));
  at::Tensor cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(dev);

  at::Tensor meta;
  at::Tensor o = kernel_causal_varlen(q, k, v, cu_dev, scale, meta);
  ASSERT_TRUE(meta.defined()) << "the metadata is built at the first call and handed back";
  ASSERT_EQ(o.sizes(), q.sizes());
  ASSERT_TRUE(o.is_contiguous());
  ASSERT_FALSE(o.isnan().any().item<bool>()) << c.name << ": NaN in the kernel's output";
  const at::Tensor ref = reference(q, k, v, cu, scale);
  const at::Tensor fl = std::get<0>(at::_flash_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_dev,
                                                                 cu_dev, max_len, max_len, 0.0, true, false, scale));
  const double ek = rel_err(o, ref), ef = rel_err(fl, ref);
  std::printf("[%s] T %ld: kernel rel %.3e, flash bf16 rel %.3e\n", c.name, long(T), ek, ef);
  EXPECT_LE(ek, 2.0 * ef + 1e-6) << c.name;
  // Every document on its own (a boundary mix-up shows in the short documents even when the
  // long ones dominate the total norm).
  for (size_t j = 0; j + 1 < cu.size(); ++j) {
    const int64_t s = cu[j], n = cu[j + 1] - s;
    const double dk = rel_err(o.narrow(0, s, n), ref.narrow(0, s, n));
    const double df = rel_err(fl.narrow(0, s, n), ref.narrow(0, s, n));
    EXPECT_LE(dk, 2.0 * df + 1e-6) << c.name << ": document " << j << " (tokens " << s << ".." << s + n << ")";
  }
  // A second call with the cached metadata: the same bits.
  EXPECT_TRUE(at::equal(kernel_causal_varlen(q, k, v, cu_dev, scale, meta), o));
  // The target's entry point picks the kernel by default on a GPU where its wgmma forward runs.
  if (forward_is_wgmma() && std::getenv(model::ops::kAttentionBackendEnv) == nullptr) {
    EXPECT_EQ(model::ops::causal_backend(q), model::ops::CausalBackend::Kernel);
    at::Tensor meta2;
    EXPECT_TRUE(at::equal(model::ops::varlen_causal_attention(q, k, v, cu, cu_dev, max_len, scale, &meta2), o));
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(
    Docs, CausalKernel,
    ::testing::Values(
        //         name                docs                                   Hq Hkv  d  fused
        CausalCase{"one_doc_2048", {2048}, 8, 2, 128, true},
        CausalCase{"tile_edges", {1, 63, 64, 65, 127, 129, 200}, 4, 1, 128, false},
        CausalCase{"tiny_docs_share_tiles", {3, 5, 1, 17, 2, 9, 30, 4, 11, 1, 50, 7}, 4, 2, 128, true},
        CausalCase{"d64_unaligned", {700, 333, 1000, 15}, 6, 3, 64, false},
        CausalCase{"qwen3_heads", {1500, 548, 3000}, 32, 8, 128, true}),
    [](const ::testing::TestParamInfo<CausalCase>& i) { return std::string(i.param.name); });

TEST(CausalKernelValidation, RejectsBadShapesWithNamedErrors) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device or kernel not built";
#if DFLASH_ATTENTION_KERNEL
  const at::Device dev(at::kCUDA, 0);
  auto opt = at::TensorOptions().device(dev).dtype(at::kBFloat16);
  auto q = at::randn({100, 4, 128}, opt), k = at::randn({100, 2, 128}, opt);
  auto cu = at::tensor(std::vector<int64_t>{0, 100}, at::kLong).to(at::kInt).to(dev);
  at::Tensor meta;
  auto msg = [&](auto&& f) {
    try {
      f();
    } catch (const UserError& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg([&] { kernel_causal_varlen(q, k.narrow(0, 0, 50), k, cu, 0.1, meta); }).find("50"), std::string::npos);
  EXPECT_NE(msg([&] { kernel_causal_varlen(q, k, k, cu.to(at::kLong), 0.1, meta); }).find("int32"), std::string::npos);
  EXPECT_NE(msg([&] { kernel_causal_varlen(q.to(at::kHalf), k, k, cu, 0.1, meta); }).find("bfloat16"),
            std::string::npos);
#endif
}

}  // namespace
}  // namespace dflash::attention
