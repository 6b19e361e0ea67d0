#include "allocator.h"

#include <cuda_runtime.h>

#include <bit>
#include <cstdint>
#include <cstdio>
#include <string>

#include "mt/error.h"

namespace mt::cuda {
namespace {

std::string gib(size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
  return buf;
}

}  // namespace

struct DeviceAllocator::Pool {
  DeviceAllocator* allocator = nullptr;
  std::map<size_t, std::vector<void*>> free;  // the pool's blocks not in use
  // The pool's blocks return to the cache when the graph holding it goes.
  ~Pool() {
    std::lock_guard<std::mutex> lock(allocator->mu_);
    allocator->drop_pool_locked(*this);
  }
};

// Both count the block as cached already (release did).
void DeviceAllocator::drop_pool_locked(Pool& pool) {
  for (auto& [size, blocks] : pool.free)
    for (void* p : blocks) {
      owner_.erase(p);
      free_[size].push_back(p);
    }
  pool.free.clear();
}

void DeviceAllocator::begin_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  MT_CHECK(!open_, "cuda allocator: a recording is already under way");
  open_ = std::make_shared<Pool>();
  open_->allocator = this;
}

std::shared_ptr<DeviceAllocator::Pool> DeviceAllocator::end_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [p, size] : quarantine_) free_[size].push_back(p);
  quarantine_.clear();
  return std::move(open_);
}

size_t DeviceAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  // Small blocks: multiples of 512 bytes (cudaMalloc's own granularity is coarser anyway).
  // Large: 4 size classes per power of two, so the waste is at most 25% and similar sizes
  // (activations of neighbouring layers) share blocks.
  if (bytes <= (size_t{1} << 20)) return (bytes + 511) & ~size_t{511};
  // A quarter of the largest power of two below `bytes`, without a doubling loop (which never
  // ended above 2^63); allocate() refuses such sizes before rounding anyway.
  // Above 64 MiB (weights, optimizer state, the largest activations) a 2 MiB granule instead:
  // four classes per power of two wasted up to 25% there (7.5% of llama2-7b's f32 weights).
  const size_t step = bytes > (size_t{64} << 20) ? size_t{2} << 20 : std::bit_floor(bytes - 1) / 4;
  if (bytes > SIZE_MAX - step) return SIZE_MAX;
  return (bytes + step - 1) / step * step;
}

DeviceAllocator::~DeviceAllocator() {
  std::lock_guard<std::mutex> lock(mu_);
  free_cache_locked();
}

void DeviceAllocator::release_cached() {
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
  if (bytes > kMaxAllocationBytes)
    throw Error("cuda: cannot allocate " + gib(bytes) +
                ": more than any device has (the limit is 2^60 bytes). " + kOutOfMemoryAdvice);
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  if (open_) {  // a recording: its own freed blocks first
    auto pit = open_->free.find(size);
    if (pit != open_->free.end() && !pit->second.empty()) {
      p = pit->second.back();
      pit->second.pop_back();
      stats_.bytes_cached -= size;
      stats_.bytes_in_use += size;
      if (stats_.bytes_in_use > stats_.peak_bytes_in_use)
        stats_.peak_bytes_in_use = stats_.bytes_in_use;
      return p;
    }
  }
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
      size_t free_bytes = 0, total_bytes = 0;
      if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        total_bytes = 0;
      }
      throw Error(
          "cuda: out of device memory: could not allocate " + gib(size) + " with " +
          gib(stats_.bytes_in_use) + " in use by mt" +
          (total_bytes ? ", " + gib(free_bytes) + " free of the device's " + gib(total_bytes)
                       : std::string()) +
          " (" + cudaGetErrorName(e) + ": " + cudaGetErrorString(e) + "). " + kOutOfMemoryAdvice);
    }
    ++stats_.num_system_allocs;
  }
  if (open_) owner_[p] = open_;
  stats_.bytes_in_use += size;
  if (stats_.bytes_in_use > stats_.peak_bytes_in_use)
    stats_.peak_bytes_in_use = stats_.bytes_in_use;
  return p;
}

void DeviceAllocator::release(void* p, size_t bytes) {
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_in_use -= size;
  if (auto it = owner_.find(p); it != owner_.end()) {
    if (std::shared_ptr<Pool> pool = it->second.lock()) {
      pool->free[size].push_back(p);  // still the graph's
      stats_.bytes_cached += size;
      return;
    }
    owner_.erase(it);  // its graph is gone
  } else if (open_) {
    // A block from before the recording: kernels recorded earlier may read it at each replay.
    quarantine_.emplace_back(p, size);
    stats_.bytes_cached += size;
    return;
  }
  free_[size].push_back(p);
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
