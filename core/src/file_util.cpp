#include "file_util.h"

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

std::string read_file(const std::string& path, const std::string& what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw UsageError(what + " file '" + path + "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    throw UsageError(what + " file '" + path + "' is a directory");
  std::string bytes;
  switch (read_all(path, bytes)) {
    case ReadStatus::ok:
      break;
    case ReadStatus::open_failed:
      throw UsageError(what + " file '" + path + "' cannot be read: " + std::strerror(errno));
    case ReadStatus::read_failed:
      throw UsageError(what + " file '" + path + "' cannot be read");
  }
  return bytes;
}

}  // namespace mt
