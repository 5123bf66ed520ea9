// Profiles under LibTorch's Kineto profiler, summarised by kind of work: one function
// (profile_ops: drafter_bench --profile) or a window of training steps on every rank
// (StepProfiler: log.profile_start / log.profile_steps, docs/training.md). On CUDA the summary
// sums the device's kernels (CUPTI: our own kernels and ATen's alike) and says how much of the wall
// time the device was busy; on the CPU it sums each operator's self time (its duration less its
// children's, per thread), so nested operators are not counted twice.
//
// Kinds, by the first rule that matches the lower-cased name: communication (NCCL's kernels),
// attention (our attn_* kernels, flash, fmha, sdpa), optimizer (adam, multi-tensor foreach
// kernels), matmul (gemm, cutlass, xmma, nvjet, cublas; on the CPU aten::mm, addmm, bmm), loss
// (softmax, logsumexp, cross entropy, nll), norm, reduce, views (host operators that only make a
// view or an empty tensor), data movement (copy, cat, index, gather, scatter, fill, memcpy,
// memset, transpose), elementwise, other. The rules are heuristics over kernel names: the
// top-kernel list beside the table shows what each kind holds.
// Thread-safety: StepProfiler belongs to the thread that runs the rank's loop (the profiler
// records that thread's operators and every CUDA kernel of the process).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <c10/core/Device.h>

namespace dflash::metrics {

struct ProfiledOp {
  std::string name;
  bool device = false;  // a device activity (kernel, memcpy, memset); else a host operator
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t thread = 0;  // host operators: the thread (self time is per thread)
};

// The kind of work of a kernel or operator name (the rules above).
std::string op_kind(const std::string& name);

struct ProfileRow {
  std::string name;
  double ms = 0;
  int64_t count = 0;
};

struct ProfileSummary {
  bool device = false;            // device activities summed (CUDA), else host self times
  double busy_ms = 0;             // their sum
  std::vector<ProfileRow> kinds;  // by op_kind, largest first
  std::vector<ProfileRow> top;    // by name, largest first
};

// Device activities when there are any (their durations), else the host operators' self times.
ProfileSummary summarize(std::vector<ProfiledOp> ops, size_t top_n);

// Runs fn once under the profiler (device activities too when `cuda`); fn must leave the device
// idle when it returns (a sync), so that every activity it launched is recorded. trace_path
// non-empty: the Chrome trace is written there too (through a temporary file).
std::vector<ProfiledOp> profile_ops(const std::function<void()>& fn, bool cuda, const std::string& trace_path = "");

// The summary as markdown: one table by kind (ms, share of the counted time, share of wall_ms,
// count), then the top kernels or operators (names cut to 100 characters).
std::string format_profile(const ProfileSummary& s, double wall_ms, const std::string& title);

// One line: "device busy 83% of 1.92 s: matmul 61%, attention 14%, ..." (kinds >= 1%).
std::string profile_line(const ProfileSummary& s, double wall_s);

// The profile of a window of training steps on one rank. begin(step) before the work of 1-based
// step `step`, end(step) after it (where the loop knows it; else the next begin() or finish()
// closes the window). The window is steps [start, start + count): it starts at the first begin()
// inside it and stops at end(last), begin(> last) or finish(); stopping waits for the device,
// writes <dir>/rank<R>.trace.json (Chrome trace: chrome://tracing, Perfetto, TensorBoard's
// profiler) and <dir>/rank<R>.md (the summary), each through a temporary file, and returns the
// console line. start <= 0: never profiles.
class StepProfiler {
 public:
  StepProfiler(int64_t start, int64_t count, std::string dir, int rank, std::string role, c10::Device device);
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Each returns the summary line when this call closed the window, else "".
  std::string begin(int64_t step);
  std::string end(int64_t step);
  std::string finish();

 private:
  std::string stop();
  int64_t start_, count_;
  std::string dir_, role_;
  int rank_;
  c10::Device device_;
  bool active_ = false, done_ = false;
  int64_t first_ = 0, last_seen_ = 0;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace dflash::metrics
