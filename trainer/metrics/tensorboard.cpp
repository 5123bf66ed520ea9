// trainer/metrics/tensorboard.h: TFRecord framing and the Event/Summary protobuf by hand.
#include "trainer/metrics/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"

namespace dflash::metrics {
namespace {

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};

// ---- protobuf wire format: the three encoders an Event needs ------------------------------
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}
template <class T> void put_fixed(std::string& out, T v) {  // little-endian fixed32/fixed64
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // the build targets are little-endian (x86-64, aarch64)
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out += bytes;
}

std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);  // wall_time: double
  put_fixed(e, wall_time);
  put_key(e, 2, 0);  // step: int64 (two's complement varint)
  put_varint(e, static_cast<uint64_t>(step));
  return e;
}

double wall_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void flatten(const json::Value& v, const std::string& tag, std::vector<std::pair<std::string, float>>& out) {
  if (v.is_number()) {
    out.emplace_back(tag, static_cast<float>(v.as_double(tag)));
  } else if (v.is_array()) {
    const auto& a = v.as_array(tag);
    for (size_t i = 0; i < a.size(); ++i) flatten(a[i], fmt::format("{}/{}", tag, i), out);
  } else if (v.is_object()) {
    for (const auto& [k, c] : v.as_object(tag)) flatten(c, tag.empty() ? k : tag + "/" + k, out);
  }
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const Crc32cTable table;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table.t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string encode_scalar_event(double wall_time, int64_t step,
                                const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, x] : values) {
    std::string value;
    put_bytes(value, 1, tag);  // tag
    put_key(value, 2, 5);      // simple_value: float
    put_fixed(value, x);
    put_bytes(summary, 1, value);  // repeated Value value = 1
  }
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);  // summary = 5
  return e;
}

std::vector<std::pair<std::string, float>> scalars_of_json(const std::string& text,
                                                           const std::vector<std::string>& skip) {
  json::Value root = json::parse(text, "metrics record");
  std::vector<std::pair<std::string, float>> out;
  for (const auto& [k, v] : root.as_object("metrics record")) {
    if (std::find(skip.begin(), skip.end(), k) != skip.end()) continue;
    flatten(v, k, out);
  }
  return out;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  files::make_dirs(dir);
  char host[256] = "localhost";
  ::gethostname(host, sizeof(host) - 1);
  host[sizeof(host) - 1] = '\0';
  const double now = wall_now();
  path_ = files::join(dir, fmt::format("events.out.tfevents.{}.{}.{}", static_cast<int64_t>(now), host,
                                       static_cast<long>(::getpid())));
  file_ = std::fopen(path_.c_str(), "ab");
  if (!file_) throw_user("cannot open {} for writing: {}", path_, std::strerror(errno));
  std::string e = event_header(now, 0);
  put_bytes(e, 3, "brain.Event:2");  // file_version = 3
  write_event(e);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_event(const std::string& event) {
  std::string rec;
  const uint64_t len = event.size();
  put_fixed(rec, len);
  put_fixed(rec, masked_crc32c(rec.data(), 8));
  rec += event;
  put_fixed(rec, masked_crc32c(event.data(), event.size()));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size() || std::fflush(file_) != 0)
    throw_user("cannot write {}: {}", path_, std::strerror(errno));
}

void TensorBoardWriter::write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values) {
  if (!values.empty()) write_event(encode_scalar_event(wall_now(), step, values));
}

void TensorBoardWriter::write_record(int64_t step, const std::string& json_object) {
  write_scalars(step, scalars_of_json(json_object, {"step"}));
}

}  // namespace dflash::metrics
