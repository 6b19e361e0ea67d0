// Shared by the fuzz harnesses: the input as a file, for the readers that take a path, and the
// report of a broken promise (a finding that is neither a crash nor a sanitizer report).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace mt::fuzz {

// Aborts with `what`: libFuzzer saves the input as a crash, the replay driver dies naming it.
[[noreturn]] inline void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what.c_str());
  std::abort();
}

// An in-memory file (memfd) rewritten with each input and opened by its /proc/self/fd/N name.
// The readers see a regular file, as they require, while nothing touches the disk or outlives
// the process, and parallel fuzzers (-jobs, -fork) never share one.
class MemFile {
 public:
  explicit MemFile(const char* name) : fd_(::memfd_create(name, MFD_CLOEXEC)) {
    if (fd_ < 0) finding(std::string("memfd_create: ") + std::strerror(errno));
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  // Replaces the contents with `size` bytes and returns the path to open.
  const std::string& write(const void* data, size_t size) {
    if (::ftruncate(fd_, 0) != 0) finding(std::string("ftruncate: ") + std::strerror(errno));
    const auto* p = static_cast<const char*>(data);
    for (size_t done = 0; done < size;) {
      const ssize_t w = ::pwrite(fd_, p + done, size - done, static_cast<off_t>(done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) finding(std::string("pwrite: ") + std::strerror(errno));
      done += static_cast<size_t>(w);
    }
    return path_;
  }

 private:
  int fd_;
  std::string path_;
};

}  // namespace mt::fuzz
