// safetensors: the Hugging Face ecosystem's tensor file format, read and written natively.
//
// Layout: an 8-byte little-endian u64 N, then N bytes of JSON (UTF-8, may be padded with trailing
// spaces), then the data section. The JSON object maps each tensor name to
//   {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
// with offsets relative to the start of the data section, plus an optional "__metadata__" object
// of string -> string. Tensors are row-major, little-endian, and tile the data section exactly
// (no gaps, no overlaps), as the reference implementation requires.
//
// The reader maps the file read-only and validates all of it up front, so later accesses are plain
// pointer reads that cannot go out of bounds. Every problem is an mt::Error naming the file and,
// where there is one, the tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mt/dtype.h"
#include "mt/tensor.h"

namespace mt {

class Backend;

// ---- dtypes ---------------------------------------------------------------------------------
// The file's dtype strings: "BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16",
// "BF16", "I32", "U32", "F32", "F64", "I64", "U64". Element size in bytes, 0 when unknown.
size_t safetensors_dtype_size(std::string_view st_dtype);
// mt dtype -> file string ("F32", "BF16", ...).
const char* safetensors_dtype_name(DType t);
// File string -> mt dtype, when mt has one.
std::optional<DType> dtype_from_safetensors(std::string_view st_dtype);
// Whether the file's dtype is a floating one mt converts from (F16, BF16, F32, F64).
bool safetensors_dtype_is_float(std::string_view st_dtype);

// ---- reading --------------------------------------------------------------------------------
struct SafeTensorInfo {
  std::string name;
  std::string dtype;  // as written in the file: "F32", "BF16", ...
  Shape shape;        // [] for a scalar
  size_t begin = 0;   // byte offsets within the data section, [begin, end)
  size_t end = 0;
  const std::byte* data = nullptr;  // into the mapping; may be unaligned, zero-size when empty
  size_t nbytes() const { return end - begin; }
  int64_t numel() const { return shape_numel(shape); }
};

class SafeTensorsFile {
 public:
  // Maps and validates the file; throws mt::Error naming the file and the problem.
  explicit SafeTensorsFile(const std::filesystem::path& path);
  ~SafeTensorsFile();
  SafeTensorsFile(SafeTensorsFile&& o) noexcept;
  SafeTensorsFile& operator=(SafeTensorsFile&& o) noexcept;
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Tensor names, sorted.
  const std::vector<std::string>& names() const { return names_; }
  size_t size() const { return names_.size(); }
  bool contains(std::string_view name) const;
  // Throws mt::Error naming the file and the tensor when there is no such tensor.
  const SafeTensorInfo& info(std::string_view name) const;
  // The "__metadata__" map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t file_size() const { return size_; }

 private:
  void unmap() noexcept;

  std::filesystem::path path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::vector<std::string> names_;
  std::map<std::string, SafeTensorInfo, std::less<>> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Copies tensor `name` onto `backend` as dtype `want`. Floating types (F64, F32, BF16, F16)
// convert to any floating `want` on the host (round to nearest even); integer types convert to
// an integer `want` when every value fits. Anything else, or a missing tensor, throws mt::Error
// naming the file and the tensor.
Tensor load_tensor(const SafeTensorsFile& file, std::string_view name, Backend& backend,
                   DType want);
// As above, and also requires the shape to be `expect` (the error states both shapes).
Tensor load_tensor(const SafeTensorsFile& file, std::string_view name, Backend& backend, DType want,
                   const Shape& expect);
// Loads tensor `name` into an existing tensor: shapes must match; converts to dst's dtype.
void load_into(const SafeTensorsFile& file, std::string_view name, Tensor& dst);
// Drops the pages of a read tensor's bytes from the process (they stay in the page cache, and a
// later read maps them again): the loaders call it once a tensor is copied, so a file's pages
// do not add up in the process's resident memory while a model loads (mt decode of a 3.6 GiB
// llama-bench-1b directory peaked at 7.2 GiB resident for 4.5 GiB of its own memory). Pages
// shared with a neighbouring tensor go too (read again on use); the mapping is read-only, so
// nothing is lost.
void release_pages(const SafeTensorInfo& info);
// `n` floating elements stored as `st_dtype` ("F32", "BF16", "F16", "F64") to `want` (a
// floating dtype), on the host, rounding to nearest even; throws mt::Error for other types.
void convert_float_elements(const std::string& st_dtype, const void* in, DType want, void* out,
                            size_t n);
// Floating tensor `name` as f32 on the host, converted in parallel (throws for other types).
std::vector<float> read_f32(const SafeTensorsFile& file, std::string_view name);

// ---- writing --------------------------------------------------------------------------------
struct SafeTensorsEntry {
  std::string name;
  std::string dtype;  // file string, e.g. "F32"
  Shape shape;
  const void* data = nullptr;  // host memory, numel * element size bytes, little-endian

  SafeTensorsEntry() = default;
  SafeTensorsEntry(std::string n, DType t, Shape s, const void* d)
      : name(std::move(n)), dtype(safetensors_dtype_name(t)), shape(std::move(s)), data(d) {}
  SafeTensorsEntry(std::string n, std::string t, Shape s, const void* d)
      : name(std::move(n)), dtype(std::move(t)), shape(std::move(s)), data(d) {}
};

// Writes a safetensors file atomically: to `<path>.tmp`, fsync, rename over `path`, fsync the
// directory. On any failure (bad entry, duplicate name, I/O error such as a full disk) the
// temporary file is removed, `path` is left as it was, and mt::Error names the file and cause.
// Tensors are laid out in order of decreasing element size (stable), so every tensor is aligned
// to its element size in the file, as the Python library does.
void write_safetensors(const std::filesystem::path& path,
                       const std::vector<SafeTensorsEntry>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Tensors of any backend (copied to the host one at a time while writing, so at most one tensor's
// bytes are held besides the buffers themselves).
void save_tensors(const std::filesystem::path& path,
                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata = {});

}  // namespace mt
