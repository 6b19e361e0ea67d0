#include "token_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <memory>

#include "../common/paths.h"
#include "mt/error.h"

namespace mt_tokens {

// The ids are stored little-endian and read in place from the mapping.
static_assert(std::endian::native == std::endian::little, "tokens files are little-endian");

namespace {

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

[[noreturn]] void bad_file(const std::string& path, const std::string& why) {
  throw mt::UsageError("tokens: " + path + ": " + why);
}

}  // namespace

TokenFile::TokenFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) bad_file(path, std::string("cannot open: ") + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    bad_file(path, "not a regular file");
  }
  const auto bytes = static_cast<uint64_t>(st.st_size);
  if (bytes < kHeaderBytes) {
    ::close(fd);
    bad_file(path, "truncated header (" + std::to_string(bytes) + " bytes, a header is " +
                       std::to_string(kHeaderBytes) + ")");
  }
  void* m = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) bad_file(path, std::string("cannot map: ") + std::strerror(errno));
  map_ = m;
  map_bytes_ = bytes;
  const auto* p = static_cast<const unsigned char*>(m);
  // The constructor throws below after mapping: unmap on the way out so nothing leaks.
  auto fail = [&](const std::string& why) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    bad_file(path, why);
  };
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0)
    fail("bad magic (not a tokens file; expected \"MTTOKENS\")");
  const auto version = load<uint32_t>(p + 8);
  if (version != kVersion)
    fail("unsupported version " + std::to_string(version) + " (this build reads version 1)");
  dtype_ = load<uint32_t>(p + 12);
  if (dtype_ != 2 && dtype_ != 4)
    fail("bad dtype " + std::to_string(dtype_) + " (2 = uint16 or 4 = uint32 ids)");
  count_ = load<uint64_t>(p + 16);
  eos_ = load<uint32_t>(p + 24);
  bos_ = load<uint32_t>(p + 28);
  const uint64_t payload = bytes - kHeaderBytes;
  if (count_ > payload / dtype_ || payload != count_ * dtype_)
    fail("size mismatch: header says " + std::to_string(count_) + " ids of " +
         std::to_string(dtype_) + " bytes, the file holds " + std::to_string(payload) +
         " bytes after the header (truncated or corrupt)");
  ids_ = p + kHeaderBytes;
  // Rows are read as contiguous runs at random offsets.
  ::madvise(map_, map_bytes_, MADV_RANDOM);
}

TokenFile::~TokenFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

uint32_t TokenFile::at(uint64_t i) const {
  return dtype_ == 2 ? load<uint16_t>(ids_ + 2 * i) : load<uint32_t>(ids_ + 4 * i);
}

Corpus::Corpus(const std::vector<std::string>& paths, int64_t vocab_size) : vocab_(vocab_size) {
  for (const auto& p : paths) {
    auto f = std::make_unique<TokenFile>(p);
    if (f->eos_id() != kNoId && f->eos_id() >= static_cast<uint64_t>(vocab_))
      throw mt::UsageError("tokens: " + p + ": eos_id " + std::to_string(f->eos_id()) +
                           " is >= vocab_size " + std::to_string(vocab_) +
                           " (made with another tokenizer?)");
    if (f->count() == 0) continue;  // an empty shard adds nothing
    starts_.push_back(total_);
    total_ += f->count();
    files_.push_back(std::move(f));
  }
}

size_t Corpus::file_of(uint64_t i) const {
  auto it = std::upper_bound(starts_.begin(), starts_.end(), i);
  return static_cast<size_t>(it - starts_.begin()) - 1;
}

void Corpus::read(uint64_t begin, uint64_t n, int32_t* ids, uint8_t* doc_start) const {
  uint64_t k = 0;
  while (k < n) {
    const uint64_t g = begin + k;
    const size_t fi = file_of(g);
    const TokenFile& f = *files_[fi];
    const uint64_t local = g - starts_[fi];
    const uint64_t run = std::min(n - k, f.count() - local);
    // Whether the id before this run ends a document: the file's start, or its eos. A bos
    // starts one too: a file written with add_eos=false marks its documents by bos alone
    // (before, its documents ran together: packed rows attended across them and each bos
    // was a target of the document before it).
    bool prev_ends = local == 0 || f.at(local - 1) == f.eos_id();
    for (uint64_t j = 0; j < run; ++j) {
      const uint32_t id = f.at(local + j);
      if (id >= static_cast<uint64_t>(vocab_))
        throw mt::UsageError("tokens: " + f.path() + ": token id " + std::to_string(id) +
                             " at index " + std::to_string(local + j) + " is >= vocab_size " +
                             std::to_string(vocab_) + " (made with another tokenizer?)");
      ids[k + j] = static_cast<int32_t>(id);
      doc_start[k + j] = prev_ends || id == f.bos_id() ? 1 : 0;
      prev_ends = id == f.eos_id();
    }
    k += run;
  }
}

std::vector<std::pair<uint64_t, uint64_t>> Corpus::documents() const {
  std::vector<std::pair<uint64_t, uint64_t>> docs;
  for (size_t fi = 0; fi < files_.size(); ++fi) {
    const TokenFile& f = *files_[fi];
    uint64_t begin = 0;
    for (uint64_t i = 0; i < f.count(); ++i) {
      if (f.at(i) == f.bos_id() && i > begin) {  // a bos after no eos starts the next one
        docs.emplace_back(starts_[fi] + begin, starts_[fi] + i);
        begin = i;
      }
      if (f.at(i) == f.eos_id()) {
        docs.emplace_back(starts_[fi] + begin, starts_[fi] + i + 1);
        begin = i + 1;
      }
    }
    if (begin < f.count()) docs.emplace_back(starts_[fi] + begin, starts_[fi] + f.count());
  }
  return docs;
}

std::string Corpus::describe() const {
  std::string s;
  for (const auto& f : files_) s += (s.empty() ? "" : ", ") + f->path();
  return s;
}

std::vector<std::string> expand_paths(const std::string& spec, const std::string& key) {
  // Plain files are opened (and their absence reported) by TokenFile.
  return mt_data::expand_paths(spec, key, {".tokens"}, "tokens file");
}

}  // namespace mt_tokens
