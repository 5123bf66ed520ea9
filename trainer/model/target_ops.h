// The target model's building blocks (RMSNorm, RoPE, SiLU-gating, packed causal attention),
// each with a CPU path that mirrors transformers' arithmetic and a CUDA path picked for speed.
//
// Owns nothing; stateless functions on tensors of one device. Thread-safety: as ATen.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model::ops {

// RMSNorm over the last dimension (x may be a strided view): x * rsqrt(mean(x^2) + eps) * w.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// Position of every token inside its document: [T] int64 on CPU.
at::Tensor positions_from_cu(const std::vector<int64_t>& cu, int64_t T);

// cos/sin of positions * inv_freq: two [T, head_dim / 2] float32 tensors (inv_freq's device).
std::tuple<at::Tensor, at::Tensor> rope_cos_sin(const at::Tensor& positions, const at::Tensor& inv_freq);

// Rotate-half RoPE of x [T, heads, head_dim] with cos/sin [T, head_dim / 2]; returns a new
// contiguous tensor in x's dtype (computed in float32).
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

// Splits the fused projection qkv [T, (nq + 2 nkv) * hd] into q [T, nq, hd], k and v
// [T, nkv, hd], with the per-head RMSNorm (q_norm/k_norm defined: qwen3) and RoPE applied to q
// and k. On CUDA this runs one kernel in place on qkv and returns views of it (row stride
// (nq + 2 nkv) * hd); on CPU it mirrors transformers' arithmetic and returns new tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor> qkv_heads(at::Tensor& qkv, int64_t nq, int64_t nkv,
                                                         int64_t hd, const at::Tensor& q_norm,
                                                         const at::Tensor& k_norm, double eps,
                                                         const at::Tensor& cos,
                                                         const at::Tensor& sin);

// silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I]: [T, I].
at::Tensor silu_mul(const at::Tensor& gu, int64_t I);

// Environment knob: the CUDA attention backend of the packed forward, read once per process:
//   auto   (default) the DFlash attention kernel's causal mode (attention/kernel.h) where its
//          Hopper forward runs (sm_90a build on an sm_90 GPU), bf16, head_dim 64 or 128; else flash
//   kernel the same, and a user error where it cannot run
//   flash  FlashAttention-2 varlen through at::_flash_attention_forward
//   cudnn  cuDNN's varlen attention through at::_cudnn_attention_forward (measured 60x slower)
constexpr const char* kAttentionBackendEnv = "DFLASH_TARGET_ATTENTION";

enum class CausalBackend { Kernel, Flash, Cudnn, Cpu };
// The backend varlen_causal_attention uses for q (its device, dtype and head_dim).
CausalBackend causal_backend(const at::Tensor& q);
const char* causal_backend_name(CausalBackend b);

// Causal attention inside each document of a packed stream: q [T, nq, hd], k/v [T, nkv, hd]
// (nq a multiple of nkv) -> [T, nq, hd]. `cu` host offsets, `cu_dev` the same as int32 on the
// device, `max_len` the longest document. `kernel_meta`, when given, caches the kernel backend's
// tile metadata for the layers of one pass (built at the first call when undefined; the caller
// resets it when cu changes).
at::Tensor varlen_causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const std::vector<int64_t>& cu, const at::Tensor& cu_dev,
                                   int64_t max_len, double scale, at::Tensor* kernel_meta = nullptr);

}  // namespace dflash::model::ops
