// Where the CPU backend's hand-written x86 kernels get their intrinsics, and how each asks for its
// instruction set.
//
// Normally: <immintrin.h>; a kernel is compiled for its set by a target attribute (MT_TARGET) and
// chosen at run time by what the CPU supports (mt_cpu_supports, mt_cpu_is_amd).
//
// With MT_EMULATE_X86 (the test-only plugin cpu_x86emu, see plugins/backends/cpu/CMakeLists.txt):
// the same sources are compiled for baseline x86-64 against SIMDe (Debian's libsimde-dev), whose
// portable definitions stand in for every AVX2, FMA, AVX-512 (F, BW, DQ, VL), AVX512_BF16 and
// VNNI intrinsic the kernels call, and the "CPU" reports all of those sets and AMD (so the
// vdpbf16ps paths are taken) but not AMX, which SIMDe lacks. So the AVX-512 kernels run, slowly,
// on a machine without AVX-512 (the CI's), under the tests that compare each kernel set with a
// double reference, with its documented bits and with the others. Where SIMDe's portable code
// is not the instruction (FMA as a multiply and an add, vdpbf16ps's order, vrndscaleps's
// immediate, a masked load that reads every lane), the operation is written out below as the
// Intel SDM defines it. Start-up peak
// measurements return a nominal figure: emulated instructions have no rate of their own.
#pragma once

#if defined(MT_EMULATE_X86)

// GCC's own header first (other headers, TBB's, include it too): SIMDe's aliases must come after
// its declarations, never before.
#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#define MT_TARGET(features)
#define mt_cpu_supports(feature) ::mt_x86_emulation::supports(feature)
#define mt_cpu_is_amd() true
#define mt_cpu_has_amx() false  // SIMDe has no AMX
#define mt_cpu_has_amx_int8() false
#define mt_cpu_has_f16c() true

namespace mt_x86_emulation {

inline bool supports(const char* f) {
  for (const char* s :
       {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512bf16", "avx512vnni"})
    if (std::strcmp(f, s) == 0) return true;
  return false;
}

// A vector's lanes as an array (E e[N] over the vector's bytes), and back (SIMDe's vectors are
// plain 16-, 32- or 64-byte values). Templates take element types only: a vector type as a
// template argument loses its attributes (-Wignored-attributes).
template <class E, int N>
struct Lanes {
  E e[N] = {};
};
template <class E, int N>
inline Lanes<E, N> lanes(const void* v) {
  Lanes<E, N> l;
  std::memcpy(l.e, v, sizeof l.e);
  return l;
}
#define MT_X86EMU_TO(V, l)                   \
  [&] {                                      \
    V v_;                                    \
    static_assert(sizeof v_ == sizeof(l).e); \
    std::memcpy(&v_, (l).e, sizeof v_);      \
    return v_;                               \
  }()

// The intrinsics the kernels use that SIMDe 0.7.4 does not define, element by element as the
// Intel intrinsics guide describes them. Masked loads and stores touch only the selected
// elements (a kernel's tail past the end of a row must not be read).
inline __m256i maskz_loadu_epi16_256(__mmask16 k, const void* p) {
  Lanes<uint16_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&r.e[i], static_cast<const uint16_t*>(p) + i, 2);
  return MT_X86EMU_TO(__m256i, r);
}
inline __m512i maskz_loadu_epi16_512(__mmask32 k, const void* p) {
  Lanes<uint16_t, 32> r;
  for (int i = 0; i < 32; ++i)
    if (k >> i & 1) std::memcpy(&r.e[i], static_cast<const uint16_t*>(p) + i, 2);
  return MT_X86EMU_TO(__m512i, r);
}
inline void mask_storeu_epi16_256(void* p, __mmask16 k, __m256i a) {
  const auto v = lanes<uint16_t, 16>(&a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<uint16_t*>(p) + i, &v.e[i], 2);
}
inline __m512 mask_loadu_ps(__m512 src, __mmask16 k, const void* p) {
  auto r = lanes<float, 16>(&src);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(&r.e[i], static_cast<const float*>(p) + i, 4);
  return MT_X86EMU_TO(__m512, r);
}
inline __m512 maskz_loadu_ps(__mmask16 k, const void* p) {
  return mask_loadu_ps(simde_mm512_setzero_ps(), k, p);
}
inline void mask_storeu_ps(void* p, __mmask16 k, __m512 a) {
  const auto v = lanes<float, 16>(&a);
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) std::memcpy(static_cast<float*>(p) + i, &v.e[i], 4);
}
// SIMDe 0.7.4 defines this one as a whole 32-byte load, masked after: past the end of a buffer
// that reads bytes the hardware's masked load never touches (AddressSanitizer stopped flash's
// AVX2 tails on it).
inline __m256 maskload_ps_256(const float* p, __m256i m) {
  const auto k = lanes<int32_t, 8>(&m);
  Lanes<float, 8> r;
  for (int i = 0; i < 8; ++i)
    if (k.e[i] < 0) std::memcpy(&r.e[i], p + i, 4);
  return MT_X86EMU_TO(__m256, r);
}
inline __mmask16 cmpgt_epu32_mask(__m512i a, __m512i b) {
  const auto x = lanes<uint32_t, 16>(&a), y = lanes<uint32_t, 16>(&b);
  unsigned k = 0;
  for (int i = 0; i < 16; ++i) k |= unsigned(x.e[i] > y.e[i]) << i;
  return __mmask16(k);
}
inline __m256i maskz_cvtepi32_epi16(__mmask16 k, __m512i a) {
  const auto x = lanes<uint32_t, 16>(&a);
  Lanes<uint16_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = uint16_t(x.e[i]);
  return MT_X86EMU_TO(__m256i, r);
}
inline __m512i maskz_cvtepu16_epi32(__mmask16 k, __m256i a) {
  const auto x = lanes<uint16_t, 16>(&a);
  Lanes<uint32_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = x.e[i];
  return MT_X86EMU_TO(__m512i, r);
}
inline __m512 maskz_cvtepi32_ps(__mmask16 k, __m512i a) {
  const auto x = lanes<int32_t, 16>(&a);
  Lanes<float, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = float(x.e[i]);
  return MT_X86EMU_TO(__m512, r);
}
inline __m512i maskz_cvtepi8_epi32(__mmask16 k, __m128i a) {
  const auto x = lanes<int8_t, 16>(&a);
  Lanes<int32_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = x.e[i];
  return MT_X86EMU_TO(__m512i, r);
}
inline __m256 maskz_extractf32x8_ps(__mmask8 k, __m512 a, int half) {
  const auto x = lanes<float, 16>(&a);
  Lanes<float, 8> r;
  for (int i = 0; i < 8; ++i)
    if (k >> i & 1) r.e[i] = x.e[8 * (half & 1) + i];
  return MT_X86EMU_TO(__m256, r);
}
inline __m512i maskz_slli_epi32(__mmask16 k, __m512i a, unsigned n) {
  const auto x = lanes<uint32_t, 16>(&a);
  Lanes<uint32_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = n > 31 ? 0 : x.e[i] << n;
  return MT_X86EMU_TO(__m512i, r);
}
inline __m512i maskz_srli_epi32(__mmask16 k, __m512i a, unsigned n) {
  const auto x = lanes<uint32_t, 16>(&a);
  Lanes<uint32_t, 16> r;
  for (int i = 0; i < 16; ++i)
    if (k >> i & 1) r.e[i] = n > 31 ? 0 : x.e[i] >> n;
  return MT_X86EMU_TO(__m512i, r);
}
// shuffle_f32x4 / shuffle_i32x4 on 32-bit lanes: result blocks 0-1 (of four lanes) are blocks
// of a chosen by imm's 2-bit fields, blocks 2-3 blocks of b; lanes outside k keep src.
inline Lanes<uint32_t, 16> mask_shuffle_x4(const void* src, __mmask16 k, const void* a,
                                           const void* b, int imm) {
  const auto x = lanes<uint32_t, 16>(a), y = lanes<uint32_t, 16>(b);
  auto r = lanes<uint32_t, 16>(src);
  for (int i = 0; i < 16; ++i) {
    const int block = i / 4, sel = imm >> (2 * block) & 3;
    if (k >> i & 1) r.e[i] = (block < 2 ? x : y).e[4 * sel + i % 4];
  }
  return r;
}
inline __m512 mask_shuffle_f32x4(__m512 src, __mmask16 k, __m512 a, __m512 b, int imm) {
  return MT_X86EMU_TO(__m512, mask_shuffle_x4(&src, k, &a, &b, imm));
}
inline __m512i maskz_shuffle_i32x4(__mmask16 k, __m512i a, __m512i b, int imm) {
  const __m512i zero = simde_mm512_setzero_si512();
  return MT_X86EMU_TO(__m512i, mask_shuffle_x4(&zero, k, &a, &b, imm));
}
inline __m512 maskz_shuffle_f32x4(__mmask16 k, __m512 a, __m512 b, int imm) {
  const __m512 zero = simde_mm512_setzero_ps();
  return MT_X86EMU_TO(__m512, mask_shuffle_x4(&zero, k, &a, &b, imm));
}
// shuffle_ps within each block of four lanes: lanes 0-1 a's lanes chosen by imm's first two
// 2-bit fields, lanes 2-3 b's by the last two; lanes outside k zero.
inline __m512 maskz_shuffle_ps(__mmask16 k, __m512 a, __m512 b, int imm) {
  const auto x = lanes<uint32_t, 16>(&a), y = lanes<uint32_t, 16>(&b);
  Lanes<uint32_t, 16> r;
  for (int i = 0; i < 16; ++i) {
    const int lane = i % 4, sel = imm >> (2 * lane) & 3;
    if (k >> i & 1) r.e[i] = (lane < 2 ? x : y).e[i - lane + sel];
  }
  return MT_X86EMU_TO(__m512, r);
}

// SIMDe without a native FMA multiplies and adds with two roundings; the kernels' bits (the int8
// kernels' documented order among them) need the fused operation, lane by lane.
template <int N, class V>
inline void fma_lanes(const V& a, const V& b, const V& c, V& r, bool negate) {
  const auto x = lanes<float, N>(&a), y = lanes<float, N>(&b), z = lanes<float, N>(&c);
  Lanes<float, N> o;
  for (int i = 0; i < N; ++i) o.e[i] = std::fma(negate ? -x.e[i] : x.e[i], y.e[i], z.e[i]);
  std::memcpy(&r, o.e, sizeof r);
}
inline __m512 fmadd_512(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  fma_lanes<16>(a, b, c, r, false);
  return r;
}
inline __m512 fnmadd_512(__m512 a, __m512 b, __m512 c) {
  __m512 r;
  fma_lanes<16>(a, b, c, r, true);
  return r;
}
inline __m256 fmadd_256(__m256 a, __m256 b, __m256 c) {
  __m256 r;
  fma_lanes<8>(a, b, c, r, false);
  return r;
}
inline __m256 fnmadd_256(__m256 a, __m256 b, __m256 c) {
  __m256 r;
  fma_lanes<8>(a, b, c, r, true);
  return r;
}

// vrndscaleps: 2^-M round(x 2^M), M = imm[7:4], rounding imm[1:0] (imm[2]: the current mode,
// nearest here). SIMDe 0.7.4 reads M from imm[7:3], so _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC
// (0x09) kept a fraction bit there.
inline __m512 mask_roundscale_ps(__m512 src, __mmask16 k, __m512 a, int imm) {
  const auto x = lanes<float, 16>(&a);
  auto r = lanes<float, 16>(&src);
  const float scale = std::ldexp(1.f, imm >> 4 & 15);
  const int mode = imm & 4 ? 0 : imm & 3;
  for (int i = 0; i < 16; ++i) {
    if (!(k >> i & 1)) continue;
    const float v = x.e[i] * scale;
    const float q = mode == 0   ? std::nearbyint(v)
                    : mode == 1 ? std::floor(v)
                    : mode == 2 ? std::ceil(v)
                                : std::trunc(v);
    r.e[i] = std::isfinite(x.e[i]) ? q / scale : x.e[i];
  }
  __m512 o;
  std::memcpy(&o, r.e, sizeof o);
  return o;
}

// vdpbf16ps as the Intel SDM writes it: per f32 lane, the odd pair's product added first, then
// the even pair's, each a fused operation (the products of two bf16 are exact in f32), bf16
// denormals read as zero and denormal results flushed to zero.
inline float bf16_daz(uint16_t h) {
  if ((h & 0x7f80) == 0) h &= 0x8000;
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float ftz(float f) {
  return std::fpclassify(f) == FP_SUBNORMAL ? std::copysign(0.f, f) : f;
}
inline __m512 dpbf16_512(__m512 src, __m512bh a, __m512bh b) {
  auto acc = lanes<float, 16>(&src);
  const auto x = lanes<uint16_t, 32>(&a), y = lanes<uint16_t, 32>(&b);
  for (int i = 0; i < 16; ++i) {
    float t = ftz(std::fma(bf16_daz(x.e[2 * i + 1]), bf16_daz(y.e[2 * i + 1]), acc.e[i]));
    acc.e[i] = ftz(std::fma(bf16_daz(x.e[2 * i]), bf16_daz(y.e[2 * i]), t));
  }
  __m512 r;
  std::memcpy(&r, acc.e, sizeof r);
  return r;
}

}  // namespace mt_x86_emulation

// SIMDe may define some of these names as its own aliases (which ones depends on the compiler:
// clang gets more of them than GCC); the definitions below replace them.
#undef _mm512_mask_roundscale_ps
#undef _mm512_fmadd_ps
#undef _mm512_fnmadd_ps
#undef _mm256_fmadd_ps
#undef _mm256_fnmadd_ps
#undef _mm512_dpbf16_ps
#undef _mm256_maskload_ps
#undef _mm256_maskz_loadu_epi16
#undef _mm512_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#undef _mm512_mask_loadu_ps
#undef _mm512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#undef _mm512_cmpgt_epu32_mask
#undef _mm512_maskz_cvtepi32_epi16
#undef _mm512_cvtepi32_epi16
#undef _mm512_maskz_cvtepu16_epi32
#undef _mm512_cvtepu16_epi32
#undef _mm512_maskz_cvtepi32_ps
#undef _mm512_maskz_cvtepi8_epi32
#undef _mm512_maskz_extractf32x8_ps
#undef _mm512_maskz_slli_epi32
#undef _mm512_maskz_srli_epi32
#undef _mm512_mask_shuffle_f32x4
#undef _mm512_maskz_shuffle_i32x4
#undef _mm512_maskz_shuffle_f32x4
#undef _mm512_maskz_shuffle_ps
#define _mm512_mask_roundscale_ps ::mt_x86_emulation::mask_roundscale_ps
#define _mm512_fmadd_ps ::mt_x86_emulation::fmadd_512
#define _mm512_fnmadd_ps ::mt_x86_emulation::fnmadd_512
#define _mm256_fmadd_ps ::mt_x86_emulation::fmadd_256
#define _mm256_fnmadd_ps ::mt_x86_emulation::fnmadd_256
#define _mm512_dpbf16_ps ::mt_x86_emulation::dpbf16_512
#define _mm256_maskload_ps ::mt_x86_emulation::maskload_ps_256
#define _mm256_maskz_loadu_epi16 ::mt_x86_emulation::maskz_loadu_epi16_256
#define _mm512_maskz_loadu_epi16 ::mt_x86_emulation::maskz_loadu_epi16_512
#define _mm256_mask_storeu_epi16 ::mt_x86_emulation::mask_storeu_epi16_256
#define _mm512_mask_loadu_ps ::mt_x86_emulation::mask_loadu_ps
#define _mm512_maskz_loadu_ps ::mt_x86_emulation::maskz_loadu_ps
#define _mm512_mask_storeu_ps ::mt_x86_emulation::mask_storeu_ps
#define _mm512_cmpgt_epu32_mask ::mt_x86_emulation::cmpgt_epu32_mask
#define _mm512_maskz_cvtepi32_epi16 ::mt_x86_emulation::maskz_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) ::mt_x86_emulation::maskz_cvtepi32_epi16(0xffff, a)
#define _mm512_maskz_cvtepu16_epi32 ::mt_x86_emulation::maskz_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) ::mt_x86_emulation::maskz_cvtepu16_epi32(0xffff, a)
#define _mm512_maskz_cvtepi32_ps ::mt_x86_emulation::maskz_cvtepi32_ps
#define _mm512_maskz_cvtepi8_epi32 ::mt_x86_emulation::maskz_cvtepi8_epi32
#define _mm512_maskz_extractf32x8_ps ::mt_x86_emulation::maskz_extractf32x8_ps
#define _mm512_maskz_slli_epi32 ::mt_x86_emulation::maskz_slli_epi32
#define _mm512_maskz_srli_epi32 ::mt_x86_emulation::maskz_srli_epi32
#define _mm512_mask_shuffle_f32x4 ::mt_x86_emulation::mask_shuffle_f32x4
#define _mm512_maskz_shuffle_i32x4 ::mt_x86_emulation::maskz_shuffle_i32x4
#define _mm512_maskz_shuffle_f32x4 ::mt_x86_emulation::maskz_shuffle_f32x4
#define _mm512_maskz_shuffle_ps ::mt_x86_emulation::maskz_shuffle_ps
// __m512bh from the bits of a 512-bit integer vector (a reinterpret_cast where they are GCC's
// vector types, a copy of the bytes where they are SIMDe's).
#define MT_AS_BF16X32(v)              \
  [&] {                               \
    const __m512i i_ = (v);           \
    __m512bh b_;                      \
    std::memcpy(&b_, &i_, sizeof b_); \
    return b_;                        \
  }()

#else  // the hardware's own

#include <cpuid.h>
#include <immintrin.h>

#define MT_TARGET(features) __attribute__((target(features)))
#define mt_cpu_supports(feature) __builtin_cpu_supports(feature)
#define mt_cpu_is_amd() (__builtin_cpu_init(), __builtin_cpu_is("amd") != 0)
// AMX-BF16 and AMX-TILE (CPUID leaf 7, EDX bits 22 and 24), read directly: clang before 15 has
// no "amx-bf16" / "amx-tile" for __builtin_cpu_supports (mt did not build with clang 14).
inline bool mt_cpu_has_amx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ((d >> 22) & 1u) != 0 && ((d >> 24) & 1u) != 0;
}
// AMX-INT8 (CPUID leaf 7, EDX bit 25).
inline bool mt_cpu_has_amx_int8() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return ((d >> 25) & 1u) != 0;
}
// F16C (CPUID leaf 1, ECX bit 29), read directly for the same reason: clang 14 has no "f16c" for
// __builtin_cpu_supports. Asked only beside AVX2, whose check covers the OS's saving of the
// 256-bit registers F16C writes.
inline bool mt_cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return ((c >> 29) & 1u) != 0;
}
#define MT_AS_BF16X32(v) reinterpret_cast<__m512bh>(v)

#endif
