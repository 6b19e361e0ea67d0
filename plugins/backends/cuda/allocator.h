// Caching device allocator: blocks are kept on per-size-class free lists and reused, so a
// steady-state training step makes no cudaMalloc (or cudaFree, which synchronises the device).
//
// Blocks go back to the cache as soon as their Storage dies, even if kernels queued on the
// backend's stream still read them. That is safe because the backend has exactly one stream:
// whoever gets the block next enqueues its work behind those kernels.
//
// A recorded CUDA graph (WorkCapture) writes the blocks it was recorded on at every replay, so
// those blocks must not go to anyone else while the graph lives. Between begin_pool() and
// end_pool() every allocation comes from a pool of its own: a block freed during the recording
// is reused by later allocations of the same recording only (the graph runs them in the same
// order), and blocks freed after it go back to the pool, not the cache. Blocks that tensors made
// before the recording free during it wait until the recording ends before anyone reuses them: a
// kernel recorded earlier may read them at each replay. Once the pool is dropped (the graph is
// destroyed), its blocks return to the cache as they are freed.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
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
  // Every cached free block back to the driver (cudaFree waits for the device); blocks freed
  // during a recording stay until it ends.
  void release_cached();
  static size_t round_size(size_t bytes);

  // The blocks of one recording, kept from the cache while the returned handle lives.
  struct Pool;
  void begin_pool();
  // Ends the recording's allocations (also after a failed one); the pool lives as long as the
  // returned handle (held by the recorded graph).
  std::shared_ptr<Pool> end_pool();

 private:
  void free_cache_locked();  // gives every cached block back to the driver
  void drop_pool_locked(Pool& pool);  // the pool's free blocks to the cache
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // size class -> free blocks
  MemoryStats stats_;
  std::shared_ptr<Pool> open_;                            // the recording under way, if any
  std::vector<std::pair<void*, size_t>> quarantine_;      // freed during it, cached at its end
  std::unordered_map<void*, std::weak_ptr<Pool>> owner_;  // pool blocks -> their pool
};

}  // namespace mt::cuda
