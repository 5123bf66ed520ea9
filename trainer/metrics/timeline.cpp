#include "trainer/metrics/timeline.h"

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#ifdef DFLASH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif

#include "core/error.h"

namespace dflash::metrics {
namespace {
double steady_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Timeline::Timeline(const c10::Device& device) : device_(device) {}

Timeline::~Timeline() {
#ifdef DFLASH_CUDA
  for (Mark& m : marks_)
    if (m.event) cudaEventDestroy(static_cast<cudaEvent_t>(m.event));
#endif
}

int64_t Timeline::mark() {
  Mark m;
#ifdef DFLASH_CUDA
  if (device_.is_cuda()) {
    c10::cuda::CUDAGuard guard(device_);
    cudaEvent_t ev = nullptr;
    DFLASH_CHECK_CUDA(cudaEventCreate(&ev));
    DFLASH_CHECK_CUDA(cudaEventRecord(ev, c10::cuda::getCurrentCUDAStream(device_.index()).stream()));
    m.event = ev;
  }
#endif
  if (!m.event) m.host_s = steady_s();
  marks_.push_back(m);
  return next_++;
}

const Timeline::Mark& Timeline::at(int64_t id) const {
  DFLASH_CHECK(id >= first_ && id < next_, "timeline: mark {} is not held (held {}..{})", id, first_, next_ - 1);
  return marks_[static_cast<size_t>(id - first_)];
}

double Timeline::seconds(int64_t a, int64_t b) {
  DFLASH_CHECK(a <= b, "timeline: mark {} is after mark {}", a, b);
  const Mark& ma = at(a);
  const Mark& mb = at(b);
#ifdef DFLASH_CUDA
  if (ma.event && mb.event) {
    float ms = 0;
    DFLASH_CHECK_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(mb.event)));
    DFLASH_CHECK_CUDA(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(ma.event), static_cast<cudaEvent_t>(mb.event)));
    return static_cast<double>(ms) * 1e-3;
  }
#endif
  return mb.host_s - ma.host_s;
}

void Timeline::drop_before(int64_t id) {
  while (first_ < id && !marks_.empty()) {
#ifdef DFLASH_CUDA
    if (marks_.front().event) cudaEventDestroy(static_cast<cudaEvent_t>(marks_.front().event));
#endif
    marks_.pop_front();
    ++first_;
  }
}

double process_age_s() {
  // /proc/self/stat: "pid (comm) state ..." with starttime the 22nd field (clock ticks after boot);
  // comm may hold spaces, so fields are counted after the last ')'.
  std::ifstream f("/proc/self/stat");
  std::string stat((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = stat.rfind(')');
  std::ifstream u("/proc/uptime");
  double uptime = -1;
  if (close == std::string::npos || !(u >> uptime)) return -1;
  std::istringstream rest(stat.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i)
    if (!(rest >> field)) return -1;  // fields 3..22; the last one read is starttime
  const long ticks = sysconf(_SC_CLK_TCK);
  if (ticks <= 0) return -1;
  return uptime - std::stod(field) / static_cast<double>(ticks);
}

}  // namespace dflash::metrics
