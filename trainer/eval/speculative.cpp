// trainer/eval/speculative.h: the speculative decoding loop, the sampler, plain decoding.
#include "trainer/eval/speculative.h"

#include <algorithm>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "core/error.h"
#include "core/random.h"

namespace dflash::eval {
namespace {

int64_t longest(const std::vector<std::vector<int64_t>>& prompts) {
  int64_t n = 0;
  for (size_t b = 0; b < prompts.size(); ++b) {
    if (prompts[b].empty()) throw_user("decode: prompt {} of the batch is empty", b);
    n = std::max<int64_t>(n, int64_t(prompts[b].size()));
  }
  return n;
}

void check_limits(const DecodeOptions& o) {
  if (o.max_new_tokens < 1) throw_user("eval.max_new_tokens must be >= 1, got {}", o.max_new_tokens);
  if (o.temperature < 0) throw_user("eval.temperature must be >= 0, got {}", o.temperature);
}

void check_ids(size_t prompts, size_t ids) {
  if (prompts != ids) throw_user("decode: {} prompts but {} prompt ids", prompts, ids);
}

}  // namespace

void check_speculative_options(const DecodeOptions& o, int64_t max_block_size) {
  check_limits(o);
  if (o.block_size < 2 || o.block_size > max_block_size)
    throw_user("eval.block_size {} must be in [2, {}] (the drafter's block size)", o.block_size, max_block_size);
}

double RowResult::tau() const {
  if (accepted.empty()) return 0;
  double s = 0;
  for (auto a : accepted) s += double(a + 1);
  return s / double(accepted.size());
}

double sample_uniform(uint64_t seed, int64_t prompt, int64_t position) {
  uint64_t h = splitmix64(splitmix64(splitmix64(seed) ^ uint64_t(prompt)) ^ uint64_t(position));
  return double(h >> 11) * 0x1.0p-53;
}

std::vector<int64_t> choose_tokens(const at::Tensor& logits, const std::vector<int64_t>& prompt,
                                   const std::vector<int64_t>& position, double temperature, uint64_t seed) {
  c10::InferenceMode guard;
  const int64_t R = logits.size(0);
  DFLASH_CHECK(int64_t(prompt.size()) == R && int64_t(position.size()) == R, "choose_tokens: {} rows, {}/{} keys",
               R, prompt.size(), position.size());
  at::Tensor tok;
  if (temperature == 0) {
    tok = logits.argmax(-1);
  } else {
    at::Tensor cdf = at::softmax(logits.to(at::kFloat) / temperature, -1).cumsum(-1);
    std::vector<float> u(R);
    for (int64_t r = 0; r < R; ++r) u[r] = float(sample_uniform(seed, prompt[r], position[r]));
    at::Tensor ut = at::tensor(u, at::kFloat).to(logits.device()).view({R, 1});
    // The first token whose cumulative probability exceeds u (rounding may leave the total
    // just below 1: clamp to the last token).
    tok = at::searchsorted(cdf.contiguous(), ut, /*out_int32=*/false, /*right=*/true).view({R})
              .clamp_max(logits.size(1) - 1);
  }
  tok = tok.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(tok.data_ptr<int64_t>(), tok.data_ptr<int64_t>() + R);
}

int64_t SpeculativeDecoder::capacity_for(const std::vector<std::vector<int64_t>>& prompts, const DecodeOptions& opt) {
  return longest(prompts) + opt.max_new_tokens + opt.block_size;
}

SpeculativeDecoder::SpeculativeDecoder(const model::TargetModel& target, DraftProposer& proposer,
                                       const std::vector<std::vector<int64_t>>& prompts,
                                       const std::vector<int64_t>& prompt_ids, const DecodeOptions& opt)
    : proposer_(proposer),
      opt_(opt),
      ids_(prompt_ids),
      own_(std::make_unique<model::TargetCache>(target, int64_t(prompts.size()), capacity_for(prompts, opt),
                                                proposer.capture_ids())),
      cache_(*own_) {
  begin_batch(prompts);
}

SpeculativeDecoder::SpeculativeDecoder(model::TargetCache& cache, DraftProposer& proposer,
                                       const std::vector<std::vector<int64_t>>& prompts,
                                       const std::vector<int64_t>& prompt_ids, const DecodeOptions& opt)
    : proposer_(proposer), opt_(opt), ids_(prompt_ids), cache_(cache) {
  DFLASH_CHECK(cache.capture_ids() == proposer.capture_ids(), "decoder: the cache captures other layers than the "
               "proposer needs");
  cache_.reset(int64_t(prompts.size()), capacity_for(prompts, opt));
  begin_batch(prompts);
}

void SpeculativeDecoder::begin_batch(const std::vector<std::vector<int64_t>>& prompts) {
  c10::InferenceMode guard;
  const DecodeOptions& opt = opt_;
  check_ids(prompts.size(), ids_.size());
  check_speculative_options(opt, proposer_.max_block_size());
  const int64_t B = int64_t(prompts.size());
  proposer_.reset(B, cache_.capacity());
  res_.resize(B);
  start_.resize(B);
  last_.resize(B);
  done_.assign(B, false);
  auto st = cache_.prefill(prompts, model::TargetCache::Logits::Last);
  proposer_.add_context(st.captured, st.offsets);
  std::vector<int64_t> pos(B);
  for (int64_t b = 0; b < B; ++b) pos[b] = int64_t(prompts[b].size());
  auto first = choose_tokens(st.logits, ids_, pos, opt_.temperature, opt_.seed);
  for (int64_t b = 0; b < B; ++b) {
    start_[b] = pos[b];
    last_[b] = first[b];
    res_[b].target_forwards = 1;
    commit(b, {first[b]});
  }
}

void SpeculativeDecoder::commit(int64_t b, const std::vector<int64_t>& toks) {
  for (int64_t t : toks) {
    if (done_[b]) return;
    res_[b].tokens.push_back(t);
    if (std::find(opt_.stop_ids.begin(), opt_.stop_ids.end(), t) != opt_.stop_ids.end() ||
        int64_t(res_[b].tokens.size()) >= opt_.max_new_tokens)
      done_[b] = true;
  }
}

bool SpeculativeDecoder::step() {
  c10::InferenceMode guard;
  const int64_t B = int64_t(res_.size()), bs = opt_.block_size;
  std::vector<int64_t> rows, last, start;
  for (int64_t b = 0; b < B; ++b)
    if (!done_[b]) rows.push_back(b), last.push_back(last_[b]), start.push_back(start_[b]);
  if (rows.empty()) return false;
  const int64_t A = int64_t(rows.size());

  // 1. draft
  auto drafts = proposer_.propose(rows, last, start, bs);
  // 2. verify: the target runs [last, d_1 .. d_{bs-1}] at positions start .. start + bs - 1.
  std::vector<std::vector<int64_t>> block(B);
  std::vector<int64_t> keys_prompt, keys_pos;
  for (int64_t j = 0; j < A; ++j) {
    const int64_t b = rows[j];
    DFLASH_CHECK(int64_t(drafts[j].size()) == bs - 1, "proposer gave {} tokens for block size {}",
                 drafts[j].size(), bs);
    block[b] = {last[j]};
    block[b].insert(block[b].end(), drafts[j].begin(), drafts[j].end());
    for (int64_t i = 0; i < bs; ++i) keys_prompt.push_back(ids_[b]), keys_pos.push_back(start[j] + 1 + i);
  }
  auto st = cache_.extend(block, model::TargetCache::Logits::All);
  auto post = choose_tokens(st.logits, keys_prompt, keys_pos, opt_.temperature, opt_.seed);

  // 3. accept, commit, crop, feed back the verified positions' features.
  std::vector<int64_t> lens = cache_.lengths(), feat_rows, offsets(B + 1, 0);
  for (int64_t j = 0; j < A; ++j) {
    const int64_t b = rows[j];
    const int64_t* p = post.data() + j * bs;
    int64_t a = 0;
    while (a < bs - 1 && drafts[j][a] == p[a]) ++a;
    res_[b].accepted.push_back(a);
    res_[b].target_forwards += 1;
    commit(b, std::vector<int64_t>(p, p + a + 1));
    lens[b] = start[j] + a + 1;
    start_[b] = lens[b];
    last_[b] = p[a];
    if (!done_[b])
      for (int64_t i = 0; i <= a; ++i) feat_rows.push_back(st.offsets[b] + i);
    offsets[b + 1] = done_[b] ? 0 : a + 1;
  }
  cache_.crop(lens);
  for (int64_t b = 0; b < B; ++b) offsets[b + 1] += offsets[b];
  if (!feat_rows.empty() && st.captured.defined())
    proposer_.add_context(st.captured.index_select(0, at::tensor(feat_rows, at::kLong).to(st.captured.device())),
                          offsets);
  return true;
}

std::vector<RowResult> plain_decode(const model::TargetModel& target, const std::vector<std::vector<int64_t>>& prompts,
                                    const std::vector<int64_t>& prompt_ids, const DecodeOptions& opt) {
  c10::InferenceMode guard;
  check_ids(prompts.size(), prompt_ids.size());
  check_limits(opt);
  const int64_t B = int64_t(prompts.size());
  std::vector<RowResult> res(B);
  if (B == 0) return res;
  model::TargetCache cache(target, B, longest(prompts) + opt.max_new_tokens);
  const std::set<int64_t> stop(opt.stop_ids.begin(), opt.stop_ids.end());
  auto st = cache.prefill(prompts, model::TargetCache::Logits::Last);
  std::vector<int64_t> rows(B), pos(B);
  for (int64_t b = 0; b < B; ++b) rows[b] = b, pos[b] = int64_t(prompts[b].size());
  std::vector<int64_t> keys_prompt = prompt_ids;
  auto next = choose_tokens(st.logits, keys_prompt, pos, opt.temperature, opt.seed);
  while (true) {
    std::vector<std::vector<int64_t>> step(B);
    std::vector<int64_t> running;
    for (size_t j = 0; j < rows.size(); ++j) {
      const int64_t b = rows[j], t = next[j];
      res[b].tokens.push_back(t);
      res[b].target_forwards += 1;
      if (!stop.count(t) && int64_t(res[b].tokens.size()) < opt.max_new_tokens) step[b] = {t}, running.push_back(b);
    }
    if (running.empty()) break;
    rows = running;
    keys_prompt.clear(), pos.clear();
    for (int64_t b : rows) keys_prompt.push_back(prompt_ids[b]), pos.push_back(cache.length(b) + 1);
    next = choose_tokens(cache.extend(step, model::TargetCache::Logits::All).logits, keys_prompt, pos,
                         opt.temperature, opt.seed);
  }
  return res;
}

}  // namespace dflash::eval
