// rmsnorm and layernorm for the CUDA backend: one block per row for the output and for dx; dw
// (and db) from fixed row blocks' partials, added in block order.
#include <algorithm>
#include <cstdint>
#include <string>

#include "common.cuh"

namespace mt::cuda {

// ---- rmsnorm --------------------------------------------------------------------------------
namespace {

// One block per row. x [N, D], w [D], out [N, D], rstd [N]
// vec (D % 8 == 0, every operand 16-byte aligned): a thread takes 8 consecutive features at a
// time through 16-byte accesses (see Ew in common.cuh) instead of one.
__global__ void rms_fwd_kernel(In x, In w, bool plus_one, float eps, int64_t D, bool vec, Out o,
                               float* rstd) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  float ss = 0;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float v[8];
      load8(v, x, base + d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) ss += v[t] * v[t];
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const float v = x[base + d];
      ss += v * v;
    }
  }
  ss = block_sum(ss, sh);
  const float inv = 1.f / sqrtf(ss / float(D) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = inv;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float v[8], wv[8], r[8];
      load8(v, x, base + d, true);
      load8(wv, w, d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) r[t] = v[t] * inv * (plus_one ? 1.f + wv[t] : wv[t]);
      store8(o, base + d, r, true);
    }
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float wv = plus_one ? 1.f + w[d] : w[d];
    o.set(base + d, x[base + d] * inv * wv);
  }
}
// dx [N, D] += inv * g * w - x * inv^3 * sum(g w x) / D, one block per row
// vec as for rms_fwd_kernel.
__global__ void rms_bwd_dx_kernel(In g, In x, In w, bool plus_one, const float* rstd, int64_t D,
                                  bool vec, Out dx) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  const float inv = rstd[blockIdx.x];
  float s = 0;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float gv[8], xv[8], wv[8];
      load8(gv, g, base + d, true);
      load8(xv, x, base + d, true);
      load8(wv, w, d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) s += gv[t] * (plus_one ? 1.f + wv[t] : wv[t]) * xv[t];
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const float wv = plus_one ? 1.f + w[d] : w[d];
      s += g[base + d] * wv * x[base + d];
    }
  }
  s = block_sum(s, sh);
  const float c = inv * inv * inv * s / float(D);
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float gv[8], xv[8], wv[8], r[8];
      load8(gv, g, base + d, true);
      load8(xv, x, base + d, true);
      load8(wv, w, d, true);
      load8(r, dx.in(), base + d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t)
        r[t] += inv * gv[t] * (plus_one ? 1.f + wv[t] : wv[t]) - c * xv[t];
      store8(dx, base + d, r, true);
    }
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float wv = plus_one ? 1.f + w[d] : w[d];
    dx.add(base + d, inv * g[base + d] * wv - c * x[base + d]);
  }
}
// partial [nblocks, D]: block b of `brows` rows sums g x rstd over its rows in row order.
// grid (ceil(D / kThreads), nblocks)
// vec (D % 8 == 0, g and x 16-byte aligned): a thread owns 8 consecutive columns, read through
// 16-byte loads; grid (ceil(D / (8 kThreads)), nblocks). Each column's sum keeps its row order.
__global__ void rms_bwd_dw_partial_kernel(In g, In x, const float* rstd, int64_t N, int64_t D,
                                          int64_t brows, bool vec, float* partial) {
  MT_KERNEL_PROLOGUE();
  const int64_t n0 = blockIdx.y * brows, n1 = min(N, n0 + brows);
  if (vec) {
    const int64_t d0 = (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x) * 8;
    if (d0 >= D) return;
    float acc[8] = {};
    for (int64_t n = n0; n < n1; ++n) {
      float gv[8], xv[8];
      load8(gv, g, n * D + d0, true);
      load8(xv, x, n * D + d0, true);
      const float r = rstd[n];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] += gv[u] * xv[u] * r;
    }
    store8(Out{partial, false}, blockIdx.y * D + d0, acc, true);
    return;
  }
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  float acc = 0;
  for (int64_t n = n0; n < n1; ++n) acc += g[n * D + d] * x[n * D + d] * rstd[n];
  partial[blockIdx.y * D + d] = acc;
}
// dw [D] += (partials in block order)
__global__ void add_partials_kernel(const float* partial, int64_t nblocks, int64_t D, Out dw) {
  MT_KERNEL_PROLOGUE();
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  // The blocks' sum first, added to dw once (as the CPU's: accumulation over micro-batches is
  // then the micro-batches' sums added, as data parallelism's ranks add them).
  float acc = 0.f;
  for (int64_t b = 0; b < nblocks; ++b) acc += partial[b * D + d];
  dw.set(d, dw.get(d) + acc);
}

}  // namespace

void rmsnorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, float eps, bool plus_one,
                     Tensor& o, Tensor& rstd) {
  auto shapes = [&] {
    return "x " + str(x) + ", w " + str(w) + ", out " + str(o) + ", rstd " + str(rstd);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(o) && w.numel() == x.dim(-1) &&
               o.numel() == x.numel() && rstd.defined() && rstd.dtype() == DType::f32,
           "cuda rmsnorm_forward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(rstd.numel() == N, "cuda rmsnorm_forward: rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const bool vec = D % 8 == 0 && aligned16({x.data(), w.data(), o.data()});
  MT_LAUNCH(rms_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(x), in(w), plus_one, eps, D, vec, out(o), rstd.ptr<float>());
  launched("rmsnorm_forward", shapes);
}

void rmsnorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) {
  auto shapes = [&] {
    return "dout " + str(dout) + ", x " + str(x) + ", w " + str(w) + ", rstd " + str(rstd) +
           ", dx " + str(dx) + ", dw " + str(dw);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(dout) && is_fb(dx) && is_fb(dw) &&
               w.numel() == x.dim(-1) && dw.numel() == w.numel() && dout.numel() == x.numel() &&
               dx.numel() == x.numel() && rstd.defined() && rstd.dtype() == DType::f32,
           "cuda rmsnorm_backward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(rstd.numel() == N, "cuda rmsnorm_backward: rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const bool vec = D % 8 == 0 && aligned16({dout.data(), x.data(), w.data(), dx.data()});
  MT_LAUNCH(rms_bwd_dx_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(dout), in(x), in(w), plus_one, rstd.ptr<const float>(), D, vec, out(dx));
  launched("rmsnorm_backward", shapes);
  // dw: fixed row blocks (a function of N only, as on the CPU), each writing its own partial,
  // then the partials added in block order.
  const int64_t brows = std::max<int64_t>(32, (N + 255) / 256);
  const int64_t nblocks = (N + brows - 1) / brows;
  Tensor partial = c.scratch({nblocks, D}, DType::f32);
  const unsigned cols = static_cast<unsigned>((D + kThreads - 1) / kThreads);
  const bool vec_dw = D % 8 == 0 && aligned16({dout.data(), x.data()});
  const unsigned dw_cols = vec_dw ? static_cast<unsigned>((D / 8 + kThreads - 1) / kThreads) : cols;
  MT_LAUNCH(rms_bwd_dw_partial_kernel, dim3(dw_cols, static_cast<unsigned>(nblocks)), kThreads, 0,
            c)
  (in(dout), in(x), rstd.ptr<const float>(), N, D, brows, vec_dw, partial.ptr<float>());
  launched("rmsnorm_backward", shapes);
  MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c)
  (partial.ptr<const float>(), nblocks, D, out(dw));
  launched("rmsnorm_backward", shapes);
}

// ---- layernorm (formulas as the CPU's norm.cpp) ---------------------------------------------
namespace {

// One block per row. x [N, D], w [D], b [D] (has_b), out [N, D], mean [N], rstd [N]. Two passes
// (mean, then squared deviations): no cancellation.
__global__ void ln_fwd_kernel(In x, In w, In b, bool has_b, float eps, int64_t D, Out o,
                              float* mean, float* rstd) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  float s = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) s += x[base + d];
  const float m = block_sum(s, sh) / float(D);
  float q = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float dev = x[base + d] - m;
    q += dev * dev;
  }
  const float inv = 1.f / sqrtf(block_sum(q, sh) / float(D) + eps);
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = m;
    rstd[blockIdx.x] = inv;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads)
    o.set(base + d, (x[base + d] - m) * inv * w[d] + (has_b ? b[d] : 0.f));
}
// xhat = (x - m) inv; dx += inv (g w - s1 - xhat s2), s1 = mean(g w), s2 = inv mean(g w (x - m))
__global__ void ln_bwd_dx_kernel(In g, In x, In w, const float* mean, const float* rstd, int64_t D,
                                 Out dx) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  const float m = mean[blockIdx.x], inv = rstd[blockIdx.x];
  float gw = 0, gwx = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    gw += g[base + d] * w[d];
    gwx += g[base + d] * w[d] * (x[base + d] - m);
  }
  const float s1 = block_sum(gw, sh) / float(D);
  const float s2 = inv * block_sum(gwx, sh) / float(D);
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float xhat = (x[base + d] - m) * inv;
    dx.add(base + d, inv * (g[base + d] * w[d] - s1 - xhat * s2));
  }
}
// pw, pb [nblocks, D]: row block b's sums of g xhat and of g, in row order.
// grid (ceil(D / kThreads), nblocks)
__global__ void ln_bwd_partial_kernel(In g, In x, const float* mean, const float* rstd, int64_t N,
                                      int64_t D, int64_t brows, float* pw, float* pb) {
  MT_KERNEL_PROLOGUE();
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  const int64_t n0 = blockIdx.y * brows, n1 = min(N, n0 + brows);
  float aw = 0, ab = 0;
  for (int64_t n = n0; n < n1; ++n) {
    const float gv = g[n * D + d];
    aw += gv * ((x[n * D + d] - mean[n]) * rstd[n]);
    ab += gv;
  }
  pw[blockIdx.y * D + d] = aw;
  pb[blockIdx.y * D + d] = ab;
}

}  // namespace

void layernorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                       Tensor& o, Tensor& mean, Tensor& rstd) {
  auto shapes = [&] {
    return "x " + str(x) + ", w " + str(w) + ", b " + str(b) + ", out " + str(o) + ", mean " +
           str(mean) + ", rstd " + str(rstd);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(o) && w.numel() == x.dim(-1) &&
               o.numel() == x.numel() && (!b.defined() || (is_fb(b) && b.numel() == w.numel())),
           "cuda layernorm_forward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == N && rstd.defined() &&
               rstd.dtype() == DType::f32 && rstd.numel() == N,
           "cuda layernorm_forward: mean and rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const In bias = b.defined() ? in(b) : In{nullptr, false};
  MT_LAUNCH(ln_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(x), in(w), bias, b.defined(), eps, D, out(o), mean.ptr<float>(), rstd.ptr<float>());
  launched("layernorm_forward", shapes);
}

void layernorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw,
                        Tensor& db) {
  auto shapes = [&] {
    return "dout " + str(dout) + ", x " + str(x) + ", w " + str(w) + ", dx " + str(dx) + ", dw " +
           str(dw) + ", db " + str(db);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(dout) && is_fb(dx) && is_fb(dw) &&
               w.numel() == x.dim(-1) && dw.numel() == w.numel() && dout.numel() == x.numel() &&
               dx.numel() == x.numel() && (!db.defined() || (is_fb(db) && db.numel() == w.numel())),
           "cuda layernorm_backward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == N && rstd.defined() &&
               rstd.dtype() == DType::f32 && rstd.numel() == N,
           "cuda layernorm_backward: mean and rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  MT_LAUNCH(ln_bwd_dx_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(dout), in(x), in(w), mean.ptr<const float>(), rstd.ptr<const float>(), D, out(dx));
  launched("layernorm_backward", shapes);
  // dw and db: fixed row blocks (a function of N only), partials added in block order.
  const int64_t brows = std::max<int64_t>(32, (N + 255) / 256);
  const int64_t nblocks = (N + brows - 1) / brows;
  Tensor partial = c.scratch({2, nblocks, D}, DType::f32);
  float* pw = partial.ptr<float>();
  float* pb = pw + nblocks * D;
  const unsigned cols = static_cast<unsigned>((D + kThreads - 1) / kThreads);
  MT_LAUNCH(ln_bwd_partial_kernel, dim3(cols, static_cast<unsigned>(nblocks)), kThreads, 0, c)
  (in(dout), in(x), mean.ptr<const float>(), rstd.ptr<const float>(), N, D, brows, pw, pb);
  launched("layernorm_backward", shapes);
  MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c)(pw, nblocks, D, out(dw));
  launched("layernorm_backward", shapes);
  if (db.defined()) {
    MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c)(pb, nblocks, D, out(db));
    launched("layernorm_backward", shapes);
  }
}

}  // namespace mt::cuda
