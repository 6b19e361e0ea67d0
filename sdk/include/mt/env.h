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

// The launcher's local rank, the GPU a process drives: OpenMPI's OMPI_COMM_WORLD_LOCAL_RANK,
// else Slurm's SLURM_LOCALID, else 0. A value that is not a whole number >= 0 is refused (atoi
// made "-1" a negative device and "x" device 0, silently).
inline int env_local_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"}) {
    const char* e = std::getenv(name);
    if (!e || !*e) continue;
    const std::string v = e;
    long r = 0;
    bool ok = v.size() <= 9;
    for (const char c : v) {
      ok = ok && c >= '0' && c <= '9';
      r = ok ? r * 10 + (c - '0') : 0;
    }
    if (!ok)
      throw UsageError(std::string(name) + "=" + v +
                       ": the launcher's local rank must be a whole number >= 0 (it picks this "
                       "process's GPU); unset it or let mpirun or srun set it.");
    return static_cast<int>(r);
  }
  return 0;
}

}  // namespace mt
