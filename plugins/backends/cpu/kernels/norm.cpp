// norm: rmsnorm (optionally with Gemma's `1 + w`) and layernorm (optional bias), forward and
// backward.
//
// Rows are independent in the forward; the backward's weight gradients are summed over rows in
// fixed blocks of rows (the block size depends only on N), each block writing its own partial,
// and the partials are then added in block order: the result does not depend on scheduling or
// on the thread count. bf16 rows are converted into thread-local f32 scratch.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

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

constexpr int64_t kRowGrain = 8;     // rows per task in the forward / dx pass
constexpr int64_t kMaxBlocks = 256;  // at most this many weight-gradient partials
constexpr int64_t kMinBlockRows = 32;
constexpr int64_t kColChunk = 512;  // columns per task when adding the partials

// scratch() slots: 0..2 belong to task bodies (which never nest parallel work); 4..7 to the
// thread that called the kernel, for the whole call (weights, partial sums shared by tasks): the
// public kernels run isolated (tbb::this_task_arena::isolate), so while that thread waits for
// its loops it cannot pick up an unrelated task that calls a norm kernel and reuses them.

// ---- vectorised row loops: 16 explicit lanes keep the summation order fixed -----------------
MT_CLONES float sum_n(const float* x, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j];
  for (; i < n; ++i) acc[i & 15] += x[i];
  float s = 0;
  for (float a : acc) s += a;
  return s;
}
MT_CLONES float dot3_n(const float* a, const float* b, const float* c, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j] * c[i + j];
  for (; i < n; ++i) acc[i & 15] += a[i] * b[i] * c[i];
  float s = 0;
  for (float v : acc) s += v;
  return s;
}
// sum(a * b * (x - m))
MT_CLONES float dot3m_n(const float* a, const float* b, const float* x, float m, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j] * (x[i + j] - m);
  for (; i < n; ++i) acc[i & 15] += a[i] * b[i] * (x[i] - m);
  float s = 0;
  for (float v : acc) s += v;
  return s;
}
// sum((x - m)^2)
MT_CLONES float sq_dev_n(const float* x, float m, int64_t n) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += (x[i + j] - m) * (x[i + j] - m);
  for (; i < n; ++i) acc[i & 15] += (x[i] - m) * (x[i] - m);
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

// o = x * r * w
MT_CLONES void rms_fwd_n(const float* x, const float* w, float r, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] * r * w[i];
}
// dx += r * dout * w - c * x;  dwp += dout * x * r
MT_CLONES void rms_bwd_n(const float* dout, const float* x, const float* w, float r, float c,
                         float* dx, float* dwp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dx[i] += r * dout[i] * w[i] - c * x[i];
    dwp[i] += dout[i] * x[i] * r;
  }
}
// o = (x - m) * r * w + b
MT_CLONES void ln_fwd_n(const float* x, float m, float r, const float* w, const float* b, float* o,
                        int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = (x[i] - m) * r * w[i] + b[i];
}
// xhat = (x - m) r;  dx += r (dout w - s1) - r xhat s2;  dwp += dout xhat;  dbp += dout
MT_CLONES void ln_bwd_n(const float* dout, const float* x, const float* w, float m, float r,
                        float s1, float s2, float* dx, float* dwp, float* dbp, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float xhat = (x[i] - m) * r;
    dx[i] += r * (dout[i] * w[i] - s1 - xhat * s2);
    dwp[i] += dout[i] * xhat;
    dbp[i] += dout[i];
  }
}

// Fixed row blocking of the weight-gradient reduction: a function of N only.
int64_t block_rows(int64_t N) {
  return std::max(kMinBlockRows, (N + kMaxBlocks - 1) / kMaxBlocks);
}

// The backward's row loop: f(blk, n0, n1, bg, bx, bd) for each of the nblocks fixed blocks of
// brows rows, [n0, n1) its rows and bg, bx, bd the task's D-float scratch (slots 0..2). One block
// per task (simple_partitioner, grain 1), so each block's partial is summed by one thread in row
// order whatever the schedule.
template <class F>
void for_row_blocks(int64_t N, int64_t D, int64_t brows, int64_t nblocks, F&& f) {
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, nblocks, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        float* bg = scratch(0, D);
        float* bx = scratch(1, D);
        float* bd = scratch(2, D);
        for (int64_t blk = r.begin(); blk < r.end(); ++blk)
          f(blk, blk * brows, std::min(N, (blk + 1) * brows), bg, bx, bd);
      },
      tbb::simple_partitioner());
}

// g [D] += (sum over blocks, in order, of partial[b][0..D))
void add_partials(const float* partial, int64_t nblocks, int64_t D, Tensor& g) {
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, D, kColChunk),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      const int64_t c0 = r.begin(), len = r.end() - r.begin();
                      // The blocks' sum first, then added to g once: a gradient accumulated
                      // over micro-batches is the micro-batches' sums added, as data
                      // parallelism's ranks add them.
                      float* sum = scratch(1, len);
                      std::copy_n(partial + c0, len, sum);
                      for (int64_t b = 1; b < nblocks; ++b) {
                        const float* p = partial + b * D + c0;
                        for (int64_t j = 0; j < len; ++j) sum[j] += p[j];
                      }
                      float* buf = scratch(0, len);
                      float* dst = row_out(g, c0, len, buf, true);
                      for (int64_t j = 0; j < len; ++j) dst[j] += sum[j];
                      row_store(g, c0, len, dst);
                    });
}

void check_stat(const char* op, const char* what, const Tensor& t, int64_t N) {
  MT_CHECK(t.dtype() == DType::f32 && t.numel() == N, std::string("cpu ") + op + ": " + what +
                                                          " must be f32 with " + std::to_string(N) +
                                                          " elements, got " + t.str());
}

}  // namespace

// x [N, D], w [D], out [N, D], rstd [N] f32
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out,
                     Tensor& rstd) {
  MT_CHECK(x.ndim() >= 1 && is_fb(x.dtype()) && is_fb(w.dtype()) && is_fb(out.dtype()) &&
               w.numel() == x.dim(-1) && out.numel() == x.numel(),
           "cpu rmsnorm_forward: x " + x.str() + ", w " + w.str() + ", out " + out.str());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  check_stat("rmsnorm_forward", "rstd", rstd, N);
  tbb::this_task_arena::isolate([&] {
    float* wv = scratch(4, D);  // effective weight, once per call
    const float* wr = row_in(w, 0, D, wv);
    for (int64_t i = 0; i < D; ++i) wv[i] = plus_one ? 1.f + wr[i] : wr[i];
    float* rs = rstd.ptr<float>();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kRowGrain),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        float* bx = scratch(0, D);
                        float* bo = scratch(1, D);
                        for (int64_t n = r.begin(); n < r.end(); ++n) {
                          const float* xr = row_in(x, n * D, D, bx);
                          const float inv = 1.f / std::sqrt(dot_n(xr, xr, D) / float(D) + eps);
                          rs[n] = inv;
                          float* o = row_out(out, n * D, D, bo, false);
                          rms_fwd_n(xr, wv, inv, o, D);
                          row_store(out, n * D, D, o);
                        }
                      });
  });
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool plus_one, Tensor& dx, Tensor& dw) {
  MT_CHECK(x.ndim() >= 1 && is_fb(x.dtype()) && is_fb(w.dtype()) && is_fb(dout.dtype()) &&
               is_fb(dx.dtype()) && is_fb(dw.dtype()) && w.numel() == x.dim(-1) &&
               dw.numel() == w.numel() && dout.numel() == x.numel() && dx.numel() == x.numel(),
           "cpu rmsnorm_backward: dout " + dout.str() + ", x " + x.str() + ", w " + w.str() +
               ", dx " + dx.str() + ", dw " + dw.str());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  check_stat("rmsnorm_backward", "rstd", rstd, N);
  if (N == 0) return;
  tbb::this_task_arena::isolate([&] {
    float* wv = scratch(4, D);
    const float* wr = row_in(w, 0, D, wv);
    for (int64_t i = 0; i < D; ++i) wv[i] = plus_one ? 1.f + wr[i] : wr[i];
    const float* rs = rstd.ptr<const float>();
    const int64_t brows = block_rows(N), nblocks = (N + brows - 1) / brows;
    float* partial = scratch(6, nblocks * D);  // [nblocks, D], each block zeroes its own row
    for_row_blocks(N, D, brows, nblocks,
                   [&](int64_t b, int64_t n0, int64_t n1, float* bg, float* bx, float* bd) {
                     float* dwp = partial + b * D;
                     std::fill_n(dwp, D, 0.f);
                     for (int64_t n = n0; n < n1; ++n) {
                       const float* g = row_in(dout, n * D, D, bg);
                       const float* xr = row_in(x, n * D, D, bx);
                       const float inv = rs[n];
                       // d/dx of x * inv * w: inv * g w - x * inv^3 * sum(g w x) / D
                       const float c = inv * inv * inv * dot3_n(g, wv, xr, D) / float(D);
                       float* d = row_out(dx, n * D, D, bd, true);
                       rms_bwd_n(g, xr, wv, inv, c, d, dwp, D);
                       row_store(dx, n * D, D, d);
                     }
                   });
    add_partials(partial, nblocks, D, dw);
  });
}

// x [N, D], w [D], b [D] or undefined, out [N, D], mean [N] f32, rstd [N] f32
void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out,
                       Tensor& mean, Tensor& rstd) {
  MT_CHECK(x.ndim() >= 1 && is_fb(x.dtype()) && is_fb(w.dtype()) && is_fb(out.dtype()) &&
               w.numel() == x.dim(-1) && out.numel() == x.numel() &&
               (!b.defined() || (is_fb(b.dtype()) && b.numel() == w.numel())),
           "cpu layernorm_forward: x " + x.str() + ", w " + w.str() + ", b " +
               (b.defined() ? b.str() : std::string("none")) + ", out " + out.str());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  check_stat("layernorm_forward", "mean", mean, N);
  check_stat("layernorm_forward", "rstd", rstd, N);
  tbb::this_task_arena::isolate([&] {
    float* wv = scratch(4, D);
    float* bv = scratch(5, D);
    const float* wr = row_in(w, 0, D, wv);
    if (wr != wv) std::copy_n(wr, D, wv);
    if (b.defined()) {
      const float* br = row_in(b, 0, D, bv);
      if (br != bv) std::copy_n(br, D, bv);
    } else {
      std::fill_n(bv, D, 0.f);
    }
    float* ms = mean.ptr<float>();
    float* rs = rstd.ptr<float>();
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kRowGrain),
                      [&](const tbb::blocked_range<int64_t>& r) {
                        float* bx = scratch(0, D);
                        float* bo = scratch(1, D);
                        for (int64_t n = r.begin(); n < r.end(); ++n) {
                          const float* xr = row_in(x, n * D, D, bx);
                          const float m = sum_n(xr, D) / float(D);
                          // Two passes (mean, then squared deviations): no cancellation.
                          const float inv = 1.f / std::sqrt(sq_dev_n(xr, m, D) / float(D) + eps);
                          ms[n] = m;
                          rs[n] = inv;
                          float* o = row_out(out, n * D, D, bo, false);
                          ln_fwd_n(xr, m, inv, wv, bv, o, D);
                          row_store(out, n * D, D, o);
                        }
                      });
  });
}

void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  MT_CHECK(x.ndim() >= 1 && is_fb(x.dtype()) && is_fb(w.dtype()) && is_fb(dout.dtype()) &&
               is_fb(dx.dtype()) && is_fb(dw.dtype()) && w.numel() == x.dim(-1) &&
               dw.numel() == w.numel() && dout.numel() == x.numel() && dx.numel() == x.numel() &&
               (!db.defined() || (is_fb(db.dtype()) && db.numel() == w.numel())),
           "cpu layernorm_backward: dout " + dout.str() + ", x " + x.str() + ", w " + w.str() +
               ", dx " + dx.str() + ", dw " + dw.str());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  check_stat("layernorm_backward", "mean", mean, N);
  check_stat("layernorm_backward", "rstd", rstd, N);
  if (N == 0) return;
  tbb::this_task_arena::isolate([&] {
    float* wv = scratch(4, D);
    const float* wr = row_in(w, 0, D, wv);
    if (wr != wv) std::copy_n(wr, D, wv);
    const float* ms = mean.ptr<const float>();
    const float* rs = rstd.ptr<const float>();
    const int64_t brows = block_rows(N), nblocks = (N + brows - 1) / brows;
    float* pw = scratch(6, nblocks * D);  // [nblocks, D] partials of dw and db
    float* pb = scratch(7, nblocks * D);
    for_row_blocks(N, D, brows, nblocks,
                   [&](int64_t blk, int64_t n0, int64_t n1, float* bg, float* bx, float* bd) {
                     float* dwp = pw + blk * D;
                     float* dbp = pb + blk * D;
                     std::fill_n(dwp, D, 0.f);
                     std::fill_n(dbp, D, 0.f);
                     for (int64_t n = n0; n < n1; ++n) {
                       const float* g = row_in(dout, n * D, D, bg);
                       const float* xr = row_in(x, n * D, D, bx);
                       const float m = ms[n], inv = rs[n];
                       // s1 = mean(g w), s2 = mean(g w xhat) with xhat = (x - m) inv
                       const float gw = dot_n(g, wv, D);
                       const float s1 = gw / float(D);
                       const float s2 = inv * dot3m_n(g, wv, xr, m, D) / float(D);
                       float* d = row_out(dx, n * D, D, bd, true);
                       ln_bwd_n(g, xr, wv, m, inv, s1, s2, d, dwp, dbp, D);
                       row_store(dx, n * D, D, d);
                     }
                   });
    add_partials(pw, nblocks, D, dw);
    if (db.defined()) add_partials(pb, nblocks, D, db);
  });
}

}  // namespace mt::cpu
