#include "trainer/metrics/profile.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "core/device.h"
#include "core/files.h"

namespace dflash::metrics {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

void enable(bool cuda) {
  // Without a GPU, a CUDA build's Kineto still asks CUPTI for devices and logs an ERROR line
  // ("gpuGetDeviceCount failed") that means nothing here: quiet it unless the user set a level.
  if (!cuda) setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  const torch::profiler::impl::ProfilerConfig cfg(torch::profiler::impl::ProfilerState::KINETO);
  std::set<ActivityType> acts = {ActivityType::CPU};
  if (cuda) acts.insert(ActivityType::CUDA);
  prof::prepareProfiler(cfg, acts);
  prof::enableProfiler(cfg, acts);
}

std::vector<ProfiledOp> ops_of(const prof::ProfilerResult& res) {
  std::vector<ProfiledOp> ops;
  for (const auto& e : res.events()) {
    ProfiledOp o;
    o.name = e.name();
    o.device = e.deviceType() != c10::DeviceType::CPU;
    o.start_ns = e.startNs(), o.end_ns = e.endNs();
    o.thread = e.startThreadId();
    ops.push_back(std::move(o));
  }
  return ops;
}

}  // namespace

std::string op_kind(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return char(std::tolower(c)); });
  // the project's own namespace holds "flash": every dflash:: kernel would read as attention
  for (size_t at = n.find("dflash::"); at != std::string::npos; at = n.find("dflash::", at)) n.erase(at, 8);
  auto any = [&](std::initializer_list<const char*> keys) {
    for (const char* k : keys)
      if (n.find(k) != std::string::npos) return true;
    return false;
  };
  if (any({"nccl"})) return "communication";  // NCCL's kernels (sends, receives, all-reduce)
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
  if (any({"softmax", "logsumexp", "cross_entropy", "nll", "ce_stats", "ce_grad"})) return "loss";
  if (any({"norm"})) return "norm";
  if (any({"reduce", "aten::sum", "aten::max", "aten::mean"})) return "reduce";
  if (any({"copy", "aten::cat", "cat_", "index", "gather", "scatter", "fill", "memcpy", "memset", "transpose"}))
    return "data movement";
  if (any({"elementwise", "aten::", "rope", "silu", "swiglu"})) return "elementwise";
  return "other";
}

// Device activities when there are any (their durations), else the host operators' self times.
ProfileSummary summarize(std::vector<ProfiledOp> ops, size_t top_n) {
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

std::vector<ProfiledOp> profile_ops(const std::function<void()>& fn, bool cuda, const std::string& trace_path) {
  enable(cuda);
  try {
    fn();
  } catch (...) {
    prof::disableProfiler();
    throw;
  }
  std::unique_ptr<prof::ProfilerResult> res = prof::disableProfiler();
  if (!trace_path.empty()) {
    res->save(trace_path + ".tmp");
    files::rename_durable(trace_path + ".tmp", trace_path);
  }
  return ops_of(*res);
}

std::string format_profile(const ProfileSummary& s, double wall_ms, const std::string& title) {
  std::string out = fmt::format("{}: {} {:.1f} ms in {:.1f} ms ({:.0f}% of the wall time)\n\n", title,
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
      if (c == '|' || c == '`') c = '/';
    out += fmt::format("| `{}` | {} | {:.2f} | {} |\n", n, op_kind(t.name), t.ms, t.count);
  }
  return out;
}

std::string profile_line(const ProfileSummary& s, double wall_s) {
  std::string out = fmt::format("{} {:.0f}% of {:.2f} s", s.device ? "device busy" : "host operators",
                                wall_s > 0 ? 100 * s.busy_ms / 1e3 / wall_s : 0.0, wall_s);
  std::string sep = ": ";
  for (const auto& k : s.kinds) {
    const double share = s.busy_ms > 0 ? 100 * k.ms / s.busy_ms : 0.0;
    if (share < 1) continue;
    out += fmt::format("{}{} {:.0f}%", sep, k.name, share);
    sep = ", ";
  }
  return out;
}

StepProfiler::StepProfiler(int64_t start, int64_t count, std::string dir, int rank, std::string role, c10::Device device)
    : start_(start), count_(std::max<int64_t>(1, count)), dir_(std::move(dir)), role_(std::move(role)), rank_(rank),
      device_(device) {}

StepProfiler::~StepProfiler() {
  if (active_) {
    try {
      prof::disableProfiler();  // an exception unwinding the loop: no files
    } catch (...) {
    }
  }
}

std::string StepProfiler::begin(int64_t step) {
  if (start_ <= 0 || done_) return "";
  const int64_t last = start_ + count_ - 1;
  if (active_ && step > last) return stop();
  if (!active_ && step >= start_ && step <= last) {
    enable(device_.is_cuda());
    active_ = true;
    first_ = step;
    t0_ = std::chrono::steady_clock::now();
  }
  if (active_) last_seen_ = std::max(last_seen_, step);
  return "";
}

std::string StepProfiler::end(int64_t step) {
  if (active_ && step >= start_ + count_ - 1) return stop();
  return "";
}

std::string StepProfiler::finish() { return active_ ? stop() : ""; }

std::string StepProfiler::stop() {
  device::sync(device_);  // every kernel of the window finished, so recorded
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  std::unique_ptr<prof::ProfilerResult> res = prof::disableProfiler();
  active_ = false, done_ = true;
  files::make_dirs(dir_);
  const std::string base = files::join(dir_, fmt::format("rank{}", rank_));
  const std::string trace = base + ".trace.json", tmp = trace + ".tmp";
  res->save(tmp);
  files::rename_durable(tmp, trace);
  const ProfileSummary s = summarize(ops_of(*res), 25);
  const std::string steps = first_ == last_seen_ ? fmt::format("step {}", first_)
                                                 : fmt::format("steps {}..{}", first_, last_seen_);
  files::write_file_atomic(base + ".md", format_profile(s, wall * 1e3, fmt::format("rank {} ({}), {}", rank_, role_, steps)));
  return fmt::format("profile of {} ({}): {}; {}", steps, role_, profile_line(s, wall), trace);
}

}  // namespace dflash::metrics
