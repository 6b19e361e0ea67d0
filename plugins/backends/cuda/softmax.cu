// softmax and cross-entropy (with z-loss) for the CUDA backend: one block per row.
#include <cmath>
#include <cstdint>
#include <string>

#include "common.cuh"

namespace mt::cuda {

// ---- softmax --------------------------------------------------------------------------------
namespace {

// x [N, C], out [N, C]
__global__ void softmax_fwd_kernel(In x, int64_t C, Out o) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * C;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) m = fmaxf(m, x[base + i]);
  m = block_max(m, sh);
  float s = 0;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) s += expf(x[base + i] - m);
  s = block_sum(s, sh);
  const float inv = 1.f / s;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) o.set(base + i, expf(x[base + i] - m) * inv);
}
// dx += y (g - sum(g y))
__global__ void softmax_bwd_kernel(In g, In y, int64_t C, Out dx) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * C;
  float s = 0;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) s += g[base + i] * y[base + i];
  s = block_sum(s, sh);
  for (int64_t i = threadIdx.x; i < C; i += kThreads)
    dx.add(base + i, y[base + i] * (g[base + i] - s));
}

}  // namespace

void softmax_forward(const Ctx& c, const Tensor& x, Tensor& o) {
  auto shapes = [&] { return "x " + str(x) + ", out " + str(o); };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(o) && o.numel() == x.numel(),
           "cuda softmax_forward: " + shapes());
  const int64_t C = x.dim(-1), N = C ? x.numel() / C : 0;
  if (N == 0) return;
  MT_LAUNCH(softmax_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)(in(x), C, out(o));
  launched("softmax_forward", shapes);
}

void softmax_backward(const Ctx& c, const Tensor& dout, const Tensor& y, Tensor& dx) {
  auto shapes = [&] { return "dout " + str(dout) + ", out " + str(y) + ", dx " + str(dx); };
  MT_CHECK(is_fb(y) && y.ndim() >= 1 && is_fb(dout) && is_fb(dx) && dout.numel() == y.numel() &&
               dx.numel() == y.numel(),
           "cuda softmax_backward: " + shapes());
  const int64_t C = y.dim(-1), N = C ? y.numel() / C : 0;
  if (N == 0) return;
  MT_LAUNCH(softmax_bwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(dout), in(y), C, out(dx));
  launched("softmax_backward", shapes);
}

// ---- cross-entropy --------------------------------------------------------------------------
namespace {

// logits [N, V], targets [N], loss [N], lse [N]. A target >= V is recorded in `bad` and its row
// left at loss 0 (the call's results are undefined once a check fails).
// One pass over the row: each thread keeps a running maximum m and the sum s of exp(v - m),
// rescaled when m grows; the block then takes the largest m and adds the rescaled sums. vec (V %
// 8 == 0, x 16-byte aligned): 8 logits per thread and step through 16-byte loads.
__global__ void ce_fwd_kernel(In x, const int32_t* tg, float z_loss, int64_t V, bool vec,
                              float* loss, float* lse, unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t n = blockIdx.x, base = n * V;
  if (tg[n] >= V) {  // uniform across the block
    if (threadIdx.x == 0) {
      record_bad(bad, n, tg[n]);
      loss[n] = 0.f;
      lse[n] = 0.f;
    }
    return;
  }
  float m = -INFINITY, s = 0.f;
  // A NaN or +inf logit makes the row's log-sum-exp NaN, as the CPU's is: s becomes NaN and
  // stays so (the comparisons below pass over NaN: a partly NaN row gave a finite loss).
  const auto push = [&](float v) {
    if (!(v < INFINITY)) {
      s = NAN;
    } else if (v > m) {
      s = s * expf(m - v) + 1.f;  // exp(-inf) = 0 at the first finite value
      m = v;
    } else if (v > -INFINITY) {
      s += expf(v - m);
    }
  };
  if (vec) {
    for (int64_t i = threadIdx.x * 8; i < V; i += kThreads * 8) {
      float v[8];
      load8(v, x, base + i, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) push(v[t]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) push(x[base + i]);
  }
  const float mx = block_max(m, sh);
  s = block_sum(m > -INFINITY || isnan(s) ? s * expf(m - mx) : 0.f, sh);
  m = mx;
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[n] = l;
    const int32_t t = tg[n];
    loss[n] = t < 0 ? 0.f : l - x[base + t] + z_loss * l * l;
  }
}
// dlogits [N, V] += dloss[n] * (softmax * (1 + 2 z lse) - onehot(target)), recomputed from lse
// vec as for ce_fwd_kernel, dx 16-byte aligned too.
__global__ void ce_bwd_kernel(In dloss, In x, const int32_t* tg, const float* lse, float z_loss,
                              int64_t V, bool vec, Out dx, unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  const int64_t n = blockIdx.x, base = n * V;
  const int32_t t = tg[n];
  if (t >= V && threadIdx.x == 0) record_bad(bad, n, t);
  if (t < 0 || t >= V) return;  // ignored (or bad) row: no gradient (uniform across the block)
  const float g = dloss[n], l = lse[n];
  const float coef = g * (1.f + 2.f * z_loss * l);
  if (vec) {
    for (int64_t i = threadIdx.x * 8; i < V; i += kThreads * 8) {
      float xv[8], r[8];
      load8(xv, x, base + i, true);
      load8(r, dx.in(), base + i, true);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        r[u] = r[u] + coef * expf(xv[u] - l);
        if (i + u == t) r[u] -= g;
      }
      store8(dx, base + i, r, true);
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    float v = dx.get(base + i) + coef * expf(x[base + i] - l);
    if (i == t) v -= g;
    dx.set(base + i, v);
  }
}

// The targets' shape; their range the kernels check on the device, into the returned slot.
unsigned long long* check_targets(const Ctx& c, const char* op, const Tensor& targets, int64_t N,
                                  int64_t V) {
  MT_CHECK(targets.defined() && targets.dtype() == DType::i32 && targets.numel() == N,
           std::string("cuda ") + op + ": targets must be i32 with " + std::to_string(N) +
               " elements, got " + str(targets));
  const std::string name = op;
  return c.checks->slot([name, V](int64_t n, int64_t t) {
    return "cuda " + name + ": target id " + std::to_string(t) + " of row " + std::to_string(n) +
           " is outside the vocabulary [0, " + std::to_string(V) + ")";
  });
}

}  // namespace

void cross_entropy_forward(const Ctx& c, const Tensor& logits, const Tensor& targets, float z_loss,
                           Tensor& loss, Tensor& lse) {
  auto shapes = [&] {
    return "logits " + str(logits) + ", targets " + str(targets) + ", loss " + str(loss) +
           ", lse " + str(lse);
  };
  MT_CHECK(is_fb(logits) && logits.ndim() >= 1 && logits.dim(-1) > 0,
           "cuda cross_entropy_forward: " + shapes());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(loss.defined() && loss.dtype() == DType::f32 && loss.numel() == N && lse.defined() &&
               lse.dtype() == DType::f32 && lse.numel() == N,
           "cuda cross_entropy_forward: " + shapes() + " (loss and lse must be f32 [N])");
  unsigned long long* bad = check_targets(c, "cross_entropy_forward", targets, N, V);
  if (N == 0) return;
  const bool vec = V % 8 == 0 && aligned16({logits.data()});
  MT_LAUNCH(ce_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(logits), targets.ptr<const int32_t>(), z_loss, V, vec, loss.ptr<float>(), lse.ptr<float>(),
   bad);
  launched("cross_entropy_forward", shapes);
}

void cross_entropy_backward(const Ctx& c, const Tensor& dloss, const Tensor& logits,
                            const Tensor& targets, const Tensor& lse, float z_loss,
                            Tensor& dlogits) {
  auto shapes = [&] {
    return "dloss " + str(dloss) + ", logits " + str(logits) + ", targets " + str(targets) +
           ", lse " + str(lse) + ", dlogits " + str(dlogits);
  };
  MT_CHECK(is_fb(logits) && logits.ndim() >= 1 && logits.dim(-1) > 0 && is_fb(dlogits) &&
               dlogits.numel() == logits.numel(),
           "cuda cross_entropy_backward: " + shapes());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(is_fb(dloss) && dloss.numel() == N && lse.defined() && lse.dtype() == DType::f32 &&
               lse.numel() == N,
           "cuda cross_entropy_backward: " + shapes() + " (dloss [N], lse f32 [N])");
  unsigned long long* bad = check_targets(c, "cross_entropy_backward", targets, N, V);
  if (N == 0) return;
  const bool vec = V % 8 == 0 && aligned16({logits.data(), dlogits.data()});
  MT_LAUNCH(ce_bwd_kernel, static_cast<unsigned>(N), kThreads, 0, c)
  (in(dloss), in(logits), targets.ptr<const int32_t>(), lse.ptr<const float>(), z_loss, V, vec,
   out(dlogits), bad);
  launched("cross_entropy_backward", shapes);
}

}  // namespace mt::cuda
