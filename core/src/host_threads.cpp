#include "host_threads.h"

#include <mt/config.h>

#include <oneapi/tbb/global_control.h>

namespace mt {

struct HostThreads::Limit {
  explicit Limit(int n)
      : control(tbb::global_control::max_allowed_parallelism, static_cast<size_t>(n)) {}
  tbb::global_control control;
};

HostThreads::HostThreads(const Config& cfg)
    : threads_(cpu_threads(cfg)), limit_(std::make_unique<Limit>(threads_)) {}

HostThreads::~HostThreads() = default;

}  // namespace mt
