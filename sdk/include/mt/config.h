// Config: the resolved, validated key/value configuration of a run (read-only for plugins).
//
// Keys and their defaults live in configs/base.yml; every value remembers where it was set
// (file and line, or the command line) so errors can say so.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mt/export.h"

namespace mt {

class MT_API Config {
 public:
  Config();
  ~Config();
  Config(const Config&);
  Config& operator=(const Config&);
  Config(Config&&) noexcept;
  Config& operator=(Config&&) noexcept;

  bool has(const std::string& key) const;
  // Typed getters throw mt::UsageError naming the key when it is missing or of another type.
  int64_t get_int(const std::string& key) const;
  double get_float(const std::string& key) const;  // ints are accepted
  bool get_bool(const std::string& key) const;
  std::string get_string(const std::string& key) const;
  std::vector<std::string> get_string_list(const std::string& key) const;
  // Where the value was set: "configs/base.yml:12", "configs/models/llama2-7b.yml:3",
  // "command line".
  std::string origin(const std::string& key) const;
  // All keys in order of first definition.
  std::vector<std::string> keys() const;
  // The resolved configuration as YAML, with each key's origin as a comment when asked.
  std::string to_yaml(bool with_origins = false) const;

  // Used by plugins that validate their own part of the config: throws mt::UsageError with
  // "<key>=<value> (set at <origin>) <reason>".
  [[noreturn]] void reject(const std::string& key, const std::string& reason) const;

  struct Impl;
  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

// The CPU threads a run computes on: num_threads, or where that is 0 (or absent) the cores
// this process may run on (mpirun binds each rank to its own; taskset and cpusets restrict
// them too). The CPU backend's count, and the memory plan's.
MT_API int cpu_threads(const Config& cfg);

}  // namespace mt
