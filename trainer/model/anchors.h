// Anchors and blocks of a DFlash training step (DFLASH.md §2.2, §2.4, §1.3), for rows that may
// pack several documents.
//
// Owns: the anchor sampling rule and the per-block tensors derived from it (block input ids,
// positions, labels, binary weights). Rule (the current SpecForge rule, "SFH"): in each DOCUMENT
// [s, e) of a row, a position p is a valid anchor iff s <= p <= e-2, m[p] = 1 and m[p+1] = 1;
// each document gets n = min(num_anchors, #valid) anchors drawn uniformly without replacement;
// a row's blocks are its documents' anchors in ascending order (documents are in row order);
// the batch has N = max(min_blocks, max over rows of the row's block count, 1) blocks per row,
// rows with fewer are padded with keep=false blocks (anchor 0, all tokens MASK, see nothing,
// weight 0).
// Randomness: counter-based. The draw for the d-th document of global batch k (documents counted
// over the rows in order) is a partial Fisher-Yates shuffle of the valid positions driven by
// splitmix64(key + i), key = a splitmix64 hash of (seed, k, d); the index is
// floor(u64 * remaining / 2^64) (multiply-shift). Nothing depends on a global RNG, the rank, the
// order in which batches are processed, or how the documents are packed into rows, so any rank
// layout and either packing (one row of several documents, or one row per document) reproduce
// the same anchors for the same (seed, k).
// Documents: a block sees only context of its own document before its anchor (ctx_begin = the
// document start, ctx_end = the anchor); positions restart at 0 at each document start; labels
// at or past the document end get weight 0, so no block crosses its document's end.
// Thread-safety: pure functions; CPU tensors in and out.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::model {

// Document boundaries of one row: {0 = b_0 < b_1 < ... < b_D <= S}; document i is [b_i, b_{i+1}).
// Tokens at or past b_D are padding. An empty vector means one document [0, S).
using DocBounds = std::vector<int64_t>;

struct Blocks {
  at::Tensor anchor;     // [B, N] int64
  at::Tensor keep;       // [B, N] bool
  at::Tensor doc_begin;  // [B, N] int64: start of the anchor's document (0 for dropped blocks)
  at::Tensor doc_end;    // [B, N] int64: end of the anchor's document (0 for dropped blocks)
  int64_t block_size = 0;
  int64_t rows() const { return anchor.size(0); }
  int64_t num_blocks() const { return anchor.size(1); }
};

struct AnchorOptions {
  int64_t block_size = 16;
  int64_t num_anchors = 512;  // per document
  uint64_t seed = 42;
  int64_t batch_index = 0;    // global batch index k
  int64_t min_blocks = 0;     // pad every batch to at least this many blocks per row
};

// Checks and normalises the bounds of `rows` rows of length S (UserError naming the row).
std::vector<DocBounds> normalize_docs(const std::vector<DocBounds>& docs, int64_t rows, int64_t S);

// Valid anchor positions of document [begin, end) of a loss mask row (SFH rule).
std::vector<int64_t> valid_anchors(const uint8_t* mask, int64_t begin, int64_t end);

// The random draw described above. loss_mask: [B, S] (any integer or bool dtype, any device).
Blocks sample_blocks(const at::Tensor& loss_mask, const std::vector<DocBounds>& docs,
                     const AnchorOptions& opt);

// Blocks from explicit anchors (tests, evaluation): anchor/keep [B, N]; every kept anchor must lie
// inside a document of its row (it need not be a valid anchor by the sampling rule).
Blocks blocks_from_anchors(const at::Tensor& anchor, const at::Tensor& keep,
                           const std::vector<DocBounds>& docs, int64_t S, int64_t block_size);

// Per-position inputs of the draft blocks, Q = N * bs, all CPU.
struct BlockInputs {
  at::Tensor input_ids;      // [B, Q] int64: x[a], then MASK x (bs-1); all MASK if dropped
  at::Tensor positions;      // [B, Q] int64: a + k - doc_begin
  at::Tensor ctx_positions;  // [B, S] int64: t - (start of t's document)
  at::Tensor labels;         // [B, Q] int64: x[a + k] (0 where the weight is 0)
  at::Tensor weight;         // [B, Q] float: keep * [a+k < doc_end] * [k > 0] * m[a+k]
};

BlockInputs build_block_inputs(const at::Tensor& ids, const at::Tensor& loss_mask,
                               const std::vector<DocBounds>& docs, const Blocks& blocks,
                               int64_t mask_token_id);

}  // namespace dflash::model
