// Attention kernels of the CPU backend: dot_product against a double-precision reference and
// finite differences, flash against dot_product over every masking/GQA combination, decode
// against forward, bf16, determinism, accumulation and shape errors.
//
// Errors between two f32 kernels are measured norm-wise, max|a - b| / max|b| per tensor: the two
// kernels sum in different orders, so an element that cancels to near zero carries an absolute
// (not a relative) error of the size of its terms.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "config_impl.h"
#include "mt/error.h"
#include "test_support.h"

namespace mt {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Problem {
  int64_t B = 1, T = 1, S = 1, Hq = 1, Hkv = 1, D = 1;
  AttentionSpec spec;
  bool segments = false;
  std::vector<float> q, k, v, dout;
  std::vector<int32_t> q_seg, kv_seg;

  Shape q_shape() const { return {B, T, Hq, D}; }
  Shape kv_shape() const { return {B, S, Hkv, D}; }
  bool visible(int64_t b, int64_t i, int64_t j) const {
    const int64_t p = i + spec.query_offset;
    if (spec.causal && j > p) return false;
    if (spec.window > 0 && p - j >= spec.window) return false;
    if (segments && q_seg[b * T + i] != kv_seg[b * S + j]) return false;
    return true;
  }
};

// Random inputs (never zeros). Segments: every batch row packs 2-3 documents; query i takes the
// document of its absolute position (the last one past the end of the keys).
void fill(Problem& p, std::mt19937_64& rng, float input_std) {
  p.q = test::randn(p.B * p.T * p.Hq * p.D, rng, input_std);
  p.k = test::randn(p.B * p.S * p.Hkv * p.D, rng, input_std);
  p.v = test::randn(p.B * p.S * p.Hkv * p.D, rng);
  p.dout = test::randn(p.B * p.T * p.Hq * p.D, rng);
  if (!p.segments) return;
  p.q_seg.assign(p.B * p.T, 0);
  p.kv_seg.assign(p.B * p.S, 0);
  for (int64_t b = 0; b < p.B; ++b) {
    const int docs = 2 + static_cast<int>(rng() % 2);
    std::vector<int64_t> cuts;
    for (int d = 1; d < docs; ++d) cuts.push_back(static_cast<int64_t>(rng() % (p.S + 1)));
    std::sort(cuts.begin(), cuts.end());
    for (int64_t j = 0; j < p.S; ++j)
      p.kv_seg[b * p.S + j] =
          static_cast<int32_t>(10 + (std::upper_bound(cuts.begin(), cuts.end(), j) - cuts.begin()));
    for (int64_t i = 0; i < p.T; ++i) {
      const int64_t pos = std::clamp<int64_t>(i + p.spec.query_offset, 0, p.S - 1);
      p.q_seg[b * p.T + i] = p.kv_seg[b * p.S + pos];
    }
  }
}

Tensor make(Backend& be, const Shape& shape, const std::vector<float>& v, DType dt) {
  if (dt == DType::f32) return test::from_vector(be, shape, v);
  // bf16 converted on the host: the test must not depend on the backend's cast kernel.
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  Tensor t = be.empty(shape, DType::bf16);
  be.copy_from_host(t, h.data());
  return t;
}

std::vector<float> read(const Tensor& t) {
  if (t.dtype() == DType::f32) return test::to_vector(t);
  std::vector<uint16_t> h(static_cast<size_t>(t.numel()));
  t.backend()->copy_to_host(t, h.data());
  std::vector<float> out(h.size());
  for (size_t i = 0; i < h.size(); ++i) out[i] = bf16_to_f32(h[i]);
  return out;
}

struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

// Forward (and backward) of `att` on p; gradients start from `prefill` when given, else zeros.
Result run(AttentionKernel& att, const Problem& p, DType dt = DType::f32, bool backward = true,
           const Result* prefill = nullptr) {
  Backend& be = test::cpu();
  Tensor q = make(be, p.q_shape(), p.q, dt), k = make(be, p.kv_shape(), p.k, dt),
         v = make(be, p.kv_shape(), p.v, dt);
  Tensor qs, ks;
  if (p.segments) {
    qs = test::from_ints(be, {p.B, p.T}, p.q_seg);
    ks = test::from_ints(be, {p.B, p.S}, p.kv_seg);
  }
  Tensor out = be.empty(p.q_shape(), dt), lse = be.empty({p.B, p.Hq, p.T}, DType::f32);
  att.forward(q, k, v, qs, ks, p.spec, out, lse);
  Result r{read(out), read(lse), {}, {}, {}};
  if (!backward) return r;
  Tensor dout = make(be, p.q_shape(), p.dout, dt);
  const std::vector<float> zq(p.q.size(), 0.f), zk(p.k.size(), 0.f);
  Tensor dq = make(be, p.q_shape(), prefill ? prefill->dq : zq, dt);
  Tensor dk = make(be, p.kv_shape(), prefill ? prefill->dk : zk, dt);
  Tensor dv = make(be, p.kv_shape(), prefill ? prefill->dv : zk, dt);
  att.backward(dout, q, k, v, qs, ks, out, lse, p.spec, dq, dk, dv);
  r.dq = read(dq);
  r.dk = read(dk);
  r.dv = read(dv);
  return r;
}

// max|a - b| / max|b| over finite entries; infinities must match exactly.
double norm_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return kInf;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(b[i]) || std::isinf(a[i])) {
      if (a[i] != b[i]) return kInf;
      continue;
    }
    if (std::isnan(a[i]) || std::isnan(b[i])) return kInf;
    num = std::max(num, std::fabs(double(a[i]) - b[i]));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

// Naive double-precision forward, straight from the definition in attention.h.
void reference(const Problem& p, std::vector<double>& out, std::vector<double>& lse) {
  const double scale = p.spec.scale != 0 ? p.spec.scale : 1.0 / std::sqrt(double(p.D));
  out.assign(p.q.size(), 0.0);
  lse.assign(p.B * p.Hq * p.T, -INFINITY);
  const int64_t group = p.Hq / p.Hkv;
  for (int64_t b = 0; b < p.B; ++b)
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.T; ++i) {
        std::vector<double> s(p.S, -INFINITY);
        double m = -INFINITY;
        for (int64_t j = 0; j < p.S; ++j) {
          if (!p.visible(b, i, j)) continue;
          double x = 0;
          for (int64_t d = 0; d < p.D; ++d)
            x += double(p.q[((b * p.T + i) * p.Hq + h) * p.D + d]) *
                 p.k[((b * p.S + j) * p.Hkv + h / group) * p.D + d];
          x *= scale;
          if (p.spec.softcap > 0) x = p.spec.softcap * std::tanh(x / p.spec.softcap);
          s[j] = x;
          m = std::max(m, x);
        }
        if (m == -INFINITY) continue;
        double sum = 0;
        for (int64_t j = 0; j < p.S; ++j) sum += std::exp(s[j] - m);
        lse[(b * p.Hq + h) * p.T + i] = m + std::log(sum);
        for (int64_t j = 0; j < p.S; ++j) {
          const double w = std::exp(s[j] - m) / sum;
          if (w == 0) continue;
          for (int64_t d = 0; d < p.D; ++d)
            out[((b * p.T + i) * p.Hq + h) * p.D + d] +=
                w * p.v[((b * p.S + j) * p.Hkv + h / group) * p.D + d];
        }
      }
}

std::vector<float> to_float(const std::vector<double>& v) {
  return {v.begin(), v.end()};
}

Problem make_problem(int64_t B, int64_t T, int64_t S, int64_t Hq, int64_t Hkv, int64_t D,
                     bool causal, int64_t window, float cap, bool segments, int64_t offset,
                     std::mt19937_64& rng, float input_std = 1.f) {
  Problem p;
  p.B = B, p.T = T, p.S = S, p.Hq = Hq, p.Hkv = Hkv, p.D = D;
  p.spec.causal = causal;
  p.spec.window = window;
  p.spec.softcap = cap;
  p.spec.query_offset = offset;
  p.segments = segments;
  fill(p, rng, input_std);
  return p;
}

// ---- (1) dot_product forward against the double reference ---------------------------------

TEST(Attention, DotProductMatchesDoubleReference) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto att = test::attention("dot_product", test::cpu());
  double worst = 0;
  for (int c = 0; c < 8; ++c) {
    const bool causal = c & 1, segments = c & 2;
    const float cap = (c & 4) ? 10.f : 0.f;
    Problem p = make_problem(2, 19, 23, 4, 2, 12, causal, (c % 3 == 0) ? 5 : 0, cap, segments, 4,
                             rng, cap > 0 ? 2.f : 1.f);
    std::vector<double> out, lse;
    reference(p, out, lse);
    const Result r = run(*att, p, DType::f32, false);
    const double e = std::max(norm_err(r.out, to_float(out)), norm_err(r.lse, to_float(lse)));
    EXPECT_LT(e, 1e-5) << "case " << c;
    worst = std::max(worst, e);
  }
  std::printf("dot_product vs double reference: max norm-wise error %.2e\n", worst);
}

// ---- (2) dot_product backward against central finite differences ---------------------------

// L = sum(out * dout) in double from an f32 forward.
double loss(AttentionKernel& att, const Problem& p) {
  const Result r = run(att, p, DType::f32, false);
  double l = 0;
  for (size_t i = 0; i < r.out.size(); ++i) l += double(r.out[i]) * p.dout[i];
  return l;
}

TEST(Attention, DotProductBackwardMatchesFiniteDifferences) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  auto att = test::attention("dot_product", test::cpu());
  struct Cfg {
    bool causal;
    int64_t window;
    float cap;
    bool segments;
  };
  double worst = 0;
  int n = 0;
  for (const Cfg cfg :
       {Cfg{true, 0, 0.f, false}, Cfg{false, 0, 0.f, false}, Cfg{true, 3, 2.f, true},
        Cfg{false, 2, 1.5f, true}, Cfg{true, 0, 0.f, false}}) {
    // Random odd shapes (T, S in [1, 9], D in [1, 5]); the last configuration is all size 1.
    const bool ones = ++n == 5;
    const int64_t T = ones ? 1 : 1 + rng() % 9, S = ones ? 1 : 1 + rng() % 9,
                  D = ones ? 1 : 1 + rng() % 5;
    Problem p = make_problem(ones ? 1 : 2, T, S, ones ? 1 : 4, ones ? 1 : 2, D, cfg.causal,
                             cfg.window, cfg.cap, cfg.segments, S - T, rng);
    const Result g = run(*att, p);
    // f32 forward: step 1e-2 keeps rounding noise (~1e-6 / 2h) well under the tolerance, the
    // truncation error is O(h^2).
    const float h = 1e-2f;
    for (auto [x, grad, name] : {std::tuple{&p.q, &g.dq, "dq"}, std::tuple{&p.k, &g.dk, "dk"},
                                 std::tuple{&p.v, &g.dv, "dv"}}) {
      std::vector<float> fd(x->size());
      for (size_t i = 0; i < x->size(); ++i) {
        const float x0 = (*x)[i];
        (*x)[i] = x0 + h;
        const double lp = loss(*att, p);
        (*x)[i] = x0 - h;
        const double lm = loss(*att, p);
        (*x)[i] = x0;
        fd[i] = static_cast<float>((lp - lm) / (2 * h));
      }
      const double e = norm_err(*grad, fd);
      EXPECT_LT(e, 2e-3) << name << " T " << T << " S " << S << " D " << D << " causal "
                         << cfg.causal << " cap " << cfg.cap;
      worst = std::max(worst, e);
    }
  }
  std::printf("dot_product backward vs finite differences: max norm-wise error %.2e\n", worst);
}

// ---- (3) flash == dot_product over every combination ---------------------------------------

struct Shape6 {
  int64_t B, T, S, D, offset;
};

TEST(Attention, FlashMatchesDotProduct) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  auto flash = test::attention("flash", be);
  auto ref = test::attention("dot_product", be);
  // Odd sizes around the 64-row tiles, T != S with the queries at the end of the keys, queries
  // before the first key (rows that see nothing), and size 1.
  const std::vector<Shape6> shapes = {
      {2, 67, 67, 24, 0}, {1, 37, 131, 72, 94}, {1, 70, 29, 5, -6}, {2, 1, 1, 1, 0}};
  struct Heads {
    int64_t hq, hkv;
  };
  const std::vector<Heads> heads = {{2, 2}, {4, 2}, {8, 2}, {16, 2}, {3, 1}};  // 1/2/4/8, MQA
  double worst[5] = {};
  int cases = 0;
  for (const Shape6& s : shapes)
    for (const Heads& hd : heads)
      for (int c = 0; c < 16; ++c) {
        const bool causal = c & 1, segments = c & 8;
        const int64_t window = (c & 2) ? 5 : 0;
        const float cap = (c & 4) ? 10.f : 0.f;
        // Inputs of std 2 give logits of std ~4 and tails past the cap of 10, where it bends them
        // (tanh(1.5) = 0.9); larger logits would only grow the f32 rounding of both kernels.
        Problem p = make_problem(s.B, s.T, s.S, hd.hq, hd.hkv, s.D, causal, window, cap, segments,
                                 s.offset, rng, cap > 0 ? 2.f : 1.f);
        const Result a = run(*flash, p);
        const Result b = run(*ref, p);
        const double e[5] = {norm_err(a.out, b.out), norm_err(a.lse, b.lse), norm_err(a.dq, b.dq),
                             norm_err(a.dk, b.dk), norm_err(a.dv, b.dv)};
        const char* names[5] = {"out", "lse", "dq", "dk", "dv"};
        for (int t = 0; t < 5; ++t) {
          EXPECT_LT(e[t], 1e-5) << names[t] << ": B " << s.B << " T " << s.T << " S " << s.S
                                << " D " << s.D << " offset " << s.offset << " Hq " << hd.hq
                                << " Hkv " << hd.hkv << " causal " << causal << " window " << window
                                << " cap " << cap << " segments " << segments;
          worst[t] = std::max(worst[t], e[t]);
        }
        ++cases;
      }
  std::printf(
      "flash vs dot_product over %d cases, max norm-wise error: out %.2e lse %.2e "
      "dq %.2e dk %.2e dv %.2e\n",
      cases, worst[0], worst[1], worst[2], worst[3], worst[4]);
}

// Flash splits the backward of few (batch, kv head) pairs into key-block chunks by thread count:
// a backend with more threads than pairs takes that path for every GQA/MQA shape here. D = 128
// also runs the microkernels over two full 64-column chunks.
TEST(Attention, FlashChunkedBackwardMatchesDotProduct) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::unique_ptr<Backend> wide = test::plugins().make_backend(
      test::cpu_backend_name(), config_from_pairs({{"num_threads", "7"}}));
  auto flash = test::attention("flash", *wide);
  auto ref = test::attention("dot_product", test::cpu());
  for (int64_t hkv : {1, 2, 3})
    for (int c = 0; c < 4; ++c) {
      Problem p = make_problem(2, 150, 200, 2 * hkv, hkv, 128, c & 1, (c & 2) ? 70 : 0, 0.f, c == 3,
                               50, rng);
      const Result a = run(*flash, p), again = run(*flash, p), b = run(*ref, p);
      EXPECT_LT(norm_err(a.out, b.out), 1e-5) << "hkv " << hkv << " case " << c;
      EXPECT_LT(norm_err(a.dq, b.dq), 1e-5) << "hkv " << hkv << " case " << c;
      EXPECT_LT(norm_err(a.dk, b.dk), 1e-5) << "hkv " << hkv << " case " << c;
      EXPECT_LT(norm_err(a.dv, b.dv), 1e-5) << "hkv " << hkv << " case " << c;
      EXPECT_EQ(0, std::memcmp(a.dq.data(), again.dq.data(), a.dq.size() * 4));
    }
}

// Queries placed before every key (negative offset, causal) see nothing: zeros, lse = -inf, and
// a zero, finite gradient.
TEST(Attention, RowsWithoutKeysGiveZeros) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* name : {"flash", "dot_product"}) {
    auto att = test::attention(name, test::cpu());
    const int64_t blind = 5;  // rows 0..4 sit at positions -5..-1
    Problem p = make_problem(1, 70, 40, 2, 1, 8, true, 0, 0.f, false, -blind, rng);
    const Result r = run(*att, p);
    for (float x : r.dq) ASSERT_TRUE(std::isfinite(x)) << name;
    for (float x : r.dk) ASSERT_TRUE(std::isfinite(x)) << name;
    for (float x : r.dv) ASSERT_TRUE(std::isfinite(x)) << name;
    for (int64_t h = 0; h < p.Hq; ++h)
      for (int64_t i = 0; i < p.T; ++i) {
        const float lse = r.lse[h * p.T + i];
        EXPECT_EQ(i < blind, lse == -kInf) << name << " row " << i;
        if (i >= blind) continue;
        for (int64_t d = 0; d < p.D; ++d) {
          EXPECT_EQ(r.out[(i * p.Hq + h) * p.D + d], 0.f) << name;
          EXPECT_EQ(r.dq[(i * p.Hq + h) * p.D + d], 0.f) << name;
        }
      }
  }
}

// A non-finite query gives its row NaN, as a softmax over its scores does (transformers' eager
// attention: NaN), in the forward (several key blocks) and in decode (several chunks); the other
// rows are untouched. Before: an infinite query's row came out finite under flash (the NaN sum
// read as a row without keys: zeros), and a NaN query's under both kernels.
TEST(Attention, NonFiniteQueriesGiveNaNRows) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (const char* name : {"flash", "dot_product"})
    for (const float bad : {kInf, nan}) {
      SCOPED_TRACE(std::string(name) + (std::isnan(bad) ? " NaN" : " inf"));
      auto att = test::attention(name, be);
      Problem p = make_problem(1, 150, 150, 2, 1, 8, true, 0, 0.f, false, 0, rng);
      const int64_t row = 140;  // past the first key block
      // Head 0 of the row: one element infinite, or every element NaN.
      for (int64_t d = 0; d < p.D; ++d)
        if (std::isnan(bad) || d == 0) p.q[(row * p.Hq + 0) * p.D + d] = bad;
      const Result r = run(*att, p, DType::f32, false);
      for (int64_t i = 0; i < p.T; ++i)
        for (int64_t h = 0; h < p.Hq; ++h) {
          const float o = r.out[(i * p.Hq + h) * p.D];
          EXPECT_EQ(std::isnan(o), i == row && h == 0) << "row " << i << " head " << h << ": " << o;
        }
      // Decode of one token over 300 cached keys (several chunks).
      const int64_t S = 300, D = 8;
      std::vector<float> q = test::randn(2 * D, rng), kc = test::randn(S * D, rng),
                         vc = test::randn(S * D, rng);
      for (int64_t d = 0; d < D; ++d)
        if (std::isnan(bad) || d == 0) q[d] = bad;  // head 0
      AttentionSpec spec;
      spec.causal = true;
      Tensor out = be.empty({1, 1, 2, D}, DType::f32);
      att->decode(test::from_vector(be, {1, 1, 2, D}, q), test::from_vector(be, {1, S, 1, D}, kc),
                  test::from_vector(be, {1, S, 1, D}, vc), test::from_ints(be, {1}, {300}), spec,
                  out);
      const std::vector<float> got = test::to_vector(out);
      EXPECT_TRUE(std::isnan(got[0])) << got[0];
      EXPECT_TRUE(std::isfinite(got[D])) << got[D];
    }
}

// The flash tests again in a child process with MT_FLASH_KERNELS=`set` on the same seed; returns
// its exit code and output.
int run_flash_tests_with(const std::string& set, std::string& output) {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return test::run_command("MT_FLASH_KERNELS=" + set +
                               " MT_TEST_SEED=" + std::to_string(test::seed()) + " '" + self +
                               "' "
                               "--gtest_filter='Attention.Flash*:Attention.Decode*:Attention.Deter*"
                               ":Attention.NonFinite*'",
                           output);
}

// The portable microkernels (chosen where the CPU lacks AVX2 + FMA).
TEST(Attention, GenericKernelsMatch) {
  if (std::getenv("MT_FLASH_KERNELS")) GTEST_SKIP() << "already the child run";
  SCOPED_TRACE("seed " + std::to_string(test::seed()));
  std::string output;
  EXPECT_EQ(run_flash_tests_with("generic", output), 0) << output;
}

// The AVX2 + FMA microkernels (chosen where the CPU has them but not AVX-512).
TEST(Attention, Avx2KernelsMatch) {
  if (std::getenv("MT_FLASH_KERNELS")) GTEST_SKIP() << "already the child run";
  if (!test::cpu_supports("avx2") || !test::cpu_supports("fma"))
    GTEST_SKIP() << "this CPU has no AVX2 + FMA";
  SCOPED_TRACE("seed " + std::to_string(test::seed()));
  std::string output;
  EXPECT_EQ(run_flash_tests_with("avx2", output), 0) << output;
}

// A set that does not exist is refused with the choices, not silently replaced.
TEST(Attention, UnknownKernelSetIsRefused) {
  if (std::getenv("MT_FLASH_KERNELS")) GTEST_SKIP() << "already the child run";
  std::string output;
  EXPECT_NE(run_flash_tests_with("sse9", output), 0) << output;
  EXPECT_NE(output.find("MT_FLASH_KERNELS=sse9: want generic, avx2 or avx512"), std::string::npos)
      << output;
}

// ---- (4) decode == forward ----------------------------------------------------------------

// Sequence b of a decode as a forward problem: its T queries (the last T positions of its L
// keys) against the first L rows of a [B, Smax, Hkv, D] cache.
Problem sequence_of(const std::vector<float>& q, const std::vector<float>& kc,
                    const std::vector<float>& vc, int64_t b, int64_t L, int64_t T, int64_t Smax,
                    int64_t Hq, int64_t Hkv, int64_t D, const AttentionSpec& spec) {
  Problem p;
  p.B = 1, p.T = T, p.S = L, p.Hq = Hq, p.Hkv = Hkv, p.D = D;
  p.spec = spec;
  p.spec.query_offset = L - T;
  p.q.assign(q.begin() + b * T * Hq * D, q.begin() + (b + 1) * T * Hq * D);
  p.k.assign(kc.begin() + b * Smax * Hkv * D, kc.begin() + (b * Smax + L) * Hkv * D);
  p.v.assign(vc.begin() + b * Smax * Hkv * D, vc.begin() + (b * Smax + L) * Hkv * D);
  return p;
}

// NaN in every cache row past each sequence's length: a kernel reading one shows in its output.
void poison_past(std::vector<float>& cache, const std::vector<int32_t>& lengths, int64_t Smax,
                 int64_t row) {
  for (size_t b = 0; b < lengths.size(); ++b)
    std::fill(cache.begin() + (static_cast<int64_t>(b) * Smax + lengths[b]) * row,
              cache.begin() + (static_cast<int64_t>(b) + 1) * Smax * row,
              std::numeric_limits<float>::quiet_NaN());
}

TEST(Attention, DecodeMatchesForward) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  const int64_t B = 3, Smax = 90;
  // Hq / Hkv = 2, 3, 7 and 8: flash decodes one token with the q heads of a kv head as one block
  // (the direct dot-product path below 4 rows, the tile microkernels from 4 rows); one token's
  // kernels take a kv head's rows for up to 3 of its q heads at once in the scores (7 = 3 + 3 +
  // 1, 8 = 3 + 3 + 2) and 4 in the sums (7 = 4 + 3). D = 72 and 136: they hold 64 of a head's
  // outputs in registers at a time, then the rest, the last part a partial vector.
  for (const int64_t D : {16, 72, 136})
    for (const char* name : {"flash", "dot_product"})
      for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 2}, {6, 2}, {7, 1}, {8, 1}})
        for (int64_t T : {1, 3})
          for (int c = 0; c < 4; ++c) {
            auto att = test::attention(name, be);
            AttentionSpec spec;
            spec.causal = c & 1;
            spec.window = (c & 2) ? 7 : 0;
            spec.softcap = (c == 3) ? 20.f : 0.f;
            const std::vector<int32_t> lengths = {
                static_cast<int32_t>(T), 17 + static_cast<int32_t>(c), static_cast<int32_t>(Smax)};
            // Rows past lengths[b] hold garbage that must be ignored.
            const std::vector<float> q = test::randn(B * T * Hq * D, rng),
                                     kc = test::randn(B * Smax * Hkv * D, rng),
                                     vc = test::randn(B * Smax * Hkv * D, rng);
            Tensor out = be.empty({B, T, Hq, D}, DType::f32);
            att->decode(test::from_vector(be, {B, T, Hq, D}, q),
                        test::from_vector(be, {B, Smax, Hkv, D}, kc),
                        test::from_vector(be, {B, Smax, Hkv, D}, vc),
                        test::from_ints(be, {B}, lengths), spec, out);
            const std::vector<float> got = test::to_vector(out);
            for (int64_t b = 0; b < B; ++b) {
              const int64_t L = lengths[b];
              const Result r = run(*att, sequence_of(q, kc, vc, b, L, T, Smax, Hq, Hkv, D, spec),
                                   DType::f32, false);
              const std::vector<float> row(got.begin() + b * T * Hq * D,
                                           got.begin() + (b + 1) * T * Hq * D);
              EXPECT_LT(norm_err(row, r.out), 2e-6)
                  << name << " D " << D << " Hq " << Hq << " Hkv " << Hkv << " T " << T << " b "
                  << b << " length " << L << " case " << c;
            }
          }
}

// A bf16 cache is read in place, a key block at a time: the outputs are those of an f32 cache
// holding the same values, bit for bit (the same arithmetic on the same numbers), for every path
// (grouped and per-head, the direct and tiled score kernels, a length spanning several key
// blocks). Rows past each length hold NaN: reading one would show in the output.
TEST(Attention, DecodeReadsABf16CacheInPlace) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  const int64_t B = 2, Smax = 150, D = 32;
  auto att = test::attention("flash", be);
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {8, 2}, {12, 4}, {16, 1}})
    for (int64_t T : {1, 2})
      for (int c = 0; c < 2; ++c) {
        AttentionSpec spec;
        spec.causal = true;
        spec.window = c ? 70 : 0;
        spec.softcap = c ? 30.f : 0.f;
        const std::vector<int32_t> lengths = {static_cast<int32_t>(Smax) - 1, 3 + c};
        std::vector<float> kc = test::randn(B * Smax * Hkv * D, rng),
                           vc = test::randn(B * Smax * Hkv * D, rng);
        for (std::vector<float>* cache : {&kc, &vc}) {
          for (float& x : *cache) x = bf16_to_f32(f32_to_bf16(x));
          poison_past(*cache, lengths, Smax, Hkv * D);
        }
        const Tensor q = test::from_vector(be, {B, T, Hq, D}, test::randn(B * T * Hq * D, rng));
        const Tensor len = test::from_ints(be, {B}, lengths);
        Tensor from_f32 = be.empty({B, T, Hq, D}, DType::f32);
        Tensor from_bf16 = be.empty({B, T, Hq, D}, DType::f32);
        att->decode(q, make(be, {B, Smax, Hkv, D}, kc, DType::f32),
                    make(be, {B, Smax, Hkv, D}, vc, DType::f32), len, spec, from_f32);
        att->decode(q, make(be, {B, Smax, Hkv, D}, kc, DType::bf16),
                    make(be, {B, Smax, Hkv, D}, vc, DType::bf16), len, spec, from_bf16);
        const std::vector<float> want = test::to_vector(from_f32), got = test::to_vector(from_bf16);
        for (float x : want) ASSERT_TRUE(std::isfinite(x)) << "Hq " << Hq << " T " << T;
        ASSERT_EQ(got, want) << "Hq " << Hq << " Hkv " << Hkv << " T " << T << " case " << c;
        // One bf16 tensor and one f32: each is read as its own dtype.
        Tensor mixed = be.empty({B, T, Hq, D}, DType::f32);
        att->decode(q, make(be, {B, Smax, Hkv, D}, kc, DType::bf16),
                    make(be, {B, Smax, Hkv, D}, vc, DType::f32), len, spec, mixed);
        ASSERT_EQ(test::to_vector(mixed), want) << "Hq " << Hq << " T " << T << " case " << c;
      }
}

// One new token a sequence reads the cache in chunks of keys, every head at once, and merges the
// chunks: each sequence's output is the same bits whatever the batch around it or the thread
// count, and matches the forward over its keys, also for a capacity past 2048 rows, where a
// chunk grows past 32 keys (at most 64 chunks a sequence), and for lengths ending inside a
// chunk or one key into it. Rows past each length hold NaN.
TEST(Attention, DecodeChunksGiveTheSameBitsAtAnyBatchAndThreads) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  std::unique_ptr<Backend> wide = test::plugins().make_backend(
      test::cpu_backend_name(), config_from_pairs({{"num_threads", "5"}}));
  std::unique_ptr<Backend> one = test::plugins().make_backend(
      test::cpu_backend_name(), config_from_pairs({{"num_threads", "1"}}));
  const int64_t D = 16;
  for (int64_t Smax : {int64_t{97}, int64_t{2100}})
    for (const auto& heads : {std::pair<int64_t, int64_t>{3, 3}, {6, 2}})
      for (int c = 0; c < 2; ++c) {
        // (Named, not a structured binding: clang before 16 cannot capture one in a lambda.)
        const int64_t Hq = heads.first, Hkv = heads.second;
        AttentionSpec spec;
        spec.causal = true;
        spec.window = c ? 40 : 0;
        spec.softcap = c ? 25.f : 0.f;
        const std::vector<int32_t> lengths = {static_cast<int32_t>(Smax), 33, 1,
                                              static_cast<int32_t>(Smax) - 31};
        const int64_t B = static_cast<int64_t>(lengths.size());
        std::vector<float> kc = test::randn(B * Smax * Hkv * D, rng),
                           vc = test::randn(B * Smax * Hkv * D, rng);
        for (std::vector<float>* cache : {&kc, &vc}) poison_past(*cache, lengths, Smax, Hkv * D);
        const std::vector<float> q = test::randn(B * Hq * D, rng);
        auto decode = [&](Backend& on, int64_t b0, int64_t nb) {
          auto att = test::attention("flash", on);
          Tensor out = on.empty({nb, 1, Hq, D}, DType::f32);
          att->decode(
              test::from_vector(
                  on, {nb, 1, Hq, D},
                  std::vector<float>(q.begin() + b0 * Hq * D, q.begin() + (b0 + nb) * Hq * D)),
              test::from_vector(on, {nb, Smax, Hkv, D},
                                std::vector<float>(kc.begin() + b0 * Smax * Hkv * D,
                                                   kc.begin() + (b0 + nb) * Smax * Hkv * D)),
              test::from_vector(on, {nb, Smax, Hkv, D},
                                std::vector<float>(vc.begin() + b0 * Smax * Hkv * D,
                                                   vc.begin() + (b0 + nb) * Smax * Hkv * D)),
              test::from_ints(
                  on, {nb}, std::vector<int32_t>(lengths.begin() + b0, lengths.begin() + b0 + nb)),
              spec, out);
          return test::to_vector(out);
        };
        const std::vector<float> all = decode(be, 0, B);
        ASSERT_EQ(decode(*wide, 0, B), all) << "Smax " << Smax << " Hq " << Hq << " case " << c;
        ASSERT_EQ(decode(*one, 0, B), all) << "Smax " << Smax << " Hq " << Hq << " case " << c;
        for (int64_t b = 0; b < B; ++b) {
          const std::vector<float> row(all.begin() + b * Hq * D, all.begin() + (b + 1) * Hq * D);
          ASSERT_EQ(decode(be, b, 1), row) << "Smax " << Smax << " b " << b << " case " << c;
          const int64_t L = lengths[b];
          const Result r =
              run(*test::attention("dot_product", be),
                  sequence_of(q, kc, vc, b, L, 1, Smax, Hq, Hkv, D, spec), DType::f32, false);
          // f32 sums over up to 2100 keys in two orders: 1e-5 as the long forward tests allow.
          EXPECT_LT(norm_err(row, r.out), L > 200 ? 1e-5 : 2e-6)
              << "Smax " << Smax << " Hq " << Hq << " b " << b << " length " << L << " case " << c;
        }
      }
}

// Decode at head sizes the other tests leave out: ending in a partial vector of 16 lanes (40,
// 200) or of 16 and 8 (36), and spanning many vectors (64, 128, 200), with lengths ending on,
// inside and one past a multiple of 16 keys, for grouped (4:1) and plain heads: each sequence
// matches the forward over its keys, and a bf16 cache gives the bits of an f32 cache holding its
// values. Rows past each length hold NaN.
TEST(Attention, DecodeHeadSizesAndKeyTails) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Backend& be = test::cpu();
  auto att = test::attention("flash", be);
  const std::vector<int32_t> lengths = {1, 15, 16, 17, 47, 100};
  const int64_t B = static_cast<int64_t>(lengths.size()), Smax = 100;
  for (int64_t D : {36, 40, 64, 128, 200})
    for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 1}, {3, 3}}) {
      std::vector<float> kc = test::randn(B * Smax * Hkv * D, rng),
                         vc = test::randn(B * Smax * Hkv * D, rng);
      for (std::vector<float>* cache : {&kc, &vc}) {
        for (float& x : *cache) x = bf16_to_f32(f32_to_bf16(x));
        poison_past(*cache, lengths, Smax, Hkv * D);
      }
      const std::vector<float> q = test::randn(B * Hq * D, rng);
      AttentionSpec spec;
      spec.causal = true;
      const Tensor qt = test::from_vector(be, {B, 1, Hq, D}, q),
                   len = test::from_ints(be, {B}, lengths);
      Tensor from_f32 = be.empty({B, 1, Hq, D}, DType::f32);
      Tensor from_bf16 = be.empty({B, 1, Hq, D}, DType::f32);
      att->decode(qt, make(be, {B, Smax, Hkv, D}, kc, DType::f32),
                  make(be, {B, Smax, Hkv, D}, vc, DType::f32), len, spec, from_f32);
      att->decode(qt, make(be, {B, Smax, Hkv, D}, kc, DType::bf16),
                  make(be, {B, Smax, Hkv, D}, vc, DType::bf16), len, spec, from_bf16);
      const std::vector<float> got = test::to_vector(from_f32);
      ASSERT_EQ(test::to_vector(from_bf16), got) << "D " << D << " Hq " << Hq;
      for (int64_t b = 0; b < B; ++b) {
        const int64_t L = lengths[b];
        const Result r =
            run(*test::attention("dot_product", be),
                sequence_of(q, kc, vc, b, L, 1, Smax, Hq, Hkv, D, spec), DType::f32, false);
        const std::vector<float> row(got.begin() + b * Hq * D, got.begin() + (b + 1) * Hq * D);
        // f32 sums in another order than the reference's: 2.2e-6 at most seen (the portable
        // kernels, D 200, seed 54756375); a wrong key, mask or scale is 1e-2 and more.
        EXPECT_LT(norm_err(row, r.out), 4e-6) << "D " << D << " Hq " << Hq << " length " << L;
      }
    }
}

// ---- (5) bf16 inputs ----------------------------------------------------------------------

TEST(Attention, Bf16CloseToF32) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* name : {"flash", "dot_product"}) {
    auto att = test::attention(name, test::cpu());
    Problem p = make_problem(2, 45, 45, 4, 2, 32, true, 0, 0.f, true, 0, rng);
    const Result f = run(*att, p);
    const Result h = run(*att, p, DType::bf16);
    // bf16 keeps 8 significant bits (relative rounding 2^-9 = 2e-3) on inputs and outputs; the
    // arithmetic is f32, so the outputs stay within a few roundings of the f32 ones.
    EXPECT_LT(norm_err(h.out, f.out), 2e-2) << name;
    EXPECT_LT(norm_err(h.lse, f.lse), 2e-2) << name;
    EXPECT_LT(norm_err(h.dq, f.dq), 3e-2) << name;
    EXPECT_LT(norm_err(h.dk, f.dk), 3e-2) << name;
    EXPECT_LT(norm_err(h.dv, f.dv), 3e-2) << name;
  }
}

// ---- (6) determinism ----------------------------------------------------------------------

TEST(Attention, Deterministic) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* name : {"flash", "dot_product"}) {
    auto att = test::attention(name, test::cpu());
    // MQA: every q head adds into the same dk/dv rows.
    Problem p = make_problem(2, 150, 150, 8, 1, 40, true, 0, 0.f, false, 0, rng);
    const Result a = run(*att, p), b = run(*att, p);
    auto same = [](const std::vector<float>& x, const std::vector<float>& y) {
      return x.size() == y.size() && std::memcmp(x.data(), y.data(), x.size() * 4) == 0;
    };
    EXPECT_TRUE(same(a.out, b.out) && same(a.lse, b.lse)) << name;
    EXPECT_TRUE(same(a.dq, b.dq) && same(a.dk, b.dk) && same(a.dv, b.dv)) << name;
  }
}

// ---- (7) backward accumulates -------------------------------------------------------------

TEST(Attention, BackwardAccumulates) {
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  for (const char* name : {"flash", "dot_product"}) {
    auto att = test::attention(name, test::cpu());
    Problem p = make_problem(1, 30, 30, 4, 2, 8, true, 0, 0.f, false, 0, rng);
    Result pre;
    pre.dq = test::randn(p.q.size(), rng);
    pre.dk = test::randn(p.k.size(), rng);
    pre.dv = test::randn(p.v.size(), rng);
    const Result fresh = run(*att, p), acc = run(*att, p, DType::f32, true, &pre);
    auto sum = [](const std::vector<float>& a, const std::vector<float>& b) {
      std::vector<float> s(a.size());
      for (size_t i = 0; i < a.size(); ++i) s[i] = a[i] + b[i];
      return s;
    };
    EXPECT_LT(norm_err(acc.dq, sum(pre.dq, fresh.dq)), 1e-6) << name;
    EXPECT_LT(norm_err(acc.dk, sum(pre.dk, fresh.dk)), 1e-6) << name;
    EXPECT_LT(norm_err(acc.dv, sum(pre.dv, fresh.dv)), 1e-6) << name;
  }
}

// ---- (8) bad shapes -----------------------------------------------------------------------

TEST(Attention, BadShapesThrow) {
  Backend& be = test::cpu();
  for (const char* name : {"flash", "dot_product"}) {
    auto att = test::attention(name, be);
    auto t = [&](const Shape& s) { return be.empty(s, DType::f32); };
    AttentionSpec spec;
    Tensor out = t({1, 4, 3, 8}), lse = t({1, 3, 4});
    // Hq % Hkv != 0
    EXPECT_THROW(
        att->forward(t({1, 4, 3, 8}), t({1, 4, 2, 8}), t({1, 4, 2, 8}), {}, {}, spec, out, lse),
        Error)
        << name;
    // head_dim of q and k differ
    EXPECT_THROW(
        att->forward(t({1, 4, 3, 8}), t({1, 4, 1, 4}), t({1, 4, 1, 4}), {}, {}, spec, out, lse),
        Error)
        << name;
    // k and v differ
    EXPECT_THROW(
        att->forward(t({1, 4, 3, 8}), t({1, 4, 1, 8}), t({1, 5, 1, 8}), {}, {}, spec, out, lse),
        Error)
        << name;
    // wrong lse shape
    Tensor bad_lse = t({1, 4, 3});
    EXPECT_THROW(
        att->forward(t({1, 4, 3, 8}), t({1, 4, 1, 8}), t({1, 4, 1, 8}), {}, {}, spec, out, bad_lse),
        Error)
        << name;
    // only one of the segment tensors
    EXPECT_THROW(att->forward(t({1, 4, 3, 8}), t({1, 4, 1, 8}), t({1, 4, 1, 8}),
                              test::from_ints(be, {1, 4}, {0, 0, 0, 0}), {}, spec, out, lse),
                 Error)
        << name;
    // backward with a dk of the wrong shape
    Tensor dq = t({1, 4, 3, 8}), dk = t({1, 4, 3, 8}), dv = t({1, 4, 1, 8});
    EXPECT_THROW(att->backward(t({1, 4, 3, 8}), t({1, 4, 3, 8}), t({1, 4, 1, 8}), t({1, 4, 1, 8}),
                               {}, {}, out, lse, spec, dq, dk, dv),
                 Error)
        << name;
    // decode: a length beyond the cache
    Tensor dout = t({2, 1, 3, 8});
    EXPECT_THROW(att->decode(t({2, 1, 3, 8}), t({2, 6, 1, 8}), t({2, 6, 1, 8}),
                             test::from_ints(be, {2}, {3, 7}), spec, dout),
                 Error)
        << name;
    // a negative window or soft-cap, even with no queries at all
    AttentionSpec neg;
    neg.window = -1;
    Tensor q0 = t({1, 0, 3, 8}), out0 = t({1, 0, 3, 8}), lse0 = t({1, 3, 0});
    EXPECT_THROW(att->forward(q0, t({1, 4, 1, 8}), t({1, 4, 1, 8}), {}, {}, neg, out0, lse0), Error)
        << name;
    neg.window = 0;
    neg.softcap = -1.f;
    EXPECT_THROW(att->forward(t({1, 4, 3, 8}), t({1, 4, 1, 8}), t({1, 4, 1, 8}), {}, {}, neg, out,
                              lse),
                 Error)
        << name;
  }
}

}  // namespace
}  // namespace mt
