// Token shards and the batch stream: format round trip, every validation error, determinism
// and packing rules of batch k (trainer/data/).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "core/files.h"
#include "trainer/data/dataset.h"
#include "trainer/data/shard.h"

namespace fs = std::filesystem;
using dflash::UserError;
using namespace dflash::data;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fs::path("dflash_data_test_" + std::to_string(::getpid()) + "_" +
                                                std::to_string(counter()++));
    fs::create_directories(path);
  }
  ~TempDir() { dflash::files::remove_tree(path.string()); }
  std::string operator/(const std::string& n) const { return (path / n).string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// Documents with recognisable content: doc d has length lens[d], ids d*1000 + i, mask i odd.
std::vector<Document> make_docs(const std::vector<int>& lens) {
  std::vector<Document> docs;
  for (size_t d = 0; d < lens.size(); ++d) {
    Document doc;
    for (int i = 0; i < lens[d]; ++i) {
      doc.ids.push_back(static_cast<uint32_t>(d * 1000 + i));
      doc.mask.push_back(static_cast<uint8_t>(i % 2));
    }
    docs.push_back(doc);
  }
  return docs;
}

std::vector<uint8_t> read_bytes(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}
// Rewrites the header CRC after a deliberate header edit (to reach the checks behind it).
void fix_crc(std::vector<uint8_t>& b) {
  uint32_t c = crc32(b.data(), 60);
  std::memcpy(b.data() + 60, &c, 4);
}

std::string open_error(const std::string& path) {
  try {
    ShardFile::open(path);
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

#define EXPECT_HAS(s, sub) EXPECT_NE((s).find(sub), std::string::npos) << (s)

}  // namespace

TEST(Crc32, KnownValue) {
  // The standard check value of CRC-32/ISO-HDLC (= zlib.crc32(b"123456789")).
  EXPECT_EQ(crc32("123456789", 9), 0xCBF43926u);
}

TEST(Shard, RoundTrip) {
  TempDir t;
  auto docs = make_docs({5, 0, 3, 7});
  write_shard(t / "a.dfshard", docs, 5000);
  EXPECT_FALSE(fs::exists(t / "a.dfshard.tmp"));
  auto s = ShardFile::open(t / "a.dfshard");
  ASSERT_EQ(s->num_docs(), 4);
  EXPECT_EQ(s->num_tokens(), 15);
  EXPECT_EQ(s->vocab_size(), 5000);
  for (int d = 0; d < 4; ++d) {
    ASSERT_EQ(s->doc_length(d), static_cast<int64_t>(docs[d].ids.size()));
    for (int i = 0; i < s->doc_length(d); ++i) {
      EXPECT_EQ(s->tokens()[s->doc_begin(d) + i], docs[d].ids[i]);
      EXPECT_EQ(s->loss_mask()[s->doc_begin(d) + i], docs[d].mask[i]);
    }
  }
  // Exact size: 64 + 8*(4+1) + 5*15.
  EXPECT_EQ(fs::file_size(t / "a.dfshard"), 64u + 40u + 75u);
}

TEST(Shard, CorruptionIsAUserErrorNamingTheFile) {
  TempDir t;
  const std::string p = t / "c.dfshard";
  write_shard(p, make_docs({4, 6, 2}), 0);
  const auto good = read_bytes(p);

  auto b = good;
  b[0] = 'X';
  write_bytes(p, b);
  std::string e = open_error(p);
  EXPECT_HAS(e, p);
  EXPECT_HAS(e, "bad magic");

  b = good;
  b[8] = 2;  // version 2
  fix_crc(b);
  write_bytes(p, b);
  e = open_error(p);
  EXPECT_HAS(e, "version 2");
  EXPECT_HAS(e, "version 1");

  b = good;
  b[16] ^= 1;  // n_docs changed without the CRC
  write_bytes(p, b);
  EXPECT_HAS(open_error(p), "checksum");

  b = good;
  b.resize(b.size() - 3);  // truncated data section
  write_bytes(p, b);
  e = open_error(p);
  EXPECT_HAS(e, "truncated");
  EXPECT_HAS(e, p);

  b = std::vector<uint8_t>(good.begin(), good.begin() + 20);  // truncated header
  write_bytes(p, b);
  EXPECT_HAS(open_error(p), "truncated");

  b = good;
  b.push_back(0);
  write_bytes(p, b);
  EXPECT_HAS(open_error(p), "trailing bytes");

  // Document 1 points outside the file: offsets[2] = 1000 > n_tokens = 12.
  b = good;
  uint64_t big = 1000;
  std::memcpy(b.data() + 64 + 8 * 2, &big, 8);
  write_bytes(p, b);
  e = open_error(p);
  EXPECT_HAS(e, "document 1 spans tokens [4, 1000)");
  EXPECT_HAS(e, p);

  // Decreasing offsets.
  b = good;
  uint64_t back = 1;
  std::memcpy(b.data() + 64 + 8 * 2, &back, 8);
  write_bytes(p, b);
  EXPECT_HAS(open_error(p), "document 1 spans");

  // A header whose counts exceed the file.
  b = good;
  uint64_t huge = uint64_t(1) << 60;
  std::memcpy(b.data() + 24, &huge, 8);
  fix_crc(b);
  write_bytes(p, b);
  EXPECT_HAS(open_error(p), "more than");

  EXPECT_HAS(open_error(t / "missing.dfshard"), "cannot open");
}

TEST(Shard, DocumentContentChecks) {
  TempDir t;
  const std::string p = t / "v.dfshard";
  auto docs = make_docs({3, 4});
  docs[1].mask[2] = 7;
  write_shard(p, docs, 0);
  auto s = ShardFile::open(p);
  EXPECT_NO_THROW(s->check_document(0, 3, 0));
  try {
    s->check_document(1, 4, 0);
    FAIL() << "mask value 7 accepted";
  } catch (const UserError& e) {
    std::string m = e.what();
    EXPECT_HAS(m, "document 1 token 2 has loss-mask value 7");
  }
  try {
    s->check_document(1, 1, 1000);  // id 1000 with a vocabulary of 1000
    FAIL() << "out-of-vocabulary id accepted";
  } catch (const UserError& e) {
    EXPECT_HAS(std::string(e.what()), "id 1000");
  }
}

TEST(Shard, ExpandPaths) {
  TempDir t;
  fs::create_directories(t / "dir");
  write_shard(t / "dir/b.dfshard", make_docs({2}), 0);
  write_shard(t / "dir/a.dfshard", make_docs({2}), 0);
  write_bytes(t / "dir/notes.txt", {1, 2});
  write_shard(t / "single.dfshard", make_docs({2}), 0);
  auto v = expand_shard_paths({t / "dir", t / "single.dfshard"});
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0], t / "dir/a.dfshard");
  EXPECT_EQ(v[1], t / "dir/b.dfshard");
  fs::create_directories(t / "empty");
  EXPECT_THROW(expand_shard_paths({t / "empty"}), UserError);
  EXPECT_THROW(expand_shard_paths({t / "nope"}), UserError);
  EXPECT_THROW(expand_shard_paths({}), UserError);
}

namespace {
// 2 shards, 40 documents of lengths 1..40 (cycled), plus one empty and one over-long document.
DataOptions make_corpus(const TempDir& t, int64_t batch_tokens, int64_t max_seq_len, int64_t seed) {
  std::vector<int> l1, l2;
  for (int i = 0; i < 20; ++i) l1.push_back(1 + i);
  for (int i = 0; i < 20; ++i) l2.push_back(21 + i);
  l2[5] = 0;
  l2[7] = 200;
  write_shard(t / "s0.dfshard", make_docs(l1), 0);
  write_shard(t / "s1.dfshard", make_docs(l2), 0);
  DataOptions o;
  o.shards = {t / "s0.dfshard", t / "s1.dfshard"};
  o.batch_tokens = batch_tokens;
  o.max_seq_len = max_seq_len;
  o.seed = seed;
  return o;
}

bool same_batch(const Batch& a, const Batch& b) {
  return a.index == b.index && a.epoch == b.epoch && at::equal(a.ids, b.ids) &&
         at::equal(a.loss_mask, b.loss_mask) && at::equal(a.cu_seqlens, b.cu_seqlens);
}
}  // namespace

TEST(Dataset, DocumentOrderIsAPermutationAndDependsOnSeedAndEpoch) {
  auto a = Dataset::document_order(1000, 7, 0);
  std::set<int64_t> s(a.begin(), a.end());
  EXPECT_EQ(s.size(), 1000u);
  EXPECT_EQ(*s.begin(), 0);
  EXPECT_EQ(*s.rbegin(), 999);
  EXPECT_EQ(a, Dataset::document_order(1000, 7, 0));
  EXPECT_NE(a, Dataset::document_order(1000, 8, 0));
  EXPECT_NE(a, Dataset::document_order(1000, 7, 1));
}

TEST(Dataset, BatchKDependsOnlyOnSeedAndK) {
  TempDir t;
  auto o = make_corpus(t, 100, 60, 3);
  Dataset walk(o);
  const int64_t per_epoch = walk.batches_in_epoch(0);
  ASSERT_GT(per_epoch, 3);
  std::vector<Batch> seq;
  for (int64_t k = 0; k < 3 * per_epoch + 2; ++k) seq.push_back(walk.batch(k));
  // A fresh reader asked for batches out of order, starting late (as a resumed rank or
  // another rank does), gets the same batches.
  for (int64_t k : {3 * per_epoch + 1, int64_t(2), per_epoch, int64_t(0), 2 * per_epoch - 1}) {
    Dataset fresh(o);
    EXPECT_TRUE(same_batch(fresh.batch(k), seq[k])) << "batch " << k;
  }
  // Another seed gives another stream.
  auto o2 = o;
  o2.seed = 4;
  Dataset other(o2);
  EXPECT_FALSE(same_batch(other.batch(0), seq[0]) && same_batch(other.batch(1), seq[1]));
}

TEST(Dataset, PackingRules) {
  TempDir t;
  auto o = make_corpus(t, 100, 60, 11);
  Dataset ds(o);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const int64_t first = ds.batches_in_epochs(epoch);
    const int64_t n = ds.batches_in_epoch(epoch);
    std::set<int64_t> seen;
    auto order = Dataset::document_order(ds.num_docs(), o.seed, epoch);
    std::vector<int64_t> visited;
    for (int64_t b = 0; b < n; ++b) {
      Batch x = ds.batch(first + b);
      EXPECT_EQ(x.epoch, epoch);
      EXPECT_EQ(ds.locate(first + b), std::make_pair(epoch, b));
      EXPECT_LE(x.num_tokens(), o.batch_tokens);
      auto docs = ds.batch_documents(first + b);
      ASSERT_EQ(static_cast<int64_t>(docs.size()), x.num_docs());
      const int64_t* cu = x.cu_seqlens.data_ptr<int64_t>();
      EXPECT_EQ(cu[0], 0);
      EXPECT_EQ(cu[x.num_docs()], x.num_tokens());
      for (size_t i = 0; i < docs.size(); ++i) {
        EXPECT_TRUE(seen.insert(docs[i]).second) << "document twice in an epoch";
        visited.push_back(docs[i]);
        const int64_t g = docs[i];
        const int64_t len = cu[i + 1] - cu[i];
        // Global doc g: shard 0 holds 0..19 (length g+1), shard 1 holds 20..39 (length g+1,
        // except 25 = empty and 27 = 200 tokens, truncated to 60).
        const int64_t full = g == 25 ? 0 : g == 27 ? 200 : g + 1;
        EXPECT_EQ(len, std::min<int64_t>(full, 60)) << "document " << g;
        EXPECT_NE(g, 25) << "an empty document was packed";
        // Content: ids local_d*1000 + i, mask i odd.
        const int64_t local = g < 20 ? g : g - 20;
        for (int64_t i2 = 0; i2 < len; ++i2) {
          EXPECT_EQ(x.ids[cu[i] + i2].item<int64_t>(), local * 1000 + i2);
          EXPECT_EQ(x.loss_mask[cu[i] + i2].item<uint8_t>(), i2 % 2);
        }
      }
      // Greedy: the next document (in order) would not have fitted.
      if (b + 1 < n) {
        auto next = ds.batch_documents(first + b + 1);
        EXPECT_GT(x.num_tokens() + std::min<int64_t>(next[0] == 27 ? 200 : next[0] + 1, 60), o.batch_tokens);
      }
    }
    // Visited documents follow the epoch's permutation (empty ones skipped), as a prefix: the
    // trailing batch is dropped.
    std::vector<int64_t> expect;
    for (int64_t g : order)
      if (g != 25) expect.push_back(g);
    ASSERT_LE(visited.size(), expect.size());
    EXPECT_TRUE(std::equal(visited.begin(), visited.end(), expect.begin()));
    EXPECT_LT(visited.size(), expect.size()) << "the trailing batch should be dropped";
  }
}

TEST(Dataset, DataSmallerThanOneBatchIsAnError) {
  TempDir t;
  write_shard(t / "tiny.dfshard", make_docs({10, 20, 30}), 0);
  DataOptions o;
  o.shards = {t / "tiny.dfshard"};
  o.batch_tokens = 60;  // exactly the data: no batch closes, the only batch is trailing
  o.max_seq_len = 60;
  try {
    Dataset ds(o);
    FAIL() << "accepted data smaller than one batch";
  } catch (const UserError& e) {
    std::string m = e.what();
    EXPECT_HAS(m, "cannot fill one batch");
    EXPECT_HAS(m, "data.batch_tokens = 60");
    EXPECT_HAS(m, "60 tokens");
  }
  o.batch_tokens = 59;
  o.max_seq_len = 59;
  Dataset ok(o);
  EXPECT_EQ(ok.batches_in_epoch(0), 1);
}

TEST(Dataset, BadOptionsAndVocabulary) {
  TempDir t;
  write_shard(t / "v.dfshard", make_docs({10, 20, 30, 40}), 50000);
  DataOptions o;
  o.shards = {t / "v.dfshard"};
  o.batch_tokens = 40;
  o.max_seq_len = 80;
  EXPECT_THROW(Dataset{o}, UserError);  // max_seq_len > batch_tokens
  o.max_seq_len = 40;
  o.vocab_limit = 1000;  // shard written for 50000 tokens
  try {
    Dataset ds(o);
    FAIL();
  } catch (const UserError& e) {
    EXPECT_HAS(std::string(e.what()), "vocabulary of 50000");
  }
  // A shard that does not record its vocabulary: ids are checked when read.
  write_shard(t / "v.dfshard", make_docs({10, 20, 30, 40}), 0);
  o.vocab_limit = 1000;
  Dataset ds(o);
  bool threw = false;
  for (int64_t k = 0; k < ds.batches_in_epoch(0); ++k) {
    try {
      ds.batch(k);
    } catch (const UserError& e) {
      threw = true;
      EXPECT_HAS(std::string(e.what()), "below the target's vocabulary size 1000");
    }
  }
  EXPECT_TRUE(threw);  // docs 1..3 hold ids >= 1000
}
