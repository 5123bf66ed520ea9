// Regeneration with the target (see regenerate.h): the sampler, the checks, and the cache
// engine (continuous batching on a TargetCache); the static engine is regenerate_static.cpp,
// the command regenerate_command.cpp.
#include "trainer/eval/regenerate.h"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <fmt/format.h>

#include "core/device.h"
#include "core/error.h"
#include "trainer/eval/regenerate_loops.h"
#include "trainer/model/target_cache.h"

namespace dflash::eval {

using namespace regen_detail;

double counter_uniform(uint64_t seed, uint64_t step) {
  uint64_t z = seed ^ (step * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL);
  for (int r = 0; r < 2; ++r) {  // two rounds of splitmix64's finaliser
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
  }
  return double(z >> 11) * 0x1.0p-53;
}

at::Tensor sample_tokens(const at::Tensor& logits, double temperature, double top_p, const at::Tensor& u) {
  c10::InferenceMode guard;
  const int64_t V = logits.size(1);
  if (temperature <= 0) return logits.argmax(-1);
  at::Tensor probs = at::softmax(logits.to(at::kFloat) / temperature, -1);
  at::Tensor order;
  if (top_p < 1.0) {
    auto sorted = probs.sort(-1, /*descending=*/true);
    probs = std::get<0>(sorted);
    order = std::get<1>(sorted);
    // keep a token while the mass before it is < top_p (the most probable is always kept)
    at::Tensor before = probs.cumsum(-1) - probs;
    probs = probs * (before < top_p);
  }
  at::Tensor cdf = probs.cumsum(-1);                                   // [n, V]
  at::Tensor target = u.to(at::kFloat).unsqueeze(1) * cdf.narrow(1, V - 1, 1);  // [n, 1]
  // the first index whose cumulative mass exceeds u * total (never a zero-mass token)
  at::Tensor j = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).clamp_max(V - 1);
  return order.defined() ? order.gather(1, j).squeeze(1) : j.squeeze(1);
}

at::Tensor uniforms_on(const std::vector<double>& u, at::Device dev) {
  return at::tensor(u, at::kDouble).to(dev, at::kFloat);
}

std::vector<int64_t> sample_rows(const at::Tensor& logits, double temperature, double top_p,
                                 const std::vector<double>& u) {
  c10::InferenceMode guard;
  const int64_t n = logits.size(0);
  at::Tensor uu;
  if (temperature > 0) {
    if (int64_t(u.size()) != n) throw std::logic_error("sample_rows: one uniform per row");
    uu = uniforms_on(u, logits.device());
  }
  at::Tensor h = sample_tokens(logits, temperature, top_p, uu).to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(h.data_ptr<int64_t>(), h.data_ptr<int64_t>() + n);
}

RegenStats regenerate(const model::TargetModel& model, const std::vector<RegenItem>& items,
                      const RegenOptions& o, const std::function<void(const RegenResult&)>& sink) {
  c10::InferenceMode guard;
  RegenStats st;
  if (items.empty()) return st;
  if (o.batch_size < 1) throw_user("regenerate: batch size must be >= 1, got {}", o.batch_size);
  if (o.max_new_tokens < 1) throw_user("regenerate: max new tokens must be >= 1, got {}", o.max_new_tokens);
  if (o.temperature < 0 || !(o.top_p > 0 && o.top_p <= 1))
    throw_user("regenerate: temperature must be >= 0 and top_p in (0, 1], got {} and {}", o.temperature, o.top_p);
  if (o.check_every < 1 || o.window_bucket < 1)
    throw_user("regenerate: check every and window bucket must be >= 1, got {} and {}", o.check_every,
               o.window_bucket);
  if (o.engine == RegenOptions::Engine::Static && model.hybrid())
    throw_user("regenerate: the static engine serves dense targets; {} needs the cache engine",
               model.config().model_type);
  const int64_t V = model.config().vocab_size;
  int64_t longest = 0;
  for (const auto& it : items) {
    if (it.ids.empty()) throw_user("regenerate: prompt '{}' is empty", it.key);
    for (int64_t t : it.ids)
      if (t < 0 || t >= V) throw_user("regenerate: prompt '{}' has token id {} outside the vocabulary [0, {})", it.key, t, V);
    longest = std::max<int64_t>(longest, int64_t(it.ids.size()));
  }
  const bool use_static = o.engine == RegenOptions::Engine::Static ||
                          (o.engine == RegenOptions::Engine::Auto && !model.hybrid());
  if (use_static) return regenerate_static(model, items, o, longest, sink);
  return regenerate_cached(model, items, o, longest, sink);
}

RegenStats regenerate_cached(const model::TargetModel& model, const std::vector<RegenItem>& items,
                             const RegenOptions& o, int64_t longest,
                             const std::function<void(const RegenResult&)>& sink) {
  c10::InferenceMode guard;
  RegenStats st;
  st.engine = "cache";
  const int64_t B = std::min<int64_t>(o.batch_size, int64_t(items.size()));
  const int64_t refill = o.refill_rows > 0 ? std::min(o.refill_rows, B) : std::max<int64_t>(1, B / 16);
  const std::set<int64_t> stop(o.stop_ids.begin(), o.stop_ids.end());
  model::TargetCache cache(model, B, longest + o.max_new_tokens);

  struct Row {
    const RegenItem* item = nullptr;  // nullptr: free
    std::vector<int64_t> out;
  };
  std::vector<Row> rows(B);
  size_t next_item = 0;
  int64_t active = 0, done = 0;
  const auto t0 = Clock::now();
  auto last_progress = t0;

  // Appends token t to row b; finishes the row (sink, crop, free) when it stops.
  auto take = [&](int64_t b, int64_t t) -> void {
    Row& r = rows[b];
    r.out.push_back(t);
    ++st.new_tokens;
    const bool hit = stop.count(t) > 0;
    if (hit || int64_t(r.out.size()) >= o.max_new_tokens) {
      RegenResult res{r.item, std::move(r.out), hit};
      sink(res);
      r = Row{};
      cache.crop(b, 0);
      --active;
      ++done;
    }
  };
  auto uniforms = [&](const std::vector<int64_t>& which) {
    std::vector<double> u;
    if (o.temperature > 0)
      for (int64_t b : which) u.push_back(counter_uniform(rows[b].item->seed, rows[b].out.size()));
    return u;
  };

  while (done < int64_t(items.size())) {
    // Refill free rows when enough are free (or nothing else would run).
    const int64_t free_rows = B - active;
    if (next_item < items.size() && free_rows > 0 && (free_rows >= refill || active == 0)) {
      const auto tf = Clock::now();
      std::vector<std::vector<int64_t>> prompts(B);
      std::vector<int64_t> filled;
      for (int64_t b = 0; b < B && next_item < items.size(); ++b) {
        if (rows[b].item) continue;
        rows[b].item = &items[next_item++];
        prompts[b] = rows[b].item->ids;
        st.prompt_tokens += int64_t(prompts[b].size());
        filled.push_back(b);
        ++active;
      }
      auto step = cache.prefill(prompts, model::TargetCache::Logits::Last);
      ++st.prefills;
      ++st.host_reads;
      auto next = sample_rows(step.logits, o.temperature, o.top_p, uniforms(filled));
      st.prefill_s += since(tf);  // sample_rows read the tokens: the prefill is done
      for (size_t j = 0; j < filled.size(); ++j) take(filled[j], next[j]);
    }
    if (active == 0) continue;
    // One decode step: every active row by its last token.
    std::vector<std::vector<int64_t>> tokens(B);
    std::vector<int64_t> ran;
    for (int64_t b = 0; b < B; ++b)
      if (rows[b].item) {
        tokens[b] = {rows[b].out.back()};
        ran.push_back(b);
      }
    auto step = cache.extend(tokens, model::TargetCache::Logits::Last);
    ++st.steps;
    auto next = sample_rows(step.logits, o.temperature, o.top_p, uniforms(ran));
    ++st.host_reads;
    for (size_t j = 0; j < ran.size(); ++j) take(ran[j], next[j]);
    if (o.progress_s > 0 && since(last_progress) >= o.progress_s) {
      last_progress = Clock::now();
      progress(done, items.size(), active, st, t0);
    }
  }
  device::sync(model.device());
  st.items = int64_t(items.size());
  st.seconds = since(t0);
  return st;
}


}  // namespace dflash::eval
