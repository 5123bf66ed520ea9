// profile_step.h: one run of a function under LibTorch's Kineto profiler, summarised by kind of
// work (header only; used by drafter_bench --profile). On CUDA it sums the device's kernels (CUPTI:
// our own kernels and ATen's alike) and says how much of the wall time the device was busy; on the
// CPU it sums each operator's self time (its duration less its children's, per thread), so nested
// operators are not counted twice.
//
// Kinds, by the first rule that matches the lower-cased name: attention (our attn_* kernels, flash,
// fmha, sdpa), optimizer (adam, multi-tensor foreach kernels), matmul (gemm, cutlass, xmma, nvjet,
// cublas; on the CPU aten::mm, addmm, bmm), loss (softmax, logsumexp, cross entropy, nll), norm,
// reduce, views (host operators that only make a view or an empty tensor), data movement (copy,
// cat, index, gather, scatter, fill, memcpy, memset, transpose), elementwise, other. The rules are heuristics over kernel names: the top-kernel list beside the
// table shows what each kind holds.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

namespace dflash::bench {

struct ProfiledOp {
  std::string name;
  bool device = false;  // a device activity (kernel, memcpy, memset); else a host operator
  uint64_t start_ns = 0, end_ns = 0;
  uint64_t thread = 0;  // host operators: the thread (self time is per thread)
};

inline std::string op_kind(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  auto any = [&](std::initializer_list<const char*> keys) {
    for (const char* k : keys)
      if (n.find(k) != std::string::npos) return true;
    return false;
  };
  if (any({"attn_", "flash", "fmha", "attention", "sdpa"})) return "attention";
  // host operators that only make a view or an empty tensor (no device work of their own)
  static const std::set<std::string> views = {"aten::view", "aten::as_strided", "aten::reshape", "aten::_reshape_alias",
                                              "aten::expand", "aten::slice", "aten::select", "aten::narrow",
                                              "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::t",
                                              "aten::transpose", "aten::detach", "aten::empty", "aten::empty_strided",
                                              "aten::alias", "aten::unflatten", "aten::flatten", "aten::split"};
  if (views.count(n)) return "views (host)";
  if (any({"adam", "multi_tensor_apply", "_foreach"})) return "optimizer";
  if (any({"gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "addmm", "bmm"})) return "matmul";
  if (any({"softmax", "logsumexp", "cross_entropy", "nll"})) return "loss";
  if (any({"norm"})) return "norm";
  if (any({"reduce", "aten::sum", "aten::max", "aten::mean"})) return "reduce";
  if (any({"copy", "aten::cat", "cat_", "index", "gather", "scatter", "fill", "memcpy", "memset", "transpose"}))
    return "data movement";
  if (any({"elementwise", "aten::"})) return "elementwise";
  return "other";
}

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
inline ProfileSummary summarize(std::vector<ProfiledOp> ops, size_t top_n) {
  ProfileSummary s;
  s.device = std::any_of(ops.begin(), ops.end(), [](const ProfiledOp& o) { return o.device; });
  std::vector<std::pair<const ProfiledOp*, double>> timed;  // op, ms counted
  if (s.device) {
    for (const auto& o : ops)
      if (o.device && o.end_ns >= o.start_ns) timed.push_back({&o, (o.end_ns - o.start_ns) / 1e6});
  } else {
    // Self time: per thread, in start order (a parent before the children it encloses), the
    // innermost open operator that encloses an operator is its parent.
    std::stable_sort(ops.begin(), ops.end(), [](const ProfiledOp& a, const ProfiledOp& b) {
      if (a.thread != b.thread) return a.thread < b.thread;
      if (a.start_ns != b.start_ns) return a.start_ns < b.start_ns;
      return a.end_ns > b.end_ns;
    });
    std::vector<double> self(ops.size());
    std::vector<size_t> open;
    for (size_t i = 0; i < ops.size(); ++i) {
      const ProfiledOp& o = ops[i];
      self[i] = o.end_ns >= o.start_ns ? (o.end_ns - o.start_ns) / 1e6 : 0.0;
      while (!open.empty() && (ops[open.back()].thread != o.thread || ops[open.back()].end_ns <= o.start_ns))
        open.pop_back();
      if (!open.empty()) self[open.back()] -= self[i];
      open.push_back(i);
    }
    for (size_t i = 0; i < ops.size(); ++i) timed.push_back({&ops[i], std::max(0.0, self[i])});
  }
  std::map<std::string, ProfileRow> kinds, names;
  for (const auto& [o, ms] : timed) {
    s.busy_ms += ms;
    ProfileRow& k = kinds[op_kind(o->name)];
    k.ms += ms, ++k.count;
    ProfileRow& n = names[o->name];
    n.ms += ms, ++n.count;
  }
  auto sorted = [](const std::map<std::string, ProfileRow>& m, size_t n) {
    std::vector<ProfileRow> v;
    for (const auto& [name, r] : m) v.push_back({name, r.ms, r.count});
    std::sort(v.begin(), v.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.ms > b.ms; });
    if (v.size() > n) v.resize(n);
    return v;
  };
  s.kinds = sorted(kinds, kinds.size());
  s.top = sorted(names, top_n);
  return s;
}

// Runs fn once under the profiler (device activities too when `cuda`); fn must leave the device
// idle when it returns (a sync), so that every activity it launched is recorded.
inline std::vector<ProfiledOp> profile_ops(const std::function<void()>& fn, bool cuda) {
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig cfg(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> acts = {ActivityType::CPU};
  if (cuda) acts.insert(ActivityType::CUDA);
  prof::prepareProfiler(cfg, acts);
  prof::enableProfiler(cfg, acts);
  try {
    fn();
  } catch (...) {
    prof::disableProfiler();
    throw;
  }
  std::unique_ptr<prof::ProfilerResult> res = prof::disableProfiler();
  std::vector<ProfiledOp> ops;
  for (const auto& e : res->events()) {
    ProfiledOp o;
    o.name = e.name();
    o.device = e.deviceType() != c10::DeviceType::CPU;
    o.start_ns = e.startNs(), o.end_ns = e.endNs();
    o.thread = e.startThreadId();
    ops.push_back(std::move(o));
  }
  return ops;
}

// The summary as markdown: one table by kind (ms, share of the counted time, share of wall_ms,
// count), then the top kernels or operators (names cut to 100 characters).
inline std::string format_profile(const ProfileSummary& s, double wall_ms, const std::string& title) {
  std::string out = fmt::format("{}: {} {:.1f} ms in a {:.1f} ms step ({:.0f}% of the wall time)\n\n", title,
                                s.device ? "device kernels busy" : "host operators' self time", s.busy_ms, wall_ms,
                                wall_ms > 0 ? 100 * s.busy_ms / wall_ms : 0.0);
  out += "| kind | ms | share | count |\n|---|---|---|---|\n";
  for (const auto& k : s.kinds)
    out += fmt::format("| {} | {:.1f} | {:.1f}% | {} |\n", k.name, k.ms, s.busy_ms > 0 ? 100 * k.ms / s.busy_ms : 0.0,
                       k.count);
  out += "\n| top " + std::string(s.device ? "kernels" : "operators") + " | kind | ms | count |\n|---|---|---|---|\n";
  for (const auto& t : s.top) {
    std::string n = t.name.rfind("void ", 0) == 0 ? t.name.substr(5) : t.name;
    if (n.size() > 100) n = n.substr(0, 97) + "...";
    for (char& c : n)
      if (c == '|') c = '/';
    out += fmt::format("| `{}` | {} | {:.2f} | {} |\n", n, op_kind(t.name), t.ms, t.count);
  }
  return out;
}

}  // namespace dflash::bench
