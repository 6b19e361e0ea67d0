// Caching host allocator: blocks are kept on per-size free lists and reused, so a steady-state
// training step makes no calls to the system allocator.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <vector>

#include "mt/backend.h"

namespace mt::cpu {

class CachingAllocator {
 public:
  CachingAllocator() = default;
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // 64-byte aligned; `bytes` is rounded up to the block's size class.
  void* allocate(size_t bytes);
  void release(void* p, size_t bytes);
  MemoryStats stats() const;
  void reset_peak();
  // Every cached free block back to the system.
  void release_cached();
  // Size class of a request (what allocate() really reserves).
  static size_t round_size(size_t bytes);

 private:
  void release_cached_locked();
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  MemoryStats stats_;
};

}  // namespace mt::cpu
