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
    : limit_(std::make_unique<Limit>(cpu_threads(cfg))), threads_(cpu_threads(cfg)) {}

HostThreads::~HostThreads() = default;

}  // namespace mt
