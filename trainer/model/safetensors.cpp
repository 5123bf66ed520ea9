// safetensors reading (mmap, validation, sharded checkpoints) and writing (see safetensors.h).
#include "trainer/model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include <ATen/ATen.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/files.h"
#include "core/json.h"

namespace dflash::st {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");


namespace {

// Headers larger than this are refused (the reference implementation's limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"BF16", at::kBFloat16}, {"F16", at::kHalf},     {"F32", at::kFloat},
    {"F64", at::kDouble},    {"I64", at::kLong},     {"I32", at::kInt},
    {"I16", at::kShort},     {"I8", at::kChar},      {"U8", at::kByte},
    {"BOOL", at::kBool},     {"F8_E4M3", at::kFloat8_e4m3fn}, {"F8_E5M2", at::kFloat8_e5m2},
};

bool dtype_from_name(const std::string& s, at::ScalarType* out) {
  for (const auto& d : kDtypes)
    if (s == d.name) {
      *out = d.type;
      return true;
    }
  return false;
}

const char* dtype_to_name(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return d.name;
  return nullptr;
}

std::string supported_dtypes() {
  std::string s;
  for (const auto& d : kDtypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// One memory-mapped file.
struct Mapped {
  std::string path;
  const uint8_t* base = nullptr;
  size_t size = 0;
  uint64_t data_start = 0;  // 8 + header length
  std::map<std::string, std::string> metadata;

  Mapped() = default;
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
  ~Mapped() {
    if (base && size) munmap(const_cast<uint8_t*>(base), size);
  }
};

std::unique_ptr<Mapped> map_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_user("safetensors file '{}': cannot open: {}", path, std::strerror(errno));
  struct stat sb {};
  if (fstat(fd, &sb) != 0) {
    int e = errno;
    ::close(fd);
    throw_user("safetensors file '{}': cannot stat: {}", path, std::strerror(e));
  }
  auto m = std::make_unique<Mapped>();
  m->path = path;
  m->size = static_cast<size_t>(sb.st_size);
  if (m->size > 0) {
    void* p = mmap(nullptr, m->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      throw_user("safetensors file '{}': cannot mmap: {}", path, std::strerror(e));
    }
    m->base = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return m;
}

// Parses and validates one file's header; appends its tensors to `out`.
void read_header(Mapped& m, std::vector<TensorInfo>& out) {
  const std::string& f = m.path;
  if (m.size < 8)
    throw_user("safetensors file '{}': {} bytes, too short for the 8-byte header length "
               "(truncated?)", f, m.size);
  uint64_t n = 0;
  std::memcpy(&n, m.base, 8);
  if (n > kMaxHeaderBytes)
    throw_user("safetensors file '{}': header length {} exceeds the {} byte limit (corrupt?)", f,
               n, kMaxHeaderBytes);
  if (8 + n > m.size)
    throw_user("safetensors file '{}': header length {} runs past the end of the {}-byte file "
               "(truncated?)", f, n, m.size);
  m.data_start = 8 + n;
  const uint64_t data_size = m.size - m.data_start;
  std::string_view text(reinterpret_cast<const char*>(m.base + 8), n);
  // The writer may pad the header with trailing spaces; the JSON parser accepts them.
  json::Value hdr = json::parse(text, fmt::format("safetensors file '{}' header", f));
  const auto& obj = hdr.as_object(fmt::format("safetensors file '{}' header", f));

  struct Range {
    uint64_t begin, end;
    const std::string* name;
  };
  std::vector<Range> ranges;
  size_t first = out.size();
  for (const auto& [name, v] : obj) {
    if (name == "__metadata__") {
      std::string what = fmt::format("safetensors file '{}': __metadata__", f);
      for (const auto& [k, mv] : v.as_object(what))
        m.metadata[k] = mv.as_string(fmt::format("{} key '{}'", what, k));
      continue;
    }
    std::string what = fmt::format("safetensors file '{}': tensor '{}'", f, name);
    const auto& fields = v.as_object(what);
    TensorInfo ti;
    ti.name = name;
    ti.file = f;
    const json::Value *dt = nullptr, *shape = nullptr, *offs = nullptr;
    for (const auto& [k, fv] : fields) {
      if (k == "dtype") dt = &fv;
      else if (k == "shape") shape = &fv;
      else if (k == "data_offsets") offs = &fv;
      else throw_user("{}: unknown field '{}' (expected dtype, shape, data_offsets)", what, k);
    }
    if (!dt || !shape || !offs)
      throw_user("{}: missing field '{}'", what, !dt ? "dtype" : !shape ? "shape" : "data_offsets");
    const std::string& dname = dt->as_string(what + " dtype");
    if (!dtype_from_name(dname, &ti.dtype))
      throw_user("{}: unknown dtype '{}' (supported: {})", what, dname, supported_dtypes());
    uint64_t numel = 1;
    for (const auto& d : shape->as_array(what + " shape")) {
      uint64_t x = d.as_uint(what + " shape entry");
      if (x > uint64_t(std::numeric_limits<int64_t>::max()))
        throw_user("{}: shape entry {} too large", what, x);
      if (x != 0 && numel > std::numeric_limits<uint64_t>::max() / x)
        throw_user("{}: shape {} overflows", what, shape->dump());
      numel *= x;
      ti.shape.push_back(static_cast<int64_t>(x));
    }
    const auto& o = offs->as_array(what + " data_offsets");
    if (o.size() != 2)
      throw_user("{}: data_offsets must be [begin, end], found {}", what, offs->dump());
    ti.begin = o[0].as_uint(what + " data_offsets[0]");
    ti.end = o[1].as_uint(what + " data_offsets[1]");
    if (ti.begin > ti.end)
      throw_user("{}: data_offsets [{}, {}] has begin > end", what, ti.begin, ti.end);
    if (ti.end > data_size)
      throw_user("{}: data_offsets [{}, {}] point outside the file's {}-byte data section "
                 "(truncated or corrupt file)", what, ti.begin, ti.end, data_size);
    uint64_t item = at::elementSize(ti.dtype);
    if (numel > std::numeric_limits<uint64_t>::max() / item)
      throw_user("{}: shape {} overflows", what, shape->dump());
    if (ti.end - ti.begin != numel * item)
      throw_user("{}: data_offsets [{}, {}] hold {} bytes, but dtype {} and shape {} need {}",
                 what, ti.begin, ti.end, ti.end - ti.begin, dname, shape_str(ti.shape),
                 numel * item);
    out.push_back(std::move(ti));
  }
  for (size_t i = first; i < out.size(); ++i) ranges.push_back({out[i].begin, out[i].end, &out[i].name});
  std::sort(ranges.begin(), ranges.end(),
            [](const Range& a, const Range& b) { return a.begin < b.begin || (a.begin == b.begin && a.end < b.end); });
  // Sorted by begin, a range overlaps an earlier one iff it starts before the largest end so far.
  // Empty tensors take no bytes and may share an offset with anything.
  uint64_t max_end = 0;
  const Range* max_r = nullptr;
  for (const Range& r : ranges) {
    if (r.begin == r.end) continue;
    if (max_r && r.begin < max_end)
      throw_user("safetensors file '{}': tensors '{}' [{}, {}] and '{}' [{}, {}] overlap (corrupt "
                 "file)", f, *max_r->name, max_r->begin, max_r->end, *r.name, r.begin, r.end);
    if (r.end > max_end) {
      max_end = r.end;
      max_r = &r;
    }
  }
}

}  // namespace

struct SafeTensors::Impl {
  std::vector<std::unique_ptr<Mapped>> files;
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, const Mapped*> file_of;
  std::map<std::string, std::string> metadata;  // of the first (or only) file
};

SafeTensors::SafeTensors(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SafeTensors::~SafeTensors() = default;
SafeTensors::SafeTensors(SafeTensors&&) noexcept = default;
SafeTensors& SafeTensors::operator=(SafeTensors&&) noexcept = default;

SafeTensors SafeTensors::open(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  auto add_file = [&](const std::string& file) -> Mapped& {
    impl->files.push_back(map_file(file));
    Mapped& m = *impl->files.back();
    std::vector<TensorInfo> infos;
    read_header(m, infos);
    for (auto& ti : infos) {
      auto it = impl->tensors.find(ti.name);
      if (it != impl->tensors.end())
        throw_user("safetensors checkpoint '{}': tensor '{}' appears in both '{}' and '{}'", path,
                   ti.name, it->second.file, ti.file);
      impl->file_of[ti.name] = &m;
      std::string name = ti.name;
      impl->tensors.emplace(std::move(name), std::move(ti));
    }
    return m;
  };

  if (files::is_dir(path)) {
    const std::string index = files::join(path, "model.safetensors.index.json");
    const std::string single = files::join(path, "model.safetensors");
    if (files::exists(index)) {
      json::Value idx = json::parse_file(index);
      std::string what = index;
      const json::Value* wm = idx.find("weight_map");
      if (!wm) throw_user("{}: no \"weight_map\" object", what);
      std::map<std::string, std::string> want;  // tensor -> shard
      std::vector<std::string> shards;
      for (const auto& [name, shard] : wm->as_object(what + " weight_map")) {
        const std::string& s = shard.as_string(fmt::format("{} weight_map['{}']", what, name));
        if (s.empty() || s.find('/') != std::string::npos || s == "." || s == "..")
          throw_user("{}: weight_map['{}'] = '{}' is not a file name in the directory", what, name, s);
        want[name] = s;
        if (std::find(shards.begin(), shards.end(), s) == shards.end()) shards.push_back(s);
      }
      for (const auto& s : shards) {
        const std::string p = files::join(path, s);
        if (!files::exists(p))
          throw_user("{}: shard '{}' is missing (listed for tensor '{}' and others in the "
                     "weight_map)", what, p,
                     std::find_if(want.begin(), want.end(), [&](auto& kv) { return kv.second == s; })->first);
        add_file(p);
      }
      for (const auto& [name, s] : want) {
        auto it = impl->tensors.find(name);
        if (it == impl->tensors.end())
          throw_user("{}: tensor '{}' is listed in shard '{}' but that file does not contain it",
                     what, name, files::join(path, s));
        if (files::basename(it->second.file) != s)
          throw_user("{}: tensor '{}' is listed in shard '{}' but found in '{}'", what, name, s,
                     it->second.file);
      }
      if (!impl->files.empty()) impl->metadata = impl->files.front()->metadata;
      if (const json::Value* md = idx.find("metadata"); md && md->is_object())
        for (const auto& [k, v] : md->as_object(what))
          if (v.is_string()) impl->metadata[k] = v.as_string(k);
    } else if (files::exists(single)) {
      impl->metadata = add_file(single).metadata;
    } else {
      throw_user("checkpoint directory '{}' holds neither model.safetensors nor "
                 "model.safetensors.index.json", path);
    }
  } else if (files::exists(path)) {
    impl->metadata = add_file(path).metadata;
  } else {
    throw_user("safetensors path '{}' does not exist", path);
  }
  return SafeTensors(std::move(impl));
}

std::vector<std::string> SafeTensors::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& kv : impl_->tensors) out.push_back(kv.first);
  return out;
}

bool SafeTensors::has(const std::string& name) const { return impl_->tensors.count(name) > 0; }

const TensorInfo& SafeTensors::info(const std::string& name) const {
  auto it = impl_->tensors.find(name);
  if (it == impl_->tensors.end()) {
    std::string where = impl_->files.size() == 1 ? impl_->files[0]->path
                                                 : fmt::format("{} shards", impl_->files.size());
    throw_user("safetensors ({}): no tensor named '{}'", where, name);
  }
  return it->second;
}

const std::map<std::string, std::string>& SafeTensors::metadata() const { return impl_->metadata; }

namespace {
// A CPU tensor over the stored bytes: a view of the mapping when aligned, else a copy.
// The result must not outlive the SafeTensors object.
at::Tensor stored_view(const Mapped& m, const TensorInfo& ti) {
  const uint8_t* src = m.base + m.data_start + ti.begin;
  const size_t bytes = ti.end - ti.begin;
  auto opts = at::TensorOptions().dtype(ti.dtype).device(at::kCPU);
  if (bytes == 0) return at::empty(ti.shape, opts);
  if (reinterpret_cast<uintptr_t>(src) % at::elementSize(ti.dtype) == 0)
    return at::from_blob(const_cast<uint8_t*>(src), ti.shape, opts);
  at::Tensor raw = at::empty(ti.shape, opts);
  std::memcpy(raw.data_ptr(), src, bytes);
  return raw;
}
}  // namespace

at::Tensor SafeTensors::load(const std::string& name, at::ScalarType dtype, at::Device device,
                             const std::vector<int64_t>* expect_shape) const {
  const TensorInfo& ti = info(name);
  if (expect_shape && *expect_shape != ti.shape)
    throw_user("safetensors file '{}': tensor '{}' has shape {}, expected {}", ti.file, name,
               shape_str(ti.shape), shape_str(*expect_shape));
  at::Tensor dst = at::empty(ti.shape, at::TensorOptions().dtype(dtype).device(device));
  if (device.is_cpu() || dtype == ti.dtype) {
    load_into(name, dst);
    return dst;
  }
  // Raw bytes to the device first (fewer bytes for bf16/f16 sources), then convert there.
  at::Tensor raw = at::empty(ti.shape, at::TensorOptions().dtype(ti.dtype).device(device));
  load_into(name, raw);
  dst.copy_(raw);
  return dst;
}

void SafeTensors::load_into(const std::string& name, const at::Tensor& dst) const {
  const TensorInfo& ti = info(name);
  if (!dst.sizes().equals(ti.shape))
    throw_user("safetensors file '{}': tensor '{}' has shape {}, expected {}", ti.file, name,
               shape_str(ti.shape), shape_str(std::vector<int64_t>(dst.sizes().begin(), dst.sizes().end())));
  at::Tensor src = stored_view(*impl_->file_of.at(name), ti);
  if (dst.is_cpu() && dst.scalar_type() == ti.dtype && dst.is_contiguous()) {
    if (src.numel()) std::memcpy(dst.data_ptr(), src.data_ptr(), ti.end - ti.begin);
    return;
  }
  dst.copy_(src);  // synchronous for pageable host memory: the mapping is not used afterwards
}

void check_finite(const at::Tensor& t, const std::string& file, const std::string& name) {
  if (!t.defined() || !at::isFloatingType(t.scalar_type()) || t.numel() == 0) return;
  at::Tensor bad = at::logical_not(at::isfinite(t));
  const int64_t n = bad.sum().item<int64_t>();
  if (n == 0) return;
  const int64_t nan = at::isnan(t).sum().item<int64_t>();
  throw_user("'{}': tensor '{}' holds {} NaN and {} infinite value(s) of {} (written by a diverged run, or "
             "corrupt); use another file or an earlier state",
             file, name, nan, n - nan, t.numel());
}

void SafeTensors::expect_names(const std::vector<std::string>& expected,
                               const std::vector<std::string>& ignore_prefixes) const {
  std::set<std::string> want(expected.begin(), expected.end());
  std::vector<std::string> missing, unexpected;
  for (const auto& n : want)
    if (!has(n)) missing.push_back(n);
  for (const auto& kv : impl_->tensors) {
    if (want.count(kv.first)) continue;
    bool ignored = false;
    for (const auto& p : ignore_prefixes) ignored |= kv.first.rfind(p, 0) == 0;
    if (!ignored) unexpected.push_back(kv.first);
  }
  if (missing.empty() && unexpected.empty()) return;
  auto list = [](const std::vector<std::string>& v) {
    constexpr size_t kShow = 20;
    std::string s;
    for (size_t i = 0; i < v.size() && i < kShow; ++i) s += (i ? ", " : "") + v[i];
    if (v.size() > kShow) s += fmt::format(", ... ({} more)", v.size() - kShow);
    return s;
  };
  std::string where = impl_->files.size() == 1
                          ? impl_->files[0]->path
                          : fmt::format("{} shards in {}", impl_->files.size(),
                                        files::parent(impl_->files[0]->path));
  std::string msg = fmt::format("safetensors ({}): tensor names do not match the model:", where);
  if (!missing.empty()) msg += fmt::format(" missing {}: {}.", missing.size(), list(missing));
  if (!unexpected.empty())
    msg += fmt::format(" unexpected {}: {}.", unexpected.size(), list(unexpected));
  throw UserError(msg);
}

void save(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
          const std::map<std::string, std::string>& metadata, bool durable) {
  std::vector<std::pair<std::string, at::Tensor>> sorted;
  sorted.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) throw_user("safetensors save '{}': tensor '{}' is undefined", path, name);
    if (!dtype_to_name(t.scalar_type()))
      throw_user("safetensors save '{}': tensor '{}' has unsupported dtype {} (supported: {})",
                 path, name, c10::toString(t.scalar_type()), supported_dtypes());
    if (name == "__metadata__" || name.empty())
      throw_user("safetensors save '{}': invalid tensor name '{}'", path, name);
    sorted.emplace_back(name, t.to(at::kCPU).contiguous());
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i].first == sorted[i - 1].first)
      throw_user("safetensors save '{}': tensor name '{}' given twice", path, sorted[i].first);

  std::string hdr = "{";
  bool first = true;
  if (!metadata.empty()) {
    hdr += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& [k, v] : metadata) {
      hdr += (f2 ? "" : ",") + json::quote(k) + ":" + json::quote(v);
      f2 = false;
    }
    hdr += "}";
    first = false;
  }
  uint64_t off = 0;
  for (const auto& [name, t] : sorted) {
    uint64_t bytes = uint64_t(t.numel()) * t.element_size();
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    hdr += fmt::format("{}{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                       first ? "" : ",", json::quote(name), dtype_to_name(t.scalar_type()),
                       fmt::join(shape, ","), off, off + bytes);
    off += bytes;
    first = false;
  }
  hdr += "}";
  while (hdr.size() % 8) hdr += ' ';  // data starts 8-byte aligned

  std::string tmp = path + ".tmp";
  FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (!fp) throw_user("safetensors save: cannot create '{}': {}", tmp, std::strerror(errno));
  bool ok = true;
  uint64_t n = hdr.size();
  ok &= std::fwrite(&n, 8, 1, fp) == 1;
  ok &= std::fwrite(hdr.data(), 1, hdr.size(), fp) == hdr.size();
  for (const auto& [name, t] : sorted) {
    size_t bytes = size_t(t.numel()) * t.element_size();
    if (bytes) ok &= std::fwrite(t.data_ptr(), 1, bytes, fp) == bytes;
  }
  ok &= std::fflush(fp) == 0;
  if (durable) ok &= fsync(fileno(fp)) == 0;
  ok &= std::fclose(fp) == 0;
  if (!ok) {
    int e = errno;
    std::remove(tmp.c_str());
    throw_user("safetensors save: writing '{}' failed: {}", tmp, std::strerror(e));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    std::remove(tmp.c_str());
    throw_user("safetensors save: cannot rename '{}' to '{}': {}", tmp, path, std::strerror(e));
  }
}

}  // namespace dflash::st
