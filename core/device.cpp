#include "core/device.h"

#include <fstream>
#include <sstream>
#include <string>
#include <utility>

#ifdef DFLASH_CUDA
#include <ATen/ops/addmm.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/embedding.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace dflash::device {

void sync(const c10::Device& d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda()) c10::cuda::device_synchronize();
#endif
  (void)d;
}

double peak_memory_gib(const c10::Device& d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda()) {
    auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(d.index());
    return static_cast<double>(s.allocated_bytes[0].peak) / (1024.0 * 1024.0 * 1024.0);
  }
#endif
  return peak_rss_gib();
}

at::Tensor to_device(const at::Tensor& t, const c10::Device& d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda() && t.is_cpu()) return t.contiguous().pin_memory().to(d, /*non_blocking=*/true);
#endif
  return t.to(d);
}

WarmUp::WarmUp(const c10::Device& d, std::function<void()> more) {
#ifdef DFLASH_CUDA
  if (!d.is_cuda()) return;
  thread_ = std::thread([this, d, more = std::move(more)] {
    try {
      c10::DeviceGuard guard(d);
      const auto bf = at::TensorOptions().device(d).dtype(at::kBFloat16);
      {
        c10::InferenceMode inference;
        // no random draws: they would advance the device's default generator under the rank
        at::Tensor a = at::full({256, 256}, 0.5, bf), b = at::full({256, 256}, 0.25, bf);
        at::Tensor c = at::mm(a, b.t());
        c.addmm_(a, b.t());  // the residual products' form (x.addmm_)
        at::Tensor n = at::rms_norm(c, {256}, at::ones({256}, bf), 1e-6);
        at::Tensor ids = at::zeros({4}, at::TensorOptions().device(d).dtype(at::kLong));
        (void)at::aminmax(ids);  // the first reductions (token id checks)
        (void)at::embedding(n, ids);
      }
      // The autograd engine starts its thread for the device at the first backward there.
      at::Tensor w = at::ones({16, 16}, bf).requires_grad_(true);
      at::mm(w, w).sum().backward();
      if (more) more();
      c10::cuda::device_synchronize();
    } catch (...) {
      error_ = std::current_exception();
    }
  });
#endif
  (void)d;
  (void)more;
}

WarmUp::~WarmUp() {
  if (thread_.joinable()) thread_.join();
}

void WarmUp::wait() {
  if (thread_.joinable()) thread_.join();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void reset_peak(const c10::Device& d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(d.index());
#endif
  (void)d;
}

void empty_cache(const c10::Device& d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
  (void)d;
}

double peak_rss_gib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::istringstream ss(line.substr(6));
      double kb = 0;
      ss >> kb;
      return kb / (1024.0 * 1024.0);
    }
  }
  return 0.0;
}

}  // namespace dflash::device
