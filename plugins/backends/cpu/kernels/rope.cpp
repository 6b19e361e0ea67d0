// rope: rotary position embedding with the default, Llama 3.1 and YaRN frequency tables, partial
// rotary dimensions, and rotate_half or interleaved pairing.
//
// The inverse frequencies follow Hugging Face transformers (_compute_default_rope_parameters,
// _compute_llama3_parameters, _compute_yarn_parameters), evaluated in double and stored in f32
// as HF stores its inv_freq buffer. Angles position * inv_freq and their cos/sin are evaluated in
// double: at positions near 128k an f32 product is off by up to ~1e-2 rad, which is not noise.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

constexpr int64_t kRowGrain = 4;  // (b, t) rows per task

// scratch() slots 0..3 belong to task bodies, which never nest parallel work.

// c[i] = scale cos(p f[i]), s[i] = sign scale sin(p f[i]). The angle and its reduction to
// r in [-pi/4, pi/4] are done in double (exact enough at any position an int32 holds); sin and
// cos of r use float polynomials (Cephes sinf/cosf, ~1 ulp), so the loop vectorises instead of
// calling libm's double sin and cos per frequency.
MT_CLONES void sincos_row(double p, const double* f, float scale, float sign, float* c, float* s,
                          int64_t n) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52: rounds to an integer
  constexpr double kTwoOverPi = 0.63661977236758134;
  constexpr double kPio2Hi = 1.5707963267948966, kPio2Lo = 6.123233995736766e-17;
  for (int64_t i = 0; i < n; ++i) {
    const double a = p * f[i];
    const double t = a * kTwoOverPi + kMagic;
    const uint64_t q = std::bit_cast<uint64_t>(t) & 3u;  // quadrant: the integer's low bits
    const double k = t - kMagic;
    const float r = static_cast<float>((a - k * kPio2Hi) - k * kPio2Lo);
    const float z = r * r;
    const float sr =
        r + r * z * (-1.6666654611E-1f + z * (8.3321608736E-3f + z * -1.9515295891E-4f));
    const float cr =
        1.f - 0.5f * z +
        z * z * (4.166664568298827E-2f + z * (-1.388731625493765E-3f + z * 2.443315711809948E-5f));
    // (cos a, sin a) for quadrants 0..3: (cr, sr), (-sr, cr), (-cr, -sr), (sr, -cr)
    const float cv = (q & 1) ? sr : cr;
    const float sv = (q & 1) ? cr : sr;
    const float cs = (q == 1 || q == 2) ? -cv : cv;
    const float ss = (q & 2) ? -sv : sv;
    c[i] = scale * cs;
    s[i] = sign * scale * ss;
  }
}

// rotate_half pairing, i with i + h:  o (+)= [x1 c - x2 s, x2 c + x1 s]
MT_CLONES void rot_half(const float* x, const float* c, const float* s, float* o, int64_t h,
                        bool acc) {
  if (acc) {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[i], b = x[i + h];
      o[i] += a * c[i] - b * s[i];
      o[i + h] += b * c[i] + a * s[i];
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[i], b = x[i + h];
      o[i] = a * c[i] - b * s[i];
      o[i + h] = b * c[i] + a * s[i];
    }
  }
}
// interleaved pairing, 2i with 2i + 1
MT_CLONES void rot_inter(const float* x, const float* c, const float* s, float* o, int64_t h,
                         bool acc) {
  if (acc) {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      o[2 * i] += a * c[i] - b * s[i];
      o[2 * i + 1] += b * c[i] + a * s[i];
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      o[2 * i] = a * c[i] - b * s[i];
      o[2 * i + 1] = b * c[i] + a * s[i];
    }
  }
}
MT_CLONES void pass_n(const float* x, float* o, int64_t n, bool acc) {
  if (acc) {
    for (int64_t i = 0; i < n; ++i) o[i] += x[i];
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = x[i];
  }
}

// Forward (inverse = false): out = rotate(x, angle). Backward (inverse = true):
// out += mscale * rotate(x, -angle), the transpose of the forward map.
void rope_apply(const char* op, const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                Tensor& out, bool inverse) {
  MT_CHECK(x.ndim() == 4 && is_fb(x.dtype()) && is_fb(out.dtype()) && out.numel() == x.numel() &&
               positions.dtype() == DType::i32 && positions.numel() == x.dim(0) * x.dim(1),
           std::string("cpu ") + op + ": x " + x.str() + ", positions " + positions.str() +
               ", out " + out.str() + " (want x [B, T, H, D], positions [B, T] i32)");
  const int64_t H = x.dim(2), D = x.dim(3), rows = x.dim(0) * x.dim(1);
  const int64_t R = spec.rotary_dim > 0 ? spec.rotary_dim : D;
  MT_CHECK(R % 2 == 0 && R <= D, std::string("cpu ") + op + ": rotary_dim " + std::to_string(R) +
                                     " must be even and at most head_dim " + std::to_string(D));
  const int64_t half = R / 2, row_len = H * D;
  const RopeFrequencies table = rope_frequencies(spec, R);
  const std::vector<double> freq(table.inv_freq.begin(), table.inv_freq.end());
  const float mscale = static_cast<float>(table.mscale);
  const int32_t* pos = positions.ptr<const int32_t>();
  const bool x_f32 = x.dtype() == DType::f32, o_f32 = out.dtype() == DType::f32;

  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, rows, kRowGrain), [&](const tbb::blocked_range<int64_t>& r) {
        float* c = scratch(0, half);
        float* s = scratch(1, half);
        float* bx = scratch(2, row_len);
        float* bo = scratch(3, row_len);
        for (int64_t row = r.begin(); row < r.end(); ++row) {
          sincos_row(double(pos[row]), freq.data(), mscale, inverse ? -1.f : 1.f, c, s, half);
          const int64_t off = row * row_len;
          const float* xr = bx;
          if (x_f32)
            xr = x.ptr<const float>() + off;
          else
            bf16_to_f32_n(x.ptr<const uint16_t>() + off, bx, row_len);
          float* o = o_f32 ? out.ptr<float>() + off : bo;
          if (!o_f32 && inverse) bf16_to_f32_n(out.ptr<const uint16_t>() + off, bo, row_len);
          for (int64_t h = 0; h < H; ++h) {
            const float* xh = xr + h * D;
            float* oh = o + h * D;
            if (spec.interleaved)
              rot_inter(xh, c, s, oh, half, inverse);
            else
              rot_half(xh, c, s, oh, half, inverse);
            // Features past rotary_dim are not rotated (nor scaled): copied / passed through.
            if (R < D) pass_n(xh + R, oh + R, D - R, inverse);
          }
          if (!o_f32) f32_to_bf16_n(bo, out.ptr<uint16_t>() + off, row_len);
        }
      });
}

}  // namespace

void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec, Tensor& out) {
  rope_apply("rope_forward", x, positions, spec, out, false);
}

void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec, Tensor& dx) {
  rope_apply("rope_backward", dout, positions, spec, dx, true);
}

}  // namespace mt::cpu
