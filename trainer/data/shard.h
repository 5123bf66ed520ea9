// Token shards: the on-disk format of training data (docs/data_format.md), read by memory map.
//
// Owns: one mapped shard file (unmapped when the ShardFile dies) and the writer of the format.
// A shard holds documents = token ids (uint32) + a loss mask (uint8, 1 = supervised) each;
// document d spans tokens [offsets[d], offsets[d+1]). Everything is little-endian.
//
//   offset 0   header, 64 bytes: magic "DFLSHARD", u32 version (1), u32 header_bytes (64),
//              u64 n_docs, u64 n_tokens, u64 vocab_size (0 = unknown), u64 file_bytes,
//              u32 token_bytes (4), u32 reserved x2 (0), u32 crc32 of bytes 0..59
//   offset 64  u64 offsets[n_docs + 1]   (offsets[0] = 0, non-decreasing, last = n_tokens)
//   then       u32 tokens[n_tokens]
//   then       u8  loss_mask[n_tokens]   (0 or 1)
//
// open() validates the header (magic, version, CRC, sizes against the real file size) and every
// document offset, so a truncated file or a document pointing outside the file is a UserError
// naming the file and what was expected. Token ids and mask values are checked when a document
// is read (check_document), which keeps opening a large corpus cheap.
// Thread-safety: a ShardFile is immutable after open(); any thread may read from it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace dflash::data {

constexpr char kShardMagic[8] = {'D', 'F', 'L', 'S', 'H', 'A', 'R', 'D'};
constexpr uint32_t kShardVersion = 1;
constexpr uint32_t kShardHeaderBytes = 64;
constexpr const char* kShardExtension = ".dfshard";

// IEEE CRC-32 (the same as zlib.crc32 in Python).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

class ShardFile {
 public:
  static std::shared_ptr<const ShardFile> open(const std::string& path);
  ~ShardFile();
  ShardFile(const ShardFile&) = delete;
  ShardFile& operator=(const ShardFile&) = delete;

  const std::string& path() const { return path_; }
  int64_t num_docs() const { return n_docs_; }
  int64_t num_tokens() const { return n_tokens_; }
  int64_t vocab_size() const { return vocab_size_; }  // 0 when the writer did not know it
  int64_t doc_begin(int64_t d) const { return static_cast<int64_t>(offsets_[d]); }
  int64_t doc_length(int64_t d) const { return static_cast<int64_t>(offsets_[d + 1] - offsets_[d]); }
  const uint32_t* tokens() const { return tokens_; }
  const uint8_t* loss_mask() const { return mask_; }

  // Checks the first `n` tokens of document d: ids below `vocab_limit` (when > 0) and mask
  // values 0/1. UserError naming the file, document, position and value otherwise.
  void check_document(int64_t d, int64_t n, int64_t vocab_limit) const;

 private:
  ShardFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t n_docs_ = 0, n_tokens_ = 0, vocab_size_ = 0;
  const uint64_t* offsets_ = nullptr;
  const uint32_t* tokens_ = nullptr;
  const uint8_t* mask_ = nullptr;
};

// One document to write: ids and a mask of the same length.
struct Document {
  std::vector<uint32_t> ids;
  std::vector<uint8_t> mask;
};

// Writes a shard to `path` through `path + ".tmp"` and a rename (tests and tools; the Python
// writer in tools/dflash_shard.py writes the same bytes).
void write_shard(const std::string& path, const std::vector<Document>& docs, int64_t vocab_size);

// The shard files named by data.shards: files as given, directories expanded to their
// *.dfshard files in name order. UserError if an entry does not exist or a directory holds none.
std::vector<std::string> expand_shard_paths(const std::vector<std::string>& entries);

}  // namespace dflash::data
