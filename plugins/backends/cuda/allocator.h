// Caching device allocator: blocks are kept on per-size-class free lists and reused, so a
// steady-state training step makes no cudaMalloc (or cudaFree, which synchronises the device).
//
// Blocks go back to the cache as soon as their Storage dies, even if kernels queued on the
// backend's stream still read them. That is safe because the backend has exactly one stream:
// whoever gets the block next enqueues its work behind those kernels.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

#include "mt/backend.h"

namespace mt::cuda {

class DeviceAllocator {
 public:
  DeviceAllocator() = default;
  ~DeviceAllocator();
  DeviceAllocator(const DeviceAllocator&) = delete;
  DeviceAllocator& operator=(const DeviceAllocator&) = delete;

  // 256-byte aligned device memory; `bytes` is rounded up to its size class.
  void* allocate(size_t bytes);
  void release(void* p, size_t bytes);
  MemoryStats stats() const;
  void reset_peak();
  static size_t round_size(size_t bytes);

 private:
  void free_cache_locked();  // gives every cached block back to the driver
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  MemoryStats stats_;
};

}  // namespace mt::cuda
