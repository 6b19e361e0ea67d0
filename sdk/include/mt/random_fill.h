// The random numbers of parameter initialisation (Backend::fill_random): every element's value
// as a pure function of (key, element index), written once here and compiled into the core's
// composition, the CPU kernel and the CUDA kernel (by nvcc, as __host__ __device__ code), so all
// of them write the same bits whatever the backend or thread count.
//
// Generator: Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as
// 1, 2, 3", SC 2011) with key (low word, high word) of the 64-bit key and counter (group low,
// group high, attempt, 0), group = element / 4. A block's words w0..w3 make two Box-Muller pairs,
// (w0, w1) for elements 4g and 4g+1 and (w2, w3) for 4g+2 and 4g+3:
//   u = ((w0 >> 8) | 1) * 2^-24          in (0, 1): odd multiples of 2^-24, exact in f32, never 0
//   theta = 2 pi w1 / 2^32 (to 2^-26 of a turn),  r = sqrt(-2 ln u)  (so |z| < 5.8),
//   z(4g) = r cos theta,  z(4g+1) = r sin theta.
// normal: value = z * stddev. truncated_normal: element i takes z from the first attempt a = 0,
// 1, ... (counter word 2) whose z(i) has |z| <= 2, and value = z * (stddev / 0.87962566), the
// standard deviation of a unit normal truncated at +-2; a rejection is 4.55% likely, so the
// element-wise retries cost about 5%, and after kMaxAttempts (never, in practice) z = 0.
//
// Exact reproducibility: ln, sin and cos are polynomials evaluated here with correctly rounded
// IEEE binary32 operations only: explicit fused multiply-adds, multiplications and additions
// where no product feeds an addition (so a compiler's FMA contraction, on or off, has nothing to
// change), one division and one square root (the device's _rn intrinsics), integer arithmetic
// and bit manipulation. Every IEEE machine computes the same bits from them, whatever the FMA
// contraction setting; -ffast-math (reassociation, reciprocals) would not.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MT_RF_HD __host__ __device__ __forceinline__
#else
#define MT_RF_HD inline
#endif

namespace mt::random_fill {

inline constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
inline constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (Weyl)
inline constexpr uint32_t kMaxAttempts = 64;  // truncated normal: 0.0455^64 ~ 1e-86 per element
inline constexpr float kTruncatedStd = 0.87962566f;  // std of N(0, 1) truncated to [-2, 2]

// ---- correctly rounded binary32 operations ---------------------------------------------------
MT_RF_HD float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
MT_RF_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
MT_RF_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
MT_RF_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
MT_RF_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- Philox4x32-10 -----------------------------------------------------------------------------
// Written out without loops, so a vectoriser sees straight-line code.
MT_RF_HD void philox_round(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
  const uint32_t hi0 = uint32_t((uint64_t{kM0} * c[0]) >> 32), lo0 = kM0 * c[0];
  const uint32_t hi1 = uint32_t((uint64_t{kM1} * c[2]) >> 32), lo1 = kM1 * c[2];
  const uint32_t x0 = hi1 ^ c[1] ^ k0;
  const uint32_t x2 = hi0 ^ c[3] ^ k1;
  c[0] = x0;
  c[1] = lo1;
  c[2] = x2;
  c[3] = lo0;
}
// c: the counter in, the four random words out. Round r uses the key bumped r times.
MT_RF_HD void philox4x32_10(uint32_t (&c)[4], uint32_t k0, uint32_t k1) {
  philox_round(c, k0, k1);
  philox_round(c, k0 + 1u * kW0, k1 + 1u * kW1);
  philox_round(c, k0 + 2u * kW0, k1 + 2u * kW1);
  philox_round(c, k0 + 3u * kW0, k1 + 3u * kW1);
  philox_round(c, k0 + 4u * kW0, k1 + 4u * kW1);
  philox_round(c, k0 + 5u * kW0, k1 + 5u * kW1);
  philox_round(c, k0 + 6u * kW0, k1 + 6u * kW1);
  philox_round(c, k0 + 7u * kW0, k1 + 7u * kW1);
  philox_round(c, k0 + 8u * kW0, k1 + 8u * kW1);
  philox_round(c, k0 + 9u * kW0, k1 + 9u * kW1);
}

// ---- the math of Box-Muller -------------------------------------------------------------------
// A word as a uniform in (0, 1): the odd multiples of 2^-24 below 1 (exact).
MT_RF_HD float uniform_open(uint32_t w) {
  return float(int32_t((w >> 8) | 1u)) * 0x1p-24f;
}

// ln(u) for u in (0, 1) a normal float: u = 2^e y with y in [sqrt(1/2), sqrt(2)), and
// ln y = 2 atanh(s), s = (y - 1) / (y + 1) in [-0.172, 0.172], by its series to s^11 (truncation
// error below 1e-9 relative; coefficients 1/3 .. 1/11 as f32 literals, so no compiler's constant
// folding is involved). A few ulp from the correctly rounded logarithm.
MT_RF_HD float log_open01(float u) {
  const uint32_t b = bits_of(u);
  const uint32_t mant = b & 0x7fffffu;
  const uint32_t big = mant > 0x3504f3u ? 1u : 0u;  // y = 1.mant > sqrt(2): halve it
  const float y = float_of(mant | (big ? 0x3f000000u : 0x3f800000u));
  const float e = float(int32_t(b >> 23) - 127 + int32_t(big));
  const float t = y - 1.f;  // exact (Sterbenz)
  const float s = div_rn(t, t + 2.f);
  const float s2 = s * s;
  float p = fma_rn(0x1.745d18p-4f, s2, 0x1.c71c72p-4f);
  p = fma_rn(p, s2, 0x1.24924ap-3f);
  p = fma_rn(p, s2, 0x1.99999ap-3f);
  p = fma_rn(p, s2, 0x1.555556p-2f);
  const float two_s = s * 2.f;
  const float ln_y = fma_rn(two_s * s2, p, two_s);
  // ln 2 split as fdlibm does: the high part has 16 significant bits, so e * hi is exact.
  return fma_rn(e, 0x1.62e400p-1f, fma_rn(e, 0x1.7f7d1cp-20f, ln_y));
}

// sin and cos of 2 pi w / 2^32: the nearest quarter turn n, then the rest a in [-pi/4, pi/4)
// (to 2^-26 of a turn) by Taylor polynomials to a^9 and a^10 (truncation below 2e-9;
// coefficients 1/k! as f32 literals).
MT_RF_HD void sincos_turns(uint32_t w, float& sin_out, float& cos_out) {
  const uint32_t n = (w + 0x20000000u) >> 30;
  const int32_t rest = int32_t(w - (n << 30));         // in [-2^29, 2^29)
  const float a = float(rest / 64) * 0x1.921fb6p-24f;  // pi / 2^25 per unit: exact integers
  const float a2 = a * a;
  float ps = fma_rn(0x1.71de3ap-19f, a2, -0x1.a01a02p-13f);
  ps = fma_rn(ps, a2, 0x1.111112p-7f);
  ps = fma_rn(ps, a2, -0x1.555556p-3f);
  const float s = fma_rn(a * a2, ps, a);
  float pc = fma_rn(-0x1.27e4fcp-22f, a2, 0x1.a01a02p-16f);
  pc = fma_rn(pc, a2, -0x1.6c16c2p-10f);
  pc = fma_rn(pc, a2, 0x1.555556p-5f);
  pc = fma_rn(pc, a2, -0.5f);
  const float c = fma_rn(a2, pc, 1.f);
  // theta = n pi/2 + a
  sin_out = n == 0 ? s : n == 1 ? c : n == 2 ? -s : -c;
  cos_out = n == 0 ? c : n == 1 ? -s : n == 2 ? -c : s;
}

// Box-Muller: the two standard normal draws of words w0 (radius) and w1 (angle).
MT_RF_HD void box_muller(uint32_t w0, uint32_t w1, float& z0, float& z1) {
  const float r = sqrt_rn(log_open01(uniform_open(w0)) * -2.f);
  float s, c;
  sincos_turns(w1, s, c);
  z0 = r * c;
  z1 = r * s;
}

// The four standard normal draws of counter block (group, attempt) under key.
MT_RF_HD void normal4(uint64_t key, uint64_t group, uint32_t attempt, float (&z)[4]) {
  uint32_t c[4] = {uint32_t(group), uint32_t(group >> 32), attempt, 0u};
  philox4x32_10(c, uint32_t(key), uint32_t(key >> 32));
  box_muller(c[0], c[1], z[0], z[1]);
  box_muller(c[2], c[3], z[2], z[3]);
}

// What multiplies the standard draw z: stddev, or for the truncated normal stddev rescaled so the
// variance is stddev^2.
MT_RF_HD float value_scale(bool truncated, float stddev) {
  return truncated ? div_rn(stddev, kTruncatedStd) : stddev;
}

// Whether a truncated normal's draw is rejected: |z| > 2, compared as bits (one integer
// comparison, no branch; a NaN, which never occurs, would be rejected too).
MT_RF_HD bool rejected(float z) {
  return (bits_of(z) & 0x7fffffffu) > 0x40000000u;  // 2.0f
}

// Element i's standard draw at one attempt: z(i) of block (i / 4, attempt), computing only its
// own Box-Muller pair.
MT_RF_HD float draw_at(uint64_t key, uint64_t i, uint32_t attempt) {
  uint32_t c[4] = {uint32_t(i >> 2), uint32_t(i >> 34), attempt, 0u};
  philox4x32_10(c, uint32_t(key), uint32_t(key >> 32));
  const bool second_pair = (i & 2u) != 0;
  float z0, z1;
  box_muller(second_pair ? c[2] : c[0], second_pair ? c[3] : c[1], z0, z1);
  return (i & 1u) != 0 ? z1 : z0;
}

// Element i's standard draw once its first attempt gave z0 (= draw_at(key, i, 0)): itself for
// the normal, else the first accepted attempt's.
MT_RF_HD float standard_draw(uint64_t key, uint64_t i, bool truncated, float z0) {
  if (!truncated || !rejected(z0)) return z0;
  for (uint32_t attempt = 1; attempt < kMaxAttempts; ++attempt) {
    const float z = draw_at(key, i, attempt);
    if (!rejected(z)) return z;
  }
  return 0.f;
}

// Element i's value (the reference: one element at a time).
MT_RF_HD float value_at(uint64_t key, uint64_t i, bool truncated, float stddev) {
  return standard_draw(key, i, truncated, draw_at(key, i, 0)) * value_scale(truncated, stddev);
}

}  // namespace mt::random_fill

#undef MT_RF_HD
