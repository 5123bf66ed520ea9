#include "core/device.h"

#include <fstream>
#include <sstream>
#include <string>

#ifdef DFLASH_CUDA
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
