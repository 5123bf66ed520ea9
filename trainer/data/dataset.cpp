#include "trainer/data/dataset.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/random.h"

namespace dflash::data {
namespace {

// The next value of the splitmix64 stream at state s (s advances by the gamma).
uint64_t next_splitmix(uint64_t& s) {
  const uint64_t z = splitmix64(s);
  s += kSplitmixGamma;
  return z;
}

// Uniform integer in [0, n) without modulo bias (rejection of the short top range).
uint64_t uniform_below(uint64_t& s, uint64_t n) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t r;
  do r = next_splitmix(s);
  while (r >= limit);
  return r % n;
}

constexpr size_t kPlansKept = 3;

}  // namespace

int64_t Batch::num_tokens() const { return ids.defined() ? ids.size(0) : 0; }
int64_t Batch::num_docs() const { return cu_seqlens.defined() ? cu_seqlens.size(0) - 1 : 0; }
int64_t Batch::num_supervised() const { return loss_mask.defined() ? loss_mask.sum().item<int64_t>() : 0; }

std::vector<int64_t> Dataset::document_order(int64_t num_docs, int64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(num_docs));
  for (int64_t i = 0; i < num_docs; ++i) order[i] = i;
  uint64_t s = static_cast<uint64_t>(seed);
  s = next_splitmix(s) ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ull + 0x5851F42D4C957F2Dull);
  for (int64_t i = num_docs - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_below(s, static_cast<uint64_t>(i) + 1));
    std::swap(order[i], order[j]);
  }
  return order;
}

Dataset::Dataset(DataOptions opt) : opt_(std::move(opt)) {
  if (opt_.batch_tokens <= 0) throw_user("config: data.batch_tokens = {}, expected a positive token count", opt_.batch_tokens);
  if (opt_.max_seq_len <= 0) throw_user("config: data.max_seq_len = {}, expected a positive length", opt_.max_seq_len);
  if (opt_.max_seq_len > opt_.batch_tokens)
    throw_user("config: data.max_seq_len = {} exceeds data.batch_tokens = {}; a document must fit in one batch",
               opt_.max_seq_len, opt_.batch_tokens);
  paths_ = expand_shard_paths(opt_.shards);
  doc_prefix_.push_back(0);
  for (const auto& p : paths_) {
    auto s = ShardFile::open(p);
    if (opt_.vocab_limit > 0 && s->vocab_size() > opt_.vocab_limit)
      throw_user("data shard {}: written for a vocabulary of {} tokens, but the target has {} (prepared with "
                 "another tokenizer?)",
                 p, s->vocab_size(), opt_.vocab_limit);
    total_docs_ += s->num_docs();
    total_tokens_ += s->num_tokens();
    doc_prefix_.push_back(total_docs_);
    shards_.push_back(std::move(s));
  }
  if (batches_in_epoch(0) == 0) {
    int64_t used = 0;
    for (int64_t d = 0; d < total_docs_; ++d) used += doc_length(d);
    throw_user("data: {} documents with {} tokens (after truncation to data.max_seq_len = {}) in {} shard file(s) "
               "cannot fill one batch of data.batch_tokens = {} tokens; expected more data or a smaller "
               "data.batch_tokens",
               total_docs_, used, opt_.max_seq_len, paths_.size(), opt_.batch_tokens);
  }
}

std::pair<const ShardFile*, int64_t> Dataset::resolve(int64_t g) const {
  auto it = std::upper_bound(doc_prefix_.begin(), doc_prefix_.end(), g);
  const size_t s = static_cast<size_t>(it - doc_prefix_.begin()) - 1;
  return {shards_[s].get(), g - doc_prefix_[s]};
}

int64_t Dataset::doc_length(int64_t g) const {
  auto [sh, d] = resolve(g);
  return std::min(sh->doc_length(d), opt_.max_seq_len);
}

std::shared_ptr<const Dataset::Plan> Dataset::build_plan(int64_t epoch) const {
  auto p = std::make_shared<Plan>();
  p->order = document_order(total_docs_, opt_.seed, epoch);
  int64_t used = 0;
  p->starts.push_back(0);
  for (int64_t i = 0; i < total_docs_; ++i) {
    const int64_t n = doc_length(p->order[i]);
    if (n == 0) continue;
    if (used > 0 && used + n > opt_.batch_tokens) {
      p->starts.push_back(i);  // batch closes before document i
      used = 0;
    }
    used += n;
  }
  // The trailing batch (documents from starts.back() on) is not closed: dropped.
  return p;
}

std::shared_ptr<const Dataset::Plan> Dataset::plan(int64_t epoch) const {
  DFLASH_CHECK(epoch >= 0, "negative epoch {}", epoch);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(epoch);
  if (it != plans_.end()) return it->second;
  auto p = build_plan(epoch);
  if (static_cast<int64_t>(epoch_batches_.size()) == epoch) epoch_batches_.push_back(p->batches());
  plans_[epoch] = p;
  while (plans_.size() > kPlansKept) {
    // drop the epoch farthest from the one just built
    auto far = plans_.begin();
    if (std::llabs(plans_.rbegin()->first - epoch) > std::llabs(far->first - epoch)) far = std::prev(plans_.end());
    plans_.erase(far);
  }
  return p;
}

int64_t Dataset::batches_in_epoch(int64_t epoch) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch < static_cast<int64_t>(epoch_batches_.size())) return epoch_batches_[epoch];
  }
  // Counts are recorded in order, so build the missing epochs before this one first.
  for (int64_t e = 0; e <= epoch; ++e) {
    bool known;
    {
      std::lock_guard<std::mutex> lock(mu_);
      known = e < static_cast<int64_t>(epoch_batches_.size());
    }
    if (!known) plan(e);
  }
  std::lock_guard<std::mutex> lock(mu_);
  return epoch_batches_[epoch];
}

int64_t Dataset::batches_in_epochs(int64_t epochs) const {
  int64_t n = 0;
  for (int64_t e = 0; e < epochs; ++e) n += batches_in_epoch(e);
  return n;
}

std::pair<int64_t, int64_t> Dataset::locate(int64_t k) const {
  DFLASH_CHECK(k >= 0, "negative batch index {}", k);
  int64_t e = 0;
  while (true) {
    const int64_t n = batches_in_epoch(e);
    if (k < n) return {e, k};
    k -= n;
    ++e;
  }
}

std::vector<int64_t> Dataset::batch_documents(int64_t k) const {
  auto [epoch, b] = locate(k);
  auto p = plan(epoch);
  std::vector<int64_t> docs;
  for (int64_t i = p->starts[b]; i < p->starts[b + 1]; ++i)
    if (doc_length(p->order[i]) > 0) docs.push_back(p->order[i]);
  return docs;
}

Batch Dataset::batch(int64_t k) const {
  auto [epoch, b] = locate(k);
  std::vector<int64_t> docs = batch_documents(k);
  int64_t total = 0;
  for (int64_t g : docs) total += doc_length(g);
  Batch out;
  out.index = k;
  out.epoch = epoch;
  out.ids = at::empty({total}, at::kLong);
  out.loss_mask = at::empty({total}, at::kByte);
  out.cu_seqlens = at::empty({static_cast<int64_t>(docs.size()) + 1}, at::kLong);
  int64_t* ids = out.ids.data_ptr<int64_t>();
  uint8_t* mask = out.loss_mask.data_ptr<uint8_t>();
  int64_t* cu = out.cu_seqlens.data_ptr<int64_t>();
  int64_t pos = 0;
  cu[0] = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    auto [sh, d] = resolve(docs[i]);
    const int64_t n = std::min(sh->doc_length(d), opt_.max_seq_len);
    sh->check_document(d, n, opt_.vocab_limit);
    const uint32_t* t = sh->tokens() + sh->doc_begin(d);
    const uint8_t* m = sh->loss_mask() + sh->doc_begin(d);
    for (int64_t j = 0; j < n; ++j) ids[pos + j] = t[j];
    std::copy(m, m + n, mask + pos);
    pos += n;
    cu[i + 1] = pos;
  }
  return out;
}

}  // namespace dflash::data
