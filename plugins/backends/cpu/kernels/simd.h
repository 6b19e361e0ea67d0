// Helpers shared by the CPU kernel files: bf16 <-> f32 conversion into f32 scratch, the
// vectorisable exp / sigmoid / tanh, fixed-lane dot product, and the multiversioning macro.
//
// Private to plugins/backends/cpu/kernels/*.cpp; never include it from a header. Everything is
// in an unnamed namespace on purpose: each kernel file keeps its own copy of every function, its
// own target_clones resolvers and its own thread-local scratch, exactly as when each file defined
// these itself, so no kernel can clobber another file's scratch while it waits on a parallel
// loop. The functions are `inline` so a file that leaves one unused gets no warning and no code.
#pragma once

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "asan.h"
#include "kernels/kernels.h"

// Hot loops are compiled three times (generic x86-64, x86-64-v3 with AVX2 + FMA, and x86-64-v4;
// the loader picks the best the CPU runs) because the build targets generic x86-64.
// clang before 15 gives the clones' resolvers of a function in an unnamed namespace external
// linkage, so two kernel files defining the same one failed to link: there the generic build only.
#if defined(__clang__) && __clang_major__ < 15
#define MT_CLONES
#else
#define MT_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif

namespace mt::cpu {
namespace {

// The float dtypes every kernel here accepts.
inline bool is_fb(DType t) {
  return t == DType::f32 || t == DType::bf16;
}

// ---- bf16 <-> f32 conversion loops (branch-free so they vectorise) ----------------------------
MT_CLONES inline void bf16_to_f32_n(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(uint32_t(src[i]) << 16);
}

MT_CLONES inline void f32_to_bf16_n(const float* src, uint16_t* dst, int64_t n) {
  // Round to nearest even; a NaN keeps its sign and top payload bits and is made quiet (the same
  // rule as mt::f32_to_bf16).
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(src[i]);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    dst[i] = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
}

// ---- row-wise kernels: per-thread f32 scratch ---------------------------------------------------

// Per-thread scratch, grown on demand and reused across calls, so the steady state allocates
// nothing. Each file documents which slots its task bodies and its calling thread own.
// Under ASan (asan.h) only the n floats asked for are addressable until the slot's next call, so
// an access past them reports although the buffer, grown for a longer row, has room for it.
constexpr int kScratchSlots = 8;
inline float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> bufs[kScratchSlots];
  auto& b = bufs[slot];
  asan_unpoison(b.data(), b.size() * sizeof(float));  // resize() copies the old contents
  if (b.size() < static_cast<size_t>(n)) b.resize(static_cast<size_t>(n));
  asan_poison(b.data() + n, (b.size() - static_cast<size_t>(n)) * sizeof(float));
  return b.data();
}

// Row [off, off + n) of t as f32: in place for f32, else converted into buf.
inline const float* row_in(const Tensor& t, int64_t off, int64_t n, float* buf) {
  if (t.dtype() == DType::f32) return t.ptr<const float>() + off;
  bf16_to_f32_n(t.ptr<const uint16_t>() + off, buf, n);
  return buf;
}
// Writable row: in place for f32; for bf16, buf (holding the current values when `load`), to be
// written back with row_store.
inline float* row_out(Tensor& t, int64_t off, int64_t n, float* buf, bool load) {
  if (t.dtype() == DType::f32) return t.ptr<float>() + off;
  if (load) bf16_to_f32_n(t.ptr<const uint16_t>() + off, buf, n);
  return buf;
}
inline void row_store(Tensor& t, int64_t off, int64_t n, const float* buf) {
  if (t.dtype() == DType::bf16) f32_to_bf16_n(buf, t.ptr<uint16_t>() + off, n);
}

// ---- flat element-range kernels: fixed chunks in f32 stack buffers --------------------------
// The chunk size is a template parameter because each file picks its own (it sizes the stack
// buffers and the tasks).

// A read-only f32 view of elements [begin, begin + n) of t (n <= kChunk).
template <int64_t kChunk>
class ChunkIn {
 public:
  ChunkIn(const Tensor& t, int64_t begin, int64_t n) {
    if (t.dtype() == DType::f32) {
      p_ = t.ptr<const float>() + begin;
    } else {
      bf16_to_f32_n(t.ptr<const uint16_t>() + begin, buf_, n);
      p_ = buf_;
    }
  }
  const float* get() const { return p_; }

 private:
  const float* p_;
  float buf_[kChunk];
};

// A writable f32 view of elements [begin, begin + n) of t. With `load`, a bf16 view starts with
// the current values (for y += ...). store() writes a bf16 view back; f32 views are in place.
template <int64_t kChunk>
class ChunkOut {
 public:
  ChunkOut(Tensor& t, int64_t begin, int64_t n, bool load)
      : bf16_(t.dtype() == DType::bf16), n_(n) {
    if (!bf16_) {
      p_ = t.ptr<float>() + begin;
    } else {
      dst_ = t.ptr<uint16_t>() + begin;
      if (load) bf16_to_f32_n(dst_, buf_, n);
      p_ = buf_;
    }
  }
  float* get() { return p_; }
  void store() {
    if (bf16_) f32_to_bf16_n(buf_, dst_, n_);
  }

 private:
  bool bf16_;
  int64_t n_;
  float* p_;
  uint16_t* dst_ = nullptr;
  float buf_[kChunk];
};

// Calls f(begin, len) over [0, n) in chunks of kChunk, in parallel.
template <int64_t kChunk, class F>
void for_chunks(int64_t n, F&& f) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kChunk),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t b = r.begin(); b < r.end(); b += kChunk)
                        f(b, std::min(kChunk, r.end() - b));
                    });
}

// ---- vectorisable math ------------------------------------------------------------------------
// Branch-free polynomial versions (within ~2 ulp of libm) so the loops that call them vectorise.
// GCC vectorises them only without trapping math (its default turns fexp's selects into a
// branch): the CPU plugin's CMakeLists.txt builds it with -fno-trapping-math.

// exp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial (Cephes expf
// coefficients). Rounding to n uses the 1.5 * 2^23 trick, so NaN propagates and no float->int
// conversion of out-of-range values happens. Underflows to 0 below -87.3 (no denormals).
inline float fexp(float x) {
  constexpr float kMagic = 12582912.f;  // 1.5 * 2^23
  const float t = x * 1.44269504088896341f + kMagic;
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kMagic);
  const float n = t - kMagic;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500E-4f;
  p = p * r + 1.3981999507E-3f;
  p = p * r + 8.3334519073E-3f;
  p = p * r + 4.1665795894E-2f;
  p = p * r + 1.6666665459E-1f;
  p = p * r + 5.0000001201E-1f;
  float y = p * r * r + r + 1.f;
  y *= std::bit_cast<float>(static_cast<uint32_t>(ni + 127) << 23);
  y = x < -87.33654f ? 0.f : y;
  y = x > 88.72283f ? INFINITY : y;
  return y;
}

inline float fsigmoid(float x) {
  return 1.f / (1.f + fexp(-x));
}

// tanh: odd polynomial below 0.625 (Cephes tanhf, no cancellation near 0), else via exp.
inline float ftanh(float x) {
  const float ax = std::fabs(x);
  const float z = x * x;
  const float small = ((((-5.70498872745E-3f * z + 2.06390887954E-2f) * z - 5.37397155531E-2f) * z +
                        1.33314422036E-1f) *
                           z -
                       3.33332819422E-1f) *
                          z * x +
                      x;
  const float large = std::copysign(1.f - 2.f / (fexp(2.f * ax) + 1.f), x);
  return ax < 0.625f ? small : large;
}

// ---- fixed-lane reductions --------------------------------------------------------------------

// sum(a * b) over 16 explicit lanes, added in lane order: the summation order depends only on n,
// never on the vector width the clone was compiled for.
MT_CLONES inline float dot_n(const float* a, const float* b, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) acc[i & 15] += a[i] * b[i];
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

}  // namespace
}  // namespace mt::cpu
