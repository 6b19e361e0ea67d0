// FNV-1a, 64-bit: the hash of a parameter's name that seeds its initialisation stream, and of a
// resolved config that ranks compare. Stable across builds and machines (it is part of what
// init_weights_seed means).
#pragma once

#include <cstdint>
#include <string_view>

namespace mt {

inline uint64_t fnv1a(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace mt
