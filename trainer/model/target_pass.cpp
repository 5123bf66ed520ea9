// One target pass (see target_pass.h).
#include "trainer/model/target_pass.h"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "trainer/model/target_ops.h"

namespace dflash::model {

void check_target_ids(const at::Tensor& ids, int64_t vocab) {
  if (ids.dim() != 1 || ids.scalar_type() != at::kLong)
    throw_user("target forward: ids must be a 1-D int64 tensor, got {} of shape [{}]",
               c10::toString(ids.scalar_type()), fmt::join(ids.sizes(), ", "));
  if (ids.numel() == 0) throw_user("target forward: no tokens");
  auto [lo, hi] = at::aminmax(ids);
  int64_t l = lo.item<int64_t>(), h = hi.item<int64_t>();
  if (l < 0 || h >= vocab)
    throw_user("target forward: token id {} is outside the vocabulary [0, {})", l < 0 ? l : h, vocab);
}

void check_capture_layer_ids(const std::vector<int64_t>& ids, int64_t loaded) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= loaded)
      throw_user("target capture: layer id {} is outside [0, {}) (loaded decoder layers)", ids[i], loaded);
    if (i && ids[i] <= ids[i - 1])
      throw_user("target capture: layer ids must be strictly increasing, got {} after {}", ids[i], ids[i - 1]);
  }
}

std::vector<int64_t> check_cu_seqlens(const at::Tensor& cu_seqlens, int64_t T) {
  if (cu_seqlens.dim() != 1 || cu_seqlens.numel() < 2 ||
      (cu_seqlens.scalar_type() != at::kLong && cu_seqlens.scalar_type() != at::kInt))
    throw_user("target forward: cu_seqlens must be a 1-D int32/int64 tensor [n_docs + 1], got {} "
               "of shape [{}]", c10::toString(cu_seqlens.scalar_type()), fmt::join(cu_seqlens.sizes(), ", "));
  at::Tensor h = cu_seqlens.to(at::kCPU, at::kLong).contiguous();
  std::vector<int64_t> cu(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + h.numel());
  if (cu.front() != 0 || cu.back() != T)
    throw_user("target forward: cu_seqlens must start at 0 and end at the token count {}, got {} .. {}",
               T, cu.front(), cu.back());
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      throw_user("target forward: cu_seqlens must be strictly increasing (document {} is empty or "
                 "negative: {} -> {})", i - 1, cu[i - 1], cu[i]);
  return cu;
}

void TargetPass::pack(const at::Tensor& ids_in, const at::Tensor& cu_seqlens, const at::Tensor& inv_freq,
                      at::Device device) {
  const int64_t T = ids_in.size(0);
  ids = ids_in.to(device);
  cu = check_cu_seqlens(cu_seqlens, T);
  for (size_t b = 0; b + 1 < cu.size(); ++b) max_len = std::max(max_len, cu[b + 1] - cu[b]);
  cu_dev = at::tensor(cu, at::kLong).to(at::kInt).to(device);
  kernel_meta = at::Tensor();
  at::Tensor pos = ops::positions_from_cu(cu, T).to(device);
  std::tie(cos, sin) = ops::rope_cos_sin(pos, inv_freq);
}

void TargetPass::at_positions(const at::Tensor& ids_in, const at::Tensor& positions, const at::Tensor& inv_freq,
                              at::Device device, const TargetModel::Attention& attention) {
  ids = ids_in.to(device);
  std::tie(cos, sin) = ops::rope_cos_sin(positions.to(device), inv_freq);
  attend = &attention;
}

at::Tensor TargetPass::capture_into(const std::vector<int64_t>& layer_ids, int64_t hidden,
                                    const at::TensorOptions& opt) {
  capture_ids = layer_ids;
  if (!layer_ids.empty()) captured = at::empty({ids.size(0), int64_t(layer_ids.size()) * hidden}, opt);
  return captured;
}

void TargetPass::after_layer(int64_t l, const at::Tensor& x) {
  if (next_capture < capture_ids.size() && capture_ids[next_capture] == l) {
    const int64_t H = x.size(1);
    captured.narrow(1, int64_t(next_capture) * H, H).copy_(x);
    ++next_capture;
  }
}

at::Tensor TargetPass::attention(int64_t l, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) const {
  if (attend) return (*attend)(l, q, k, v);
  const double scale = 1.0 / std::sqrt(double(q.size(2)));
  return ops::varlen_causal_attention(q, k, v, cu, cu_dev, max_len, scale, &kernel_meta);
}

}  // namespace dflash::model
