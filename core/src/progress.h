// One live line of progress for a long phase (initialising parameters, loading weights,
// evaluating), with the share done and an ETA, redrawn in place on a terminal once the phase has
// lasted a second; nothing at all for a shorter phase, when the stream is not a terminal, or
// when the caller is quiet (logs keep their plain lines).
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace mt {

class Progress {
 public:
  // `unit`: "B" counts bytes (shown as MB/GB), anything else counts items of that name.
  Progress(std::string what, double total, std::string unit, bool enabled, std::FILE* out = stderr);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Whether stdout (for the trainer's own lines) or stderr is a terminal.
  static bool terminal(std::FILE* f);

  void add(double amount) { update(done_ + amount); }
  // Redraws at most ten times a second (and at the end).
  void update(double done);
  // Ends the line with the time taken; called by the destructor if not before.
  void finish();

 private:
  std::string amount(double v) const;

  std::string what_, unit_;
  double total_, done_ = 0;
  bool enabled_, finished_ = false, drawn_ = false;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace mt
