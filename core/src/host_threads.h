// HostThreads: a command's oneTBB parallelism bounded by num_threads while it lives.
//
// The backend runs its kernels in an arena of num_threads, but the host work around it (converting
// and transposing weights at load, quantizing them to int8, converting a Hugging Face directory)
// ran in oneTBB's default arena: every CPU of the affinity mask, whatever num_threads said (eight
// jobs of num_threads=8 on a 64-core machine each loaded on 64 threads).
#pragma once

#include <memory>

namespace mt {

class Config;

class HostThreads {
 public:
  // Bounds oneTBB's parallelism to cpu_threads(cfg) (num_threads, or the affinity mask's CPUs
  // when it is 0) until destroyed. A num_threads above the CPUs raises the bound, as the CPU
  // backend's arena does.
  explicit HostThreads(const Config& cfg);
  ~HostThreads();
  HostThreads(const HostThreads&) = delete;
  HostThreads& operator=(const HostThreads&) = delete;

  int threads() const { return threads_; }

 private:
  struct Limit;
  int threads_ = 1;
  std::unique_ptr<Limit> limit_;
};

}  // namespace mt
