// Switches read from the environment: the MT_* variables that choose between two ways of doing
// one thing (to compare them, or to work around a machine). Each takes 0 or 1; unset or empty
// keeps the default; any other value ("yes", "off", "2") is refused with the variable's name and
// what it switches, rather than silently meaning the default.
#pragma once

#include <cstdlib>
#include <string>

#include "mt/error.h"

namespace mt {

// The switch `name`: -1 when unset or empty, else 0 or 1. `what` says what 0 and 1 choose, for
// the message; `deflt` names the default there.
inline int env_flag(const char* name, const char* what, const char* deflt) {
  const char* e = std::getenv(name);
  if (!e || !*e) return -1;
  const std::string v = e;
  if (v == "0" || v == "1") return v == "1" ? 1 : 0;
  throw UsageError(std::string(name) + "=" + v + ": " + what + "; set 0 or 1, or unset it for " +
                   "the default (" + deflt + ").");
}

// The switch `name` as a bool: `deflt` when unset or empty.
inline bool env_switch(const char* name, bool deflt, const char* what) {
  const int v = env_flag(name, what, deflt ? "1" : "0");
  return v < 0 ? deflt : v == 1;
}

}  // namespace mt
