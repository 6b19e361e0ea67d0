// int8 weights for inference (quantization=int8): the row layout Backend::matmul_q8 reads.
//
// A matrix of N rows of K values (K a multiple of kQ8Block) is an i8 tensor [N, q8_row_bytes(K)]:
// each row holds its K values as int8, then K / kQ8Block f32 scales (little-endian, unaligned),
// one per block of kQ8Block consecutive values; value k of the row is q[k] * scale[k / 32].
// Symmetric, as llama.cpp's q8_0 (whose scales are f16): scale = max |w| / 127 over the block,
// q = round-half-away-from-zero(w / scale), a block of zeros has scale 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace mt {

inline constexpr int64_t kQ8Block = 32;

inline int64_t q8_row_bytes(int64_t k) {
  return k + k / kQ8Block * 4;
}

// One row: w[0, k) -> out[0, q8_row_bytes(k)). k must be a multiple of kQ8Block.
inline void quantize_q8_row(const float* w, int64_t k, int8_t* out) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* x = w + b * kQ8Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i)
      out[b * kQ8Block + i] =
          static_cast<int8_t>(std::lround(std::fmin(127.f, std::fmax(-127.f, x[i] * inv))));
    std::memcpy(out + k + b * 4, &scale, 4);
  }
}

// One row back to f32: out[k] = q[k] * scale[k / kQ8Block].
inline void dequantize_q8_row(const int8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    float scale;
    std::memcpy(&scale, row + k + b * 4, 4);
    for (int64_t i = 0; i < kQ8Block; ++i)
      out[b * kQ8Block + i] = static_cast<float>(row[b * kQ8Block + i]) * scale;
  }
}

// One group of n values of an int8 KV cache (Backend::scatter_rows_q8), the same rule as a
// block above: out[i] = round(x[i] / scale), scale = max |x| / 127 (0 for a group of zeros),
// returned. A group holding NaN gets a NaN scale (fmax passes over NaN: the NaN was stored as
// -127 x scale, a finite value); an infinite value already gives NaN back (0 x inf).
inline float quantize_q8_group(const float* x, int64_t n, int8_t* out) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    amax = std::fmax(amax, std::fabs(x[i]));
    nan = nan || std::isnan(x[i]);
  }
  const float scale = nan ? std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<int8_t>(std::lround(std::fmin(127.f, std::fmax(-127.f, x[i] * inv))));
  return scale;
}

}  // namespace mt
