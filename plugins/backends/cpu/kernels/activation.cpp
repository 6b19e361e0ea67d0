// activation: silu, gelu (tanh and exact), relu, their gated forms (swiglu, geglu) and the
// logit soft-cap, forward and backward.
//
// exp and tanh are branch-free polynomial versions (within ~2 ulp of libm) so the loops
// vectorise; erf (gelu_exact) uses libm. Work is split into fixed chunks; bf16 operands are
// converted chunk by chunk into f32 stack buffers.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

constexpr int64_t kChunk = 1024;  // elements per task and per stack buffer

using In = ChunkIn<kChunk>;
using Out = ChunkOut<kChunk>;

constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

// o = act(x)
MT_CLONES void act_fwd_n(Activation act, const float* x, float* o, int64_t n) {
  switch (act) {
    case Activation::silu:
      for (int64_t i = 0; i < n; ++i) o[i] = x[i] * fsigmoid(x[i]);
      break;
    case Activation::gelu_tanh:
      // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative x.
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        o[i] = v * fsigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
      }
      break;
    case Activation::gelu_exact:
      // 0.5 (1 + erf(x / sqrt 2)) = 0.5 erfc(-x / sqrt 2): no cancellation for negative x.
      for (int64_t i = 0; i < n; ++i) o[i] = 0.5f * x[i] * std::erfc(-x[i] * kInvSqrt2);
      break;
    case Activation::relu:
      for (int64_t i = 0; i < n; ++i) o[i] = x[i] > 0.f ? x[i] : 0.f;
      break;
    case Activation::tanh:
      for (int64_t i = 0; i < n; ++i) o[i] = ftanh(x[i]);
      break;
  }
}

// a = act(x), d = act'(x)
MT_CLONES void act_both_n(Activation act, const float* x, float* a, float* d, int64_t n) {
  switch (act) {
    case Activation::silu:
      for (int64_t i = 0; i < n; ++i) {
        const float s = fsigmoid(x[i]);
        a[i] = x[i] * s;
        d[i] = s * (1.f + x[i] * (1.f - s));
      }
      break;
    case Activation::gelu_tanh:
      // With s = sigmoid(2u) = 0.5 (1 + tanh u): gelu = x s, and 0.5 (1 - tanh^2 u) = 2 s (1 - s).
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        const float s = fsigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
        a[i] = v * s;
        d[i] = s + v * 2.f * s * (1.f - s) * kGeluK * (1.f + 3.f * kGeluC * v * v);
      }
      break;
    case Activation::gelu_exact:
      for (int64_t i = 0; i < n; ++i) {
        const float v = x[i];
        const float cdf = 0.5f * std::erfc(-v * kInvSqrt2);
        a[i] = v * cdf;
        d[i] = cdf + v * kInvSqrt2Pi * fexp(-0.5f * v * v);
      }
      break;
    case Activation::relu:
      for (int64_t i = 0; i < n; ++i) {
        a[i] = x[i] > 0.f ? x[i] : 0.f;
        d[i] = x[i] > 0.f ? 1.f : 0.f;
      }
      break;
    case Activation::tanh:
      for (int64_t i = 0; i < n; ++i) {
        const float t = ftanh(x[i]);
        a[i] = t;
        d[i] = 1.f - t * t;
      }
      break;
  }
}

MT_CLONES void fma_acc_n(const float* g, const float* d, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += g[i] * d[i];
}
// swiglu's forward in one pass (same operation order as act_fwd_n then mul_n)
MT_CLONES void silu_gated_n(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = (g[i] * fsigmoid(g[i])) * u[i];
}
// swiglu's backward in one pass (same operation order as act_both_n then gated_bwd_n)
MT_CLONES void silu_gated_bwd_n(const float* g, const float* x, const float* up, float* dgate,
                                float* dup, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = fsigmoid(x[i]);
    const float a = x[i] * s;
    const float d = s * (1.f + x[i] * (1.f - s));
    dgate[i] += g[i] * up[i] * d;
    dup[i] += g[i] * a;
  }
}
MT_CLONES void mul_n(const float* a, const float* b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] * b[i];
}
// dgate += g * up * d;  dup += g * a
MT_CLONES void gated_bwd_n(const float* g, const float* up, const float* a, const float* d,
                           float* dgate, float* dup, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dgate[i] += g[i] * up[i] * d[i];
    dup[i] += g[i] * a[i];
  }
}
MT_CLONES void softcap_fwd_n(const float* x, float cap, float* o, int64_t n) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) o[i] = cap * ftanh(x[i] * inv);
}
// d/dx cap tanh(x / cap) = 1 - tanh^2 = 1 - (out / cap)^2
MT_CLONES void softcap_bwd_n(const float* g, const float* out, float cap, float* dx, int64_t n) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) {
    const float t = out[i] * inv;
    dx[i] += g[i] * (1.f - t * t);
  }
}

void check(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  bool ok = true;
  std::string desc;
  for (const Tensor* t : ts) {
    ok = ok && is_fb(t->dtype()) && t->numel() == first.numel();
    desc += (desc.empty() ? "" : ", ") + t->str();
  }
  MT_CHECK(ok, std::string("cpu ") + op + ": operands " + desc +
                   " must be f32 or bf16 with the same element count");
}

}  // namespace

void activation_forward(Activation act, const Tensor& x, Tensor& out) {
  check("activation_forward", {&x, &out});
  for_chunks<kChunk>(x.numel(), [&](int64_t c, int64_t len) {
    In ix(x, c, len);
    Out o(out, c, len, false);
    act_fwd_n(act, ix.get(), o.get(), len);
    o.store();
  });
}

void activation_backward(Activation act, const Tensor& dout, const Tensor& x, Tensor& dx) {
  check("activation_backward", {&dout, &x, &dx});
  for_chunks<kChunk>(x.numel(), [&](int64_t c, int64_t len) {
    In ig(dout, c, len), ix(x, c, len);
    Out d(dx, c, len, true);
    float a[kChunk], deriv[kChunk];
    act_both_n(act, ix.get(), a, deriv, len);
    fma_acc_n(ig.get(), deriv, d.get(), len);
    d.store();
  });
}

void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) {
  check("gated_forward", {&gate, &up, &out});
  for_chunks<kChunk>(gate.numel(), [&](int64_t c, int64_t len) {
    In ig(gate, c, len), iu(up, c, len);
    Out o(out, c, len, false);
    if (act == Activation::silu) {
      silu_gated_n(ig.get(), iu.get(), o.get(), len);
    } else {
      float a[kChunk];
      act_fwd_n(act, ig.get(), a, len);
      mul_n(a, iu.get(), o.get(), len);
    }
    o.store();
  });
}

void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up,
                    Tensor& dgate, Tensor& dup) {
  check("gated_backward", {&dout, &gate, &up, &dgate, &dup});
  for_chunks<kChunk>(gate.numel(), [&](int64_t c, int64_t len) {
    In ig(dout, c, len), igate(gate, c, len), iu(up, c, len);
    Out dg(dgate, c, len, true), du(dup, c, len, true);
    if (act == Activation::silu) {
      silu_gated_bwd_n(ig.get(), igate.get(), iu.get(), dg.get(), du.get(), len);
    } else {
      float a[kChunk], deriv[kChunk];
      act_both_n(act, igate.get(), a, deriv, len);
      gated_bwd_n(ig.get(), iu.get(), a, deriv, dg.get(), du.get(), len);
    }
    dg.store();
    du.store();
  });
}

void softcap_forward(const Tensor& x, float cap, Tensor& out) {
  check("softcap_forward", {&x, &out});
  MT_CHECK(cap > 0.f, "cpu softcap_forward: cap must be positive, got " + std::to_string(cap));
  for_chunks<kChunk>(x.numel(), [&](int64_t c, int64_t len) {
    In ix(x, c, len);
    Out o(out, c, len, false);
    softcap_fwd_n(ix.get(), cap, o.get(), len);
    o.store();
  });
}

void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) {
  check("softcap_backward", {&dout, &out, &dx});
  MT_CHECK(cap > 0.f, "cpu softcap_backward: cap must be positive, got " + std::to_string(cap));
  for_chunks<kChunk>(out.numel(), [&](int64_t c, int64_t len) {
    In ig(dout, c, len), io(out, c, len);
    Out d(dx, c, len, true);
    softcap_bwd_n(ig.get(), io.get(), cap, d.get(), len);
    d.store();
  });
}

}  // namespace mt::cpu
