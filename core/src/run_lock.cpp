#include "run_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "file_util.h"
#include "mt/error.h"

namespace fs = std::filesystem;

namespace mt {

RunLock::RunLock(const fs::path& run_dir) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec)
    throw Error("Cannot create the run directory " + quoted(run_dir) + ": " + ec.message() +
                ". Set base_output_directory= to a directory mt may write to.");
  const fs::path file = run_dir / "run.lock";
  fd_ = ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd_ < 0)
    throw Error("Cannot create the run's lock file " + quoted(file) + ": " + std::strerror(errno) +
                ". Set base_output_directory= to a directory mt may write to.");
  int r;
  do r = ::flock(fd_, LOCK_EX | LOCK_NB);
  while (r != 0 && errno == EINTR);
  if (r != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof buf - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (err != EWOULDBLOCK)
      throw Error("Cannot lock the run directory through " + quoted(file) + ": " +
                  std::strerror(err) + ".");
    std::string pid = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    throw UsageError("Another mt process" + (pid.empty() ? std::string() : " (PID " + pid + ")") +
                     " is writing to the run directory " + quoted(run_dir) + " (it holds " +
                     quoted(file) +
                     "). Two runs in one directory would interleave their checkpoints and "
                     "metrics: wait for it to end, or give this run another run_name=.");
  }
  // Ours: record who holds it, for the message above.
  const std::string pid = std::to_string(::getpid()) + "\n";
  // Holding the lock is what matters; a PID that could not be written only makes the message
  // above vaguer.
  if (::ftruncate(fd_, 0) == 0) static_cast<void>(write_all(fd_, pid.data(), pid.size()));
}

RunLock::~RunLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace mt
