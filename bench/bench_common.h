// bench_common.h: what the benchmark binaries share (header only: every bench/*.cpp is its own
// binary): the device they run on, waiting for it, the median time of repeated runs, the --shapes
// list of B x S, and the matmul ceiling that MFU is measured against.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>
#endif

#include "core/error.h"

namespace dflash::bench {

// CUDA device 0 when there is one (and the build has CUDA), else the CPU.
inline at::Device bench_device() {
#ifdef DFLASH_CUDA
  if (at::hasCUDA()) return at::Device(at::kCUDA, 0);
#endif
  return at::kCPU;
}

inline void sync(at::Device d) {
#ifdef DFLASH_CUDA
  if (d.is_cuda()) cudaDeviceSynchronize();
#endif
  (void)d;
}

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// How a run is timed on CUDA: CUDA events on the current stream (the GPU's time), or the wall
// clock with a device synchronisation after each run (what a Python loop with
// torch.cuda.synchronize() measures, for benchmarks compared with one). The CPU: always the wall.
enum class Timing { Events, Wall };

// Median seconds of `fn` over `iters` runs after 2 warm-ups.
template <typename F>
double time_median(at::Device dev, int iters, F fn, Timing timing = Timing::Events) {
  for (int i = 0; i < 2; ++i) fn();
  sync(dev);
  std::vector<double> t;
#ifdef DFLASH_CUDA
  if (dev.is_cuda() && timing == Timing::Events) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    auto stream = at::cuda::getCurrentCUDAStream().stream();
    for (int i = 0; i < iters; ++i) {
      cudaEventRecord(a, stream);
      fn();
      cudaEventRecord(b, stream);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      t.push_back(ms / 1e3);
    }
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
#endif
  (void)timing;
  if (t.empty()) {
    for (int i = 0; i < iters; ++i) {
      auto t0 = std::chrono::steady_clock::now();
      fn();
      sync(dev);
      t.push_back(seconds_since(t0));
    }
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// "8x2048,4x4096" -> {{8, 2048}, {4, 4096}}; a part without an 'x' is a user error.
inline std::vector<std::pair<int64_t, int64_t>> parse_shapes(const std::string& v) {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  for (size_t p = 0; p < v.size();) {
    size_t e = v.find(',', p);
    if (e == std::string::npos) e = v.size();
    std::string s = v.substr(p, e - p);
    size_t x = s.find('x');
    if (x == std::string::npos) throw_user("--shapes: '{}' is not BxS", s);
    shapes.emplace_back(std::stoll(s.substr(0, x)), std::stoll(s.substr(x + 1)));
    p = e + 1;
  }
  return shapes;
}

// FLOP/s of an n x n x n matmul in `dtype` on `dev` (median of `iters`): the ceiling for MFU.
inline double matmul_flops(at::Device dev, at::ScalarType dtype, int64_t n, int iters,
                           Timing timing = Timing::Events) {
  auto opt = at::TensorOptions().dtype(dtype).device(dev);
  at::Tensor x = at::randn({n, n}, opt), y = at::randn({n, n}, opt), z = at::empty({n, n}, opt);
  return 2.0 * n * n * n / time_median(dev, iters, [&] { at::mm_out(z, x, y); }, timing);
}

}  // namespace dflash::bench
