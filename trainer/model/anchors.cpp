// trainer/model/anchors.h: anchor sampling and the block inputs (DFLASH.md §2.2, §2.4).
#include "trainer/model/anchors.h"

#include <algorithm>

#include <ATen/ATen.h>

#include "core/error.h"
#include "core/random.h"

namespace dflash::model {
namespace {

uint64_t draw_key(uint64_t seed, int64_t batch, int64_t doc) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(batch));
  return splitmix64(h ^ static_cast<uint64_t>(doc));
}

// floor(r * n / 2^64): an index in [0, n).
uint64_t scale_to(uint64_t r, uint64_t n) {
  return static_cast<uint64_t>((static_cast<unsigned __int128>(r) * n) >> 64);
}

at::Tensor mask_u8(const at::Tensor& loss_mask) {
  if (loss_mask.dim() != 2) throw_user("drafter batch: loss_mask must be [B, S], got {} dims", loss_mask.dim());
  return loss_mask.to(at::kCPU).ne(0).to(at::kByte).contiguous();
}

Blocks make_blocks(const std::vector<std::vector<int64_t>>& per_row, const std::vector<DocBounds>& docs,
                   int64_t block_size, int64_t min_blocks) {
  const int64_t B = static_cast<int64_t>(per_row.size());
  int64_t N = std::max<int64_t>(min_blocks, 1);
  for (auto& r : per_row) N = std::max<int64_t>(N, static_cast<int64_t>(r.size()));
  Blocks out;
  out.block_size = block_size;
  out.anchor = at::zeros({B, N}, at::kLong);
  out.keep = at::zeros({B, N}, at::kBool);
  out.doc_begin = at::zeros({B, N}, at::kLong);
  out.doc_end = at::zeros({B, N}, at::kLong);
  auto a = out.anchor.accessor<int64_t, 2>();
  auto k = out.keep.accessor<bool, 2>();
  auto db = out.doc_begin.accessor<int64_t, 2>();
  auto de = out.doc_end.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const auto& bounds = docs[b];
    for (size_t j = 0; j < per_row[b].size(); ++j) {
      const int64_t p = per_row[b][j];
      // the document holding p: last bound <= p
      auto it = std::upper_bound(bounds.begin(), bounds.end(), p);
      const size_t d = static_cast<size_t>(it - bounds.begin()) - 1;
      a[b][j] = p;
      k[b][j] = true;
      db[b][j] = bounds[d];
      de[b][j] = bounds[d + 1];
    }
  }
  return out;
}

}  // namespace

std::vector<DocBounds> normalize_docs(const std::vector<DocBounds>& docs, int64_t rows, int64_t S) {
  if (!docs.empty() && static_cast<int64_t>(docs.size()) != rows)
    throw_user("drafter batch: doc_bounds has {} rows, the batch has {}", docs.size(), rows);
  std::vector<DocBounds> out(rows);
  for (int64_t b = 0; b < rows; ++b) {
    if (docs.empty() || docs[b].empty()) {
      out[b] = {0, S};
      continue;
    }
    const auto& d = docs[b];
    if (d.size() < 2 || d.front() != 0)
      throw_user("drafter batch: doc_bounds of row {} must start with 0 and hold at least one document end", b);
    for (size_t i = 1; i < d.size(); ++i)
      if (d[i] <= d[i - 1])
        throw_user("drafter batch: doc_bounds of row {} must be strictly increasing (entry {} = {} after {})", b,
                   i, d[i], d[i - 1]);
    if (d.back() > S)
      throw_user("drafter batch: doc_bounds of row {} end at {} beyond the row length {}", b, d.back(), S);
    out[b] = d;
  }
  return out;
}

std::vector<int64_t> valid_anchors(const uint8_t* m, int64_t begin, int64_t end) {
  std::vector<int64_t> v;
  for (int64_t p = begin; p + 1 < end; ++p)
    if (m[p] && m[p + 1]) v.push_back(p);
  return v;
}

Blocks sample_blocks(const at::Tensor& loss_mask, const std::vector<DocBounds>& docs_in,
                     const AnchorOptions& opt) {
  if (opt.block_size < 2) throw_user("drafter.block_size: must be >= 2, got {}", opt.block_size);
  if (opt.num_anchors < 1) throw_user("drafter.num_anchors: must be >= 1, got {}", opt.num_anchors);
  auto m = mask_u8(loss_mask);
  const int64_t B = m.size(0), S = m.size(1);
  auto docs = normalize_docs(docs_in, B, S);
  std::vector<std::vector<int64_t>> per_row(B);
  int64_t doc_index = 0;  // counts documents over the rows, so packing does not change the draw
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* row = m.data_ptr<uint8_t>() + b * S;
    for (size_t d = 0; d + 1 < docs[b].size(); ++d) {
      auto valid = valid_anchors(row, docs[b][d], docs[b][d + 1]);
      const uint64_t count = valid.size();
      const uint64_t n = std::min<uint64_t>(count, static_cast<uint64_t>(opt.num_anchors));
      const uint64_t key = draw_key(opt.seed, opt.batch_index, doc_index++);
      for (uint64_t i = 0; i < n; ++i) {  // partial Fisher-Yates: valid[0..n) is the sample
        const uint64_t j = i + scale_to(splitmix64(key + i), count - i);
        std::swap(valid[i], valid[j]);
      }
      std::sort(valid.begin(), valid.begin() + static_cast<int64_t>(n));
      per_row[b].insert(per_row[b].end(), valid.begin(), valid.begin() + static_cast<int64_t>(n));
    }
  }
  return make_blocks(per_row, docs, opt.block_size, opt.min_blocks);
}

Blocks blocks_from_anchors(const at::Tensor& anchor, const at::Tensor& keep, const std::vector<DocBounds>& docs_in,
                           int64_t S, int64_t block_size) {
  if (anchor.dim() != 2 || keep.sizes() != anchor.sizes())
    throw_user("blocks: anchor and keep must both be [B, N]");
  const int64_t B = anchor.size(0), N = anchor.size(1);
  auto docs = normalize_docs(docs_in, B, S);
  auto a = anchor.to(at::kCPU, at::kLong).contiguous();
  auto k = keep.to(at::kCPU, at::kBool).contiguous();
  std::vector<std::vector<int64_t>> rows(B);
  std::vector<std::vector<int64_t>> slots(B);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < N; ++j) {
      if (!k[b][j].item<bool>()) continue;
      const int64_t p = a[b][j].item<int64_t>();
      if (p < 0 || p >= docs[b].back())
        throw_user("blocks: anchor {} of row {} block {} lies outside the row's documents [0, {})", p, b, j,
                   docs[b].back());
      rows[b].push_back(p);
      slots[b].push_back(j);
    }
  // Same layout as given (block j stays block j), kept blocks filled by make_blocks' rule.
  auto packed = make_blocks(rows, docs, block_size, N);
  Blocks out;
  out.block_size = block_size;
  out.anchor = at::zeros({B, N}, at::kLong);
  out.keep = at::zeros({B, N}, at::kBool);
  out.doc_begin = at::zeros({B, N}, at::kLong);
  out.doc_end = at::zeros({B, N}, at::kLong);
  for (int64_t b = 0; b < B; ++b)
    for (size_t i = 0; i < slots[b].size(); ++i) {
      const int64_t j = slots[b][i];
      out.anchor[b][j] = packed.anchor[b][i];
      out.keep[b][j] = true;
      out.doc_begin[b][j] = packed.doc_begin[b][i];
      out.doc_end[b][j] = packed.doc_end[b][i];
    }
  return out;
}

BlockInputs build_block_inputs(const at::Tensor& ids_in, const at::Tensor& loss_mask,
                               const std::vector<DocBounds>& docs_in, const Blocks& blocks,
                               int64_t mask_token_id) {
  if (ids_in.dim() != 2) throw_user("drafter batch: ids must be [B, S], got {} dims", ids_in.dim());
  auto ids = ids_in.to(at::kCPU, at::kLong).contiguous();
  auto m = mask_u8(loss_mask);
  const int64_t B = ids.size(0), S = ids.size(1), N = blocks.num_blocks(), bs = blocks.block_size;
  if (m.size(0) != B || m.size(1) != S)
    throw_user("drafter batch: loss_mask [{}, {}] does not match ids [{}, {}]", m.size(0), m.size(1), B, S);
  if (blocks.rows() != B) throw_user("blocks: {} rows for a batch of {}", blocks.rows(), B);
  auto docs = normalize_docs(docs_in, B, S);
  const int64_t Q = N * bs;

  auto off = at::arange(bs, at::kLong);                                   // [bs]
  auto a = blocks.anchor.unsqueeze(2);                                    // [B,N,1]
  auto keep = blocks.keep.unsqueeze(2);
  auto pos_abs = a + off.view({1, 1, bs});                                // [B,N,bs]
  auto in_doc = pos_abs.lt(blocks.doc_end.unsqueeze(2)).logical_and(keep);
  auto gather_at = pos_abs.clamp_max(S - 1).view({B, Q});
  auto x = ids.gather(1, gather_at).view({B, N, bs});
  auto mk = m.gather(1, gather_at).view({B, N, bs}).to(at::kBool);

  BlockInputs out;
  auto first = off.view({1, 1, bs}).eq(0).logical_and(keep);
  out.input_ids = at::where(first, x, at::full({}, mask_token_id, at::kLong)).view({B, Q});
  out.positions = (pos_abs - blocks.doc_begin.unsqueeze(2)).view({B, Q});
  auto w = in_doc.logical_and(off.view({1, 1, bs}).gt(0)).logical_and(mk);
  out.weight = w.to(at::kFloat).view({B, Q});
  out.labels = at::where(w, x, at::zeros({}, at::kLong)).view({B, Q});
  out.ctx_positions = at::empty({B, S}, at::kLong);
  auto cp = out.ctx_positions.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    size_t d = 0;
    for (int64_t t = 0; t < S; ++t) {
      while (d < docs[b].size() && docs[b][d] <= t) start = docs[b][d++];
      cp[b][t] = t - start;
    }
  }
  return out;
}

}  // namespace dflash::model
