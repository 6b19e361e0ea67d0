// Mixture-of-experts kernels (top-k routing, gather/scatter of rows, grouped matmul) and the fused
// AdamW update of the CPU backend: forwards against double-precision references written here,
// backwards against central finite differences, bf16 storage, accumulation, determinism and the
// errors a caller gets for bad shapes, indices and offsets.
//
// bf16 tensors are converted on the host (mt::f32_to_bf16 / bf16_to_f32) so these tests depend on
// no kernel besides the ones under test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "mt/error.h"
#include "test_support.h"

namespace mt {
namespace {

using Vec = std::vector<float>;
using DVec = std::vector<double>;
using IVec = std::vector<int32_t>;

// ---- host helpers -----------------------------------------------------------------------------

Tensor make(Backend& b, const Shape& shape, const Vec& v, DType dt = DType::f32) {
  Tensor t = b.empty(shape, dt);
  EXPECT_EQ(static_cast<int64_t>(v.size()), t.numel());
  if (dt == DType::f32) {
    b.copy_from_host(t, v.data());
  } else {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    b.copy_from_host(t, h.data());
  }
  return t;
}

Tensor zeros(Backend& b, const Shape& shape, DType dt = DType::f32) {
  return make(b, shape, Vec(static_cast<size_t>(shape_numel(shape)), 0.f), dt);
}

Vec read(const Tensor& t) {
  Vec out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    t.backend()->copy_to_host(t, out.data());
  } else {
    std::vector<uint16_t> h(out.size());
    t.backend()->copy_to_host(t, h.data());
    for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
  }
  return out;
}

// The raw bytes, for bitwise comparisons.
std::vector<uint8_t> bytes(const Tensor& t) {
  std::vector<uint8_t> out(t.nbytes());
  t.backend()->copy_to_host(t, out.data());
  return out;
}

Vec round_bf16(Vec v) {
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

Vec to_f(const DVec& v) {
  return Vec(v.begin(), v.end());
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * b[i];
  return s;
}

IVec random_ints(size_t n, int32_t hi, std::mt19937_64& rng) {
  std::uniform_int_distribution<int32_t> d(0, hi - 1);
  IVec v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

#define MT_SEED_TRACE()                                  \
  const uint64_t seed_ = test::seed();                   \
  SCOPED_TRACE("MT_TEST_SEED=" + std::to_string(seed_)); \
  std::mt19937_64 rng(seed_)

// ---- top-k routing ----------------------------------------------------------------------------

// Scores of one row in double.
DVec scores_ref(const double* logits, int64_t E, bool sigmoid) {
  DVec s(static_cast<size_t>(E));
  if (sigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.0 / (1.0 + std::exp(-logits[e]));
    return s;
  }
  double mx = *std::max_element(logits, logits + E), sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(logits[e] - mx));
  for (auto& x : s) x /= sum;
  return s;
}

// Routing weights of every row for a fixed selection, in double.
DVec weights_ref(const DVec& logits, const IVec& idx, int64_t N, int64_t E, int k, bool sigmoid,
                 bool normalize) {
  DVec w(static_cast<size_t>(N * k));
  for (int64_t n = 0; n < N; ++n) {
    const DVec s = scores_ref(logits.data() + n * E, E, sigmoid);
    double total = 0;
    for (int j = 0; j < k; ++j) total += (w[n * k + j] = s[idx[n * k + j]]);
    if (normalize)
      for (int j = 0; j < k; ++j) w[n * k + j] /= total;
  }
  return w;
}

struct Route {
  Tensor weights, indices, probs;
};

Route route(Backend& b, const Tensor& logits, int k, bool sigmoid, bool normalize) {
  const int64_t E = logits.dim(-1), N = logits.numel() / E;
  Route r{b.empty({N, k}, DType::f32), b.empty({N, k}, DType::i32), b.empty({N, E}, DType::f32)};
  b.topk_route_forward(logits, k, sigmoid, normalize, r.weights, r.indices, r.probs);
  return r;
}

struct RouteCase {
  int64_t N, E;
  int k;
};
const RouteCase kRouteCases[] = {{1, 1, 1}, {7, 5, 2}, {13, 64, 6}, {3, 8, 8}, {33, 16, 1}};

TEST(TopkRoute, ForwardMatchesDoubleReference) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (const auto& c : kRouteCases)
    for (bool sigmoid : {false, true})
      for (bool normalize : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "N=" << c.N << " E=" << c.E << " k=" << c.k
                                          << " sigmoid=" << sigmoid << " normalize=" << normalize);
        const Vec logits = test::randn(static_cast<size_t>(c.N * c.E), rng, 2.f);
        const Route r = route(b, make(b, {c.N, c.E}, logits), c.k, sigmoid, normalize);
        const Vec probs = read(r.probs), w = read(r.weights);
        const IVec idx = test::to_ints(r.indices);
        const DVec dl(logits.begin(), logits.end());
        DVec pref;
        for (int64_t n = 0; n < c.N; ++n) {
          const DVec s = scores_ref(dl.data() + n * c.E, c.E, sigmoid);
          pref.insert(pref.end(), s.begin(), s.end());
          // The selection is the k largest of the kernel's own scores in descending order, ties
          // to the lower index (ranking the kernel's f32 scores keeps near-ties out of the test).
          IVec order(static_cast<size_t>(c.E));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t bb) {
            return probs[n * c.E + a] > probs[n * c.E + bb];
          });
          for (int j = 0; j < c.k; ++j) ASSERT_EQ(idx[n * c.k + j], order[j]) << "row " << n;
        }
        EXPECT_LT(test::max_rel_err(probs, to_f(pref), 1e-6), 1e-5);
        const DVec wref = weights_ref(dl, idx, c.N, c.E, c.k, sigmoid, normalize);
        EXPECT_LT(test::max_rel_err(w, to_f(wref), 1e-6), 1e-5);
      }
}

TEST(TopkRoute, TiesGoToTheLowerIndex) {
  Backend& b = test::cpu();
  for (bool sigmoid : {false, true}) {
    const Route r =
        route(b, make(b, {2, 6}, {1, 3, 3, 0, 3, -1, 2, 2, 2, 2, 2, 2}), 3, sigmoid, true);
    EXPECT_EQ(test::to_ints(r.indices), (IVec{1, 2, 4, 0, 1, 2}));
    const Vec w = read(r.weights);
    for (int j = 0; j < 6; ++j) EXPECT_NEAR(w[j], 1.0 / 3.0, 1e-6);
  }
}

TEST(TopkRoute, BackwardMatchesFiniteDifferences) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (const auto& c : kRouteCases)
    for (bool sigmoid : {false, true})
      for (bool normalize : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "N=" << c.N << " E=" << c.E << " k=" << c.k
                                          << " sigmoid=" << sigmoid << " normalize=" << normalize);
        const int64_t N = c.N, E = c.E;
        const int k = c.k;
        const Vec logits = test::randn(static_cast<size_t>(N * E), rng, 2.f);
        const Vec dw = test::randn(static_cast<size_t>(N * k), rng);
        const Vec init = test::randn(static_cast<size_t>(N * E), rng);
        const Route r = route(b, make(b, {N, E}, logits), k, sigmoid, normalize);
        const IVec idx = test::to_ints(r.indices);
        Tensor dlogits = make(b, {N, E}, init);
        b.topk_route_backward(make(b, {N, k}, dw), r.weights, r.indices, r.probs, sigmoid,
                              normalize, dlogits);
        Vec grad = read(dlogits);
        for (size_t i = 0; i < grad.size(); ++i) grad[i] -= init[i];  // it accumulated

        // L = sum dw * weights with the selection held fixed, differentiated in double.
        const DVec dl(logits.begin(), logits.end());
        auto loss = [&](const DVec& x) {
          const DVec w = weights_ref(x, idx, N, E, k, sigmoid, normalize);
          double s = 0;
          for (size_t i = 0; i < w.size(); ++i) s += dw[i] * w[i];
          return s;
        };
        DVec fd(dl.size());
        for (size_t i = 0; i < dl.size(); ++i) {
          const double h = 1e-5;
          DVec xp = dl, xm = dl;
          xp[i] += h;
          xm[i] -= h;
          fd[i] = (loss(xp) - loss(xm)) / (2 * h);
        }
        EXPECT_LT(test::max_rel_err(grad, to_f(fd), 1e-2), 1e-4);

        // And the kernel against its own f32 forward: perturbations small enough to keep the
        // selection (a coordinate where it flips is skipped).
        int checked = 0;
        for (size_t i = 0; i < logits.size(); ++i) {
          const float h = 1e-2f;
          Vec xp = logits, xm = logits;
          xp[i] += h;
          xm[i] -= h;
          const Route rp = route(b, make(b, {N, E}, xp), k, sigmoid, normalize);
          const Route rm = route(b, make(b, {N, E}, xm), k, sigmoid, normalize);
          if (test::to_ints(rp.indices) != idx || test::to_ints(rm.indices) != idx) continue;
          const double g = (dot(dw, read(rp.weights)) - dot(dw, read(rm.weights))) /
                           (double(xp[i]) - double(xm[i]));
          EXPECT_NEAR(grad[i], g, 1e-3 + 1e-2 * std::fabs(g)) << "logit " << i;
          ++checked;
        }
        EXPECT_GT(checked, static_cast<int>(logits.size()) / 2);
      }
}

TEST(TopkRoute, Bf16LogitsAndGradients) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t N = 9, E = 12;
  const int k = 3;
  const Vec logits = round_bf16(test::randn(static_cast<size_t>(N * E), rng, 2.f));
  const Vec dw = round_bf16(test::randn(static_cast<size_t>(N * k), rng));
  const Vec init = round_bf16(test::randn(static_cast<size_t>(N * E), rng));
  for (bool sigmoid : {false, true}) {
    const Route r32 = route(b, make(b, {N, E}, logits), k, sigmoid, true);
    const Route r16 = route(b, make(b, {N, E}, logits, DType::bf16), k, sigmoid, true);
    // bf16 is storage only: same values in, the same f32 arithmetic.
    EXPECT_EQ(bytes(r32.probs), bytes(r16.probs));
    EXPECT_EQ(bytes(r32.weights), bytes(r16.weights));
    EXPECT_EQ(bytes(r32.indices), bytes(r16.indices));
    Tensor g32 = zeros(b, {N, E});
    Tensor g16 = make(b, {N, E}, init, DType::bf16);
    b.topk_route_backward(make(b, {N, k}, dw), r32.weights, r32.indices, r32.probs, sigmoid, true,
                          g32);
    b.topk_route_backward(make(b, {N, k}, dw, DType::bf16), r16.weights, r16.indices, r16.probs,
                          sigmoid, true, g16);
    const Vec g = read(g32);
    // The same f32 gradient added to the bf16 values and rounded once.
    Vec want(g.size());
    for (size_t i = 0; i < g.size(); ++i) want[i] = init[i] + g[i];
    EXPECT_EQ(read(g16), round_bf16(want));
  }
}

TEST(TopkRoute, Errors) {
  Backend& b = test::cpu();
  Tensor logits = zeros(b, {4, 6});
  Tensor w = b.empty({4, 2}, DType::f32), i = b.empty({4, 2}, DType::i32),
         p = b.empty({4, 6}, DType::f32);
  EXPECT_THROW(b.topk_route_forward(logits, 0, false, false, w, i, p), Error);
  Tensor w7 = b.empty({4, 7}, DType::f32), i7 = b.empty({4, 7}, DType::i32);
  EXPECT_THROW(b.topk_route_forward(logits, 7, false, false, w7, i7, p), Error);
  EXPECT_THROW(b.topk_route_forward(logits, 3, false, false, w, i, p), Error);  // [4, 2] for k 3
  Tensor i_f = b.empty({4, 2}, DType::f32);
  EXPECT_THROW(b.topk_route_forward(logits, 2, false, false, w, i_f, p), Error);
  Tensor bad_idx = test::from_ints(b, {4, 2}, {0, 1, 2, 3, 4, 5, 6, 0});  // 6 is not < E
  Tensor dl = zeros(b, {4, 6});
  EXPECT_THROW(b.topk_route_backward(zeros(b, {4, 2}), zeros(b, {4, 2}), bad_idx, zeros(b, {4, 6}),
                                     false, false, dl),
               Error);
  try {
    b.topk_route_forward(logits, 9, true, false, w, i, p);
    FAIL() << "expected mt::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("topk_route_forward"), std::string::npos) << e.what();
  }
}

// ---- gather / scatter -------------------------------------------------------------------------

TEST(GatherScatter, GatherCopiesRows) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (DType xt : {DType::f32, DType::bf16})
    for (DType ot : {DType::f32, DType::bf16}) {
      const int64_t N = 11, D = 13, M = 29;
      const Vec x = round_bf16(test::randn(static_cast<size_t>(N * D), rng));
      const IVec idx = random_ints(static_cast<size_t>(M), static_cast<int32_t>(N), rng);
      Tensor out = b.empty({M, D}, ot);
      b.gather_rows(make(b, {N, D}, x, xt), test::from_ints(b, {M}, idx), out);
      Vec want;
      for (int32_t i : idx) want.insert(want.end(), x.begin() + i * D, x.begin() + (i + 1) * D);
      EXPECT_EQ(read(out), want);  // bf16-representable values survive every conversion
    }
  // Empty selection and zero-width rows.
  Tensor none = b.empty({0, 4}, DType::f32);
  b.gather_rows(zeros(b, {3, 4}), test::from_ints(b, {0}, {}), none);
  Tensor thin = b.empty({2, 0}, DType::f32);
  b.gather_rows(zeros(b, {3, 0}), test::from_ints(b, {2}, {2, 0}), thin);
}

// scatter_rows writes the named rows (distinct, in random order) and leaves the others; the SDK's
// default (gather, subtract, add) gives the same bits. Large enough for the CPU's column tasks.
TEST(GatherScatter, ScatterRowsOverwritesTheNamedRows) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (int64_t D : {int64_t{13}, int64_t{1000}})
    for (DType st : {DType::f32, DType::bf16})
      for (DType ot : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(::testing::Message()
                     << "D=" << D << " src " << dtype_name(st) << " out " << dtype_name(ot));
        const int64_t N = 131, M = 97;
        const Vec src = round_bf16(test::randn(static_cast<size_t>(M * D), rng));
        const Vec init = round_bf16(test::randn(static_cast<size_t>(N * D), rng));
        IVec rows(static_cast<size_t>(N));
        for (int32_t i = 0; i < N; ++i) rows[static_cast<size_t>(i)] = i;
        std::shuffle(rows.begin(), rows.end(), rng);
        const IVec idx(rows.begin(), rows.begin() + M);  // distinct; 34 rows untouched
        Vec want = init;
        for (int64_t m = 0; m < M; ++m)
          std::copy(src.begin() + m * D, src.begin() + (m + 1) * D, want.begin() + idx[m] * D);
        Tensor out = make(b, {N, D}, init, ot);
        b.scatter_rows(make(b, {M, D}, src, st), test::from_ints(b, {M}, idx), out);
        EXPECT_EQ(read(out), want);  // bf16-representable values survive every conversion
        Tensor by_default = make(b, {N, D}, init, ot);
        b.Backend::scatter_rows(make(b, {M, D}, src, st), test::from_ints(b, {M}, idx), by_default);
        EXPECT_EQ(read(by_default), want);
      }
  // Nothing to write, zero-width rows, and a [B, S, H, D] cache viewed as rows.
  Tensor keep = make(b, {3, 4}, Vec(12, 2.f));
  b.scatter_rows(b.empty({0, 4}, DType::f32), test::from_ints(b, {0}, {}), keep);
  EXPECT_EQ(read(keep), Vec(12, 2.f));
  Tensor thin = b.empty({3, 0}, DType::f32);
  b.scatter_rows(b.empty({2, 0}, DType::f32), test::from_ints(b, {2}, {2, 0}), thin);
}

TEST(GatherScatter, ScatterAddMatchesDoubleReference) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (bool weighted : {false, true})
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << "weighted=" << weighted << " dtype=" << dtype_name(dt));
      const int64_t N = 17, D = 33, M = 61;  // duplicates and rows nobody writes
      const Vec src = round_bf16(test::randn(static_cast<size_t>(M * D), rng));
      const Vec w = test::randn(static_cast<size_t>(M), rng);
      const Vec init = round_bf16(test::randn(static_cast<size_t>(N * D), rng));
      const IVec idx =
          random_ints(static_cast<size_t>(M), 13, rng);  // rows 13..16 stay as they are
      Tensor out = make(b, {N, D}, init, dt);
      b.scatter_add_rows(make(b, {M, D}, src, dt), test::from_ints(b, {M}, idx),
                         weighted ? make(b, {M}, w) : Tensor(), out);
      DVec want(init.begin(), init.end());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t d = 0; d < D; ++d)
          want[idx[m] * D + d] += (weighted ? double(w[m]) : 1.0) * src[m * D + d];
      const Vec got = read(out);
      EXPECT_LT(test::max_rel_err(got, to_f(want), 1e-1), dt == DType::f32 ? 1e-5 : 1e-2);
      for (int64_t i = 13 * D; i < N * D; ++i) ASSERT_EQ(got[i], init[i]);
    }
}

// gather_rows and scatter_add_rows are each other's backward: check both against central
// differences of L = <c, op(input)> (linear, so h can be large and the differences exact up to
// f32 rounding).
TEST(GatherScatter, BackwardsMatchFiniteDifferences) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t N = 7, D = 5, M = 12;
  const IVec idx = random_ints(static_cast<size_t>(M), static_cast<int32_t>(N), rng);
  const Tensor idx_t = test::from_ints(b, {M}, idx);
  const float h = 0.5f;

  {  // gather: dx = scatter_add(c, idx)
    const Vec x = test::randn(static_cast<size_t>(N * D), rng);
    const Vec c = test::randn(static_cast<size_t>(M * D), rng);
    Tensor dx = zeros(b, {N, D});
    b.scatter_add_rows(make(b, {M, D}, c), idx_t, Tensor(), dx);
    const Vec grad = read(dx);
    auto loss = [&](const Vec& xv) {
      Tensor out = b.empty({M, D}, DType::f32);
      b.gather_rows(make(b, {N, D}, xv), idx_t, out);
      return dot(c, read(out));
    };
    for (size_t i = 0; i < x.size(); ++i) {
      Vec xp = x, xm = x;
      xp[i] += h;
      xm[i] -= h;
      EXPECT_NEAR(grad[i], (loss(xp) - loss(xm)) / (double(xp[i]) - xm[i]), 1e-4) << i;
    }
  }
  {  // scatter with weights: dsrc[m] = w[m] * gather(c)[m], dw[m] = <gather(c)[m], src[m]>
    const Vec src = test::randn(static_cast<size_t>(M * D), rng);
    const Vec w = test::randn(static_cast<size_t>(M), rng);
    const Vec c = test::randn(static_cast<size_t>(N * D), rng);
    Tensor gc = b.empty({M, D}, DType::f32);
    b.gather_rows(make(b, {N, D}, c), idx_t, gc);
    const Vec g = read(gc);
    auto loss = [&](const Vec& sv, const Vec& wv) {
      Tensor out = zeros(b, {N, D});
      b.scatter_add_rows(make(b, {M, D}, sv), idx_t, make(b, {M}, wv), out);
      return dot(c, read(out));
    };
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t d = 0; d < D; ++d) {
        Vec sp = src, sm = src;
        sp[m * D + d] += h;
        sm[m * D + d] -= h;
        const double fd = (loss(sp, w) - loss(sm, w)) / (double(sp[m * D + d]) - sm[m * D + d]);
        EXPECT_NEAR(w[m] * g[m * D + d], fd, 1e-4 * (1 + std::fabs(fd)));
      }
      Vec wp = w, wm = w;
      wp[m] += h;
      wm[m] -= h;
      const double fd = (loss(src, wp) - loss(src, wm)) / (double(wp[m]) - wm[m]);
      double want = 0;
      for (int64_t d = 0; d < D; ++d) want += double(g[m * D + d]) * src[m * D + d];
      EXPECT_NEAR(want, fd, 1e-4 * (1 + std::fabs(fd)));
    }
  }
}

TEST(GatherScatter, Errors) {
  Backend& b = test::cpu();
  Tensor x = zeros(b, {4, 3}), out = b.empty({2, 3}, DType::f32);
  EXPECT_THROW(b.gather_rows(x, test::from_ints(b, {2}, {0, 4}), out), Error);
  EXPECT_THROW(b.gather_rows(x, test::from_ints(b, {2}, {-1, 0}), out), Error);
  EXPECT_THROW(b.gather_rows(x, test::from_ints(b, {3}, {0, 1, 2}), out), Error);  // out rows
  Tensor wide = b.empty({2, 4}, DType::f32);
  EXPECT_THROW(b.gather_rows(x, test::from_ints(b, {2}, {0, 1}), wide), Error);
  Tensor dst = zeros(b, {4, 3});
  EXPECT_THROW(b.scatter_add_rows(zeros(b, {2, 3}), test::from_ints(b, {2}, {0, 9}), Tensor(), dst),
               Error);
  EXPECT_THROW(
      b.scatter_add_rows(zeros(b, {2, 3}), test::from_ints(b, {2}, {0, 1}), zeros(b, {3}), dst),
      Error);
  EXPECT_THROW(b.scatter_rows(zeros(b, {2, 3}), test::from_ints(b, {2}, {0, 4}), dst), Error);
  EXPECT_THROW(b.scatter_rows(zeros(b, {2, 3}), test::from_ints(b, {2}, {-1, 0}), dst), Error);
  EXPECT_THROW(b.scatter_rows(zeros(b, {3, 3}), test::from_ints(b, {2}, {0, 1}), dst), Error);
  EXPECT_THROW(b.scatter_rows(zeros(b, {2, 4}), test::from_ints(b, {2}, {0, 1}), dst), Error);
  EXPECT_EQ(read(dst), Vec(12, 0.f));  // every refused call left it alone
  try {
    b.scatter_rows(zeros(b, {2, 3}), test::from_ints(b, {2}, {1, 9}), dst);
    FAIL() << "expected mt::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("scatter_rows"), std::string::npos) << msg;
    EXPECT_NE(msg.find("idx[1] = 9"), std::string::npos) << msg;
  }
  try {
    b.gather_rows(x, test::from_ints(b, {2}, {0, 7}), out);
    FAIL() << "expected mt::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("gather_rows"), std::string::npos) << msg;
    EXPECT_NE(msg.find("7"), std::string::npos) << msg;
  }
}

// ---- grouped matmul ---------------------------------------------------------------------------

// Reference of one grouped matmul in double: out[M, N] and, per element, the sum of |terms| (the
// scale its f32 rounding error is measured against).
struct GmmRef {
  DVec out, scale;
};

// w is [E, K, N] (or [E, N, K] when trans_w); W_e[k][n] accessed accordingly.
double w_at(const Vec& w, bool trans_w, int64_t e, int64_t kk, int64_t n, int64_t K, int64_t N) {
  return trans_w ? w[(e * N + n) * K + kk] : w[(e * K + kk) * N + n];
}

GmmRef gmm_ref(const Vec& x, const Vec& w, const IVec& off, bool trans_w, int64_t K, int64_t N) {
  const int64_t M = off.back();
  GmmRef r{DVec(static_cast<size_t>(M * N)), DVec(static_cast<size_t>(M * N))};
  for (size_t e = 0; e + 1 < off.size(); ++e)
    for (int64_t m = off[e]; m < off[e + 1]; ++m)
      for (int64_t n = 0; n < N; ++n) {
        double s = 0, a = 0;
        for (int64_t kk = 0; kk < K; ++kk) {
          const double t = x[m * K + kk] * w_at(w, trans_w, static_cast<int64_t>(e), kk, n, K, N);
          s += t;
          a += std::fabs(t);
        }
        r.out[m * N + n] = s;
        r.scale[m * N + n] = a;
      }
  return r;
}

// max |got - want| / (scale + floor): f32 GEMM error relative to the magnitude of its terms.
double scaled_err(const Vec& got, const DVec& want, const DVec& scale, double floor = 1e-3) {
  double m = 0;
  for (size_t i = 0; i < got.size(); ++i)
    m = std::max(m, std::fabs(got[i] - want[i]) / (scale[i] + floor));
  return m;
}

struct GmmCase {
  int64_t K, N;
  IVec offsets;
};
const GmmCase kGmmCases[] = {
    {37, 19, {0, 0, 5, 5, 23, 23}},  // empty first, middle and last groups, odd sizes
    {1, 1, {0, 1}},
    {8, 3, {0, 0, 0}},              // no rows at all
    {96, 200, {0, 130, 131, 300}},  // large enough to be cut into tiles
};

TEST(GroupedMatmul, ForwardMatchesDoubleReference) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (const auto& c : kGmmCases)
    for (bool trans_w : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "K=" << c.K << " N=" << c.N << " trans_w=" << trans_w);
      const int64_t E = static_cast<int64_t>(c.offsets.size()) - 1, M = c.offsets.back();
      const Vec x = test::randn(static_cast<size_t>(M * c.K), rng);
      const Vec w = test::randn(static_cast<size_t>(E * c.K * c.N), rng);
      const Shape ws = trans_w ? Shape{E, c.N, c.K} : Shape{E, c.K, c.N};
      Tensor out =
          make(b, {M, c.N}, test::randn(static_cast<size_t>(M * c.N), rng));  // overwritten
      b.grouped_matmul(make(b, {M, c.K}, x), make(b, ws, w), test::from_ints(b, {E + 1}, c.offsets),
                       trans_w, out);
      const GmmRef r = gmm_ref(x, w, c.offsets, trans_w, c.K, c.N);
      EXPECT_LT(scaled_err(read(out), r.out, r.scale), 1e-5);
    }
}

TEST(GroupedMatmul, Bf16Operands) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t K = 21, N = 34;
  const IVec off{0, 9, 9, 40};
  const int64_t E = 3, M = 40;
  for (bool trans_w : {false, true}) {
    const Vec x = round_bf16(test::randn(static_cast<size_t>(M * K), rng));
    const Vec w = round_bf16(test::randn(static_cast<size_t>(E * K * N), rng));
    const Shape ws = trans_w ? Shape{E, N, K} : Shape{E, K, N};
    const GmmRef r = gmm_ref(x, w, off, trans_w, K, N);
    Tensor out16 = b.empty({M, N}, DType::bf16);
    b.grouped_matmul(make(b, {M, K}, x, DType::bf16), make(b, ws, w, DType::bf16),
                     test::from_ints(b, {E + 1}, off), trans_w, out16);
    EXPECT_LT(scaled_err(read(out16), r.out, r.scale), 4e-3);  // one bf16 rounding of the result
    Tensor out32 = b.empty({M, N}, DType::f32);  // mixed: bf16 weights, f32 activations
    b.grouped_matmul(make(b, {M, K}, x), make(b, ws, w, DType::bf16),
                     test::from_ints(b, {E + 1}, off), trans_w, out32);
    EXPECT_LT(scaled_err(read(out32), r.out, r.scale), 1e-5);

    // Weight gradient accumulated into bf16 storage.
    const Vec dout = round_bf16(test::randn(static_cast<size_t>(M * N), rng));
    const Vec init = round_bf16(test::randn(static_cast<size_t>(E * K * N), rng));
    Tensor dw = make(b, ws, init, DType::bf16);
    b.grouped_matmul_weight_grad(make(b, {M, K}, x, DType::bf16),
                                 make(b, {M, N}, dout, DType::bf16),
                                 test::from_ints(b, {E + 1}, off), trans_w, dw);
    Tensor dw32 = make(b, ws, init);
    b.grouped_matmul_weight_grad(make(b, {M, K}, x), make(b, {M, N}, dout),
                                 test::from_ints(b, {E + 1}, off), trans_w, dw32);
    EXPECT_LT(test::max_rel_err(read(dw), read(dw32), 1.0), 1e-2);
  }
}

// The x gradient is grouped_matmul(dout, w, !trans_w); the weight gradient accumulates
// x_e^T dout_e. Both against central differences of L = <c, grouped_matmul(x, w)> (linear in
// each, so h = 0.5 and the differences are exact up to f32 rounding), and against the double
// reference.
TEST(GroupedMatmul, BackwardMatchesFiniteDifferences) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t K = 7, N = 5;
  const IVec off{0, 3, 3, 8, 11, 11};  // empty middle and last groups
  const int64_t E = 5, M = 11;
  const Tensor off_t = test::from_ints(b, {E + 1}, off);
  for (bool trans_w : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "trans_w=" << trans_w);
    const Shape ws = trans_w ? Shape{E, N, K} : Shape{E, K, N};
    const Vec x = test::randn(static_cast<size_t>(M * K), rng);
    const Vec w = test::randn(static_cast<size_t>(E * K * N), rng);
    const Vec c = test::randn(static_cast<size_t>(M * N), rng);
    auto loss = [&](const Vec& xv, const Vec& wv) {
      Tensor out = b.empty({M, N}, DType::f32);
      b.grouped_matmul(make(b, {M, K}, xv), make(b, ws, wv), off_t, trans_w, out);
      return dot(c, read(out));
    };

    // dx = dout @ W_e^T: the same kernel with the other transpose flag on w.
    Tensor dx = b.empty({M, K}, DType::f32);
    b.grouped_matmul(make(b, {M, N}, c), make(b, ws, w), off_t, !trans_w, dx);
    const Vec gx = read(dx);
    // dw accumulates onto what is there; the empty groups keep it bit for bit.
    const Vec init = test::randn(static_cast<size_t>(E * K * N), rng);
    Tensor dw = make(b, ws, init);
    b.grouped_matmul_weight_grad(make(b, {M, K}, x), make(b, {M, N}, c), off_t, trans_w, dw);
    Vec gw = read(dw);
    for (int64_t e : {1, 4})
      for (int64_t i = e * K * N; i < (e + 1) * K * N; ++i) ASSERT_EQ(gw[i], init[i]);
    for (size_t i = 0; i < gw.size(); ++i) gw[i] -= init[i];

    const float h = 0.5f;
    for (size_t i = 0; i < x.size(); ++i) {
      Vec xp = x, xm = x;
      xp[i] += h;
      xm[i] -= h;
      const double fd = (loss(xp, w) - loss(xm, w)) / (double(xp[i]) - xm[i]);
      EXPECT_NEAR(gx[i], fd, 1e-4 * (1 + std::fabs(fd))) << "x " << i;
    }
    for (size_t i = 0; i < w.size(); ++i) {
      Vec wp = w, wm = w;
      wp[i] += h;
      wm[i] -= h;
      const double fd = (loss(x, wp) - loss(x, wm)) / (double(wp[i]) - wm[i]);
      EXPECT_NEAR(gw[i], fd, 1e-4 * (1 + std::fabs(fd))) << "w " << i;
    }

    // Double reference of both gradients.
    DVec rx(x.size(), 0.0), rw(w.size(), 0.0);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = off[e]; m < off[e + 1]; ++m)
        for (int64_t kk = 0; kk < K; ++kk)
          for (int64_t n = 0; n < N; ++n) {
            const size_t wi =
                static_cast<size_t>(trans_w ? (e * N + n) * K + kk : (e * K + kk) * N + n);
            rx[m * K + kk] += double(c[m * N + n]) * w[wi];
            rw[wi] += double(x[m * K + kk]) * c[m * N + n];
          }
    // Errors relative to the O(1) size of the products summed (results may cancel to near zero);
    // gw also had init added and taken away again.
    EXPECT_LT(test::max_rel_err(gx, to_f(rx), 1.0), 1e-5);
    EXPECT_LT(test::max_rel_err(gw, to_f(rw), 1.0), 1e-5);
  }
}

TEST(GroupedMatmul, Errors) {
  Backend& b = test::cpu();
  Tensor x = zeros(b, {6, 4}), w = zeros(b, {2, 4, 3}), out = b.empty({6, 3}, DType::f32);
  auto gmm = [&](const IVec& off) {
    b.grouped_matmul(x, w, test::from_ints(b, {static_cast<int64_t>(off.size())}, off), false, out);
  };
  EXPECT_NO_THROW(gmm({0, 2, 6}));
  EXPECT_THROW(gmm({0, 4, 2}), Error);     // decreasing
  EXPECT_THROW(gmm({0, 2, 5}), Error);     // last != M
  EXPECT_THROW(gmm({1, 2, 6}), Error);     // first != 0
  EXPECT_THROW(gmm({0, 2, 4, 6}), Error);  // E + 1 entries for E = 2
  EXPECT_THROW(gmm({0, -1, 6}), Error);
  Tensor off = test::from_ints(b, {3}, {0, 2, 6});
  EXPECT_THROW(b.grouped_matmul(x, w, off, true, out), Error);  // [E, N, K] needs K = 3
  EXPECT_THROW(b.grouped_matmul(x, zeros(b, {4, 3}), off, false, out), Error);
  Tensor dw_bad = zeros(b, {2, 3, 4});
  EXPECT_THROW(b.grouped_matmul_weight_grad(x, zeros(b, {6, 3}), off, false, dw_bad), Error);
  Tensor dw = zeros(b, {2, 4, 3});
  EXPECT_THROW(b.grouped_matmul_weight_grad(x, zeros(b, {6, 3}), test::from_ints(b, {3}, {0, 2, 7}),
                                            false, dw),
               Error);
  try {
    gmm({0, 2, 5});
    FAIL() << "expected mt::Error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("grouped_matmul"), std::string::npos) << msg;
    EXPECT_NE(msg.find("5"), std::string::npos) << msg;
  }
}

// ---- AdamW ------------------------------------------------------------------------------------

struct AdamRef {
  DVec p, m, v;
};

void adamw_ref(AdamRef& s, const Vec& grad, const AdamWParams& hp, bool bf16_param) {
  const double bc1 = 1 - std::pow(double(hp.b1), double(hp.step));
  const double bc2 = 1 - std::pow(double(hp.b2), double(hp.step));
  for (size_t i = 0; i < s.p.size(); ++i) {
    const double g = double(grad[i]) * hp.grad_scale;
    s.m[i] = hp.b1 * s.m[i] + (1 - double(hp.b1)) * g;
    s.v[i] = hp.b2 * s.v[i] + (1 - double(hp.b2)) * g * g;
    const double upd = (s.m[i] / bc1) / (std::sqrt(s.v[i] / bc2) + hp.eps);
    s.p[i] = s.p[i] - double(hp.lr) * upd - double(hp.lr) * hp.weight_decay * s.p[i];
    if (bf16_param) s.p[i] = bf16_to_f32(f32_to_bf16(static_cast<float>(s.p[i])));
  }
}

TEST(AdamW, MatchesDoubleReferenceOverThreeSteps) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  for (DType pt : {DType::f32, DType::bf16})
    for (DType gt : {DType::f32, DType::bf16})
      for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{100003}}) {
        SCOPED_TRACE(::testing::Message()
                     << "param " << dtype_name(pt) << " grad " << dtype_name(gt) << " n=" << n);
        const bool p16 = pt == DType::bf16;
        Vec p0 = test::randn(static_cast<size_t>(n), rng);
        if (p16) p0 = round_bf16(p0);
        AdamRef ref{DVec(p0.begin(), p0.end()), DVec(static_cast<size_t>(n), 0.0),
                    DVec(static_cast<size_t>(n), 0.0)};
        Tensor param = make(b, {n}, p0, pt), m = zeros(b, {n}), v = zeros(b, {n});
        AdamWParams hp;
        hp.lr = 1e-2f;
        hp.b1 = 0.9f;
        hp.b2 = 0.95f;
        hp.eps = 1e-8f;
        hp.weight_decay = 0.1f;
        hp.grad_scale = 0.37f;
        int64_t off_by_one = 0;
        for (int64_t step = 1; step <= 3; ++step) {
          hp.step = step;
          Vec g = test::randn(static_cast<size_t>(n), rng, 3.f);
          if (gt == DType::bf16) g = round_bf16(g);
          // bf16 params: the kernel rounds its f32 result, the reference its double one, so they
          // may differ by one ulp where the exact value sits on a rounding midpoint; the reference
          // restarts from the kernel's params each step so that such a difference cannot grow as
          // values move to a finer binade.
          const Vec prev = p16 ? read(param) : Vec();
          if (p16) ref.p.assign(prev.begin(), prev.end());
          b.adamw_update(param, make(b, {n}, g, gt), m, v, hp);
          adamw_ref(ref, g, hp, p16);
          if (!p16) continue;
          const Vec got = read(param);
          for (int64_t i = 0; i < n; ++i) {
            const int d =
                std::abs(int(f32_to_bf16(got[i])) - int(f32_to_bf16(static_cast<float>(ref.p[i]))));
            if (d == 0) continue;
            ++off_by_one;
            // Where p - update cancels to near zero the f32 rounding of the operands (relative to
            // |p| + lr) is many bf16 ulps of the small result.
            const bool cancels =
                std::fabs(got[i] - ref.p[i]) <= 1e-6 * (std::fabs(prev[i]) + hp.lr);
            ASSERT_TRUE(d <= 1 || cancels)
                << "step " << step << " element " << i << ": " << got[i] << " vs " << ref.p[i];
          }
        }
        if (p16)
          EXPECT_LE(off_by_one, n / 1000 + 1);
        else
          EXPECT_LT(test::max_rel_err(read(param), to_f(ref.p), 1e-2), 2e-6);
        EXPECT_LT(test::max_rel_err(read(m), to_f(ref.m), 1e-2), 1e-5);
        EXPECT_LT(test::max_rel_err(read(v), to_f(ref.v), 1e-2), 1e-5);
      }
}

TEST(AdamW, Errors) {
  Backend& b = test::cpu();
  Tensor p = zeros(b, {8}), g = zeros(b, {8}), m = zeros(b, {8}), v = zeros(b, {8});
  AdamWParams hp;
  hp.lr = 1e-3f;
  hp.step = 0;
  EXPECT_THROW(b.adamw_update(p, g, m, v, hp), Error);  // step is 1-based
  hp.step = 1;
  Tensor g7 = zeros(b, {7});
  EXPECT_THROW(b.adamw_update(p, g7, m, v, hp), Error);
  Tensor v16 = zeros(b, {8}, DType::bf16);  // m may be bf16 (mu_dtype), v may not
  EXPECT_THROW(b.adamw_update(p, g, m, v16, hp), Error);
  Tensor pi = b.empty({8}, DType::i32);
  EXPECT_THROW(b.adamw_update(pi, g, m, v, hp), Error);
  EXPECT_NO_THROW(b.adamw_update(p, g, m, v, hp));
}

// mu_dtype=bfloat16: a bf16 first moment gives the update of the f32 one from the same
// (bf16-representable) values, computed in f32, with m stored rounded to bf16; v and the
// parameter are unaffected.
TEST(AdamW, Bf16FirstMomentIsTheF32UpdateRounded) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t n = 1000;  // past the 16-wide vector body, with a tail
  auto round16 = [](std::vector<float> v) {
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
    return v;
  };
  const std::vector<float> p0 = test::randn(n, rng), g0 = test::randn(n, rng);
  const std::vector<float> m0 = round16(test::randn(n, rng, 0.1f));
  std::vector<float> v0 = test::randn(n, rng, 0.1f);
  for (float& x : v0) x = x * x;
  AdamWParams hp;
  hp.lr = 1e-2f;
  hp.weight_decay = 0.1f;
  hp.step = 4;
  Tensor p32 = test::from_vector(b, {n}, p0), m32 = test::from_vector(b, {n}, m0),
         v32 = test::from_vector(b, {n}, v0), g = test::from_vector(b, {n}, g0);
  Tensor p16 = test::from_vector(b, {n}, p0), m16 = test::from_vector(b, {n}, m0, DType::bf16),
         v16 = test::from_vector(b, {n}, v0);
  b.adamw_update(p32, g, m32, v32, hp);
  b.adamw_update(p16, g, m16, v16, hp);
  EXPECT_EQ(test::to_vector(p16), test::to_vector(p32));
  EXPECT_EQ(test::to_vector(v16), test::to_vector(v32));
  EXPECT_EQ(test::to_vector(m16), round16(test::to_vector(m32)));
}

// The AVX-512 update performs the scalar one's f32 operations in its order (no FMA), so every
// kernel set gives the same bits. Run on cpu_x86emu (kernels/x86_simd.h's emulated CPU, which
// always takes the AVX-512 kernel) against the native cpu backend (the scalar kernel on a CPU
// without AVX-512, the native AVX-512 one on a CPU with it), for every dtype mix, a vector body
// with a tail, bf16 rounding midpoints and non-finite gradients.
TEST(AdamW, EveryKernelSetGivesTheSameBits) {
  if (std::string(test::cpu_backend_name()) == "cpu")
    GTEST_SKIP() << "compares the emulated AVX-512 kernel with the native one: runs as "
                    "X86Emu.AdamW.* (MT_TEST_CPU_BACKEND=cpu_x86emu)";
  MT_SEED_TRACE();
  Backend& emu = test::cpu();
  const auto native =
      test::plugins().make_backend("cpu", config_from_pairs({{"num_threads", "2"}}));
  const int64_t n = 16 * 40 + 7;
  Vec p0 = test::randn(static_cast<size_t>(n), rng);
  Vec g0 = test::randn(static_cast<size_t>(n), rng, 3.f);
  Vec m0 = test::randn(static_cast<size_t>(n), rng, 0.1f);
  Vec v0 = test::randn(static_cast<size_t>(n), rng, 0.1f);
  for (float& x : v0) x = x * x;
  // f32 gradients on exact bf16 midpoints (low half 0x8000: step 1 stores them as a bf16 m), and
  // non-finite gradients, in the vector body and the tail.
  for (int64_t i : {int64_t{2}, int64_t{3}, int64_t{300}, n - 2}) {
    uint32_t u;
    std::memcpy(&u, &g0[static_cast<size_t>(i)], 4);
    u = (u & 0xfffe0000u) | (i % 2 ? 0x18000u : 0x8000u);  // both parities of the kept bit
    std::memcpy(&g0[static_cast<size_t>(i)], &u, 4);
  }
  g0[5] = g0[static_cast<size_t>(n - 1)] = NAN;
  g0[17] = INFINITY;
  for (DType pt : {DType::f32, DType::bf16})
    for (DType gt : {DType::f32, DType::bf16})
      for (DType mo : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(::testing::Message() << "param " << dtype_name(pt) << " grad "
                                          << dtype_name(gt) << " m " << dtype_name(mo));
        struct State {
          Tensor p, m, v;
        };
        auto state = [&](Backend& b) {
          return State{make(b, {n}, p0, pt), make(b, {n}, m0, mo), make(b, {n}, v0)};
        };
        State a = state(emu), r = state(*native);
        AdamWParams hp;
        hp.lr = 3e-2f;
        hp.b2 = 0.95f;
        hp.eps = 1e-8f;
        hp.weight_decay = 0.1f;
        for (int64_t step = 1; step <= 3; ++step) {
          hp.step = step;
          // Step 1 makes m the gradient itself (b1 = 0, no scale), so its bf16 store rounds g.
          hp.b1 = step == 1 ? 0.f : 0.9f;
          hp.grad_scale = step == 1 ? 1.f : 0.37f;
          emu.adamw_update(a.p, make(emu, {n}, g0, gt), a.m, a.v, hp);
          native->adamw_update(r.p, make(*native, {n}, g0, gt), r.m, r.v, hp);
        }
        for (auto [x, y] : {std::pair{&a.p, &r.p}, {&a.m, &r.m}, {&a.v, &r.v}}) {
          const Vec got = read(*x), want = read(*y);
          ASSERT_EQ(got.size(), want.size());
          EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
        }
      }
}

// ---- conventions shared by the kernels --------------------------------------------------------

// "[N, D]" accepts any leading shape: the results are those of the flattened tensors.
TEST(MoeOptim, LeadingDimensionsFlatten) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  const int64_t E = 6, D = 5, K = 4, Nn = 3;
  const Vec logits = test::randn(2 * 3 * E, rng);
  const Route flat = route(b, make(b, {6, E}, logits), 2, false, true);
  Route nested{b.empty({2, 3, 2}, DType::f32), b.empty({2, 3, 2}, DType::i32),
               b.empty({2, 3, E}, DType::f32)};
  b.topk_route_forward(make(b, {2, 3, E}, logits), 2, false, true, nested.weights, nested.indices,
                       nested.probs);
  EXPECT_EQ(bytes(flat.weights), bytes(nested.weights));
  EXPECT_EQ(bytes(flat.indices), bytes(nested.indices));

  const Vec x = test::randn(2 * 3 * D, rng);
  Tensor g3 = b.empty({2, 2, D}, DType::f32), g2 = b.empty({4, D}, DType::f32);
  b.gather_rows(make(b, {2, 3, D}, x), test::from_ints(b, {2, 2}, {5, 0, 3, 5}), g3);
  b.gather_rows(make(b, {6, D}, x), test::from_ints(b, {4}, {5, 0, 3, 5}), g2);
  EXPECT_EQ(bytes(g3), bytes(g2));
  Tensor s3 = zeros(b, {2, 3, D}), s2 = zeros(b, {6, D});
  b.scatter_add_rows(g3, test::from_ints(b, {2, 2}, {1, 1, 4, 0}), Tensor(), s3);
  b.scatter_add_rows(g2, test::from_ints(b, {4}, {1, 1, 4, 0}), Tensor(), s2);
  EXPECT_EQ(bytes(s3), bytes(s2));

  const Vec xm = test::randn(2 * 3 * K, rng), w = test::randn(2 * K * Nn, rng);
  const Tensor off = test::from_ints(b, {3}, {0, 4, 6});
  Tensor o3 = b.empty({2, 3, Nn}, DType::f32), o2 = b.empty({6, Nn}, DType::f32);
  b.grouped_matmul(make(b, {2, 3, K}, xm), make(b, {2, K, Nn}, w), off, false, o3);
  b.grouped_matmul(make(b, {6, K}, xm), make(b, {2, K, Nn}, w), off, false, o2);
  EXPECT_EQ(bytes(o3), bytes(o2));
}

TEST(AdamW, NonFiniteGradientsPropagate) {
  Backend& b = test::cpu();
  // 40 elements: the vector path and its scalar tail both see a NaN and an infinity.
  Vec g(40, 0.5f);
  g[3] = g[37] = NAN;
  g[5] = g[38] = INFINITY;
  for (DType pt : {DType::f32, DType::bf16}) {
    Tensor p = make(b, {40}, Vec(40, 1.f), pt), m = zeros(b, {40}), v = zeros(b, {40});
    AdamWParams hp;
    hp.lr = 1e-3f;
    b.adamw_update(p, make(b, {40}, g), m, v, hp);
    const Vec got = read(p);
    for (int i : {3, 37, 5, 38}) EXPECT_TRUE(std::isnan(got[i])) << dtype_name(pt) << " " << i;
    EXPECT_NEAR(got[0], 1.f - 1e-3f, pt == DType::f32 ? 1e-6 : 4e-3);
  }
}

// ---- determinism ------------------------------------------------------------------------------

// Every kernel twice on the same inputs: the outputs are equal bit for bit.
TEST(MoeOptim, Deterministic) {
  MT_SEED_TRACE();
  Backend& b = test::cpu();
  auto twice = [&](auto&& f) {
    const auto a = f();
    EXPECT_EQ(a, f());
  };
  const int64_t N = 257, E = 32, D = 96, M = 1031;
  const int k = 4;
  const Vec logits = test::randn(static_cast<size_t>(N * E), rng);
  const Vec dw = test::randn(static_cast<size_t>(N * k), rng);
  twice([&] {
    const Route r = route(b, make(b, {N, E}, logits), k, false, true);
    Tensor dl = zeros(b, {N, E});
    b.topk_route_backward(make(b, {N, k}, dw), r.weights, r.indices, r.probs, false, true, dl);
    return bytes(dl);
  });
  const Vec src = test::randn(static_cast<size_t>(M * D), rng);
  const Vec w = test::randn(static_cast<size_t>(M), rng);
  const IVec idx = random_ints(static_cast<size_t>(M), 64, rng);  // ~16 writes per row
  twice([&] {
    Tensor out = zeros(b, {64, D});
    b.scatter_add_rows(make(b, {M, D}, src), test::from_ints(b, {M}, idx), make(b, {M}, w), out);
    return bytes(out);
  });
  const int64_t K = 96, Nn = 160;
  const IVec off{0, 300, 301, 301, 1031};
  const Vec x = test::randn(static_cast<size_t>(M * K), rng);
  const Vec ww = test::randn(static_cast<size_t>(4 * K * Nn), rng);
  const Vec dout = test::randn(static_cast<size_t>(M * Nn), rng);
  twice([&] {
    Tensor out = b.empty({M, Nn}, DType::f32);
    b.grouped_matmul(make(b, {M, K}, x), make(b, {4, K, Nn}, ww), test::from_ints(b, {5}, off),
                     false, out);
    Tensor g = zeros(b, {4, K, Nn});
    b.grouped_matmul_weight_grad(make(b, {M, K}, x), make(b, {M, Nn}, dout),
                                 test::from_ints(b, {5}, off), false, g);
    auto r = bytes(out);
    const auto rg = bytes(g);
    r.insert(r.end(), rg.begin(), rg.end());
    return r;
  });
  const Vec p0 = test::randn(70001, rng), g0 = test::randn(70001, rng);
  twice([&] {
    Tensor p = make(b, {70001}, p0, DType::bf16), m = zeros(b, {70001}), v = zeros(b, {70001});
    AdamWParams hp;
    hp.lr = 3e-3f;
    hp.weight_decay = 0.01f;
    for (int64_t s = 1; s <= 2; ++s) {
      hp.step = s;
      b.adamw_update(p, make(b, {70001}, g0), m, v, hp);
    }
    return bytes(p);
  });
}

}  // namespace
}  // namespace mt
