// Target model building blocks (see target_ops.h).
#include "trainer/model/target_ops.h"

#include <atomic>
#include <string>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/parse.h"

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "trainer/model/target_kernels_dtype.h"
#endif
#if DFLASH_ATTENTION_KERNEL
#include "attention/kernel.h"
#endif
#include "core/log.h"

namespace dflash::model::ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = x.size(-1);
  if (x.is_cuda()) {
    // One fused kernel; statistics in float32.
    return std::get<0>(at::_fused_rms_norm(x.contiguous(), {n}, weight, eps));
  }
  // As transformers: normalize in float32, cast back, then scale by the weight.
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  at::Tensor y = (xf * at::rsqrt(var + eps)).to(x.scalar_type());
  return weight * y;
}

at::Tensor positions_from_cu(const std::vector<int64_t>& cu, int64_t T) {
  at::Tensor pos = at::empty({T}, at::kLong);
  int64_t* p = pos.data_ptr<int64_t>();
  for (size_t d = 0; d + 1 < cu.size(); ++d)
    for (int64_t t = cu[d]; t < cu[d + 1]; ++t) p[t] = t - cu[d];
  return pos;
}

std::tuple<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq) {
  at::Tensor freqs = positions.to(inv_freq.device(), at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  return {freqs.cos(), freqs.sin()};
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t half = x.size(-1) / 2;
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor x1 = xf.narrow(-1, 0, half), x2 = xf.narrow(-1, half, half);
  at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [T, 1, half]
  at::Tensor out = at::cat({x1 * c - x2 * s, x2 * c + x1 * s}, -1);
  return out.to(x.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads(at::Tensor& qkv, int64_t nq, int64_t nkv,
                                                         int64_t hd, const at::Tensor& q_norm,
                                                         const at::Tensor& k_norm, double eps,
                                                         const at::Tensor& cos,
                                                         const at::Tensor& sin) {
  const int64_t T = qkv.size(0);
  auto view = [&](int64_t head0, int64_t heads) {
    return qkv.narrow(1, head0 * hd, heads * hd).view({T, heads, hd});
  };
#ifdef DFLASH_CUDA
  if (qkv.is_cuda() && hd <= 256 && qkv.stride(1) == 1) {
    DFLASH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
                 "qkv_heads: cos/sin must be contiguous float32");
    DFLASH_CHECK(!q_norm.defined() || (q_norm.is_contiguous() && q_norm.scalar_type() == qkv.scalar_type()),
                 "qkv_heads: q_norm must be contiguous and of qkv's dtype");
    kernels::qk_norm_rope(qkv.data_ptr(), T, qkv.stride(0), int(nq), int(nkv), int(hd),
                          q_norm.defined() ? q_norm.data_ptr() : nullptr,
                          k_norm.defined() ? k_norm.data_ptr() : nullptr, float(eps),
                          cos.data_ptr<float>(), sin.data_ptr<float>(), kernels::dtype_of(qkv),
                          at::cuda::getCurrentCUDAStream());
    return {view(0, nq), view(nq, nkv), view(nq + nkv, nkv)};
  }
#endif
  at::Tensor q = view(0, nq), k = view(nq, nkv), v = view(nq + nkv, nkv);
  if (q_norm.defined()) {
    q = rms_norm(q, q_norm, eps);
    k = rms_norm(k, k_norm, eps);
  }
  return {rope(q, cos, sin), rope(k, cos, sin), v};
}

at::Tensor silu_mul(const at::Tensor& gu, int64_t I) {
#ifdef DFLASH_CUDA
  if (gu.is_cuda() && gu.is_contiguous()) {
    at::Tensor out = at::empty({gu.size(0), I}, gu.options());
    kernels::silu_mul(gu.data_ptr(), out.data_ptr(), gu.size(0), I, kernels::dtype_of(gu),
                      at::cuda::getCurrentCUDAStream());
    return out;
  }
#endif
  return at::silu(gu.narrow(1, 0, I)) * gu.narrow(1, I, I);
}

namespace {

bool kernel_can_run(at::ScalarType dtype, int64_t head_dim) {
#if DFLASH_ATTENTION_KERNEL
  return dtype == at::kBFloat16 && (head_dim == 64 || head_dim == 128) && attention::forward_is_wgmma();
#else
  (void)dtype;
  (void)head_dim;
  return false;
#endif
}

}  // namespace

const char* causal_backend_name(CausalBackend b) {
  switch (b) {
    case CausalBackend::Kernel: return "dflash kernel (causal, wgmma)";
    case CausalBackend::Flash: return "flash-attention-2 varlen";
    case CausalBackend::Cudnn: return "cuDNN varlen";
    case CausalBackend::Cpu: return "SDPA per document";
  }
  return "?";
}

CausalBackend causal_backend(const at::Tensor& q) {
  const at::ScalarType dtype = q.scalar_type();
  const at::Device device = q.device();
  const int64_t head_dim = q.size(-1);
  if (!device.is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return CausalBackend::Cpu;
  static const std::string choice = env_choice(kAttentionBackendEnv, "auto", {"auto", "kernel", "flash", "cudnn"});
  if (choice == "flash") return CausalBackend::Flash;
  if (choice == "cudnn") return CausalBackend::Cudnn;
  if (kernel_can_run(dtype, head_dim)) return CausalBackend::Kernel;
  if (choice == "kernel")
    throw_user("{}=kernel: the DFlash attention kernel's causal mode needs its Hopper forward (an sm_90 GPU "
               "and a build with sm_90a in DFLASH_CUDA_ARCHS), bf16 and head_dim 64 or 128; got {} on {}, head_dim {}",
               kAttentionBackendEnv, c10::toString(dtype), device.str(), head_dim);
  return CausalBackend::Flash;
}

at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& cu, const at::Tensor& cu_dev,
                                   int64_t max_len, double scale, at::Tensor* kernel_meta) {
  const CausalBackend backend = causal_backend(q);
  static std::atomic<bool> said{false};
  if (backend != CausalBackend::Cpu && !said.exchange(true)) log::info("target attention: {}", causal_backend_name(backend));
  switch (backend) {
    case CausalBackend::Kernel: {
#if DFLASH_ATTENTION_KERNEL
      at::Tensor local;
      return attention::kernel_causal_varlen(q, k, v, cu_dev, scale, kernel_meta ? *kernel_meta : local);
#else
      break;
#endif
    }
    case CausalBackend::Cudnn:
      return std::get<0>(at::_cudnn_attention_forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                                      {}, cu_dev, cu_dev, max_len, max_len,
                                                      /*compute_log_sumexp=*/false, 0.0,
                                                      /*is_causal=*/true, false, scale));
    case CausalBackend::Flash: {
      auto res = at::_flash_attention_forward(q, k, v, cu_dev, cu_dev, max_len, max_len, 0.0,
                                              /*is_causal=*/true, /*return_debug_mask=*/false, scale);
      return std::get<0>(res);
    }
    case CausalBackend::Cpu: break;
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  for (size_t d = 0; d + 1 < cu.size(); ++d) {
    const int64_t s = cu[d], n = cu[d + 1] - s;
    auto heads_first = [&](const at::Tensor& t) { return t.narrow(0, s, n).transpose(0, 1).unsqueeze(0); };
    at::Tensor o = at::scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), {},
                                                    0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true);
    out.narrow(0, s, n).copy_(o.squeeze(0).transpose(0, 1));
  }
  return out;
}

}  // namespace dflash::model::ops
