#include "trainer/data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "core/error.h"
#include "core/files.h"

namespace dflash::data {
namespace {

static_assert(sizeof(kShardMagic) == 8);

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> t = [] {
    std::array<uint32_t, 256> a{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      a[i] = c;
    }
    return a;
  }();
  return t;
}

// Little-endian loads (the format is little-endian on every host).
uint32_t le32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
uint64_t le64(const uint8_t* p) { return uint64_t(le32(p)) | uint64_t(le32(p + 4)) << 32; }
void put32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = uint8_t(v >> (8 * i));
}
void put64(uint8_t* p, uint64_t v) {
  put32(p, uint32_t(v));
  put32(p + 4, uint32_t(v >> 32));
}

bool host_is_little_endian() {
  uint16_t x = 1;
  uint8_t b;
  std::memcpy(&b, &x, 1);
  return b == 1;
}

}  // namespace

uint32_t crc32(const void* data, size_t n, uint32_t crc) {
  const auto& t = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
}

std::shared_ptr<const ShardFile> ShardFile::open(const std::string& path) {
  if (!host_is_little_endian()) throw_user("data shard {}: this host is big-endian; shards are little-endian", path);
  std::shared_ptr<ShardFile> s(new ShardFile());
  s->path_ = path;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_user("data shard {}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    throw_user("data shard {}: cannot stat: {}", path, std::strerror(e));
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kShardHeaderBytes) {
    ::close(fd);
    throw_user("data shard {}: truncated: {} bytes, expected at least the {}-byte header", path, size,
               kShardHeaderBytes);
  }
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  int e = errno;
  ::close(fd);
  if (m == MAP_FAILED) throw_user("data shard {}: cannot map {} bytes: {}", path, size, std::strerror(e));
  s->map_ = m;
  s->map_bytes_ = size;
  const auto* b = static_cast<const uint8_t*>(m);

  if (std::memcmp(b, kShardMagic, 8) != 0)
    throw_user("data shard {}: bad magic (expected \"DFLSHARD\"; is this a file written by "
               "tools/prepare_data.py?)",
               path);
  const uint32_t version = le32(b + 8);
  if (version != kShardVersion)
    throw_user("data shard {}: format version {}, this build reads version {}", path, version, kShardVersion);
  const uint32_t header_bytes = le32(b + 12);
  if (header_bytes != kShardHeaderBytes)
    throw_user("data shard {}: header size {}, expected {}", path, header_bytes, kShardHeaderBytes);
  const uint32_t want_crc = le32(b + 60);
  const uint32_t got_crc = crc32(b, 60);
  if (want_crc != got_crc)
    throw_user("data shard {}: header checksum mismatch (stored {:08x}, computed {:08x}): the header is corrupt",
               path, want_crc, got_crc);
  const uint64_t n_docs = le64(b + 16), n_tokens = le64(b + 24), vocab = le64(b + 32), file_bytes = le64(b + 40);
  const uint32_t token_bytes = le32(b + 48);
  if (token_bytes != 4) throw_user("data shard {}: token size {} bytes, expected 4", path, token_bytes);
  // Overflow-safe expected size: the counts are bounded by the file size first.
  if (n_docs > size / 8 || n_tokens > size / 5)
    throw_user("data shard {}: header claims {} documents and {} tokens, more than a {}-byte file can hold "
               "(truncated?)",
               path, n_docs, n_tokens, size);
  const uint64_t expect = kShardHeaderBytes + 8 * (n_docs + 1) + 5 * n_tokens;
  if (file_bytes != expect)
    throw_user("data shard {}: header file size {} does not match its counts ({} documents, {} tokens -> {} bytes)",
               path, file_bytes, n_docs, n_tokens, expect);
  if (size != expect)
    throw_user("data shard {}: {} bytes on disk, expected {} ({} documents, {} tokens){}", path, size, expect,
               n_docs, n_tokens, size < expect ? ": truncated" : ": trailing bytes");
  s->n_docs_ = static_cast<int64_t>(n_docs);
  s->n_tokens_ = static_cast<int64_t>(n_tokens);
  s->vocab_size_ = static_cast<int64_t>(vocab);
  s->offsets_ = reinterpret_cast<const uint64_t*>(b + kShardHeaderBytes);
  s->tokens_ = reinterpret_cast<const uint32_t*>(b + kShardHeaderBytes + 8 * (n_docs + 1));
  s->mask_ = b + kShardHeaderBytes + 8 * (n_docs + 1) + 4 * n_tokens;

  if (s->offsets_[0] != 0)
    throw_user("data shard {}: document 0 starts at token {}, expected 0", path, s->offsets_[0]);
  for (uint64_t d = 0; d < n_docs; ++d) {
    const uint64_t a = s->offsets_[d], z = s->offsets_[d + 1];
    if (z < a || z > n_tokens)
      throw_user("data shard {}: document {} spans tokens [{}, {}), outside the file's {} tokens "
                 "(expected non-decreasing offsets within [0, {}])",
                 path, d, a, z, n_tokens, n_tokens);
  }
  if (s->offsets_[n_docs] != n_tokens)
    throw_user("data shard {}: the last document ends at token {}, expected the token count {}", path,
               s->offsets_[n_docs], n_tokens);
  return s;
}

ShardFile::~ShardFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

void ShardFile::check_document(int64_t d, int64_t n, int64_t vocab_limit) const {
  const int64_t a = doc_begin(d);
  for (int64_t i = 0; i < n; ++i) {
    if (vocab_limit > 0 && tokens_[a + i] >= static_cast<uint64_t>(vocab_limit))
      throw_user("data shard {}: document {} token {} has id {}, expected an id below the target's vocabulary "
                 "size {} (prepared with another tokenizer?)",
                 path_, d, i, tokens_[a + i], vocab_limit);
    if (mask_[a + i] > 1)
      throw_user("data shard {}: document {} token {} has loss-mask value {}, expected 0 or 1", path_, d, i,
                 int(mask_[a + i]));
  }
}

void write_shard(const std::string& path, const std::vector<Document>& docs, int64_t vocab_size) {
  uint64_t n_tokens = 0;
  for (const auto& d : docs) {
    DFLASH_CHECK(d.ids.size() == d.mask.size(), "document ids and mask differ in length");
    n_tokens += d.ids.size();
  }
  const uint64_t n_docs = docs.size();
  const uint64_t file_bytes = kShardHeaderBytes + 8 * (n_docs + 1) + 5 * n_tokens;
  std::vector<uint8_t> buf(file_bytes, 0);
  uint8_t* b = buf.data();
  std::memcpy(b, kShardMagic, 8);
  put32(b + 8, kShardVersion);
  put32(b + 12, kShardHeaderBytes);
  put64(b + 16, n_docs);
  put64(b + 24, n_tokens);
  put64(b + 32, static_cast<uint64_t>(vocab_size));
  put64(b + 40, file_bytes);
  put32(b + 48, 4);
  put32(b + 60, crc32(b, 60));
  uint8_t* off = b + kShardHeaderBytes;
  uint8_t* tok = off + 8 * (n_docs + 1);
  uint8_t* msk = tok + 4 * n_tokens;
  uint64_t pos = 0;
  put64(off, 0);
  for (uint64_t d = 0; d < n_docs; ++d) {
    for (size_t i = 0; i < docs[d].ids.size(); ++i) {
      put32(tok + 4 * (pos + i), docs[d].ids[i]);
      msk[pos + i] = docs[d].mask[i];
    }
    pos += docs[d].ids.size();
    put64(off + 8 * (d + 1), pos);
  }
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw_user("cannot write data shard {}: {}", tmp, std::strerror(errno));
    f.write(reinterpret_cast<const char*>(b), static_cast<std::streamsize>(buf.size()));
    if (!f) throw_user("cannot write data shard {}: {}", tmp, std::strerror(errno));
  }
  files::rename_durable(tmp, path);
}

std::vector<std::string> expand_shard_paths(const std::vector<std::string>& entries) {
  if (entries.empty()) throw_user("config: data.shards is empty; expected shard files or directories");
  const std::string ext = kShardExtension;
  std::vector<std::string> out;
  for (const auto& e : entries) {
    if (files::is_dir(e)) {
      std::vector<std::string> found;
      for (const auto& n : files::list_dir(e))  // sorted by name
        if (n.size() > ext.size() && n.compare(n.size() - ext.size(), ext.size(), ext) == 0 &&
            !files::is_dir(e + "/" + n))
          found.push_back(e + "/" + n);
      if (found.empty()) throw_user("data.shards: directory {} holds no *{} files", e, kShardExtension);
      out.insert(out.end(), found.begin(), found.end());
    } else if (files::exists(e)) {
      out.push_back(e);
    } else {
      throw_user("data.shards: {} does not exist (expected a shard file or a directory of *{} files)", e,
                 kShardExtension);
    }
  }
  return out;
}

}  // namespace dflash::data
