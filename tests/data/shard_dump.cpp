// Test helper: prints batches of a shard set as JSON lines, so that Python tests can compare
// the C++ reader with an independent Python reading of the same files.
//
//   dflash_shard_dump BATCH_TOKENS MAX_SEQ_LEN SEED FIRST COUNT SHARD...
// Output: one line per batch {"k", "epoch", "docs": [...], "ids": [...], "mask": [...], "cu": [...]}.
// A UserError prints "error: <message>" on stderr and exits 2.
#include <cstdio>
#include <string>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "trainer/data/dataset.h"

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s BATCH_TOKENS MAX_SEQ_LEN SEED FIRST COUNT SHARD...\n", argv[0]);
    return 1;
  }
  try {
    dflash::data::DataOptions o;
    o.batch_tokens = std::stoll(argv[1]);
    o.max_seq_len = std::stoll(argv[2]);
    o.seed = std::stoll(argv[3]);
    const int64_t first = std::stoll(argv[4]), count = std::stoll(argv[5]);
    for (int i = 6; i < argc; ++i) o.shards.push_back(argv[i]);
    dflash::data::Dataset ds(o);
    for (int64_t k = first; k < first + count; ++k) {
      auto b = ds.batch(k);
      auto v = [](const at::Tensor& t) {
        auto l = t.to(at::kLong).contiguous();
        return std::vector<int64_t>(l.data_ptr<int64_t>(), l.data_ptr<int64_t>() + l.numel());
      };
      std::printf("%s\n", fmt::format(R"({{"k": {}, "epoch": {}, "docs": [{}], "ids": [{}], "mask": [{}], "cu": [{}]}})",
                                      b.index, b.epoch, fmt::join(ds.batch_documents(k), ", "),
                                      fmt::join(v(b.ids), ", "), fmt::join(v(b.loss_mask), ", "),
                                      fmt::join(v(b.cu_seqlens), ", "))
                              .c_str());
    }
  } catch (const dflash::UserError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return 0;
}
