// comm/agree.h: the start-up agreement over MPI or the store.
#include "comm/agree.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/error.h"

namespace dflash::comm {
namespace {

// "<code> <cause>" on one line, at most kReportBytes bytes.
std::string encode(const Report& r) {
  std::string what;
  for (char ch : r.what) {
    if (ch == '\n') what += " | ";
    else if (ch != '\r') what += ch;
  }
  std::string line = fmt::format("{} {}", r.code, what);
  if (line.size() > kReportBytes) line.resize(kReportBytes);
  return line;
}

Report decode(const std::string& line, int rank) {
  const size_t sp = line.find(' ');
  Report r;
  try {
    r.code = std::stoi(line.substr(0, sp));
  } catch (const std::exception&) {
    throw CommError(fmt::format("start-up agreement: the report of rank {} is garbled: '{}'", rank, line));
  }
  r.what = sp == std::string::npos ? "" : line.substr(sp + 1);
  return r;
}

std::vector<std::string> over_mpi(const Identity& id, const std::string& line, double timeout_s) {
  auto c = make_mpi_communicator(id, timeout_s);
  std::vector<int> everyone(static_cast<size_t>(id.world_size));
  for (int r = 0; r < id.world_size; ++r) everyone[static_cast<size_t>(r)] = r;
  auto world = c->new_group(everyone);
  // one row per rank, bytes as int32 (an integer sum is exact; only the owner's row is non-zero)
  at::Tensor table = at::zeros({id.world_size, static_cast<int64_t>(kReportBytes)}, at::kInt);
  int32_t* mine = table[id.rank].data_ptr<int32_t>();
  for (size_t i = 0; i < line.size(); ++i) mine[i] = static_cast<int32_t>(static_cast<unsigned char>(line[i]));
  std::vector<at::Tensor> ts{table};
  c->all_reduce(*world, ts, ReduceOp::Sum);
  at::Tensor got = ts[0].contiguous();
  std::vector<std::string> lines;
  for (int r = 0; r < id.world_size; ++r) {
    const int32_t* row = got[r].data_ptr<int32_t>();
    std::string s;
    for (size_t i = 0; i < kReportBytes && row[i] != 0; ++i) s += static_cast<char>(row[i]);
    lines.push_back(s);
  }
  return lines;
}

}  // namespace

std::vector<Report> agree(const Identity& id, const std::string& tag, const Report& mine, double timeout_s,
                          Store* store) {
  if (id.world_size == 1) return {mine};
  const std::string line = encode(mine);
  std::vector<std::string> lines;
  if (id.source == Source::Mpi) {
    lines = over_mpi(id, line, timeout_s);
  } else {
    DFLASH_CHECK(store != nullptr, "start-up agreement '{}' of a {} launch needs the run's store", tag,
                 source_name(id.source));
    lines = rendezvous(*store, tag, id.rank, id.world_size, line, timeout_s);
    sign_off(*store, tag, id.rank, id.world_size, timeout_s);
  }
  std::vector<Report> all;
  for (int r = 0; r < id.world_size; ++r) all.push_back(decode(lines[static_cast<size_t>(r)], r));
  return all;
}

}  // namespace dflash::comm
