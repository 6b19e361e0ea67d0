// The `tokens` file format and a read-only memory-mapped view of one or more such files.
//
// Layout (little-endian), 32-byte header then the ids:
//   offset  0  char[8]  magic "MTTOKENS"
//   offset  8  u32      version (1)
//   offset 12  u32      dtype: bytes per id, 2 (uint16) or 4 (uint32)
//   offset 16  u64      count: number of ids that follow
//   offset 24  u32      eos_id: the id that ends a document (0xFFFFFFFF = none)
//   offset 28  u32      bos_id: the id that starts a document (0xFFFFFFFF = none)
//   offset 32  count ids of dtype bytes each
// Documents are delimited by eos_id (the eos belongs to the document it ends) and bos_id (the
// bos belongs to the document it starts); the end of a file also ends a document.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../common/token_stream.h"

namespace mt_tokens {

inline constexpr char kMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kVersion = 1;
inline constexpr uint32_t kNoId = 0xFFFFFFFFu;
inline constexpr size_t kHeaderBytes = 32;

// One mapped file; validated on open (magic, version, dtype, size), ids checked when read.
class TokenFile {
 public:
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t count() const { return count_; }
  uint32_t eos_id() const { return eos_; }
  uint32_t bos_id() const { return bos_; }
  uint32_t at(uint64_t i) const;

 private:
  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const unsigned char* ids_ = nullptr;
  uint32_t dtype_ = 0, eos_ = kNoId, bos_ = kNoId;
  uint64_t count_ = 0;
};

// The files of a dataset as one token stream, in the order given.
class Corpus final : public mt_data::TokenStream {
 public:
  // paths: files in stream order. vocab_size: ids must be below it (checked per read).
  Corpus(const std::vector<std::string>& paths, int64_t vocab_size);

  uint64_t size() const override { return total_; }
  // Copies ids [begin, begin + n) to `ids` and marks in `doc_start` which of them begin a
  // document (first id of a file, the id after its file's eos, or its bos). Throws mt::Error naming
  // the file and the offset for an id >= vocab_size.
  void read(uint64_t begin, uint64_t n, int32_t* ids, uint8_t* doc_start) const override;
  // Every document as [begin, end) in the stream (for packing=false).
  std::vector<std::pair<uint64_t, uint64_t>> documents() const override;
  std::string describe() const override;  // "a.tokens, b.tokens"

 private:
  size_t file_of(uint64_t i) const;

  std::vector<std::unique_ptr<TokenFile>> files_;
  std::vector<uint64_t> starts_;  // stream index of each file's first id
  uint64_t total_ = 0;
  int64_t vocab_ = 0;
};

// Expands dataset_path: a file, a directory (its *.tokens, sorted), a comma-separated list, or
// glob patterns. Throws mt::UsageError naming `key` when something matches nothing.
std::vector<std::string> expand_paths(const std::string& spec, const std::string& key);

}  // namespace mt_tokens
