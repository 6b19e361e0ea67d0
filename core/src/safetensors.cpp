#include "safetensors.h"

#include <fcntl.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <set>

#include "file_util.h"
#include "json.h"
#include "mt/backend.h"
#include "mt/error.h"

namespace mt {
namespace {

// The reference implementation refuses headers above 100 MB; a larger length is corruption, and
// refusing it early avoids parsing gigabytes of tensor data as JSON.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Nesting deeper than the format needs (object -> object -> array) is rejected; the bound only
// keeps the recursive parser's stack small on hostile input.
constexpr int kMaxDepth = 16;

[[noreturn]] void file_error(const std::filesystem::path& p, const std::string& what) {
  throw Error("safetensors file " + quoted(p) + ": " + what);
}

// A json::parse error in the words this reader has always used (json.h names the text "input"
// and the top level "the JSON value", and places a control character's error at the character
// rather than after it), so that messages and offsets stay as users and scripts know them.
std::string header_syntax_error(const json::ParseError& e) {
  std::string what = e.what;
  size_t at = e.offset;
  constexpr std::string_view kEndOfInput = "unexpected end of input";
  if (what.starts_with(kEndOfInput))
    what.replace(0, kEndOfInput.size(), "unexpected end of header");
  else if (what == "unexpected characters after the JSON value")
    what = "unexpected characters after the JSON object";
  else if (what == "control character in string")
    ++at;
  return what + " at byte " + std::to_string(at) + " of the header";
}

// ---- dtype tables and conversions -----------------------------------------------------------
struct StType {
  const char* name;
  size_t size;
  enum class Cls { flt, sint, uint, other } cls;
};

constexpr StType kStTypes[] = {
    {"BOOL", 1, StType::Cls::uint},     {"U8", 1, StType::Cls::uint},
    {"I8", 1, StType::Cls::sint},       {"F8_E5M2", 1, StType::Cls::other},
    {"F8_E4M3", 1, StType::Cls::other}, {"I16", 2, StType::Cls::sint},
    {"U16", 2, StType::Cls::uint},      {"F16", 2, StType::Cls::flt},
    {"BF16", 2, StType::Cls::flt},      {"I32", 4, StType::Cls::sint},
    {"U32", 4, StType::Cls::uint},      {"F32", 4, StType::Cls::flt},
    {"F64", 8, StType::Cls::flt},       {"I64", 8, StType::Cls::sint},
    {"U64", 8, StType::Cls::uint},
};

const StType* find_st_type(std::string_view name) {
  for (const auto& t : kStTypes)
    if (name == t.name) return &t;
  return nullptr;
}

template <class T>
T load_le(const std::byte* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // x86-64 and aarch64 are little-endian, as is the format
  return v;
}

// Signed value of an integer element; false for a U64 above INT64_MAX.
bool read_int(const std::string& dt, const std::byte* p, int64_t& out) {
  if (dt == "BOOL" || dt == "U8")
    out = load_le<uint8_t>(p);
  else if (dt == "I8")
    out = load_le<int8_t>(p);
  else if (dt == "I16")
    out = load_le<int16_t>(p);
  else if (dt == "U16")
    out = load_le<uint16_t>(p);
  else if (dt == "I32")
    out = load_le<int32_t>(p);
  else if (dt == "U32")
    out = load_le<uint32_t>(p);
  else if (dt == "I64")
    out = load_le<int64_t>(p);
  else {
    uint64_t u = load_le<uint64_t>(p);
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
    out = static_cast<int64_t>(u);
  }
  return true;
}

// numel * elem_size with overflow detection.
bool checked_nbytes(const Shape& shape, size_t elem, size_t& out) {
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  out = static_cast<size_t>(n);
  return true;
}

// ---- writing --------------------------------------------------------------------------------
// Owns a file descriptor and the temporary path; removes the temporary file unless committed.
class TempFile {
 public:
  TempFile(std::filesystem::path final_path)
      : final_(std::move(final_path)), tmp_(final_.string() + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail_errno("cannot create " + quoted(tmp_));
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write(const void* data, size_t n) {
    if (!write_all(fd_, data, n)) fail_errno("write failed");
  }

  void commit() {
    if (::fsync(fd_) != 0) fail_errno("fsync failed");
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail_errno("close failed");
    if (::rename(tmp_.c_str(), final_.c_str()) != 0) fail_errno("rename to the final name failed");
    committed_ = true;
    // Make the rename itself durable; a failure here leaves a complete file, so only report it.
    std::filesystem::path dir = final_.parent_path();
    if (dir.empty()) dir = ".";
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
      int rc = ::fsync(dfd);
      int err = errno;
      ::close(dfd);
      if (rc != 0) {
        errno = err;
        fail_errno("fsync of the directory failed");
      }
    }
  }

 private:
  [[noreturn]] void fail_errno(const std::string& what) const {
    std::string msg = std::strerror(errno);
    throw Error("writing safetensors file " + quoted(final_) + ": " + what + ": " + msg);
  }

  std::filesystem::path final_, tmp_;
  int fd_ = -1;
  bool committed_ = false;
};

// Shared by write_safetensors and save_tensors: `fetch(i, scratch)` returns entry i's bytes,
// using `scratch` when they must first be copied to the host.
void write_impl(const std::filesystem::path& path, const std::vector<SafeTensorsEntry>& entries,
                const std::map<std::string, std::string>& metadata,
                const std::function<const void*(size_t, std::vector<std::byte>&)>& fetch) {
  auto bad = [&](const std::string& what) {
    throw Error("writing safetensors file " + quoted(path) + ": " + what);
  };
  std::set<std::string_view> seen;
  std::vector<size_t> sizes(entries.size()), elem(entries.size());
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    if (e.name.empty()) bad("a tensor has an empty name");
    if (e.name == "__metadata__") bad("'__metadata__' is reserved and cannot name a tensor");
    if (!seen.insert(e.name).second) bad("tensor '" + e.name + "' appears twice");
    const StType* t = find_st_type(e.dtype);
    if (!t) bad("tensor '" + e.name + "' has unknown dtype '" + e.dtype + "'");
    elem[i] = t->size;
    if (!checked_nbytes(e.shape, t->size, sizes[i]))
      bad("tensor '" + e.name + "' has an invalid shape " + shape_str(e.shape));
  }
  // Larger elements first keeps every tensor aligned to its element size (stable for the rest).
  std::vector<size_t> order(entries.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return elem[a] > elem[b]; });

  std::string header = "{";
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool mfirst = true;
    for (const auto& [k, v] : metadata) {
      if (!mfirst) header += ',';
      mfirst = false;
      header += json::quote(k);
      header += ':';
      header += json::quote(v);
    }
    header += '}';
    first = false;
  }
  size_t offset = 0;
  for (size_t i : order) {
    const auto& e = entries[i];
    if (!first) header += ',';
    first = false;
    header += json::quote(e.name);
    header += ":{\"dtype\":\"" + e.dtype + "\",\"shape\":[";
    for (size_t d = 0; d < e.shape.size(); ++d) {
      if (d) header += ',';
      header += std::to_string(e.shape[d]);
    }
    header += "],\"data_offsets\":[" + std::to_string(offset) + ',' +
              std::to_string(offset + sizes[i]) + "]}";
    offset += sizes[i];
  }
  header += '}';
  // Pad with spaces so the data section starts 8-byte aligned, as the Python library does.
  header.append((8 - header.size() % 8) % 8, ' ');

  TempFile out(path);
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(len, 8);
  out.write(header.data(), header.size());
  std::vector<std::byte> scratch;
  for (size_t i : order) {
    if (sizes[i] == 0) continue;
    const void* p = fetch(i, scratch);
    if (!p) bad("tensor '" + entries[i].name + "' has no data pointer");
    out.write(p, sizes[i]);
  }
  out.commit();
}

}  // namespace

// ---- dtypes ---------------------------------------------------------------------------------
size_t safetensors_dtype_size(std::string_view st_dtype) {
  const StType* t = find_st_type(st_dtype);
  return t ? t->size : 0;
}

bool safetensors_dtype_is_float(std::string_view st_dtype) {
  const StType* t = find_st_type(st_dtype);
  return t && t->cls == StType::Cls::flt;
}

const char* safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::i8:
      return "I8";
    case DType::u8:
      return "U8";
  }
  return "?";
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  if (s == "F32") return DType::f32;
  if (s == "BF16") return DType::bf16;
  if (s == "F16") return DType::f16;
  if (s == "I32") return DType::i32;
  if (s == "I64") return DType::i64;
  if (s == "I8") return DType::i8;
  if (s == "U8") return DType::u8;
  return std::nullopt;
}

// ---- reading --------------------------------------------------------------------------------
SafeTensorsFile::SafeTensorsFile(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) file_error(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    file_error(path, std::string("cannot stat: ") + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    file_error(path, "not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    file_error(path, "truncated: the file has " + std::to_string(size_) +
                         " bytes, fewer than the 8-byte header length");
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    file_error(path, std::string("cannot map: ") + std::strerror(map_err));
  }
  // From here on a throw must unmap: the destructor does not run for a failed constructor.
  try {
    const auto* base = static_cast<const std::byte*>(map_);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint64_t>(base[i]);
    if (n > size_ - 8)
      file_error(path, "header length " + std::to_string(n) + " exceeds the file size (" +
                           std::to_string(size_) + " bytes): truncated or not a safetensors file");
    if (n > kMaxHeaderBytes)
      file_error(path, "header length " + std::to_string(n) + " exceeds the 100 MB limit");
    if (n < 2) file_error(path, "header of " + std::to_string(n) + " bytes is too short");
    std::string_view text(reinterpret_cast<const char*>(base + 8), static_cast<size_t>(n));
    json::Value root;
    try {
      root = json::parse(text, kMaxDepth);
    } catch (const json::ParseError& e) {
      file_error(path, "malformed JSON header: " + header_syntax_error(e));
    }
    if (!root.is_object())
      file_error(path,
                 std::string("header is ") + json::kind_name(root.kind) + ", not a JSON object");

    const size_t data_size = size_ - 8 - static_cast<size_t>(n);
    const std::byte* data = base + 8 + n;
    std::set<std::string_view> seen;
    for (auto& [key, val] : root.members) {
      if (!seen.insert(key).second)
        file_error(path, "key '" + key + "' appears twice in the header");
      if (key == "__metadata__") {
        if (!val.is_object())
          file_error(path, std::string("__metadata__ is ") + json::kind_name(val.kind) +
                               ", not an object of strings");
        for (auto& [mk, mv] : val.members) {
          if (!mv.is_string())
            file_error(path, "__metadata__ value of '" + mk + "' is " + json::kind_name(mv.kind) +
                                 ", not a string");
          metadata_[mk] = mv.str;
        }
        continue;
      }
      // `key` by name: clang before 16 cannot capture a structured binding.
      auto tensor_error = [&, &name = key](const std::string& what) {
        file_error(path, "tensor '" + name + "': " + what);
      };
      if (!val.is_object())
        tensor_error(std::string("entry is ") + json::kind_name(val.kind) + ", not an object");
      const json::Value *dtype = nullptr, *shape = nullptr, *offsets = nullptr;
      for (auto& [fk, fv] : val.members) {
        // Other fields are ignored, for forward compatibility with writers that add some.
        if (fk == "dtype")
          dtype = &fv;
        else if (fk == "shape")
          shape = &fv;
        else if (fk == "data_offsets")
          offsets = &fv;
      }
      if (!dtype || !shape || !offsets)
        tensor_error(std::string("missing field '") +
                     (!dtype   ? "dtype"
                      : !shape ? "shape"
                               : "data_offsets") +
                     "'");
      if (!dtype->is_string()) tensor_error("dtype is not a string");
      const StType* st_type = find_st_type(dtype->str);
      if (!st_type) tensor_error("unknown dtype '" + dtype->str + "'");
      SafeTensorInfo info;
      info.name = key;
      info.dtype = dtype->str;
      if (!shape->is_array()) tensor_error("shape is not an array");
      for (const auto& d : shape->items) {
        const std::optional<uint64_t> n = d.as_uint64();
        if (!n || *n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
          tensor_error("shape entry " + (d.kind == json::Value::Kind::number ? d.str : "") +
                       " is not a non-negative integer");
        info.shape.push_back(static_cast<int64_t>(*n));
      }
      if (!offsets->is_array() || offsets->items.size() != 2)
        tensor_error("data_offsets is not an array of two integers");
      const std::optional<uint64_t> ob = offsets->items[0].as_uint64(),
                                    oe = offsets->items[1].as_uint64();
      if (!ob || !oe)
        tensor_error("data_offsets holds something other than a non-negative integer");
      uint64_t b = *ob, e = *oe;
      if (b > e)
        tensor_error("data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                     "] end before they begin");
      if (e > data_size)
        tensor_error("data_offsets [" + std::to_string(b) + ", " + std::to_string(e) +
                     "] lie beyond the data section (" + std::to_string(data_size) +
                     " bytes): truncated or corrupt file");
      size_t expect = 0;
      if (!checked_nbytes(info.shape, st_type->size, expect))
        tensor_error("shape " + shape_str(info.shape) + " is too large");
      if (expect != e - b)
        tensor_error("data_offsets [" + std::to_string(b) + ", " + std::to_string(e) + "] span " +
                     std::to_string(e - b) + " bytes but " + info.dtype + " " +
                     shape_str(info.shape) + " needs " + std::to_string(expect));
      info.begin = static_cast<size_t>(b);
      info.end = static_cast<size_t>(e);
      info.data = data + info.begin;
      names_.push_back(key);
      tensors_.emplace(key, std::move(info));
    }
    // The tensors must tile the data section exactly: any overlap means two tensors share bytes
    // and any gap or trailing bytes mean the header and data disagree.
    std::vector<const SafeTensorInfo*> by_offset;
    for (const auto& [k, info] : tensors_) by_offset.push_back(&info);
    std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) {
      return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    size_t cursor = 0;
    const SafeTensorInfo* prev = nullptr;
    for (const auto* t : by_offset) {
      if (t->begin < cursor)
        file_error(path, "tensors '" + prev->name + "' [" + std::to_string(prev->begin) + ", " +
                             std::to_string(prev->end) + ") and '" + t->name + "' [" +
                             std::to_string(t->begin) + ", " + std::to_string(t->end) +
                             ") overlap");
      if (t->begin > cursor)
        file_error(path, "bytes [" + std::to_string(cursor) + ", " + std::to_string(t->begin) +
                             ") of the data section belong to no tensor (before '" + t->name +
                             "')");
      if (t->end > cursor || !prev) {
        cursor = t->end;
        prev = t;
      }
    }
    if (cursor != data_size)
      file_error(path, "the data section has " + std::to_string(data_size - cursor) +
                           " bytes after the last tensor");
    std::sort(names_.begin(), names_.end());
  } catch (...) {
    unmap();
    throw;
  }
}

SafeTensorsFile::~SafeTensorsFile() {
  unmap();
}

void SafeTensorsFile::unmap() noexcept {
  if (map_) ::munmap(map_, size_);
  map_ = nullptr;
}

SafeTensorsFile::SafeTensorsFile(SafeTensorsFile&& o) noexcept
    : path_(std::move(o.path_)),
      map_(std::exchange(o.map_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      names_(std::move(o.names_)),
      tensors_(std::move(o.tensors_)),
      metadata_(std::move(o.metadata_)) {}

SafeTensorsFile& SafeTensorsFile::operator=(SafeTensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = std::exchange(o.size_, 0);
    names_ = std::move(o.names_);
    tensors_ = std::move(o.tensors_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

bool SafeTensorsFile::contains(std::string_view name) const {
  return tensors_.find(name) != tensors_.end();
}

const SafeTensorInfo& SafeTensorsFile::info(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    file_error(path_, "no tensor named '" + std::string(name) + "' (the file has " +
                          std::to_string(names_.size()) + " tensors)");
  return it->second;
}

// ---- loading onto a backend -----------------------------------------------------------------
namespace {

// Host bytes of `info` converted to `want`; empty when no conversion is needed (same dtype).
// n floating elements of file type `dt` at `in` (unaligned, little-endian) to `want` at `out`:
// the type dispatch once, outside the loop, and blocks of the tensor converted in parallel
// (loading a checkpoint is bound by this pass).
template <class Load>
void convert_floats_from(Load load, DType want, std::byte* out, size_t n) {
  auto each = [&](auto store) {
    tbb::parallel_for(tbb::blocked_range<size_t>(0, n, size_t{1} << 16),
                      [&](const tbb::blocked_range<size_t>& r) {
                        for (size_t i = r.begin(); i < r.end(); ++i) store(i, load(i));
                      });
  };
  if (want == DType::f32)
    each([out](size_t i, float v) { std::memcpy(out + i * 4, &v, 4); });
  else if (want == DType::bf16)
    each([out](size_t i, float v) {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(out + i * 2, &h, 2);
    });
  else
    each([out](size_t i, float v) {
      const uint16_t h = f32_to_f16(v);
      std::memcpy(out + i * 2, &h, 2);
    });
}

void convert_floats(const std::string& dt, const std::byte* in, DType want, std::byte* out,
                    size_t n) {
  if (dt == "F32")
    convert_floats_from([in](size_t i) { return load_le<float>(in + i * 4); }, want, out, n);
  else if (dt == "BF16")
    convert_floats_from([in](size_t i) { return bf16_to_f32(load_le<uint16_t>(in + i * 2)); }, want,
                        out, n);
  else if (dt == "F16")
    convert_floats_from([in](size_t i) { return f16_to_f32(load_le<uint16_t>(in + i * 2)); }, want,
                        out, n);
  else  // F64
    convert_floats_from([in](size_t i) { return static_cast<float>(load_le<double>(in + i * 8)); },
                        want, out, n);
}

std::vector<std::byte> convert(const SafeTensorsFile& file, const SafeTensorInfo& info,
                               DType want) {
  auto bad = [&](const std::string& what) {
    file_error(file.path(), "tensor '" + info.name + "': " + what);
  };
  const StType* src = find_st_type(info.dtype);
  const size_t n = static_cast<size_t>(info.numel());
  const size_t out_size = dtype_size(want);
  std::vector<std::byte> out(n * out_size);
  if (src->cls == StType::Cls::flt && is_float(want)) {
    convert_floats(info.dtype, info.data, want, out.data(), n);
    return out;
  }
  if ((src->cls == StType::Cls::sint || src->cls == StType::Cls::uint) && !is_float(want)) {
    int64_t lo = 0, hi = 0;
    switch (want) {
      case DType::i32:
        lo = INT32_MIN, hi = INT32_MAX;
        break;
      case DType::i64:
        lo = INT64_MIN, hi = INT64_MAX;
        break;
      case DType::i8:
        lo = INT8_MIN, hi = INT8_MAX;
        break;
      case DType::u8:
        lo = 0, hi = UINT8_MAX;
        break;
      default:
        break;
    }
    for (size_t i = 0; i < n; ++i) {
      int64_t v = 0;
      if (!read_int(info.dtype, info.data + i * src->size, v) || v < lo || v > hi)
        bad(std::string("element ") + std::to_string(i) + " does not fit in " + dtype_name(want));
      std::byte* o = out.data() + i * out_size;
      switch (want) {
        case DType::i32: {
          auto x = static_cast<int32_t>(v);
          std::memcpy(o, &x, 4);
          break;
        }
        case DType::i64:
          std::memcpy(o, &v, 8);
          break;
        case DType::i8: {
          auto x = static_cast<int8_t>(v);
          std::memcpy(o, &x, 1);
          break;
        }
        default: {
          auto x = static_cast<uint8_t>(v);
          std::memcpy(o, &x, 1);
          break;
        }
      }
    }
    return out;
  }
  file_error(file.path(), "tensor '" + info.name + "': cannot convert " + info.dtype + " to " +
                              dtype_name(want));
}

}  // namespace

Tensor load_tensor(const SafeTensorsFile& file, std::string_view name, Backend& backend,
                   DType want) {
  const SafeTensorInfo& info = file.info(name);
  Tensor t = backend.empty(info.shape, want);
  if (info.nbytes() == 0) return t;
  auto same = dtype_from_safetensors(info.dtype);
  if (same && *same == want) {
    backend.copy_from_host(t, info.data);  // straight from the mapping, no staging copy
  } else {
    std::vector<std::byte> host = convert(file, info, want);
    backend.copy_from_host(t, host.data());
  }
  return t;
}

Tensor load_tensor(const SafeTensorsFile& file, std::string_view name, Backend& backend, DType want,
                   const Shape& expect) {
  const SafeTensorInfo& info = file.info(name);
  if (info.shape != expect)
    file_error(file.path(), "tensor '" + info.name + "' has shape " + shape_str(info.shape) +
                                ", expected " + shape_str(expect));
  return load_tensor(file, name, backend, want);
}

std::vector<float> read_f32(const SafeTensorsFile& file, std::string_view name) {
  const SafeTensorInfo& info = file.info(name);
  const StType* src = find_st_type(info.dtype);
  if (src->cls != StType::Cls::flt)
    file_error(file.path(), "tensor '" + info.name + "' is " + info.dtype + ", not floating");
  std::vector<float> out(static_cast<size_t>(info.numel()));
  convert_floats(info.dtype, info.data, DType::f32, reinterpret_cast<std::byte*>(out.data()),
                 out.size());
  release_pages(info);
  return out;
}

void release_pages(const SafeTensorInfo& info) {
  if (info.nbytes() == 0 || !info.data) return;
  // The mapping starts on a page and runs to the end of the file's last page, so the rounded
  // range stays within it.
  static const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto first = reinterpret_cast<uintptr_t>(info.data) / page * page;
  const auto last =
      (reinterpret_cast<uintptr_t>(info.data) + info.nbytes() + page - 1) / page * page;
  static_cast<void>(::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED));
}

void convert_float_elements(const std::string& st_dtype, const void* in, DType want, void* out,
                            size_t n) {
  if (!find_st_type(st_dtype) || find_st_type(st_dtype)->cls != StType::Cls::flt || !is_float(want))
    throw Error("cannot convert " + st_dtype + " elements to " + dtype_name(want));
  convert_floats(st_dtype, static_cast<const std::byte*>(in), want, static_cast<std::byte*>(out),
                 n);
}

void load_into(const SafeTensorsFile& file, std::string_view name, Tensor& dst) {
  const SafeTensorInfo& info = file.info(name);
  if (info.shape != dst.shape())
    file_error(file.path(), "tensor '" + info.name + "' has shape " + shape_str(info.shape) +
                                ", expected " + shape_str(dst.shape()));
  if (info.nbytes() == 0) return;
  Backend& backend = *dst.backend();
  auto same = dtype_from_safetensors(info.dtype);
  if (same && *same == dst.dtype()) {
    backend.copy_from_host(dst, info.data);
  } else {
    std::vector<std::byte> host = convert(file, info, dst.dtype());
    backend.copy_from_host(dst, host.data());
  }
  release_pages(info);
}

// ---- writing --------------------------------------------------------------------------------
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafeTensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_impl(path, tensors, metadata,
             [&](size_t i, std::vector<std::byte>&) { return tensors[i].data; });
}

void save_tensors(const std::filesystem::path& path,
                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<SafeTensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw Error("writing safetensors file " + quoted(path) + ": tensor '" + name +
                  "' is undefined");
    entries.emplace_back(name, t.dtype(), t.shape(), nullptr);
  }
  write_impl(path, entries, metadata, [&](size_t i, std::vector<std::byte>& scratch) {
    const Tensor& t = tensors[i].second;
    scratch.resize(t.nbytes());
    t.backend()->copy_to_host(t, scratch.data());
    return static_cast<const void*>(scratch.data());
  });
}

}  // namespace mt
