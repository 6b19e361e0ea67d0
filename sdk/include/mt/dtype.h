// Element types and bf16 / f16 conversion helpers.
#pragma once

#include <bit>
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
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

inline uint16_t f32_to_bf16(float f) {
  auto u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 (f16): 1 sign, 5 exponent, 10 mantissa bits. Exact into f32 (subnormals too);
// from f32 rounded to nearest even, beyond 65504 (rounding to 65520 or more) an infinity, NaN
// stays NaN.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                 mant = h & 0x3ffu;
  if (exp == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
  // zero or subnormal: mant x 2^-24, exact in f32
  return std::bit_cast<float>(std::bit_cast<uint32_t>(static_cast<float>(mant) * 0x1p-24f) | sign);
}

inline uint16_t f32_to_f16(float f) {
  const auto x = std::bit_cast<uint32_t>(f);
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // quiet NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520
  if (ax < 0x38800000u) {               // subnormal or zero: value / 2^-24 rounded to nearest even
    if (ax < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24 bits dropped to land on the 2^-24 grid
    uint32_t q = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = ax + 0xfffu + ((ax >> 13) & 1u);  // the 13 dropped bits, ties to even
  return static_cast<uint16_t>(sign | ((r - 0x38000000u) >> 13));
}

}  // namespace mt
