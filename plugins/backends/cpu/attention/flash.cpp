// flash attention (FlashAttention-2 style) on the CPU.
//
// Forward: one task per (batch, query head, block of kBQ query rows). The task walks the key
// blocks that its rows can see (causal, window and segment ranges skip whole blocks) with an
// online softmax: running row max m, running sum l, and an output accumulator rescaled by
// exp(m_old - m_new). Only lse = m + log(l) per row is kept, so the extra memory is O(T * D)
// (per-task tiles), never T x S.
//
// Backward: one task per (batch, kv head). For each key block it accumulates dK and dV in a tile
// while looping over the q heads of the group and the query blocks that see the key block;
// scores are recomputed from q, k and the saved lse (P = exp(s - lse)), with
// dS = P * (dO.V - D_i) and D_i = rowsum(dO * O). dQ rows are owned by the task (their q heads
// belong to its kv head), so every gradient element is written by one task in a fixed order:
// race-free and bitwise deterministic. When there are fewer (batch, kv head) pairs than threads
// (MQA, few kv heads, small batches) each pair's key blocks are dealt round-robin to several
// tasks, each with its own dQ partial buffer, summed in a fixed order afterwards (deterministic
// for a fixed thread count, as backend.h asks).
//
// Tiles are multiplied by small register-blocked microkernels: AVX-512 intrinsics when the CPU
// has them, else AVX2 + FMA intrinsics (checked at run time, the build stays portable), plain
// loops otherwise. The per-tile bookkeeping (scaling, masks, online softmax, dS) is compiled
// three times with target_clones (AVX-512, x86-64-v3, generic) and the loader picks the copy the
// CPU runs. MT_FLASH_KERNELS=generic|avx2|avx512 in the environment forces a microkernel set.
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#include "attention/checks.h"
#include "cpu_backend.h"
#include "mt/attention.h"
#include "mt/error.h"

#define MT_ALWAYS_INLINE __attribute__((always_inline)) inline
#if defined(__x86_64__) && defined(__GNUC__)
#include "kernels/x86_simd.h"
#define MT_FLASH_X86 1
#define MT_AVX512 MT_TARGET("avx512f")
#define MT_AVX2 MT_TARGET("avx2,fma")
#define MT_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else  // other architectures: the generic kernels only
#define MT_FLASH_X86 0
#define MT_CLONES
#endif

namespace mt::cpu {
namespace {

using attention::Dims;

constexpr int64_t kBQ = 64;  // query rows per tile
constexpr int64_t kBK = 64;  // key rows per tile (the width of every score tile)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Query blocks with fewer rows (decode steps) score keys by direct dot products.
constexpr int64_t kDirectRows = 4;
// Keys a decode task reads at least (see decode_chunk).
constexpr int64_t kDecodeRows = 32;

// ---- microkernels -------------------------------------------------------------------------

// A cache element as f32 (bf16 widened).
template <class T>
MT_ALWAYS_INLINE float widen(T x) {
  if constexpr (std::is_same_v<T, uint16_t>)
    return bf16_to_f32(x);
  else
    return x;
}

// out [nr, kBK] = a [nr, D] (row stride lda) @ bt [D, kBK].
void abt_generic(const float* a, int64_t lda, int64_t nr, const float* bt, int64_t D, float* out) {
  for (int64_t r = 0; r < nr; ++r) {
    float acc[kBK] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float x = a[r * lda + d];
      const float* b = bt + d * kBK;
      for (int64_t c = 0; c < kBK; ++c) acc[c] += x * b[c];
    }
    std::copy(acc, acc + kBK, out + r * kBK);
  }
}

// out[r, :D] += sum_{c < nc} w[r * wr + c * wc] * x[c * ldx + :D] for r < nr. The weight strides
// (wr, wc) read a score tile as it is (wr = kBK, wc = 1) or transposed (wr = 1, wc = kBK).
void acc_generic(float* out, int64_t ldo, int64_t nr, const float* w, int64_t wr, int64_t wc,
                 const float* x, int64_t ldx, int64_t nc, int64_t D) {
  for (int64_t r = 0; r < nr; ++r) {
    float* o = out + r * ldo;
    for (int64_t c = 0; c < nc; ++c) {
      const float s = w[r * wr + c * wc];
      const float* xr = x + c * ldx;
      for (int64_t d = 0; d < D; ++d) o[d] += s * xr[d];
    }
  }
}

// exp(x) for x <= ~0 (Cody-Waite range reduction and a degree-6 polynomial, ~2 ulp), written so
// that the loops calling it vectorise; exp(x < -87) and exp(-inf) are exactly 0.
MT_ALWAYS_INLINE float exp_approx(float x) {
  const bool under = x < -87.f;
  x = under ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.44269504088896341f + 0.5f;
  int32_t n = static_cast<int32_t>(t);
  n -= static_cast<float>(n) > t ? 1 : 0;  // floor
  const float fn = static_cast<float>(n);
  const float r = (x - fn * 0.693359375f) + fn * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const float two_n = std::bit_cast<float>(static_cast<int32_t>((n + 127) << 23));
  return under ? 0.f : y * two_n;
}

// x[c] = exp(x[c] - sub) for c < n; returns the sum of the new x[c].
float exp_sub_generic(float* x, int64_t n, float sub) {
  float sum = 0.f;
  for (int64_t c = 0; c < n; ++c) {
    x[c] = exp_approx(x[c] - sub);
    sum += x[c];
  }
  return sum;
}

// x = cap * tanh(x / cap), and th = tanh(x / cap) when th is given.
void softcap_generic(float* x, int64_t n, float cap, float* th) {
  for (int64_t c = 0; c < n; ++c) {
    const float t = std::tanh(x[c] / cap);
    if (th) th[c] = t;
    x[c] = cap * t;
  }
}

// Every max kernel: the largest of x, or NaN when an element is NaN or +inf (a non-finite query
// or key: the row's softmax is NaN, exp(inf - inf), which the max, passing over NaN, and the
// clamping vector exp would hide). -inf (a masked score) is an ordinary value.
float max_generic(const float* x, int64_t n) {
  float m = kNegInf;
  bool bad = false;
  for (int64_t c = 0; c < n; ++c) {
    m = std::max(m, x[c]);
    bad |= !(x[c] < std::numeric_limits<float>::infinity());
  }
  return bad ? std::numeric_limits<float>::quiet_NaN() : m;
}

// out [nr, kBK] (first nk columns) = a [nr, D] (row stride lda) @ rows [nk, D]^T (row stride ldk):
// one dot product per score, for blocks of very few query rows (decode), where transposing the
// key tile would cost more than the products.
void abt_direct_generic(const float* a, int64_t lda, int64_t nr, const float* rows, int64_t ldk,
                        int64_t nk, int64_t D, float* out) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < nk; ++c) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += a[r * lda + d] * rows[c * ldk + d];
      out[r * kBK + c] = acc;
    }
}

// bt[d * kBK + c] = rows[c * ld + d] for rows [c0, c1) and columns [d0, d1): the part of a
// transpose that the vector kernels leave (ragged edges), and the whole of the generic one.
// Rows are read in order (a key tile's rows lie ld floats apart, often a multiple of 4 KiB,
// so reading down a column would map every row onto the same few L1 sets).
void transpose_part(const float* rows, int64_t ld, int64_t c0, int64_t c1, int64_t d0, int64_t d1,
                    float* bt) {
  for (int64_t c = c0; c < c1; ++c) {
    const float* src = rows + c * ld;
    for (int64_t d = d0; d < d1; ++d) bt[d * kBK + c] = src[d];
  }
}

// Columns n..kBK of bt [D, kBK] zero (a key block shorter than kBK).
void zero_tail(float* bt, int64_t n, int64_t D) {
  if (n < kBK)
    for (int64_t d = 0; d < D; ++d) std::fill(bt + d * kBK + n, bt + (d + 1) * kBK, 0.f);
}

// bt [D, kBK] = rows [n, D] (row stride ld) transposed, columns n..kBK zero.
void transpose_generic(const float* rows, int64_t ld, int64_t n, int64_t D, float* bt) {
  transpose_part(rows, ld, 0, n, 0, D, bt);
  zero_tail(bt, n, D);
}

// Decode (one query a sequence, see decode_chunk): s[h * lds + c] = qs[h] . k[c, h /
// group] for the nk cache rows c at k + c * ld (kc f32 or kh bf16), every head h < Hq.
template <class T>
void decode_scores_t(const float* qs, int64_t Hq, int64_t group, int64_t D, const T* k, int64_t ld,
                     int64_t nk, float* s, int64_t lds) {
  for (int64_t c = 0; c < nk; ++c)
    for (int64_t h = 0; h < Hq; ++h) {
      const T* kr = k + c * ld + h / group * D;
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += qs[h * D + d] * widen(kr[d]);
      s[h * lds + c] = acc;
    }
}
// Decode: part[h * ldp + d] += sum_c s[h * lds + c] * v[c, h / group, d], rows c < nk
// (vc f32 or vh bf16, rows ld elements apart), read in order.
template <class T>
void decode_acc_t(float* part, int64_t ldp, int64_t Hq, int64_t group, int64_t D, const float* s,
                  int64_t lds, const T* v, int64_t ld, int64_t nk) {
  for (int64_t c = 0; c < nk; ++c)
    for (int64_t h = 0; h < Hq; ++h) {
      const T* vr = v + c * ld + h / group * D;
      const float e = s[h * lds + c];
      float* o = part + h * ldp;
      for (int64_t d = 0; d < D; ++d) o[d] += e * widen(vr[d]);
    }
}
// One decode kernel a Kernels entry: the instantiation for the cache's dtype (kc/vc f32 or
// kh/vh bf16, one of them null) of a kernel set's templates.
template <class T>
using DecodeScoresFn = void (*)(const float*, int64_t, int64_t, int64_t, const T*, int64_t, int64_t,
                                float*, int64_t);
template <DecodeScoresFn<float> F32, DecodeScoresFn<uint16_t> BF16>
void decode_scores_of(const float* qs, int64_t Hq, int64_t group, int64_t D, const float* kc,
                      const uint16_t* kh, int64_t ld, int64_t nk, float* s, int64_t lds) {
  if (kh)
    BF16(qs, Hq, group, D, kh, ld, nk, s, lds);
  else
    F32(qs, Hq, group, D, kc, ld, nk, s, lds);
}
template <class T>
using DecodeAccFn = void (*)(float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t,
                             const T*, int64_t, int64_t);
template <DecodeAccFn<float> F32, DecodeAccFn<uint16_t> BF16>
void decode_acc_of(float* part, int64_t ldp, int64_t Hq, int64_t group, int64_t D, const float* s,
                   int64_t lds, const float* vc, const uint16_t* vh, int64_t ld, int64_t nk) {
  if (vh)
    BF16(part, ldp, Hq, group, D, s, lds, vh, ld, nk);
  else
    F32(part, ldp, Hq, group, D, s, lds, vc, ld, nk);
}

#if MT_FLASH_X86
// ---- AVX-512 microkernels (same contracts as the generic ones above) ----------------------

template <int NR>
MT_AVX512 MT_ALWAYS_INLINE void abt_rows_avx512(const float* a, int64_t lda, const float* bt,
                                                int64_t D, float* out) {
  __m512 acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int k = 0; k < 4; ++k) acc[i][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* b = bt + d * kBK;
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16),
                 b2 = _mm512_loadu_ps(b + 32), b3 = _mm512_loadu_ps(b + 48);
    for (int i = 0; i < NR; ++i) {
      const __m512 x = _mm512_set1_ps(a[i * lda + d]);
      acc[i][0] = _mm512_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(x, b1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(x, b2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(x, b3, acc[i][3]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(out + i * kBK + 16 * k, acc[i][k]);
}

MT_AVX512 void abt_avx512(const float* a, int64_t lda, int64_t nr, const float* bt, int64_t D,
                          float* out) {
  static_assert(kBK == 64, "the AVX-512 kernels hold a score row in four registers");
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4) abt_rows_avx512<4>(a + r * lda, lda, bt, D, out + r * kBK);
  for (; r < nr; ++r) abt_rows_avx512<1>(a + r * lda, lda, bt, D, out + r * kBK);
}

// transpose_generic's contract, 16 x 16 blocks transposed in registers (unpack, then two rounds
// of 128-bit lane shuffles); the ragged edges go through transpose_part. The unpacks take the
// masked forms with all lanes set (GCC bug 105593, as the kernels below).
MT_AVX512 void transpose_avx512(const float* rows, int64_t ld, int64_t n, int64_t D, float* bt) {
  const int64_t n16 = n & ~int64_t{15}, d16 = D & ~int64_t{15};
  for (int64_t c0 = 0; c0 < n16; c0 += 16)
    for (int64_t d0 = 0; d0 < d16; d0 += 16) {
      __m512 r[16], t[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows + (c0 + i) * ld + d0);
      // t[2i], t[2i + 1]: rows 2i and 2i + 1 interleaved (columns 0, 1 | 2, 3 of each lane).
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_mask_unpacklo_ps(r[2 * i], 0xFFFF, r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_mask_unpackhi_ps(r[2 * i], 0xFFFF, r[2 * i], r[2 * i + 1]);
      }
      // r[4q + j]: rows 4q..4q+3 of columns j, 4 + j, 8 + j, 12 + j (one a 128-bit lane).
      for (int q = 0; q < 4; ++q) {
        const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 1]),
                      c = _mm512_castps_pd(t[4 * q + 2]), d = _mm512_castps_pd(t[4 * q + 3]);
        r[4 * q + 0] = _mm512_castpd_ps(_mm512_mask_unpacklo_pd(a, 0xFF, a, c));
        r[4 * q + 1] = _mm512_castpd_ps(_mm512_mask_unpackhi_pd(a, 0xFF, a, c));
        r[4 * q + 2] = _mm512_castpd_ps(_mm512_mask_unpacklo_pd(b, 0xFF, b, d));
        r[4 * q + 3] = _mm512_castpd_ps(_mm512_mask_unpackhi_pd(b, 0xFF, b, d));
      }
      for (int j = 0; j < 4; ++j) {
        // Lanes 0 and 2 (columns j, 8 + j), then 1 and 3 (4 + j, 12 + j), of rows 0-7 and 8-15.
        const __m512 lo02 = _mm512_mask_shuffle_f32x4(r[j], 0xFFFF, r[j], r[4 + j], 0x88),
                     lo13 = _mm512_mask_shuffle_f32x4(r[j], 0xFFFF, r[j], r[4 + j], 0xdd),
                     hi02 = _mm512_mask_shuffle_f32x4(r[8 + j], 0xFFFF, r[8 + j], r[12 + j], 0x88),
                     hi13 = _mm512_mask_shuffle_f32x4(r[8 + j], 0xFFFF, r[8 + j], r[12 + j], 0xdd);
        float* col = bt + (d0 + j) * kBK + c0;
        _mm512_storeu_ps(col, _mm512_mask_shuffle_f32x4(lo02, 0xFFFF, lo02, hi02, 0x88));
        _mm512_storeu_ps(col + 8 * kBK, _mm512_mask_shuffle_f32x4(lo02, 0xFFFF, lo02, hi02, 0xdd));
        _mm512_storeu_ps(col + 4 * kBK, _mm512_mask_shuffle_f32x4(lo13, 0xFFFF, lo13, hi13, 0x88));
        _mm512_storeu_ps(col + 12 * kBK, _mm512_mask_shuffle_f32x4(lo13, 0xFFFF, lo13, hi13, 0xdd));
      }
    }
  transpose_part(rows, ld, 0, n16, d16, D, bt);
  transpose_part(rows, ld, n16, n, 0, D, bt);
  zero_tail(bt, n, D);
}

// The exp and max kernels below use the masked forms of max, min, roundscale, cvtps and slli with
// an all-ones mask: GCC 12's unmasked forms start from _mm512_undefined_*() and trip
// -Wuninitialized (GCC bug 105593).
constexpr __mmask16 kAll = 0xFFFF;

MT_AVX512 MT_ALWAYS_INLINE __mmask16 tail_mask(int64_t remaining) {
  if (remaining >= 16) return 0xFFFF;
  if (remaining <= 0) return 0;
  return static_cast<__mmask16>((1u << remaining) - 1u);
}

// Columns [d0, d0 + 64) of NR rows of out (four registers per row). kFull: all 64 columns exist,
// so the loads need no masks (masked loads in the inner loop cost mask-register spills).
template <bool kFull>
MT_AVX512 MT_ALWAYS_INLINE __m512 load_chunk(const float* p, __mmask16 m) {
  return kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

template <int NR, bool kFull>
MT_AVX512 MT_ALWAYS_INLINE void acc_chunk_avx512(float* out, int64_t ldo, const float* w,
                                                 int64_t wr, int64_t wc, const float* x,
                                                 int64_t ldx, int64_t nc, int64_t d0, int64_t D) {
  __mmask16 m[4];
  for (int k = 0; k < 4; ++k) m[k] = kFull ? kAll : tail_mask(D - d0 - 16 * k);
  __m512 acc[NR][4];
  for (int i = 0; i < NR; ++i)
    for (int k = 0; k < 4; ++k) acc[i][k] = load_chunk<kFull>(out + i * ldo + d0 + 16 * k, m[k]);
  for (int64_t c = 0; c < nc; ++c) {
    const float* xr = x + c * ldx + d0;
    const __m512 x0 = load_chunk<kFull>(xr, m[0]), x1 = load_chunk<kFull>(xr + 16, m[1]),
                 x2 = load_chunk<kFull>(xr + 32, m[2]), x3 = load_chunk<kFull>(xr + 48, m[3]);
    for (int i = 0; i < NR; ++i) {
      const __m512 s = _mm512_set1_ps(w[i * wr + c * wc]);
      acc[i][0] = _mm512_fmadd_ps(s, x0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(s, x1, acc[i][1]);
      acc[i][2] = _mm512_fmadd_ps(s, x2, acc[i][2]);
      acc[i][3] = _mm512_fmadd_ps(s, x3, acc[i][3]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int k = 0; k < 4; ++k) {
      float* o = out + i * ldo + d0 + 16 * k;
      if (kFull)
        _mm512_storeu_ps(o, acc[i][k]);
      else
        _mm512_mask_storeu_ps(o, m[k], acc[i][k]);
    }
}

template <int NR>
MT_AVX512 MT_ALWAYS_INLINE void acc_rows_avx512(float* out, int64_t ldo, const float* w, int64_t wr,
                                                int64_t wc, const float* x, int64_t ldx, int64_t nc,
                                                int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) acc_chunk_avx512<NR, true>(out, ldo, w, wr, wc, x, ldx, nc, d0, D);
  if (d0 < D) acc_chunk_avx512<NR, false>(out, ldo, w, wr, wc, x, ldx, nc, d0, D);
}

MT_AVX512 void acc_avx512(float* out, int64_t ldo, int64_t nr, const float* w, int64_t wr,
                          int64_t wc, const float* x, int64_t ldx, int64_t nc, int64_t D) {
  int64_t r = 0;
  for (; r + 4 <= nr; r += 4)
    acc_rows_avx512<4>(out + r * ldo, ldo, w + r * wr, wr, wc, x, ldx, nc, D);
  for (; r < nr; ++r) acc_rows_avx512<1>(out + r * ldo, ldo, w + r * wr, wr, wc, x, ldx, nc, D);
}

// The same polynomial as exp_approx, sixteen lanes at a time (the branches of the scalar form
// keep the compiler from vectorising it).
// exp(v) for v in [-87, 88] (callers clamp), the polynomial of exp_approx.
MT_AVX512 MT_ALWAYS_INLINE __m512 exp_avx512(__m512 v) {
  const __m512 t = _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 fn =
      _mm512_mask_roundscale_ps(t, kAll, t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fmadd_ps(fn, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(_mm512_mul_ps(y, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  // y * 2^fn: exact, as the scalar form's product with 2^n (the result is normal for v >= -87).
  return _mm512_mask_scalef_ps(y, kAll, y, fn);
}

MT_AVX512 float exp_sub_avx512(float* x, int64_t n, float sub) {
  const __m512 vsub = _mm512_set1_ps(sub), lo = _mm512_set1_ps(-87.f), hi = _mm512_set1_ps(88.f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    __m512 v = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + c), vsub);
    const __mmask16 under = _mm512_cmp_ps_mask(v, lo, _CMP_LT_OQ);
    v = _mm512_mask_min_ps(v, kAll, _mm512_mask_max_ps(v, kAll, v, lo), hi);
    const __m512 res = _mm512_maskz_mov_ps(static_cast<__mmask16>(m & ~under), exp_avx512(v));
    _mm512_mask_storeu_ps(x + c, m, res);
    sum = _mm512_add_ps(sum, res);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  float total = 0.f;
  for (float l : lanes) total += l;
  return total;
}

// x = cap * tanh(x / cap), and th = tanh(x / cap) when th is given. tanh as in Cephes' tanhf:
// an odd polynomial below |y| = 0.625, 1 - 2 / (exp(2|y|) + 1) above (no cancellation there);
// |y| is clamped at 9, where tanh is 1 in f32.
MT_AVX512 void softcap_avx512(float* x, int64_t n, float cap, float* th) {
  const __m512 inv = _mm512_set1_ps(1.f / cap), vcap = _mm512_set1_ps(cap);
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = tail_mask(n - c);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + c), inv);
    const __m512 ay = _mm512_abs_ps(y);
    const __m512 z = _mm512_mul_ps(y, y);
    __m512 p = _mm512_set1_ps(-5.70498872745e-3f);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(2.06390887954e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-5.37397155531e-2f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(1.33314422036e-1f));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(-3.33332819422e-1f));
    const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(y, z), p, y);
    const __m512 e = exp_avx512(
        _mm512_mul_ps(_mm512_mask_min_ps(ay, kAll, ay, _mm512_set1_ps(9.f)), _mm512_set1_ps(2.f)));
    const __m512 big_abs =
        _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, one)));
    const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 big = _mm512_mask_sub_ps(big_abs, neg, _mm512_setzero_ps(), big_abs);
    const __mmask16 use_small = _mm512_cmp_ps_mask(ay, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
    const __m512 t = _mm512_mask_blend_ps(use_small, big, small);
    if (th) _mm512_mask_storeu_ps(th + c, m, t);
    _mm512_mask_storeu_ps(x + c, m, _mm512_mul_ps(vcap, t));
  }
}

MT_AVX512 float max_avx512(const float* x, int64_t n) {
  __m512 m = _mm512_set1_ps(kNegInf);
  const __m512 inf = _mm512_set1_ps(std::numeric_limits<float>::infinity());
  __mmask16 bad = 0;  // lanes that held NaN or +inf (not below +inf, unordered)
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kNegInf), tail_mask(n - c), x + c);
    bad |= _mm512_cmp_ps_mask(v, inf, _CMP_NLT_UQ);
    m = _mm512_mask_max_ps(m, kAll, m, v);
  }
  if (bad) return std::numeric_limits<float>::quiet_NaN();
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, m);
  return *std::max_element(lanes, lanes + 16);
}

MT_AVX512 MT_ALWAYS_INLINE float hsum_avx512(__m512 v) {
  // Halves through the masked extract (GCC 12's cast and plain extract warn, see kAll).
  const __m512d vd = _mm512_castps_pd(v);
  const __m256 lo = _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, vd, 0));
  const __m256 hi = _mm256_castpd_ps(_mm512_mask_extractf64x4_pd(_mm256_setzero_pd(), 0xF, vd, 1));
  const __m256 s = _mm256_add_ps(lo, hi);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

MT_AVX512 void abt_direct_avx512(const float* a, int64_t lda, int64_t nr, const float* rows,
                                 int64_t ldk, int64_t nk, int64_t D, float* out) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < nk; ++c) {
      const float* q = a + r * lda;
      const float* k = rows + c * ldk;
      __m512 acc = _mm512_setzero_ps();
      int64_t d = 0;
      for (; d + 16 <= D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(k + d), acc);
      if (d < D) {
        const __mmask16 m = tail_mask(D - d);
        acc =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, k + d), acc);
      }
      out[r * kBK + c] = hsum_avx512(acc);
    }
}

// 16 elements (n of them, the rest 0 when n < 16) of an f32 or bf16 row, as f32.
template <class T>
MT_AVX512 MT_ALWAYS_INLINE __m512 load16_avx512(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(tail_mask(n), p);
  } else {
    __m256i h;
    if (n >= 16) {
      h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    } else {
      alignas(32) uint16_t b[16] = {};
      // Clamped although n < 16 here: inlined into acc_rows, GCC 12 loses that bound and warns
      // of a copy past b.
      std::copy_n(p, std::clamp<int64_t>(n, 0, 15), b);
      h = _mm256_load_si256(reinterpret_cast<const __m256i*>(b));
    }
    return _mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(kAll, _mm512_maskz_cvtepu16_epi32(kAll, h), 16));
  }
}

// r[i] = hsum_avx512(a[i]) for 16 vectors at once, the same additions in the same pairs (256-bit
// halves, then 128-bit quarters, then pairs of lanes, then lanes), so the same bits: a score
// no longer pays a whole horizontal sum of its own.
MT_AVX512 MT_ALWAYS_INLINE __m512 hsum16_avx512(const __m512* a) {
  __m512 h[8], q[4], p[2];
  for (int i = 0; i < 8; ++i)  // [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3]
    h[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_maskz_shuffle_f32x4(kAll, a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit lane L: the 4-lane partial of a[4 i + L]
    q[i] = _mm512_add_ps(_mm512_maskz_shuffle_f32x4(kAll, h[2 * i], h[2 * i + 1], 0x88),
                         _mm512_maskz_shuffle_f32x4(kAll, h[2 * i], h[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // lane L: 2 lanes of a[8 i + L], then 2 of a[8 i + 4 + L]
    const __m512d x = _mm512_castps_pd(q[2 * i]), y = _mm512_castps_pd(q[2 * i + 1]);
    p[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_maskz_unpacklo_pd(0xFF, x, y)),
                         _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(0xFF, x, y)));
  }
  // Element 4 L + m is a[L + 4 m]'s sum: back to element i = a[i]'s.
  const __m512 r = _mm512_add_ps(_mm512_maskz_shuffle_ps(kAll, p[0], p[1], 0x88),
                                 _mm512_maskz_shuffle_ps(kAll, p[0], p[1], 0xDD));
  return _mm512_maskz_permutexvar_ps(
      kAll, _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

// Rows [c0 + Rows, c0 + 2 Rows) of the chunk (those before nk), bytes [from, to) of each: the
// next block's share of what this block is about to read (the decode kernels of both sets).
template <int Rows, class T>
MT_ALWAYS_INLINE void prefetch_next_block(const T* rows, int64_t ld, int64_t c0, int64_t nk,
                                          int64_t from, int64_t to) {
  const auto* base = reinterpret_cast<const char*>(rows);
  const int64_t bytes = ld * static_cast<int64_t>(sizeof(T));
  for (int64_t c = c0 + Rows; c < std::min(nk, c0 + 2 * Rows); ++c) {
    for (int64_t off = from; off < to; off += 64) _mm_prefetch(base + c * bytes + off, _MM_HINT_T0);
    _mm_prefetch(base + c * bytes + to - 1, _MM_HINT_T0);
  }
}

// Scores of q heads [h0, h1) against n <= 16 rows (ldk apart) into s[h * lds + i]: per score the
// d-ordered fma chain and hsum_avx512's additions (16 at once by hsum16_avx512).
template <class T>
MT_AVX512 MT_ALWAYS_INLINE void scores16(const float* qs, int64_t h0, int64_t h1, int64_t D,
                                         const T* kr, int64_t ldk, int64_t n, float* s,
                                         int64_t lds) {
  for (int64_t h = h0; h < h1; ++h) {
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 qv = load16_avx512(qs + h * D + d, D - d);
      for (int64_t i = 0; i < n; ++i)
        acc[i] = _mm512_fmadd_ps(qv, load16_avx512(kr + i * ldk + d, D - d), acc[i]);
    }
    _mm512_mask_storeu_ps(s + h * lds, tail_mask(n), hsum16_avx512(acc));
  }
}

// Scores of the S q heads [h0, h0 + S) of one kv head (GQA) against n <= 8 rows: each row's
// 16 values loaded (and widened from bf16) once for the S heads, where scores16 loads them once a
// head. Per score the same d-ordered fma chain and the same hsum16_avx512 additions as scores16
// (rows past n read the last row again; their scores are not stored), so the same bits.
template <int S, class T>
MT_AVX512 MT_ALWAYS_INLINE void scores8_group(const float* qs, int64_t h0, int64_t D, const T* kr,
                                              int64_t ldk, int64_t n, float* s, int64_t lds) {
  const T* rows[8];
  for (int i = 0; i < 8; ++i) rows[i] = kr + std::min<int64_t>(i, n - 1) * ldk;
  __m512 acc[S][8];
  for (int x = 0; x < S; ++x)
    for (int i = 0; i < 8; ++i) acc[x][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qv[S];
    for (int x = 0; x < S; ++x) qv[x] = load16_avx512(qs + (h0 + x) * D + d, D - d);
    for (int i = 0; i < 8; ++i) {
      const __m512 kv = load16_avx512(rows[i] + d, D - d);
      for (int x = 0; x < S; ++x) acc[x][i] = _mm512_fmadd_ps(qv[x], kv, acc[x][i]);
    }
  }
  for (int x = 0; x < S; ++x) {
    __m512 all[16];  // hsum16_avx512's 16 inputs: each lane's result depends on its vector only
    for (int i = 0; i < 16; ++i) all[i] = i < 8 ? acc[x][i] : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(s + (h0 + x) * lds, tail_mask(n), hsum16_avx512(all));
  }
}

// How many of a kv head's `left` q heads the GQA kernels take at once, at most `most` (the
// registers' limit): 4 left of most 3 go as 2 + 2, not 3 + 1.
inline int64_t heads_at_once(int64_t left, int64_t most) {
  return left == most + 1 && most > 2 ? 2 : std::min(left, most);
}

// Keys in blocks of 16 (rows 16 x Hkv x D: in L1), each block's next prefetched as it is read.
// A score is the d-ordered fma chain of hsum_avx512 (16 at once by hsum16_avx512): the bits of
// one dot product at a time. With GQA (group > 1) a kv head's q heads take its rows together,
// up to 3 at a time in halves of 8 rows (scores8_group: 8 x 3 accumulators).
template <class T>
MT_AVX512 void decode_scores_t_avx512(const float* qs, int64_t Hq, int64_t group, int64_t D,
                                      const T* k, int64_t ld, int64_t nk, float* s, int64_t lds) {
  const int64_t Hkv = Hq / group, sz = static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < nk; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, nk - c0);
    for (int64_t g = 0; g < Hkv; ++g) {
      prefetch_next_block<16>(k, ld, c0, nk, g * D * sz, (g + 1) * D * sz);
      const T* kr = k + c0 * ld + g * D;
      if (group == 1) {
        scores16(qs, g, g + 1, D, kr, ld, n, s + c0, lds);
        continue;
      }
      for (int64_t h = g * group, end = h + group; h < end;) {
        const int64_t heads = heads_at_once(end - h, 3);
        for (int64_t i0 = 0; i0 < n; i0 += 8) {
          const int64_t m = std::min<int64_t>(8, n - i0);
          if (heads == 3)
            scores8_group<3>(qs, h, D, kr + i0 * ld, ld, m, s + c0 + i0, lds);
          else if (heads == 2)
            scores8_group<2>(qs, h, D, kr + i0 * ld, ld, m, s + c0 + i0, lds);
          else
            scores8_group<1>(qs, h, D, kr + i0 * ld, ld, m, s + c0 + i0, lds);
        }
        h += heads;
      }
    }
  }
}

// Outputs [d0, d0 + 16 NV) of the H heads o[x] += their weights e[x] times n <= 16 rows (ldv
// apart) of their kv heads vr[x], or with Shared of one kv head vr[0] (GQA: its q heads), each
// row's vectors then loaded (and widened from bf16) once for the H heads. The outputs are held
// in registers through the rows (NV a constant, so nothing spills); each is the fma chain over
// the rows in order, the same bits however many heads and vectors are taken at once.
template <int H, int NV, bool Shared, class T>
MT_AVX512 MT_ALWAYS_INLINE void acc_rows(float* const* o, const float* const* e, int64_t D,
                                         int64_t d0, const T* const* vr, int64_t ldv, int64_t n) {
  __mmask16 m[NV];
  __m512 acc[H][NV];
  for (int u = 0; u < NV; ++u) {
    m[u] = D - d0 - 16 * u >= 16 ? kAll : tail_mask(D - d0 - 16 * u);
    for (int x = 0; x < H; ++x) acc[x][u] = _mm512_maskz_loadu_ps(m[u], o[x] + d0 + 16 * u);
  }
  for (int64_t i = 0; i < n; ++i) {
    __m512 row[NV];
    if constexpr (Shared)
      for (int u = 0; u < NV; ++u)
        row[u] = load16_avx512(vr[0] + i * ldv + d0 + 16 * u, D - d0 - 16 * u);
    for (int x = 0; x < H; ++x) {
      const __m512 w = _mm512_set1_ps(e[x][i]);
      for (int u = 0; u < NV; ++u) {
        const __m512 r =
            Shared ? row[u] : load16_avx512(vr[x] + i * ldv + d0 + 16 * u, D - d0 - 16 * u);
        acc[x][u] = _mm512_fmadd_ps(w, r, acc[x][u]);
      }
    }
  }
  for (int u = 0; u < NV; ++u)
    for (int x = 0; x < H; ++x) _mm512_mask_storeu_ps(o[x] + d0 + 16 * u, m[u], acc[x][u]);
}

// acc_rows over a head's D outputs, 64 at a time (4 vectors, fewer in the last part). Two heads
// give 8 fma chains where one head of 64 gave 4, each waiting on the fma before it. The counts
// go through switches, not gemm_amx.h's with_count: its lambdas, however marked, stayed calls
// inside these target-specific kernels (BM_Decode 10-25% slower in three pairs).
template <int H, bool Shared, class T>
MT_AVX512 MT_ALWAYS_INLINE void acc16(float* const* o, const float* const* e, int64_t D,
                                      const T* const* vr, int64_t ldv, int64_t n) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(4, (D - d0 + 15) / 16)) {
      case 4:
        acc_rows<H, 4, Shared>(o, e, D, d0, vr, ldv, n);
        break;
      case 3:
        acc_rows<H, 3, Shared>(o, e, D, d0, vr, ldv, n);
        break;
      case 2:
        acc_rows<H, 2, Shared>(o, e, D, d0, vr, ldv, n);
        break;
      default:
        acc_rows<H, 1, Shared>(o, e, D, d0, vr, ldv, n);
        break;
    }
  }
}

// Keys in blocks of 16, up to 64 of a head's D outputs held in registers through a block
// (loaded and stored once a block, not once a key), each kv head's share of the next block
// prefetched before it is read. With GQA (group > 1) a kv head's q heads take its rows together,
// up to 4 at a time (acc16's Shared); else the heads go in pairs, each with its own kv head.
template <class T>
MT_AVX512 void decode_acc_t_avx512(float* part, int64_t ldp, int64_t Hq, int64_t group, int64_t D,
                                   const float* s, int64_t lds, const T* v, int64_t ld,
                                   int64_t nk) {
  const int64_t sz = static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < nk; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, nk - c0);
    if (group > 1) {
      for (int64_t g = 0; g < Hq / group; ++g) {
        prefetch_next_block<16>(v, ld, c0, nk, g * D * sz, (g + 1) * D * sz);
        const T* vr = v + c0 * ld + g * D;
        for (int64_t h = g * group, end = h + group; h < end;) {
          const int64_t heads = heads_at_once(end - h, 4);
          float* o[4];
          const float* e[4];
          for (int64_t x = 0; x < heads; ++x) {
            o[x] = part + (h + x) * ldp;
            e[x] = s + (h + x) * lds + c0;
          }
          if (heads == 4)
            acc16<4, true>(o, e, D, &vr, ld, n);
          else if (heads == 3)
            acc16<3, true>(o, e, D, &vr, ld, n);
          else if (heads == 2)
            acc16<2, true>(o, e, D, &vr, ld, n);
          else
            acc16<1, true>(o, e, D, &vr, ld, n);
          h += heads;
        }
      }
      continue;
    }
    for (int64_t h = 0; h < Hq; h += 2) {
      const int64_t heads = std::min<int64_t>(2, Hq - h);
      float* o[2];
      const float* e[2];
      const T* vr[2];
      for (int64_t x = 0; x < heads; ++x) {  // one kv head a q head (group 1)
        const int64_t g = h + x;
        prefetch_next_block<16>(v, ld, c0, nk, g * D * sz, (g + 1) * D * sz);
        o[x] = part + g * ldp;
        e[x] = s + g * lds + c0;
        vr[x] = v + c0 * ld + g * D;
      }
      if (heads == 2)
        acc16<2, false>(o, e, D, vr, ld, n);
      else
        acc16<1, false>(o, e, D, vr, ld, n);
    }
  }
}
// ---- AVX2 + FMA microkernels (same contracts; for CPUs without AVX-512) -------------------
// Sixteen 8-lane registers: the tiles are cut so that accumulators, operands and broadcasts fit
// (abt: 6 rows x 16 score columns per pass, then 4 and 1; acc: 6 rows x 16 features per pass,
// then 4 and 1). Twelve accumulators, not eight, keep both FMA pipes of a Zen 3 busy past the
// FMA's 4-cycle latency: a 6-row pass of either is the same chain per output as a 4-row one.

// Lanes [0, remaining) of an 8-lane mask for maskload / maskstore (all lanes from 8 on).
MT_AVX2 MT_ALWAYS_INLINE __m256i tail_mask8(int64_t remaining) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t n = static_cast<int32_t>(std::clamp<int64_t>(remaining, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
}

// Score columns [c0, c0 + 16) of NR rows.
template <int NR>
MT_AVX2 MT_ALWAYS_INLINE void abt_strip_avx2(const float* a, int64_t lda, const float* bt,
                                             int64_t D, float* out, int64_t c0) {
  __m256 acc[NR][2];
  for (int i = 0; i < NR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const float* b = bt + d * kBK + c0;
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
    for (int i = 0; i < NR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + i * lda + d);
      acc[i][0] = _mm256_fmadd_ps(x, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(x, b1, acc[i][1]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    _mm256_storeu_ps(out + i * kBK + c0, acc[i][0]);
    _mm256_storeu_ps(out + i * kBK + c0 + 8, acc[i][1]);
  }
}

template <int NR>
MT_AVX2 MT_ALWAYS_INLINE void abt_rows_avx2(const float* a, int64_t lda, const float* bt, int64_t D,
                                            float* out) {
  for (int64_t c0 = 0; c0 < kBK; c0 += 16) abt_strip_avx2<NR>(a, lda, bt, D, out, c0);
}

// transpose_generic's contract, 8 x 8 blocks transposed in registers.
MT_AVX2 void transpose_avx2(const float* rows, int64_t ld, int64_t n, int64_t D, float* bt) {
  const int64_t n8 = n & ~int64_t{7}, d8 = D & ~int64_t{7};
  for (int64_t c0 = 0; c0 < n8; c0 += 8)
    for (int64_t d0 = 0; d0 < d8; d0 += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows + (c0 + i) * ld + d0);
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      // r[4h + j]: rows 4h..4h+3 of columns j (low lane) and 4 + j (high lane).
      for (int h = 0; h < 2; ++h) {
        r[4 * h + 0] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      for (int j = 0; j < 4; ++j) {
        float* col = bt + (d0 + j) * kBK + c0;
        _mm256_storeu_ps(col, _mm256_permute2f128_ps(r[j], r[4 + j], 0x20));
        _mm256_storeu_ps(col + 4 * kBK, _mm256_permute2f128_ps(r[j], r[4 + j], 0x31));
      }
    }
  transpose_part(rows, ld, 0, n8, d8, D, bt);
  transpose_part(rows, ld, n8, n, 0, D, bt);
  zero_tail(bt, n, D);
}

MT_AVX2 void abt_avx2(const float* a, int64_t lda, int64_t nr, const float* bt, int64_t D,
                      float* out) {
  static_assert(kBK % 16 == 0, "the AVX2 kernels take score rows in strips of 16 columns");
  int64_t r = 0;
  for (; r + 6 <= nr; r += 6) abt_rows_avx2<6>(a + r * lda, lda, bt, D, out + r * kBK);
  for (; r + 4 <= nr; r += 4) abt_rows_avx2<4>(a + r * lda, lda, bt, D, out + r * kBK);
  for (; r < nr; ++r) abt_rows_avx2<1>(a + r * lda, lda, bt, D, out + r * kBK);
}

// Features [d0, d0 + 16) of NR rows of out; kFull: all 16 exist (no masks in the inner loop).
template <bool kFull>
MT_AVX2 MT_ALWAYS_INLINE __m256 load8(const float* p, __m256i m) {
  return kFull ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
}

template <int NR, bool kFull>
MT_AVX2 MT_ALWAYS_INLINE void acc_chunk_avx2(float* out, int64_t ldo, const float* w, int64_t wr,
                                             int64_t wc, const float* x, int64_t ldx, int64_t nc,
                                             int64_t d0, int64_t D) {
  const __m256i m0 = tail_mask8(D - d0), m1 = tail_mask8(D - d0 - 8);
  __m256 acc[NR][2];
  for (int i = 0; i < NR; ++i) {
    acc[i][0] = load8<kFull>(out + i * ldo + d0, m0);
    acc[i][1] = load8<kFull>(out + i * ldo + d0 + 8, m1);
  }
  for (int64_t c = 0; c < nc; ++c) {
    const float* xr = x + c * ldx + d0;
    const __m256 x0 = load8<kFull>(xr, m0), x1 = load8<kFull>(xr + 8, m1);
    for (int i = 0; i < NR; ++i) {
      const __m256 s = _mm256_broadcast_ss(w + i * wr + c * wc);
      acc[i][0] = _mm256_fmadd_ps(s, x0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(s, x1, acc[i][1]);
    }
  }
  for (int i = 0; i < NR; ++i) {
    float* o = out + i * ldo + d0;
    if (kFull) {
      _mm256_storeu_ps(o, acc[i][0]);
      _mm256_storeu_ps(o + 8, acc[i][1]);
    } else {
      _mm256_maskstore_ps(o, m0, acc[i][0]);
      _mm256_maskstore_ps(o + 8, m1, acc[i][1]);
    }
  }
}

template <int NR>
MT_AVX2 MT_ALWAYS_INLINE void acc_rows_avx2(float* out, int64_t ldo, const float* w, int64_t wr,
                                            int64_t wc, const float* x, int64_t ldx, int64_t nc,
                                            int64_t D) {
  int64_t d0 = 0;
  for (; d0 + 16 <= D; d0 += 16) acc_chunk_avx2<NR, true>(out, ldo, w, wr, wc, x, ldx, nc, d0, D);
  if (d0 < D) acc_chunk_avx2<NR, false>(out, ldo, w, wr, wc, x, ldx, nc, d0, D);
}

MT_AVX2 void acc_avx2(float* out, int64_t ldo, int64_t nr, const float* w, int64_t wr, int64_t wc,
                      const float* x, int64_t ldx, int64_t nc, int64_t D) {
  int64_t r = 0;
  for (; r + 6 <= nr; r += 6)
    acc_rows_avx2<6>(out + r * ldo, ldo, w + r * wr, wr, wc, x, ldx, nc, D);
  for (; r + 4 <= nr; r += 4)
    acc_rows_avx2<4>(out + r * ldo, ldo, w + r * wr, wr, wc, x, ldx, nc, D);
  for (; r < nr; ++r) acc_rows_avx2<1>(out + r * ldo, ldo, w + r * wr, wr, wc, x, ldx, nc, D);
}

// exp(v) for v in [-87, 88] (callers clamp), the polynomial of exp_approx, eight lanes.
MT_AVX2 MT_ALWAYS_INLINE __m256 exp_avx2(__m256 v) {
  const __m256 t = _mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  const __m256 fn = _mm256_floor_ps(t);
  __m256 r = _mm256_fnmadd_ps(fn, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fmadd_ps(fn, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fn), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

MT_AVX2 MT_ALWAYS_INLINE float hsum_avx2(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// exp of v's lanes that `keep` passes (v clamped to [-87, 88] first), else 0.
MT_AVX2 MT_ALWAYS_INLINE __m256 exp_kept_avx2(__m256 v, __m256 keep) {
  const __m256 lo = _mm256_set1_ps(-87.f), hi = _mm256_set1_ps(88.f);
  // Lanes below -87 (exp(-inf) included) give exactly 0.
  keep = _mm256_and_ps(_mm256_cmp_ps(v, lo, _CMP_GE_OQ), keep);
  return _mm256_and_ps(exp_avx2(_mm256_min_ps(_mm256_max_ps(v, lo), hi)), keep);
}

// Whole vectors by plain loads and stores (vmaskmovps stores are slow on AMD's cores); the
// tail of n by masks.
MT_AVX2 float exp_sub_avx2(float* x, int64_t n, float sub) {
  const __m256 vsub = _mm256_set1_ps(sub), all = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
  __m256 sum = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 res = exp_kept_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + c), vsub), all);
    _mm256_storeu_ps(x + c, res);
    sum = _mm256_add_ps(sum, res);
  }
  if (c < n) {
    const __m256i m = tail_mask8(n - c);
    const __m256 res =
        exp_kept_avx2(_mm256_sub_ps(_mm256_maskload_ps(x + c, m), vsub), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(x + c, m, res);
    sum = _mm256_add_ps(sum, res);
  }
  return hsum_avx2(sum);
}

MT_AVX2 float max_avx2(const float* x, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
  __m256 m = ninf, bad = _mm256_setzero_ps();  // bad: lanes that held NaN or +inf
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    const __m256 v = _mm256_loadu_ps(x + c);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));
    m = _mm256_max_ps(m, v);
  }
  if (c < n) {
    const __m256i k = tail_mask8(n - c);
    const __m256 v = _mm256_blendv_ps(ninf, _mm256_maskload_ps(x + c, k), _mm256_castsi256_ps(k));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));
    m = _mm256_max_ps(m, v);
  }
  if (!_mm256_testz_ps(bad, bad)) return std::numeric_limits<float>::quiet_NaN();
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  return *std::max_element(lanes, lanes + 8);
}

MT_AVX2 void abt_direct_avx2(const float* a, int64_t lda, int64_t nr, const float* rows,
                             int64_t ldk, int64_t nk, int64_t D, float* out) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < nk; ++c) {
      const float* q = a + r * lda;
      const float* k = rows + c * ldk;
      __m256 acc = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 8 <= D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), acc);
      if (d < D) {
        const __m256i m = tail_mask8(D - d);
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + d, m), _mm256_maskload_ps(k + d, m), acc);
      }
      out[r * kBK + c] = hsum_avx2(acc);
    }
}

// 8 elements (n of them, the rest 0 when n < 8) of an f32 or bf16 row, as f32.
template <class T>
MT_AVX2 MT_ALWAYS_INLINE __m256 load8_avx2(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask8(n));
  } else {
    __m128i h;
    if (n >= 8) {
      h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    } else {
      alignas(16) uint16_t b[8] = {};
      std::copy_n(p, n, b);
      h = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// hsum_avx2(a[i]) for 8 vectors at once, the same additions in the same pairs (128-bit halves,
// then pairs of lanes, then lanes): the same bits.
MT_AVX2 MT_ALWAYS_INLINE __m256 hsum8_avx2(const __m256* a) {
  __m256 h[4], q[2];
  for (int i = 0; i < 4; ++i)  // [a.lo + a.hi, b.lo + b.hi]
    h[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i) {  // lane L: 2 lanes of a[4 i + L], then 2 of a[4 i + 2 + L]
    const __m256d x = _mm256_castps_pd(h[2 * i]), y = _mm256_castps_pd(h[2 * i + 1]);
    q[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)),
                         _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  // Element 4 L + m is a[L + 2 m]'s sum: back to element i = a[i]'s.
  const __m256 r =
      _mm256_add_ps(_mm256_shuffle_ps(q[0], q[1], 0x88), _mm256_shuffle_ps(q[0], q[1], 0xDD));
  return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Scores of q heads [h0, h1) against n <= 8 rows (ldk apart): per score the d-ordered fma chain
// and hsum_avx2's additions (8 at once by hsum8_avx2).
template <class T>
MT_AVX2 MT_ALWAYS_INLINE void scores8_avx2(const float* qs, int64_t h0, int64_t h1, int64_t D,
                                           const T* kr, int64_t ldk, int64_t n, float* s,
                                           int64_t lds) {
  for (int64_t h = h0; h < h1; ++h) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = load8_avx2(qs + h * D + d, D - d);
      for (int64_t i = 0; i < n; ++i)
        acc[i] = _mm256_fmadd_ps(qv, load8_avx2(kr + i * ldk + d, D - d), acc[i]);
    }
    const __m256 sums = hsum8_avx2(acc);
    if (n == 8)
      _mm256_storeu_ps(s + h * lds, sums);
    else
      _mm256_maskstore_ps(s + h * lds, tail_mask8(n), sums);
  }
}

// The AVX-512 decode kernels' structure in blocks of 8 keys (sixteen registers).
template <class T>
MT_AVX2 void decode_scores_t_avx2(const float* qs, int64_t Hq, int64_t group, int64_t D, const T* k,
                                  int64_t ld, int64_t nk, float* s, int64_t lds) {
  const int64_t Hkv = Hq / group, sz = static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < nk; c0 += 8) {
    const int64_t n = std::min<int64_t>(8, nk - c0);
    for (int64_t g = 0; g < Hkv; ++g) {
      prefetch_next_block<8>(k, ld, c0, nk, g * D * sz, (g + 1) * D * sz);
      scores8_avx2(qs, g * group, (g + 1) * group, D, k + c0 * ld + g * D, ld, n, s + c0, lds);
    }
  }
}

// Outputs [d0, d0 + 8 NV) of a head += its weights e times n <= 8 rows (ldv apart): held in
// registers through the rows (NV a constant: with a run-time count GCC kept them on the stack),
// each the fma chain over the rows in order.
template <int NV, class T>
MT_AVX2 MT_ALWAYS_INLINE void acc8_rows_avx2(float* o, const float* e, int64_t D, int64_t d0,
                                             const T* vr, int64_t ldv, int64_t n) {
  __m256 acc[NV];
  for (int u = 0; u < NV; ++u) acc[u] = load8_avx2(o + d0 + 8 * u, D - d0 - 8 * u);
  for (int64_t i = 0; i < n; ++i) {
    const __m256 w = _mm256_set1_ps(e[i]);
    for (int u = 0; u < NV; ++u)
      acc[u] = _mm256_fmadd_ps(w, load8_avx2(vr + i * ldv + d0 + 8 * u, D - d0 - 8 * u), acc[u]);
  }
  for (int u = 0; u < NV; ++u) {
    if (D - d0 - 8 * u >= 8)
      _mm256_storeu_ps(o + d0 + 8 * u, acc[u]);
    else
      _mm256_maskstore_ps(o + d0 + 8 * u, tail_mask8(D - d0 - 8 * u), acc[u]);
  }
}

// Head h's outputs += e[i] times n <= 8 rows, up to 64 outputs in registers through the rows.
template <class T>
MT_AVX2 MT_ALWAYS_INLINE void acc8_avx2(float* o, const float* e, int64_t D, const T* vr,
                                        int64_t ldv, int64_t n) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    switch (std::min<int64_t>(8, (D - d0 + 7) / 8)) {
      case 8:
        acc8_rows_avx2<8>(o, e, D, d0, vr, ldv, n);
        break;
      case 7:
        acc8_rows_avx2<7>(o, e, D, d0, vr, ldv, n);
        break;
      case 6:
        acc8_rows_avx2<6>(o, e, D, d0, vr, ldv, n);
        break;
      case 5:
        acc8_rows_avx2<5>(o, e, D, d0, vr, ldv, n);
        break;
      case 4:
        acc8_rows_avx2<4>(o, e, D, d0, vr, ldv, n);
        break;
      case 3:
        acc8_rows_avx2<3>(o, e, D, d0, vr, ldv, n);
        break;
      case 2:
        acc8_rows_avx2<2>(o, e, D, d0, vr, ldv, n);
        break;
      default:
        acc8_rows_avx2<1>(o, e, D, d0, vr, ldv, n);
        break;
    }
  }
}

template <class T>
MT_AVX2 void decode_acc_t_avx2(float* part, int64_t ldp, int64_t Hq, int64_t group, int64_t D,
                               const float* s, int64_t lds, const T* v, int64_t ld, int64_t nk) {
  const int64_t Hkv = Hq / group, sz = static_cast<int64_t>(sizeof(T));
  for (int64_t c0 = 0; c0 < nk; c0 += 8) {
    const int64_t n = std::min<int64_t>(8, nk - c0);
    for (int64_t g = 0; g < Hkv; ++g) {
      prefetch_next_block<8>(v, ld, c0, nk, g * D * sz, (g + 1) * D * sz);
      for (int64_t h = g * group; h < (g + 1) * group; ++h)
        acc8_avx2(part + h * ldp, s + h * lds + c0, D, v + c0 * ld + g * D, ld, n);
    }
  }
}
#endif  // MT_FLASH_X86

struct Kernels {
  void (*abt)(const float*, int64_t, int64_t, const float*, int64_t, float*);
  void (*abt_direct)(const float*, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                     float*);
  void (*acc)(float*, int64_t, int64_t, const float*, int64_t, int64_t, const float*, int64_t,
              int64_t, int64_t);
  float (*exp_sub)(float*, int64_t, float);
  float (*max)(const float*, int64_t);
  void (*softcap)(float*, int64_t, float, float*);
  void (*transpose)(const float*, int64_t, int64_t, int64_t, float*);
  void (*decode_scores)(const float*, int64_t, int64_t, int64_t, const float*, const uint16_t*,
                        int64_t, int64_t, float*, int64_t);
  void (*decode_acc)(float*, int64_t, int64_t, int64_t, int64_t, const float*, int64_t,
                     const float*, const uint16_t*, int64_t, int64_t);
};

// The best set this CPU runs: AVX-512, else AVX2 + FMA, else the portable loops.
// MT_FLASH_KERNELS=generic|avx2|avx512 forces one (the tests run every set the CPU has); a set
// the CPU lacks, or another value, is refused.
const Kernels& kernels() {
  static const Kernels generic{abt_generic,
                               abt_direct_generic,
                               acc_generic,
                               exp_sub_generic,
                               max_generic,
                               softcap_generic,
                               transpose_generic,
                               decode_scores_of<decode_scores_t<float>, decode_scores_t<uint16_t>>,
                               decode_acc_of<decode_acc_t<float>, decode_acc_t<uint16_t>>};
#if MT_FLASH_X86
  static const Kernels avx512{
      abt_avx512,
      abt_direct_avx512,
      acc_avx512,
      exp_sub_avx512,
      max_avx512,
      softcap_avx512,
      transpose_avx512,
      decode_scores_of<decode_scores_t_avx512<float>, decode_scores_t_avx512<uint16_t>>,
      decode_acc_of<decode_acc_t_avx512<float>, decode_acc_t_avx512<uint16_t>>};
  // softcap keeps the portable loop (std::tanh); only Gemma-style models use it.
  static const Kernels avx2{
      abt_avx2,
      abt_direct_avx2,
      acc_avx2,
      exp_sub_avx2,
      max_avx2,
      softcap_generic,
      transpose_avx2,
      decode_scores_of<decode_scores_t_avx2<float>, decode_scores_t_avx2<uint16_t>>,
      decode_acc_of<decode_acc_t_avx2<float>, decode_acc_t_avx2<uint16_t>>};
  static const bool has_avx512 = mt_cpu_supports("avx512f");
  static const bool has_avx2 = mt_cpu_supports("avx2") && mt_cpu_supports("fma");
#else
  static const bool has_avx512 = false, has_avx2 = false;
#endif
  static const Kernels* chosen = []() -> const Kernels* {
    const char* e = std::getenv("MT_FLASH_KERNELS");
    const std::string want = e ? e : "";
    if (want == "generic") return &generic;
#if MT_FLASH_X86
    if (want.empty()) return has_avx512 ? &avx512 : has_avx2 ? &avx2 : &generic;
    if (want == "avx512" && has_avx512) return &avx512;
    if (want == "avx2" && has_avx2) return &avx2;
#else
    if (want.empty()) return &generic;
#endif
    return nullptr;
  }();
  if (!chosen)
    fail("MT_FLASH_KERNELS=" + std::string(std::getenv("MT_FLASH_KERNELS")) +
         ": want generic, avx2 or avx512, one this CPU supports (AVX-512: " +
         (has_avx512 ? "yes" : "no") + ", AVX2+FMA: " + (has_avx2 ? "yes" : "no") + ")");
  return *chosen;
}

// ---- f32 views of f32 or bf16 tensors -----------------------------------------------------

// The tensor's data as f32: itself when f32, else a converted copy from the backend's
// allocator (O(size of the tensor), freed when the view dies). Runs inside the arena.
struct F32 {
  float* p = nullptr;
  Tensor copy;
};

F32 as_f32(CpuBackend& be, const Tensor& t) {
  if (t.dtype() == DType::f32) return {t.ptr<float>(), Tensor()};
  F32 v{nullptr, be.empty(t.shape(), DType::f32)};
  v.p = v.copy.ptr<float>();
  const uint16_t* src = t.ptr<uint16_t>();
  float* dst = v.p;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, t.numel(), 1 << 14),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i < r.end(); ++i) dst[i] = bf16_to_f32(src[i]);
                    });
  return v;
}

// Writes an f32 view back into its bf16 tensor (no-op for f32 tensors, already written).
void write_back(const F32& v, Tensor& t) {
  if (!v.copy.defined()) return;
  uint16_t* dst = t.ptr<uint16_t>();
  const float* src = v.p;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, t.numel(), 1 << 14),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t i = r.begin(); i < r.end(); ++i) dst[i] = f32_to_bf16(src[i]);
                    });
}

// ---- forward ------------------------------------------------------------------------------

// One (batch, head) as seen by the forward: pointers at row 0 of the head, row strides.
struct HeadFwd {
  const float* q;
  int64_t ldq;
  const float* k;
  const float* v;
  int64_t ldkv;
  int64_t S;  // keys [0, S) exist
  float* out;
  int64_t ldo;
  float* lse;  // [T] or null
  int64_t offset;
  const int32_t* q_seg;   // [T] or null
  const int32_t* kv_seg;  // [S]
  // A bf16 KV cache read in place (decode), k and v then null: each key block's rows are
  // widened into the task's tiles as it comes, so a step reads the cache's valid rows once, as
  // bf16, and writes no f32 copy of it.
  const uint16_t* k16 = nullptr;
  const uint16_t* v16 = nullptr;
};

struct Params {
  int64_t D;
  float scale;
  float cap;
  bool causal;
  int64_t window;
};

// Keys [lo, hi) that any of the query rows [i0, i1) may see (causal and window bounds only).
void key_range(const Params& p, int64_t offset, int64_t S, int64_t i0, int64_t i1, int64_t& lo,
               int64_t& hi) {
  lo = 0;
  hi = S;
  if (p.causal) hi = std::min(S, i1 - 1 + offset + 1);
  if (p.window > 0) lo = std::max<int64_t>(0, i0 + offset - p.window + 1);
}

void min_max(const int32_t* s, int64_t n, int32_t& lo, int32_t& hi) {
  lo = std::numeric_limits<int32_t>::max();
  hi = std::numeric_limits<int32_t>::min();
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, s[i]);
    hi = std::max(hi, s[i]);
  }
}

// Tiles of one forward task, carved from the calling thread's scratch slot.
struct FwdScratch {
  float *qs, *kt, *s, *acc, *m, *l, *kw, *vw;
  // kw and vw [kBK, D]: a key block of a bf16 cache widened (HeadFwd::k16 and v16).
  static int64_t floats(int64_t D) {
    return 2 * kBQ * D + D * kBK + kBQ * kBK + 2 * kBQ + 2 * kBK * D;
  }
  FwdScratch(float* p, int64_t D)
      : qs(p),
        kt(qs + kBQ * D),
        s(kt + D * kBK),
        acc(s + kBQ * kBK),
        m(acc + kBQ * D),
        l(m + kBQ),
        kw(l + kBQ),
        vw(kw + kBK * D) {}
};

// dst [n, D] (contiguous) = the bf16 rows src + c * ld, c < n, widened. Rows up to `rows` (>= n:
// the valid rows from src on, the next blocks' too) are prefetched 32 ahead, as a decode of
// several tokens a sequence reads the cache from memory (a head's rows lie Hkv * D apart; the
// weights streamed since the layer's last step have evicted them). One token a sequence takes
// decode_chunk's sequential chunks instead; on that path (Zen 5, llama-bench-m bf16 batch 1)
// 8 -> 32 rows ahead had taken a call from 36 to 29 us.
MT_CLONES void widen_rows(const uint16_t* src, int64_t ld, int64_t n, int64_t rows, int64_t D,
                          float* dst) {
  constexpr int64_t kAhead = 32;
  for (int64_t c = 0; c < n; ++c) {
    if (c + kAhead < rows)
      for (int64_t b = 0; b < D * 2; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(src + (c + kAhead) * ld) + b);
    for (int64_t d = 0; d < D; ++d) dst[c * D + d] = bf16_to_f32(src[c * ld + d]);
  }
}

// Rows r < nr of a block (row r: q at h.q + (i0 + r) * ldq, query i0 + r): out and lse.
MT_CLONES void forward_block(const Kernels& kn, const Params& p, const HeadFwd& h, int64_t i0,
                             int64_t nr, FwdScratch& w) {
  const int64_t D = p.D;
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t d = 0; d < D; ++d) w.qs[r * D + d] = p.scale * h.q[(i0 + r) * h.ldq + d];
  std::fill(w.acc, w.acc + nr * D, 0.f);
  std::fill(w.m, w.m + kBQ, kNegInf);
  std::fill(w.l, w.l + kBQ, 0.f);
  int32_t qs_lo = 0, qs_hi = 0;
  if (h.q_seg) min_max(h.q_seg + i0, nr, qs_lo, qs_hi);

  int64_t lo, hi;
  const int64_t i_last = i0 + nr - 1;
  key_range(p, h.offset, h.S, i0, i_last + 1, lo, hi);
  const int64_t p_first = i0 + h.offset, p_last = i_last + h.offset;
  for (int64_t j0 = lo; j0 < hi; j0 += kBK) {
    const int64_t nk = std::min(kBK, hi - j0);
    bool full = (!p.causal || j0 + nk - 1 <= p_first) && (p.window == 0 || p_last - j0 < p.window);
    if (h.q_seg) {
      int32_t ks_lo, ks_hi;
      min_max(h.kv_seg + j0, nk, ks_lo, ks_hi);
      if (ks_hi < qs_lo || ks_lo > qs_hi) continue;  // no shared document
      full = full && qs_lo == qs_hi && ks_lo == ks_hi && qs_lo == ks_lo;
    }
    const float* kb = h.k16 ? w.kw : h.k + j0 * h.ldkv;
    const int64_t ldk = h.k16 ? D : h.ldkv;
    if (h.k16) widen_rows(h.k16 + j0 * h.ldkv, h.ldkv, nk, hi - j0, D, w.kw);
    if (nr < kDirectRows) {
      kn.abt_direct(w.qs, D, nr, kb, ldk, nk, D, w.s);
    } else {
      kn.transpose(kb, ldk, nk, D, w.kt);
      kn.abt(w.qs, D, nr, w.kt, D, w.s);
    }
    for (int64_t r = 0; r < nr; ++r) {
      float* row = w.s + r * kBK;
      const int64_t i = i0 + r, pos = i + h.offset;
      if (p.cap > 0.f) kn.softcap(row, nk, p.cap, nullptr);
      if (!full && p.window == 0 && !h.q_seg) {
        // Causal only: the keys after the query's position, a tail of the row.
        std::fill(row + std::clamp<int64_t>(pos - j0 + 1, 0, nk), row + nk, kNegInf);
      } else if (!full) {
        for (int64_t c = 0; c < nk; ++c) {
          const int64_t j = j0 + c;
          if ((p.causal && j > pos) || (p.window > 0 && pos - j >= p.window) ||
              (h.q_seg && h.q_seg[i] != h.kv_seg[j]))
            row[c] = kNegInf;
        }
      }
      // A NaN or +inf score (a non-finite query or key) makes the row's softmax NaN (exp(inf -
      // inf)), which the vector exp would hide: kn.max says so with NaN, and the row is marked
      // and gives NaN (before: a finite output, and a finite loss).
      const float m_block = kn.max(row, nk);
      if (std::isnan(m_block)) {
        w.l[r] = std::numeric_limits<float>::quiet_NaN();
        std::fill(row, row + nk, 0.f);
        continue;
      }
      const float m_new = std::max(w.m[r], m_block);
      if (m_new == kNegInf) {  // nothing visible yet: contributes nothing
        std::fill(row, row + nk, 0.f);
        continue;
      }
      const float sum = kn.exp_sub(row, nk, m_new);
      if (m_new != w.m[r]) {
        const float alpha = w.m[r] == kNegInf ? 0.f : std::exp(w.m[r] - m_new);
        float* a = w.acc + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        w.l[r] *= alpha;
        w.m[r] = m_new;
      }
      w.l[r] += sum;
    }
    if (h.v16) {
      widen_rows(h.v16 + j0 * h.ldkv, h.ldkv, nk, hi - j0, D, w.vw);
      kn.acc(w.acc, D, nr, w.s, kBK, 1, w.vw, D, nk, D);
    } else {
      kn.acc(w.acc, D, nr, w.s, kBK, 1, h.v + j0 * h.ldkv, h.ldkv, nk, D);
    }
  }
  for (int64_t r = 0; r < nr; ++r) {
    float* o = h.out + (i0 + r) * h.ldo;
    const float* a = w.acc + r * D;
    if (w.l[r] > 0.f) {
      const float inv = 1.f / w.l[r];
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
      if (h.lse) h.lse[i0 + r] = w.m[r] + std::log(w.l[r]);
    } else if (std::isnan(w.l[r])) {
      // A NaN or infinite score (exp(inf - inf)): NaN out, not the zeros of a row that saw no
      // key (before: an infinite query gave a finite loss where a softmax gives NaN).
      std::fill(o, o + D, std::numeric_limits<float>::quiet_NaN());
      if (h.lse) h.lse[i0 + r] = std::numeric_limits<float>::quiet_NaN();
    } else {
      std::fill(o, o + D, 0.f);
      if (h.lse) h.lse[i0 + r] = kNegInf;
    }
  }
}

// ---- decode: one new token, keys split into chunks ---------------------------------------

// A decode step (T = 1) reads each sequence's cache in chunks of keys, one task a chunk for every
// head at once, and merges the chunks' partial softmaxes afterwards (the split-KV decode of
// FlashDecoding). A chunk's rows are contiguous in the cache ([rows, Hkv, D]), so a task reads
// one sequential stream, where one task a head (the forward's split) read rows Hkv x D apart,
// which the hardware prefetchers follow poorly, and had only B x Hq tasks (llama-bench-m bf16
// batch 1, Zen 5: 53-55 -> 25-27 us an attention_decode call in the model). A chunk is kDecodeRows
// keys, or a multiple of it that keeps a sequence to kDecodeChunks chunks (bounding the partial
// results beside a long cache); its bounds depend on the cache's capacity and the positions
// alone, never on the batch or the thread count, so a sequence's output is the same bits at
// any batch size and on any number of threads.
constexpr int64_t kDecodeChunks = 64;
int64_t decode_rows(int64_t capacity) {
  const int64_t span = kDecodeRows * kDecodeChunks;
  return kDecodeRows * std::max<int64_t>(1, (capacity + span - 1) / span);
}

// One sequence's keys [j0, j1) (all visible to its query), every head: each q head's partial
// softmax over them, part[h] = {max, sum of exp, acc[D] (unnormalised)}. qs [Hq, D]: the
// query's heads, scaled; kc/vc (f32) or kh/vh (bf16) point at the sequence's row 0; s
// [Hq, lds] scratch, lds >= j1 - j0. The keys are read row by row, each row's Hkv heads in
// order (one sequential stream), then the values likewise. A bf16 cache gives the bits of an
// f32 cache holding the same values (each kernel widens, then does the f32 arithmetic).
void decode_chunk(const Kernels& kn, const Params& p, int64_t Hq, int64_t Hkv, const float* qs,
                  const float* kc, const float* vc, const uint16_t* kh, const uint16_t* vh,
                  int64_t j0, int64_t j1, float* part, float* s, int64_t lds) {
  const int64_t D = p.D, group = Hq / Hkv, ldp = D + 2, nk = j1 - j0, ld = Hkv * D;
  for (int64_t h = 0; h < Hq; ++h) {
    part[h * ldp] = kNegInf;
    part[h * ldp + 1] = 0.f;
    std::fill(part + h * ldp + 2, part + (h + 1) * ldp, 0.f);
  }
  if (nk <= 0) return;
  kn.decode_scores(qs, Hq, group, D, kc ? kc + j0 * ld : nullptr, kh ? kh + j0 * ld : nullptr, ld,
                   nk, s, lds);
  for (int64_t h = 0; h < Hq; ++h) {
    float* x = s + h * lds;
    if (p.cap > 0.f) kn.softcap(x, nk, p.cap, nullptr);
    const float m = kn.max(x, nk);
    if (std::isnan(m)) {  // a NaN or +inf score: NaN out (merge_chunks)
      part[h * ldp + 1] = std::numeric_limits<float>::quiet_NaN();
      std::fill(x, x + nk, 0.f);
      continue;
    }
    part[h * ldp] = m;
    part[h * ldp + 1] = kn.exp_sub(x, nk, m);
  }
  kn.decode_acc(part + 2, ldp, Hq, group, D, s, lds, vc ? vc + j0 * ld : nullptr,
                vh ? vh + j0 * ld : nullptr, ld, nk);
}

// out [D] = the softmax-weighted sum of a head's chunks (parts ldc floats apart, in key order),
// each chunk's sums rescaled to the largest max; zeros if no key was visible. One chunk gives
// the bits of one pass over its keys.
void merge_chunks(const float* part, int64_t ldc, int64_t chunks, int64_t D, float* out) {
  // A chunk whose sum is NaN saw a NaN or infinite score: the softmax is NaN (the max passes
  // over NaN, so such a chunk could read as one without a visible key, and give zeros).
  for (int64_t c = 0; c < chunks; ++c)
    if (std::isnan(part[c * ldc + 1])) {
      std::fill(out, out + D, std::numeric_limits<float>::quiet_NaN());
      return;
    }
  float m = kNegInf;
  for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part[c * ldc]);
  if (m == kNegInf) {
    std::fill(out, out + D, 0.f);
    return;
  }
  float l = 0.f;
  std::fill(out, out + D, 0.f);
  for (int64_t c = 0; c < chunks; ++c) {
    const float* pc = part + c * ldc;
    if (pc[0] == kNegInf) continue;
    const float a = pc[0] == m ? 1.f : std::exp(pc[0] - m);
    l += a * pc[1];
    for (int64_t d = 0; d < D; ++d) out[d] += a * pc[2 + d];
  }
  const float inv = 1.f / l;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// ---- backward -----------------------------------------------------------------------------

// Tiles of one backward task, carved from the calling thread's scratch slot.
struct BwdScratch {
  float *kt, *vt, *qs, *s, *tanh_s, *dp, *dk, *dv;
  static int64_t floats(int64_t D) { return 4 * kBK * D + kBQ * D + 3 * kBQ * kBK; }
  BwdScratch(float* p, int64_t D)
      : kt(p),
        vt(kt + D * kBK),
        qs(vt + D * kBK),
        s(qs + kBQ * D),
        tanh_s(s + kBQ * kBK),
        dp(tanh_s + kBQ * kBK),
        dk(dp + kBQ * kBK),
        dv(dk + kBK * D) {}
};

class FlashAttention final : public AttentionKernel {
 public:
  explicit FlashAttention(CpuBackend& b) : backend_(b) {}
  std::string name() const override { return "flash"; }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_segment,
               const Tensor& kv_segment, const AttentionSpec& spec, Tensor& out,
               Tensor& lse) override {
    const std::string op = "flash attention forward";
    const Dims n = attention::check_forward(op, q, k, v, q_segment, kv_segment, spec, out, lse);
    if (q.numel() == 0) return;
    const Params p = params(spec, n.D);
    Tensor scratch = slots(FwdScratch::floats(n.D));
    backend_.run([&] {
      const F32 qf = as_f32(backend_, q), kf = as_f32(backend_, k), vf = as_f32(backend_, v);
      F32 of = out.dtype() == DType::f32 ? F32{out.ptr<float>(), Tensor()}
                                         : F32{nullptr, backend_.empty(out.shape(), DType::f32)};
      if (!of.p) of.p = of.copy.ptr<float>();
      const int64_t nblk = (n.T + kBQ - 1) / kBQ;
      const Kernels& kn = kernels();
      tbb::parallel_for(int64_t{0}, n.B * n.Hq * nblk, [&](int64_t task) {
        const int64_t bh = task / nblk, blk = task % nblk;
        const int64_t b = bh / n.Hq, h = bh % n.Hq, g = h / (n.Hq / n.Hkv);
        HeadFwd hf{qf.p + (b * n.T * n.Hq + h) * n.D,
                   n.Hq * n.D,
                   kf.p + (b * n.S * n.Hkv + g) * n.D,
                   vf.p + (b * n.S * n.Hkv + g) * n.D,
                   n.Hkv * n.D,
                   n.S,
                   of.p + (b * n.T * n.Hq + h) * n.D,
                   n.Hq * n.D,
                   lse.ptr<float>() + bh * n.T,
                   spec.query_offset,
                   q_segment.defined() ? q_segment.ptr<int32_t>() + b * n.T : nullptr,
                   kv_segment.defined() ? kv_segment.ptr<int32_t>() + b * n.S : nullptr};
        FwdScratch w(slot(scratch), n.D);
        const int64_t i0 = blk * kBQ;
        forward_block(kn, p, hf, i0, std::min(kBQ, n.T - i0), w);
      });
      write_back(of, out);
    });
  }

  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                const Tensor& lse, const AttentionSpec& spec, Tensor& dq, Tensor& dk,
                Tensor& dv) override {
    const std::string op = "flash attention backward";
    const Dims n = attention::check_backward(op, dout, q, k, v, q_segment, kv_segment, out, lse,
                                             spec, dq, dk, dv);
    if (q.numel() == 0 || k.numel() == 0) return;
    const Params p = params(spec, n.D);
    Tensor scratch = slots(BwdScratch::floats(n.D));
    backend_.run([&] {
      const F32 qf = as_f32(backend_, q), kf = as_f32(backend_, k), vf = as_f32(backend_, v);
      const F32 dof = as_f32(backend_, dout);
      F32 dqf = as_f32(backend_, dq), dkf = as_f32(backend_, dk), dvf = as_f32(backend_, dv);
      // D_i = dO_i . O_i per (b, h, i), [B, Hq, T]: O(T) memory.
      Tensor di = backend_.empty({n.B, n.Hq, n.T}, DType::f32);
      {
        const F32 of = as_f32(backend_, out);
        float* dst = di.ptr<float>();
        tbb::parallel_for(int64_t{0}, n.B * n.T, [&](int64_t bt) {
          const int64_t b = bt / n.T, t = bt % n.T;
          for (int64_t h = 0; h < n.Hq; ++h) {
            const float* o = of.p + (bt * n.Hq + h) * n.D;
            const float* g = dof.p + (bt * n.Hq + h) * n.D;
            float s = 0.f;
            for (int64_t d = 0; d < n.D; ++d) s += o[d] * g[d];
            dst[(b * n.Hq + h) * n.T + t] = s;
          }
        });
      }
      // Fewer (batch, kv head) pairs than threads (MQA, GQA, small batches): split each pair's
      // key blocks round-robin into `chunks` tasks (round-robin balances the causal triangle).
      // dK/dV rows stay disjoint; dQ gets one partial buffer per extra chunk, summed in chunk
      // order afterwards, so the result depends on the thread count only, not on scheduling.
      const int64_t pairs = n.B * n.Hkv, key_blocks = (n.S + kBK - 1) / kBK;
      const int64_t threads = backend_.num_threads();
      const int64_t chunks =
          pairs >= threads ? 1 : std::min(key_blocks, (2 * threads + pairs - 1) / pairs);
      Tensor partial;
      if (chunks > 1) {
        partial = backend_.empty({chunks - 1, q.numel()}, DType::f32);
        std::fill(partial.ptr<float>(), partial.ptr<float>() + partial.numel(), 0.f);
      }
      const Kernels& kn = kernels();
      tbb::parallel_for(int64_t{0}, pairs * chunks, [&](int64_t task) {
        const int64_t bg = task / chunks, chunk = task % chunks;
        const int64_t b = bg / n.Hkv, g = bg % n.Hkv;
        BwdScratch w(slot(scratch), n.D);
        float* dq_chunk = chunk == 0 ? dqf.p : partial.ptr<float>() + (chunk - 1) * q.numel();
        backward_kv_head(kn, p, n, spec.query_offset, b, g, chunk, chunks, qf.p, kf.p, vf.p, dof.p,
                         lse.ptr<float>(), di.ptr<float>(),
                         q_segment.defined() ? q_segment.ptr<int32_t>() + b * n.T : nullptr,
                         kv_segment.defined() ? kv_segment.ptr<int32_t>() + b * n.S : nullptr,
                         dq_chunk, dkf.p, dvf.p, w);
      });
      if (chunks > 1) {
        const float* part = partial.ptr<float>();
        float* dst = dqf.p;
        const int64_t numel = q.numel();
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, numel, 1 << 14),
                          [&](const tbb::blocked_range<int64_t>& r) {
                            for (int64_t c = 0; c < chunks - 1; ++c)
                              for (int64_t i = r.begin(); i < r.end(); ++i)
                                dst[i] += part[c * numel + i];
                          });
      }
      write_back(dqf, dq);
      write_back(dkf, dk);
      write_back(dvf, dv);
    });
  }

  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
              const AttentionSpec& spec, Tensor& out) override {
    const std::string op = "flash attention decode";
    const Dims n = attention::check_decode(op, q, k_cache, v_cache, lengths, spec, out);
    const int32_t* len = lengths.ptr<int32_t>();
    if (q.numel() == 0) return;
    const Params p = params(spec, n.D);
    backend_.run([&] {
      // A bf16 cache is read in place, a key block at a time (HeadFwd::k16 and v16).
      const F32 qf = as_f32(backend_, q);
      const bool k16 = k_cache.dtype() == DType::bf16, v16 = v_cache.dtype() == DType::bf16;
      const float* kc = k16 ? nullptr : k_cache.ptr<float>();
      const float* vc = v16 ? nullptr : v_cache.ptr<float>();
      const uint16_t* kh = k16 ? k_cache.ptr<uint16_t>() : nullptr;
      const uint16_t* vh = v16 ? v_cache.ptr<uint16_t>() : nullptr;
      // The element offset of kv head g's row 0 in sequence b (either dtype).
      auto at = [&](int64_t b, int64_t g) { return (b * n.S * n.Hkv + g) * n.D; };
      auto cache = [&](HeadFwd& hf, int64_t b, int64_t g) {
        hf.k = kc ? kc + at(b, g) : nullptr;
        hf.v = vc ? vc + at(b, g) : nullptr;
        hf.k16 = kh ? kh + at(b, g) : nullptr;
        hf.v16 = vh ? vh + at(b, g) : nullptr;
      };
      F32 of = out.dtype() == DType::f32 ? F32{out.ptr<float>(), Tensor()}
                                         : F32{nullptr, backend_.empty(out.shape(), DType::f32)};
      if (!of.p) of.p = of.copy.ptr<float>();
      const Kernels& kn = kernels();
      const int64_t group = n.Hq / n.Hkv;
      if (n.T == 1) {
        // One new token a sequence: chunks of kDecodeRows keys, every head at once (see
        // decode_chunk), then each head's chunks merged.
        int64_t smax = 0;
        for (int64_t b = 0; b < n.B; ++b) smax = std::max<int64_t>(smax, len[b]);
        const int64_t rows = decode_rows(n.S), chunks = (smax + rows - 1) / rows, ldp = n.D + 2;
        Tensor part = backend_.empty({n.B * chunks * n.Hq, ldp}, DType::f32);
        float* pp = part.ptr<float>();
        // Per thread: the query's heads scaled [Hq, D], then the scores [Hq, rows].
        Tensor dscratch = slots(n.Hq * (n.D + rows));
        tbb::parallel_for(int64_t{0}, n.B * chunks, [&](int64_t task) {
          const int64_t b = task / chunks, c = task % chunks;
          int64_t lo, hi;
          key_range(p, len[b] - 1, len[b], 0, 1, lo, hi);
          const int64_t j0 = std::max(lo, c * rows), j1 = std::min(hi, (c + 1) * rows);
          float* qs = slot(dscratch);
          const float* q = qf.p + b * n.Hq * n.D;
          for (int64_t i = 0; i < n.Hq * n.D; ++i) qs[i] = p.scale * q[i];
          decode_chunk(kn, p, n.Hq, n.Hkv, qs, kc ? kc + at(b, 0) : nullptr,
                       vc ? vc + at(b, 0) : nullptr, kh ? kh + at(b, 0) : nullptr,
                       vh ? vh + at(b, 0) : nullptr, j0, j1, pp + task * n.Hq * ldp,
                       qs + n.Hq * n.D, rows);
        });
        const int64_t grain = std::max<int64_t>(1, 16384 / (chunks * n.D));
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, n.B * n.Hq, grain),
                          [&](const tbb::blocked_range<int64_t>& r) {
                            for (int64_t bh = r.begin(); bh < r.end(); ++bh) {
                              const int64_t b = bh / n.Hq, h = bh % n.Hq;
                              merge_chunks(pp + (b * chunks * n.Hq + h) * ldp, n.Hq * ldp, chunks,
                                           n.D, of.p + bh * n.D);
                            }
                          });
      } else {
        Tensor scratch = slots(FwdScratch::floats(n.D));
        const int64_t nblk = (n.T + kBQ - 1) / kBQ;
        tbb::parallel_for(int64_t{0}, n.B * n.Hq * nblk, [&](int64_t task) {
          const int64_t bh = task / nblk, blk = task % nblk;
          const int64_t b = bh / n.Hq, h = bh % n.Hq, g = h / group;
          HeadFwd hf{qf.p + (b * n.T * n.Hq + h) * n.D,
                     n.Hq * n.D,
                     nullptr,
                     nullptr,
                     n.Hkv * n.D,
                     len[b],
                     of.p + (b * n.T * n.Hq + h) * n.D,
                     n.Hq * n.D,
                     nullptr,
                     len[b] - n.T,
                     nullptr,
                     nullptr};
          cache(hf, b, g);
          FwdScratch w(slot(scratch), n.D);
          const int64_t i0 = blk * kBQ;
          forward_block(kn, p, hf, i0, std::min(kBQ, n.T - i0), w);
        });
      }
      write_back(of, out);
    });
  }

 private:
  // One block of `per_slot` floats per thread of the backend's arena, from its allocator (so
  // memory_stats() counts the tiles).
  Tensor slots(int64_t per_slot) {
    return backend_.empty({std::max(backend_.num_threads(), 1), per_slot}, DType::f32);
  }
  // The calling thread's block: arena thread indices are unique among running threads, and a
  // task body never waits on other tasks, so a slot is never shared.
  static float* slot(const Tensor& scratch) {
    const int idx = tbb::this_task_arena::current_thread_index();
    MT_CHECK(idx >= 0 && idx < scratch.dim(0), "flash attention: thread slot out of range");
    return scratch.ptr<float>() + idx * scratch.dim(1);
  }

  static Params params(const AttentionSpec& spec, int64_t D) {
    // The spec was checked with the other arguments (attention::check_*).
    return {D, spec.scale != 0.f ? spec.scale : 1.f / std::sqrt(static_cast<float>(D)),
            spec.softcap, spec.causal, spec.window};
  }

  // Key blocks chunk, chunk + chunks, ... of kv head g of batch row b; dq receives this chunk's
  // share of the dQ of the group's q heads.
  MT_CLONES static void backward_kv_head(const Kernels& kn, const Params& p, const Dims& n,
                                         int64_t offset, int64_t b, int64_t g, int64_t chunk,
                                         int64_t chunks, const float* q, const float* k,
                                         const float* v, const float* dout, const float* lse,
                                         const float* di, const int32_t* q_seg,
                                         const int32_t* kv_seg, float* dq, float* dk, float* dv,
                                         BwdScratch& w) {
    const int64_t D = n.D, group = n.Hq / n.Hkv;
    const int64_t ldq = n.Hq * D, ldkv = n.Hkv * D;
    const float* kh = k + (b * n.S * n.Hkv + g) * D;
    const float* vh = v + (b * n.S * n.Hkv + g) * D;
    for (int64_t j0 = chunk * kBK; j0 < n.S; j0 += chunks * kBK) {
      const int64_t nk = std::min(kBK, n.S - j0), j_last = j0 + nk - 1;
      // Queries that may see a key of [j0, j_last]: causal needs pos >= j0, the window needs
      // pos - j_last < window.
      int64_t ilo = 0, ihi = n.T;
      if (p.causal) ilo = std::max<int64_t>(0, j0 - offset);
      if (p.window > 0) ihi = std::min(n.T, j_last + p.window - offset);
      if (ilo >= ihi) continue;
      int32_t ks_lo = 0, ks_hi = 0;
      if (q_seg) min_max(kv_seg + j0, nk, ks_lo, ks_hi);
      kn.transpose(kh + j0 * ldkv, ldkv, nk, D, w.kt);
      kn.transpose(vh + j0 * ldkv, ldkv, nk, D, w.vt);
      std::fill(w.dk, w.dk + kBK * D, 0.f);
      std::fill(w.dv, w.dv + kBK * D, 0.f);
      bool any = false;
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qh = q + (b * n.T * n.Hq + h) * D;
        const float* doh = dout + (b * n.T * n.Hq + h) * D;
        float* dqh = dq + (b * n.T * n.Hq + h) * D;
        const float* lse_h = lse + (b * n.Hq + h) * n.T;
        const float* di_h = di + (b * n.Hq + h) * n.T;
        for (int64_t i0 = ilo; i0 < ihi; i0 += kBQ) {
          const int64_t nr = std::min(kBQ, ihi - i0);
          // Tiles entirely inside the mask skip the per-element test.
          bool full = (!p.causal || j_last <= i0 + offset) &&
                      (p.window == 0 || i0 + nr - 1 + offset - j0 < p.window);
          if (q_seg) {
            int32_t qs_lo, qs_hi;
            min_max(q_seg + i0, nr, qs_lo, qs_hi);
            if (ks_hi < qs_lo || ks_lo > qs_hi) continue;
            full = full && qs_lo == qs_hi && ks_lo == ks_hi && qs_lo == ks_lo;
          }
          any = true;
          for (int64_t r = 0; r < nr; ++r)
            for (int64_t d = 0; d < D; ++d) w.qs[r * D + d] = p.scale * qh[(i0 + r) * ldq + d];
          kn.abt(w.qs, D, nr, w.kt, D, w.s);               // scores
          kn.abt(doh + i0 * ldq, ldq, nr, w.vt, D, w.dp);  // dP = dO V^T
          for (int64_t r = 0; r < nr; ++r) {
            const int64_t i = i0 + r, pos = i + offset;
            float* s = w.s + r * kBK;  // scores -> P
            const float* dp = w.dp + r * kBK;
            float* th = w.tanh_s + r * kBK;
            const float l = lse_h[i];
            if (l == kNegInf) {  // row saw no key: no gradient
              std::fill(s, s + kBK, 0.f);
            } else {
              if (p.cap > 0.f) kn.softcap(s, nk, p.cap, th);
              if (!full)
                for (int64_t c = 0; c < nk; ++c) {
                  const int64_t j = j0 + c;
                  if ((p.causal && j > pos) || (p.window > 0 && pos - j >= p.window) ||
                      (q_seg && q_seg[i] != kv_seg[j]))
                    s[c] = kNegInf;
                }
              kn.exp_sub(s, nk, l);
              std::fill(s + nk, s + kBK, 0.f);
            }
            // dS = P (dP - D_i) through the cap, times the scale (d s / d q = scale k), in dp's
            // place.
            const float dii = di_h[i];
            float* ds_row = w.dp + r * kBK;
            for (int64_t c = 0; c < nk; ++c) {
              float ds = s[c] == 0.f ? 0.f : s[c] * (dp[c] - dii);
              if (p.cap > 0.f) ds *= 1.f - th[c] * th[c];
              ds_row[c] = ds * p.scale;
            }
          }
          // dV += P^T dO; dK += (scale dS)^T Q; dQ += (scale dS) K. The transposes are only
          // strides of the weight reads.
          kn.acc(w.dv, D, nk, w.s, 1, kBK, doh + i0 * ldq, ldq, nr, D);
          kn.acc(w.dk, D, nk, w.dp, 1, kBK, qh + i0 * ldq, ldq, nr, D);
          kn.acc(dqh + i0 * ldq, ldq, nr, w.dp, kBK, 1, kh + j0 * ldkv, ldkv, nk, D);
        }
      }
      if (!any) continue;
      float* dkh = dk + (b * n.S * n.Hkv + g) * D;
      float* dvh = dv + (b * n.S * n.Hkv + g) * D;
      for (int64_t c = 0; c < nk; ++c)
        for (int64_t d = 0; d < D; ++d) {
          dkh[(j0 + c) * ldkv + d] += w.dk[c * D + d];
          dvh[(j0 + c) * ldkv + d] += w.dv[c * D + d];
        }
    }
  }

  CpuBackend& backend_;
};

}  // namespace

std::unique_ptr<AttentionKernel> make_flash_attention(Backend& b) {
  auto* cpu = dynamic_cast<CpuBackend*>(&b);
  MT_CHECK(cpu != nullptr, "flash attention (cpu) needs the cpu backend, got " + b.name());
  return std::make_unique<FlashAttention>(*cpu);
}

}  // namespace mt::cpu
