// Errors: values at the plugin boundary, sentences at the user boundary.
//
// Every error the user can cause is an mt::Error carrying a one-paragraph message and the exit
// code the CLI returns: 2 for bad input refused before work starts (config, arguments, plugins),
// 1 for failures during work (I/O, NaN loss, corrupt checkpoint).
#pragma once

#include <stdexcept>
#include <string>

namespace mt {

enum class ErrorKind : int {
  usage = 2,    // bad command line, config or plugin choice: refused before any work
  runtime = 1,  // failure while working
};

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg, ErrorKind kind = ErrorKind::runtime)
      : std::runtime_error(msg), kind_(kind) {}
  ErrorKind kind() const { return kind_; }
  int exit_code() const { return static_cast<int>(kind_); }

 private:
  ErrorKind kind_;
};

// Bad user input: exit code 2.
class UsageError : public Error {
 public:
  explicit UsageError(const std::string& msg) : Error(msg, ErrorKind::usage) {}
};

// Internal invariant violated by a caller (wrong shapes or dtypes handed to a kernel). Message
// names the op and the shapes.
[[noreturn]] void fail(const std::string& msg);

#define MT_CHECK(cond, ...)                                                  \
  do {                                                                       \
    if (!(cond)) ::mt::fail(::mt::detail::check_msg(#cond, __VA_ARGS__));    \
  } while (0)

namespace detail {
inline std::string check_msg(const char* cond, const std::string& msg) {
  return msg + " (check failed: " + cond + ")";
}
}  // namespace detail

}  // namespace mt
