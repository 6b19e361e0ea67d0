// matmul on the CPU backend against a double-precision reference: every transpose combination,
// batches (shared 2-D b, batched b), alpha/beta, odd sizes and size 1, the M = 1 matrix-vector
// path, bf16 operands, shapes large enough to be tiled over threads, determinism, shape errors,
// and the GEMM path's start-up line (including a coretype the environment sets).
//
// Tolerances. f32: |got - ref| <= 1e-5 * (|alpha| sum_k |a_ik b_kj| + |beta c_ij|), i.e. relative
// to the magnitude of the terms summed (the rounding of an f32 sum of K terms is well inside
// this for K < 1000). bf16 inputs are rounded on the host first and the reference uses the
// rounded values, so the same bound holds (bf16 x bf16 on AMX tiles too: products of bf16 are
// exact in f32 and the tiles accumulate in f32); a bf16 output adds its own rounding, 2^-8 |ref|.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "config_impl.h"
#include "mt/backend.h"
#include "mt/config.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "mt/q8.h"
#include "plugin_manager.h"
#include "test_support.h"

namespace mt {
namespace {

// A tensor holding `v` (bf16: rounded to nearest even). `v` is replaced by the stored values, so
// the reference sees exactly what the kernel sees. Written without Backend::cast.
Tensor make(Backend& b, const Shape& shape, std::vector<float>& v, DType dt) {
  Tensor t = b.empty(shape, dt);
  if (dt == DType::f32) {
    b.copy_from_host(t, v.data());
  } else {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      h[i] = f32_to_bf16(v[i]);
      v[i] = bf16_to_f32(h[i]);
    }
    b.copy_from_host(t, h.data());
  }
  return t;
}

std::vector<float> read(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    t.backend()->copy_to_host(t, out.data());
  } else {
    std::vector<uint16_t> h(out.size());
    t.backend()->copy_to_host(t, h.data());
    for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
  }
  return out;
}

struct Case {
  int64_t batch = 1;  // 0: 2-D a and c
  int64_t m, n, k;
  bool ta = false, tb = false;
  bool shared_b = true;  // b 2-D (else batched like a)
  float alpha = 1.f, beta = 0.f;
  DType da = DType::f32, db = DType::f32, dc = DType::f32;
};

std::string name(const Case& c) {
  return "batch=" + std::to_string(c.batch) + " m=" + std::to_string(c.m) +
         " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) + " ta=" + std::to_string(c.ta) +
         " tb=" + std::to_string(c.tb) + " shared_b=" + std::to_string(c.shared_b) +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta) +
         " a=" + dtype_name(c.da) + " b=" + dtype_name(c.db) + " c=" + dtype_name(c.dc);
}

// Runs one case with fresh random operands; checks every element and returns the output.
std::vector<float> check(const Case& cs, std::mt19937_64& rng, Backend& be = test::cpu()) {
  SCOPED_TRACE(name(cs));
  const int64_t nb = std::max<int64_t>(cs.batch, 1);
  auto with_batch = [&](Shape s, bool batched) {
    if (batched && cs.batch > 0) s.insert(s.begin(), cs.batch);
    return s;
  };
  const Shape sa = with_batch(cs.ta ? Shape{cs.k, cs.m} : Shape{cs.m, cs.k}, true);
  const Shape sb = with_batch(cs.tb ? Shape{cs.n, cs.k} : Shape{cs.k, cs.n}, !cs.shared_b);
  const Shape sc = with_batch({cs.m, cs.n}, true);
  std::vector<float> va = test::randn(size_t(shape_numel(sa)), rng);
  std::vector<float> vb = test::randn(size_t(shape_numel(sb)), rng);
  std::vector<float> vc = test::randn(size_t(shape_numel(sc)), rng);
  Tensor a = make(be, sa, va, cs.da), b = make(be, sb, vb, cs.db), c = make(be, sc, vc, cs.dc);
  be.matmul(a, b, c, cs.ta, cs.tb, cs.alpha, cs.beta);
  const std::vector<float> got = read(c);

  const int64_t bstride = cs.shared_b ? 0 : cs.k * cs.n;
  for (int64_t bi = 0; bi < nb; ++bi) {
    for (int64_t i = 0; i < cs.m; ++i) {
      for (int64_t j = 0; j < cs.n; ++j) {
        double sum = 0, mag = 0;
        for (int64_t p = 0; p < cs.k; ++p) {
          const double x = va[size_t(bi * cs.m * cs.k + (cs.ta ? p * cs.m + i : i * cs.k + p))];
          const double y = vb[size_t(bi * bstride + (cs.tb ? j * cs.k + p : p * cs.n + j))];
          sum += x * y;
          mag += std::fabs(x * y);
        }
        const size_t ci = size_t((bi * cs.m + i) * cs.n + j);
        const double old = vc[ci];
        const double ref = cs.alpha * sum + (cs.beta == 0.f ? 0.0 : cs.beta * old);
        double tol = 1e-5 * (std::fabs(cs.alpha) * mag + std::fabs(cs.beta * old)) + 1e-30;
        if (cs.dc == DType::bf16) tol += std::ldexp(std::fabs(ref), -8);
        if (!(std::fabs(got[ci] - ref) <= tol)) {
          ADD_FAILURE() << "c[" << bi << ", " << i << ", " << j << "] = " << got[ci]
                        << ", reference " << ref << " (tolerance " << tol << ")";
          return got;
        }
      }
    }
  }
  return got;
}

class Gemm : public ::testing::Test {
 protected:
  void SetUp() override {
    seed_ = test::seed();
    rng_.seed(seed_);
  }
  int64_t odd(int64_t lo, int64_t hi) {  // an odd size in [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo / 2, (hi - 1) / 2)(rng_) * 2 + 1;
  }
  uint64_t seed_ = 0;
  std::mt19937_64 rng_;
};

#define MT_SEED_TRACE() SCOPED_TRACE("MT_TEST_SEED=" + std::to_string(seed_))

TEST_F(Gemm, AllTransposeCombinations) {
  MT_SEED_TRACE();
  for (int t = 0; t < 4; ++t)
    check({.batch = 0,
           .m = odd(3, 71),
           .n = odd(3, 71),
           .k = odd(3, 71),
           .ta = bool(t & 1),
           .tb = bool(t & 2)},
          rng_);
}

TEST_F(Gemm, SizeOne) {
  MT_SEED_TRACE();
  const int64_t n = odd(3, 41);
  const int64_t sizes[][3] = {{1, 1, 1}, {1, n, n + 2}, {n, 1, n + 4}, {n, n + 2, 1},
                              {1, 1, n}, {n, 1, 1},     {1, n, 1}};
  for (const auto& s : sizes)
    for (int t = 0; t < 4; ++t)
      check({.batch = 0, .m = s[0], .n = s[1], .k = s[2], .ta = bool(t & 1), .tb = bool(t & 2)},
            rng_);
}

TEST_F(Gemm, BatchedSharedAndBatchedB) {
  MT_SEED_TRACE();
  for (int t = 0; t < 4; ++t) {
    for (bool shared : {true, false}) {
      check({.batch = 3,
             .m = odd(3, 33),
             .n = odd(3, 33),
             .k = odd(3, 33),
             .ta = bool(t & 1),
             .tb = bool(t & 2),
             .shared_b = shared},
            rng_);
    }
  }
}

TEST_F(Gemm, FourDimensionalLeadingShape) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  // a [2, 3, M, K] against batched b [2, 3, K, N]: the batch is the product of leading dims.
  const int64_t m = 5, n = 7, k = 9;
  std::vector<float> va = test::randn(2 * 3 * m * k, rng_), vb = test::randn(2 * 3 * k * n, rng_);
  Tensor a = make(be, {2, 3, m, k}, va, DType::f32), b = make(be, {2, 3, k, n}, vb, DType::f32);
  Tensor c = be.empty({2, 3, m, n}, DType::f32);
  be.matmul(a, b, c, false, false);
  const std::vector<float> got = read(c);
  for (int64_t bi = 0; bi < 6; ++bi) {
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double ref = 0, mag = 0;
        for (int64_t p = 0; p < k; ++p) {
          const double x = va[size_t((bi * m + i) * k + p)], y = vb[size_t((bi * k + p) * n + j)];
          ref += x * y;
          mag += std::fabs(x * y);
        }
        EXPECT_NEAR(got[size_t((bi * m + i) * n + j)], ref, 1e-5 * mag);
      }
    }
  }
}

TEST_F(Gemm, AlphaBetaAccumulate) {
  MT_SEED_TRACE();
  for (int t = 0; t < 4; ++t) {
    for (float beta : {1.f, -0.75f}) {
      check({.batch = 0,
             .m = odd(3, 41),
             .n = odd(3, 41),
             .k = odd(3, 41),
             .ta = bool(t & 1),
             .tb = bool(t & 2),
             .alpha = 0.5f,
             .beta = beta},
            rng_);
      // The matrix-vector path has its own alpha/beta handling.
      check({.batch = 2,
             .m = 1,
             .n = odd(3, 300),
             .k = odd(3, 41),
             .ta = bool(t & 1),
             .tb = bool(t & 2),
             .shared_b = false,
             .alpha = -2.f,
             .beta = beta},
            rng_);
    }
  }
}

TEST_F(Gemm, BetaZeroOverwritesNaN) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (int64_t m : {1, 9}) {
    SCOPED_TRACE("m=" + std::to_string(m));
    std::vector<float> va = test::randn(size_t(m * 5), rng_), vb = test::randn(5 * 6, rng_);
    std::vector<float> vc(size_t(m * 6), std::numeric_limits<float>::quiet_NaN());
    Tensor a = make(be, {m, 5}, va, DType::f32), b = make(be, {5, 6}, vb, DType::f32);
    Tensor c = make(be, {m, 6}, vc, DType::f32);
    be.matmul(a, b, c, false, false, 1.f, 0.f);
    for (float x : read(c)) EXPECT_TRUE(std::isfinite(x));
  }
}

TEST_F(Gemm, EmptyK) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  std::vector<float> none, vc = test::randn(4 * 3, rng_);
  Tensor a = make(be, {4, 0}, none, DType::f32), b = make(be, {0, 3}, none, DType::f32);
  Tensor c = make(be, {4, 3}, vc, DType::f32);
  be.matmul(a, b, c, false, false, 1.f, 2.f);
  const std::vector<float> got = read(c);
  for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], 2.f * vc[i]);
}

TEST_F(Gemm, MatrixVector) {
  MT_SEED_TRACE();
  // K and N cross the kernels' vector width (16), row blocks (4) and 4-row steps.
  for (int64_t k : {int64_t{1}, int64_t{15}, int64_t{17}, odd(33, 301)}) {
    for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{257}, odd(301, 601)}) {
      for (bool tb : {false, true}) {
        check({.batch = 0, .m = 1, .n = n, .k = k, .tb = tb}, rng_);
        check({.batch = 0, .m = 1, .n = n, .k = k, .tb = tb, .db = DType::bf16}, rng_);
      }
    }
  }
  // Wider than one task's column chunk (several rounds of chunks per thread).
  for (DType db : {DType::f32, DType::bf16})
    check({.batch = 0, .m = 1, .n = odd(4097, 4601), .k = 9, .db = db}, rng_);
  // A few rows against shared weights (batched decode, up to 8 rows: the few-rows kernels), f32
  // and bf16, with the batch folded into the rows (2 x 2, 2 x 4) and alone (3, 5, 8).
  for (bool tb : {false, true})
    for (DType db : {DType::f32, DType::bf16}) {
      for (int64_t m : {2, 4})
        check(
            {.batch = 2, .m = m, .n = 77, .k = 45, .tb = tb, .alpha = 0.5f, .beta = 1.f, .db = db},
            rng_);
      for (int64_t m : {3, 5, 8})
        check({.batch = 0, .m = m, .n = odd(17, 301), .k = odd(33, 301), .tb = tb, .db = db}, rng_);
    }
  // bf16 rows against bf16 [n, k] weights (decode's transposed projections in bf16: the
  // dot-product kernel where the CPU takes it), K across its 32-element steps, its 128-element
  // blocks and their tails; with alpha and beta, a few rows, and a batched b.
  for (int64_t k :
       {int64_t{1}, int64_t{31}, int64_t{32}, int64_t{128}, int64_t{161}, odd(257, 601)})
    check({.batch = 0,
           .m = 1,
           .n = odd(17, 301),
           .k = k,
           .tb = true,
           .da = DType::bf16,
           .db = DType::bf16},
          rng_);
  for (int64_t m : {1, 3, 8})
    check({.batch = 0,
           .m = m,
           .n = 77,
           .k = 300,
           .tb = true,
           .alpha = 0.5f,
           .beta = 1.f,
           .da = DType::bf16,
           .db = DType::bf16,
           .dc = DType::bf16},
          rng_);
  check({.batch = 3,
         .m = 1,
         .n = 40,
         .k = 200,
         .tb = true,
         .shared_b = false,
         .da = DType::bf16,
         .db = DType::bf16},
        rng_);
  // Batched decode: one row per batch item with batched b and with a transposed a.
  check({.batch = 3, .m = 1, .n = 40, .k = 33, .ta = true, .tb = true, .shared_b = false}, rng_);
  check({.batch = 3, .m = 1, .n = 40, .k = 33, .ta = true}, rng_);
}

// Batched decode: each row of a few-row product (shared weights, up to 8 rows) is bit for bit
// what that row alone gives, so a sequence's tokens do not depend on the batch beside it; with
// bf16 rows and [n, k] bf16 weights too (the dot-product kernel where the CPU takes it).
TEST_F(Gemm, FewRowsEqualEachRowAlone) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (bool tb : {false, true})
    for (DType db : {DType::f32, DType::bf16})
      for (DType da : {DType::f32, DType::bf16})
        for (int64_t m : {2, 3, 7, 8}) {
          if (da == DType::bf16 && db != DType::bf16) continue;
          // bf16 x bf16 [n, k] (the dot-product kernel's four accumulators): at M = 8, two
          // 128-element blocks and four tail steps, the last partial.
          const int64_t n = odd(17, 2601);
          const int64_t k = da == DType::bf16 && tb ? (m == 8 ? 383 : odd(17, 511)) : odd(17, 301);
          SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) +
                       " k=" + std::to_string(k) + " tb=" + std::to_string(tb) + " " +
                       dtype_name(db) + " x " + dtype_name(da));
          std::vector<float> va = test::randn(size_t(m * k), rng_);
          std::vector<float> vb = test::randn(size_t(k * n), rng_);
          const Tensor b = make(be, tb ? Shape{n, k} : Shape{k, n}, vb, db);
          Tensor c = be.zeros({m, n}, DType::f32);
          be.matmul(make(be, {m, k}, va, da), b, c, false, tb, 1.f, 0.f);
          const std::vector<float> all = read(c);
          for (int64_t r = 0; r < m; ++r) {
            std::vector<float> row(va.begin() + r * k, va.begin() + (r + 1) * k);
            Tensor c1 = be.zeros({1, n}, DType::f32);
            be.matmul(make(be, {1, k}, row, da), b, c1, false, tb, 1.f, 0.f);
            const std::vector<float> one = read(c1);
            for (int64_t j = 0; j < n; ++j)
              ASSERT_EQ(all[size_t(r * n + j)], one[size_t(j)]) << "row " << r << " column " << j;
          }
        }
}

// Decode's int8 products as gemm.cpp documents them, in scalar: x's row quantized in blocks of 32
// (scale max |x| / 127, values rounded half to even), each block's products summed exactly in
// 8 lanes of 4, fma(scale_w * scale_x, lane, acc[block parity]) per lane, then (acc0 + acc1) and
// the lanes as ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)). Every vector kernel set must
// give these bits. Where AMX-INT8 is used (`tiles`) each block's 32 products are one exact sum,
// t[b % 16] = fma(scale_w * scale_x, sum, t[b % 16]) over the blocks b in order, then
// u_l = t_l + t_(l + 8) and the u as the lanes above.
float q8_decode_reference(const float* x, const int8_t* row, int64_t k, bool tiles) {
  float acc[2][8] = {}, t[16] = {};
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* v = x + b * kQ8Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float sx = amax / 127.f, inv = sx > 0.f ? 1.f / sx : 0.f;
    const float sw = q8_scale(row, k, b);
    int32_t sum = 0;
    for (int l = 0; l < 8; ++l) {
      int32_t lane = 0;
      for (int64_t i = 4 * l; i < 4 * l + 4; ++i)
        lane += int32_t(row[b * kQ8Block + i]) * int32_t(std::nearbyint(v[i] * inv));
      acc[b & 1][l] = std::fma(sw * sx, float(lane), acc[b & 1][l]);
      sum += lane;
    }
    t[b % 16] = std::fma(sw * sx, float(sum), t[b % 16]);
  }
  float u[8];
  for (int l = 0; l < 8; ++l) u[l] = tiles ? t[l] + t[l + 8] : acc[0][l] + acc[1][l];
  return ((u[0] + u[4]) + (u[2] + u[6])) + ((u[1] + u[5]) + (u[3] + u[7]));
}

// Whether this process's decode int8 products run on AMX-INT8 tiles (the backend's line says).
bool q8_on_tiles(Backend& be) {
  return be.describe().find("int8 x int8 weight rows on AMX-INT8 tiles") != std::string::npos;
}

// int8 weights (mt/q8.h): the quantization round-trips within half a step of each block's scale;
// matmul_q8 computes decode's few rows (M <= 8) with x quantized too, to the documented bits
// (so one row's outputs whatever rows are beside it, and on every kernel set: see
// EveryMatvecKernelSetMatches), within 5% of the f32 product with the dequantized weights; a
// prefill's many rows against the dequantized weights to f32 rounding; f32 and bf16 x and y.
TEST_F(Gemm, Int8RowsMatchTheDequantizedMatmul) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (int64_t k : {32, 96, 1184, 2048}) {  // 1184: 37 blocks, two groups of 16 and 5
    const int64_t n = odd(17, 301), rb = q8_row_bytes(k);
    SCOPED_TRACE("k=" + std::to_string(k) + " n=" + std::to_string(n));
    std::vector<float> w = test::randn(static_cast<size_t>(n * k), rng_);
    for (int64_t i = 0; i < k; ++i) w[static_cast<size_t>(i)] = 0.f;  // a row of zeros: scale 0
    std::vector<int8_t> q(static_cast<size_t>(n * rb));
    std::vector<float> dq(w.size());
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_TRUE(quantize_q8_row(w.data() + j * k, k, q.data() + j * rb));
      dequantize_q8_row(q.data() + j * rb, k, dq.data() + j * k);
      for (int64_t b = 0; b < k / kQ8Block; ++b) {
        float amax = 0.f;
        for (int64_t i = 0; i < kQ8Block; ++i)
          amax = std::max(amax, std::fabs(w[static_cast<size_t>(j * k + b * kQ8Block + i)]));
        // The scale is max |w| / 127 rounded to f16 (to nearest: 2^-11 of it at most); each
        // value within half of it, or, where the rounded scale fell short and 127 was the
        // clamp, within what 127 of it leaves.
        const float s = q8_scale(q.data() + j * rb, k, b);
        ASSERT_LE(std::fabs(s - amax / 127.f), amax / 127.f * 0x1p-11f) << "row " << j;
        const float bound = std::max(s * 0.5f, amax - 127.f * s) * 1.0001f;
        for (int64_t i = 0; i < kQ8Block; ++i) {
          const auto at = static_cast<size_t>(j * k + b * kQ8Block + i);
          ASSERT_LE(std::fabs(dq[at] - w[at]), bound) << "row " << j;
        }
      }
    }
    Tensor wq = be.empty({n, rb}, DType::i8);
    be.copy_from_host(wq, q.data());
    const bool tiles = q8_on_tiles(be);
    for (DType dt : {DType::f32, DType::bf16})
      for (int64_t m : {1, 2, 3, 5, 8, 13}) {
        SCOPED_TRACE("m=" + std::to_string(m) + " " + dtype_name(dt));
        std::vector<float> x = test::randn(static_cast<size_t>(m * k), rng_);
        if (m == 5)  // a block of zeros: scale 0
          for (int64_t i = 2 * k; i < 2 * k + kQ8Block; ++i) x[static_cast<size_t>(i)] = 0.f;
        const Tensor xt = make(be, {m, k}, x, dt);
        const std::vector<float> xr = read(xt);  // x as the tensor holds it (bf16-rounded)
        Tensor y = be.zeros({m, n}, dt);
        be.matmul_q8(xt, wq, y);
        const std::vector<float> got = read(y);
        std::vector<float> want(got.size());
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j) {
            double s = 0;
            for (int64_t i = 0; i < k; ++i)
              s += double(xr[static_cast<size_t>(r * k + i)]) * dq[static_cast<size_t>(j * k + i)];
            want[static_cast<size_t>(r * n + j)] = static_cast<float>(s);
          }
        if (m > 8) {  // a prefill: the dequantized weights
          EXPECT_LT(test::scaled_err(got, want), dt == DType::f32 ? 1e-5 : 1e-2);
          continue;
        }
        // x's quantization: each value within half its block's step (scaled error up to 1.4e-2
        // over 100 runs of random seeds).
        EXPECT_LT(test::scaled_err(got, want), 5e-2);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t j = 0; j < n; ++j) {
            const float ref = q8_decode_reference(xr.data() + r * k, q.data() + j * rb, k, tiles);
            const float g = got[static_cast<size_t>(r * n + j)];
            if (dt == DType::f32)
              ASSERT_EQ(g, ref) << "row " << r << " column " << j;
            else
              ASSERT_EQ(g, bf16_to_f32(f32_to_bf16(ref))) << "row " << r << " column " << j;
          }
      }
  }
  // What it refuses: K not a multiple of 32, rows of another size, a weight not i8.
  Tensor x = be.zeros({1, 48}, DType::f32), y = be.zeros({1, 3}, DType::f32);
  EXPECT_THROW(be.matmul_q8(x, be.zeros({3, q8_row_bytes(48)}, DType::i8), y), Error);
  Tensor x64 = be.zeros({1, 64}, DType::f32);
  EXPECT_THROW(be.matmul_q8(x64, be.zeros({3, 64}, DType::i8), y), Error);
  EXPECT_THROW(be.matmul_q8(x64, be.zeros({3, q8_row_bytes(64)}, DType::f32), y), Error);
  EXPECT_THROW(be.matmul_q8(x64, be.zeros({4, q8_row_bytes(64)}, DType::i8), y), Error);
}

// A prefill against int8 weights (more rows than decode's few) with bf16 x equals the bf16
// product with the dequantized weights rounded to bf16 ([N, K], as they are stored), bit for
// bit: the bf16 GEMM dequantizes the blocks as it packs them. One row has a NaN scale (its
// column is NaN), one a scale of zero. Several row blocks, ragged panels, one block and many.
TEST_F(Gemm, Int8PrefillEqualsTheRoundedDequantizedProduct) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (auto [m, n, k] : {std::array<int64_t, 3>{13, 45, 32}, {150, 97, 96}, {301, 64, 2048}}) {
    SCOPED_TRACE("m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k));
    const int64_t rb = q8_row_bytes(k);
    std::vector<float> w = test::randn(static_cast<size_t>(n * k), rng_);
    for (int64_t i = 0; i < k; ++i) w[static_cast<size_t>(k + i)] = 0.f;  // row 1: scale 0
    std::vector<int8_t> q(static_cast<size_t>(n * rb));
    for (int64_t j = 0; j < n; ++j)
      ASSERT_TRUE(quantize_q8_row(w.data() + j * k, k, q.data() + j * rb));
    const uint16_t nan = 0x7e00;                           // an f16 NaN
    std::memcpy(q.data() + 2 * rb + k, &nan, sizeof nan);  // row 2, block 0: a NaN scale
    std::vector<float> dq(w.size());
    for (int64_t j = 0; j < n; ++j) dequantize_q8_row(q.data() + j * rb, k, dq.data() + j * k);
    Tensor wq = be.empty({n, rb}, DType::i8);
    be.copy_from_host(wq, q.data());
    const Tensor wb = make(be, {n, k}, dq, DType::bf16);  // dq now holds the rounded values
    std::vector<float> x = test::randn(static_cast<size_t>(m * k), rng_);
    const Tensor xt = make(be, {m, k}, x, DType::bf16);
    for (DType dy : {DType::f32, DType::bf16}) {
      Tensor got = be.zeros({m, n}, dy), want = be.zeros({m, n}, dy);
      be.matmul_q8(xt, wq, got);
      be.matmul(xt, wb, want, false, true);
      const std::vector<float> g = read(got), r = read(want);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const size_t at = static_cast<size_t>(i * n + j);
          if (j == 2) {
            ASSERT_TRUE(std::isnan(g[at]) && std::isnan(r[at])) << "row " << i;
          } else {
            ASSERT_EQ(g[at], r[at]) << "row " << i << " column " << j << " " << dtype_name(dy);
          }
        }
    }
  }
}

// A row of x holding a NaN or an infinity is not quantized (it would become a finite number):
// its outputs carry the NaN or infinity, and the rows beside it keep their bits.
TEST_F(Gemm, Int8DecodeKeepsNanAndInfinity) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  const int64_t k = 64, n = 5, rb = q8_row_bytes(k);
  std::vector<float> w = test::randn(static_cast<size_t>(n * k), rng_);
  std::vector<int8_t> q(static_cast<size_t>(n * rb));
  for (int64_t j = 0; j < n; ++j)
    ASSERT_TRUE(quantize_q8_row(w.data() + j * k, k, q.data() + j * rb));
  for (int64_t i = 0; i < k; ++i) q[static_cast<size_t>(i)] = 1;  // row 0: all positive
  Tensor wq = be.empty({n, rb}, DType::i8);
  be.copy_from_host(wq, q.data());
  std::vector<float> x = test::randn(static_cast<size_t>(3 * k), rng_);
  x[5] = std::numeric_limits<float>::quiet_NaN();                               // row 0
  x[static_cast<size_t>(2 * k + 40)] = std::numeric_limits<float>::infinity();  // row 2
  Tensor y = be.zeros({3, n}, DType::f32);
  be.matmul_q8(make(be, {3, k}, x, DType::f32), wq, y);
  const std::vector<float> got = read(y);
  for (int64_t j = 0; j < n; ++j) {
    EXPECT_TRUE(std::isnan(got[static_cast<size_t>(j)])) << j;
    EXPECT_EQ(got[static_cast<size_t>(n + j)],
              q8_decode_reference(x.data() + k, q.data() + j * rb, k, q8_on_tiles(be)))
        << j;
  }
  // Column 0 (values 1, scales > 0) of row 2: +inf.
  EXPECT_EQ(got[static_cast<size_t>(2 * n)], std::numeric_limits<float>::infinity());
}

TEST_F(Gemm, Bf16Operands) {
  MT_SEED_TRACE();
  const DType f = DType::f32, h = DType::bf16;
  const DType combos[][3] = {{h, f, f}, {f, h, f}, {h, h, f}, {h, h, h}, {f, f, h}};
  for (const auto& d : combos) {
    for (int t = 0; t < 4; ++t) {
      check({.batch = 2,
             .m = odd(3, 41),
             .n = odd(3, 41),
             .k = odd(3, 41),
             .ta = bool(t & 1),
             .tb = bool(t & 2),
             .beta = 0.5f,
             .da = d[0],
             .db = d[1],
             .dc = d[2]},
            rng_);
    }
    check({.batch = 0, .m = 1, .n = 300, .k = 77, .tb = true, .da = d[0], .db = d[1], .dc = d[2]},
          rng_);
  }
}

// On a CPU without AMX, bf16 x bf16 GEMMs run on AVX512_BF16's dot products where it has them,
// MT_CPU_BF16DOT is not 0 and they measured faster than f32 FMAs (Bf16LargeShapes checks their
// results); the start-up line says which path they take, and the bf16 peak is above f32's
// exactly when it is the dot products'.
TEST_F(Gemm, Bf16PathIsNamed) {
  if (test::cpu_supports("amx-bf16")) GTEST_SKIP() << "this CPU has AMX: the AMX path is named";
  const char* env = std::getenv("MT_CPU_BF16DOT");
  const bool dot = test::cpu_supports("avx512f") && test::cpu_supports("avx512bw") &&
                   test::cpu_supports("avx512vl") && test::cpu_supports("avx512bf16") &&
                   !(env && std::string(env) == "0");
  // The path is the CPU's to decide (AMD's dot products outrun its FMAs), never a timing's.
  const bool taken = dot && (test::cpu_supports("amd") || (env && std::string(env) == "1"));
  Backend& be = test::cpu();
  const bool faster = be.peak_flops(DType::bf16) > be.peak_flops(DType::f32);
  const std::string d = be.describe();
  EXPECT_NE(d.find(taken ? "bf16 x bf16 on AVX512_BF16 dot products" : "bf16 widened to f32"),
            std::string::npos)
      << d;
  if (!dot) {
    EXPECT_FALSE(faster) << d;
  }
}

TEST_F(Gemm, TiledOverThreads) {
  MT_SEED_TRACE();
  // Big enough to be cut into per-thread tiles: along M (m >= n) and along N (n > m, 16-column
  // tiles with a ragged end), single and in an unbalanced batch of 3.
  for (int t = 0; t < 4; ++t) {
    check({.batch = 0, .m = 301, .n = 97, .k = 131, .ta = bool(t & 1), .tb = bool(t & 2)}, rng_);
    check({.batch = 0, .m = 67, .n = 517, .k = 129, .ta = bool(t & 1), .tb = bool(t & 2)}, rng_);
    check({.batch = 3,
           .m = 129,
           .n = 161,
           .k = 97,
           .ta = bool(t & 1),
           .tb = bool(t & 2),
           .shared_b = false},
          rng_);
  }
}

TEST_F(Gemm, Bf16LargeShapes) {
  MT_SEED_TRACE();
  // bf16 x bf16 takes the AMX path where the CPU has it (else AVX512_BF16's dot products on the
  // same packed tiles, else the f32 path): several 128-row blocks with a ragged
  // end, several blocks of panels, 32-column panels with a ragged end, K across several 32-wide
  // tile steps with a tail and across several 256-wide chunks, and a single row block split over
  // column ranges.
  const DType h = DType::bf16;
  for (int t = 0; t < 4; ++t) {
    check({.batch = 0,
           .m = 301,
           .n = 97,
           .k = 131,
           .ta = bool(t & 1),
           .tb = bool(t & 2),
           .beta = 0.5f,
           .da = h,
           .db = h},
          rng_);
    check({.batch = 2,
           .m = 67,
           .n = 517,
           .k = 64,
           .ta = bool(t & 1),
           .tb = bool(t & 2),
           .shared_b = false,
           .alpha = 2.f,
           .da = h,
           .db = h,
           .dc = h},
          rng_);
    // Several row blocks over several blocks of panels (the AMX path cuts the 17 panels into
    // blocks of about half an L2 of packed b: 140 KiB a panel at this K), the last ones ragged.
    check({.batch = 0,
           .m = 300,
           .n = 520,
           .k = 1100,
           .ta = bool(t & 1),
           .tb = bool(t & 2),
           .beta = 0.25f,
           .da = h,
           .db = h},
          rng_);
    // K over several 256-wide chunks (partial sums carried between chunks), odd K.
    check({.batch = 0,
           .m = 150,
           .n = 40,
           .k = 523,
           .ta = bool(t & 1),
           .tb = bool(t & 2),
           .beta = 1.f,
           .da = h,
           .db = h},
          rng_);
  }
}

// A bf16 c with beta 0 is written by the bf16 GEMM itself: each element the f32 result (the same
// product into an f32 c) rounded to nearest even, bit for bit. Every transpose, alpha != 1,
// ragged blocks, a batch with its own b per item.
TEST_F(Gemm, Bf16OutputIsTheRoundedF32Output) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    for (auto [batch, m, n, k] :
         {std::array<int64_t, 4>{1, 150, 97, 131}, {1, 301, 40, 523}, {3, 67, 64, 32}}) {
      SCOPED_TRACE("ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) +
                   " m=" + std::to_string(m));
      std::vector<float> va = test::randn(size_t(batch * m * k), rng_),
                         vb = test::randn(size_t(batch * k * n), rng_);
      const Tensor a =
          make(be, batch > 1 ? Shape{batch, ta ? k : m, ta ? m : k} : Shape{ta ? k : m, ta ? m : k},
               va, DType::bf16);
      const Tensor b =
          make(be, batch > 1 ? Shape{batch, tb ? n : k, tb ? k : n} : Shape{tb ? n : k, tb ? k : n},
               vb, DType::bf16);
      const Shape sc = batch > 1 ? Shape{batch, m, n} : Shape{m, n};
      Tensor c16 = be.empty(sc, DType::bf16), c32 = be.empty(sc, DType::f32);
      be.matmul(a, b, c16, ta, tb, 0.75f, 0.f);
      be.matmul(a, b, c32, ta, tb, 0.75f, 0.f);
      const std::vector<float> g = read(c16), f = read(c32);
      for (size_t i = 0; i < g.size(); ++i)
        ASSERT_EQ(g[i], bf16_to_f32(f32_to_bf16(f[i]))) << "element " << i;
    }
  }
}

// Up to 256 rows, the bf16 GEMM packs b inside its tasks, 16 panels at a time (an MoE expert's
// rows); above, once up front. Each element is the same accumulation either way: the first 200
// rows of a 260-row product equal the 200-row product bit for bit, every transpose, f32 c with
// beta and bf16 c. n = 2100 gives each of two threads' column ranges a full group of 16 panels
// and a partial one, k = 300 two 256-wide chunks with a tail, 200 rows a ragged 32-row group.
TEST_F(Gemm, Bf16FewRowsEqualTheirRowsOfALargerProduct) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  // Without AMX tiles or AVX512_BF16 dot products for it ("bf16 x bf16 on ..." in the start-up
  // line), bf16 is widened and multiplied by OpenBLAS's sgemm, whose bits may depend on the row
  // count (a Zen 3's: row 192 of 200 differs in its last bit); the packed bf16 GEMM this checks
  // runs there under X86Emu (AVX512_BF16 emulated).
  if (be.describe().find("bf16 x bf16 on ") == std::string::npos)
    GTEST_SKIP() << "this CPU's bf16 GEMM is OpenBLAS's f32 one (bf16 widened to f32): the "
                    "packed bf16 GEMM is checked under X86Emu";
  const int64_t small = 200, big = 260, n = 2100, k = 300;
  for (int t = 0; t < 4; ++t) {
    const bool ta = t & 1, tb = t & 2;
    SCOPED_TRACE("ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
    std::vector<float> va = test::randn(size_t(big * k), rng_),
                       vb = test::randn(size_t(k * n), rng_);
    std::vector<float> vc = test::randn(size_t(big * n), rng_);
    // a's first `rows` rows ([rows, k], or [k, rows] if ta).
    auto a_rows = [&](int64_t rows) {
      std::vector<float> v(size_t(rows * k));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t p = 0; p < k; ++p)
          v[size_t(ta ? p * rows + i : i * k + p)] = va[size_t(i * k + p)];
      return make(be, ta ? Shape{k, rows} : Shape{rows, k}, v, DType::bf16);
    };
    const Tensor b = make(be, tb ? Shape{n, k} : Shape{k, n}, vb, DType::bf16);
    const Tensor a_small = a_rows(small), a_big = a_rows(big);
    for (DType dc : {DType::f32, DType::bf16}) {
      const float beta = dc == DType::f32 ? 0.5f : 0.f;
      std::vector<float> c0(vc.begin(), vc.begin() + small * n);
      Tensor c_small = make(be, {small, n}, c0, dc), c_big = make(be, {big, n}, vc, dc);
      be.matmul(a_small, b, c_small, ta, tb, 1.5f, beta);
      be.matmul(a_big, b, c_big, ta, tb, 1.5f, beta);
      const std::vector<float> gs = read(c_small), gb = read(c_big);
      for (size_t i = 0; i < gs.size(); ++i)
        ASSERT_EQ(gs[i], gb[i]) << "row " << i / size_t(n) << " column " << i % size_t(n)
                                << (dc == DType::bf16 ? " (bf16 c)" : " (f32 c)");
    }
  }
}

// bf16 x bf16 against [N, K] weights (trans_b, as decode keeps its projections) packs the same
// tiles as against [K, N] ones, so the products are the same bits: ragged panels (n % 32), a k
// tail and an odd k, one and several row blocks.
TEST_F(Gemm, Bf16TransposedWeightsGiveTheSameBits) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  for (auto [m, n, k] : {std::array<int64_t, 3>{150, 97, 131}, {301, 64, 523}, {40, 45, 32}}) {
    std::vector<float> va = test::randn(size_t(m * k), rng_), vb = test::randn(size_t(k * n), rng_);
    std::vector<float> vbt(vb.size());
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < n; ++j) vbt[size_t(j * k + p)] = vb[size_t(p * n + j)];
    const Tensor a = make(be, {m, k}, va, DType::bf16);
    Tensor c = be.empty({m, n}, DType::f32), ct = be.empty({m, n}, DType::f32);
    be.matmul(a, make(be, {k, n}, vb, DType::bf16), c, false, false);
    be.matmul(a, make(be, {n, k}, vbt, DType::bf16), ct, false, true);
    ASSERT_EQ(test::to_vector(ct), test::to_vector(c)) << "m " << m << " n " << n << " k " << k;
  }
}

TEST_F(Gemm, OtherThreadCounts) {
  MT_SEED_TRACE();
  // The tiling depends on the arena's thread count: 1 (no tiles) and 3 (odd splits, batch of 2
  // unbalanced; only where there are 3 cores, as oneTBB caps its workers at the core count).
  std::vector<int> counts = {1};
  if (std::thread::hardware_concurrency() >= 3) counts.push_back(3);
  for (int threads : counts) {
    SCOPED_TRACE("threads=" + std::to_string(threads));
    std::unique_ptr<Backend> be = test::plugins().make_backend(
        test::cpu_backend_name(), config_from_pairs({{"num_threads", std::to_string(threads)}}));
    for (DType d : {DType::f32, DType::bf16}) {
      check({.batch = 2,
             .m = 211,
             .n = 133,
             .k = 77,
             .tb = true,
             .shared_b = false,
             .da = d,
             .db = d},
            rng_, *be);
      check({.batch = 0, .m = 45, .n = 403, .k = 150, .ta = true, .da = d, .db = d}, rng_, *be);
      check({.batch = 0, .m = 1, .n = 1001, .k = 150, .db = d}, rng_, *be);
    }
  }
}

TEST_F(Gemm, Deterministic) {
  MT_SEED_TRACE();
  Backend& be = test::cpu();
  // The matrix-vector kernels, OpenBLAS tiles over threads, and bf16 x bf16 (AMX where present).
  struct V {
    int64_t m;
    DType da, db;
  };
  for (const V& v : {V{1, DType::f32, DType::bf16}, V{257, DType::f32, DType::f32},
                     V{257, DType::bf16, DType::bf16}}) {
    SCOPED_TRACE("m=" + std::to_string(v.m) + " a=" + dtype_name(v.da) + " b=" + dtype_name(v.db));
    std::vector<float> va = test::randn(size_t(v.m * 300), rng_);
    std::vector<float> vb = test::randn(300 * 333, rng_);
    Tensor a = make(be, {v.m, 300}, va, v.da), b = make(be, {300, 333}, vb, v.db);
    Tensor c1 = be.empty({v.m, 333}, DType::f32), c2 = be.empty({v.m, 333}, DType::f32);
    be.matmul(a, b, c1, false, false);
    be.matmul(a, b, c2, false, false);
    const std::vector<float> r1 = read(c1), r2 = read(c2);
    EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(float)), 0);
  }
}

TEST_F(Gemm, ShapeErrorsThrow) {
  Backend& be = test::cpu();
  auto t = [&](Shape s, DType d = DType::f32) { return be.zeros(s, d); };
  Tensor c = t({4, 5});
  EXPECT_THROW(be.matmul(t({4, 3}), t({2, 5}), c, false, false), Error);  // K mismatch
  EXPECT_THROW(be.matmul(t({4, 3}), t({3, 6}), c, false, false), Error);  // N vs c
  EXPECT_THROW(be.matmul(t({4, 3}), t({3, 5}), c, true, false), Error);   // trans_a: M = 3
  EXPECT_THROW(be.matmul(t({3}), t({3, 5}), c, false, false), Error);     // 1-D a
  EXPECT_THROW(be.matmul(t({4, 3}, DType::i32), t({3, 5}), c, false, false), Error);
  Tensor cb = t({2, 4, 5});
  EXPECT_THROW(be.matmul(t({2, 4, 3}), t({3, 3, 5}), cb, false, false), Error);  // batch of b
  EXPECT_THROW(be.matmul(t({2, 4, 3}), t({3, 5}), c, false, false), Error);      // batch of c
  EXPECT_NO_THROW(be.matmul(t({2, 4, 3}), t({3, 5}), cb, false, false));
}

TEST(GemmPath, DescribesPathAndPeak) {
  Backend& be = test::cpu();
  const std::string d = be.describe();
  SCOPED_TRACE(d);
  EXPECT_NE(d.find("GEMM"), std::string::npos);
  EXPECT_GT(be.peak_flops(DType::f32), 1e9);
  EXPECT_GT(be.peak_flops(DType::bf16), 1e9);
  // A forced matrix-vector kernel set is the one the line names.
  if (const char* env = std::getenv("MT_CPU_MATVEC")) {
    const std::string v = env;
    const char* name = v == "avx512" ? "M=1: mt AVX-512 kernels"
                       : v == "avx2" ? "M=1: mt AVX2 kernels"
                                     : "M=1: mt portable kernels";
    EXPECT_NE(d.find(name), std::string::npos) << "MT_CPU_MATVEC=" << v;
  }
  // Where bf16 GEMMs run on AMX tiles and the CPU has AMX-INT8, decode's int8 products take
  // tiles too with the AVX-512 set (unless MT_CPU_MATVEC_AMX=0), and the line says so.
  auto env_is = [](const char* name, const char* v) {
    const char* e = std::getenv(name);
    return e && std::string(e) == v;
  };
  if (d.find("bf16 x bf16 on AMX tiles") != std::string::npos && test::cpu_supports("amx-int8") &&
      !env_is("MT_CPU_MATVEC_AMX", "0") &&
      (!std::getenv("MT_CPU_MATVEC") || env_is("MT_CPU_MATVEC", "avx512")))
    EXPECT_NE(d.find("int8 x int8 weight rows on AMX-INT8 tiles"), std::string::npos);
  else
    EXPECT_EQ(d.find("int8 x int8 weight rows on AMX-INT8 tiles"), std::string::npos);
  // The one-stream kernels' prefetch (AVX-512 set), where the environment forces it either way.
  const bool avx512_set = d.find("M=1: mt AVX-512 kernels") != std::string::npos;
  if (env_is("MT_CPU_MATVEC_PREFETCH", "1") && env_is("MT_CPU_MATVEC_STREAMS", "0") && avx512_set) {
    EXPECT_NE(d.find("one weight stream a core prefetched into L2"), std::string::npos);
  }
  if (env_is("MT_CPU_MATVEC_PREFETCH", "0") || !avx512_set) {
    EXPECT_EQ(d.find("prefetched into L2"), std::string::npos);
  }
  if (const char* env = std::getenv("MT_CPU_BLAS")) {
    EXPECT_NE(d.find("portable"), std::string::npos) << "MT_CPU_BLAS=" << env;
    return;
  }
  // A coretype from the environment is what OpenBLAS runs, and the line says where it came from.
  if (const char* env = std::getenv("OPENBLAS_CORETYPE")) {
    if (d.find("OpenBLAS") != std::string::npos) {
      EXPECT_NE(d.find("from the environment"), std::string::npos);
      std::string want = env, got = d;
      for (auto& ch : want) ch = char(std::tolower(ch));
      for (auto& ch : got) ch = char(std::tolower(ch));
      EXPECT_NE(got.find(want + " kernels"), std::string::npos);
      // A coretype narrower than the hardware (this workplace's Haswell on an AVX-512 CPU) is
      // kept, and the line says so; an AVX-512 one, or an AVX2-only CPU, gets no such remark.
      const bool hw_avx512 =
          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
      const bool narrow = want != "skylakex" && want != "cooperlake" && want != "sapphirerapids";
      EXPECT_EQ(d.find("this CPU has AVX-512: unset it") != std::string::npos, hw_avx512 && narrow)
          << d;
    }
  }
}

// The threads in this process (/proc/self/status), or -1 where that file is not readable.
int process_threads() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("Threads:", 0) == 0) return std::atoi(line.c_str() + 8);
  return -1;
}

// num_threads above the CPUs this process may use: the backend runs that many threads (oneTBB
// alone would run only as many as there are CPUs, and print a warning), says so, and keeps the
// CPUs' peak (the extra threads share them), so MFU is not divided by phantom cores.
TEST(GemmPath, MoreThreadsThanCpusRunAndKeepThePeak) {
  const int cpus = mt::cpu_threads(config_from_pairs({}));
  // Above what the process has without the raised limit (this thread, oneTBB's cpus - 1
  // workers, OpenBLAS's pool of at most cpus - 1), so a count of n threads shows the raise.
  const int n = 2 * cpus + 3;
  std::unique_ptr<Backend> at_cpus = test::plugins().make_backend(
      test::cpu_backend_name(), config_from_pairs({{"num_threads", std::to_string(cpus)}}));
  const double peak = at_cpus->peak_flops(DType::f32);
  at_cpus.reset();
  std::unique_ptr<Backend> wide = test::plugins().make_backend(
      test::cpu_backend_name(), config_from_pairs({{"num_threads", std::to_string(n)}}));
  const std::string d = wide->describe();
  EXPECT_NE(d.find(std::to_string(n) + " threads (oneTBB, more than the " + std::to_string(cpus) +
                   " CPUs it may use)"),
            std::string::npos)
      << d;
  EXPECT_EQ(wide->peak_flops(DType::f32), peak);
  // A GEMM tiled over the n threads: oneTBB starts its workers as the tiles ask for them.
  if (process_threads() < 0) GTEST_SKIP() << "/proc/self/status is not readable here";
  const Tensor a = wide->zeros({512, 512}, DType::f32);
  Tensor c = wide->empty({512, 512}, DType::f32);
  int threads = process_threads();
  for (int i = 0; i < 200 && threads < n; ++i) {
    wide->matmul(a, a, c, false, false);
    threads = process_threads();
  }
  EXPECT_GE(threads, n) << "num_threads " << n << " on " << cpus << " CPUs";
}

// Set in the child processes the two tests below start. Their filters do not select these tests,
// so the marker only stops a broader filter from recursing. It used to be MT_CPU_BLAS or
// OPENBLAS_CORETYPE themselves, but a machine may set those for every process (this workplace
// sets OPENBLAS_CORETYPE=Haswell), and the tests then skipped themselves everywhere.
constexpr const char* kChildMarker = "MT_GEMM_TEST_CHILD";

bool in_child() {
  return std::getenv(kChildMarker) != nullptr;
}

TEST(GemmPath, PortablePathWithoutOpenBlas) {
  if (in_child()) GTEST_SKIP() << "runs as the child of this test";
  // The GEMM used where OpenBLAS cannot be loaded, and the f32 path for bf16 without AMX: the
  // whole suite again in a child process (both are chosen once per process).
  std::string out;
  const int rc = test::run_command(
      std::string(kChildMarker) + "=1 MT_CPU_BLAS=portable MT_CPU_AMX=0 /proc/" +
          std::to_string(getpid()) + "/exe --gtest_filter=Gemm.*:GemmPath.DescribesPathAndPeak",
      out);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("PASSED"), std::string::npos) << out;
}

// OpenBLAS is loaded as the CPU plugin registers, not when its first backend is made: the
// loading sets OPENBLAS_CORETYPE (setenv), and mt run and mt bench register the plugin before
// their communicator starts MPI's threads, which may read the environment meanwhile. In a child
// process (this one has loaded both): absent before the plugin registers, present after.
TEST(GemmPath, OpenBlasLoadsAsThePluginRegisters) {
  if (!in_child()) {
    std::string out;
    const int rc = test::run_command(
        std::string(kChildMarker) + "=1 env -u MT_CPU_BLAS /proc/" + std::to_string(getpid()) +
            "/exe --gtest_filter=GemmPath.OpenBlasLoadsAsThePluginRegisters",
        out);
    EXPECT_EQ(rc, 0) << out;
    EXPECT_NE(out.find("[  PASSED  ] 1 test"), std::string::npos) << out;
    return;
  }
  auto loaded = [] {
    for (const char* name : {"libopenblas.so.0", "libopenblas.so"})
      if (void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD)) {
        dlclose(h);
        return true;
      }
    return false;
  };
  ASSERT_FALSE(loaded()) << "OpenBLAS is in this process before any plugin";
  test::plugins().require("backend", "cpu");
  EXPECT_TRUE(loaded()) << "the CPU plugin registered without loading OpenBLAS";
}

// Every matrix-vector kernel set the CPU has (MT_CPU_MATVEC; chosen once per process, so each
// in a child process): the M = 1 cases (and batched decode's few rows) against the double
// reference, determinism, and the start-up line naming the set. A set that does not exist, or
// one the CPU lacks, is refused when the first product needs it.
TEST(GemmPath, EveryMatvecKernelSetMatches) {
  if (in_child()) GTEST_SKIP() << "runs as the child of this test";
  const bool avx2 = test::cpu_supports("avx2") && test::cpu_supports("fma");
  const bool avx512 = test::cpu_supports("avx512f") && test::cpu_supports("avx512bw") &&
                      test::cpu_supports("avx512dq") && test::cpu_supports("avx512vl");
  const std::string exe = "/proc/" + std::to_string(getpid()) + "/exe";
  for (const auto& [set, has] :
       {std::pair<const char*, bool>{"portable", true}, {"avx2", avx2}, {"avx512", avx512}}) {
    if (!has) continue;
    // Each set with one weight stream per task and with several (MT_CPU_MATVEC_STREAMS); on a
    // CPU with AMX, bf16 rows against [n, k] bf16 weights on the AVX-512 set's widening kernels
    // in the first run and on tiles in the second (MT_CPU_MATVEC_AMX).
    // One stream a task is run with and without its software prefetch (MT_CPU_MATVEC_PREFETCH).
    for (const auto& [streams, prefetch] :
         {std::pair<const char*, const char*>{"0", "0"}, {"0", "1"}, {"1", "0"}}) {
      SCOPED_TRACE(std::string(set) + " MT_CPU_MATVEC_STREAMS=" + streams +
                   " MT_CPU_MATVEC_PREFETCH=" + prefetch);
      std::string out;
      const int rc = test::run_command(
          std::string(kChildMarker) + "=1 MT_CPU_MATVEC=" + set +
              " MT_CPU_MATVEC_STREAMS=" + streams + " MT_CPU_MATVEC_PREFETCH=" + prefetch +
              " MT_CPU_MATVEC_AMX=" + streams + " " + exe +
              " --gtest_filter=Gemm.MatrixVector:Gemm.Deterministic:Gemm.FewRowsEqualEachRowAlone:"
              "Gemm.Int8RowsMatchTheDequantizedMatmul:Gemm.Int8DecodeKeepsNanAndInfinity:"
              "GemmPath.DescribesPathAndPeak",
          out);
      EXPECT_EQ(rc, 0) << out;
      EXPECT_NE(out.find("[  PASSED  ] 6 tests"), std::string::npos) << out;
    }
  }
  // A value the variable does not take is refused with its sentence.
  for (const auto& [setting, says] : {
           std::pair<const char*, const char*>{
               "MT_CPU_MATVEC=sse9",
               "MT_CPU_MATVEC=sse9: unknown kernel set; use portable, avx2 or avx512"},
           {"MT_CPU_MATVEC_STREAMS=4",
            "MT_CPU_MATVEC_STREAMS=4: want 0 (one weight stream per core) or 1"},
           {"MT_CPU_MATVEC_PREFETCH=yes",
            "MT_CPU_MATVEC_PREFETCH=yes: the one-stream matrix-vector kernels read"}}) {
    std::string out;
    EXPECT_NE(test::run_command(std::string(kChildMarker) + "=1 " + setting + " " + exe +
                                    " --gtest_filter=Gemm.MatrixVector",
                                out),
              0)
        << setting;
    EXPECT_NE(out.find(says), std::string::npos) << out;
  }
}

TEST(GemmPath, RespectsCoretypeFromEnvironment) {
  if (in_child()) GTEST_SKIP() << "runs as the child of this test";
  // OpenBLAS reads the variable when it loads, once per process: check it in a child process,
  // with a coretype other than the one this process may already have from its environment.
  const char* inherited = std::getenv("OPENBLAS_CORETYPE");
  const std::string coretype =
      inherited && std::string(inherited) == "Haswell" ? "Sandybridge" : "Haswell";
  std::string out;
  const int rc = test::run_command(
      "env -u MT_CPU_BLAS " + std::string(kChildMarker) + "=1 OPENBLAS_CORETYPE=" + coretype +
          " /proc/" + std::to_string(getpid()) +
          "/exe --gtest_filter=GemmPath.DescribesPathAndPeak:Gemm.AllTransposeCombinations",
      out);
  EXPECT_EQ(rc, 0) << out;
  if (rc == 0) {
    EXPECT_EQ(out.find("FAILED"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace mt
