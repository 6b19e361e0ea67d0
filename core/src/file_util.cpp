#include "file_util.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "mt/error.h"

namespace mt {

std::string quoted(const std::filesystem::path& p) {
  // Built by appending: GCC 12 warns falsely (-Wrestrict) about "'" + std::string&&.
  std::string s = p.string();
  s.insert(s.begin(), '\'');
  s += '\'';
  return s;
}

ReadStatus read_all(const std::filesystem::path& path, std::string& out) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return ReadStatus::open_failed;
  std::ostringstream ss;
  ss << f.rdbuf();
  if (f.bad()) return ReadStatus::read_failed;
  out = std::move(ss).str();
  return ReadStatus::ok;
}

bool write_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // Linux transfers at most ~2 GiB per call; chunk so large tensors need no special case.
    const size_t chunk = std::min<size_t>(n, size_t{1} << 30);
    const ssize_t w = ::write(fd, p, chunk);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

namespace {

std::string bytes_text(uint64_t n) {
  if (n >= (uint64_t{1} << 30) && n % (uint64_t{1} << 30) == 0)
    return std::to_string(n >> 30) + " GiB";
  if (n >= (uint64_t{1} << 20) && n % (uint64_t{1} << 20) == 0)
    return std::to_string(n >> 20) + " MiB";
  return std::to_string(n) + " bytes";
}

// Opens a regular file for reading, or throws. The type is checked before open() (opening a
// FIFO waits for a writer) and again on the descriptor, in case the path changed in between.
int open_regular(const std::string& path, const std::string& what) {
  const std::string name = what + " file '" + path + "'";
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (st.type() == std::filesystem::file_type::not_found)
    throw UsageError(name + " does not exist");
  if (st.type() == std::filesystem::file_type::directory)
    throw UsageError(name + " is a directory");
  if (!ec && st.type() != std::filesystem::file_type::regular)
    throw UsageError(name +
                     " is not a regular file (a device, FIFO or socket, which may never end); "
                     "mt reads regular files only");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw UsageError(name + " cannot be read: " + std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    throw UsageError(name + " is not a regular file; mt reads regular files only");
  }
  return fd;
}

// read(2) resuming after EINTR; -1 with errno on an error.
ssize_t read_some(int fd, char* p, size_t n) {
  for (;;) {
    const ssize_t r = ::read(fd, p, n);
    if (r >= 0 || errno != EINTR) return r;
  }
}

// A UTF-8 byte order mark (EF BB BF) at the start of a file is skipped, as Python's
// "utf-8-sig" codec skips it: editors on Windows write one, and the first JSON line would
// otherwise be refused as malformed at byte 0 with nothing visibly wrong in it. (Refusing it
// with a sentence naming the mark was the other choice; skipping is what readers expect.) Only
// at the file's start: anywhere else U+FEFF is text.
void skip_byte_order_mark(std::string_view& first_line) {
  if (first_line.substr(0, 3) == "\xEF\xBB\xBF") first_line.remove_prefix(3);
}

}  // namespace

std::string read_file(const std::string& path, const std::string& what, uint64_t max_bytes) {
  const int fd = open_regular(path, what);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  const std::string name = what + " file '" + path + "'";
  auto too_large = [&] {
    return UsageError(
        name + " is larger than " + bytes_text(max_bytes) + ", the most mt reads from " +
        (what.find_first_of("aeiou") == 0 ? "an " : "a ") + what + " file: is it the right file?");
  };
  struct stat sb {};
  if (::fstat(fd, &sb) == 0 && static_cast<uint64_t>(sb.st_size) > max_bytes) throw too_large();
  std::string bytes;
  bytes.resize(static_cast<size_t>(std::max<off_t>(sb.st_size, 0)) + 1);
  size_t have = 0;
  for (;;) {
    if (have == bytes.size()) {
      // The file grew since fstat (or reports no size, as /proc does): keep going, bounded.
      if (have > max_bytes) throw too_large();
      bytes.resize(std::min<uint64_t>(std::max<size_t>(2 * have, 4096), max_bytes + 1));
    }
    const ssize_t r = read_some(fd, bytes.data() + have, bytes.size() - have);
    if (r < 0) throw UsageError(name + " cannot be read: " + std::strerror(errno));
    if (r == 0) break;
    have += static_cast<size_t>(r);
  }
  if (have > max_bytes) throw too_large();
  bytes.resize(have);
  return bytes;
}

LineReader::LineReader(const std::string& path, const std::string& what, uint64_t max_line)
    : path_(path), what_(what), max_line_(max_line), fd_(open_regular(path, what)) {}

LineReader::~LineReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool LineReader::fill() {
  if (eof_) return false;
  if (begin_ > 0) {
    buf_.erase(0, begin_);
    begin_ = 0;
  }
  const size_t chunk = size_t{1} << 20;
  const size_t old = buf_.size();
  buf_.resize(old + chunk);
  const ssize_t r = read_some(fd_, buf_.data() + old, chunk);
  if (r < 0) {
    buf_.resize(old);
    throw UsageError(what_ + " file '" + path_ + "' cannot be read: " + std::strerror(errno));
  }
  buf_.resize(old + static_cast<size_t>(r));
  if (r == 0) eof_ = true;
  return r > 0;
}

bool LineReader::next(std::string_view& line) {
  size_t scanned = begin_;
  for (;;) {
    const size_t nl = buf_.find('\n', scanned);
    if (nl != std::string::npos) {
      if (nl - begin_ > max_line_) break;
      ++line_no_;
      line = std::string_view(buf_).substr(begin_, nl - begin_);
      begin_ = nl + 1;
      if (line_no_ == 1) skip_byte_order_mark(line);
      return true;
    }
    if (buf_.size() - begin_ > max_line_) break;
    scanned = buf_.size();
    const size_t shift = begin_;
    if (!fill()) {
      if (buf_.size() == begin_) return false;
      ++line_no_;
      line = std::string_view(buf_).substr(begin_);
      begin_ = buf_.size();
      if (line_no_ == 1) skip_byte_order_mark(line);
      return true;
    }
    scanned -= shift;  // fill() moved the unread part to the front
  }
  throw UsageError(what_ + " file '" + path_ + "': line " + std::to_string(line_no_ + 1) +
                   " is longer than " + bytes_text(max_line_) +
                   ", the most mt holds of one record: is it the right file?");
}

}  // namespace mt
