// safetensors files: reading (single files and sharded checkpoints, memory-mapped) and writing.
//
// Format: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {str: str}}, then raw little-endian data; offsets
// are relative to the end of the header. A sharded checkpoint is a directory with
// model.safetensors.index.json ({"weight_map": {name: file}}) and the shard files.
//
// Owns: the mapped files (unmapped when the SafeTensors object dies; tensors returned by load()
// are copies, never views of the mapping). Every header is validated on open: bounds, offsets
// inside the file, overlapping/out-of-order ranges, dtype names, byte sizes vs shape; errors are
// UserErrors naming the file and tensor. Thread-safety: a SafeTensors object is immutable after
// open; load() may be called from several threads.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

namespace dflash::st {

struct TensorInfo {
  std::string name;
  std::string file;            // the file that holds it
  at::ScalarType dtype;        // as stored
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0; // byte range inside the file's data section
};

class SafeTensors {
 public:
  // `path`: a .safetensors file, or a directory holding model.safetensors or
  // model.safetensors.index.json (+ shards). A missing shard is an error naming it.
  static SafeTensors open(const std::string& path);
  ~SafeTensors();
  SafeTensors(SafeTensors&&) noexcept;
  SafeTensors& operator=(SafeTensors&&) noexcept;

  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const;
  const TensorInfo& info(const std::string& name) const;  // UserError if absent
  const std::map<std::string, std::string>& metadata() const;

  // A copy converted to `dtype` on `device`. If `expect_shape` is given, a mismatch is a
  // UserError naming file, tensor, expected and found shapes.
  at::Tensor load(const std::string& name, at::ScalarType dtype, at::Device device,
                  const std::vector<int64_t>* expect_shape = nullptr) const;

  // Copies tensor `name` into `dst` (any device and float/int dtype; converted as
  // at::Tensor::copy_ does). The stored shape must equal dst's shape (UserError naming file,
  // tensor, both shapes). `dst` may be a strided view (e.g. a slice of a fused weight).
  // Safe to call from several threads at once for different destinations.
  void load_into(const std::string& name, const at::Tensor& dst) const;

  // Checks that the names are exactly `expected` (plus any matching `ignore_prefixes`);
  // a UserError lists the missing and the unexpected names.
  void expect_names(const std::vector<std::string>& expected,
                    const std::vector<std::string>& ignore_prefixes = {}) const;

 private:
  struct Impl;
  explicit SafeTensors(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// UserError naming `file` and tensor `name` if floating-point `t` holds a NaN or an infinity
// (with the count), e.g. the weights of a diverged run; integer tensors always pass.
void check_finite(const at::Tensor& t, const std::string& file, const std::string& name);

// Writes one .safetensors file (contiguous CPU copies of the tensors, names as given, sorted),
// through `path + ".tmp"` and a rename, so a reader never sees a half-written file. With
// `durable` (the default) the data is fsync'ed before the rename; benchmarks that write
// scratch files may skip that.
void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata = {}, bool durable = true);

}  // namespace dflash::st
