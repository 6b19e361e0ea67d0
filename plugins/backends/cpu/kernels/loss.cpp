// loss: softmax over the last dimension and the fused softmax cross-entropy.
//
// Cross-entropy works on tasks of kCeRows rows; each row is read twice (max, then sum of exp)
// while it sits in cache, and the backward recomputes the probabilities from the saved logsumexp,
// so no full-vocabulary probability row is ever stored. bf16 rows are converted into
// thread-local f32 scratch, one row at a time.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

constexpr int64_t kCeRows = 8;       // rows per cross-entropy task
constexpr int64_t kSoftmaxRows = 8;  // rows per softmax task

// scratch() slots 0..2 belong to task bodies, which never nest parallel work.

// Element i of t as f32.
float scalar_at(const Tensor& t, int64_t i) {
  return t.dtype() == DType::f32 ? t.ptr<const float>()[i]
                                 : std::bit_cast<float>(uint32_t(t.ptr<const uint16_t>()[i]) << 16);
}

// ---- vectorised row loops; 16 explicit lanes fix the summation order -------------------------
MT_CLONES float max_n(const float* x, int64_t n) {
  float acc[16];
  for (float& a : acc) a = -INFINITY;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] = x[i + j] > acc[j] ? x[i + j] : acc[j];
  for (; i < n; ++i) acc[i & 15] = x[i] > acc[i & 15] ? x[i] : acc[i & 15];
  float m = -INFINITY;
  for (float a : acc) m = a > m ? a : m;
  return m;
}
// sum(exp(x - m))
MT_CLONES float sum_exp_n(const float* x, float m, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += fexp(x[i + j] - m);
  for (; i < n; ++i) acc[i & 15] += fexp(x[i] - m);
  float s = 0;
  for (float a : acc) s += a;
  return s;
}
// o = exp(x - m); returns sum(o)
MT_CLONES float exp_store_n(const float* x, float m, float* o, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      o[i + j] = fexp(x[i + j] - m);
      acc[j] += o[i + j];
    }
  for (; i < n; ++i) {
    o[i] = fexp(x[i] - m);
    acc[i & 15] += o[i];
  }
  float s = 0;
  for (float a : acc) s += a;
  return s;
}
MT_CLONES void scale_n(float* o, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] *= s;
}
// dx += y * (g - s)
MT_CLONES void softmax_bwd_n(const float* g, const float* y, float s, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += y[i] * (g[i] - s);
}
// dx += c * exp(x - lse)
MT_CLONES void ce_bwd_n(const float* x, float lse, float c, float* dx, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dx[i] += c * fexp(x[i] - lse);
}

// Throws naming the first target outside [0, V) (negative targets mean "ignored").
void check_targets(const char* op, const Tensor& targets, int64_t N, int64_t V) {
  MT_CHECK(targets.dtype() == DType::i32 && targets.numel() == N,
           std::string("cpu ") + op + ": targets must be i32 with " + std::to_string(N) +
               " elements, got " + targets.str());
  const int32_t* t = targets.ptr<const int32_t>();
  for (int64_t n = 0; n < N; ++n)
    if (t[n] >= V)
      throw Error(std::string("cpu ") + op + ": target id " + std::to_string(t[n]) + " of row " +
                  std::to_string(n) + " is outside the vocabulary [0, " + std::to_string(V) + ")");
}

}  // namespace

// x [N, C], out [N, C]
void softmax_forward(const Tensor& x, Tensor& out) {
  MT_CHECK(x.ndim() >= 1 && is_fb(x.dtype()) && is_fb(out.dtype()) && out.numel() == x.numel(),
           "cpu softmax_forward: x " + x.str() + ", out " + out.str());
  const int64_t C = x.dim(-1), N = C ? x.numel() / C : 0;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kSoftmaxRows),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      float* bx = scratch(0, C);
                      float* bo = scratch(1, C);
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const float* xr = row_in(x, n * C, C, bx);
                        float* o = row_out(out, n * C, C, bo, false);
                        const float m = max_n(xr, C);
                        const float s = exp_store_n(xr, m, o, C);
                        scale_n(o, 1.f / s, C);
                        row_store(out, n * C, C, o);
                      }
                    });
}

// dx [N, C] += out * (dout - sum(dout * out))
void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  MT_CHECK(out.ndim() >= 1 && is_fb(dout.dtype()) && is_fb(out.dtype()) && is_fb(dx.dtype()) &&
               dout.numel() == out.numel() && dx.numel() == out.numel(),
           "cpu softmax_backward: dout " + dout.str() + ", out " + out.str() + ", dx " + dx.str());
  const int64_t C = out.dim(-1), N = C ? out.numel() / C : 0;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kSoftmaxRows),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      float* bg = scratch(0, C);
                      float* by = scratch(1, C);
                      float* bd = scratch(2, C);
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const float* g = row_in(dout, n * C, C, bg);
                        const float* y = row_in(out, n * C, C, by);
                        float* d = row_out(dx, n * C, C, bd, true);
                        softmax_bwd_n(g, y, dot_n(g, y, C), d, C);
                        row_store(dx, n * C, C, d);
                      }
                    });
}

// logits [N, V], targets [N] i32, loss [N] f32, lse [N] f32
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss, Tensor& loss,
                           Tensor& lse) {
  MT_CHECK(logits.ndim() >= 1 && is_fb(logits.dtype()) && logits.dim(-1) > 0,
           "cpu cross_entropy_forward: logits " + logits.str());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(loss.dtype() == DType::f32 && loss.numel() == N && lse.dtype() == DType::f32 &&
               lse.numel() == N,
           "cpu cross_entropy_forward: logits " + logits.str() + ", loss " + loss.str() + ", lse " +
               lse.str() + " (loss and lse must be f32 [N])");
  check_targets("cross_entropy_forward", targets, N, V);
  const int32_t* tg = targets.ptr<const int32_t>();
  float* lo = loss.ptr<float>();
  float* ls = lse.ptr<float>();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kCeRows),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      float* bx = scratch(0, V);
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const float* x = row_in(logits, n * V, V, bx);
                        const float m = max_n(x, V);
                        const float l = m + std::log(sum_exp_n(x, m, V));
                        ls[n] = l;
                        lo[n] = tg[n] < 0 ? 0.f : l - x[tg[n]] + z_loss * l * l;
                      }
                    });
}

// dlogits [N, V] += dloss[n] * (softmax(logits[n]) * (1 + 2 z_loss lse[n]) - onehot(target))
void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                            const Tensor& lse, float z_loss, Tensor& dlogits) {
  MT_CHECK(logits.ndim() >= 1 && is_fb(logits.dtype()) && logits.dim(-1) > 0 &&
               is_fb(dlogits.dtype()) && dlogits.numel() == logits.numel(),
           "cpu cross_entropy_backward: logits " + logits.str() + ", dlogits " + dlogits.str());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(
      is_fb(dloss.dtype()) && dloss.numel() == N && lse.dtype() == DType::f32 && lse.numel() == N,
      "cpu cross_entropy_backward: logits " + logits.str() + ", dloss " + dloss.str() + ", lse " +
          lse.str() + " (dloss [N], lse f32 [N])");
  check_targets("cross_entropy_backward", targets, N, V);
  const int32_t* tg = targets.ptr<const int32_t>();
  const float* ls = lse.ptr<const float>();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kCeRows),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      float* bx = scratch(0, V);
                      float* bd = scratch(1, V);
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const int32_t t = tg[n];
                        if (t < 0) continue;  // ignored row: no gradient
                        const float g = scalar_at(dloss, n);
                        const float l = ls[n];
                        const float* x = row_in(logits, n * V, V, bx);
                        float* d = row_out(dlogits, n * V, V, bd, true);
                        ce_bwd_n(x, l, g * (1.f + 2.f * z_loss * l), d, V);
                        d[t] -= g;
                        row_store(dlogits, n * V, V, d);
                      }
                    });
}

}  // namespace mt::cpu
