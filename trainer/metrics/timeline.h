// Honest time of device work without a device sync: marks on the current stream, read late.
//
// Owns: a Timeline of marks on one device. On CUDA a mark is an event recorded on the current
// stream, so the time between two marks is the time the stream took between them (queued
// work and any idle gap in which it waited for the host); reading it waits for the later event
// only, never for the device (cudaDeviceSynchronize would also wait for the communicator's
// NCCL streams, where a send blocked on a slow receiver turned the target's back-pressure
// wait into "busy" time), and costs nothing once the work is done, e.g. when read a step late.
// On CPU, work is synchronous and a mark is the host's steady clock.
// Also the process's age (seconds since the kernel started it), for the time to first step.
// Thread-safety: a Timeline is used by one thread.
#pragma once

#include <cstdint>
#include <deque>

#include <c10/core/Device.h>

namespace dflash::metrics {

class Timeline {
 public:
  explicit Timeline(const c10::Device& device);
  ~Timeline();
  Timeline(const Timeline&) = delete;
  Timeline& operator=(const Timeline&) = delete;

  // A mark at this point of the current stream (CUDA) or now (CPU); ids increase from 0.
  int64_t mark();
  // Seconds from mark a to mark b (a before b; both not yet dropped). Waits until the work
  // before b is done (CUDA: b's event), not for the rest of the device.
  double seconds(int64_t a, int64_t b);
  // Frees the marks before `id` (they can no longer be read).
  void drop_before(int64_t id);
  int64_t last() const { return next_ - 1; }  // -1 before the first mark

 private:
  struct Mark {
    void* event = nullptr;  // cudaEvent_t on CUDA
    double host_s = 0;      // steady clock on CPU
  };
  const Mark& at(int64_t id) const;
  c10::Device device_;
  std::deque<Mark> marks_;  // ids first_ .. next_-1
  int64_t first_ = 0, next_ = 0;
};

// Seconds since this process was started (from /proc/self/stat and /proc/uptime, 10 ms
// resolution: it includes loading the program's libraries, before main); < 0 if unknown.
double process_age_s();

}  // namespace dflash::metrics
