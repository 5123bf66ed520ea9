// TensorBoard event files written by the trainer itself (no TensorFlow or protobuf library).
//
// Owns: the file <dir>/events.out.tfevents.<unix time>.<host>.<pid> and its encoding:
//   file    = records; the first holds Event{wall_time, file_version "brain.Event:2"}
//   record  = uint64 length (LE) | masked CRC-32C of those 8 bytes (uint32 LE) | data |
//             masked CRC-32C of data; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8
//   data    = the Event protobuf, hand-encoded: wall_time (1, double), step (2, int64),
//             file_version (3, string) or summary (5, Summary{repeated Value value = 1}),
//             Value{tag (1, string), simple_value (2, float)}
// Scalars come from the metrics record generically (write_record): every number of the JSON
// object is one scalar, nested objects and arrays become "a/b" and "a/<index>" tags, so a
// field added to the record appears in TensorBoard without a change here. Each record is
// flushed, so `tensorboard --logdir runs/` follows a run live.
// Thread-safety: a TensorBoardWriter is used by one thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dflash::metrics {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes, and the TFRecord mask.
uint32_t crc32c(const void* data, size_t n);
uint32_t masked_crc32c(const void* data, size_t n);

// One serialised Event with scalar values (exposed for tests).
std::string encode_scalar_event(double wall_time, int64_t step,
                                const std::vector<std::pair<std::string, float>>& values);
// The (tag, value) pairs of a flat or nested JSON object text: numbers only (null, strings and
// booleans are skipped), keys in `skip` are left out at the top level.
std::vector<std::pair<std::string, float>> scalars_of_json(const std::string& json_object,
                                                           const std::vector<std::string>& skip);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it (UserError naming the file if it cannot).
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // One event at `step` with every numeric field of the JSON object (its "step" field excluded).
  void write_record(int64_t step, const std::string& json_object);
  void write_scalars(int64_t step, const std::vector<std::pair<std::string, float>>& values);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);
  std::string path_;
  std::FILE* file_ = nullptr;
};

}  // namespace dflash::metrics
