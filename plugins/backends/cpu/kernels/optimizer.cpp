// optimizer: the fused AdamW update, one pass over param, grad and both moments; AVX-512 where
// the CPU has it (chosen at run time: the build targets generic x86-64).

// GCC 12's AVX-512 headers trip -Wmaybe-uninitialized on their own _mm512_undefined_* temporaries
// once inlined; the warning points into the header, so it is silenced where the header is read
// (first, before anything else can include it).
#pragma GCC diagnostic push
#if !defined(__clang__)  // (clang has no -Wmaybe-uninitialized, and warns of the unknown name)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "kernels/x86_simd.h"
#pragma GCC diagnostic pop

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

// Elements per task: large enough to amortise scheduling, small enough to balance two to a few
// dozen threads on the parameter sizes of a layer.
constexpr int64_t kGrain = 1 << 14;

// The per-element constants, folded once per call.
struct AdamWConsts {
  float b1, one_minus_b1, b2, one_minus_b2, eps, grad_scale;
  float step_size;     // lr / (1 - b1^step): folds m's bias correction
  float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^step): v's bias correction, applied under the sqrt
  float decay;         // lr * weight_decay
};

float load_f(const float* p, int64_t i) {
  return p[i];
}
float load_f(const uint16_t* p, int64_t i) {
  return bf16_to_f32(p[i]);
}
void store_f(float* p, int64_t i, float v) {
  p[i] = v;
}
void store_f(uint16_t* p, int64_t i, float v) {
  p[i] = f32_to_bf16(v);
}

// One contiguous block, one element at a time: the portable path and the tail of the vector one.
// The vector path below performs the same f32 operations in the same order (no FMA
// contraction), so both give the same bits.
template <class P, class G, class M>
void adamw_scalar(P* param, const G* grad, M* m, float* v, int64_t begin, int64_t end,
                  const AdamWConsts& c) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = load_f(grad, i) * c.grad_scale;
    // A bf16 first moment (mu_dtype=bfloat16) is updated in f32 and stored rounded; the
    // update uses the f32 value, as optax does.
    const float mi = c.b1 * load_f(m, i) + c.one_minus_b1 * g;
    const float vi = c.b2 * v[i] + c.one_minus_b2 * (g * g);
    store_f(m, i, mi);
    v[i] = vi;
    const float p = load_f(param, i);
    // Decoupled weight decay uses the parameter before this step's update.
    const float update = c.step_size * mi / (std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps);
    store_f(param, i, (p - update) - c.decay * p);
  }
}

// AVX-512, 16 elements at a time. Written with intrinsics because the compiler will not vectorise
// the scalar loop: std::sqrt may set errno, which keeps a branch in the loop.
#define MT_AVX512 MT_TARGET("avx512f")

MT_AVX512 inline __m512 load16(const float* p) {
  return _mm512_loadu_ps(p);
}
MT_AVX512 inline __m512 load16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
MT_AVX512 inline void store16(float* p, __m512 x) {
  _mm512_storeu_ps(p, x);
}
// Round to nearest even, NaN stays a quiet NaN: mt::f32_to_bf16, lane by lane.
MT_AVX512 inline void store16(uint16_t* p, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __m512i nan = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_blend_epi32(is_nan, rounded, nan);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

template <class P, class G, class M>
MT_AVX512 void adamw_avx512(P* param, const G* grad, M* m, float* v, int64_t begin, int64_t end,
                            const AdamWConsts& c) {
  const __m512 b1 = _mm512_set1_ps(c.b1), omb1 = _mm512_set1_ps(c.one_minus_b1);
  const __m512 b2 = _mm512_set1_ps(c.b2), omb2 = _mm512_set1_ps(c.one_minus_b2);
  const __m512 eps = _mm512_set1_ps(c.eps), scale = _mm512_set1_ps(c.grad_scale);
  const __m512 step = _mm512_set1_ps(c.step_size), inv = _mm512_set1_ps(c.inv_sqrt_bc2);
  const __m512 decay = _mm512_set1_ps(c.decay);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = _mm512_mul_ps(load16(grad + i), scale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(b1, load16(m + i)), _mm512_mul_ps(omb1, g));
    const __m512 vi =
        _mm512_add_ps(_mm512_mul_ps(b2, load16(v + i)), _mm512_mul_ps(omb2, _mm512_mul_ps(g, g)));
    store16(m + i, mi);
    store16(v + i, vi);
    const __m512 p = load16(param + i);
    const __m512 update = _mm512_div_ps(_mm512_mul_ps(step, mi),
                                        _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vi), inv), eps));
    store16(param + i, _mm512_sub_ps(_mm512_sub_ps(p, update), _mm512_mul_ps(decay, p)));
  }
  adamw_scalar(param, grad, m, v, i, end, c);
}

bool have_avx512() {
  static const bool yes = mt_cpu_supports("avx512f");
  return yes;
}

template <class P, class G, class M>
void adamw_typed(P* param, const G* grad, M* m, float* v, int64_t n, const AdamWConsts& c) {
  const bool simd = have_avx512();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, kGrain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      if (simd)
                        adamw_avx512(param, grad, m, v, r.begin(), r.end(), c);
                      else
                        adamw_scalar(param, grad, m, v, r.begin(), r.end(), c);
                    });
}

template <class M>
void adamw_dispatch(Tensor& param, const Tensor& grad, M* m, float* v, int64_t n,
                    const AdamWConsts& c) {
  const bool p32 = param.dtype() == DType::f32, g32 = grad.dtype() == DType::f32;
  if (p32 && g32)
    adamw_typed(param.ptr<float>(), grad.ptr<const float>(), m, v, n, c);
  else if (p32)
    adamw_typed(param.ptr<float>(), grad.ptr<const uint16_t>(), m, v, n, c);
  else if (g32)
    adamw_typed(param.ptr<uint16_t>(), grad.ptr<const float>(), m, v, n, c);
  else
    adamw_typed(param.ptr<uint16_t>(), grad.ptr<const uint16_t>(), m, v, n, c);
}

}  // namespace

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  constexpr const char* op = "adamw_update";
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v})
    if (!t->defined()) fail(fmt::format("{}: every tensor must be defined", op));
  const auto is_f32_or_bf16 = [](DType t) { return t == DType::f32 || t == DType::bf16; };
  if (!is_f32_or_bf16(param.dtype()) || !is_f32_or_bf16(grad.dtype()) ||
      !is_f32_or_bf16(m.dtype()) || v.dtype() != DType::f32)
    fail(
        fmt::format("{}: param, grad and m must be f32 or bf16 and v f32; got param {}, grad {}, "
                    "m {}, v {}",
                    op, param.str(), grad.str(), m.str(), v.str()));
  const int64_t n = param.numel();
  if (grad.numel() != n || m.numel() != n || v.numel() != n)
    fail(fmt::format("{}: param {}, grad {}, m {} and v {} must have the same element count", op,
                     param.str(), grad.str(), m.str(), v.str()));
  if (p.step < 1) fail(fmt::format("{}: step must be >= 1 (1-based), got {}", op, p.step));

  // Bias corrections in double: for b2 = 0.999 and small steps 1 - b2^step loses digits in f32.
  const double step = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.b1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.b2), step);
  AdamWConsts c{};
  c.b1 = p.b1;
  c.one_minus_b1 = static_cast<float>(1.0 - p.b1);
  c.b2 = p.b2;
  c.one_minus_b2 = static_cast<float>(1.0 - p.b2);
  c.eps = p.eps;
  c.grad_scale = p.grad_scale;
  c.step_size = static_cast<float>(p.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.decay = static_cast<float>(static_cast<double>(p.lr) * p.weight_decay);

  if (m.dtype() == DType::f32)
    adamw_dispatch(param, grad, m.ptr<float>(), v.ptr<float>(), n, c);
  else
    adamw_dispatch(param, grad, m.ptr<uint16_t>(), v.ptr<float>(), n, c);
}

}  // namespace mt::cpu
