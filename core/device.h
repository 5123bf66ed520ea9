// Device helpers shared by the roles, the benchmarks and the tools: a full device sync (for
// honest host timings), memory statistics, and host-to-device uploads that do not wait for the
// device, the same on CPU and CUDA.
//
// Owns nothing. On CPU, sync is a no-op and the peak is the process's peak resident set
// (VmHWM); on CUDA it is the caching allocator's peak of allocated bytes on that device.
// Thread-safety: stateless; the CUDA calls are safe from any thread.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <exception>
#include <functional>
#include <thread>

namespace dflash::device {

// Waits for all work queued on `d` (no-op on CPU).
void sync(const c10::Device& d);
// Peak memory in GiB: CUDA allocator peak on `d`, else the process's peak RSS.
double peak_memory_gib(const c10::Device& d);
// Resets the CUDA allocator's peak statistics of `d` (no-op on CPU).
void reset_peak(const c10::Device& d);
// Returns cached CUDA blocks to the driver (no-op on CPU).
void empty_cache(const c10::Device& d);
// The process's peak resident set size in GiB (VmHWM of /proc/self/status; 0 if unknown).
double peak_rss_gib();
// t on `d`. A CPU tensor bound for a CUDA device goes through pinned memory and an asynchronous
// copy on the current stream, so the host does not wait for the work queued before it (a copy
// from pageable memory waits for the whole stream first: a sync in the middle of a step); the
// pinned block stays reserved until the copy is done (LibTorch's host allocator records it).
// Otherwise t.to(d).
at::Tensor to_device(const at::Tensor& t, const c10::Device& d);

// The one-time set-up that a rank's first step would otherwise pay on a CUDA device, run on a
// thread of its own while the rank loads its weights: the cuBLAS and cuBLASLt handles and their
// workspace (handed back to LibTorch's handle pool when the thread ends, so the rank's own thread
// takes them over) and the kernel modules of the first products, norms, embedding and
// reductions (CUDA loads modules lazily, at a kernel's first launch), and the autograd engine's
// device thread (started by the process's first backward on the device). Measured at 1 x 40000 on an
// H200: the first step's first GEMM launched ~96 ms late without it (bench/RESULTS.md). Nothing
// on CPU. `more` runs after these on the same thread (the models' own first ops, e.g.
// model::Drafter::warm_up_kernels). wait() joins and rethrows what the thread threw; the
// destructor joins and drops it.
class WarmUp {
 public:
  explicit WarmUp(const c10::Device& d, std::function<void()> more = {});
  WarmUp(const WarmUp&) = delete;  // the thread holds `this`
  WarmUp& operator=(const WarmUp&) = delete;
  ~WarmUp();
  void wait();

 private:
  std::thread thread_;
  std::exception_ptr error_;
};

}  // namespace dflash::device
