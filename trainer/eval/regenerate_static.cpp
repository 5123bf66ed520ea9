// The static engine of regenerate() (regenerate.h): continuous batching on a StaticKVCache with
// the rows' state on the device, host reads every check_every steps, CUDA graphs of the step.
//
// Device state per row b (all [rows] unless said): last (the token fed next), n_gen (tokens
// produced so far), alive, out [rows, max_new + 1] (the tokens; column max_new takes the
// writes of finished rows that already hold max_new), uni [rows, max_new] (the sampling
// uniforms, counter_uniform(seed, j) for token j, uploaded at the row's prefill). A step:
// logits of every row at its length, one token per row, out[b, n_gen] = token, n_gen and the
// length advance where alive, alive &= not a stop id and n_gen < max_new. A finished row runs
// on as a dummy (its writes land past its end) until the host sees it at the next check.
//
// Host state: which item each row holds, and per row an upper bound of its length (its
// prompt plus the steps since its prefill, at most prompt + max_new - 1) that sizes the
// attention window, and the exact count of steps since the prefill (an alive row produces one
// token per step, so the host knows when a row reaches max_new and checks right then).
#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/device.h"
#include "core/error.h"
#include "trainer/eval/regenerate_graph.h"
#include "trainer/eval/regenerate_loops.h"
#include "trainer/model/target_cache_static.h"

namespace dflash::eval {

using namespace regen_detail;

RegenStats regenerate_static(const model::TargetModel& model, const std::vector<RegenItem>& items,
                             const RegenOptions& o, int64_t longest,
                             const std::function<void(const RegenResult&)>& sink) {
  c10::InferenceMode guard;
  RegenStats st;
  st.engine = "static";
  const int64_t N = int64_t(items.size()), M = o.max_new_tokens;
  const int64_t B = std::min<int64_t>(o.batch_size, N);
  const int64_t refill = o.refill_rows > 0 ? std::min(o.refill_rows, B) : std::max<int64_t>(1, B / 16);
  const bool sampled = o.temperature > 0;
  const at::Device dev = model.device();
  const std::set<int64_t> stop(o.stop_ids.begin(), o.stop_ids.end());
  const auto t0 = Clock::now();

  StepGraphs graphs(o.cuda_graphs, dev);  // first: on CUDA the loop's work runs on its stream
  model::StaticKVCache cache(model, B, longest + M);
  auto lopt = at::TensorOptions().dtype(at::kLong).device(dev);
  at::Tensor last = at::zeros({B}, lopt), n_gen = at::zeros({B}, lopt), out = at::zeros({B, M + 1}, lopt);
  at::Tensor alive = at::zeros({B}, lopt.dtype(at::kBool));
  at::Tensor uni = sampled ? at::zeros({B, M}, lopt.dtype(at::kFloat)) : at::Tensor();
  at::Tensor stop_t = at::tensor(o.stop_ids, at::kLong).to(dev);
  auto on_dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(dev); };
  auto stops = [&](const at::Tensor& tok) {  // [n] bool: tok is a stop id
    return stop_t.numel() ? (tok.unsqueeze(1) == stop_t).any(1) : at::zeros(tok.sizes(), tok.options().dtype(at::kBool));
  };

  std::vector<const RegenItem*> row_item(B, nullptr);
  std::vector<int64_t> prompt_len(B, 0), since_prefill(B, 0);
  size_t next_item = 0;
  int64_t active = 0, done = 0;
  auto last_progress = t0;

  // The decode step: only static buffers, no host tensor, no host read.
  auto step = [&](int64_t window) {
    at::Tensor logits = cache.step(last, window);
    at::Tensor u = sampled ? uni.gather(1, n_gen.clamp_max(M - 1).unsqueeze(1)).squeeze(1) : at::Tensor();
    at::Tensor tok = sample_tokens(logits, o.temperature, o.top_p, u);
    out.scatter_(1, n_gen.unsqueeze(1), tok.unsqueeze(1));
    at::Tensor a = alive.to(at::kLong);
    n_gen.add_(a);
    cache.lengths().add_(a);
    alive.logical_and_(stops(tok).logical_not()).logical_and_(n_gen < M);
    last.copy_(tok);
  };

  // Prompts into the free rows, their first tokens recorded on the device.
  auto fill = [&]() {
    const auto tf = Clock::now();
    std::vector<int64_t> which;
    std::vector<std::vector<int64_t>> prompts;
    std::vector<double> u;
    for (int64_t b = 0; b < B && next_item < items.size(); ++b) {
      if (row_item[b]) continue;
      const RegenItem* it = &items[next_item++];
      row_item[b] = it;
      prompt_len[b] = int64_t(it->ids.size());
      since_prefill[b] = 0;
      which.push_back(b);
      prompts.push_back(it->ids);
      st.prompt_tokens += prompt_len[b];
      ++active;
      if (sampled)
        for (int64_t j = 0; j < M; ++j) u.push_back(counter_uniform(it->seed, uint64_t(j)));
    }
    at::Tensor logits = cache.prefill(which, prompts);
    ++st.prefills;
    at::Tensor w = on_dev(which);
    at::Tensor u0;
    if (sampled) {
      uni.index_copy_(0, w, uniforms_on(u, dev).view({int64_t(which.size()), M}));
      u0 = uni.index_select(0, w).select(1, 0);
    }
    at::Tensor tok = sample_tokens(logits, o.temperature, o.top_p, u0);
    out.index_put_({w, at::zeros_like(w)}, tok);
    n_gen.index_fill_(0, w, 1);
    at::Tensor al = stops(tok).logical_not();
    if (M <= 1) al.zero_();  // the first token was the last
    alive.index_put_({w}, al);
    last.index_put_({w}, tok);
    device::sync(dev);  // one per refill: its time is its own (stats)
    st.prefill_s += since(tf);
  };

  // The host read: rows that finished go to the sink and are freed (length 0).
  auto harvest = [&]() {
    at::Tensor h = at::stack({alive.to(at::kLong), n_gen}).to(at::kCPU).contiguous();
    ++st.host_reads;
    const int64_t* al = h.data_ptr<int64_t>();
    const int64_t* ng = al + B;
    std::vector<int64_t> fin;
    for (int64_t b = 0; b < B; ++b)
      if (row_item[b] && !al[b]) fin.push_back(b);
    if (fin.empty()) return;
    at::Tensor f = on_dev(fin);
    at::Tensor toks = out.index_select(0, f).to(at::kCPU).contiguous();
    cache.lengths().index_fill_(0, f, 0);
    for (size_t j = 0; j < fin.size(); ++j) {
      const int64_t b = fin[j], n = ng[b];
      const int64_t* p = toks.data_ptr<int64_t>() + int64_t(j) * (M + 1);
      RegenResult res{row_item[b], std::vector<int64_t>(p, p + n), stop.count(p[n - 1]) > 0};
      st.new_tokens += n;
      row_item[b] = nullptr;
      prompt_len[b] = 0;
      --active;
      ++done;
      sink(res);
    }
  };

  while (done < N) {
    const int64_t free_rows = B - active;
    if (next_item < items.size() && free_rows > 0 && (free_rows >= refill || active == 0)) fill();
    // Steps until the next check: check_every, or fewer when a row reaches max_new before.
    int64_t k = M > 1 ? o.check_every : 0;
    for (int64_t b = 0; b < B; ++b)
      if (row_item[b]) k = std::min(k, std::max<int64_t>(0, M - 1 - since_prefill[b]));
    for (int64_t i = 0; i < k; ++i) {
      int64_t bound = 0;  // > every row's length
      for (int64_t b = 0; b < B; ++b)
        if (row_item[b]) bound = std::max(bound, std::min(prompt_len[b] + since_prefill[b], prompt_len[b] + M - 1) + 1);
      const int64_t window = std::min(cache.capacity(), (std::max<int64_t>(bound, 1) + o.window_bucket - 1) /
                                                            o.window_bucket * o.window_bucket);
      graphs.run(window, [&] { step(window); });
      ++st.steps;
      for (int64_t b = 0; b < B; ++b)
        if (row_item[b]) ++since_prefill[b];
    }
    harvest();
    if (o.progress_s > 0 && since(last_progress) >= o.progress_s) {
      last_progress = Clock::now();
      progress(done, items.size(), active, st, t0);
    }
  }
  device::sync(dev);
  st.graphs = graphs.captured();
  st.items = N;
  st.seconds = since(t0);
  return st;
}

}  // namespace dflash::eval
