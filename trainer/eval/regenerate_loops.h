// The two engines of regenerate() (regenerate.h) and what they share; internal to trainer/eval.
// regenerate() validates the items and options, then runs one of them.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "trainer/eval/regenerate.h"

namespace dflash::eval {

// TargetCache, only the active rows run, one host read per step (regenerate.cpp).
RegenStats regenerate_cached(const model::TargetModel& model, const std::vector<RegenItem>& items,
                             const RegenOptions& o, int64_t longest,
                             const std::function<void(const RegenResult&)>& sink);
// StaticKVCache, device-side row state, host reads every check_every steps, CUDA graphs
// (regenerate_static.cpp). Dense targets only.
RegenStats regenerate_static(const model::TargetModel& model, const std::vector<RegenItem>& items,
                             const RegenOptions& o, int64_t longest,
                             const std::function<void(const RegenResult&)>& sink);

// Host uniforms -> float32 on `dev` (the one conversion both engines use: same samples).
at::Tensor uniforms_on(const std::vector<double>& u, at::Device dev);

namespace regen_detail {
using Clock = std::chrono::steady_clock;
inline double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
inline std::string human(double x) {
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  if (x >= 1e3) return fmt::format("{:.1f}K", x / 1e3);
  return fmt::format("{:.0f}", x);
}
inline void progress(int64_t done, size_t items, int64_t active, const RegenStats& st, Clock::time_point t0) {
  const double s = since(t0);
  std::fprintf(stderr, "regenerate: %lld/%zu done, %lld active | %s new tokens in %.0f s | %s tok/s\n",
               (long long)done, items, (long long)active, human(double(st.new_tokens)).c_str(), s,
               human(double(st.new_tokens) / std::max(s, 1e-9)).c_str());
}
}  // namespace regen_detail

}  // namespace dflash::eval
