// The AdamW update for the CUDA backend: one vectorised elementwise pass (Ew, common.cuh) over
// param, grad, m and v.
#include <cmath>
#include <cstdint>
#include <string>

#include "common.cuh"

namespace mt::cuda {

// ---- AdamW ----------------------------------------------------------------------------------
namespace {

struct AdamWConsts {
  float b1, one_minus_b1, b2, one_minus_b2, eps, grad_scale;
  float step_size;     // lr / (1 - b1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^step)
  float decay;         // lr * weight_decay
};
// The CPU's operation order with every step rounded (no contraction into FMAs), so both
// backends give the same bits.
// x: param, grad, m, v; y: param, m, v.
struct AdamWM {
  AdamWConsts c;
  __device__ void operator()(const float (&x)[4], float (&y)[3]) const {
    const float p = x[0];
    const float g = __fmul_rn(x[1], c.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(c.b1, x[2]), __fmul_rn(c.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(c.b2, x[3]), __fmul_rn(c.one_minus_b2, __fmul_rn(g, g)));
    const float update = __fdiv_rn(__fmul_rn(c.step_size, mi),
                                   __fadd_rn(__fmul_rn(__fsqrt_rn(vi), c.inv_sqrt_bc2), c.eps));
    y[0] = __fadd_rn(__fadd_rn(p, -update), -__fmul_rn(c.decay, p));
    y[1] = mi;
    y[2] = vi;
  }
};

}  // namespace

void adamw_update(const Ctx& c, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                  const AdamWParams& p) {
  auto shapes = [&] {
    return "param " + str(param) + ", grad " + str(grad) + ", m " + str(m) + ", v " + str(v);
  };
  MT_CHECK(is_fb(param) && is_fb(grad) && is_fb(m) && v.defined() && v.dtype() == DType::f32,
           "cuda adamw_update: param, grad and m must be f32 or bf16 and v f32: " + shapes());
  const int64_t n = param.numel();
  MT_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
           "cuda adamw_update: element counts differ: " + shapes());
  MT_CHECK(p.step >= 1,
           "cuda adamw_update: step must be >= 1 (1-based), got " + std::to_string(p.step));
  // Bias corrections in double, folded into f32 constants exactly as the CPU backend does.
  const double step = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.b1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.b2), step);
  AdamWConsts k{};
  k.b1 = p.b1;
  k.one_minus_b1 = static_cast<float>(1.0 - p.b1);
  k.b2 = p.b2;
  k.one_minus_b2 = static_cast<float>(1.0 - p.b2);
  k.eps = p.eps;
  k.grad_scale = p.grad_scale;
  k.step_size = static_cast<float>(p.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.decay = static_cast<float>(static_cast<double>(p.lr) * p.weight_decay);
  launch_ew(c, n,
            Ew<4, 3, AdamWM>{{in(param), in(grad), in(m), in(v)},
                             {out(param), out(m), out(v)},
                             {false, false, false},
                             {k}},
            "adamw_update", shapes);
}

}  // namespace mt::cuda
