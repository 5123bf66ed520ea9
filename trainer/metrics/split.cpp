#include "trainer/metrics/split.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "trainer/metrics/metrics.h"

namespace dflash::metrics {
namespace {

SplitOption option(int64_t t, int64_t d, double s_rate, double d_rate) {
  SplitOption o;
  o.target_ranks = t;
  o.drafter_ranks = d;
  const double supply = static_cast<double>(t) * s_rate, demand = static_cast<double>(d) * d_rate;
  o.tok_s = std::min(supply, demand);
  const double rel = std::abs(supply - demand) / std::max(supply, demand);
  o.bound = rel < 0.02 ? "balanced" : (supply < demand ? "target" : "drafter");
  return o;
}

}  // namespace

SplitAdvice recommend_split(int64_t gpus, double s, double d) {
  SplitAdvice a;
  if (gpus < 1 || !(s > 0) || !(d > 0) || !std::isfinite(s) || !std::isfinite(d)) return a;
  a.gpus = gpus;
  a.target_tok_s = s;
  a.drafter_tok_s = d;
  a.colocated.tok_s = 1.0 / (1.0 / s + 1.0 / d);
  a.colocated.bound = "both";
  for (int64_t t = 1; t < gpus; ++t) {
    a.options.push_back(option(t, gpus - t, s, d));
    // ties go to more drafter ranks: the drafter side has the state worth scaling
    if (a.best.target_ranks == 0 || a.options.back().tok_s > a.best.tok_s) a.best = a.options.back();
  }
  return a;
}

std::string format_split(const SplitAdvice& a) {
  if (a.gpus == 0) return "split: not enough measurements yet";
  std::string s = fmt::format("measured per rank: target {} tok/s, drafter {} tok/s", human(a.target_tok_s),
                              human(a.drafter_tok_s));
  if (a.gpus >= 2)
    s += fmt::format("; best on {} GPUs: {} target + {} drafter ranks, {} tok/s ({}-bound)", a.gpus,
                     a.best.target_ranks, a.best.drafter_ranks, human(a.best.tok_s), a.best.bound);
  s += fmt::format("; colocated: {} tok/s per GPU", human(a.colocated.tok_s));
  return s;
}

std::string split_json(const SplitAdvice& a) {
  std::string opts;
  for (const auto& o : a.options)
    opts += fmt::format("{}{{\"target_ranks\":{},\"drafter_ranks\":{},\"tok_s\":{:.1f},\"bound\":\"{}\"}}",
                        opts.empty() ? "" : ",", o.target_ranks, o.drafter_ranks, o.tok_s, o.bound);
  return fmt::format(
      "{{\"gpus\":{},\"target_tok_s_per_rank\":{:.1f},\"drafter_tok_s_per_rank\":{:.1f},"
      "\"best\":{{\"target_ranks\":{},\"drafter_ranks\":{},\"tok_s\":{:.1f},\"bound\":\"{}\"}},"
      "\"colocated_tok_s\":{:.1f},\"options\":[{}]}}",
      a.gpus, a.target_tok_s, a.drafter_tok_s, a.best.target_ranks, a.best.drafter_ranks, a.best.tok_s,
      a.best.bound, a.colocated.tok_s, opts);
}

}  // namespace dflash::metrics
