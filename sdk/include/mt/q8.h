// int8 weights for inference (quantization=int8): the row layout Backend::matmul_q8 reads.
//
// A matrix of N rows of K values (K a multiple of kQ8Block) is an i8 tensor [N, q8_row_bytes(K)]:
// each row holds its K values as int8, then K / kQ8Block f16 scales (IEEE binary16,
// little-endian, 2-byte aligned when the row is), one per block of kQ8Block consecutive values:
// K + K / 16 bytes, 1.0625 a weight, as llama.cpp's q8_0. Value k of the row is
// q[k] x f16_to_f32(scale[k / 32]), an f32 product. Symmetric: a block's scale is max |w| / 127
// rounded to f16 (to nearest even), and q = round-half-away-from-zero(w / scale) clamped to
// [-127, 127] (the rounded scale may be a little below max |w| / 127); a block of zeros has
// scale 0. A row holding NaN or an infinity, or a value beyond 127 x 65504 (a scale f16 cannot
// hold), is not quantized (quantize_q8_row returns false).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "mt/dtype.h"

namespace mt {

inline constexpr int64_t kQ8Block = 32;

inline int64_t q8_row_bytes(int64_t k) {
  return k + k / kQ8Block * 2;
}

// The K of int8 rows of rb bytes (rb = q8_row_bytes(K)), or -1 when no K gives rb.
inline int64_t q8_row_values(int64_t rb) {
  constexpr int64_t kBlockBytes = kQ8Block + 2;
  return rb >= 0 && rb % kBlockBytes == 0 ? rb / kBlockBytes * kQ8Block : -1;
}

// Block b's scale of a row of K values.
inline float q8_scale(const int8_t* row, int64_t k, int64_t b) {
  uint16_t h;
  std::memcpy(&h, row + k + b * 2, 2);
  return f16_to_f32(h);
}

// One row: w[0, k) -> out[0, q8_row_bytes(k)). k must be a multiple of kQ8Block. False (out
// partly written) when the row cannot be held: a NaN or an infinity, or a value whose block
// scale is beyond f16's range.
[[nodiscard]] inline bool quantize_q8_row(const float* w, int64_t k, int8_t* out) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* x = w + b * kQ8Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) {
      if (!std::isfinite(x[i])) return false;
      amax = std::fmax(amax, std::fabs(x[i]));
    }
    const uint16_t h = f32_to_f16(amax / 127.f);
    const float scale = f16_to_f32(h);
    if (!std::isfinite(scale)) return false;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i)
      out[b * kQ8Block + i] =
          static_cast<int8_t>(std::lround(std::fmin(127.f, std::fmax(-127.f, x[i] * inv))));
    std::memcpy(out + k + b * 2, &h, 2);
  }
  return true;
}

// One row back to f32: out[k] = q[k] * scale[k / kQ8Block].
inline void dequantize_q8_row(const int8_t* row, int64_t k, float* out) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float scale = q8_scale(row, k, b);
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
