// Bounded file reading, part of the SDK so plugins (data sources) read files as the core does.
//
// The one bounded reader (issue 24, item 5): every file mt reads whole or by lines comes through
// these, so none can be made to read forever or without limit. Both refuse anything but a
// regular file before opening it (a FIFO would block the open, /dev/zero never ends), and
// bound what they hold: `max_bytes` for a whole file, `max_line` for one line.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "mt/export.h"

namespace mt {

inline constexpr uint64_t kMaxFileBytes = uint64_t{1} << 30;  // 1 GiB
inline constexpr uint64_t kMaxConfigFileBytes = uint64_t{16} << 20;
// One record of a data file: a JSON line, or a whole plain-text document.
inline constexpr uint64_t kMaxRecordBytes = uint64_t{256} << 20;

// Whole file; throws mt::UsageError "<what> file '<path>' ..." when missing, not a regular file,
// larger than `max_bytes`, or unreadable.
MT_API std::string read_file(const std::string& path, const std::string& what,
                             uint64_t max_bytes = kMaxFileBytes);

// A regular file read line by line ('\n' ends a line and is not part of it; a last line
// without one counts; a UTF-8 byte order mark at the start of the file is skipped). Errors are
// mt::UsageError naming `what`, the path and the line.
class MT_API LineReader {
 public:
  LineReader(const std::string& path, const std::string& what, uint64_t max_line);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;
  // The next line, valid until the next call; false at the end of the file.
  bool next(std::string_view& line);
  // 1-based number of the line `next` returned last.
  uint64_t line_number() const { return line_no_; }

 private:
  bool fill();
  std::string path_, what_;
  uint64_t max_line_;
  int fd_ = -1;
  std::string buf_;
  size_t begin_ = 0;  // start of the unread part of buf_
  bool eof_ = false;
  uint64_t line_no_ = 0;
};

}  // namespace mt
