#include "allocator.h"

#include <cuda_runtime.h>

#include <string>

#include "mt/error.h"

namespace mt::cuda {

size_t DeviceAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  // Small blocks: multiples of 512 bytes (cudaMalloc's own granularity is coarser anyway).
  // Large: 4 size classes per power of two, so the waste is at most 25% and similar sizes
  // (activations of neighbouring layers) share blocks.
  if (bytes <= (size_t{1} << 20)) return (bytes + 511) & ~size_t{511};
  size_t p = size_t{1} << 20;
  while (p * 2 < bytes) p *= 2;
  const size_t step = p / 4;
  return (bytes + step - 1) / step * step;
}

DeviceAllocator::~DeviceAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  free_cache_locked();
}

void DeviceAllocator::free_cache_locked() {
  // cudaFree waits for the device; errors here cannot be reported usefully (teardown), and the
  // blocks are lost either way.
  for (auto& [size, blocks] : free_)
    for (void* p : blocks) static_cast<void>(cudaFree(p));
  free_.clear();
  stats_.bytes_cached = 0;
}

void* DeviceAllocator::allocate(size_t bytes) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= size;
  } else {
    cudaError_t e = cudaMalloc(&p, size);
    if (e == cudaErrorMemoryAllocation) {
      // Blocks of other size classes may be what is missing: give the cache back, try again.
      static_cast<void>(cudaGetLastError());  // clear the sticky-free error state
      free_cache_locked();
      e = cudaMalloc(&p, size);
    }
    if (e != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      throw Error("cuda: out of device memory: could not allocate " + std::to_string(size) +
                  " bytes with " + std::to_string(stats_.bytes_in_use) + " bytes in use (" +
                  cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + ")");
    }
    ++stats_.num_system_allocs;
  }
  stats_.bytes_in_use += size;
  if (stats_.bytes_in_use > stats_.peak_bytes_in_use)
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  return p;
}

void DeviceAllocator::release(void* p, size_t bytes) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  free_[size].push_back(p);
  stats_.bytes_in_use -= size;
  stats_.bytes_cached += size;
}

MemoryStats DeviceAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void DeviceAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
}

}  // namespace mt::cuda
