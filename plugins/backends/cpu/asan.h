// AddressSanitizer annotations for the backend's caches of host memory (the caching allocator's
// free lists, the kernels' per-thread scratch). A cache hands the same memory out again, so ASan
// sees one long-lived allocation and misses every use after a block went back to the cache and
// every access past the bytes asked for that stays within what the cache really holds. The caches
// poison what nobody may touch and unpoison exactly what they hand out, so those accesses report
// as they would with the system allocator. Without ASan the helpers are empty.
#pragma once

#include <cstddef>

#if defined(__SANITIZE_ADDRESS__)
#define MT_CPU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MT_CPU_ASAN 1
#endif
#endif

#ifdef MT_CPU_ASAN
#include <sanitizer/asan_interface.h>
#endif

namespace mt::cpu {

// ASan's shadow records, for each 8-byte granule, how many of its first bytes are addressable:
// exact for what the caches do, unpoison from an 8-byte aligned start (a block's, a buffer's)
// and poison from anywhere up to the end of the memory.
inline void asan_poison(const void* p, size_t bytes) {
#ifdef MT_CPU_ASAN
  ASAN_POISON_MEMORY_REGION(p, bytes);
#else
  (void)p, (void)bytes;
#endif
}
inline void asan_unpoison(const void* p, size_t bytes) {
#ifdef MT_CPU_ASAN
  ASAN_UNPOISON_MEMORY_REGION(p, bytes);
#else
  (void)p, (void)bytes;
#endif
}

}  // namespace mt::cpu
