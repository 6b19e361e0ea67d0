// Element types and bf16 conversion helpers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace mt {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, i8, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// Parses "float32"/"f32", "bfloat16"/"bf16", "float16"/"f16", "int32", "int64", "int8", "uint8".
// Returns false for anything else.
bool parse_dtype(std::string_view s, DType& out);
inline bool is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// bf16 is the upper half of an IEEE f32. Round-to-nearest-even on conversion; NaN stays NaN.
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace mt
