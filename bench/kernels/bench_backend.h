// The CPU backend the kernel benchmarks time, made once per process: all cores, or
// MT_BENCH_THREADS threads (with 1 thread the CPU-time column is the kernel's whole cost, which
// is steadier on a shared machine).
#pragma once

#include <cstdlib>
#include <memory>

#include "config_impl.h"
#include "mt/backend.h"
#include "plugin_manager.h"

namespace mt::bench {

inline Backend& cpu_backend() {
  static PluginManager pm;
  static std::unique_ptr<Backend> b = [] {
    const char* t = std::getenv("MT_BENCH_THREADS");
    return pm.make_backend("cpu", config_from_pairs({{"num_threads", t ? t : "0"}}));
  }();
  return *b;
}

}  // namespace mt::bench
