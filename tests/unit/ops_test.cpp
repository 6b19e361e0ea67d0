// The CPU backend's non-GEMM op set: elementwise, cast, embedding, rmsnorm/layernorm, rope,
// activations (plain, gated, soft-cap), softmax and the fused cross-entropy.
//
// Every forward is compared with a plain double-precision reference written here; every backward
// with central finite differences of L = sum(out * w) (w fixed random weights) taken on that
// double reference, so the f32 kernel is the only approximate side. Tolerances (relative, with
// a floor for values near zero):
//   forward f32: 5e-5 (floor 1e-3; 1e-2 for outputs that are sums of O(1) terms);
//   backward f32: 2e-4 (floor 1e-2: gradients are O(1) and f32 cancellation is ~1e-6 absolute);
//   bf16 storage vs the f32 kernel on the same (rounded) inputs: 1.5e-2 (floor 1e-2).
// Shapes are random (odd sizes and size 1 included), draws are fresh each run: a failure
// prints the seed; MT_TEST_SEED=<seed> replays it.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "config_impl.h"
#include "mt/backend.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "mt/q8.h"
#include "test_support.h"

namespace mt {
namespace {

constexpr double kFwdTol = 5e-5, kFwdFloor = 1e-3;
constexpr double kSumFloor =
    1e-2;  // outputs that are sums of O(1) terms (rope, layernorm, CE loss)
constexpr double kBwdTol = 2e-4, kBwdFloor = 1e-2;
constexpr double kBf16Tol = 1.5e-2, kBf16Floor = 1e-2;

using Vec = std::vector<double>;
using Inputs = std::vector<Vec>;
using Forward = std::function<Vec(const Inputs&)>;

Backend& B() {
  return test::cpu();
}

Vec to_d(const std::vector<float>& v) {
  return Vec(v.begin(), v.end());
}

int64_t pick(std::mt19937_64& rng, std::initializer_list<int64_t> options) {
  std::uniform_int_distribution<size_t> d(0, options.size() - 1);
  return *(options.begin() + d(rng));
}

// Values bounded away from zero in magnitude: never an all-zero (or near-zero) input.
std::vector<float> rand_nz(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::vector<float> v = test::randn(n, rng, scale);
  for (auto& x : v)
    if (std::fabs(x) < 0.05f * scale) x = x < 0 ? -0.05f * scale : 0.05f * scale;
  return v;
}

std::vector<float> round_bf16(const std::vector<float>& v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = bf16_to_f32(f32_to_bf16(v[i]));
  return r;
}

// max_i |got - want| / max(|want_i|, floor), with the worst index in the message.
::testing::AssertionResult close(const std::vector<float>& got, const Vec& want, double tol,
                                 double floor, const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size " << got.size() << " vs " << want.size();
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double e = std::fabs(double(got[i]) - want[i]) / std::max(std::fabs(want[i]), floor);
    if (!(e <= worst)) {  // also catches NaN
      worst = std::isnan(e) ? INFINITY : e;
      at = i;
    }
  }
  if (std::getenv("MT_OPS_VERBOSE")) std::printf("  [err] %-40s %.3g\n", what.c_str(), worst);
  if (worst <= tol) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": relative error " << worst << " > " << tol << " at " << at << " (got "
         << got[at] << ", want " << want[at] << ")";
}
::testing::AssertionResult close(const std::vector<float>& got, const std::vector<float>& want,
                                 double tol, double floor, const std::string& what) {
  return close(got, to_d(want), tol, floor, what);
}

double dotw(const Vec& a, const Vec& w) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * w[i];
  return s;
}

// Central differences of L = sum(f(in) * w) with respect to in[which], in double.
Vec fd_grad(const Forward& f, Inputs in, size_t which, const Vec& w) {
  Vec g(in[which].size());
  for (size_t i = 0; i < g.size(); ++i) {
    const double x0 = in[which][i];
    const double h = 1e-5 * std::max(1.0, std::fabs(x0));
    in[which][i] = x0 + h;
    const double lp = dotw(f(in), w);
    in[which][i] = x0 - h;
    const double lm = dotw(f(in), w);
    in[which][i] = x0;
    g[i] = (lp - lm) / (2 * h);
  }
  return g;
}

// Elementwise ops out_i = f(a_i, b_i): central differences one element at a time (the generic
// fd_grad would cost O(n^2)).
Vec fd_elementwise(const std::function<double(double, double)>& f, const Vec& a, const Vec& b,
                   int which, const Vec& w) {
  Vec g(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const double x0 = which == 0 ? a[i] : b[i];
    const double h = 1e-5 * std::max(1.0, std::fabs(x0));
    const double lp = which == 0 ? f(x0 + h, b[i]) : f(a[i], x0 + h);
    const double lm = which == 0 ? f(x0 - h, b[i]) : f(a[i], x0 - h);
    g[i] = w[i] * (lp - lm) / (2 * h);
  }
  return g;
}

// Gradient the kernel accumulated on top of a random pre-fill (checks += semantics).
std::vector<float> minus(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<float> r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](float x, float y) {
           return std::bit_cast<uint32_t>(x) == std::bit_cast<uint32_t>(y);
         });
}

Tensor T(const Shape& s, const std::vector<float>& v, DType dt = DType::f32) {
  return test::from_vector(B(), s, v, dt);
}

// ================================ memory =====================================================

// Blocks of 2 MiB or more start on a huge-page boundary and are advised for transparent huge
// pages (a decode step streams its weights; 4 KiB pages cost it ~20% of its read bandwidth):
// the kernel's own view of the block (/proc/self/smaps) says it may get them. Where the kernel
// has THP off, only the alignment is checked.
TEST(Memory, LargeBlocksAreAdvisedForHugePages) {
  Tensor big = B().empty({3 << 20}, DType::f32);  // 12 MiB
  B().fill(big, 1.f);
  const auto at = reinterpret_cast<uintptr_t>(big.ptr<float>());
  EXPECT_EQ(at % (uintptr_t{2} << 20), 0u) << "a 12 MiB block not on a 2 MiB boundary";
  std::ifstream thp("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(thp, mode);
  if (mode.empty() || mode.find("[never]") != std::string::npos)
    GTEST_SKIP() << "transparent huge pages are off here (" << mode << ")";
  // The mapping holding the block: "lo-hi perms ...", then its fields up to THPeligible.
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool inside = false, found = false;
  int eligible = -1;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(' ') < line.find(':')) {
      inside = lo <= at && at < hi;
      found = found || inside;
    } else if (inside && line.rfind("THPeligible:", 0) == 0) {
      eligible = std::atoi(line.c_str() + 12);
      break;
    }
  }
  ASSERT_TRUE(found) << "no mapping in /proc/self/smaps holds the block";
  if (eligible == -1) GTEST_SKIP() << "this kernel's smaps has no THPeligible field";
  EXPECT_EQ(eligible, 1) << "the 12 MiB block's mapping may not get huge pages (mode " << mode
                         << ")";
}

// ================================ elementwise ================================================

TEST(Elementwise, FillAllDtypes) {
  Tensor f = B().empty({3, 5}, DType::f32);
  B().fill(f, 1.5f);
  EXPECT_EQ(test::to_vector(f), std::vector<float>(15, 1.5f));
  Tensor h = B().empty({7}, DType::bf16);
  B().fill(h, 3.140625f);  // exactly representable in bf16
  EXPECT_EQ(test::to_vector(h), std::vector<float>(7, 3.140625f));
  Tensor i = B().empty({4}, DType::i32);
  B().fill(i, 7.f);
  EXPECT_EQ(test::to_ints(i), std::vector<int32_t>(4, 7));
  Tensor big = B().empty({100003}, DType::f32);
  B().fill(big, -2.f);
  EXPECT_EQ(B().sum(big), -200006.0);
}

TEST(Elementwise, BinaryOpsMatchReference) {
  MT_SEEDED_RNG(rng);
  for (int64_t n : {int64_t(1), int64_t(7), int64_t(2049), pick(rng, {5000, 70001})}) {
    auto a = rand_nz(n, rng), b = rand_nz(n, rng);
    const float s = 0.37f, alpha = -1.25f;
    Vec add(n), mul(n), sc(n), ax(n);
    for (int64_t i = 0; i < n; ++i) {
      add[i] = double(a[i]) + b[i];
      mul[i] = double(a[i]) * b[i];
      sc[i] = double(a[i]) * s;
      ax[i] = double(b[i]) + alpha * double(a[i]);
    }
    Tensor ta = T({n}, a), tb = T({n}, b), out = B().empty({n}, DType::f32);
    B().add(ta, tb, out);
    EXPECT_TRUE(close(test::to_vector(out), add, 1e-7, 1e-3, "add"));
    B().mul(ta, tb, out);
    EXPECT_TRUE(close(test::to_vector(out), mul, 1e-7, 1e-3, "mul"));
    B().scale(ta, s, out);
    EXPECT_TRUE(close(test::to_vector(out), sc, 1e-7, 1e-3, "scale"));
    Tensor y = T({n}, b);
    B().axpy(alpha, ta, y);
    {
      // Two roundings (the product, then the sum) unless the compiler fuses them, which depends
      // on the instruction set the kernel was built for: the error is bounded by the summands'
      // size (2 u (|alpha a| + |b|)), not the result's, which cancellation can make tiny.
      const std::vector<float> got = test::to_vector(y);
      double worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double size = std::fabs(double(b[i])) + std::fabs(alpha * double(a[i]));
        const double e = std::fabs(double(got[i]) - ax[i]) / size;
        if (!(e <= worst)) worst = std::isnan(e) ? INFINITY : e;
      }
      EXPECT_LE(worst, 1.2e-7) << "axpy: error relative to the summands";
    }
    // In place (out aliases an input), as residual adds do.
    Tensor z = T({n}, a);
    B().add(z, tb, z);
    EXPECT_TRUE(close(test::to_vector(z), add, 1e-7, 1e-3, "add in place"));

    // bf16 operands and results: f32 arithmetic on the rounded inputs, one final rounding (the
    // kernel may fuse a * x + y, so allow one bf16 step: 2^-7 relative).
    const auto ar = round_bf16(a), br = round_bf16(b);
    Tensor ha = T({n}, a, DType::bf16), hb = T({n}, b, DType::bf16);
    Tensor ho = B().empty({n}, DType::bf16);
    B().add(ha, tb, ho);  // mixed bf16 + f32 -> bf16
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = ar[i] + b[i];
    EXPECT_TRUE(close(test::to_vector(ho), round_bf16(want), 1e-2, 1e-3, "add bf16"));
    B().mul(ha, hb, ho);
    for (int64_t i = 0; i < n; ++i) want[i] = ar[i] * br[i];
    EXPECT_TRUE(close(test::to_vector(ho), round_bf16(want), 1e-2, 1e-3, "mul bf16"));
    Tensor hy = T({n}, b, DType::bf16);
    B().axpy(alpha, ta, hy);
    for (int64_t i = 0; i < n; ++i) want[i] = br[i] + alpha * a[i];
    EXPECT_TRUE(close(test::to_vector(hy), round_bf16(want), 1e-2, 1e-3, "axpy bf16"));
  }
}

TEST(Elementwise, SumsInDoubleAndDeterministic) {
  MT_SEEDED_RNG(rng);
  for (int64_t n : {int64_t(1), int64_t(9), int64_t(65537), pick(rng, {300001, 1000003})}) {
    auto a = rand_nz(n, rng, 3.f);
    double s = 0, ss = 0;
    for (float v : a) {
      s += v;
      ss += double(v) * v;
    }
    Tensor t = T({n}, a);
    const double got = B().sum(t), got2 = B().sum_squares(t);
    // Both sides sum in double, in different orders: ~sqrt(n) ulps apart.
    EXPECT_NEAR(got, s, 1e-11 * ss) << "n=" << n;
    EXPECT_NEAR(got2, ss, 1e-11 * ss) << "n=" << n;
    EXPECT_EQ(got, B().sum(t));  // bitwise: fixed blocking
    EXPECT_EQ(got2, B().sum_squares(t));
    Tensor h = T({n}, a, DType::bf16);
    double hs = 0;
    for (float v : round_bf16(a)) hs += v;
    EXPECT_NEAR(B().sum(h), hs, 1e-11 * ss);
  }
}

TEST(Elementwise, ShapeMismatchThrows) {
  Tensor a = B().empty({3}, DType::f32), b = B().empty({4}, DType::f32);
  EXPECT_THROW(B().add(a, b, a), Error);
  Tensor i = B().empty({3}, DType::i32);
  EXPECT_THROW(B().mul(a, i, a), Error);
}

// ================================ cast =======================================================

// Independent round-to-nearest-even: pick the nearer of the two bf16 neighbours in double.
uint16_t ref_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;  // checked separately: any NaN pattern is accepted
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xffff) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // next away from zero (may become inf)
  const double dl = std::fabs(double(f) - bf16_to_f32(lo));
  // Past the largest finite bf16 the upper neighbour is 2^128 (the rounding boundary to inf).
  const double hv = std::isinf(bf16_to_f32(hi)) ? std::copysign(std::ldexp(1.0, 128), f)
                                                : double(bf16_to_f32(hi));
  const double dh = std::fabs(hv - double(f));
  if (dl < dh) return lo;
  if (dh < dl) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(Cast, RoundToNearestEvenAndNaN) {
  MT_SEEDED_RNG(rng);
  std::vector<float> v = {1.0f,
                          1.00390625f /* tie -> even 1.0 */,
                          1.01171875f /* tie -> up */,
                          -1.00390625f,
                          0.f,
                          -0.f,
                          1e-40f /* denormal */,
                          -3e-39f,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          3.3895e38f /* rounds to inf */,
                          std::numeric_limits<float>::quiet_NaN(),
                          std::bit_cast<float>(0x7f800001u) /* signalling NaN, low payload */,
                          std::bit_cast<float>(0xff810000u)};
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 5000; ++i) v.push_back(std::bit_cast<float>(bits(rng)));
  const int64_t n = static_cast<int64_t>(v.size());
  Tensor f = B().empty({n}, DType::f32);
  B().copy_from_host(f, v.data());
  Tensor h = B().empty({n}, DType::bf16);
  B().cast(f, h);
  std::vector<uint16_t> got(n);
  B().copy_to_host(h, got.data());
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(v[i])) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(got[i])))
          << "NaN " << std::hex << std::bit_cast<uint32_t>(v[i]);
      EXPECT_EQ(got[i] & 0x8000, (std::bit_cast<uint32_t>(v[i]) >> 16) & 0x8000);
    } else {
      ASSERT_EQ(got[i], ref_bf16(v[i]))
          << "value " << v[i] << " bits " << std::hex << std::bit_cast<uint32_t>(v[i]);
    }
  }
  // bf16 -> f32 -> bf16 is the identity on every non-NaN pattern.
  std::vector<uint16_t> all(65536);
  for (int i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  Tensor a = B().empty({65536}, DType::bf16), af = B().empty({65536}, DType::f32);
  Tensor back = B().empty({65536}, DType::bf16);
  B().copy_from_host(a, all.data());
  B().cast(a, af);
  B().cast(af, back);
  std::vector<float> widened(65536);
  std::vector<uint16_t> round_trip(65536);
  B().copy_to_host(af, widened.data());
  B().copy_to_host(back, round_trip.data());
  for (int i = 0; i < 65536; ++i) {
    ASSERT_EQ(std::bit_cast<uint32_t>(widened[i]), uint32_t(i) << 16);
    if (!std::isnan(widened[i]))
      ASSERT_EQ(round_trip[i], all[i]);
    else
      ASSERT_TRUE(std::isnan(bf16_to_f32(round_trip[i])));
  }
}

TEST(Cast, SameDtypeCopies) {
  std::vector<int32_t> ids = {3, -1, 7, 2147483647, 0};
  Tensor a = test::from_ints(B(), {5}, ids), b = B().empty({5}, DType::i32);
  B().cast(a, b);
  EXPECT_EQ(test::to_ints(b), ids);
  Tensor f = T({2, 2}, {1, 2, 3, 4}), g = B().empty({4}, DType::f32);
  B().cast(f, g);
  EXPECT_EQ(test::to_vector(g), (std::vector<float>{1, 2, 3, 4}));
  Tensor e1 = B().empty({0, 4}, DType::f32), e2 = B().empty({0}, DType::bf16);
  B().cast(e1, e2);  // empty tensors are fine
  EXPECT_EQ(B().sum(e1), 0.0);
  Tensor bad = B().empty({3}, DType::f32);
  EXPECT_THROW(B().cast(f, bad), Error);
  EXPECT_THROW(B().cast(a, g), Error);  // i32 -> f32 is not a supported conversion
}

// ================================ embedding ==================================================

TEST(Embedding, ForwardBackwardDeterministic) {
  MT_SEEDED_RNG(rng);
  for (int rep = 0; rep < 3; ++rep) {
    const int64_t V = pick(rng, {1, 5, 37}), D = pick(rng, {1, 3, 16, 65}),
                  N = pick(rng, {1, 7, 64, 300});
    std::uniform_int_distribution<int32_t> idd(0, static_cast<int32_t>(V - 1));
    std::vector<int32_t> ids(N);
    for (auto& i : ids) i = idd(rng);
    auto table = rand_nz(V * D, rng);
    Tensor tt = T({V, D}, table), ti = test::from_ints(B(), {N}, ids);
    Tensor out = B().empty({N, D}, DType::f32);
    B().embedding_forward(tt, ti, out);
    Vec want(N * D);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t d = 0; d < D; ++d) want[n * D + d] = table[ids[n] * D + d];
    EXPECT_TRUE(close(test::to_vector(out), want, 0, 1, "embedding_forward"));

    // Backward: dtable[ids[n]] += dout[n], on top of a pre-filled gradient. The op is linear,
    // so the finite-difference gradient of L = sum(out * dout) is exact; compute it directly.
    auto dout = rand_nz(N * D, rng), pre = rand_nz(V * D, rng);
    Forward f = [&](const Inputs& in) {
      Vec o(N * D);
      for (int64_t n = 0; n < N; ++n)
        for (int64_t d = 0; d < D; ++d) o[n * D + d] = in[0][ids[n] * D + d];
      return o;
    };
    const Vec g = fd_grad(f, {to_d(table)}, 0, to_d(dout));
    Tensor td = T({N, D}, dout), dt = T({V, D}, pre);
    B().embedding_backward(td, ti, dt);
    const auto got = test::to_vector(dt);
    // Each row is a sum of up to N f32 terms of size O(1): floor 1.
    EXPECT_TRUE(close(minus(got, pre), g, kBwdTol, 1.0, "embedding_backward"));
    Tensor dt2 = T({V, D}, pre);
    B().embedding_backward(td, ti, dt2);
    EXPECT_TRUE(bitwise_equal(got, test::to_vector(dt2))) << "embedding_backward not deterministic";

    // bf16 table / out / dout / dtable.
    Tensor ht = T({V, D}, table, DType::bf16), ho = B().empty({N, D}, DType::bf16);
    B().embedding_forward(ht, ti, ho);
    EXPECT_TRUE(close(test::to_vector(ho), round_bf16(test::to_vector(out)), 0, 1,
                      "embedding_forward bf16"));
    Tensor of = B().empty({N, D}, DType::f32);
    B().embedding_forward(ht, ti, of);  // bf16 table -> f32 out
    EXPECT_TRUE(close(test::to_vector(of), round_bf16(test::to_vector(out)), 0, 1,
                      "embedding_forward bf16->f32"));
    // bf16 dtable: rows summed in f32, rounded once; compare with f32 on the rounded inputs.
    Tensor hd = T({N, D}, dout, DType::bf16), hdt = T({V, D}, pre, DType::bf16);
    B().embedding_backward(hd, ti, hdt);
    Tensor fdt = T({V, D}, round_bf16(pre));
    B().embedding_backward(T({N, D}, round_bf16(dout)), ti, fdt);
    EXPECT_TRUE(close(test::to_vector(hdt), round_bf16(test::to_vector(fdt)), 0, 1e-30,
                      "embedding_backward bf16"));
  }
}

TEST(Embedding, RejectsBadIds) {
  Tensor table = T({4, 2}, {1, 2, 3, 4, 5, 6, 7, 8});
  Tensor out = B().empty({2, 2}, DType::f32);
  for (int32_t bad : {4, -1, 1000}) {
    Tensor ids = test::from_ints(B(), {2}, {0, bad});
    try {
      B().embedding_forward(table, ids, out);
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::to_string(bad)), std::string::npos) << e.what();
    }
    Tensor dt = B().zeros({4, 2}, DType::f32);
    EXPECT_THROW(B().embedding_backward(out, ids, dt), Error);
  }
}

// A table of int8 rows (quantization=int8's tied embedding): each looked-up row is
// dequantize_q8_row's values exactly (f32 out), rounded once for bf16; bad ids and a table
// whose rows are not int8 rows are refused.
TEST(Embedding, Q8RowsAreTheDequantizedRows) {
  MT_SEEDED_RNG(rng);
  const int64_t V = 37, D = 96, N = 300, rb = q8_row_bytes(D);
  const auto table = rand_nz(V * D, rng);
  std::vector<int8_t> q(static_cast<size_t>(V * rb));
  for (int64_t v = 0; v < V; ++v)
    ASSERT_TRUE(quantize_q8_row(table.data() + v * D, D, q.data() + v * rb));
  Tensor tq = B().empty({V, rb}, DType::i8);
  B().copy_from_host(tq, q.data());
  std::uniform_int_distribution<int32_t> idd(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(N);
  for (auto& i : ids) i = idd(rng);
  ids[0] = 0;
  ids[1] = static_cast<int32_t>(V - 1);
  Tensor ti = test::from_ints(B(), {N}, ids);
  std::vector<float> want(N * D), rows(N * D);
  for (int64_t n = 0; n < N; ++n) {
    dequantize_q8_row(q.data() + ids[n] * rb, D, &want[n * D]);
    std::copy_n(table.begin() + ids[n] * D, D, rows.begin() + n * D);
  }
  Tensor out = B().empty({N, D}, DType::f32);
  B().embedding_q8_forward(tq, ti, out);
  EXPECT_TRUE(bitwise_equal(test::to_vector(out), want));
  EXPECT_LT(test::scaled_err(test::to_vector(out), rows), 0.01);  // int8's rounding, no more
  Tensor ho = B().empty({N, D}, DType::bf16);
  B().embedding_q8_forward(tq, ti, ho);
  EXPECT_TRUE(bitwise_equal(test::to_vector(ho), round_bf16(want)));
  for (int32_t bad : {static_cast<int32_t>(V), -1}) {
    Tensor b = test::from_ints(B(), {2}, {0, bad});
    Tensor o = B().empty({2, D}, DType::f32);
    try {
      B().embedding_q8_forward(tq, b, o);
      ADD_FAILURE() << "no error for id " << bad;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos)
          << e.what();
    }
  }
  Tensor dense = T({V, D}, table), o = B().empty({N, D}, DType::f32);
  EXPECT_THROW(B().embedding_q8_forward(dense, ti, o), Error);  // not int8 rows
  Tensor odd = B().empty({V, 40}, DType::i8);                   // 40 bytes: no K + K / 16
  EXPECT_THROW(B().embedding_q8_forward(odd, ti, o), Error);
}

// ================================ normalisation ==============================================

Vec rmsnorm_ref(const Vec& x, const Vec& w, int64_t N, int64_t D, double eps, bool plus_one,
                Vec* rstd = nullptr) {
  Vec out(N * D);
  if (rstd) rstd->resize(N);
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += x[n * D + d] * x[n * D + d];
    const double r = 1.0 / std::sqrt(ss / D + eps);
    if (rstd) (*rstd)[n] = r;
    for (int64_t d = 0; d < D; ++d)
      out[n * D + d] = x[n * D + d] * r * (plus_one ? 1.0 + w[d] : w[d]);
  }
  return out;
}

TEST(RmsNorm, ForwardBackwardAgainstReference) {
  MT_SEEDED_RNG(rng);
  const float eps = 1e-6f;
  for (bool plus_one : {false, true}) {
    for (int rep = 0; rep < 4; ++rep) {
      // D = 1 is left out: there dx ~ eps / x^2 is pure f32 cancellation.
      const int64_t N = pick(rng, {1, 3, 5}), D = pick(rng, {2, 7, 33, 64});
      auto x = rand_nz(N * D, rng), w = rand_nz(D, rng, 0.5f), dout = rand_nz(N * D, rng);
      const std::string tag = std::string(plus_one ? "rmsnorm(1+w)" : "rmsnorm") +
                              " N=" + std::to_string(N) + " D=" + std::to_string(D);
      Tensor tx = T({N, D}, x), tw = T({D}, w), out = B().empty({N, D}, DType::f32);
      Tensor rstd = B().empty({N}, DType::f32);
      B().rmsnorm_forward(tx, tw, eps, plus_one, out, rstd);
      Vec r;
      const Vec want = rmsnorm_ref(to_d(x), to_d(w), N, D, eps, plus_one, &r);
      EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, kFwdFloor, tag + " forward"));
      EXPECT_TRUE(close(test::to_vector(rstd), r, kFwdTol, kFwdFloor, tag + " rstd"));

      Forward f = [&](const Inputs& in) { return rmsnorm_ref(in[0], in[1], N, D, eps, plus_one); };
      const Inputs in = {to_d(x), to_d(w)};
      auto pre_dx = rand_nz(N * D, rng), pre_dw = rand_nz(D, rng);
      Tensor tg = T({N, D}, dout), dx = T({N, D}, pre_dx), dw = T({D}, pre_dw);
      B().rmsnorm_backward(tg, tx, tw, rstd, plus_one, dx, dw);
      EXPECT_TRUE(close(minus(test::to_vector(dx), pre_dx), fd_grad(f, in, 0, to_d(dout)), kBwdTol,
                        kBwdFloor, tag + " dx"));
      EXPECT_TRUE(close(minus(test::to_vector(dw), pre_dw), fd_grad(f, in, 1, to_d(dout)), kBwdTol,
                        kBwdFloor, tag + " dw"));
    }
  }
}

// Many rows: the weight gradient is reduced over several row blocks; analytic double reference
// (d/dw of sum(dout * out) = sum_n dout * x * rstd), bf16 variants and determinism.
TEST(RmsNorm, ManyRowsBf16AndDeterminism) {
  MT_SEEDED_RNG(rng);
  const int64_t N = pick(rng, {257, 1000, 9000}), D = pick(rng, {48, 129});
  const float eps = 1e-5f;
  auto x = rand_nz(N * D, rng), w = rand_nz(D, rng), dout = rand_nz(N * D, rng);
  Vec r;
  const Vec want = rmsnorm_ref(to_d(x), to_d(w), N, D, eps, false, &r);
  Vec dw_ref(D, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) dw_ref[d] += double(dout[n * D + d]) * x[n * D + d] * r[n];
  Tensor tx = T({N, D}, x), tw = T({D}, w), out = B().empty({N, D}, DType::f32);
  Tensor rstd = B().empty({N}, DType::f32);
  B().rmsnorm_forward(tx, tw, eps, false, out, rstd);
  EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, kFwdFloor, "rmsnorm forward many rows"));
  Tensor tg = T({N, D}, dout);
  Tensor dx = B().zeros({N, D}, DType::f32), dw = B().zeros({D}, DType::f32);
  B().rmsnorm_backward(tg, tx, tw, rstd, false, dx, dw);
  // f32 sums over N rows: allow for N * eps growth.
  EXPECT_TRUE(close(test::to_vector(dw), dw_ref, 1e-4, 1.0, "rmsnorm dw many rows"));
  Tensor dx2 = B().zeros({N, D}, DType::f32), dw2 = B().zeros({D}, DType::f32);
  B().rmsnorm_backward(tg, tx, tw, rstd, false, dx2, dw2);
  EXPECT_TRUE(bitwise_equal(test::to_vector(dx), test::to_vector(dx2)));
  EXPECT_TRUE(bitwise_equal(test::to_vector(dw), test::to_vector(dw2)));

  // bf16 everywhere, against the f32 kernel on the same rounded inputs.
  Tensor hx = T({N, D}, x, DType::bf16), hw = T({D}, w, DType::bf16);
  Tensor ho = B().empty({N, D}, DType::bf16), hr = B().empty({N}, DType::f32);
  B().rmsnorm_forward(hx, hw, eps, false, ho, hr);
  Tensor fx = T({N, D}, round_bf16(x)), fw = T({D}, round_bf16(w));
  Tensor fo = B().empty({N, D}, DType::f32), fr = B().empty({N}, DType::f32);
  B().rmsnorm_forward(fx, fw, eps, false, fo, fr);
  EXPECT_TRUE(close(test::to_vector(ho), test::to_vector(fo), kBf16Tol, kBf16Floor,
                    "rmsnorm forward bf16"));
  Tensor hg = T({N, D}, dout, DType::bf16), fg = T({N, D}, round_bf16(dout));
  Tensor hdx = B().zeros({N, D}, DType::bf16), hdw = B().zeros({D}, DType::bf16);
  Tensor fdx = B().zeros({N, D}, DType::f32), fdw = B().zeros({D}, DType::f32);
  B().rmsnorm_backward(hg, hx, hw, hr, false, hdx, hdw);
  B().rmsnorm_backward(fg, fx, fw, fr, false, fdx, fdw);
  EXPECT_TRUE(
      close(test::to_vector(hdx), test::to_vector(fdx), kBf16Tol, kBf16Floor, "rmsnorm dx bf16"));
  EXPECT_TRUE(close(test::to_vector(hdw), test::to_vector(fdw), kBf16Tol, 1.0, "rmsnorm dw bf16"));
}

// The kernels that sum rows into a parameter's f32 gradient add their sum to it once: a
// gradient g accumulated into is g + (the result into zeros), to the bit, so gradient
// accumulation over micro-batches adds the micro-batches' results as data parallelism's ranks
// do (before: each row was added onto g, rounding differently). Many rows (several of the
// norms' row blocks), repeated ids and destinations.
TEST(Accumulation, RowSumKernelsAddTheirSumOnce) {
  MT_SEEDED_RNG(rng);
  const int64_t N = 1000, D = 48, V = 7;
  auto x = rand_nz(N * D, rng), w = rand_nz(D, rng), dout = rand_nz(N * D, rng);
  auto pre_w = rand_nz(D, rng), pre_b = rand_nz(D, rng), pre_t = rand_nz(V * D, rng);
  auto plus = [](const std::vector<float>& a, const std::vector<float>& b) {
    std::vector<float> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
    return r;
  };
  Tensor tx = T({N, D}, x), tw = T({D}, w), tg = T({N, D}, dout);
  // rmsnorm's dw (and dx).
  Tensor out = B().empty({N, D}, DType::f32), rstd = B().empty({N}, DType::f32);
  B().rmsnorm_forward(tx, tw, 1e-5f, false, out, rstd);
  Tensor dx0 = B().zeros({N, D}, DType::f32), dw0 = B().zeros({D}, DType::f32);
  B().rmsnorm_backward(tg, tx, tw, rstd, false, dx0, dw0);
  Tensor dx1 = T({N, D}, x), dw1 = T({D}, pre_w);
  B().rmsnorm_backward(tg, tx, tw, rstd, false, dx1, dw1);
  EXPECT_TRUE(bitwise_equal(test::to_vector(dw1), plus(pre_w, test::to_vector(dw0))));
  EXPECT_TRUE(bitwise_equal(test::to_vector(dx1), plus(x, test::to_vector(dx0))));
  // layernorm's dw and db.
  Tensor tb = T({D}, pre_b), mean = B().empty({N}, DType::f32);
  B().layernorm_forward(tx, tw, tb, 1e-5f, out, mean, rstd);
  Tensor db0 = B().zeros({D}, DType::f32);
  dw0 = B().zeros({D}, DType::f32);
  dx0 = B().zeros({N, D}, DType::f32);
  B().layernorm_backward(tg, tx, tw, mean, rstd, dx0, dw0, db0);
  Tensor db1 = T({D}, pre_b);
  dw1 = T({D}, pre_w);
  B().layernorm_backward(tg, tx, tw, mean, rstd, dx0, dw1, db1);
  EXPECT_TRUE(bitwise_equal(test::to_vector(dw1), plus(pre_w, test::to_vector(dw0))));
  EXPECT_TRUE(bitwise_equal(test::to_vector(db1), plus(pre_b, test::to_vector(db0))));
  // The embedding's rows and scatter_add_rows (weighted or not): N rows onto V.
  std::vector<int32_t> ids(N);
  for (auto& i : ids) i = static_cast<int32_t>(rng() % V);
  Tensor ti = test::from_ints(B(), {N}, ids), tw8 = T({N}, rand_nz(N, rng));
  Tensor t0 = B().zeros({V, D}, DType::f32), t1 = T({V, D}, pre_t);
  B().embedding_backward(tg, ti, t0);
  B().embedding_backward(tg, ti, t1);
  EXPECT_TRUE(bitwise_equal(test::to_vector(t1), plus(pre_t, test::to_vector(t0))));
  for (const bool weighted : {false, true}) {
    Tensor s0 = B().zeros({V, D}, DType::f32), s1 = T({V, D}, pre_t);
    B().scatter_add_rows(tg, ti, weighted ? tw8 : Tensor(), s0);
    B().scatter_add_rows(tg, ti, weighted ? tw8 : Tensor(), s1);
    EXPECT_TRUE(bitwise_equal(test::to_vector(s1), plus(pre_t, test::to_vector(s0)))) << weighted;
  }
}

Vec layernorm_ref(const Vec& x, const Vec& w, const Vec* b, int64_t N, int64_t D, double eps) {
  Vec out(N * D);
  for (int64_t n = 0; n < N; ++n) {
    double m = 0, v = 0;
    for (int64_t d = 0; d < D; ++d) m += x[n * D + d];
    m /= D;
    for (int64_t d = 0; d < D; ++d) v += (x[n * D + d] - m) * (x[n * D + d] - m);
    const double r = 1.0 / std::sqrt(v / D + eps);
    for (int64_t d = 0; d < D; ++d)
      out[n * D + d] = (x[n * D + d] - m) * r * w[d] + (b ? (*b)[d] : 0.0);
  }
  return out;
}

TEST(LayerNorm, ForwardBackwardAgainstReference) {
  MT_SEEDED_RNG(rng);
  const float eps = 1e-5f;
  for (bool bias : {true, false}) {
    for (int rep = 0; rep < 4; ++rep) {
      // Tiny D is left out: there dx is mostly f32 cancellation (exactly 0 in theory for D = 1).
      const int64_t N = pick(rng, {1, 2, 5}), D = pick(rng, {5, 7, 33, 64});
      auto x = rand_nz(N * D, rng, 2.f), w = rand_nz(D, rng), b = rand_nz(D, rng);
      for (auto& v : x) v += 0.7f;  // a non-zero mean
      auto dout = rand_nz(N * D, rng);
      const std::string tag = std::string(bias ? "layernorm+b" : "layernorm") +
                              " N=" + std::to_string(N) + " D=" + std::to_string(D);
      Tensor tx = T({N, D}, x), tw = T({D}, w), tb = bias ? T({D}, b) : Tensor();
      Tensor out = B().empty({N, D}, DType::f32);
      Tensor mean = B().empty({N}, DType::f32), rstd = B().empty({N}, DType::f32);
      B().layernorm_forward(tx, tw, tb, eps, out, mean, rstd);
      const Vec bd = to_d(b);
      const Vec want = layernorm_ref(to_d(x), to_d(w), bias ? &bd : nullptr, N, D, eps);
      EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, kSumFloor, tag + " forward"));

      Forward f = [&](const Inputs& in) {
        return layernorm_ref(in[0], in[1], bias ? &in[2] : nullptr, N, D, eps);
      };
      const Inputs in = {to_d(x), to_d(w), bd};
      auto pre_dx = rand_nz(N * D, rng), pre_dw = rand_nz(D, rng), pre_db = rand_nz(D, rng);
      Tensor tg = T({N, D}, dout), dx = T({N, D}, pre_dx), dw = T({D}, pre_dw);
      Tensor db = bias ? T({D}, pre_db) : Tensor();
      B().layernorm_backward(tg, tx, tw, mean, rstd, dx, dw, db);
      EXPECT_TRUE(close(minus(test::to_vector(dx), pre_dx), fd_grad(f, in, 0, to_d(dout)), kBwdTol,
                        kBwdFloor, tag + " dx"));
      EXPECT_TRUE(close(minus(test::to_vector(dw), pre_dw), fd_grad(f, in, 1, to_d(dout)), kBwdTol,
                        kBwdFloor, tag + " dw"));
      if (bias) {
        EXPECT_TRUE(close(minus(test::to_vector(db), pre_db), fd_grad(f, in, 2, to_d(dout)),
                          kBwdTol, kBwdFloor, tag + " db"));
      }
    }
  }
}

TEST(LayerNorm, ManyRowsBf16AndDeterminism) {
  MT_SEEDED_RNG(rng);
  const int64_t N = pick(rng, {300, 2000}), D = pick(rng, {40, 97});
  const float eps = 1e-5f;
  auto x = rand_nz(N * D, rng), w = rand_nz(D, rng), b = rand_nz(D, rng),
       dout = rand_nz(N * D, rng);
  auto run = [&](DType dt, const std::vector<float>& xs, const std::vector<float>& ws,
                 const std::vector<float>& bs, const std::vector<float>& gs) {
    Tensor tx = T({N, D}, xs, dt), tw = T({D}, ws, dt), tb = T({D}, bs, dt);
    Tensor out = B().empty({N, D}, dt), mean = B().empty({N}, DType::f32),
           rstd = B().empty({N}, DType::f32);
    B().layernorm_forward(tx, tw, tb, eps, out, mean, rstd);
    Tensor tg = T({N, D}, gs, dt);
    Tensor dx = B().zeros({N, D}, dt), dw = B().zeros({D}, dt), db = B().zeros({D}, dt);
    B().layernorm_backward(tg, tx, tw, mean, rstd, dx, dw, db);
    return std::vector<std::vector<float>>{test::to_vector(out), test::to_vector(dx),
                                           test::to_vector(dw), test::to_vector(db)};
  };
  const auto a = run(DType::f32, x, w, b, dout), a2 = run(DType::f32, x, w, b, dout);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(bitwise_equal(a[i], a2[i])) << "output " << i;
  Vec dbr(D, 0.0);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t d = 0; d < D; ++d) dbr[d] += dout[n * D + d];
  EXPECT_TRUE(close(a[3], dbr, 1e-4, 1.0, "layernorm db many rows"));
  const auto h = run(DType::bf16, x, w, b, dout);
  const auto f = run(DType::f32, round_bf16(x), round_bf16(w), round_bf16(b), round_bf16(dout));
  const char* names[] = {"out", "dx", "dw", "db"};
  for (int i = 0; i < 4; ++i)
    EXPECT_TRUE(close(h[i], f[i], kBf16Tol, i >= 2 ? 1.0 : kBf16Floor,
                      std::string("layernorm bf16 ") + names[i]));
}

// ================================ rope =======================================================

// The inverse frequencies as Hugging Face transformers computes them (rope_init_functions:
// _compute_default_rope_parameters, _compute_llama3_parameters, _compute_yarn_parameters),
// written out in double, then stored as f32 like HF's inv_freq buffer.
struct HfRope {
  std::vector<float> inv_freq;
  double attention_factor = 1.0;
};

HfRope hf_rope(const RopeSpec& s, int64_t dim) {
  const double base = s.theta;
  Vec inv_freq(dim / 2);
  for (int64_t k = 0; k < dim / 2; ++k)  // 1 / base ** (arange(0, dim, 2) / dim)
    inv_freq[k] = 1.0 / std::pow(base, double(2 * k) / double(dim));
  HfRope out;
  if (s.type == RopeSpec::Type::llama3) {
    const double factor = s.factor, low_freq_factor = s.low_freq_factor,
                 high_freq_factor = s.high_freq_factor;
    const double old_context_len = double(s.original_max_position);
    const double low_freq_wavelen = old_context_len / low_freq_factor;
    const double high_freq_wavelen = old_context_len / high_freq_factor;
    for (auto& f : inv_freq) {
      const double wavelen = 2 * std::numbers::pi / f;
      // inv_freq_llama = where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
      const double inv_freq_llama = wavelen > low_freq_wavelen ? f / factor : f;
      const double smooth_factor =
          (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
      const double smoothed =
          (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama;
      const bool is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      f = is_medium ? smoothed : inv_freq_llama;
    }
  } else if (s.type == RopeSpec::Type::yarn) {
    const double factor = s.factor, max_pos = double(s.original_max_position);
    auto get_mscale = [](double scale) { return scale <= 1 ? 1.0 : 0.1 * std::log(scale) + 1.0; };
    out.attention_factor = s.attention_factor != 0.f ? s.attention_factor : get_mscale(factor);
    auto find_correction_dim = [&](double num_rotations) {
      return (double(dim) * std::log(max_pos / (num_rotations * 2 * std::numbers::pi))) /
             (2 * std::log(base));
    };
    double low = std::floor(find_correction_dim(s.beta_fast));
    double high = std::ceil(find_correction_dim(s.beta_slow));
    low = std::max(low, 0.0);
    high = std::min(high, double(dim - 1));
    if (low == high) high += 0.001;
    for (int64_t k = 0; k < dim / 2; ++k) {
      const double pos_freqs = std::pow(base, double(2 * k) / double(dim));
      const double inv_freq_extrapolation = 1.0 / pos_freqs;
      const double inv_freq_interpolation = 1.0 / (factor * pos_freqs);
      const double ramp = std::clamp((double(k) - low) / (high - low), 0.0, 1.0);
      const double inv_freq_extrapolation_factor = 1 - ramp;
      inv_freq[k] = inv_freq_interpolation * (1 - inv_freq_extrapolation_factor) +
                    inv_freq_extrapolation * inv_freq_extrapolation_factor;
    }
  } else if (s.type == RopeSpec::Type::linear) {
    for (auto& f : inv_freq) f /= s.factor;  // _compute_linear_scaling_rope_parameters
  }
  for (double f : inv_freq) out.inv_freq.push_back(static_cast<float>(f));
  return out;
}

// x [B, T, H, D], positions [B, T]
Vec rope_ref(const Vec& x, const std::vector<int32_t>& pos, const RopeSpec& s, int64_t BT,
             int64_t H, int64_t D) {
  const int64_t R = s.rotary_dim ? s.rotary_dim : D, half = R / 2;
  const HfRope hf = hf_rope(s, R);
  Vec out(x.size());
  for (int64_t bt = 0; bt < BT; ++bt)
    for (int64_t h = 0; h < H; ++h) {
      const double* xi = &x[(bt * H + h) * D];
      double* o = &out[(bt * H + h) * D];
      for (int64_t d = R; d < D; ++d) o[d] = xi[d];
      for (int64_t k = 0; k < half; ++k) {
        const double a = double(pos[bt]) * double(hf.inv_freq[k]);
        const double c = std::cos(a) * hf.attention_factor, sn = std::sin(a) * hf.attention_factor;
        const int64_t i = s.interleaved ? 2 * k : k, j = s.interleaved ? 2 * k + 1 : k + half;
        o[i] = xi[i] * c - xi[j] * sn;
        o[j] = xi[j] * c + xi[i] * sn;
      }
    }
  return out;
}

std::vector<RopeSpec> rope_specs() {
  std::vector<RopeSpec> specs;
  RopeSpec s;
  specs.push_back(s);               // default, theta 1e4
  s.type = RopeSpec::Type::llama3;  // Llama 3.1 defaults
  s.theta = 500000.f;
  s.factor = 8.f;
  s.low_freq_factor = 1.f;
  s.high_freq_factor = 4.f;
  s.original_max_position = 8192;
  specs.push_back(s);
  RopeSpec y;
  y.type = RopeSpec::Type::yarn;
  y.theta = 10000.f;
  y.factor = 4.f;
  y.original_max_position = 4096;
  specs.push_back(y);
  y.attention_factor = 0.85f;  // explicit attention factor
  y.beta_fast = 16.f;
  specs.push_back(y);
  RopeSpec lin;  // Gemma 3's global layers: theta 1e6, frequencies divided by 8
  lin.type = RopeSpec::Type::linear;
  lin.theta = 1000000.f;
  lin.factor = 8.f;
  specs.push_back(lin);
  return specs;
}

TEST(Rope, MatchesHuggingFaceFormulas) {
  MT_SEEDED_RNG(rng);
  std::uniform_int_distribution<int32_t> pd(0, 131072);
  const char* names[] = {"standard", "llama3", "yarn", "yarn(af)", "linear"};
  int si = 0;
  for (RopeSpec spec : rope_specs()) {
    for (bool inter : {false, true}) {
      for (bool partial : {false, true}) {
        const int64_t Bn = pick(rng, {1, 2}), Tn = pick(rng, {1, 3}), H = pick(rng, {1, 3});
        const int64_t D = pick(rng, {8, 64, 128});
        spec.interleaved = inter;
        spec.rotary_dim = partial ? static_cast<int>(pick(rng, {D / 2, D - 2})) : 0;
        std::vector<int32_t> pos(Bn * Tn);
        for (auto& p : pos) p = pd(rng);
        pos[0] = 1;
        const std::string tag = std::string("rope ") + names[si] + (inter ? " interleaved" : "") +
                                (partial ? " partial" : "") + " D=" + std::to_string(D);
        auto x = rand_nz(Bn * Tn * H * D, rng), dout = rand_nz(x.size(), rng);
        Tensor tx = T({Bn, Tn, H, D}, x), tp = test::from_ints(B(), {Bn, Tn}, pos);
        Tensor out = B().empty({Bn, Tn, H, D}, DType::f32);
        B().rope_forward(tx, tp, spec, out);
        const Vec want = rope_ref(to_d(x), pos, spec, Bn * Tn, H, D);
        EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, kSumFloor, tag + " forward"));

        Forward f = [&](const Inputs& in) { return rope_ref(in[0], pos, spec, Bn * Tn, H, D); };
        auto pre = rand_nz(x.size(), rng);
        Tensor tg = T({Bn, Tn, H, D}, dout), dx = T({Bn, Tn, H, D}, pre);
        B().rope_backward(tg, tp, spec, dx);
        EXPECT_TRUE(close(minus(test::to_vector(dx), pre), fd_grad(f, {to_d(x)}, 0, to_d(dout)),
                          kBwdTol, kBwdFloor, tag + " backward"));

        Tensor hx = T({Bn, Tn, H, D}, x, DType::bf16), ho = B().empty({Bn, Tn, H, D}, DType::bf16);
        B().rope_forward(hx, tp, spec, ho);
        Tensor fx = T({Bn, Tn, H, D}, round_bf16(x));
        B().rope_forward(fx, tp, spec, out);
        EXPECT_TRUE(
            close(test::to_vector(ho), test::to_vector(out), kBf16Tol, kBf16Floor, tag + " bf16"));
      }
    }
    ++si;
  }
}

// Spot values of the frequency tables that do not depend on the reference above.
TEST(Rope, FrequencyTableSpotChecks) {
  // Llama 3.1 (dim 128, theta 5e5, factor 8, 8192): the highest frequency (k = 0, wavelength
  // 2 pi < 2048) is unchanged: position 1 rotates (x0, x64) by exactly 1 radian.
  RopeSpec l;
  l.type = RopeSpec::Type::llama3;
  l.theta = 500000.f;
  l.factor = 8.f;
  const int64_t D = 128;
  std::vector<float> x(D, 0.f);
  x[0] = 1.f;
  x[D - 1] = 1.f;  // feature 127 pairs with 63, the lowest frequency
  Tensor tx = T({1, 1, 1, D}, x), out = B().empty({1, 1, 1, D}, DType::f32);
  Tensor p1 = test::from_ints(B(), {1, 1}, {1});
  B().rope_forward(tx, p1, l, out);
  auto o = test::to_vector(out);
  EXPECT_NEAR(o[0], std::cos(1.0), 1e-7);
  EXPECT_NEAR(o[64], std::sin(1.0), 1e-7);
  // Lowest frequency: wavelength > 8192, so divided by the factor 8.
  const double f63 = 1.0 / std::pow(500000.0, 126.0 / 128.0) / 8.0;
  Tensor pb = test::from_ints(B(), {1, 1}, {100000});
  B().rope_forward(tx, pb, l, out);
  o = test::to_vector(out);
  EXPECT_NEAR(o[D - 1], std::cos(100000.0 * double(float(f63))), 1e-6);
  EXPECT_NEAR(o[63], -std::sin(100000.0 * double(float(f63))), 1e-6);

  // YaRN default attention factor 0.1 ln(4) + 1 scales a position-0 vector.
  RopeSpec y;
  y.type = RopeSpec::Type::yarn;
  y.factor = 4.f;
  Tensor p0 = test::from_ints(B(), {1, 1}, {0});
  B().rope_forward(tx, p0, y, out);
  o = test::to_vector(out);
  EXPECT_NEAR(o[0], 0.1 * std::log(4.0) + 1.0, 1e-6);
  EXPECT_EQ(o[1], 0.f);
}

TEST(Rope, RejectsBadShapes) {
  Tensor x = B().zeros({1, 2, 1, 6}, DType::f32), out = B().empty({1, 2, 1, 6}, DType::f32);
  Tensor pos = test::from_ints(B(), {1, 2}, {0, 1});
  RopeSpec s;
  s.rotary_dim = 3;  // odd
  EXPECT_THROW(B().rope_forward(x, pos, s, out), Error);
  s.rotary_dim = 8;  // > head_dim
  EXPECT_THROW(B().rope_forward(x, pos, s, out), Error);
  Tensor bad_pos = test::from_ints(B(), {1, 3}, {0, 1, 2});
  EXPECT_THROW(B().rope_forward(x, bad_pos, RopeSpec{}, out), Error);
}

// ================================ activations ================================================

double act_ref(Activation a, double x) {
  switch (a) {
    case Activation::silu:
      return x / (1 + std::exp(-x));
    case Activation::gelu_tanh:
      return 0.5 * x *
             (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
    case Activation::gelu_exact:
      return 0.5 * x * (1 + std::erf(x / std::sqrt(2.0)));
    case Activation::relu:
      return x > 0 ? x : 0;
    case Activation::tanh:
      return std::tanh(x);
  }
  return 0;
}

const Activation kActs[] = {Activation::silu, Activation::gelu_tanh, Activation::gelu_exact,
                            Activation::relu, Activation::tanh};
const char* kActNames[] = {"silu", "gelu_tanh", "gelu_exact", "relu", "tanh"};

TEST(Activation, PlainAndGatedAgainstReference) {
  MT_SEEDED_RNG(rng);
  for (int ai = 0; ai < 5; ++ai) {
    const Activation act = kActs[ai];
    for (int64_t n : {int64_t(1), pick(rng, {7, 100}), pick(rng, {1025, 3000})}) {
      const std::string tag = std::string(kActNames[ai]) + " n=" + std::to_string(n);
      auto x = rand_nz(n, rng, 3.f), up = rand_nz(n, rng), dout = rand_nz(n, rng);
      auto f = [&](double a, double) { return act_ref(act, a); };
      auto fg = [&](double a, double u) { return act_ref(act, a) * u; };
      const Vec xd = to_d(x), ud = to_d(up), wd = to_d(dout);
      Vec want(n), want_g(n);
      for (int64_t i = 0; i < n; ++i) {
        want[i] = f(xd[i], 0);
        want_g[i] = fg(xd[i], ud[i]);
      }
      Tensor tx = T({n}, x), tu = T({n}, up), tg = T({n}, dout), out = B().empty({n}, DType::f32);
      B().activation_forward(act, tx, out);
      EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, kFwdFloor, tag + " forward"));
      auto pre = rand_nz(n, rng), pre2 = rand_nz(n, rng);
      Tensor dx = T({n}, pre);
      B().activation_backward(act, tg, tx, dx);
      EXPECT_TRUE(close(minus(test::to_vector(dx), pre), fd_elementwise(f, xd, ud, 0, wd), kBwdTol,
                        kBwdFloor, tag + " backward"));

      B().gated_forward(act, tx, tu, out);
      EXPECT_TRUE(close(test::to_vector(out), want_g, kFwdTol, kFwdFloor, tag + " gated forward"));
      Tensor dg = T({n}, pre), du = T({n}, pre2);
      B().gated_backward(act, tg, tx, tu, dg, du);
      EXPECT_TRUE(close(minus(test::to_vector(dg), pre), fd_elementwise(fg, xd, ud, 0, wd), kBwdTol,
                        kBwdFloor, tag + " gated dgate"));
      EXPECT_TRUE(close(minus(test::to_vector(du), pre2), fd_elementwise(fg, xd, ud, 1, wd),
                        kBwdTol, kBwdFloor, tag + " gated dup"));

      // bf16 storage against the f32 kernel on the rounded inputs.
      Tensor hx = T({n}, x, DType::bf16), hu = T({n}, up, DType::bf16),
             hg = T({n}, dout, DType::bf16);
      Tensor fx = T({n}, round_bf16(x)), fu = T({n}, round_bf16(up)),
             fgr = T({n}, round_bf16(dout));
      Tensor ho = B().empty({n}, DType::bf16);
      B().gated_forward(act, hx, hu, ho);
      B().gated_forward(act, fx, fu, out);
      EXPECT_TRUE(close(test::to_vector(ho), test::to_vector(out), kBf16Tol, kBf16Floor,
                        tag + " gated bf16 forward"));
      Tensor hdg = B().zeros({n}, DType::bf16), hdu = B().zeros({n}, DType::bf16);
      Tensor fdg = B().zeros({n}, DType::f32), fdu = B().zeros({n}, DType::f32);
      B().gated_backward(act, hg, hx, hu, hdg, hdu);
      B().gated_backward(act, fgr, fx, fu, fdg, fdu);
      EXPECT_TRUE(close(test::to_vector(hdg), test::to_vector(fdg), kBf16Tol, kBf16Floor,
                        tag + " gated bf16 dgate"));
      EXPECT_TRUE(close(test::to_vector(hdu), test::to_vector(fdu), kBf16Tol, kBf16Floor,
                        tag + " gated bf16 dup"));
    }
  }
}

TEST(Activation, ExtremeInputsStayFinite) {
  std::vector<float> x = {-1000.f, -88.f, -20.f, -1e-6f, 0.f, 1e-6f, 20.f, 88.f, 1000.f};
  const int64_t n = static_cast<int64_t>(x.size());
  for (int ai = 0; ai < 5; ++ai) {
    Tensor tx = T({n}, x), out = B().empty({n}, DType::f32), dx = B().zeros({n}, DType::f32);
    B().activation_forward(kActs[ai], tx, out);
    B().activation_backward(kActs[ai], T({n}, std::vector<float>(n, 1.f)), tx, dx);
    const auto o = test::to_vector(out), d = test::to_vector(dx);
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_NEAR(o[i], act_ref(kActs[ai], x[i]), 1e-6 * std::max(1.f, std::fabs(x[i])))
          << kActNames[ai] << " x=" << x[i];
      EXPECT_TRUE(std::isfinite(d[i])) << kActNames[ai] << " x=" << x[i];
    }
  }
}

TEST(Activation, SoftcapAgainstReference) {
  MT_SEEDED_RNG(rng);
  for (float cap : {1.f, 30.f}) {
    const int64_t n = pick(rng, {1, 17, 2500});
    auto x = rand_nz(n, rng, 2.f * cap), dout = rand_nz(n, rng);
    x[0] = 1e-4f;  // small values: tanh(x / cap) must not lose relative precision
    auto f = [&](double a, double) { return cap * std::tanh(a / cap); };
    const Vec xd = to_d(x), wd = to_d(dout);
    Vec want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = f(xd[i], 0);
    const std::string tag = "softcap " + std::to_string(cap);
    Tensor tx = T({n}, x), out = B().empty({n}, DType::f32);
    B().softcap_forward(tx, cap, out);
    EXPECT_TRUE(close(test::to_vector(out), want, kFwdTol, 1e-6, tag + " forward"));
    auto pre = rand_nz(n, rng);
    Tensor dx = T({n}, pre);
    B().softcap_backward(T({n}, dout), out, cap, dx);
    EXPECT_TRUE(close(minus(test::to_vector(dx), pre), fd_elementwise(f, xd, xd, 0, wd), kBwdTol,
                      kBwdFloor, tag + " backward"));
  }
}

// ================================ softmax and cross-entropy ==================================

Vec softmax_ref(const Vec& x, int64_t N, int64_t C) {
  Vec o(x.size());
  for (int64_t n = 0; n < N; ++n) {
    double m = -INFINITY, s = 0;
    for (int64_t c = 0; c < C; ++c) m = std::max(m, x[n * C + c]);
    for (int64_t c = 0; c < C; ++c) s += std::exp(x[n * C + c] - m);
    for (int64_t c = 0; c < C; ++c) o[n * C + c] = std::exp(x[n * C + c] - m) / s;
  }
  return o;
}

TEST(Softmax, ForwardBackwardAgainstReference) {
  MT_SEEDED_RNG(rng);
  for (int rep = 0; rep < 4; ++rep) {
    const int64_t N = pick(rng, {1, 3, 10}), C = pick(rng, {1, 5, 33, 100});
    const std::string tag = "softmax N=" + std::to_string(N) + " C=" + std::to_string(C);
    auto x = rand_nz(N * C, rng, 3.f), dout = rand_nz(N * C, rng);
    Forward f = [&](const Inputs& in) { return softmax_ref(in[0], N, C); };
    const Inputs in = {to_d(x)};
    Tensor tx = T({N, C}, x), out = B().empty({N, C}, DType::f32);
    B().softmax_forward(tx, out);
    EXPECT_TRUE(close(test::to_vector(out), f(in), kFwdTol, 1e-6, tag + " forward"));
    auto pre = rand_nz(N * C, rng);
    Tensor dx = T({N, C}, pre);
    B().softmax_backward(T({N, C}, dout), out, dx);
    EXPECT_TRUE(close(minus(test::to_vector(dx), pre), fd_grad(f, in, 0, to_d(dout)), kBwdTol,
                      kBwdFloor, tag + " backward"));
    Tensor ho = B().empty({N, C}, DType::bf16);
    B().softmax_forward(T({N, C}, x, DType::bf16), ho);
    B().softmax_forward(T({N, C}, round_bf16(x)), out);
    EXPECT_TRUE(close(test::to_vector(ho), test::to_vector(out), kBf16Tol, 1e-3, tag + " bf16"));
  }
}

// loss[n] = lse - x[t] + z lse^2 (0 where t < 0); returns loss, and lse through *lse.
Vec ce_ref(const Vec& x, const std::vector<int32_t>& t, int64_t N, int64_t V, double z,
           Vec* lse = nullptr) {
  Vec loss(N);
  if (lse) lse->resize(N);
  for (int64_t n = 0; n < N; ++n) {
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < V; ++v) m = std::max(m, x[n * V + v]);
    for (int64_t v = 0; v < V; ++v) s += std::exp(x[n * V + v] - m);
    const double l = m + std::log(s);
    if (lse) (*lse)[n] = l;
    loss[n] = t[n] < 0 ? 0.0 : l - x[n * V + t[n]] + z * l * l;
  }
  return loss;
}

TEST(CrossEntropy, ForwardBackwardAgainstReference) {
  MT_SEEDED_RNG(rng);
  for (float z : {0.f, 1e-2f}) {
    for (int rep = 0; rep < 3; ++rep) {
      const int64_t N = pick(rng, {1, 5, 19}), V = pick(rng, {1, 7, 130});
      const std::string tag = "cross_entropy N=" + std::to_string(N) + " V=" + std::to_string(V) +
                              " z=" + std::to_string(z);
      std::uniform_int_distribution<int32_t> td(0, static_cast<int32_t>(V - 1));
      std::vector<int32_t> t(N);
      for (auto& v : t) v = td(rng);
      if (N > 1) t[1] = -100;  // ignored row
      auto x = rand_nz(N * V, rng, 2.f), dloss = rand_nz(N, rng);
      Vec lse_ref;
      const Vec want = ce_ref(to_d(x), t, N, V, z, &lse_ref);
      Tensor tx = T({N, V}, x), tt = test::from_ints(B(), {N}, t);
      Tensor loss = B().empty({N}, DType::f32), lse = B().empty({N}, DType::f32);
      B().cross_entropy_forward(tx, tt, z, loss, lse);
      EXPECT_TRUE(close(test::to_vector(loss), want, kFwdTol, kSumFloor, tag + " loss"));
      EXPECT_TRUE(close(test::to_vector(lse), lse_ref, kFwdTol, kFwdFloor, tag + " lse"));

      Forward f = [&](const Inputs& in) { return ce_ref(in[0], t, N, V, z); };
      auto pre = rand_nz(N * V, rng);
      Tensor dx = T({N, V}, pre);
      B().cross_entropy_backward(T({N}, dloss), tx, tt, lse, z, dx);
      const auto got = minus(test::to_vector(dx), pre);
      EXPECT_TRUE(
          close(got, fd_grad(f, {to_d(x)}, 0, to_d(dloss)), kBwdTol, kBwdFloor, tag + " backward"));
      if (N > 1) {
        for (int64_t v = 0; v < V; ++v) EXPECT_EQ(got[V + v], 0.f) << "ignored row has gradient";
      }
    }
  }
}

TEST(CrossEntropy, LargeVocabBf16AndDeterminism) {
  MT_SEEDED_RNG(rng);
  const int64_t N = pick(rng, {9, 33}), V = pick(rng, {5003, 32000});
  std::uniform_int_distribution<int32_t> td(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> t(N);
  for (auto& v : t) v = td(rng);
  t[0] = -1;
  auto x = rand_nz(N * V, rng, 4.f), dloss = rand_nz(N, rng);
  const float z = 1e-4f;
  Vec lse_ref;
  const Vec want = ce_ref(to_d(x), t, N, V, z, &lse_ref);
  auto run = [&](DType dt, const std::vector<float>& xs) {
    Tensor tx = T({N, V}, xs, dt), tt = test::from_ints(B(), {N}, t);
    Tensor loss = B().empty({N}, DType::f32), lse = B().empty({N}, DType::f32);
    B().cross_entropy_forward(tx, tt, z, loss, lse);
    Tensor dx = B().zeros({N, V}, dt);
    B().cross_entropy_backward(T({N}, dloss), tx, tt, lse, z, dx);
    return std::vector<std::vector<float>>{test::to_vector(loss), test::to_vector(lse),
                                           test::to_vector(dx)};
  };
  const auto a = run(DType::f32, x), b = run(DType::f32, x);
  EXPECT_TRUE(close(a[0], want, kFwdTol, kSumFloor, "cross_entropy large V loss"));
  EXPECT_TRUE(close(a[1], lse_ref, kFwdTol, kFwdFloor, "cross_entropy large V lse"));
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "output " << i;
  // Analytic gradient in double for the large case (FD would take too long).
  Vec g(N * V, 0.0);
  for (int64_t n = 0; n < N; ++n) {
    if (t[n] < 0) continue;
    for (int64_t v = 0; v < V; ++v)
      g[n * V + v] =
          dloss[n] * std::exp(double(x[n * V + v]) - lse_ref[n]) * (1 + 2 * double(z) * lse_ref[n]);
    g[n * V + t[n]] -= dloss[n];
  }
  EXPECT_TRUE(close(a[2], g, kBwdTol, 1e-3, "cross_entropy large V backward"));
  const auto h = run(DType::bf16, x), fr = run(DType::f32, round_bf16(x));
  EXPECT_TRUE(close(h[0], fr[0], 1e-5, kFwdFloor, "cross_entropy bf16 logits loss"));
  EXPECT_TRUE(close(h[2], fr[2], kBf16Tol, 1e-3, "cross_entropy bf16 dlogits"));
}

TEST(CrossEntropy, RejectsBadTargets) {
  Tensor x = T({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor loss = B().empty({2}, DType::f32), lse = B().empty({2}, DType::f32);
  Tensor tt = test::from_ints(B(), {2}, {0, 3});
  try {
    B().cross_entropy_forward(x, tt, 0.f, loss, lse);
    ADD_FAILURE() << "no error for target 3 with V = 3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find('3'), std::string::npos) << e.what();
  }
  Tensor dx = B().zeros({2, 3}, DType::f32);
  EXPECT_THROW(B().cross_entropy_backward(T({2}, {1, 1}), x, tt, lse, 0.f, dx), Error);
  Tensor short_t = test::from_ints(B(), {1}, {0});
  EXPECT_THROW(B().cross_entropy_forward(x, short_t, 0.f, loss, lse), Error);
}

// ================================ determinism across thread counts ===========================

// Reductions use fixed blocks (not the schedule), so one thread and all threads agree bitwise.
TEST(Determinism, SameBitsWithOneThreadAndAll) {
  MT_SEEDED_RNG(rng);
  // Inputs and outputs live in the shared backend; only the kernels run on the 1-thread one.
  std::unique_ptr<Backend> one =
      test::plugins().make_backend("cpu", config_from_pairs({{"num_threads", "1"}}));
  const int64_t N = 1500, D = 96, V = 2000;
  auto x = rand_nz(N * D, rng), w = rand_nz(D, rng), g = rand_nz(N * D, rng);
  Tensor tx = T({N, D}, x), tw = T({D}, w), tg = T({N, D}, g);
  EXPECT_EQ(B().sum(tx), one->sum(tx));
  EXPECT_EQ(B().sum_squares(tx), one->sum_squares(tx));
  auto norm = [&](Backend& b) {
    Tensor out = B().empty({N, D}, DType::f32), rstd = B().empty({N}, DType::f32);
    Tensor mean = B().empty({N}, DType::f32);
    Tensor dx = B().zeros({N, D}, DType::f32), dw = B().zeros({D}, DType::f32),
           db = B().zeros({D}, DType::f32);
    b.rmsnorm_forward(tx, tw, 1e-6f, false, out, rstd);
    b.rmsnorm_backward(tg, tx, tw, rstd, false, dx, dw);
    b.layernorm_forward(tx, tw, tw, 1e-6f, out, mean, rstd);
    b.layernorm_backward(tg, tx, tw, mean, rstd, dx, dw, db);
    return std::vector<std::vector<float>>{test::to_vector(out), test::to_vector(dx),
                                           test::to_vector(dw), test::to_vector(db)};
  };
  const auto a = norm(B()), b = norm(*one);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "norm output " << i;

  std::uniform_int_distribution<int32_t> idd(0, static_cast<int32_t>(V - 1));
  std::vector<int32_t> ids(N);
  for (auto& i : ids) i = idd(rng) % 50;  // many repeats
  Tensor ti = test::from_ints(B(), {N}, ids);
  Tensor d1 = B().zeros({V, D}, DType::f32), d2 = B().zeros({V, D}, DType::f32);
  B().embedding_backward(tg, ti, d1);
  one->embedding_backward(tg, ti, d2);
  EXPECT_TRUE(bitwise_equal(test::to_vector(d1), test::to_vector(d2))) << "embedding_backward";

  auto logits = rand_nz(64 * V, rng);
  for (auto& i : ids) i = idd(rng);
  Tensor tl = T({64, V}, logits), tt = test::from_ints(B(), {64}, {ids.begin(), ids.begin() + 64});
  auto ce = [&](Backend& b) {
    Tensor loss = B().empty({64}, DType::f32), lse = B().empty({64}, DType::f32);
    Tensor dl = B().zeros({64, V}, DType::f32);
    b.cross_entropy_forward(tl, tt, 1e-4f, loss, lse);
    b.cross_entropy_backward(T({64}, std::vector<float>(64, 1.f)), tl, tt, lse, 1e-4f, dl);
    return std::vector<std::vector<float>>{test::to_vector(loss), test::to_vector(dl)};
  };
  const auto c1 = ce(B()), c2 = ce(*one);
  EXPECT_TRUE(bitwise_equal(c1[0], c2[0]) && bitwise_equal(c1[1], c2[1])) << "cross_entropy";
}

}  // namespace
}  // namespace mt
