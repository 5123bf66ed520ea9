// trainer/roles/batch_message.h: the wire layout of a batch message.
#include "trainer/roles/batch_message.h"

#include <ATen/ATen.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dflash::roles {
namespace {

enum Slot { kIds, kLossMask, kCuSeqlens, kFeatures, kStats };

std::string describe(const at::Tensor& t) {
  return fmt::format("{} [{}]", c10::toString(t.scalar_type()), fmt::join(t.sizes().vec(), ", "));
}

// A received tensor on the host. take() returns once the message is complete on the device, so
// a CUDA tensor is copied on a side stream: the read does not wait for the work queued on the
// current stream (the previous step's AdamW update), and the step's host work overlaps it.
at::Tensor on_host(const at::Tensor& t) {
#ifdef DFLASH_CUDA
  if (t.is_cuda()) {
    const c10::cuda::CUDAStreamGuard guard(c10::cuda::getStreamFromPool(false, t.device().index()));
    return t.to(at::kCPU);  // synchronous on the side stream
  }
#endif
  return t;
}

}  // namespace

comm::Message pack(const BatchMessage& b, at::Device device) {
  comm::Message m;
  m.kind = kBatchMessageKind;
  m.batch = b.batch;
  m.tensors = {b.ids, b.loss_mask, b.cu_seqlens, b.features,
               at::tensor({b.stats.tokens, b.stats.busy_s, b.stats.wait_s, b.stats.stop}, at::kDouble).to(device)};
  return m;
}

BatchMessage unpack(comm::Message msg, int64_t expected_batch, const std::string& from) {
  if (msg.kind != kBatchMessageKind || msg.batch != expected_batch || msg.tensors.size() != kNumBatchTensors)
    throw CommError(fmt::format("expected batch {} ({} tensors) from {}, got kind {} batch {} with {} tensors",
                                expected_batch, kNumBatchTensors, from, msg.kind, msg.batch, msg.tensors.size()));
  auto& t = msg.tensors;
  const int64_t T = t[kIds].dim() == 1 ? t[kIds].size(0) : -1;
  const bool ok = T >= 0 && t[kIds].scalar_type() == at::kLong && t[kLossMask].scalar_type() == at::kByte &&
                  t[kLossMask].dim() == 1 && t[kLossMask].size(0) == T && t[kCuSeqlens].scalar_type() == at::kLong &&
                  t[kCuSeqlens].dim() == 1 && t[kCuSeqlens].size(0) >= 2 && t[kFeatures].dim() == 2 &&
                  t[kFeatures].size(0) == T && t[kStats].scalar_type() == at::kDouble && t[kStats].dim() == 1 &&
                  t[kStats].size(0) == 4;
  if (!ok)
    throw CommError(fmt::format("batch {} from {}: ids {}, loss_mask {}, cu_seqlens {}, features {}, stats {}; "
                                "expected int64 [T], uint8 [T], int64 [n+1], [T, K*H], float64 [4]",
                                expected_batch, from, describe(t[kIds]), describe(t[kLossMask]),
                                describe(t[kCuSeqlens]), describe(t[kFeatures]), describe(t[kStats])));
  BatchMessage b;
  b.batch = msg.batch;
  b.ids = on_host(t[kIds]);
  b.loss_mask = on_host(t[kLossMask]);
  b.cu_seqlens = on_host(t[kCuSeqlens]);
  b.features = std::move(t[kFeatures]);
  const at::Tensor st = on_host(t[kStats]).to(at::kDouble);
  b.stats = TargetStats{st[0].item<double>(), st[1].item<double>(), st[2].item<double>(), st[3].item<double>()};
  return b;
}

}  // namespace dflash::roles
