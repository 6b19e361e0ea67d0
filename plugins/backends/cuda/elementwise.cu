// Elementwise kernels of the CUDA backend: fill, cast, add, mul, scale, axpy, fill_random, the
// deterministic sums, activations (plain and gated) and the soft-cap. All but fill, fill_random
// and the sums are Ew math (common.cuh).
#ifndef MT_CUDA_EMULATION
#include <cuda_bf16.h>
#endif

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "common.cuh"
#include "mt/random_fill.h"

namespace mt::cuda {

namespace {

// ---- elementwise functors -------------------------------------------------------------------
struct FillF32 {
  float* p;
  float v;
  __device__ void operator()(int64_t i) const { p[i] = v; }
};
struct FillBf16 {
  __nv_bfloat16* p;
  float v;
  __device__ void operator()(int64_t i) const { p[i] = __float2bfloat16_rn(v); }
};
struct FillI32 {
  int32_t* p;
  int32_t v;
  __device__ void operator()(int64_t i) const { p[i] = v; }
};
// The math of the elementwise ops (Ew, common.cuh): inputs x, outputs y.
struct CopyM {
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = x[0]; }
};
struct AddM {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[0] + x[1]; }
};
struct MulM {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[0] * x[1]; }
};
struct ScaleM {
  float s;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = x[0] * s; }
};
// y += alpha x with the product rounded first, as the CPU does (no fused multiply-add).
struct AxpyM {
  float alpha;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = __fmul_rn(alpha, x[0]);
  }
};

void check_same(const char* op, const Tensor& a, const Tensor& b) {
  MT_CHECK(is_fb(a) && is_fb(b) && a.numel() == b.numel(),
           std::string("cuda ") + op + ": operands " + str(a) + " and " + str(b) +
               " must have the same element count and be f32 or bf16");
}

}  // namespace

// ---- elementwise ------------------------------------------------------------------------------

void fill(const Ctx& c, Tensor& x, float value) {
  auto shapes = [&] { return str(x); };
  const int64_t n = x.numel();
  switch (x.dtype()) {
    case DType::f32:
      return launch_map(c, n, FillF32{x.ptr<float>(), value}, "fill", shapes);
    case DType::bf16:
      return launch_map(c, n, FillBf16{x.ptr<__nv_bfloat16>(), value}, "fill", shapes);
    case DType::i32:
      return launch_map(c, n, FillI32{x.ptr<int32_t>(), static_cast<int32_t>(value)}, "fill",
                        shapes);
    default:
      fail("cuda fill: unsupported tensor " + str(x));
  }
}

void cast(const Ctx& c, const Tensor& src, Tensor& dst) {
  auto shapes = [&] { return str(src) + " -> " + str(dst); };
  MT_CHECK(src.numel() == dst.numel(), "cuda cast: element counts differ: " + shapes());
  if (src.dtype() == dst.dtype()) {
    if (src.data() == dst.data() || src.nbytes() == 0) return;
    check(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, c.stream),
          "cast", "cudaMemcpyAsync", shapes());
    return;
  }
  MT_CHECK(is_fb(src) && is_fb(dst), "cuda cast: unsupported conversion " + shapes());
  launch_ew(c, src.numel(), Ew<1, 1, CopyM>{{in(src)}, {out(dst)}, {false}, {}}, "cast", shapes);
}

void add(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& o) {
  check_same("add", a, b);
  check_same("add", a, o);
  launch_ew(c, a.numel(), Ew<2, 1, AddM>{{in(a), in(b)}, {out(o)}, {false}, {}}, "add",
            [&] { return str(a) + " + " + str(b) + " -> " + str(o); });
}

void mul(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& o) {
  check_same("mul", a, b);
  check_same("mul", a, o);
  launch_ew(c, a.numel(), Ew<2, 1, MulM>{{in(a), in(b)}, {out(o)}, {false}, {}}, "mul",
            [&] { return str(a) + " * " + str(b) + " -> " + str(o); });
}

void scale(const Ctx& c, const Tensor& x, float s, Tensor& o) {
  check_same("scale", x, o);
  launch_ew(c, x.numel(), Ew<1, 1, ScaleM>{{in(x)}, {out(o)}, {false}, {s}}, "scale",
            [&] { return str(x) + " -> " + str(o); });
}

void axpy(const Ctx& c, float alpha, const Tensor& x, Tensor& y) {
  check_same("axpy", x, y);
  launch_ew(c, x.numel(), Ew<1, 1, AxpyM>{{in(x)}, {out(y)}, {true}, {alpha}}, "axpy",
            [&] { return str(x) + " -> " + str(y); });
}

// ---- random fill ----------------------------------------------------------------------------
namespace {

// Eight elements (two Philox blocks) per thread and step, stored as one (bf16) or two (f32)
// 16-byte stores where the output is aligned. The truncated normal's rare redraws (4.55% of
// elements) diverge within a warp, briefly.
__global__ void fill_random_kernel(Out o, int64_t n, uint64_t key, bool truncated, float scale,
                                   bool vec) {
  MT_KERNEL_PROLOGUE();
  namespace rf = random_fill;
  const int64_t chunks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t base = c * 8;
    float a[4], b[4], z[8];
    rf::normal4(key, static_cast<uint64_t>(c) * 2, 0, a);
    rf::normal4(key, static_cast<uint64_t>(c) * 2 + 1, 0, b);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      z[t] = a[t];
      z[t + 4] = b[t];
    }
#pragma unroll
    for (int t = 0; t < 8; ++t)
      z[t] = __fmul_rn(rf::standard_draw(key, static_cast<uint64_t>(base + t), truncated, z[t]),
                       scale);
    store8_upto(o, base, z, n, vec);
  }
}

}  // namespace

void fill_random(const Ctx& c, Tensor& t, const RandomFill& spec) {
  auto shapes = [&] { return str(t); };
  const bool truncated = spec.distribution == RandomFill::Distribution::truncated_normal;
  MT_CHECK(is_fb(t), "cuda fill_random: out " + shapes() + " (want f32 or bf16)");
  MT_CHECK((truncated || spec.distribution == RandomFill::Distribution::normal) &&
               std::isfinite(spec.stddev) && spec.stddev >= 0.f,
           "cuda fill_random: distribution " + std::to_string(int(spec.distribution)) +
               ", stddev " + std::to_string(spec.stddev) +
               " (want normal or truncated_normal, stddev >= 0)");
  const int64_t n = t.numel();
  if (n == 0) return;
  const float scale = random_fill::value_scale(truncated, spec.stddev);
  MT_LAUNCH(fill_random_kernel, grid_for((n + 7) / 8), kThreads, 0, c)
  (out(t), n, spec.key, truncated, scale, aligned16({t.data()}));
  launched("fill_random", shapes);
}

// ---- two-pass deterministic sum ------------------------------------------------------------
namespace {

constexpr int kSumBlocks = 512;  // fixed grid of the two-pass sum: fixes its order

// x [n] -> partial [kSumBlocks] (double): each block's threads stride the array in a fixed
// pattern (the grid is fixed), then a fixed tree adds the block's lanes.
// A thread takes chunks of 8 consecutive elements, through one 16-byte load (bf16; two for
// f32) when x is 16-byte aligned (vec), else element by element in the same order: the sum
// depends on n alone. (One 2- or 4-byte load per thread in flight would leave a Hopper's HBM
// mostly idle on the gradient norm's pass over every parameter.)
__global__ void sum_partial_kernel(In x, int64_t n, bool squares, bool vec, double* partial) {
  MT_KERNEL_PROLOGUE();
  __shared__ double sh[kThreads];
  double acc = 0;
  const int64_t chunks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(kSumBlocks) * kThreads;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; c < chunks;
       c += stride) {
    float v[8];
    load8_upto(v, x, c * 8, n, vec);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const double d = v[t];
      acc += squares ? d * d : d;
    }
  }
  const double s = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// partial [kSumBlocks] -> *result, one block
__global__ void sum_final_kernel(const double* partial, double* result) {
  MT_KERNEL_PROLOGUE();
  __shared__ double sh[kThreads];
  double acc = 0;
  for (int i = threadIdx.x; i < kSumBlocks; i += kThreads) acc += partial[i];
  const double s = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) *result = s;
}

// The sum (of squares) of x into *dst on the device: kSumBlocks partials, then their sum in order.
void launch_sum(const Ctx& c, const Tensor& x, bool squares, double* partial, double* dst) {
  const char* op = squares ? "sum_squares" : "sum";
  MT_LAUNCH(sum_partial_kernel, kSumBlocks, kThreads, 0, c)
  (in(x), x.numel(), squares, aligned16({x.data()}), partial);
  launched(op, [&] { return str(x); });
  MT_LAUNCH(sum_final_kernel, 1, kThreads, 0, c)(partial, dst);
  launched(op, [&] { return str(x); });
}

}  // namespace

double sum(const Ctx& c, const Tensor& x, bool squares) {
  std::vector<double> r;
  sums(c, {&x}, squares, r);
  return r[0];
}

void sums(const Ctx& c, const std::vector<const Tensor*>& xs, bool squares,
          std::vector<double>& result) {
  const char* op = squares ? "sum_squares" : "sum";
  const auto n = static_cast<int64_t>(xs.size());
  result.assign(xs.size(), 0.0);
  if (n == 0) return;
  for (const Tensor* x : xs)
    MT_CHECK(x != nullptr && is_fb(*x),
             std::string("cuda ") + op + ": unsupported tensor " + (x ? str(*x) : "null"));
  // The partials of one tensor (reused by the next: the stream orders them) and the n results,
  // as doubles in one f32 scratch block; the results come back in one copy and one sync. An
  // empty tensor's partials are 0.
  Tensor buf = c.scratch({2 * (kSumBlocks + n)}, DType::f32);
  double* partial = static_cast<double*>(buf.data());
  double* dst = partial + kSumBlocks;
  for (int64_t i = 0; i < n; ++i)
    launch_sum(c, *xs[static_cast<size_t>(i)], squares, partial, dst + i);
  const std::string what = n == 1 ? str(*xs[0]) : std::to_string(n) + " tensors";
  check(cudaMemcpyAsync(result.data(), dst, static_cast<size_t>(n) * sizeof(double),
                        cudaMemcpyDeviceToHost, c.stream),
        op, "copying the result to the host", what);
  check(cudaStreamSynchronize(c.stream), op, "stream synchronize", what);
}

// ---- activations (formulas as plugins/backends/cpu/kernels/activation.cpp) -----------------
namespace {

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

__device__ float sigmoid(float x) {
  return 1.f / (1.f + expf(-x));
}
__device__ float act_fwd(Activation act, float v) {
  switch (act) {
    case Activation::silu:
      return v * sigmoid(v);
    case Activation::gelu_tanh:
      // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative x.
      return v * sigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
    case Activation::gelu_exact:
      return 0.5f * v * erfcf(-v * kInvSqrt2);
    case Activation::relu:
      return v > 0.f ? v : 0.f;
    case Activation::tanh:
      return tanhf(v);
  }
  return 0.f;
}
// a = act(v), d = act'(v)
__device__ void act_both(Activation act, float v, float& a, float& d) {
  switch (act) {
    case Activation::silu: {
      const float s = sigmoid(v);
      a = v * s;
      d = s * (1.f + v * (1.f - s));
      return;
    }
    case Activation::gelu_tanh: {
      const float s = sigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
      a = v * s;
      d = s + v * 2.f * s * (1.f - s) * kGeluK * (1.f + 3.f * kGeluC * v * v);
      return;
    }
    case Activation::gelu_exact: {
      const float cdf = 0.5f * erfcf(-v * kInvSqrt2);
      a = v * cdf;
      d = cdf + v * kInvSqrt2Pi * expf(-0.5f * v * v);
      return;
    }
    case Activation::relu:
      a = v > 0.f ? v : 0.f;
      d = v > 0.f ? 1.f : 0.f;
      return;
    case Activation::tanh:
      a = tanhf(v);
      d = 1.f - a * a;
      return;
  }
}

struct ActFwdM {
  Activation act;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = act_fwd(act, x[0]);
  }
};
// x: dout, input; y: dx (accumulated)
struct ActBwdM {
  Activation act;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    float a = 0.f, d = 0.f;  // act_both sets both for every Activation
    act_both(act, x[1], a, d);
    y[0] = x[0] * d;
  }
};
// x: gate, up
struct GatedFwdM {
  Activation act;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = act_fwd(act, x[0]) * x[1];
  }
};
// x: dout, gate, up; y: dgate, dup (accumulated)
struct GatedBwdM {
  Activation act;
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    float a = 0.f, d = 0.f;  // act_both sets both for every Activation
    act_both(act, x[1], a, d);
    y[0] = x[0] * x[2] * d;
    y[1] = x[0] * a;
  }
};
struct SoftcapFwdM {
  float cap, inv;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = cap * tanhf(x[0] * inv);
  }
};
// d/dx cap tanh(x / cap) = 1 - (out / cap)^2. x: dout, out; y: dx (accumulated)
struct SoftcapBwdM {
  float inv;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    const float t = x[1] * inv;
    y[0] = x[0] * (1.f - t * t);
  }
};

void check_ew(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  bool ok = true;
  std::string desc;
  for (const Tensor* t : ts) {
    ok = ok && is_fb(*t) && t->numel() == first.numel();
    desc += (desc.empty() ? "" : ", ") + str(*t);
  }
  MT_CHECK(ok, std::string("cuda ") + op + ": operands " + desc +
                   " must be f32 or bf16 with the same element count");
}

}  // namespace

void activation_forward(const Ctx& c, Activation act, const Tensor& x, Tensor& o) {
  check_ew("activation_forward", {&x, &o});
  launch_ew(c, x.numel(), Ew<1, 1, ActFwdM>{{in(x)}, {out(o)}, {false}, {act}},
            "activation_forward", [&] { return str(x) + " -> " + str(o); });
}

void activation_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& x,
                         Tensor& dx) {
  check_ew("activation_backward", {&dout, &x, &dx});
  launch_ew(c, x.numel(), Ew<2, 1, ActBwdM>{{in(dout), in(x)}, {out(dx)}, {true}, {act}},
            "activation_backward", [&] { return str(dout) + ", " + str(x) + " -> " + str(dx); });
}

void gated_forward(const Ctx& c, Activation act, const Tensor& gate, const Tensor& up, Tensor& o) {
  check_ew("gated_forward", {&gate, &up, &o});
  launch_ew(c, gate.numel(), Ew<2, 1, GatedFwdM>{{in(gate), in(up)}, {out(o)}, {false}, {act}},
            "gated_forward", [&] { return str(gate) + ", " + str(up) + " -> " + str(o); });
}

void gated_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& gate,
                    const Tensor& up, Tensor& dgate, Tensor& dup) {
  check_ew("gated_backward", {&dout, &gate, &up, &dgate, &dup});
  launch_ew(c, gate.numel(),
            Ew<3, 2, GatedBwdM>{
                {in(dout), in(gate), in(up)}, {out(dgate), out(dup)}, {true, true}, {act}},
            "gated_backward", [&] { return str(dout) + ", " + str(gate) + ", " + str(up); });
}

void softcap_forward(const Ctx& c, const Tensor& x, float cap, Tensor& o) {
  check_ew("softcap_forward", {&x, &o});
  MT_CHECK(cap > 0.f, "cuda softcap_forward: cap must be positive, got " + std::to_string(cap));
  launch_ew(c, x.numel(), Ew<1, 1, SoftcapFwdM>{{in(x)}, {out(o)}, {false}, {cap, 1.f / cap}},
            "softcap_forward", [&] { return str(x) + " -> " + str(o); });
}

void softcap_backward(const Ctx& c, const Tensor& dout, const Tensor& y, float cap, Tensor& dx) {
  check_ew("softcap_backward", {&dout, &y, &dx});
  MT_CHECK(cap > 0.f, "cuda softcap_backward: cap must be positive, got " + std::to_string(cap));
  launch_ew(c, y.numel(), Ew<2, 1, SoftcapBwdM>{{in(dout), in(y)}, {out(dx)}, {true}, {1.f / cap}},
            "softcap_backward", [&] { return str(dout) + ", " + str(y) + " -> " + str(dx); });
}

}  // namespace mt::cuda
