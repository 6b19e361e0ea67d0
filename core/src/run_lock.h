// RunLock: one writer per run directory (issue 24, item 8). Two `mt run` with the same run_name
// used to both exit 0, leaving checkpoints of each, interleaved metrics and the config of one
// beside the final checkpoint of the other, from which the next resume continued.
//
// The lock is flock(LOCK_EX) on <run_dir>/run.lock, which holds the PID of its holder. The kernel
// drops it when the holder's descriptor closes, so a killed run (kill -9) never leaves a stale
// lock behind; the file itself stays (deleting it would let a third process lock a new file
// while the second still waits on the old one).
#pragma once

#include <filesystem>

namespace mt {

class RunLock {
 public:
  // Creates `run_dir` if needed and takes the lock. Throws mt::UsageError naming the directory
  // and the PID of the process that holds it, or mt::Error when the file cannot be made.
  explicit RunLock(const std::filesystem::path& run_dir);
  ~RunLock();
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace mt
