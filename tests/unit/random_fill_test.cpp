// Backend::fill_random and its generator (mt/random_fill.h): Philox4x32-10's published answers,
// the accuracy of the generator's own ln, sin and cos, the same bits from every backend and thread
// count (the CPU kernel on 1 and 2 threads, the core's host composition, the cuda plugin's kernel
// emulated on the CPU, the header's one-element reference), the distributions' moments, and
// ModelRunner::init_parameters' streams (same seed, same weights; another name, another stream).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "config_impl.h"
#include "config_loader.h"
#include "emulated_cuda.h"
#include "model_runner.h"
#include "mt/backend.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "mt/random_fill.h"
#include "test_support.h"

namespace mt {
namespace {

namespace rf = random_fill;
using Dist = RandomFill::Distribution;

RandomFill spec_of(uint64_t key, Dist d, float stddev) {
  RandomFill s;
  s.key = key;
  s.distribution = d;
  s.stddev = stddev;
  return s;
}

// The raw bits of a tensor's elements (f32: 32 bits, bf16: 16 bits, widened).
std::vector<uint32_t> bits(const Tensor& t) {
  std::vector<uint32_t> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::f32) {
    t.backend()->copy_to_host(t, out.data());
  } else {
    std::vector<uint16_t> h(out.size());
    t.backend()->copy_to_host(t, h.data());
    for (size_t i = 0; i < h.size(); ++i) out[i] = h[i];
  }
  return out;
}

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Index of the first difference, or -1.
int64_t first_difference(const std::vector<uint32_t>& a, const std::vector<uint32_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  return -1;
}

std::vector<float> fill_f32(Backend& b, int64_t n, const RandomFill& s) {
  Tensor t = b.empty({n}, DType::f32);
  b.fill_random(t, s);
  return test::to_vector(t);
}

TEST(RandomFill, PhiloxMatchesThePublishedAnswers) {
  // Random123's known-answer vectors for philox4x32 with 10 rounds.
  struct Kat {
    uint32_t ctr[4], key[2], want[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    uint32_t c[4] = {k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3]};
    rf::philox4x32_10(c, k.key[0], k.key[1]);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(c[j], k.want[j]) << "word " << j;
  }
}

TEST(RandomFill, UniformsAreOpenAndExact) {
  EXPECT_EQ(rf::uniform_open(0u), 0x1p-24f);
  EXPECT_EQ(rf::uniform_open(0xffffffffu), 1.f - 0x1p-24f);
  EXPECT_EQ(rf::uniform_open(0x80000000u), 0.5f + 0x1p-24f);
}

TEST(RandomFill, LogSinAndCosAreAccurate) {
  // Every 2^-24 step of u's range would take long: a fine stride over it, plus its ends.
  double worst_log = 0;
  for (uint64_t w = 0; w <= 0xffffffffull; w += 4093) {
    const float u = rf::uniform_open(static_cast<uint32_t>(w));
    const double want = std::log(static_cast<double>(u));
    const double err = std::fabs(rf::log_open01(u) - want) / std::fabs(want);
    worst_log = std::max(worst_log, err);
  }
  EXPECT_LT(worst_log, 4e-7) << "ln's relative error (a few float ulp allowed)";
  double worst_trig = 0;
  for (uint64_t w = 0; w <= 0xffffffffull; w += 4093) {
    float s, c;
    rf::sincos_turns(static_cast<uint32_t>(w), s, c);
    // The angle the generator means: w's nearest quarter turn n, and the rest to 2^-26 turns.
    const uint32_t u = static_cast<uint32_t>(w), n = (u + 0x20000000u) >> 30;
    const auto rest = static_cast<int32_t>(u - (n << 30));
    const double th = n * (M_PI / 2) + (rest / 64) * (M_PI / 33554432.0);
    worst_trig = std::max({worst_trig, std::fabs(s - std::sin(th)), std::fabs(c - std::cos(th))});
  }
  EXPECT_LT(worst_trig, 2e-7) << "sin and cos, absolute error";
}

// Every backend and thread count: the same bits, element for element, as the header's reference.
class RandomFillBits : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cpu1_ = test::plugins().make_backend("cpu", config_from_pairs({{"num_threads", "1"}}));
    cpu2_ = test::plugins().make_backend("cpu", config_from_pairs({{"num_threads", "2"}}));
  }
  static void TearDownTestSuite() {
    cpu1_.reset();
    cpu2_.reset();
  }
  static std::unique_ptr<Backend> cpu1_, cpu2_;
};
std::unique_ptr<Backend> RandomFillBits::cpu1_, RandomFillBits::cpu2_;

TEST_F(RandomFillBits, EveryBackendAndThreadCountWritesTheSameBits) {
  test::RequiredOnlyBackend composed(*cpu2_);
  std::unique_ptr<Backend> emulated;
#if !defined(__SANITIZE_ADDRESS__)  // the emulator's fibers and AddressSanitizer do not mix
  emulated = test::emulated_cuda();
#endif
  const uint64_t key = 0x0123456789abcdefull;
  // Sizes: below one Philox block, a ragged tail, across the CPU's 4096-element chunks.
  for (const int64_t n : {int64_t{1}, int64_t{3}, int64_t{8}, int64_t{4099}, int64_t{70001}})
    for (const Dist d : {Dist::normal, Dist::truncated_normal})
      for (const DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE("n " + std::to_string(n) + (d == Dist::normal ? " normal " : " truncated ") +
                     dtype_name(dt));
        const RandomFill s = spec_of(key, d, 0.02f);
        // The reference, one element at a time.
        std::vector<uint32_t> want(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          const float v =
              rf::value_at(key, static_cast<uint64_t>(i), d == Dist::truncated_normal, s.stddev);
          want[static_cast<size_t>(i)] = dt == DType::f32 ? f32_bits(v) : f32_to_bf16(v);
        }
        std::vector<std::pair<std::string, Backend*>> backends = {
            {"cpu 1 thread", cpu1_.get()},
            {"cpu 2 threads", cpu2_.get()},
            {"cpu_composed (the core's host composition)", &composed}};
        if (emulated) backends.push_back({"emulated_cuda", emulated.get()});
        for (auto& [name, b] : backends) {
          Tensor t = b->empty({n}, dt);
          b->fill_random(t, s);
          EXPECT_EQ(first_difference(bits(t), want), -1) << name;
        }
      }
}

TEST_F(RandomFillBits, LargeTensorsAgreeAcrossThreadCountsAndTheComposition) {
  // 2^20 + 5 elements: many chunks for the threads to share.
  const int64_t n = (int64_t{1} << 20) + 5;
  test::RequiredOnlyBackend composed(*cpu1_);
  for (const Dist d : {Dist::normal, Dist::truncated_normal}) {
    const RandomFill s = spec_of(42, d, 1.f);
    Tensor a = cpu1_->empty({n}, DType::f32), b = cpu2_->empty({n}, DType::f32);
    Tensor c = composed.empty({n}, DType::f32);
    cpu1_->fill_random(a, s);
    cpu2_->fill_random(b, s);
    composed.fill_random(c, s);
    const std::vector<uint32_t> ba = bits(a);
    EXPECT_EQ(first_difference(bits(b), ba), -1);
    EXPECT_EQ(first_difference(bits(c), ba), -1);
  }
}

TEST_F(RandomFillBits, ViewsAreFilledAsTensorsOfTheirOwn) {
  // A view's element i is element i of its own stream, wherever the view starts.
  Tensor whole = cpu2_->zeros({3, 1001}, DType::f32);
  Tensor row = whole.slice0(1, 2);
  const RandomFill s = spec_of(9, Dist::normal, 1.f);
  cpu2_->fill_random(row, s);
  const std::vector<float> got = test::to_vector(whole);
  const std::vector<float> want = fill_f32(*cpu1_, 1001, s);
  for (int64_t i = 0; i < 1001; ++i) {
    ASSERT_EQ(got[static_cast<size_t>(i)], 0.f);
    ASSERT_EQ(got[static_cast<size_t>(1001 + i)], want[static_cast<size_t>(i)]) << i;
    ASSERT_EQ(got[static_cast<size_t>(2002 + i)], 0.f);
  }
}

// Mean, variance, the mass within one standard deviation, per Philox lane (a bug in one of the
// four lanes or in the sin or cos half would show there), and adjacent elements uncorrelated.
// Bounds are 6 standard errors of each statistic at n = 2^20 (so a correct generator fails
// once in 10^8 or so; the key is fixed anyway, so the outcome is too).
void check_moments(const std::vector<float>& v, double sigma, bool truncated) {
  const double n = static_cast<double>(v.size());
  double sum = 0, sq = 0, within = 0, lag = 0;
  double lane_sq[4] = {};
  for (size_t i = 0; i < v.size(); ++i) {
    const double z = v[i] / sigma;
    sum += z;
    sq += z * z;
    lane_sq[i % 4] += z * z;
    // One standard deviation of the underlying normal: for the truncated one, z was rescaled
    // by 1 / 0.87962566.
    within += std::fabs(z) < (truncated ? 1.0 / 0.87962566 : 1.0);
    if (i + 1 < v.size()) lag += z * (v[i + 1] / sigma);
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_LT(std::fabs(mean), 6 / std::sqrt(n)) << "mean";
  EXPECT_LT(std::fabs(var - 1), 6 * std::sqrt(2 / n)) << "variance";
  for (int j = 0; j < 4; ++j)
    EXPECT_LT(std::fabs(lane_sq[j] / (n / 4) - 1), 6 * std::sqrt(2 / (n / 4))) << "lane " << j;
  const double p = truncated ? 0.68268949 / 0.95449974 : 0.68268949;
  EXPECT_LT(std::fabs(within / n - p), 6 * std::sqrt(p * (1 - p) / n)) << "mass within 1 sd";
  EXPECT_LT(std::fabs(lag / n), 6 / std::sqrt(n)) << "lag-1 correlation";
}

TEST_F(RandomFillBits, DistributionsHaveTheirMoments) {
  const int64_t n = int64_t{1} << 20;
  const std::vector<float> normal = fill_f32(*cpu2_, n, spec_of(1234, Dist::normal, 0.5f));
  check_moments(normal, 0.5, false);
  const std::vector<float> tn = fill_f32(*cpu2_, n, spec_of(1234, Dist::truncated_normal, 0.02f));
  check_moments(tn, 0.02, true);
  // Truncated at two standard deviations of the underlying normal, and reaching close to it.
  const float bound = 2.f * (0.02f / 0.87962566f);
  float widest = 0;
  for (float x : tn) widest = std::max(widest, std::fabs(x));
  EXPECT_LE(widest, bound);
  EXPECT_GT(widest, 0.999f * bound);
  // The normal's tails: beyond 4 sd happens (6.3e-5 of draws), beyond 6 cannot (u >= 2^-24).
  float widest_normal = 0;
  for (float x : normal) widest_normal = std::max(widest_normal, std::fabs(x));
  EXPECT_GT(widest_normal, 4 * 0.5f);
  EXPECT_LT(widest_normal, 6 * 0.5f);
}

TEST_F(RandomFillBits, Bf16IsTheF32ValuesRoundedToNearestEven) {
  const int64_t n = 100003;
  for (const Dist d : {Dist::normal, Dist::truncated_normal}) {
    const RandomFill s = spec_of(77, d, 0.02f);
    const std::vector<float> f = fill_f32(*cpu2_, n, s);
    Tensor h = cpu2_->empty({n}, DType::bf16);
    cpu2_->fill_random(h, s);
    const std::vector<uint32_t> got = bits(h);
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(got[static_cast<size_t>(i)], f32_to_bf16(f[static_cast<size_t>(i)])) << i;
  }
}

TEST_F(RandomFillBits, KeysGiveIndependentStreams) {
  const int64_t n = 1 << 16;
  const std::vector<float> a = fill_f32(*cpu2_, n, spec_of(5, Dist::normal, 1.f));
  const std::vector<float> b = fill_f32(*cpu2_, n, spec_of(6, Dist::normal, 1.f));
  const std::vector<float> again = fill_f32(*cpu1_, n, spec_of(5, Dist::normal, 1.f));
  EXPECT_EQ(a, again);
  int64_t equal = 0;
  double cross = 0;
  for (int64_t i = 0; i < n; ++i) {
    equal += a[static_cast<size_t>(i)] == b[static_cast<size_t>(i)];
    cross += double(a[static_cast<size_t>(i)]) * b[static_cast<size_t>(i)];
  }
  EXPECT_EQ(equal, 0);
  EXPECT_LT(std::fabs(cross / n), 6 / std::sqrt(double(n)));
}

TEST_F(RandomFillBits, BadSpecsAndTensorsAreRefused) {
  Tensor ints = cpu2_->empty({4}, DType::i32);
  EXPECT_THROW(cpu2_->fill_random(ints, spec_of(1, Dist::normal, 1.f)), Error);
  Tensor f = cpu2_->empty({4}, DType::f32);
  EXPECT_THROW(cpu2_->fill_random(f, spec_of(1, Dist::normal, -1.f)), Error);
  EXPECT_THROW(cpu2_->fill_random(f, spec_of(1, Dist::normal, NAN)), Error);
  test::RequiredOnlyBackend composed(*cpu2_);
  EXPECT_THROW(composed.fill_random(ints, spec_of(1, Dist::normal, 1.f)), Error);
  // Nothing to write is fine.
  Tensor empty = cpu2_->empty({0}, DType::f32);
  EXPECT_NO_THROW(cpu2_->fill_random(empty, spec_of(1, Dist::normal, 1.f)));
}

// ---- ModelRunner::init_parameters -------------------------------------------------------------

std::unique_ptr<ModelRunner> llama_test(uint64_t seed, std::vector<std::string> overrides = {}) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = std::move(overrides);
  auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
  r->init_parameters(seed);
  return r;
}

TEST(InitParameters, SameSeedSameWeightsOtherNamesOtherStreams) {
  auto a = llama_test(3), b = llama_test(3), c = llama_test(4);
  ASSERT_EQ(a->params().size(), b->params().size());
  bool any_differs = false;
  for (size_t i = 0; i < a->params().size(); ++i) {
    const Param& p = a->params()[i];
    EXPECT_EQ(test::to_vector(p.value), test::to_vector(b->params()[i].value)) << p.name;
    if (p.spec.init == Init::normal || p.spec.init == Init::truncated_normal)
      any_differs =
          any_differs || test::to_vector(p.value) != test::to_vector(c->params()[i].value);
  }
  EXPECT_TRUE(any_differs) << "another init_weights_seed gives other weights";
  // Two layers' parameters of one name, shape and init draw different numbers.
  const Param* w0 = a->find("layers.0.wq");
  const Param* w1 = a->find("layers.1.wq");
  ASSERT_TRUE(w0 && w1);
  EXPECT_NE(test::to_vector(w0->value), test::to_vector(w1->value));
}

TEST(InitParameters, InitsAndDtypes) {
  // weight_dtype=bfloat16: the values are the f32 draws rounded, written with no f32 copy.
  auto f = llama_test(11), h = llama_test(11, {"weight_dtype=bfloat16", "dtype=bfloat16"});
  ASSERT_EQ(f->params().size(), h->params().size());
  for (size_t i = 0; i < f->params().size(); ++i) {
    const Param& p = f->params()[i];
    const std::vector<float> fv = test::to_vector(p.value);
    const std::vector<float> hv = test::to_vector(h->params()[i].value);
    ASSERT_EQ(h->params()[i].value.dtype(), DType::bf16) << p.name;
    for (size_t k = 0; k < fv.size(); ++k)
      ASSERT_EQ(hv[k], bf16_to_f32(f32_to_bf16(fv[k]))) << p.name << " " << k;
    if (p.spec.init == Init::ones) {
      for (float x : fv) ASSERT_EQ(x, 1.f) << p.name;
    }
    if (p.spec.init == Init::zeros) {
      for (float x : fv) ASSERT_EQ(x, 0.f) << p.name;
    }
    if (p.spec.init == Init::truncated_normal) {
      const float bound = 2.f * (p.spec.stddev / 0.87962566f);
      for (float x : fv) ASSERT_LE(std::fabs(x), bound) << p.name;
    }
  }
}

}  // namespace
}  // namespace mt
