#include "allocator.h"

#include <bit>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <string>

#include <sys/mman.h>

#include "asan.h"
#include "mt/env.h"
#include "mt/error.h"

namespace mt::cpu {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// Blocks of 2 MiB or more start on a 2 MiB boundary and ask the kernel for transparent huge
// pages (MADV_HUGEPAGE: most distributions set THP to "madvise", so memory gets them only when
// asked). A decode step streams every weight once; with 4 KiB pages each page of a weight
// costs a TLB miss and a page walk, and one core's stream stalls on them: llama-bench-1b's
// bf16 matrix-vector products read 47 GB/s from 4 KiB pages and 57 GB/s from huge ones on the
// 2-core EPYC of 2026-11-27 (llama.cpp reads its weights from an mmapped file, whose page
// cache had huge pages). MT_CPU_HUGEPAGES=0 keeps 4 KiB pages.
bool huge_pages_on() {
  static const bool kOn = [] {
    return env_switch("MT_CPU_HUGEPAGES", true,
                      "large blocks come from 4 KiB pages (0) or 2 MiB huge pages where the "
                      "kernel gives them (1)");
  }();
  return kOn;
}

size_t huge_extent(size_t size) {
  return (size + kHugePage - 1) / kHugePage * kHugePage;
}

void* system_alloc(size_t size) {
  if (size < kHugePage || !huge_pages_on()) return std::aligned_alloc(64, size);
  // aligned_alloc wants a size that is a multiple of the alignment; the tail past `size` is
  // never touched, so it costs address space, not memory. Only the whole huge pages within
  // `size` are advised: a huge page over the block's end would make its untouched part resident.
  void* p = std::aligned_alloc(kHugePage, huge_extent(size));
  // Advice only: where the kernel has no THP (or refuses), the block keeps small pages.
  if (p) (void)madvise(p, size / kHugePage * kHugePage, MADV_HUGEPAGE);
  // ASan counts that tail as part of the allocation.
  if (p) asan_poison(static_cast<char*>(p) + size, huge_extent(size) - size);
  return p;
}

// Under ASan (asan.h) the block is poisoned: it is made addressable again, tail included,
// before free() takes it back.
void system_free(void* p, size_t size) {
#ifdef MT_CPU_ASAN
  asan_unpoison(p, size < kHugePage || !huge_pages_on() ? size : huge_extent(size));
#endif
  std::free(p);
}

}  // namespace

size_t CachingAllocator::round_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  // Small blocks: multiples of 64 bytes. Large: 4 size classes per power of two, so the waste
  // is at most 25% and similar sizes share blocks.
  if (bytes <= 4096) return (bytes + 63) & ~size_t{63};
  // A quarter of the largest power of two below `bytes`. No loop: a doubling loop never ended
  // for sizes above 2^63 (it wrapped to 0), which allocate() refuses before rounding anyway.
  // Above 64 MiB (weights, optimizer state, the largest activations) a 2 MiB granule instead:
  // four classes per power of two wasted up to 25% there (7.5% of llama2-7b's f32 weights).
  const size_t step = bytes > (size_t{64} << 20) ? size_t{2} << 20 : std::bit_floor(bytes - 1) / 4;
  if (bytes > SIZE_MAX - step) return SIZE_MAX;
  return (bytes + step - 1) / step * step;
}

CachingAllocator::~CachingAllocator() {
  for (auto& [size, blocks] : free_)
    for (void* p : blocks) system_free(p, size);
}

void* CachingAllocator::allocate(size_t bytes) {
  if (bytes > kMaxAllocationBytes)
    throw Error("The CPU backend cannot allocate " + std::to_string(bytes) +
                " bytes: more than any machine has (the limit is 2^60). " + kOutOfMemoryAdvice);
  const size_t size = round_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= size;
  } else {
    p = system_alloc(size);
    if (!p) {
      // Give the cache back to the system and try once more before failing.
      release_cached_locked();
      p = system_alloc(size);
      if (!p)
        throw Error("The CPU backend is out of memory: could not allocate " + std::to_string(size) +
                    " bytes with " + std::to_string(stats_.bytes_in_use) + " bytes in use. " +
                    kOutOfMemoryAdvice);
    }
    ++stats_.num_system_allocs;
    asan_poison(p, size);  // as a cached block is, for the next line
  }
  stats_.bytes_in_use += size;
  if (stats_.bytes_in_use > stats_.peak_bytes_in_use) stats_.peak_bytes_in_use = stats_.bytes_in_use;
  // Under ASan (asan.h) the bytes asked for, not the whole size class: an access past a
  // tensor's end reports even where the class has room for it.
  asan_unpoison(p, bytes);
  return p;
}

void CachingAllocator::release(void* p, size_t bytes) {
  const size_t size = round_size(bytes);
  // Poisoned whole (asan.h) before it is on a free list, where another thread may take it.
  // Blocks are 64-byte aligned and their sizes multiples of 64, so two never share one of
  // ASan's 8-byte granules and no lock is needed.
  asan_poison(p, size);
  std::lock_guard<std::mutex> lock(mu_);
  free_[size].push_back(p);
  stats_.bytes_in_use -= size;
  stats_.bytes_cached += size;
}

void CachingAllocator::release_cached_locked() {
  for (auto& [s, blocks] : free_)
    for (void* q : blocks) system_free(q, s);
  free_.clear();
  stats_.bytes_cached = 0;
}

void CachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes_in_use = stats_.bytes_in_use;
}

}  // namespace mt::cpu
