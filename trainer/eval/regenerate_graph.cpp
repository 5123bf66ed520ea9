// trainer/eval/regenerate_graph.h: CUDA graphs of the decode step (CUDA builds), else eager.
#include "trainer/eval/regenerate_graph.h"

#include <map>
#include <optional>
#include <set>

#ifdef DFLASH_CUDA
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dflash::eval {

struct StepGraphs::Impl {
#ifdef DFLASH_CUDA
  explicit Impl(c10::Device d) : stream(c10::cuda::getStreamFromPool(false, d.index())), guard(stream) {}
  c10::cuda::CUDAStream stream;
  c10::cuda::CUDAStreamGuard guard;  // the side stream is current while the object lives
  std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> graphs;
  std::set<int64_t> warmed;
#endif
};

StepGraphs::StepGraphs(bool enabled, c10::Device device) {
#ifdef DFLASH_CUDA
  if (enabled && device.is_cuda()) {
    // The side stream starts after everything already queued on the current one (weights, cache).
    c10::cuda::getCurrentCUDAStream(device.index()).synchronize();
    impl_ = std::make_unique<Impl>(device);
  }
#else
  (void)enabled;
  (void)device;
#endif
}

StepGraphs::~StepGraphs() {
#ifdef DFLASH_CUDA
  if (impl_) impl_->stream.synchronize();  // replays finish before the graphs and the guard go
#endif
}

int64_t StepGraphs::captured() const {
#ifdef DFLASH_CUDA
  if (impl_) return int64_t(impl_->graphs.size());
#endif
  return 0;
}

void StepGraphs::run(int64_t key, const std::function<void()>& step) {
#ifdef DFLASH_CUDA
  if (impl_) {
    auto it = impl_->graphs.find(key);
    if (it != impl_->graphs.end()) {
      it->second->replay();
      return;
    }
    if (impl_->warmed.insert(key).second) {  // first time: a real step, eager, also the warm-up
      step();
      return;
    }
    auto g = std::make_unique<at::cuda::CUDAGraph>();
    g->capture_begin();
    step();  // recorded, not run
    g->capture_end();
    g->replay();  // this step's work
    impl_->graphs.emplace(key, std::move(g));
    return;
  }
#endif
  (void)key;
  step();
}

}  // namespace dflash::eval
