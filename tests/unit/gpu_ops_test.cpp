// The CUDA backend's op set against the CPU backend (label `gpu`).
//
// Every test draws fresh random inputs (never zeros), poisons forward outputs with NaN first and
// starts accumulated gradients from the same random values on both backends, runs the op on each
// and compares norm-wise: max|gpu - cpu| / max|cpu| within 1e-5 for f32 storage and 1e-2 for bf16
// storage (the same bf16 inputs, f32 math on both sides: only the final rounding may differ).
// Where this machine has no CUDA device, or the cuda plugin was not built or declines, every test
// skips and says why. A failure prints the seed; MT_TEST_SEED=<seed> replays it.
//
// Built a second time as cuda_emulated_ops_test (label unit, tests named Emulated.*): the "gpu"
// is then the cuda plugin's kernels run on the CPU under tests/support/cuda_emulation.h, so the
// CUDA code's logic is checked on every machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "config_impl.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/capture.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "test_support.h"
#ifdef MT_CUDA_EMULATED_OPS
#include "emulated_cuda.h"
#endif

namespace mt {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
// cuda_emulated_ops_test runs every GPU thread on the CPU: its largest shapes shrink by this
// factor so that it stays a unit test; on a device they run whole.
#ifdef MT_CUDA_EMULATED_OPS
constexpr int64_t kShrink = 5;
#else
constexpr int64_t kShrink = 1;
#endif
constexpr DType kDtypes[] = {DType::f32, DType::bf16};

const char* dname(DType d) {
  return d == DType::f32 ? "f32" : "bf16";
}
double tol(DType d) {
  return d == DType::f32 ? 1e-5 : 1e-2;
}

// A new cuda backend (the emulated one in cuda_emulated_ops_test); throws where there is none.
std::unique_ptr<Backend> make_gpu() {
#ifdef MT_CUDA_EMULATED_OPS
  return test::emulated_cuda();
#else
  return test::plugins().make_backend("cuda", config_from_pairs({}));
#endif
}
std::unique_ptr<AttentionKernel> attention_on(const std::string& name, Backend& b) {
#ifdef MT_CUDA_EMULATED_OPS
  return test::emulated_cuda_attention(name, b);
#else
  return test::attention(name, b);
#endif
}

// The cuda backend of this process, made once; null with the reason when there is none.
struct Gpu {
  std::unique_ptr<Backend> backend;
  std::string why;
};
Gpu& gpu_state() {
  static Gpu g = [] {
    Gpu r;
    try {
      r.backend = make_gpu();
    } catch (const Error& e) {
      r.why = e.what();
    } catch (const std::exception& e) {
      r.why = e.what();
    }
    return r;
  }();
  return g;
}

class GpuOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!gpu_state().backend) GTEST_SKIP() << "no CUDA device: " << gpu_state().why;
  }
  Backend& gpu() { return *gpu_state().backend; }
  std::unique_ptr<AttentionKernel> gpu_attention(const std::string& name) {
    return attention_on(name, gpu());
  }
  Backend& cpu() { return test::cpu(); }

  // One tensor on each backend holding the same values.
  struct Both {
    Tensor g, c;
  };
  Both make(const Shape& s, const std::vector<float>& v, DType dt) {
    return {test::from_vector(gpu(), s, v, dt), test::from_vector(cpu(), s, v, dt)};
  }
  Both ints(const Shape& s, const std::vector<int32_t>& v) {
    return {test::from_ints(gpu(), s, v), test::from_ints(cpu(), s, v)};
  }
  // A forward output, NaN everywhere until the op writes it.
  Both poisoned(const Shape& s, DType dt) {
    Both b{gpu().empty(s, dt), cpu().empty(s, dt)};
    gpu().fill(b.g, kNaN);
    cpu().fill(b.c, kNaN);
    return b;
  }

  // Norm-wise relative error of the gpu result against the cpu one.
  ::testing::AssertionResult close(const Both& b, double limit, const std::string& what) {
    const std::vector<float> g = test::to_vector(b.g), c = test::to_vector(b.c);
    if (g.size() != c.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
    double diff = 0, ref = 0;
    size_t worst = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (!std::isfinite(g[i]) && std::isfinite(c[i]))
        return ::testing::AssertionFailure()
               << what << ": gpu[" << i << "] = " << g[i] << " (cpu " << c[i] << ")";
      const double d = std::fabs(double(g[i]) - double(c[i]));
      if (d > diff) diff = d, worst = i;
      ref = std::max(ref, std::fabs(double(c[i])));
    }
    const double err = diff / std::max(ref, 1e-30);
    if (err <= limit) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << what << ": norm-wise error " << err << " > " << limit << " (worst at " << worst
           << ": gpu " << g[worst] << ", cpu " << c[worst] << ", max|cpu| " << ref << ")";
  }
};

std::vector<float> rand_nz(size_t n, std::mt19937_64& rng, float scale = 1.f) {
  std::vector<float> v = test::randn(n, rng, scale);
  for (auto& x : v)
    if (std::fabs(x) < 0.05f * scale) x = x < 0 ? -0.05f * scale : 0.05f * scale;
  return v;
}

int64_t pick(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

TEST_F(GpuOps, ElementwiseAndCast) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    const int64_t n = pick(rng, 1, 100000);
    const Shape s{n};
    Both a = make(s, rand_nz(n, rng), dt), b = make(s, rand_nz(n, rng), dt);

    Both o = poisoned(s, dt);
    gpu().fill(o.g, 0.37f);
    cpu().fill(o.c, 0.37f);
    EXPECT_TRUE(close(o, tol(dt), "fill"));

    o = poisoned(s, dt);
    gpu().add(a.g, b.g, o.g);
    cpu().add(a.c, b.c, o.c);
    EXPECT_TRUE(close(o, tol(dt), "add"));

    o = poisoned(s, dt);
    gpu().mul(a.g, b.g, o.g);
    cpu().mul(a.c, b.c, o.c);
    EXPECT_TRUE(close(o, tol(dt), "mul"));

    o = poisoned(s, dt);
    gpu().scale(a.g, -1.7f, o.g);
    cpu().scale(a.c, -1.7f, o.c);
    EXPECT_TRUE(close(o, tol(dt), "scale"));

    Both y = make(s, rand_nz(n, rng), dt);
    gpu().axpy(0.3f, a.g, y.g);
    cpu().axpy(0.3f, a.c, y.c);
    EXPECT_TRUE(close(y, tol(dt), "axpy"));

    // Casts to every float dtype, from this one.
    for (DType to : kDtypes) {
      o = poisoned(s, to);
      gpu().cast(a.g, o.g);
      cpu().cast(a.c, o.c);
      EXPECT_TRUE(close(o, tol(to), std::string("cast to ") + dname(to)));
    }
  }
  // i32 fill and copy.
  Both i = ints({5}, {1, 2, 3, 4, 5});
  gpu().fill(i.g, 7.f);
  EXPECT_EQ(test::to_ints(i.g), std::vector<int32_t>(5, 7));
}

// The elementwise kernels take 16-byte loads only where every operand is 16-byte aligned: views
// one element in (2 or 4 bytes off), alone or next to aligned operands, go element by element
// and give the same results.
TEST_F(GpuOps, ElementwiseOnUnalignedViews) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    const int64_t n = pick(rng, 9, 5000);
    auto view = [&](const Both& b) { return Both{b.g.slice0(1, n + 1), b.c.slice0(1, n + 1)}; };
    Both a = view(make({n + 1}, rand_nz(n + 1, rng), dt));
    Both b = make({n}, rand_nz(n, rng), dt);  // aligned
    Both o = view(poisoned({n + 1}, dt));
    gpu().add(a.g, b.g, o.g);
    cpu().add(a.c, b.c, o.c);
    EXPECT_TRUE(close(o, tol(dt), "add"));
    Both y = view(make({n + 1}, rand_nz(n + 1, rng), dt));
    gpu().axpy(0.3f, a.g, y.g);
    cpu().axpy(0.3f, a.c, y.c);
    EXPECT_TRUE(close(y, tol(dt), "axpy"));
    Both dgate = view(make({n + 1}, rand_nz(n + 1, rng), dt)), dup = make({n}, rand_nz(n, rng), dt);
    gpu().gated_backward(Activation::silu, b.g, a.g, b.g, dgate.g, dup.g);
    cpu().gated_backward(Activation::silu, b.c, a.c, b.c, dgate.c, dup.c);
    EXPECT_TRUE(close(dgate, tol(dt), "gated_backward dgate"));
    EXPECT_TRUE(close(dup, tol(dt), "gated_backward dup"));
    Both c32 = view(poisoned({n + 1}, DType::f32));
    gpu().cast(a.g, c32.g);
    cpu().cast(a.c, c32.c);
    EXPECT_TRUE(close(c32, 0.0, "cast"));  // exact either way
  }
}

TEST_F(GpuOps, SumAndSumSquaresAreDeterministic) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    for (int64_t n : {int64_t{1}, pick(rng, 2, 1000), pick(rng, 100000, 3000000)}) {
      std::vector<float> v = rand_nz(n, rng);
      Both x = make({n}, v, dt);
      const double gs = gpu().sum(x.g), cs = cpu().sum(x.c);
      const double gq = gpu().sum_squares(x.g), cq = cpu().sum_squares(x.c);
      EXPECT_NEAR(gs, cs, 1e-9 * std::max(1.0, cq)) << "sum, n " << n;
      EXPECT_NEAR(gq, cq, 1e-9 * cq) << "sum_squares, n " << n;
      EXPECT_EQ(gpu().sum(x.g), gs) << "sum must be bitwise reproducible";
      EXPECT_EQ(gpu().sum_squares(x.g), gq);
      // The same values one element into a buffer (not 16-byte aligned: element loads) are
      // added in the same order.
      v.insert(v.begin(), 5.f);
      const Tensor off = test::from_vector(gpu(), {n + 1}, v, dt).slice0(1, n + 1);
      EXPECT_EQ(gpu().sum(off), gs) << "n " << n;
      EXPECT_EQ(gpu().sum_squares(off), gq) << "n " << n;
    }
  }
}

// The gradient norm's batched form: every tensor's sum of squares in one read-back, each equal
// bit for bit to its own sum_squares (an empty tensor sums to 0), mixed dtypes and sizes.
TEST_F(GpuOps, SumSquaresEachMatchesOneByOne) {
  MT_SEEDED_RNG(rng);
  std::vector<Tensor> xs;
  for (int i = 0; i < 7; ++i) {
    const int64_t n = i == 3 ? 0 : pick(rng, 1, i % 2 ? 200000 : 5000);
    xs.push_back(test::from_vector(gpu(), {n}, rand_nz(n, rng), kDtypes[i % 2]));
  }
  std::vector<const Tensor*> ptrs;
  for (const Tensor& x : xs) ptrs.push_back(&x);
  std::vector<double> sums = {kNaN};  // resized and overwritten
  gpu().sum_squares_each(ptrs, sums);
  ASSERT_EQ(sums.size(), xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    EXPECT_EQ(sums[i], gpu().sum_squares(xs[i])) << "tensor " << i << " " << xs[i].str();
    const Tensor host =
        test::from_vector(cpu(), xs[i].shape(), test::to_vector(xs[i]), xs[i].dtype());
    const double want = cpu().sum_squares(host);
    EXPECT_NEAR(sums[i], want, 1e-9 * want) << "tensor " << i << " against the CPU";
  }
  EXPECT_EQ(sums[3], 0.0);
  gpu().sum_squares_each({}, sums);
  EXPECT_TRUE(sums.empty());
}

TEST_F(GpuOps, Matmul) {
  MT_SEEDED_RNG(rng);
  struct Case {
    Shape lead;
    int64_t m, k, n;
    bool ta, tb, shared_b;
    float alpha, beta;
  };
  const Case cases[] = {
      {{}, 37, 53, 29, false, false, false, 1.f, 0.f},
      {{}, 64, 128, 96, true, false, false, 1.f, 0.f},
      {{}, 33, 70, 41, false, true, false, 0.5f, 1.f},
      {{}, 1, 257, 130, false, true, false, 1.f, 0.f},  // decode: M = 1
      {{3}, 17, 40, 23, true, true, false, 2.f, -0.5f},
      {{2, 3}, 19, 31, 27, false, false, true, 1.f, 0.f},  // batch against a shared 2-D b
      {{4}, 21, 35, 18, true, false, true, 1.f, 1.f},      // shared b, a transposed
      {{5}, 16, 64, 48, false, true, false, 1.f, 0.f},
  };
  // Every dtype mix of a, b and c.
  for (DType da : kDtypes)
    for (DType db : kDtypes)
      for (DType dc : kDtypes) {
        const double limit =
            (da == DType::f32 && db == DType::f32 && dc == DType::f32) ? 1e-5 : 1e-2;
        for (const Case& cs : cases) {
          SCOPED_TRACE(std::string(dname(da)) + "/" + dname(db) + "/" + dname(dc) +
                       " m=" + std::to_string(cs.m) + " k=" + std::to_string(cs.k) +
                       " n=" + std::to_string(cs.n) + (cs.ta ? " ta" : "") + (cs.tb ? " tb" : "") +
                       (cs.shared_b ? " shared_b" : ""));
          Shape sa = cs.lead, sb = cs.shared_b ? Shape{} : cs.lead, sc = cs.lead;
          sa.push_back(cs.ta ? cs.k : cs.m);
          sa.push_back(cs.ta ? cs.m : cs.k);
          sb.push_back(cs.tb ? cs.n : cs.k);
          sb.push_back(cs.tb ? cs.k : cs.n);
          sc.push_back(cs.m);
          sc.push_back(cs.n);
          Both a = make(sa, rand_nz(shape_numel(sa), rng), da);
          Both b = make(sb, rand_nz(shape_numel(sb), rng), db);
          Both c = cs.beta != 0.f ? make(sc, rand_nz(shape_numel(sc), rng), dc) : poisoned(sc, dc);
          gpu().matmul(a.g, b.g, c.g, cs.ta, cs.tb, cs.alpha, cs.beta);
          cpu().matmul(a.c, b.c, c.c, cs.ta, cs.tb, cs.alpha, cs.beta);
          EXPECT_TRUE(close(c, limit, "matmul"));
        }
      }
}

TEST_F(GpuOps, Embedding) {
  MT_SEEDED_RNG(rng);
  // Up to 1024 rows the backward scatters on the device alone, beyond through host-built runs:
  // both sizes, same sums.
  for (DType dt : kDtypes)
    for (int64_t N : {pick(rng, 1, 700), pick(rng, 1025, 1400)}) {
      SCOPED_TRACE(std::string(dname(dt)) + " N " + std::to_string(N));
      const int64_t V = pick(rng, 5, 300), D = pick(rng, 1, 300);
      std::vector<int32_t> id(static_cast<size_t>(N));
      // Few distinct ids, so rows repeat and the backward really accumulates.
      for (auto& i : id) i = static_cast<int32_t>(pick(rng, 0, std::min<int64_t>(V - 1, 20)));
      Both ids = ints({N}, id);
      Both table = make({V, D}, rand_nz(V * D, rng), dt);
      Both o = poisoned({N, D}, dt);
      gpu().embedding_forward(table.g, ids.g, o.g);
      cpu().embedding_forward(table.c, ids.c, o.c);
      EXPECT_TRUE(close(o, tol(dt), "embedding_forward"));

      Both dout = make({N, D}, rand_nz(N * D, rng), dt);
      Both dtable = make({V, D}, rand_nz(V * D, rng), dt);
      gpu().embedding_backward(dout.g, ids.g, dtable.g);
      cpu().embedding_backward(dout.c, ids.c, dtable.c);
      EXPECT_TRUE(close(dtable, tol(dt), "embedding_backward"));
    }
  // A bad id is found on the device: the error comes at the next synchronisation.
  Both bad = ints({2}, {0, 1000});
  Both table = make({4, 3}, rand_nz(12, rng), DType::f32);
  Tensor o = gpu().empty({2, 3}, DType::f32);
  EXPECT_THROW(
      {
        gpu().embedding_forward(table.g, bad.g, o);
        gpu().synchronize();
      },
      Error);
}

// Ids, row indices, targets and decode lengths are checked on the device (no read-back per
// call): the call returns, the next synchronize() or copy_to_host() throws naming the op and the
// lowest bad position with its value, and the one after is clean again. Nothing is read out of
// bounds meanwhile (memcheck on a device).
TEST_F(GpuOps, BadIndicesAreReportedAtTheNextSync) {
  MT_SEEDED_RNG(rng);
  auto expect_reported = [&](const char* what, const std::function<void()>& call,
                             const std::string& needle, bool by_copy = false) {
    SCOPED_TRACE(what);
    EXPECT_NO_THROW(call());
    try {
      if (by_copy) {
        float x = 0.f;
        gpu().copy_to_host(gpu().zeros({1}, DType::f32), &x);
      } else {
        gpu().synchronize();
      }
      ADD_FAILURE() << "no error reported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_NO_THROW(gpu().synchronize()) << "reported once only";
  };
  Both table = make({5, 3}, rand_nz(15, rng), DType::f32);
  Tensor o = gpu().empty({4, 3}, DType::f32);
  Both ids = ints({4}, {1, 7, -2, 9});
  expect_reported(
      "embedding_forward", [&] { gpu().embedding_forward(table.g, ids.g, o); },
      "embedding_forward: token id 7 at position 1 is outside the vocabulary [0, 5)");
  Both idx = ints({3}, {0, 3, 8});
  Tensor g = gpu().empty({3, 3}, DType::f32);
  expect_reported(
      "gather_rows", [&] { gpu().gather_rows(table.g, idx.g, g); },
      "gather_rows: idx[2] = 8 is outside [0, 5)", /*by_copy=*/true);
  Both src = make({3, 3}, rand_nz(9, rng), DType::f32);
  Both sidx = ints({3}, {4, 9, 6});
  expect_reported(
      "scatter_add_rows", [&] { gpu().scatter_add_rows(src.g, sidx.g, Tensor(), table.g); },
      "scatter_add_rows: idx[1] = 9 is outside [0, 5)");
  expect_reported(
      "scatter_rows", [&] { gpu().scatter_rows(src.g, sidx.g, table.g); },
      "scatter_rows: idx[1] = 9 is outside [0, 5)");
  expect_reported(
      "embedding_backward", [&] { gpu().embedding_backward(src.g, sidx.g, table.g); },
      "embedding_backward: token id 9 at position 1 is outside the vocabulary [0, 5)");
  Both logits = make({2, 32}, rand_nz(64, rng), DType::f32);
  Both targets = ints({2}, {-1, 40});
  Tensor loss = gpu().empty({2}, DType::f32), lse = gpu().empty({2}, DType::f32);
  expect_reported(
      "cross_entropy_forward",
      [&] { gpu().cross_entropy_forward(logits.g, targets.g, 0.f, loss, lse); },
      "cross_entropy_forward: target id 40 of row 1 is outside the vocabulary [0, 32)");
  for (const char* kernel : {"flash", "dot_product"}) {
    auto ga = gpu_attention(kernel);
    const Shape sq{2, 1, 2, 8}, sc{2, 6, 1, 8};
    Both q = make(sq, rand_nz(shape_numel(sq), rng), DType::f32);
    Both kc = make(sc, rand_nz(shape_numel(sc), rng), DType::f32);
    Both vc = make(sc, rand_nz(shape_numel(sc), rng), DType::f32);
    Both lengths = ints({2}, {3, 7});
    Tensor od = gpu().empty(sq, DType::f32);
    expect_reported(
        kernel, [&] { ga->decode(q.g, kc.g, vc.g, lengths.g, AttentionSpec{}, od); },
        "attention decode: lengths[1] = 7 must be in [T, Smax] = [1, 6]");
    // An empty cache: no length is valid, and the decode says so (flash's grid of no blocks was
    // a launch error that named no cause).
    const Shape s0{2, 0, 1, 8};
    Tensor k0 = gpu().empty(s0, DType::f32), v0 = gpu().empty(s0, DType::f32);
    Both ones = ints({2}, {1, 1});
    expect_reported(
        kernel, [&] { ga->decode(q.g, k0, v0, ones.g, AttentionSpec{}, od); },
        "attention decode: lengths[0] = 1 must be in [T, Smax] = [1, 0]");
  }
  Both dw = make({2, 2}, rand_nz(4, rng), DType::f32),
       w = make({2, 2}, rand_nz(4, rng), DType::f32);
  Both probs = make({2, 4}, rand_nz(8, rng), DType::f32);
  Both experts = ints({2, 2}, {0, 3, 1, 5});
  Tensor dlogits = gpu().zeros({2, 4}, DType::f32);
  expect_reported(
      "topk_route_backward",
      [&] { gpu().topk_route_backward(dw.g, w.g, experts.g, probs.g, false, true, dlogits); },
      "topk_route_backward: idx[3] = 5 is outside [0, 4)");
  // More checked launches than slots between synchronisations: the early ones are reported when
  // the slots run out, so no failure is lost.
  Both good = ints({4}, {1, 2, 3, 4});
  EXPECT_THROW(
      {
        gpu().embedding_forward(table.g, ids.g, o);
        for (int i = 0; i < 300; ++i) gpu().embedding_forward(table.g, good.g, o);
      },
      Error);
  EXPECT_NO_THROW(gpu().synchronize());
  for (int i = 0; i < 300; ++i) gpu().embedding_forward(table.g, good.g, o);
  EXPECT_NO_THROW(gpu().synchronize()) << "good ids across a slot flush";
}

TEST_F(GpuOps, GatherAndScatterRows) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (bool weighted : {false, true})
      for (int64_t M : {pick(rng, 1, 600), pick(rng, 1025, 1400)}) {  // device, host-built runs
        SCOPED_TRACE(std::string(dname(dt)) + (weighted ? " weighted" : "") + " M " +
                     std::to_string(M));
        const int64_t N = pick(rng, 1, 200), D = pick(rng, 1, 300);
        std::vector<int32_t> id(static_cast<size_t>(M));
        for (auto& i : id) i = static_cast<int32_t>(pick(rng, 0, N - 1));
        Both idx = ints({M}, id);
        Both x = make({N, D}, rand_nz(N * D, rng), dt);
        Both o = poisoned({M, D}, dt);
        gpu().gather_rows(x.g, idx.g, o.g);
        cpu().gather_rows(x.c, idx.c, o.c);
        EXPECT_TRUE(close(o, tol(dt), "gather_rows"));

        Both src = make({M, D}, rand_nz(M * D, rng), dt);
        Both w = weighted ? make({M}, rand_nz(M, rng), DType::f32) : Both{};
        Both acc = make({N, D}, rand_nz(N * D, rng), dt);
        gpu().scatter_add_rows(src.g, idx.g, w.g, acc.g);
        cpu().scatter_add_rows(src.c, idx.c, w.c, acc.c);
        EXPECT_TRUE(close(acc, tol(dt), "scatter_add_rows"));
      }
}

// scatter_rows (KV-cache writes): distinct rows in random order over a cache whose other rows
// must survive; the source in either dtype.
TEST_F(GpuOps, ScatterRows) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (DType st : kDtypes) {
      SCOPED_TRACE(std::string("out ") + dname(dt) + " src " + dname(st));
      const int64_t N = pick(rng, 2, 300), M = pick(rng, 1, N - 1), D = pick(rng, 1, 300);
      std::vector<int32_t> rows(static_cast<size_t>(N));
      for (int32_t i = 0; i < N; ++i) rows[static_cast<size_t>(i)] = i;
      std::shuffle(rows.begin(), rows.end(), rng);
      Both idx = ints({M}, std::vector<int32_t>(rows.begin(), rows.begin() + M));
      Both src = make({M, D}, rand_nz(M * D, rng), st);
      Both cache = make({N, D}, rand_nz(N * D, rng), dt);
      gpu().scatter_rows(src.g, idx.g, cache.g);
      cpu().scatter_rows(src.c, idx.c, cache.c);
      EXPECT_TRUE(close(cache, 0.0, "scatter_rows"));  // copies: the same bits
    }
}

// copy_columns (split and concat): a block of columns between matrices of other widths, copied
// (the same bits, converting where the dtypes differ) or accumulated.
TEST_F(GpuOps, CopyColumns) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (DType st : kDtypes)
      for (bool acc : {false, true}) {
        SCOPED_TRACE(std::string("dst ") + dname(dt) + " src " + dname(st) +
                     (acc ? " accumulate" : " copy"));
        const int64_t N = pick(rng, 1, 300 / kShrink), ds = pick(rng, 1, 200),
                      dd = pick(rng, 1, 200), width = pick(rng, 0, std::min(ds, dd));
        const int64_t sc = pick(rng, 0, ds - width), dc = pick(rng, 0, dd - width);
        Both src = make({N, ds}, rand_nz(N * ds, rng), st);
        Both dst = make({N, dd}, rand_nz(N * dd, rng), dt);
        gpu().copy_columns(src.g, sc, dst.g, dc, width, acc);
        cpu().copy_columns(src.c, sc, dst.c, dc, width, acc);
        EXPECT_TRUE(close(dst, acc ? tol(dt) : 0.0, "copy_columns"));
      }
  Both src = make({4, 3}, rand_nz(12, rng), DType::f32);
  Both dst = make({4, 5}, rand_nz(20, rng), DType::f32);
  EXPECT_THROW(gpu().copy_columns(src.g, 2, dst.g, 0, 2, false), Error);
  EXPECT_THROW(gpu().copy_columns(src.g, 0, dst.g, 4, 2, false), Error);
  Both rows = make({3, 4}, rand_nz(12, rng), DType::f32);
  EXPECT_THROW(gpu().copy_columns(rows.g, 0, dst.g, 0, 2, false), Error);
}

TEST_F(GpuOps, TopkRoute) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (bool sigmoid : {false, true})
      for (bool normalize : {false, true}) {
        SCOPED_TRACE(std::string(dname(dt)) + (sigmoid ? " sigmoid" : " softmax") +
                     (normalize ? " normalize" : ""));
        const int64_t N = pick(rng, 1, 500), E = pick(rng, 2, 64);
        const int k = static_cast<int>(pick(rng, 1, std::min<int64_t>(E, 8)));
        Both logits = make({N, E}, rand_nz(N * E, rng, 2.f), dt);
        Both w = poisoned({N, k}, DType::f32), probs = poisoned({N, E}, DType::f32);
        Both idx{gpu().empty({N, k}, DType::i32), cpu().empty({N, k}, DType::i32)};
        gpu().topk_route_forward(logits.g, k, sigmoid, normalize, w.g, idx.g, probs.g);
        cpu().topk_route_forward(logits.c, k, sigmoid, normalize, w.c, idx.c, probs.c);
        EXPECT_TRUE(close(probs, 1e-5, "topk_route_forward probs"));
        EXPECT_TRUE(close(w, 1e-5, "topk_route_forward weights"));
        // Distinct logits differ by at least one bf16/f32 step, far more than the last-bit
        // differences of exp, and exact ties go to the lower index on both sides.
        EXPECT_EQ(test::to_ints(idx.g), test::to_ints(idx.c));

        Both dw = make({N, k}, rand_nz(N * k, rng), DType::f32);
        Both dlogits = make({N, E}, rand_nz(N * E, rng), dt);
        gpu().topk_route_backward(dw.g, w.g, idx.g, probs.g, sigmoid, normalize, dlogits.g);
        cpu().topk_route_backward(dw.c, w.c, idx.c, probs.c, sigmoid, normalize, dlogits.c);
        EXPECT_TRUE(close(dlogits, tol(dt), "topk_route_backward"));
      }
}

TEST_F(GpuOps, GroupedMatmul) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (bool trans_w : {false, true}) {
      SCOPED_TRACE(std::string(dname(dt)) + (trans_w ? " trans_w" : ""));
      const int64_t E = pick(rng, 1, 5), K = pick(rng, 1, 70), N = pick(rng, 1, 70);
      std::vector<int32_t> off(static_cast<size_t>(E) + 1, 0);
      for (int64_t e = 0; e < E; ++e) off[e + 1] = off[e] + static_cast<int32_t>(pick(rng, 0, 40));
      const int64_t M = off[E];
      if (M == 0) continue;
      const Shape sw = trans_w ? Shape{E, N, K} : Shape{E, K, N};
      Both offsets = ints({E + 1}, off);
      Both x = make({M, K}, rand_nz(M * K, rng), dt), w = make(sw, rand_nz(E * K * N, rng), dt);
      Both o = poisoned({M, N}, dt);
      gpu().grouped_matmul(x.g, w.g, offsets.g, trans_w, o.g);
      cpu().grouped_matmul(x.c, w.c, offsets.c, trans_w, o.c);
      EXPECT_TRUE(close(o, tol(dt), "grouped_matmul"));
      Both dout = make({M, N}, rand_nz(M * N, rng), dt);
      Both dw = make(sw, rand_nz(E * K * N, rng), dt);
      gpu().grouped_matmul_weight_grad(x.g, dout.g, offsets.g, trans_w, dw.g);
      cpu().grouped_matmul_weight_grad(x.c, dout.c, offsets.c, trans_w, dw.c);
      EXPECT_TRUE(close(dw, tol(dt), "grouped_matmul_weight_grad"));
    }
}

TEST_F(GpuOps, RmsNorm) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (bool plus_one : {false, true})
      // Any width (element by element) and a multiple of 8 (16-byte accesses).
      for (const int64_t D : {pick(rng, 1, 2100), 8 * pick(rng, 1, 262)}) {
        SCOPED_TRACE(std::string(dname(dt)) + (plus_one ? " plus_one" : "") + " D " +
                     std::to_string(D));
        const int64_t N = pick(rng, 1, 3000 / kShrink);
        Both x = make({N, D}, rand_nz(N * D, rng), dt), w = make({D}, rand_nz(D, rng), dt);
        Both o = poisoned({N, D}, dt), rstd = poisoned({N}, DType::f32);
        gpu().rmsnorm_forward(x.g, w.g, 1e-5f, plus_one, o.g, rstd.g);
        cpu().rmsnorm_forward(x.c, w.c, 1e-5f, plus_one, o.c, rstd.c);
        EXPECT_TRUE(close(o, tol(dt), "rmsnorm_forward out"));
        EXPECT_TRUE(close(rstd, 1e-5, "rmsnorm_forward rstd"));

        Both dout = make({N, D}, rand_nz(N * D, rng), dt);
        Both dx = make({N, D}, rand_nz(N * D, rng), dt), dw = make({D}, rand_nz(D, rng), dt);
        gpu().rmsnorm_backward(dout.g, x.g, w.g, rstd.g, plus_one, dx.g, dw.g);
        cpu().rmsnorm_backward(dout.c, x.c, w.c, rstd.c, plus_one, dx.c, dw.c);
        EXPECT_TRUE(close(dx, tol(dt), "rmsnorm_backward dx"));
        EXPECT_TRUE(close(dw, dt == DType::f32 ? 2e-5 : 1e-2, "rmsnorm_backward dw"));

        // The weight gradient is reproducible bit for bit.
        Tensor dw1 = gpu().zeros({D}, DType::f32), dw2 = gpu().zeros({D}, DType::f32);
        Tensor dx1 = gpu().zeros({N, D}, DType::f32);
        gpu().rmsnorm_backward(dout.g, x.g, w.g, rstd.g, plus_one, dx1, dw1);
        gpu().rmsnorm_backward(dout.g, x.g, w.g, rstd.g, plus_one, dx1, dw2);
        EXPECT_EQ(test::to_vector(dw1), test::to_vector(dw2));
      }
}

TEST_F(GpuOps, LayerNorm) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (bool bias : {false, true}) {
      SCOPED_TRACE(std::string(dname(dt)) + (bias ? " bias" : ""));
      const int64_t N = pick(rng, 1, 3000 / kShrink), D = pick(rng, 1, 2100);
      Both x = make({N, D}, rand_nz(N * D, rng, 2.f), dt), w = make({D}, rand_nz(D, rng), dt);
      Both b = bias ? make({D}, rand_nz(D, rng), dt) : Both{};
      Both o = poisoned({N, D}, dt), mean = poisoned({N}, DType::f32);
      Both rstd = poisoned({N}, DType::f32);
      gpu().layernorm_forward(x.g, w.g, b.g, 1e-5f, o.g, mean.g, rstd.g);
      cpu().layernorm_forward(x.c, w.c, b.c, 1e-5f, o.c, mean.c, rstd.c);
      EXPECT_TRUE(close(o, tol(dt), "layernorm_forward out"));
      EXPECT_TRUE(close(mean, 1e-5, "layernorm_forward mean"));
      EXPECT_TRUE(close(rstd, 1e-5, "layernorm_forward rstd"));

      Both dout = make({N, D}, rand_nz(N * D, rng), dt);
      Both dx = make({N, D}, rand_nz(N * D, rng), dt), dw = make({D}, rand_nz(D, rng), dt);
      Both db = bias ? make({D}, rand_nz(D, rng), dt) : Both{};
      gpu().layernorm_backward(dout.g, x.g, w.g, mean.g, rstd.g, dx.g, dw.g, db.g);
      cpu().layernorm_backward(dout.c, x.c, w.c, mean.c, rstd.c, dx.c, dw.c, db.c);
      EXPECT_TRUE(close(dx, tol(dt), "layernorm_backward dx"));
      EXPECT_TRUE(close(dw, dt == DType::f32 ? 2e-5 : 1e-2, "layernorm_backward dw"));
      if (bias) {
        EXPECT_TRUE(close(db, dt == DType::f32 ? 2e-5 : 1e-2, "layernorm_backward db"));
      }
    }
}

TEST_F(GpuOps, Rope) {
  MT_SEEDED_RNG(rng);
  std::vector<RopeSpec> specs(5);
  specs[1].interleaved = true;
  specs[2].type = RopeSpec::Type::llama3;
  specs[2].theta = 500000.f;
  specs[2].factor = 8.f;
  specs[3].type = RopeSpec::Type::yarn;
  specs[3].factor = 4.f;
  specs[3].original_max_position = 4096;
  specs[4].rotary_dim = 16;  // partial rotary: features past 16 pass through
  for (DType dt : kDtypes)
    for (size_t si = 0; si < specs.size(); ++si)
      // D = 2 x odd goes element by element, a multiple of 16 through 16-byte accesses.
      for (const int64_t D : {2 * (2 * pick(rng, 4, 31) + 1), 16 * pick(rng, 1, 8)}) {
        SCOPED_TRACE(std::string(dname(dt)) + " spec " + std::to_string(si) + " D " +
                     std::to_string(D));
        const int64_t B = pick(rng, 1, 3), T = pick(rng, 1, 40), H = pick(rng, 1, 5);
        std::vector<int32_t> pos(static_cast<size_t>(B * T));
        for (auto& p : pos) p = static_cast<int32_t>(pick(rng, 0, 131072));
        Both positions = ints({B, T}, pos);
        const Shape s{B, T, H, D};
        Both x = make(s, rand_nz(shape_numel(s), rng), dt);
        Both o = poisoned(s, dt);
        gpu().rope_forward(x.g, positions.g, specs[si], o.g);
        cpu().rope_forward(x.c, positions.c, specs[si], o.c);
        EXPECT_TRUE(close(o, tol(dt), "rope_forward"));
        Both dx = make(s, rand_nz(shape_numel(s), rng), dt);
        gpu().rope_backward(x.g, positions.g, specs[si], dx.g);
        cpu().rope_backward(x.c, positions.c, specs[si], dx.c);
        EXPECT_TRUE(close(dx, tol(dt), "rope_backward"));
      }
  // The backend keeps each spec's table: specs that differ in one field at the same width, each
  // met twice (the second time from the cache), and yarn's attention factor, which scales cos
  // and sin without changing the frequencies.
  specs[4] = specs[3];
  specs[4].attention_factor = 1.5f;
  const int64_t B = 2, T = 9, H = 3, D = 32;
  const Shape s{B, T, H, D};
  std::vector<int32_t> pos(static_cast<size_t>(B * T));
  for (auto& p : pos) p = static_cast<int32_t>(pick(rng, 0, 131072));
  Both positions = ints({B, T}, pos);
  for (int pass = 0; pass < 2; ++pass)
    for (size_t si = 0; si < specs.size(); ++si) {
      SCOPED_TRACE("pass " + std::to_string(pass) + " spec " + std::to_string(si));
      Both x = make(s, rand_nz(shape_numel(s), rng), DType::f32);
      Both o = poisoned(s, DType::f32);
      gpu().rope_forward(x.g, positions.g, specs[si], o.g);
      cpu().rope_forward(x.c, positions.c, specs[si], o.c);
      EXPECT_TRUE(close(o, tol(DType::f32), "rope_forward"));
    }
}

TEST_F(GpuOps, Activations) {
  MT_SEEDED_RNG(rng);
  const Activation acts[] = {Activation::silu, Activation::gelu_tanh, Activation::gelu_exact,
                             Activation::relu, Activation::tanh};
  for (DType dt : kDtypes)
    for (Activation act : acts) {
      SCOPED_TRACE(std::string(dname(dt)) + " act " + std::to_string(int(act)));
      const int64_t n = pick(rng, 1, 50000);
      const Shape s{n};
      Both x = make(s, rand_nz(n, rng, 3.f), dt), up = make(s, rand_nz(n, rng), dt);
      Both g = make(s, rand_nz(n, rng), dt);
      Both o = poisoned(s, dt);
      gpu().activation_forward(act, x.g, o.g);
      cpu().activation_forward(act, x.c, o.c);
      EXPECT_TRUE(close(o, tol(dt), "activation_forward"));
      Both dx = make(s, rand_nz(n, rng), dt);
      gpu().activation_backward(act, g.g, x.g, dx.g);
      cpu().activation_backward(act, g.c, x.c, dx.c);
      EXPECT_TRUE(close(dx, tol(dt), "activation_backward"));

      o = poisoned(s, dt);
      gpu().gated_forward(act, x.g, up.g, o.g);
      cpu().gated_forward(act, x.c, up.c, o.c);
      EXPECT_TRUE(close(o, tol(dt), "gated_forward"));
      Both dgate = make(s, rand_nz(n, rng), dt), dup = make(s, rand_nz(n, rng), dt);
      gpu().gated_backward(act, g.g, x.g, up.g, dgate.g, dup.g);
      cpu().gated_backward(act, g.c, x.c, up.c, dgate.c, dup.c);
      EXPECT_TRUE(close(dgate, tol(dt), "gated_backward dgate"));
      EXPECT_TRUE(close(dup, tol(dt), "gated_backward dup"));
    }
}

TEST_F(GpuOps, Softcap) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    const int64_t n = pick(rng, 1, 50000);
    Both x = make({n}, rand_nz(n, rng, 40.f), dt), g = make({n}, rand_nz(n, rng), dt);
    Both o = poisoned({n}, dt);
    gpu().softcap_forward(x.g, 30.f, o.g);
    cpu().softcap_forward(x.c, 30.f, o.c);
    EXPECT_TRUE(close(o, tol(dt), "softcap_forward"));
    // The backward reads the forward's output: give both sides the cpu's, so a last-bit
    // difference near saturation (1 - t^2 cancels) is not amplified into the comparison.
    Both y = make({n}, test::to_vector(o.c), dt);
    Both dx = make({n}, rand_nz(n, rng), dt);
    gpu().softcap_backward(g.g, y.g, 30.f, dx.g);
    cpu().softcap_backward(g.c, y.c, 30.f, dx.c);
    EXPECT_TRUE(close(dx, tol(dt), "softcap_backward"));
  }
}

TEST_F(GpuOps, Softmax) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    const int64_t N = pick(rng, 1, 500), C = pick(rng, 1, 3000);
    Both x = make({N, C}, rand_nz(N * C, rng, 3.f), dt), g = make({N, C}, rand_nz(N * C, rng), dt);
    Both o = poisoned({N, C}, dt);
    gpu().softmax_forward(x.g, o.g);
    cpu().softmax_forward(x.c, o.c);
    EXPECT_TRUE(close(o, tol(dt), "softmax_forward"));
    Both y = make({N, C}, test::to_vector(o.c), dt);  // the same forward output on both sides
    Both dx = make({N, C}, rand_nz(N * C, rng), dt);
    gpu().softmax_backward(g.g, y.g, dx.g);
    cpu().softmax_backward(g.c, y.c, dx.c);
    EXPECT_TRUE(close(dx, tol(dt), "softmax_backward"));
  }
}

TEST_F(GpuOps, CrossEntropy) {
  MT_SEEDED_RNG(rng);
  for (DType dt : kDtypes)
    for (float z : {0.f, 1e-4f})
      // Any vocabulary (element by element) and a multiple of 8 (16-byte loads).
      for (const int64_t V : {pick(rng, 2, 33000), 8 * pick(rng, 1, 4100)}) {
        SCOPED_TRACE(std::string(dname(dt)) + " z_loss " + std::to_string(z) + " V " +
                     std::to_string(V));
        const int64_t N = pick(rng, 1, 300);
        std::vector<int32_t> t(static_cast<size_t>(N));
        for (auto& x : t) x = static_cast<int32_t>(pick(rng, 0, V - 1));
        t[0] = -1;  // an ignored row
        Both targets = ints({N}, t);
        Both logits = make({N, V}, rand_nz(N * V, rng, 4.f), dt);
        Both loss = poisoned({N}, DType::f32), lse = poisoned({N}, DType::f32);
        gpu().cross_entropy_forward(logits.g, targets.g, z, loss.g, lse.g);
        cpu().cross_entropy_forward(logits.c, targets.c, z, loss.c, lse.c);
        EXPECT_TRUE(close(loss, 1e-5, "cross_entropy_forward loss"));
        EXPECT_TRUE(close(lse, 1e-5, "cross_entropy_forward lse"));
        Both dloss = make({N}, rand_nz(N, rng), dt);
        Both dlogits = make({N, V}, rand_nz(N * V, rng, 1e-3f), dt);
        gpu().cross_entropy_backward(dloss.g, logits.g, targets.g, lse.g, z, dlogits.g);
        cpu().cross_entropy_backward(dloss.c, logits.c, targets.c, lse.c, z, dlogits.c);
        EXPECT_TRUE(close(dlogits, tol(dt), "cross_entropy_backward"));
      }
}

TEST_F(GpuOps, AdamW) {
  MT_SEEDED_RNG(rng);
  for (DType dp : kDtypes)
    for (DType dg : kDtypes) {
      SCOPED_TRACE(std::string("param ") + dname(dp) + ", grad " + dname(dg));
      const int64_t n = pick(rng, 1, 100000);
      Both p = make({n}, rand_nz(n, rng), dp), g = make({n}, rand_nz(n, rng), dg);
      std::vector<float> mv = rand_nz(n, rng, 0.1f), vv = test::randn(n, rng, 0.1f);
      for (auto& x : vv) x = x * x + 1e-4f;  // second moments are positive
      Both m = make({n}, mv, DType::f32), v = make({n}, vv, DType::f32);
      AdamWParams ap;
      ap.lr = 1e-3f;
      ap.weight_decay = 0.1f;
      ap.step = 7;
      ap.grad_scale = 0.5f;
      gpu().adamw_update(p.g, g.g, m.g, v.g, ap);
      cpu().adamw_update(p.c, g.c, m.c, v.c, ap);
      EXPECT_TRUE(close(p, tol(dp), "adamw param"));
      EXPECT_TRUE(close(m, 1e-5, "adamw m"));
      EXPECT_TRUE(close(v, 1e-5, "adamw v"));
    }
}

// Attention: a GPU kernel against the CPU's dot_product reference on one mask/GQA case, forward,
// backward into random accumulators, and decode over a longer cache (without segment ids).
struct AttnCase {
  int64_t hq, hkv;
  bool causal;
  int64_t window;
  float softcap;
  bool segments;
  int64_t offset;
};
const AttnCase kAttnCases[] = {{4, 4, true, 0, 0.f, false, 0},  {4, 2, true, 0, 0.f, false, 3},
                               {6, 1, false, 0, 0.f, false, 0}, {4, 2, true, 5, 0.f, false, 0},
                               {2, 2, true, 0, 20.f, false, 0}, {4, 1, true, 0, 0.f, true, 0},
                               {3, 3, false, 4, 10.f, true, 0}, {4, 2, true, 70, 0.f, false, 9},
                               {4, 1, true, 6, 15.f, false, 2}};  // Gemma: MQA, window, soft-cap

class GpuAttention : public GpuOps {
 protected:
  void compare(AttentionKernel& gk, const AttnCase& cs, DType dt, int64_t B, int64_t T, int64_t D,
               double limit, std::mt19937_64& rng) {
    SCOPED_TRACE(gk.name() + " " + dname(dt) + " B " + std::to_string(B) + " T " +
                 std::to_string(T) + " D " + std::to_string(D) + " hq " + std::to_string(cs.hq) +
                 " hkv " + std::to_string(cs.hkv) + (cs.causal ? " causal" : "") + " window " +
                 std::to_string(cs.window) + " softcap " + std::to_string(cs.softcap) +
                 (cs.segments ? " segments" : "") + " offset " + std::to_string(cs.offset));
    auto ck = test::attention("dot_product", cpu());
    const int64_t S = T + cs.offset;
    const Shape sq{B, T, cs.hq, D}, sk{B, S, cs.hkv, D};
    Both q = make(sq, rand_nz(shape_numel(sq), rng), dt);
    Both k = make(sk, rand_nz(shape_numel(sk), rng), dt);
    Both v = make(sk, rand_nz(shape_numel(sk), rng), dt);
    Both qs, ks;
    if (cs.segments) {
      std::vector<int32_t> a(static_cast<size_t>(B * T)), b(static_cast<size_t>(B * S));
      for (auto& x : a) x = static_cast<int32_t>(pick(rng, 0, 2));
      for (auto& x : b) x = static_cast<int32_t>(pick(rng, 0, 2));
      qs = ints({B, T}, a);
      ks = ints({B, S}, b);
    }
    AttentionSpec spec;
    spec.causal = cs.causal;
    spec.window = cs.window;
    spec.softcap = cs.softcap;
    spec.query_offset = cs.offset;
    Both o = poisoned(sq, dt), lse = poisoned({B, cs.hq, T}, DType::f32);
    gk.forward(q.g, k.g, v.g, qs.g, ks.g, spec, o.g, lse.g);
    ck->forward(q.c, k.c, v.c, qs.c, ks.c, spec, o.c, lse.c);
    EXPECT_TRUE(close(o, limit, "attention forward out"));
    // lse is -inf on rows that see no key, on both sides. Scores sum exact products of the same
    // inputs in f32 on both sides: lse agrees far more closely than the output.
    const double lse_tol = limit > tol(dt) ? 1e-4 : 1e-5;
    const std::vector<float> gl = test::to_vector(lse.g), cl = test::to_vector(lse.c);
    for (size_t i = 0; i < gl.size(); ++i) {
      if (std::isinf(cl[i]))
        EXPECT_EQ(gl[i], cl[i]) << "lse " << i;
      else
        EXPECT_NEAR(gl[i], cl[i], lse_tol * std::max(1.f, std::fabs(cl[i]))) << "lse " << i;
    }

    // Backward into random accumulators, from the same forward output on both sides.
    Both dout = make(sq, rand_nz(shape_numel(sq), rng), dt);
    Both dq = make(sq, rand_nz(shape_numel(sq), rng), dt);
    Both dk = make(sk, rand_nz(shape_numel(sk), rng), dt);
    Both dv = make(sk, rand_nz(shape_numel(sk), rng), dt);
    gk.backward(dout.g, q.g, k.g, v.g, qs.g, ks.g, o.g, lse.g, spec, dq.g, dk.g, dv.g);
    ck->backward(dout.c, q.c, k.c, v.c, qs.c, ks.c, o.c, lse.c, spec, dq.c, dk.c, dv.c);
    EXPECT_TRUE(close(dq, limit, "attention backward dq"));
    EXPECT_TRUE(close(dk, limit, "attention backward dk"));
    EXPECT_TRUE(close(dv, limit, "attention backward dv"));

    // Decode: the same q attends to a cache of Smax rows of which lengths[b] are valid.
    if (cs.segments) return;
    const int64_t smax = S + 7;
    const Shape sc{B, smax, cs.hkv, D};
    Both kc = make(sc, rand_nz(shape_numel(sc), rng), dt);
    Both vc = make(sc, rand_nz(shape_numel(sc), rng), dt);
    std::vector<int32_t> len(static_cast<size_t>(B));
    for (auto& l : len) l = static_cast<int32_t>(pick(rng, T, smax));
    Both lengths = ints({B}, len);
    Both od = poisoned(sq, dt);
    gk.decode(q.g, kc.g, vc.g, lengths.g, spec, od.g);
    ck->decode(q.c, kc.c, vc.c, lengths.c, spec, od.c);
    EXPECT_TRUE(close(od, limit, "attention decode"));
  }
};

// Non-finite inputs give NaN as the CPU gives it (a NaN in a softmax's row is NaN): a logits row
// with one NaN (cross-entropy's max and sum passed over it: a finite loss), a NaN query row
// (dot_product's and flash decode's max passed over it: zeros, or lse -inf under flash), a NaN
// key alone in a decode chunk (read as a chunk without keys: a finite row).
TEST_F(GpuAttention, NonFiniteInputsGiveNaNAsOnTheCpu) {
  MT_SEEDED_RNG(rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (DType dt : kDtypes) {
    SCOPED_TRACE(dname(dt));
    {
      const int64_t N = 2, V = 67;
      std::vector<float> x = rand_nz(N * V, rng, 4.f);
      x[5] = nan;  // row 0, not its target
      Both logits = make({N, V}, x, dt), targets = ints({N}, {1, 2});
      Both loss = poisoned({N}, DType::f32), lse = poisoned({N}, DType::f32);
      gpu().cross_entropy_forward(logits.g, targets.g, 0.f, loss.g, lse.g);
      const std::vector<float> l = test::to_vector(loss.g);
      EXPECT_TRUE(std::isnan(l[0])) << l[0];
      EXPECT_TRUE(std::isfinite(l[1])) << l[1];
    }
    for (const char* name : {"dot_product", "flash"}) {
      SCOPED_TRACE(name);
      auto ga = gpu_attention(name);
      const int64_t B = 1, T = 70, H = 2, D = 64;
      std::vector<float> qv = rand_nz(B * T * H * D, rng);
      for (int64_t d = 0; d < D; ++d) qv[(66 * H + 0) * D + d] = nan;  // row 66, head 0
      Both q = make({B, T, H, D}, qv, dt);
      Both k = make({B, T, H, D}, rand_nz(B * T * H * D, rng), dt);
      Both v = make({B, T, H, D}, rand_nz(B * T * H * D, rng), dt);
      Both none;
      AttentionSpec spec;
      spec.causal = true;
      Both o = poisoned({B, T, H, D}, dt), lse = poisoned({B, H, T}, DType::f32);
      ga->forward(q.g, k.g, v.g, none.g, none.g, spec, o.g, lse.g);
      const std::vector<float> out = test::to_vector(o.g), ls = test::to_vector(lse.g);
      EXPECT_TRUE(std::isnan(out[(66 * H + 0) * D])) << out[(66 * H + 0) * D];
      EXPECT_TRUE(std::isnan(ls[66])) << ls[66];
      EXPECT_TRUE(std::isfinite(out[(65 * H + 0) * D]));
      EXPECT_TRUE(std::isfinite(out[(66 * H + 1) * D]));
      // Decode of one token: a NaN query head, then a NaN key alone in the last chunk.
      const int64_t S = 300;
      std::vector<float> q1 = rand_nz(H * D, rng);
      for (int64_t d = 0; d < D; ++d) q1[d] = nan;
      std::vector<float> kc = rand_nz(S * H * D, rng);
      Both qd = make({1, 1, H, D}, q1, dt), kd = make({1, S, H, D}, kc, dt),
           vd = make({1, S, H, D}, rand_nz(S * H * D, rng), dt), len = ints({1}, {200});
      Both od = poisoned({1, 1, H, D}, dt);
      ga->decode(qd.g, kd.g, vd.g, len.g, spec, od.g);
      std::vector<float> got = test::to_vector(od.g);
      EXPECT_TRUE(std::isnan(got[0])) << got[0];
      EXPECT_TRUE(std::isfinite(got[D])) << got[D];
      kc[(256 * H + 1) * D] = nan;  // key 256, kv head 1
      Both q2 = make({1, 1, H, D}, rand_nz(H * D, rng), dt), k2 = make({1, S, H, D}, kc, dt),
           len2 = ints({1}, {257});
      ga->decode(q2.g, k2.g, vd.g, len2.g, spec, od.g);
      got = test::to_vector(od.g);
      EXPECT_TRUE(std::isnan(got[D])) << got[D];
      EXPECT_TRUE(std::isfinite(got[0])) << got[0];
    }
  }
}

TEST_F(GpuAttention, DotProduct) {
  MT_SEEDED_RNG(rng);
  auto ga = gpu_attention("dot_product");
  for (DType dt : kDtypes)
    for (const AttnCase& cs : kAttnCases)
      compare(*ga, cs, dt, pick(rng, 1, 3), pick(rng, 1, 40), pick(rng, 1, 80), tol(dt), rng);
}

// Small shapes: f32, and bf16 head sizes other than 64 and 128, take the SIMT kernels; bf16 with
// head_dim 64 takes the tensor-core kernels on a single partial tile.
TEST_F(GpuAttention, FlashSmall) {
  MT_SEEDED_RNG(rng);
  auto ga = gpu_attention("flash");
  for (DType dt : kDtypes)
    for (const AttnCase& cs : kAttnCases)
      for (int64_t D : {pick(rng, 1, 80), int64_t{64}}) {
        const bool tc = dt == DType::bf16 && D == 64;
#ifdef MT_CUDA_EMULATED_OPS
        const int64_t mma_before = test::emulated_mma_calls();
#endif
        // Tensor cores round P and dS to bf16 before their products (as FlashAttention-2).
        compare(*ga, cs, dt, pick(rng, 1, 3), pick(rng, 1, 40), D, tc ? 2e-2 : tol(dt), rng);
#ifdef MT_CUDA_EMULATED_OPS
        // The path this case is meant to cover is the one that ran.
        EXPECT_EQ(test::emulated_mma_calls() > mma_before, tc) << "D " << D << " " << dname(dt);
#endif
      }
}

// Several 64-row tiles, partial last tiles, and both tensor-core head sizes; f32 runs the SIMT
// kernels on the same shapes. The sliding window of 70 with offset 9 skips whole key tiles.
TEST_F(GpuAttention, FlashTiles) {
  MT_SEEDED_RNG(rng);
  auto ga = gpu_attention("flash");
  for (DType dt : kDtypes)
    for (const AttnCase& cs : kAttnCases)
      for (int64_t D : {64, 128}) {
        // Emulated, f32 at head_dim 64 stands for the SIMT kernels (FlashSmall has the rest).
        if (kShrink > 1 && dt == DType::f32 && D == 128) continue;
        compare(*ga, cs, dt, pick(rng, 1, 2), pick(rng, 65, 65 + 135 / kShrink), D,
                dt == DType::bf16 ? 2e-2 : tol(dt), rng);
      }
}

// Long enough for several 128-row tiles a tensor-core block owns (query rows forward and dq, key
// rows dk/dv) and several 64-row tiles it streams: tiles every query sees whole (no mask), tiles
// some warps skip (causal, window), the partial last tiles, and the double-buffered copies that
// refill each buffer more than once. Emulated, four of the cases (causal MHA with an offset,
// causal GQA, non-causal MQA, window with offset); on a device all of them.
TEST_F(GpuAttention, FlashLongTiles) {
  MT_SEEDED_RNG(rng);
  auto ga = gpu_attention("flash");
  for (size_t c = 0; c < std::size(kAttnCases); ++c) {
    if (kShrink > 1 && c != 0 && c != 1 && c != 2 && c != 7) continue;
    for (int64_t D : {64, 128})
      compare(*ga, kAttnCases[c], DType::bf16, 1, pick(rng, 257, kShrink > 1 ? 300 : 700), D, 2e-2,
              rng);
  }
}

// More queries than keys (T > S, no causal mask) is a forward, not a decode: no length check
// applies. Both kernels, f32 (SIMT) and bf16 at head_dim 64 (tensor cores), against the CPU.
TEST_F(GpuAttention, ForwardWithMoreQueriesThanKeys) {
  MT_SEEDED_RNG(rng);
  for (const char* kernel : {"dot_product", "flash"}) {
    auto ga = gpu_attention(kernel);
    auto ca = test::attention("dot_product", cpu());
    for (DType dt : kDtypes) {
      SCOPED_TRACE(std::string(kernel) + " " + dname(dt));
      const int64_t B = 1, T = 150, S = 70, H = 2, D = 64;
      const Shape sq{B, T, H, D}, sk{B, S, H, D};
      Both q = make(sq, rand_nz(shape_numel(sq), rng), dt);
      Both k = make(sk, rand_nz(shape_numel(sk), rng), dt);
      Both v = make(sk, rand_nz(shape_numel(sk), rng), dt);
      AttentionSpec spec;
      spec.causal = false;
      Both o = poisoned(sq, dt), lse = poisoned({B, H, T}, DType::f32);
      ga->forward(q.g, k.g, v.g, Tensor(), Tensor(), spec, o.g, lse.g);
      ca->forward(q.c, k.c, v.c, Tensor(), Tensor(), spec, o.c, lse.c);
      EXPECT_NO_THROW(gpu().synchronize());
      EXPECT_TRUE(close(o, dt == DType::bf16 ? 2e-2 : tol(dt), "out"));
      EXPECT_TRUE(close(lse, 1e-4, "lse"));
    }
  }
}

// flash against dot_product on the GPU itself, bf16 at a training-like shape.
TEST_F(GpuAttention, FlashMatchesDotProductOnDevice) {
  MT_SEEDED_RNG(rng);
  auto fa = gpu_attention("flash");
  auto da = gpu_attention("dot_product");
  const int64_t B = 2, T = kShrink > 1 ? 128 : 256, H = 8, Hkv = 2, D = 128;
  const Shape sq{B, T, H, D}, sk{B, T, Hkv, D};
  auto dev = [&](const Shape& s) {
    return test::from_vector(gpu(), s, rand_nz(shape_numel(s), rng), DType::bf16);
  };
  Tensor q = dev(sq), k = dev(sk), v = dev(sk), dout = dev(sq);
  AttentionSpec spec;
  struct Run {
    Both o, lse, dq, dk, dv;  // .g = flash, .c = dot_product (both on the device)
  } r{{gpu().empty(sq, DType::bf16), gpu().empty(sq, DType::bf16)},
      {gpu().empty({B, H, T}, DType::f32), gpu().empty({B, H, T}, DType::f32)},
      {gpu().zeros(sq, DType::f32), gpu().zeros(sq, DType::f32)},
      {gpu().zeros(sk, DType::f32), gpu().zeros(sk, DType::f32)},
      {gpu().zeros(sk, DType::f32), gpu().zeros(sk, DType::f32)}};
  fa->forward(q, k, v, Tensor(), Tensor(), spec, r.o.g, r.lse.g);
  da->forward(q, k, v, Tensor(), Tensor(), spec, r.o.c, r.lse.c);
  EXPECT_TRUE(close(r.o, 2e-2, "flash vs dot_product out"));
  EXPECT_TRUE(close(r.lse, 1e-3, "flash vs dot_product lse"));
  fa->backward(dout, q, k, v, Tensor(), Tensor(), r.o.g, r.lse.g, spec, r.dq.g, r.dk.g, r.dv.g);
  da->backward(dout, q, k, v, Tensor(), Tensor(), r.o.c, r.lse.c, spec, r.dq.c, r.dk.c, r.dv.c);
  EXPECT_TRUE(close(r.dq, 2e-2, "flash vs dot_product dq"));
  EXPECT_TRUE(close(r.dk, 2e-2, "flash vs dot_product dk"));
  EXPECT_TRUE(close(r.dv, 2e-2, "flash vs dot_product dv"));
}

// Decode over a cache of several chunks (128 rows each): blocks per kv head and chunk, their
// partial softmaxes combined; with a sliding window some chunks see no key at all, and without
// the causal mask only lengths[b] keeps the rows past each sequence out.
TEST_F(GpuAttention, FlashDecodeLongCache) {
  MT_SEEDED_RNG(rng);
  auto ga = gpu_attention("flash");
  auto ca = test::attention("dot_product", cpu());
  for (DType dt : kDtypes)
    for (int64_t window : {int64_t{-1}, int64_t{0}, int64_t{300}})
      for (int64_t T : {1, 3}) {
        SCOPED_TRACE(std::string(dname(dt)) + (window < 0 ? " not causal" : " window ") +
                     (window < 0 ? "" : std::to_string(window)) + " T " + std::to_string(T));
        const int64_t B = 2, H = 4, Hkv = 2, D = 64, smax = 700;
        const Shape sq{B, T, H, D}, sc{B, smax, Hkv, D};
        Both q = make(sq, rand_nz(shape_numel(sq), rng), dt);
        Both kc = make(sc, rand_nz(shape_numel(sc), rng), dt);
        Both vc = make(sc, rand_nz(shape_numel(sc), rng), dt);
        Both lengths = ints({B}, {static_cast<int32_t>(pick(rng, 520, smax)),
                                  static_cast<int32_t>(pick(rng, T, 300))});
        AttentionSpec spec;
        spec.causal = window >= 0;
        spec.window = std::max<int64_t>(window, 0);
        Both od = poisoned(sq, dt);
        ga->decode(q.g, kc.g, vc.g, lengths.g, spec, od.g);
        ca->decode(q.c, kc.c, vc.c, lengths.c, spec, od.c);
        EXPECT_TRUE(close(od, tol(dt), "split decode"));
      }
}

// Bad arguments are refused before any launch, with the op and every operand's shape in the
// message (the launchers build that text only for a message); the kernel computes afterwards.
TEST_F(GpuAttention, BadArgumentsNameTheOpAndTheShapes) {
  MT_SEEDED_RNG(rng);
  const DType dt = DType::bf16;
  const auto filled = [&](const Shape& s) { return make(s, rand_nz(shape_numel(s), rng), dt).g; };
  const auto refused = [](const std::string& what, const std::vector<std::string>& parts,
                          const std::function<void()>& call) {
    try {
      call();
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      for (const std::string& p : parts)
        EXPECT_NE(m.find(p), std::string::npos)
            << what << ": \"" << m << "\" lacks \"" << p << "\"";
    }
  };
  for (const std::string name : {"dot_product", "flash"}) {
    SCOPED_TRACE(name);
    auto ga = gpu_attention(name);
    AttentionSpec spec;
    spec.causal = true;
    // Three query heads over two kv heads.
    Tensor q3 = filled({1, 5, 3, 64}), k2 = filled({1, 5, 2, 64}), v2 = filled({1, 5, 2, 64});
    Tensor o3 = filled({1, 5, 3, 64}), lse3 = gpu().empty({1, 3, 5}, DType::f32);
    refused("Hq % Hkv != 0",
            {name + " attention forward", "Hq % Hkv", "q bf16[1, 5, 3, 64]", "k bf16[1, 5, 2, 64]",
             "out bf16[1, 5, 3, 64]"},
            [&] { ga->forward(q3, k2, v2, Tensor(), Tensor(), spec, o3, lse3); });
    // dk with q's shape instead of k's.
    Tensor q = filled({1, 5, 4, 64}), o = filled({1, 5, 4, 64}), dout = filled({1, 5, 4, 64});
    Tensor dq = filled({1, 5, 4, 64}), dk = filled({1, 5, 4, 64}), dv = filled({1, 5, 2, 64});
    Tensor lse = gpu().empty({1, 4, 5}, DType::f32);
    refused("dk of q's shape",
            {name + " attention backward", "dout bf16[1, 5, 4, 64]", "dk bf16[1, 5, 4, 64]",
             "dv bf16[1, 5, 2, 64]"},
            [&] { ga->backward(dout, q, k2, v2, Tensor(), Tensor(), o, lse, spec, dq, dk, dv); });
    // Decode into an output of the wrong shape.
    Tensor q1 = filled({1, 1, 4, 64}), o1 = filled({1, 1, 4, 32});
    Tensor kc = filled({1, 9, 2, 64}), vc = filled({1, 9, 2, 64});
    Tensor len = test::from_ints(gpu(), {1}, {6});
    refused("decode out of another shape",
            {name + " attention decode", "out must have q's shape", "k bf16[1, 9, 2, 64]",
             "out bf16[1, 1, 4, 32]"},
            [&] { ga->decode(q1, kc, vc, len, spec, o1); });
    compare(*ga, kAttnCases[1], dt, 1, 5, 64, name == "flash" ? 2e-2 : tol(dt), rng);
  }
}

// The backward owns its output rows (no atomics): two runs give the same bits.
TEST_F(GpuAttention, FlashBackwardIsDeterministic) {
  MT_SEEDED_RNG(rng);
  auto fa = gpu_attention("flash");
  for (DType dt : kDtypes) {
    const int64_t B = 1, T = 130, H = 4, Hkv = 2, D = 64;
    const Shape sq{B, T, H, D}, sk{B, T, Hkv, D};
    auto dev = [&](const Shape& s) {
      return test::from_vector(gpu(), s, rand_nz(shape_numel(s), rng), dt);
    };
    Tensor q = dev(sq), k = dev(sk), v = dev(sk), dout = dev(sq);
    Tensor o = gpu().empty(sq, dt), lse = gpu().empty({B, H, T}, DType::f32);
    AttentionSpec spec;
    fa->forward(q, k, v, Tensor(), Tensor(), spec, o, lse);
    std::vector<float> first[3];
    for (int run = 0; run < 2; ++run) {
      Tensor dq = gpu().zeros(sq, DType::f32), dk = gpu().zeros(sk, DType::f32),
             dv = gpu().zeros(sk, DType::f32);
      fa->backward(dout, q, k, v, Tensor(), Tensor(), o, lse, spec, dq, dk, dv);
      const std::vector<float> got[3] = {test::to_vector(dq), test::to_vector(dk),
                                         test::to_vector(dv)};
      for (int t = 0; t < 3; ++t) {
        if (run == 0)
          first[t] = got[t];
        else
          EXPECT_EQ(got[t], first[t]) << dname(dt) << " gradient " << t << " differs between runs";
      }
    }
  }
}

// A cuda backend made while the environment variable `name` is `value` (restored after).
std::unique_ptr<Backend> gpu_with_env(const char* name, const char* value) {
  const char* old = std::getenv(name);
  const std::string saved = old ? old : "";
  setenv(name, value, 1);
  std::unique_ptr<Backend> b;
  std::string error;
  try {
    b = make_gpu();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (old)
    setenv(name, saved.c_str(), 1);
  else
    unsetenv(name);
  if (!b) throw Error(error);
  return b;
}
std::unique_ptr<Backend> gpu_with_dkv_parts(const char* value) {
  return gpu_with_env("MT_CUDA_FLASH_DKV_PARTS", value);
}

// Flash forward and backward (bf16, tensor cores) on two backends made with different kernel
// knobs that must not change a bit: o, lse, dq, dk and dv equal, under causal masks with an
// offset, GQA, windows and segment ids, at head_dim 64 and 128.
void expect_same_flash_bits(Backend& first, Backend& second, const std::string& what) {
  MT_SEEDED_RNG(rng);
  for (size_t c : {size_t{1}, size_t{5}, size_t{6}, size_t{7}})
    for (int64_t D : {64, 128}) {
      const AttnCase& cs = kAttnCases[c];
      SCOPED_TRACE("case " + std::to_string(c) + " D " + std::to_string(D));
      const int64_t B = 1, T = kShrink > 1 ? 150 : 300, S = T + cs.offset;
      const Shape sq{B, T, cs.hq, D}, sk{B, S, cs.hkv, D};
      const std::vector<float> hq = rand_nz(shape_numel(sq), rng),
                               hk = rand_nz(shape_numel(sk), rng),
                               hv = rand_nz(shape_numel(sk), rng),
                               hd = rand_nz(shape_numel(sq), rng);
      std::vector<int32_t> qseg(static_cast<size_t>(B * T)), kseg(static_cast<size_t>(B * S));
      for (auto& x : qseg) x = static_cast<int32_t>(pick(rng, 0, 2));
      for (auto& x : kseg) x = static_cast<int32_t>(pick(rng, 0, 2));
      AttentionSpec spec;
      spec.causal = cs.causal;
      spec.window = cs.window;
      spec.softcap = cs.softcap;
      spec.query_offset = cs.offset;
      std::vector<float> got[2][5];
      for (int variant = 0; variant < 2; ++variant) {
        Backend& b = variant == 0 ? first : second;
        auto fa = attention_on("flash", b);
        Tensor q = test::from_vector(b, sq, hq, DType::bf16),
               k = test::from_vector(b, sk, hk, DType::bf16),
               v = test::from_vector(b, sk, hv, DType::bf16),
               dout = test::from_vector(b, sq, hd, DType::bf16);
        Tensor qs, ks;
        if (cs.segments)
          qs = test::from_ints(b, {B, T}, qseg), ks = test::from_ints(b, {B, S}, kseg);
        Tensor o = b.empty(sq, DType::bf16), lse = b.empty({B, cs.hq, T}, DType::f32);
        fa->forward(q, k, v, qs, ks, spec, o, lse);
        Tensor dq = b.zeros(sq, DType::f32), dk = b.zeros(sk, DType::f32),
               dv = b.zeros(sk, DType::f32);
        fa->backward(dout, q, k, v, qs, ks, o, lse, spec, dq, dk, dv);
        got[variant][0] = test::to_vector(o);
        got[variant][1] = test::to_vector(lse);
        got[variant][2] = test::to_vector(dq);
        got[variant][3] = test::to_vector(dk);
        got[variant][4] = test::to_vector(dv);
      }
      const char* names[5] = {"o", "lse", "dq", "dk", "dv"};
      for (int t = 0; t < 5; ++t) {
        EXPECT_EQ(got[0][t], got[1][t]) << names[t] << " differs between " << what;
        double norm = 0;
        for (float x : got[0][t]) norm += std::isfinite(x) ? std::fabs(x) : 0.0;
        EXPECT_GT(norm, 0.0) << names[t] << " is all zeros";
      }
    }
}

// flash's dk/dv kernel takes each streamed query tile whole or in two slices of 32 (the default
// at head_dim 128, where whole tiles spill registers): the same mma.sync sequence into each
// accumulator, so the same bits (slices skipped or taken unmasked where whole tiles are not).
TEST_F(GpuAttention, FlashDkvSlicesGiveTheSameBits) {
  std::unique_ptr<Backend> whole = gpu_with_dkv_parts("1"), sliced = gpu_with_dkv_parts("2");
  expect_same_flash_bits(*whole, *sliced, "1 and 2 slices");
}

// The forward and dq kernels with 4 or 8 warps a block: each warp's 16 query rows meet the same
// key tiles in the same order (tiles that none of them sees are skipped), so the same bits.
TEST_F(GpuAttention, FlashWarpsPerBlockGiveTheSameBits) {
  std::unique_ptr<Backend> four = gpu_with_env("MT_CUDA_FLASH_WARPS", "4"),
                           eight = gpu_with_env("MT_CUDA_FLASH_WARPS", "8");
  expect_same_flash_bits(*four, *eight, "4 and 8 warps a block");
}

// The dk/dv kernel with 4 or 8 warps a block: each warp's 16 key rows meet the same query tiles
// in the same order, so the same bits.
TEST_F(GpuAttention, FlashDkvWarpsPerBlockGiveTheSameBits) {
  std::unique_ptr<Backend> four = gpu_with_env("MT_CUDA_FLASH_DKV_WARPS", "4"),
                           eight = gpu_with_env("MT_CUDA_FLASH_DKV_WARPS", "8");
  expect_same_flash_bits(*four, *eight, "dk/dv kernels of 4 and 8 warps a block");
}

// A device with 99 KiB of shared memory a block (sm_86/89/120): flash's tensor-core backward at
// head_dim 128 needs more (102 KiB), so the SIMT kernels run there, and give what the default
// device's tensor-core kernels give within bf16's rounding (before: cudaFuncSetAttribute failed
// and the run ended).
TEST_F(GpuAttention, SmallSharedMemoryTakesTheSimtKernels) {
#ifndef MT_CUDA_EMULATED_OPS
  GTEST_SKIP() << "sets the emulated device's shared memory per block (a real device has its own)";
#endif
  MT_SEEDED_RNG(rng);
  const int64_t B = 1, T = 80, H = 2, D = 128;
  const Shape s{B, T, H, D};
  const std::vector<float> hq = rand_nz(shape_numel(s), rng), hk = rand_nz(shape_numel(s), rng),
                           hv = rand_nz(shape_numel(s), rng), hd = rand_nz(shape_numel(s), rng);
  AttentionSpec spec;
  spec.causal = true;
  std::vector<float> got[2][4];
  // The emulated device's limit holds while the small one runs (cudaFuncSetAttribute reads it).
  struct Limit {
    ~Limit() { unsetenv("MT_EMULATED_SMEM_PER_BLOCK"); }
  } limit;
  std::unique_ptr<Backend> small;
  for (int variant = 0; variant < 2; ++variant) {
    if (variant == 1) {
      setenv("MT_EMULATED_SMEM_PER_BLOCK", "101376", 1);
      small = make_gpu();
    }
    Backend& b = variant == 0 ? gpu() : *small;
    auto fa = attention_on("flash", b);
    Tensor q = test::from_vector(b, s, hq, DType::bf16),
           k = test::from_vector(b, s, hk, DType::bf16),
           v = test::from_vector(b, s, hv, DType::bf16),
           dout = test::from_vector(b, s, hd, DType::bf16);
    Tensor o = b.empty(s, DType::bf16), lse = b.empty({B, H, T}, DType::f32);
    ASSERT_NO_THROW(fa->forward(q, k, v, Tensor(), Tensor(), spec, o, lse)) << variant;
    Tensor dq = b.zeros(s, DType::f32), dk = b.zeros(s, DType::f32), dv = b.zeros(s, DType::f32);
    ASSERT_NO_THROW(fa->backward(dout, q, k, v, Tensor(), Tensor(), o, lse, spec, dq, dk, dv))
        << variant;
    got[variant][0] = test::to_vector(o);
    got[variant][1] = test::to_vector(dq);
    got[variant][2] = test::to_vector(dk);
    got[variant][3] = test::to_vector(dv);
  }
  const char* names[4] = {"o", "dq", "dk", "dv"};
  for (int t = 0; t < 4; ++t) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < got[0][t].size(); ++i) {
      diff += std::pow(double(got[0][t][i]) - got[1][t][i], 2);
      norm += std::pow(double(got[0][t][i]), 2);
    }
    EXPECT_GT(norm, 0) << names[t];
    EXPECT_LT(std::sqrt(diff / norm), 2e-2) << names[t];
  }
}

// Making a backend with `var` set to each of `bad` is refused, naming the variable and value.
void expect_each_refused(const char* var, std::initializer_list<const char*> bad) {
  for (const char* value : bad) {
    try {
      gpu_with_env(var, value);
      ADD_FAILURE() << var << "=" << value << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(var) + "=" + value), std::string::npos)
          << e.what();
    }
  }
}

TEST_F(GpuOps, FlashWarpsRefusesOtherValues) {
  for (const char* var : {"MT_CUDA_FLASH_WARPS", "MT_CUDA_FLASH_DKV_WARPS"})
    expect_each_refused(var, {"2", "16", "four"});
}

TEST_F(GpuOps, FlashDkvPartsRefusesOtherValues) {
  expect_each_refused("MT_CUDA_FLASH_DKV_PARTS", {"3", "0", "two"});
}

// matmul under MT_CUDA_ROWS_GEMV=1: decode's products (at most 8 rows of a against b's [N, K]
// rows, beta 0) in rows_gemv_kernel, against the CPU backend's, for both dtypes and outputs, rows
// that take 1, 2, 4 and 8 of the kernel's row slots, N odd (a warp's second weight row past N),
// K with a partial last round of chunks, and a batch of a folded into rows. Each output row is
// the same bits whatever rows the call holds beside it. What the kernel does not take (beta, K
// not a multiple of 8, more rows, a transposed, b untransposed or one b per batch entry) goes to
// cuBLASLt, still right; the emulation counts its calls.
TEST_F(GpuOps, RowsGemvMatchesTheCpu) {
  std::unique_ptr<Backend> own = gpu_with_env("MT_CUDA_ROWS_GEMV", "1");
  Backend& g = *own;
  MT_SEEDED_RNG(rng);
  auto gemm_calls = [] {
#ifdef MT_CUDA_EMULATED_OPS
    return test::emulated_gemm_calls();
#else
    return int64_t{-1};  // cuBLASLt's calls are not counted on a device
#endif
  };
  struct Case {
    Shape lead;
    int64_t m, k, n;
    float alpha, beta;
    bool gemv;  // rows_gemv_kernel takes it
    bool ta = false, tb = true;
    Shape b_lead = {};  // b's batch dimensions (b is 2-D without)
  };
  const Case cases[] = {
      {{}, 1, 8, 1, 1.f, 0.f, true},
      {{}, 1, 264, 130, 1.f, 0.f, true},
      {{}, 2, 520, 33, 0.5f, 0.f, true},
      {{}, 3, 1032, 7, 1.f, 0.f, true},
      {{}, 4, 2056, 45, 1.f, 0.f, true},
      {{}, 5, 264, 9, 2.f, 0.f, true},
      {{}, 8, 776, 66, 1.f, 0.f, true},
      {{2, 3}, 1, 136, 31, 1.f, 0.f, true},                  // a batch of a against one b: 6 rows
      {{}, 2, 257, 40, 1.f, 0.f, false},                     // K not a multiple of 8
      {{}, 2, 264, 40, 1.f, 1.f, false},                     // beta
      {{}, 9, 264, 40, 1.f, 0.f, false},                     // more rows than decode's
      {{}, 8, 8, 40, 1.f, 0.f, false, true, true},           // a transposed: its K = 8 rows of 8
      {{}, 2, 264, 40, 1.f, 0.f, false, false, false},       // b not transposed
      {{3}, 2, 264, 40, 1.f, 0.f, false, false, true, {3}},  // one b per batch entry
  };
  for (DType dt : kDtypes)
    for (DType dc : kDtypes)
      for (const Case& cs : cases) {
        SCOPED_TRACE(std::string(dname(dt)) + " -> " + dname(dc) + " m=" + std::to_string(cs.m) +
                     " k=" + std::to_string(cs.k) + " n=" + std::to_string(cs.n));
        Shape sa = cs.lead, sb = cs.b_lead, sc = cs.lead;
        sa.insert(sa.end(), {cs.ta ? cs.k : cs.m, cs.ta ? cs.m : cs.k});
        sb.insert(sb.end(), {cs.tb ? cs.n : cs.k, cs.tb ? cs.k : cs.n});
        sc.insert(sc.end(), {cs.m, cs.n});
        const std::vector<float> ha = rand_nz(shape_numel(sa), rng),
                                 hb = rand_nz(shape_numel(sb), rng),
                                 hc = rand_nz(shape_numel(sc), rng);
        Tensor ag = test::from_vector(g, sa, ha, dt), ac = test::from_vector(cpu(), sa, ha, dt);
        Tensor bg = test::from_vector(g, sb, hb, dt), bc = test::from_vector(cpu(), sb, hb, dt);
        Tensor cg = test::from_vector(g, sc, hc, dc), cc = test::from_vector(cpu(), sc, hc, dc);
        if (cs.beta == 0.f) g.fill(cg, kNaN);  // beta 0 must not read c
        const int64_t before = gemm_calls();
        g.matmul(ag, bg, cg, cs.ta, cs.tb, cs.alpha, cs.beta);
        const int64_t calls = gemm_calls() - before;
        cpu().matmul(ac, bc, cc, cs.ta, cs.tb, cs.alpha, cs.beta);
        if (before >= 0) {
          EXPECT_EQ(calls == 0, cs.gemv) << calls << " cuBLASLt calls";
        }
        const double limit = dt == DType::f32 && dc == DType::f32 ? 1e-5 : 1e-2;
        EXPECT_TRUE(close({cg, cc}, limit, "matmul"));
        // Row by row alone: the same bits as in the whole call.
        if (!cs.gemv || !cs.lead.empty()) continue;
        const std::vector<float> whole = test::to_vector(cg);
        for (int64_t r = 0; r < cs.m; ++r) {
          Tensor one = g.empty({1, cs.n}, dc);
          g.matmul(ag.slice0(r, r + 1), bg, one, false, true, cs.alpha, 0.f);
          const std::vector<float> got = test::to_vector(one);
          EXPECT_TRUE(std::equal(got.begin(), got.end(), whole.begin() + r * cs.n))
              << "row " << r << " alone differs from the row in the call";
        }
      }
}

// The 0/1 kernel choices refuse anything else, naming the variable and its value.
TEST_F(GpuOps, KernelChoicesRefuseOtherValues) {
  for (const char* var :
       {"MT_CUDA_ROWS_GEMV", "MT_CUDA_PDL", "MT_CUDA_Q8_GEMV", "MT_CUDA_JOINT_COPIES"})
    expect_each_refused(var, {"2", "yes"});
}

// Kernels launched so far under the emulation; -1 on a device (not counted there).
int64_t kernel_launches() {
#ifdef MT_CUDA_EMULATED_OPS
  return test::emulated_kernel_launches();
#else
  return -1;
#endif
}

// split_columns under MT_CUDA_JOINT_COPIES=1: every piece in one launch for up to 8 pieces (one
// copy_columns launch each past 8, and without the switch), the same bits as the CPU's copies,
// converting where a piece's dtype differs from src's; pieces of width 0, off 16-byte
// boundaries, and rows of two leading dimensions. Bad shapes are refused.
TEST_F(GpuOps, SplitColumnsInOneLaunch) {
  std::unique_ptr<Backend> own = gpu_with_env("MT_CUDA_JOINT_COPIES", "1");
  MT_SEEDED_RNG(rng);
  for (bool once : {true, false})
    for (DType st : kDtypes)
      for (DType pt : kDtypes)
        for (int n : {1, 2, 3, 5, 8, 9}) {
          SCOPED_TRACE(std::string("src ") + dname(st) + " pieces " + dname(pt) + ", " +
                       std::to_string(n) + " pieces" + (once ? "" : ", switch off"));
          Backend& g = once ? *own : gpu();
          const int64_t lead = pick(rng, 1, 9);
          std::vector<int64_t> widths;
          int64_t d = 0;
          for (int i = 0; i < n; ++i) {
            widths.push_back(i == 1 ? 0 : pick(rng, 1, 70));
            d += widths.back();
          }
          const std::vector<float> h = rand_nz(2 * lead * d, rng);
          Tensor sg = test::from_vector(g, {2, lead, d}, h, st);
          Tensor sc = test::from_vector(cpu(), {2, lead, d}, h, st);
          std::vector<Tensor> pg, pc;
          for (int64_t w : widths) {
            pg.push_back(g.empty({2, lead, w}, pt));
            if (w) g.fill(pg.back(), kNaN);  // every element must be written
            pc.push_back(cpu().empty({2, lead, w}, pt));
          }
          const int64_t before = kernel_launches();
          g.split_columns(sg, pg);
          const int64_t count = kernel_launches() - before;
          cpu().split_columns(sc, pc);
          if (before >= 0) {
            int64_t apart = 0;
            for (int64_t w : widths) apart += w > 0;
            EXPECT_EQ(count, once && n <= 8 ? 1 : apart) << "kernel launches";
          }
          for (size_t i = 0; i < widths.size(); ++i)
            EXPECT_EQ(test::to_vector(pg[i]), test::to_vector(pc[i])) << "piece " << i;
        }
  Backend& g = *own;
  Tensor src = g.empty({4, 6}, DType::f32);
  std::vector<Tensor> short_by_one{g.empty({4, 2}, DType::f32), g.empty({4, 3}, DType::f32)};
  EXPECT_THROW(g.split_columns(src, short_by_one), Error);
  std::vector<Tensor> other_rows{g.empty({4, 2}, DType::f32), g.empty({3, 4}, DType::f32)};
  EXPECT_THROW(g.split_columns(src, other_rows), Error);
  std::vector<Tensor> ints{g.empty({4, 6}, DType::i32)};
  EXPECT_THROW(g.split_columns(src, ints), Error);
}

// scatter_rows_each under MT_CUDA_JOINT_COPIES=1 (a decode step's k and v cache writes): one
// launch for up to 4 pairs of one cache row count, else one scatter_rows each (5 pairs, caches of
// other row counts, the switch off); pairs of other widths and dtypes, the same bits as the
// CPU's, other rows untouched. A bad index is reported once at the next synchronisation, and
// nothing is written with it.
TEST_F(GpuOps, ScatterRowsEachInOneLaunch) {
  std::unique_ptr<Backend> own = gpu_with_env("MT_CUDA_JOINT_COPIES", "1");
  MT_SEEDED_RNG(rng);
  for (bool once : {true, false})
    for (int pairs : {1, 2, 4, 5})
      for (bool same_rows : {true, false}) {
        SCOPED_TRACE(std::to_string(pairs) + " pairs" + (same_rows ? "" : ", other row counts") +
                     (once ? "" : ", switch off"));
        Backend& g = once ? *own : gpu();
        const int64_t N = pick(rng, 9, 40), M = pick(rng, 1, 8);
        std::vector<int32_t> rows(static_cast<size_t>(N));
        for (int32_t i = 0; i < N; ++i) rows[static_cast<size_t>(i)] = i;
        std::shuffle(rows.begin(), rows.end(), rng);
        rows.resize(static_cast<size_t>(M));
        Tensor ig = test::from_ints(g, {M}, rows), ic = test::from_ints(cpu(), {M}, rows);
        std::vector<Tensor> sg, sc, og, oc;
        for (int t = 0; t < pairs; ++t) {
          const DType st = kDtypes[static_cast<size_t>(t) % 2],
                      ot = kDtypes[static_cast<size_t>(t / 2) % 2];
          const int64_t D = pick(rng, 1, 70), n = same_rows || t == 0 ? N : N + t;
          const std::vector<float> hs = rand_nz(M * D, rng), ho = rand_nz(n * D, rng);
          sg.push_back(test::from_vector(g, {M, D}, hs, st));
          sc.push_back(test::from_vector(cpu(), {M, D}, hs, st));
          og.push_back(test::from_vector(g, {n, D}, ho, ot));
          oc.push_back(test::from_vector(cpu(), {n, D}, ho, ot));
        }
        const int64_t before = kernel_launches();
        g.scatter_rows_each(sg, ig, og);
        const int64_t count = kernel_launches() - before;
        cpu().scatter_rows_each(sc, ic, oc);
        if (before >= 0) {
          EXPECT_EQ(count, once && pairs <= 4 && (same_rows || pairs == 1) ? 1 : pairs)
              << "kernel launches";
        }
        for (int t = 0; t < pairs; ++t)
          EXPECT_EQ(test::to_vector(og[static_cast<size_t>(t)]),
                    test::to_vector(oc[static_cast<size_t>(t)]))
              << "out " << t;
      }
  Backend& g = *own;
  const std::vector<float> k0 = rand_nz(5 * 3, rng), v0 = rand_nz(5 * 2, rng);
  std::vector<Tensor> src{test::from_vector(g, {3, 3}, rand_nz(9, rng), DType::f32),
                          test::from_vector(g, {3, 2}, rand_nz(6, rng), DType::f32)};
  std::vector<Tensor> caches{test::from_vector(g, {5, 3}, k0, DType::f32),
                             test::from_vector(g, {5, 2}, v0, DType::f32)};
  Tensor bad = test::from_ints(g, {3}, {4, 9, 6});
  g.scatter_rows_each(src, bad, caches);
  try {
    g.synchronize();
    ADD_FAILURE() << "no error reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("scatter_rows: idx[1] = 9 is outside [0, 5)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(g.synchronize()) << "reported once only";
  // Row 4 was written from src row 0; rows 0-3 are as they were.
  const std::vector<float> k = test::to_vector(caches[0]), v = test::to_vector(caches[1]);
  EXPECT_TRUE(std::equal(k.begin(), k.begin() + 12, k0.begin())) << "k rows 0-3 changed";
  EXPECT_TRUE(std::equal(v.begin(), v.begin() + 8, v0.begin())) << "v rows 0-3 changed";
  std::vector<Tensor> one_out{caches[0]};
  EXPECT_THROW(g.scatter_rows_each(src, bad, one_out), Error);
  Tensor short_idx = test::from_ints(g, {2}, {0, 1});
  EXPECT_THROW(g.scatter_rows_each(src, short_idx, caches), Error);
}

// More memory than any device has: a message that says what to change, and the backend goes on.
TEST_F(GpuOps, OutOfMemorySaysWhatToChange) {
  Backend& b = gpu();
  try {
    Tensor huge = b.empty({int64_t{1} << 42}, DType::f32);  // 16 TiB
    ADD_FAILURE() << "16 TiB were allocated";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("out of"), std::string::npos) << m;
    EXPECT_NE(m.find("per_device_batch_size"), std::string::npos) << m;
    EXPECT_NE(m.find("remat_policy=full"), std::string::npos) << m;
  }
  Tensor t = b.empty({1000}, DType::f32);
  b.fill(t, 2.f);
  EXPECT_EQ(b.sum(t), 2000.0);
}

// Sizes past what the arithmetic or any device holds are refused at once (issue 24, item 4:
// the allocator's rounding loop never ended above 2^63 bytes).
TEST_F(GpuOps, AbsurdAllocationsAreRefused) {
  Backend& b = gpu();
  EXPECT_THROW(b.empty({int64_t{1} << 62, 4}, DType::f32), Error);
  EXPECT_THROW(b.empty({int64_t{1} << 61}, DType::u8), Error);
  Tensor t = b.empty({1000}, DType::f32);
  b.fill(t, 2.f);
  EXPECT_EQ(b.sum(t), 2000.0);
}

TEST_F(GpuOps, AllocatorReusesBlocks) {
  Backend& b = gpu();
  { Tensor warm = b.empty({1 << 20}, DType::f32); }
  const size_t before = b.memory_stats().num_system_allocs;
  for (int i = 0; i < 10; ++i) {
    Tensor t = b.empty({1 << 20}, DType::f32);
    b.fill(t, 1.f);
  }
  b.synchronize();
  EXPECT_EQ(b.memory_stats().num_system_allocs, before) << "steady state must not cudaMalloc";
  EXPECT_GT(b.memory_stats().bytes_cached, size_t{0});
}

// Recorded work (CUDA graphs, mt/capture.h): a replay runs the recorded kernels on the inputs'
// current contents; bad inputs found during a replay are reported at the next synchronisation;
// what cannot be recorded is refused and the backend works on after abandon(); blocks the
// recording allocated are not handed out again while the work lives, even once freed.
TEST_F(GpuOps, RecordedWorkReplaysOnNewInputsAndReportsBadOnes) {
  Backend& b = gpu();
  auto* cap = static_cast<WorkCapture*>(b.extension(kWorkCapture));
  if (!cap) GTEST_SKIP() << "this backend cannot record work (emulated, or MT_CUDA_GRAPHS=0)";
  MT_SEEDED_RNG(rng);
  const std::vector<float> table_v = rand_nz(10 * 4, rng);
  Tensor table = test::from_vector(b, {10, 4}, table_v, DType::f32);
  Tensor ids = test::from_ints(b, {3}, {1, 2, 3});
  b.synchronize();
  cap->begin();
  // A copy, a synchronisation and a host reduction cannot be recorded; after abandon() the
  // backend runs ops as before.
  EXPECT_THROW(b.copy_from_host(ids, std::vector<int32_t>{0, 0, 0}.data()), Error);
  cap->abandon();
  EXPECT_NO_THROW(b.synchronize());
  cap->begin();
  EXPECT_THROW(b.synchronize(), Error);
  cap->abandon();
  cap->begin();
  EXPECT_THROW(static_cast<void>(b.sum(table)), Error);
  cap->abandon();
  EXPECT_NEAR(b.sum(table), std::accumulate(table_v.begin(), table_v.end(), 0.0), 1e-4);

  cap->begin();
  void* freed_inside = nullptr;
  Tensor out;
  {
    Tensor rows = b.empty({3, 4}, DType::f32);
    freed_inside = rows.data();
    b.embedding_forward(table, ids, rows);
    out = b.empty({3, 4}, DType::f32);
    b.scale(rows, 2.f, out);
  }
  std::unique_ptr<CapturedWork> work = cap->end();
  // The block freed during the recording stays the recording's.
  std::vector<Tensor> later;
  for (int i = 0; i < 4; ++i) {
    later.push_back(b.empty({3, 4}, DType::f32));
    EXPECT_NE(later.back().data(), freed_inside);
    EXPECT_NE(later.back().data(), out.data());
    b.fill(later.back(), 7.f);
  }
  for (const std::vector<int32_t>& v : {std::vector<int32_t>{1, 2, 3}, {9, 0, 4}}) {
    b.copy_from_host(ids, v.data());
    b.fill(out, kNaN);
    work->replay();
    const std::vector<float> got = test::to_vector(out);
    for (size_t r = 0; r < 3; ++r)
      for (size_t c = 0; c < 4; ++c)
        EXPECT_EQ(got[r * 4 + c], 2.f * table_v[static_cast<size_t>(v[r]) * 4 + c]);
  }
  const std::vector<int32_t> bad = {1, 12, 2};
  b.copy_from_host(ids, bad.data());
  work->replay();
  try {
    b.synchronize();
    ADD_FAILURE() << "the bad id of the replay was not reported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 12 at position 1"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(b.synchronize()) << "reported once only";
  b.copy_from_host(ids, std::vector<int32_t>{3, 3, 3}.data());
  work->replay();
  EXPECT_NO_THROW(b.synchronize()) << "the slots are clear again";
  EXPECT_EQ(test::to_vector(out)[0], 2.f * table_v[12]);
  for (const Tensor& t : later) EXPECT_EQ(test::to_vector(t)[0], 7.f) << "untouched by replays";
  work.reset();
  out = Tensor();
  EXPECT_NO_THROW(b.synchronize());
}

}  // namespace
}  // namespace mt
