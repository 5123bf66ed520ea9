// CUDA graphs of the regeneration decode step (regenerate_static.cpp): a step that reads and
// writes only static buffers (StaticKVCache, the loop's per-row state) is run eagerly the first
// time for each key (the attention window bucket: it fixes every shape), which is also the
// warm-up (lazy handles and workspaces are created outside any capture), captured the second
// time and replayed from then on. Disabled (or without CUDA in the build) run() simply calls the
// step: the eager path, the oracle of the graphed one.
//
// While enabled, the object keeps the current stream switched to a side stream from the pool
// for its whole lifetime (captures need a non-default stream; the loop's eager work runs on the
// same stream, so everything stays ordered). A sync inside a step makes the capture fail: the
// graph path doubles as the check that the step never reads the device from the host.
//
// Owns: the graphs (one private memory pool each). Thread-safety: one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include <c10/core/Device.h>

namespace dflash::eval {

class StepGraphs {
 public:
  // enabled only takes effect on a CUDA device in a CUDA build (enabled() says).
  StepGraphs(bool enabled, c10::Device device);
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  void run(int64_t key, const std::function<void()>& step);
  bool enabled() const { return impl_ != nullptr; }
  int64_t captured() const;  // graphs captured so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::eval
