// Graph's SDK v2 ops (graph_ops.cpp) on the CPU backend: split and concat on the last dimension,
// the mixture-of-experts ops, each against central differences; the moe block against a naive
// per-token loop on the host, with its auxiliary losses; Backend::copy_columns's default (what a
// backend without the kernel runs); the attention block with a value head size other than the
// query/key one, against a host reference and decoding token by token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mt/blocks.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/q8.h"
#include "test_support.h"

namespace mt {
namespace {

using Fn = std::function<std::vector<Tensor>(Graph&, const std::vector<Tensor>&)>;

// The tape's gradients of L = sum_j <out_j, seed_j> (random seeds) for every input against
// central differences of L evaluated without recording, Richardson-extrapolated from steps h and
// h / 2 so that the reference's error is O(h^4): a plain central difference at h = 1e-2 is off by
// a few 1e-3 where a random draw makes a softmax sharp (seed 2407425081 of the attention test),
// and a smaller h drowns in f32 rounding. Inputs are f32 leaves.
void check_gradients(const Fn& f, const std::vector<Shape>& shapes,
                     std::vector<std::vector<float>> vals, std::mt19937_64& rng, float h = 1e-2f,
                     double atol = 2e-3, double rtol = 2e-2) {
  Backend& be = test::cpu();
  Graph g(be);
  std::vector<Tensor> in, grads;
  for (size_t i = 0; i < shapes.size(); ++i) {
    in.push_back(test::from_vector(be, shapes[i], vals[i]));
    grads.push_back(be.zeros(shapes[i], DType::f32));
    Graph::track(in.back(), grads.back());
  }
  const std::vector<Tensor> outs = f(g, in);
  std::vector<std::vector<float>> seeds;
  std::vector<std::pair<Tensor, Tensor>> roots;
  for (const Tensor& o : outs) {
    seeds.push_back(test::randn(static_cast<size_t>(o.numel()), rng));
    roots.emplace_back(o, test::from_vector(be, o.shape(), seeds.back()));
  }
  g.backward(roots);
  EXPECT_EQ(g.tape_size(), 0u);
  auto eval = [&] {
    Graph e(be, /*record=*/false);
    std::vector<Tensor> ins;
    for (size_t i = 0; i < shapes.size(); ++i)
      ins.push_back(test::from_vector(be, shapes[i], vals[i]));
    const std::vector<Tensor> os = f(e, ins);
    double l = 0;
    for (size_t j = 0; j < os.size(); ++j) {
      const std::vector<float> v = test::to_vector(os[j]);
      for (size_t k = 0; k < v.size(); ++k) l += double(v[k]) * seeds[j][k];
    }
    return l;
  };
  for (size_t i = 0; i < shapes.size(); ++i) {
    const std::vector<float> got = test::to_vector(grads[i]);
    for (size_t j = 0; j < vals[i].size(); ++j) {
      const float keep = vals[i][j];
      auto central = [&](float step) {
        vals[i][j] = keep + step;
        const double up = eval();
        vals[i][j] = keep - step;
        const double down = eval();
        vals[i][j] = keep;
        // The steps actually taken in f32, not the nominal ones.
        return (up - down) / (double(keep + step) - double(keep - step));
      };
      const double fd = (4.0 * central(h / 2) - central(h)) / 3.0;
      EXPECT_NEAR(got[j], fd, atol + rtol * std::fabs(fd)) << "input " << i << " element " << j;
    }
  }
}

// Norm-wise error: max |a - b| / max |b| (f32 results against a double-precision reference).
double norm_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double diff = 0, ref = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
    ref = std::max(ref, std::fabs(double(b[i])));
  }
  return diff / ref;
}

std::vector<float> rand_vec(int64_t n, std::mt19937_64& rng, float stddev = 1.f) {
  return test::randn(static_cast<size_t>(n), rng, stddev);
}

// ---- split and concat ---------------------------------------------------------------------------

// One row not differentiated (a decode step of one sequence): the pieces are views of x where
// each starts 16-byte aligned, else copies; a tracked row is copied and differentiated.
TEST(GraphOps, SplitOfOneRowIsViewsWhereAligned) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const std::vector<float> xv = rand_vec(16, rng);
  Graph plain(be, false);
  const Tensor x = test::from_vector(be, {1, 1, 16}, xv);
  const auto base = static_cast<const char*>(x.data());
  for (const std::vector<int64_t>& sizes :
       std::vector<std::vector<int64_t>>{{8, 4, 4}, {4, 0, 12}, {3, 13}, {4, 3, 9}}) {
    const bool aligned = sizes[0] % 4 == 0 && (sizes[0] + sizes[1]) % 4 == 0;
    const std::vector<Tensor> p = plain.split(x, sizes);
    int64_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(p[i].shape(), (Shape{1, 1, sizes[i]}));
      if (sizes[i] > 0) {
        if (aligned)
          EXPECT_EQ(static_cast<const char*>(p[i].data()), base + at * 4) << i;
        else
          EXPECT_NE(static_cast<const char*>(p[i].data()), base + at * 4) << i;
      }
      EXPECT_EQ(test::to_vector(p[i]),
                std::vector<float>(xv.begin() + at, xv.begin() + at + sizes[i]));
      at += sizes[i];
    }
  }
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        return g.split(in[0], {8, 8});
      },
      {{1, 1, 16}}, {xv}, rng);
}

TEST(GraphOps, SplitForwardAndGradients) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const std::vector<float> xv = rand_vec(2 * 3 * 7, rng);
  // Forward: the pieces are the columns.
  Graph plain(be, false);
  const std::vector<Tensor> p = plain.split(test::from_vector(be, {2, 3, 7}, xv), {2, 0, 5});
  ASSERT_EQ(p.size(), 3u);
  EXPECT_EQ(p[0].shape(), (Shape{2, 3, 2}));
  EXPECT_EQ(p[1].shape(), (Shape{2, 3, 0}));
  EXPECT_EQ(p[2].shape(), (Shape{2, 3, 5}));
  const std::vector<float> a = test::to_vector(p[0]), b = test::to_vector(p[2]);
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t c = 0; c < 7; ++c)
      EXPECT_EQ(c < 2 ? a[r * 2 + c] : b[r * 5 + c - 2], xv[r * 7 + c]) << r << ", " << c;
  EXPECT_THROW(plain.split(p[0], {1, 2}), Error);
  EXPECT_THROW(plain.split(p[0], {3, -1}), Error);

  // Every piece with a gradient (the copy into a fresh buffer), of a leaf and of an intermediate.
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        return g.split(in[0], {2, 0, 5});
      },
      {{2, 3, 7}}, {xv}, rng);
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        auto s = g.split(g.activation(Activation::gelu_tanh, in[0]), {4, 3});
        return std::vector<Tensor>{g.mul(s[0], s[0]), s[1]};
      },
      {{6, 7}}, {xv}, rng);
  // Some pieces without a gradient (accumulation into a zeroed buffer), and x used elsewhere too.
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        Tensor h = g.scale(in[0], 1.5f);
        auto s = g.split(h, {1, 3, 3});
        return std::vector<Tensor>{s[1], g.add(h, h)};
      },
      {{6, 7}}, {xv}, rng);
}

TEST(GraphOps, ConcatForwardAndGradients) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const std::vector<float> av = rand_vec(2 * 3 * 2, rng), bv = rand_vec(2 * 3 * 4, rng);
  Graph plain(be, false);
  const Tensor a = test::from_vector(be, {2, 3, 2}, av), b = test::from_vector(be, {2, 3, 4}, bv);
  const Tensor c = plain.concat({a, b, a});
  EXPECT_EQ(c.shape(), (Shape{2, 3, 8}));
  const std::vector<float> cv = test::to_vector(c);
  for (int64_t r = 0; r < 6; ++r)
    for (int64_t j = 0; j < 8; ++j) {
      const float want = j < 2 ? av[r * 2 + j] : j < 6 ? bv[r * 4 + j - 2] : av[r * 2 + j - 6];
      EXPECT_EQ(cv[r * 8 + j], want) << r << ", " << j;
    }
  EXPECT_THROW(plain.concat({a, test::from_vector(be, {3, 2, 2}, av)}), Error);
  EXPECT_THROW(plain.concat({}), Error);

  // a twice (its gradient accumulates), b an intermediate (its buffer is fresh).
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        Tensor bb = g.activation(Activation::silu, in[1]);
        Tensor y = g.concat({in[0], bb, in[0]});
        return std::vector<Tensor>{g.mul(y, y)};
      },
      {{2, 3, 2}, {2, 3, 4}}, {av, bv}, rng);
  // concat then split back: the identity.
  check_gradients(
      [](Graph& g, const std::vector<Tensor>& in) {
        return g.split(g.concat({in[0], in[1]}), {3, 3});
      },
      {{2, 3, 2}, {2, 3, 4}}, {av, bv}, rng);
}

// ---- the fallback of a backend without copy_columns --------------------------------------------

// split and concat, forward and backward, in f32 and bf16, on the CPU backend's kernel and on a
// backend that lacks it: the same bits.
TEST(GraphOps, CopyColumnsFallsBackOnABackendWithoutTheKernel) {
  MT_SEEDED_RNG(rng);
  Backend& cpu = test::cpu();
  test::RequiredOnlyBackend fallback(cpu);
  const std::vector<float> av = rand_vec(4 * 3, rng), bv = rand_vec(4 * 5, rng),
                           sv = rand_vec(4 * 8, rng);
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    auto run = [&](Backend& be) {
      std::vector<std::vector<float>> r;
      Graph g(be);
      Tensor a = test::from_vector(be, {4, 3}, av, dt), b = test::from_vector(be, {4, 5}, bv, dt);
      Tensor ga = be.zeros({4, 3}, DType::f32), gb = be.zeros({4, 5}, DType::f32);
      Graph::track(a, ga);
      Graph::track(b, gb);
      Tensor c = g.concat({a, b});
      std::vector<Tensor> s = g.split(c, {6, 2});
      r.push_back(test::to_vector(c));
      r.push_back(test::to_vector(s[0]));
      r.push_back(test::to_vector(s[1]));
      // A seed on the first piece only: x's gradient accumulates into a zeroed buffer.
      g.backward(
          s[0], test::from_vector(be, {4, 6}, std::vector<float>(sv.begin(), sv.begin() + 24), dt));
      r.push_back(test::to_vector(ga));
      r.push_back(test::to_vector(gb));
      return r;
    };
    const auto want = run(cpu);
    const int64_t reads = fallback.host_reads;
    const auto got = run(fallback);
    EXPECT_GT(fallback.host_reads, reads + 2) << "the default went through the host";
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "result " << i;
    // Columns outside the copy are left alone, and bad columns are refused.
    Tensor dst = test::from_vector(fallback, {4, 5}, bv, dt);
    fallback.copy_columns(test::from_vector(fallback, {4, 3}, av, dt), 1, dst, 2, 2, true);
    const std::vector<float> d = test::to_vector(dst);
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 5; ++c) {
        float want_v = test::to_vector(test::from_vector(cpu, {4, 5}, bv, dt))[r * 5 + c];
        if (c >= 2 && c < 4) {
          const float add = test::to_vector(test::from_vector(cpu, {4, 3}, av, dt))[r * 3 + c - 1];
          want_v = test::to_vector(test::from_vector(cpu, {1}, {want_v + add}, dt))[0];
        }
        EXPECT_EQ(d[r * 5 + c], want_v) << r << ", " << c;
      }
    Tensor other = test::from_vector(fallback, {4, 3}, av, dt);
    EXPECT_THROW(fallback.copy_columns(other, 2, dst, 0, 2, false), Error);
    EXPECT_THROW(cpu.copy_columns(other, 2, dst, 0, 2, false), Error);
    EXPECT_THROW(cpu.copy_columns(other, 0, dst, 4, 2, false), Error);
    Tensor rows = test::from_vector(cpu, {3, 4}, av, dt);
    EXPECT_THROW(cpu.copy_columns(rows, 0, dst, 0, 2, false), Error);
  }
}

// ---- mixture-of-experts ops ---------------------------------------------------------------------

// Router logits [n, E] whose top-k is separated from the rest by at least `gap`, so that a
// finite-difference step never changes the selection.
std::vector<float> separated_logits(int64_t n, int64_t E, std::mt19937_64& rng, float gap = 0.3f) {
  std::vector<float> v(static_cast<size_t>(n * E));
  std::vector<int> perm(static_cast<size_t>(E));
  std::normal_distribution<float> noise(0.f, 0.05f);
  for (int64_t t = 0; t < n; ++t) {
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t e = 0; e < E; ++e)
      v[static_cast<size_t>(t * E + perm[static_cast<size_t>(e)])] =
          -1.f + gap * static_cast<float>(e) + noise(rng) * 0.5f;
  }
  return v;
}

TEST(GraphOps, RouteGradients) {
  MT_SEEDED_RNG(rng);
  const int64_t n = 5, E = 6;
  const std::vector<float> lv = separated_logits(n, E, rng);
  for (bool sigmoid : {false, true})
    for (bool normalize : {false, true})
      for (int k : {1, 2}) {
        SCOPED_TRACE(std::string(sigmoid ? "sigmoid" : "softmax") +
                     (normalize ? " normalized" : "") + " k " + std::to_string(k));
        check_gradients(
            [&](Graph& g, const std::vector<Tensor>& in) {
              Graph::Routing r = g.route(in[0], k, sigmoid, normalize);
              return std::vector<Tensor>{r.weights, r.probs};
            },
            {{n, E}}, {lv}, rng, 1e-3f);
      }
  // Only one of the two outputs used.
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        return std::vector<Tensor>{g.route(in[0], 2, false, true).probs};
      },
      {{n, E}}, {lv}, rng, 1e-3f);
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        return std::vector<Tensor>{g.route(in[0], 3, true, false).weights};
      },
      {{n, E}}, {lv}, rng, 1e-3f);
}

TEST(GraphOps, GatherRowsGradients) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const Tensor idx = test::from_ints(be, {7}, {3, 0, 3, 4, 1, 3, 0});  // repeats, row 2 unused
  const std::vector<float> xv = rand_vec(5 * 3, rng);
  Graph plain(be, false);
  const std::vector<float> o =
      test::to_vector(plain.gather_rows(test::from_vector(be, {5, 3}, xv), idx));
  const std::vector<int32_t> id = test::to_ints(idx);
  for (size_t m = 0; m < id.size(); ++m)
    for (size_t d = 0; d < 3; ++d) EXPECT_EQ(o[m * 3 + d], xv[static_cast<size_t>(id[m]) * 3 + d]);
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        return std::vector<Tensor>{g.gather_rows(in[0], idx)};
      },
      {{5, 3}}, {xv}, rng);
}

TEST(GraphOps, WeightedScatterAddGradients) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const Tensor idx = test::from_ints(be, {6}, {2, 0, 2, 3, 2, 0});  // row 1 receives nothing
  const std::vector<float> sv = rand_vec(6 * 4, rng), wv = rand_vec(6, rng);
  // Forward against the host sum.
  Graph plain(be, false);
  const std::vector<float> o = test::to_vector(plain.scatter_add_rows(
      test::from_vector(be, {6, 4}, sv), idx, test::from_vector(be, {6}, wv), 4));
  std::vector<float> want(16, 0.f);
  const std::vector<int32_t> id = test::to_ints(idx);
  for (size_t m = 0; m < 6; ++m)
    for (size_t d = 0; d < 4; ++d)
      want[static_cast<size_t>(id[m]) * 4 + d] += wv[m] * sv[m * 4 + d];
  EXPECT_LT(norm_err(o, want), 1e-5);
  // Gradients for src and w, for src alone (no weights) and for w alone.
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        return std::vector<Tensor>{g.scatter_add_rows(in[0], idx, in[1], 4)};
      },
      {{6, 4}, {6}}, {sv, wv}, rng);
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        return std::vector<Tensor>{g.scatter_add_rows(g.scale(in[0], 2.f), idx, Tensor(), 4)};
      },
      {{6, 4}}, {sv}, rng);
  check_gradients(
      [&](Graph& g, const std::vector<Tensor>& in) {
        // w used twice: a leaf (its gradient accumulates) and an intermediate (fresh).
        Tensor src = test::from_vector(g.backend(), {6, 4}, sv);
        Tensor w2 = g.scale(in[0], 0.5f);
        return std::vector<Tensor>{g.scatter_add_rows(src, idx, in[0], 4),
                                   g.scatter_add_rows(g.scale(src, -2.f), idx, in[0], 4),
                                   g.scatter_add_rows(src, idx, w2, 4),
                                   g.scatter_add_rows(src, idx, w2, 4)};
      },
      {{6}}, {wv}, rng);
}

TEST(GraphOps, GroupedMatmulGradients) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const int64_t M = 7, K = 3, N = 4, E = 3;
  const Tensor offsets = test::from_ints(be, {E + 1}, {0, 2, 2, 7});  // expert 1 has no rows
  const std::vector<float> xv = rand_vec(M * K, rng), wv = rand_vec(E * K * N, rng);
  for (bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "trans_w" : "w");
    const Shape ws = trans ? Shape{E, N, K} : Shape{E, K, N};
    // Forward against the host loop.
    Graph plain(be, false);
    const std::vector<float> o = test::to_vector(plain.grouped_matmul(
        test::from_vector(be, {M, K}, xv), test::from_vector(be, ws, wv), offsets, trans));
    const std::vector<int32_t> off = test::to_ints(offsets);
    std::vector<float> want(static_cast<size_t>(M * N), 0.f);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t m = off[e]; m < off[e + 1]; ++m)
        for (int64_t j = 0; j < N; ++j) {
          double s = 0;
          for (int64_t i = 0; i < K; ++i)
            s += double(xv[m * K + i]) * wv[e * K * N + (trans ? j * K + i : i * N + j)];
          want[m * N + j] = static_cast<float>(s);
        }
    EXPECT_LT(norm_err(o, want), 1e-5);
    check_gradients(
        [&](Graph& g, const std::vector<Tensor>& in) {
          return std::vector<Tensor>{g.grouped_matmul(in[0], in[1], offsets, trans)};
        },
        {{M, K}, ws}, {xv, wv}, rng);
    // x an intermediate whose gradient also comes from elsewhere (accumulated, not written).
    check_gradients(
        [&](Graph& g, const std::vector<Tensor>& in) {
          Tensor h = g.scale(in[0], 0.5f);
          return std::vector<Tensor>{g.grouped_matmul(h, in[1], offsets, trans), h};
        },
        {{M, K}, ws}, {xv, wv}, rng);
  }
}

// The CPU kernels tile the experts' blocks over the threads: at shapes of several row and column
// tiles (an empty expert, a one-row expert, a segment of two row tiles), forward and weight
// gradient match one backend matmul per expert (the per-expert form) and repeat bit for bit.
TEST(GraphOps, GroupedMatmulTiledMatchesPerExpert) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const int64_t K = 40, N = 600, E = 5;
  const std::vector<int32_t> off = {0, 0, 1, 4, 304, 374};
  const int64_t M = off[E];
  const Tensor offsets = test::from_ints(be, {E + 1}, off);
  const Tensor x = test::from_vector(be, {M, K}, rand_vec(M * K, rng));
  const Tensor dout = test::from_vector(be, {M, N}, rand_vec(M * N, rng));
  const std::vector<float> dw0 = rand_vec(E * K * N, rng);
  for (bool trans : {false, true}) {
    SCOPED_TRACE(trans ? "trans_w" : "w");
    const Shape ws = trans ? Shape{E, N, K} : Shape{E, K, N};
    const Tensor w = test::from_vector(be, ws, rand_vec(E * K * N, rng));
    auto forward = [&] {
      Tensor o = be.empty({M, N}, DType::f32);
      be.grouped_matmul(x, w, offsets, trans, o);
      return test::to_vector(o);
    };
    auto weight_grad = [&] {
      Tensor dw = test::from_vector(be, ws, dw0);
      be.grouped_matmul_weight_grad(x, dout, offsets, trans, dw);
      return test::to_vector(dw);
    };
    Tensor o_ref = be.zeros({M, N}, DType::f32);
    Tensor dw_ref = test::from_vector(be, ws, dw0);
    for (int64_t e = 0; e < E; ++e) {
      if (off[e] == off[e + 1]) continue;
      const Tensor xe = x.slice0(off[e], off[e + 1]), de = dout.slice0(off[e], off[e + 1]);
      Tensor oe = o_ref.slice0(off[e], off[e + 1]);
      const Tensor we = w.slice0(e, e + 1).view({ws[1], ws[2]});
      be.matmul(xe, we, oe, false, trans);
      Tensor dwe = dw_ref.slice0(e, e + 1).view({ws[1], ws[2]});
      if (trans)
        be.matmul(de, xe, dwe, true, false, 1.f, 1.f);
      else
        be.matmul(xe, de, dwe, true, false, 1.f, 1.f);
    }
    const std::vector<float> o = forward(), dw = weight_grad();
    EXPECT_LT(norm_err(o, test::to_vector(o_ref)), 1e-5);
    EXPECT_LT(norm_err(dw, test::to_vector(dw_ref)), 1e-5);
    EXPECT_EQ(forward(), o);
    EXPECT_EQ(weight_grad(), dw);
  }
}

// Decode's few rows an expert (1 to 8: a batch of sequences routed to a few experts each) run
// the experts' matrix-vector products concurrently: each expert's rows are bit for bit what
// one backend matmul of that expert gives, in f32 (one-row experts; more rows take the tiled
// GEMM above) and with bf16 weights (f32 or bf16 rows), stored [E, K, N] or [E, N, K].
TEST(GraphOps, GroupedMatmulFewRowsAreEachExpertsProduct) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const int64_t K = 96, N = 200, E = 6;
  for (const DType wt : {DType::f32, DType::bf16})
    for (const DType xt : {DType::f32, DType::bf16})
      for (bool trans : {false, true}) {
        if (wt == DType::f32 && xt == DType::bf16) continue;  // the CPU's matmul mixes only so
        SCOPED_TRACE(std::string(dtype_name(wt)) + " weights, " + dtype_name(xt) + " rows" +
                     (trans ? ", trans_w" : ""));
        const std::vector<int32_t> off = wt == DType::f32
                                             ? std::vector<int32_t>{0, 1, 2, 2, 3, 4, 5}
                                             : std::vector<int32_t>{0, 1, 2, 2, 5, 13, 14};
        const int64_t M = off[E];
        const Tensor offsets = test::from_ints(be, {E + 1}, off);
        const Shape ws = trans ? Shape{E, N, K} : Shape{E, K, N};
        Tensor x = be.empty({M, K}, xt), w = be.empty(ws, wt);
        be.cast(test::from_vector(be, {M, K}, rand_vec(M * K, rng)), x);
        be.cast(test::from_vector(be, ws, rand_vec(E * K * N, rng)), w);
        Tensor o = be.empty({M, N}, xt);
        be.grouped_matmul(x, w, offsets, trans, o);
        Tensor o_ref = be.zeros({M, N}, xt);
        for (int64_t e = 0; e < E; ++e) {
          if (off[e] == off[e + 1]) continue;
          Tensor oe = o_ref.slice0(off[e], off[e + 1]);
          be.matmul(x.slice0(off[e], off[e + 1]), w.slice0(e, e + 1).view({ws[1], ws[2]}), oe,
                    false, trans);
        }
        Tensor o32 = be.empty({M, N}, DType::f32), r32 = be.empty({M, N}, DType::f32);
        be.cast(o, o32);
        be.cast(o_ref, r32);
        EXPECT_EQ(test::to_vector(o32), test::to_vector(r32));
      }
}

// The CPU's grouped_matmul_q8 (int8 experts) gives each expert's rows what matmul_q8 alone
// gives them, bit for bit: at decode's few rows an expert (one fork over every expert), with an
// expert beyond 8 rows (each expert's own product), f32 and bf16 rows, and a row holding a NaN
// (not quantized: it reaches its outputs).
TEST(GraphOps, GroupedMatmulQ8IsEachExpertsProduct) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  const int64_t K = 128, N = 200, E = 6, rb = q8_row_bytes(K);
  std::vector<int8_t> q(static_cast<size_t>(E * N * rb));
  const std::vector<float> wf = rand_vec(E * N * K, rng);
  for (int64_t j = 0; j < E * N; ++j)
    ASSERT_TRUE(quantize_q8_row(wf.data() + j * K, K, q.data() + j * rb));
  Tensor w = be.empty({E, N, rb}, DType::i8);
  be.copy_from_host(w, q.data());
  for (const DType xt : {DType::f32, DType::bf16})
    for (const std::vector<int64_t>& counts :
         {std::vector<int64_t>{1, 1, 0, 3, 8, 1}, std::vector<int64_t>{2, 0, 12, 1, 0, 1}}) {
      SCOPED_TRACE(std::string(dtype_name(xt)) + " rows, " + std::to_string(counts[2]) +
                   " rows for expert 2");
      int64_t M = 0;
      for (const int64_t c : counts) M += c;
      std::vector<float> xv = rand_vec(M * K, rng);
      xv[static_cast<size_t>(K + 5)] = std::nanf("");  // row 1
      Tensor x = be.empty({M, K}, xt);
      be.cast(test::from_vector(be, {M, K}, xv), x);
      Tensor o = be.empty({M, N}, xt), o_ref = be.zeros({M, N}, xt);
      be.grouped_matmul_q8(x, w, counts, o);
      int64_t r = 0;
      for (int64_t e = 0; e < E; ++e) {
        const int64_t c = counts[static_cast<size_t>(e)];
        if (c == 0) continue;
        Tensor oe = o_ref.slice0(r, r + c);
        be.matmul_q8(x.slice0(r, r + c), w.slice0(e, e + 1).view({N, rb}), oe);
        r += c;
      }
      Tensor o32 = be.empty({M, N}, DType::f32), r32 = be.empty({M, N}, DType::f32);
      be.cast(o, o32);
      be.cast(o_ref, r32);
      const std::vector<float> got = test::to_vector(o32), want = test::to_vector(r32);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << i;
          continue;
        }
        ASSERT_EQ(got[i], want[i]) << i;
      }
      EXPECT_TRUE(std::isnan(got[static_cast<size_t>(N)]));  // row 1 holds the NaN
    }
  // Counts that do not cover x's rows are refused.
  Tensor x = be.empty({3, K}, DType::f32), o = be.empty({3, N}, DType::f32);
  EXPECT_THROW(be.grouped_matmul_q8(x, w, {1, 1, 0, 0, 0, 0}, o), Error);
  EXPECT_THROW(be.grouped_matmul_q8(x, w, {1, 2}, o), Error);
}

TEST(GraphOps, SortByExpert) {
  Backend& be = test::cpu();
  Graph g(be, false);
  const Graph::ExpertOrder o = g.sort_by_expert(test::from_ints(be, {3, 2}, {2, 0, 0, 2, 3, 0}), 4);
  EXPECT_EQ(test::to_ints(o.slots), (std::vector<int32_t>{1, 2, 5, 0, 3, 4}));
  EXPECT_EQ(test::to_ints(o.tokens), (std::vector<int32_t>{0, 1, 2, 0, 1, 2}));
  EXPECT_EQ(test::to_ints(o.offsets), (std::vector<int32_t>{0, 3, 3, 5, 6}));
  EXPECT_EQ(o.counts, (std::vector<int64_t>{3, 0, 2, 1}));
  EXPECT_THROW(g.sort_by_expert(test::from_ints(be, {1, 2}, {0, 4}), 4), Error);
}

// ---- the moe block
// -------------------------------------------------------------------------------

float act_host(Activation a, float x) {
  switch (a) {
    case Activation::silu:
      return x / (1.f + std::exp(-x));
    case Activation::relu:
      return x > 0 ? x : 0.f;
    case Activation::gelu_exact:
      return 0.5f * x * (1.f + std::erf(x / std::sqrt(2.f)));
    case Activation::gelu_tanh:
      return 0.5f * x * (1.f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x)));
    case Activation::tanh:
      return std::tanh(x);
  }
  return 0.f;
}

struct MoeCase {
  blocks::MoeSpec spec;
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  std::vector<std::vector<float>> vals;  // x first, then the parameters in moe_params' order
  int64_t n = 0;
};

MoeCase make_moe_case(const blocks::MoeSpec& s, int64_t B, int64_t T, std::mt19937_64& rng,
                      float min_margin = 0.f) {
  MoeCase c;
  c.spec = s;
  c.n = B * T;
  const std::vector<ParamSpec> ps = blocks::moe_params(s);
  c.shapes.push_back({B, T, s.d_model});
  for (const auto& p : ps) {
    c.names.push_back(p.name);
    c.shapes.push_back(p.shape);
  }
  // Draw until every token's k-th and (k+1)-th logits are min_margin apart.
  for (int attempt = 0; attempt < 1000; ++attempt) {
    c.vals.clear();
    for (size_t i = 0; i < c.shapes.size(); ++i)
      c.vals.push_back(
          rand_vec(shape_numel(c.shapes[i]), rng,
                   i == 0 ? 1.f : 1.f / std::sqrt(float(c.shapes[i][c.shapes[i].size() - 2]))));
    if (min_margin <= 0.f || s.top_k == s.num_experts) break;
    bool ok = true;
    for (int64_t t = 0; t < c.n && ok; ++t) {
      std::vector<float> l(static_cast<size_t>(s.num_experts), 0.f);
      for (int64_t e = 0; e < s.num_experts; ++e)
        for (int64_t j = 0; j < s.d_model; ++j)
          l[e] += c.vals[0][t * s.d_model + j] * c.vals[1][j * s.num_experts + e];
      std::sort(l.begin(), l.end(), std::greater<>());
      ok = l[s.top_k - 1] - l[s.top_k] > min_margin;
    }
    if (ok) break;
  }
  return c;
}

struct HostMoe {
  std::vector<float> y;
  double lb = 0, z = 0;
};

// The block's definition token by token: every chosen expert's FFN weighted and summed.
HostMoe host_moe(const MoeCase& c) {
  const auto& s = c.spec;
  const int64_t d = s.d_model, H = s.hidden, E = s.num_experts, k = s.top_k, n = c.n;
  const auto& x = c.vals[0];
  const auto& router = c.vals[1];
  const std::vector<float>* wg = s.gated ? &c.vals[2] : nullptr;
  const auto& wu = c.vals[s.gated ? 3 : 2];
  const auto& wd = c.vals[s.gated ? 4 : 3];
  HostMoe r;
  r.y.assign(static_cast<size_t>(n * d), 0.f);
  // Load balancing per sequence of T tokens (MaxText's), averaged over the sequences.
  const int64_t T = c.shapes[0][1];
  std::vector<double> count(static_cast<size_t>(E), 0), mean_p(static_cast<size_t>(E), 0);
  for (int64_t t = 0; t < n; ++t) {
    if (t % T == 0) {
      std::fill(count.begin(), count.end(), 0.0);
      std::fill(mean_p.begin(), mean_p.end(), 0.0);
    }
    std::vector<double> l(static_cast<size_t>(E), 0), p(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t j = 0; j < d; ++j) l[e] += double(x[t * d + j]) * router[j * E + e];
    const double mx = *std::max_element(l.begin(), l.end());
    double se = 0;
    for (int64_t e = 0; e < E; ++e) se += std::exp(l[e] - mx);
    const double lse = mx + std::log(se);
    r.z += lse * lse / double(n);
    for (int64_t e = 0; e < E; ++e)
      p[e] = s.sigmoid_scores ? 1.0 / (1.0 + std::exp(-l[e])) : std::exp(l[e] - lse);
    for (int64_t e = 0; e < E; ++e) mean_p[e] += p[e] / double(T);
    std::vector<int64_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    double total = 0;
    for (int64_t j = 0; j < k; ++j) total += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j];
      count[e] += 1;
      const double w = s.normalize_topk ? p[e] / total : p[e];
      std::vector<double> h(static_cast<size_t>(H));
      for (int64_t q = 0; q < H; ++q) {
        double up = 0, gate = 0;
        for (int64_t i = 0; i < d; ++i) {
          up += double(x[t * d + i]) * wu[(e * d + i) * H + q];
          if (wg) gate += double(x[t * d + i]) * (*wg)[(e * d + i) * H + q];
        }
        h[q] = wg ? act_host(s.act, float(gate)) * up : act_host(s.act, float(up));
      }
      for (int64_t o = 0; o < d; ++o) {
        double acc = 0;
        for (int64_t q = 0; q < H; ++q) acc += h[q] * wd[(e * H + q) * d + o];
        r.y[t * d + o] += static_cast<float>(w * acc);
      }
    }
    if (t % T == T - 1)
      for (int64_t e = 0; e < E; ++e)
        r.lb += double(E) * count[e] / double(T) * mean_p[e] / double(n / T);
  }
  return r;
}

LayerOutput run_moe(Graph& g, const MoeCase& c, const std::vector<Tensor>& in) {
  const Params p(c.names, std::vector<Tensor>(in.begin() + 1, in.end()));
  return blocks::moe(g, p, c.spec, in[0]);
}

TEST(GraphOps, MoeBlockMatchesAHostLoopOverTopKExperts) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  for (bool gated : {true, false})
    for (bool sigmoid : {false, true})
      for (bool normalize : {false, true}) {
        blocks::MoeSpec s;
        s.d_model = 8;
        s.hidden = 5;
        s.num_experts = 4;
        s.top_k = 2;
        s.gated = gated;
        s.act = gated ? Activation::silu : Activation::gelu_tanh;
        s.sigmoid_scores = sigmoid;
        s.normalize_topk = normalize;
        s.load_balance_weight = 0.01f;
        s.z_loss_weight = 0.001f;
        SCOPED_TRACE(std::string(gated ? "gated" : "plain") + (sigmoid ? " sigmoid" : " softmax") +
                     (normalize ? " normalized" : ""));
        const MoeCase c = make_moe_case(s, 2, 5, rng);
        Graph g(be, false);
        std::vector<Tensor> in;
        for (size_t i = 0; i < c.shapes.size(); ++i)
          in.push_back(test::from_vector(be, c.shapes[i], c.vals[i]));
        const LayerOutput out = run_moe(g, c, in);
        EXPECT_EQ(out.x.shape(), c.shapes[0]);
        const HostMoe want = host_moe(c);
        EXPECT_LT(norm_err(test::to_vector(out.x), want.y), 1e-5);
        ASSERT_EQ(out.aux.size(), 4u);  // and the load metrics (moe_block_test)
        EXPECT_EQ(out.aux[0].name, "moe_lb_loss");
        EXPECT_EQ(out.aux[0].weight, 0.01f);
        EXPECT_NEAR(test::to_vector(out.aux[0].value)[0], want.lb, 1e-5 * std::max(1.0, want.lb));
        EXPECT_EQ(out.aux[1].name, "moe_z_loss");
        EXPECT_EQ(out.aux[1].weight, 0.001f);
        EXPECT_NEAR(test::to_vector(out.aux[1].value)[0], want.z, 1e-4 * std::max(1.0, want.z));
      }
}

// The block's gradients (output and both auxiliary losses) against central differences.
TEST(GraphOps, MoeBlockGradients) {
  MT_SEEDED_RNG(rng);
  for (bool sigmoid : {false, true}) {
    SCOPED_TRACE(sigmoid ? "sigmoid" : "softmax");
    blocks::MoeSpec s;
    s.d_model = 6;
    s.hidden = 4;
    s.num_experts = 4;
    s.top_k = 2;
    s.sigmoid_scores = sigmoid;
    s.normalize_topk = !sigmoid;
    const MoeCase c = make_moe_case(s, 1, 5, rng, 0.2f);
    check_gradients(
        [&](Graph& g, const std::vector<Tensor>& in) {
          LayerOutput o = run_moe(g, c, in);
          return std::vector<Tensor>{o.x, o.aux[0].value, o.aux[1].value};
        },
        c.shapes, c.vals, rng, 5e-3f);
  }
}

TEST(GraphOps, MoeParamsAndRefusals) {
  blocks::MoeSpec s;
  s.d_model = 8;
  s.hidden = 16;
  s.num_experts = 8;
  s.top_k = 2;
  const std::vector<ParamSpec> ps = blocks::moe_params(s, "mlp.");
  ASSERT_EQ(ps.size(), 4u);
  EXPECT_EQ(ps[0].name, "mlp.router");
  EXPECT_EQ(ps[0].shape, (Shape{8, 8}));
  EXPECT_EQ(ps[0].active, 1.f);
  EXPECT_EQ(ps[1].name, "mlp.w_gate");
  EXPECT_EQ(ps[1].shape, (Shape{8, 8, 16}));
  EXPECT_EQ(ps[2].name, "mlp.w_up");
  EXPECT_EQ(ps[3].name, "mlp.w_down");
  EXPECT_EQ(ps[3].shape, (Shape{8, 16, 8}));
  for (size_t i = 1; i < 4; ++i) EXPECT_FLOAT_EQ(ps[i].active, 0.25f);
  s.gated = false;
  EXPECT_EQ(blocks::moe_params(s).size(), 3u);

  // Token dropping's capacity (MaxText's rule; moe_block_test drops by it).
  EXPECT_EQ(blocks::moe_capacity(s, 100), 0);  // dropless
  s.capacity_factor = 1.25f;
  EXPECT_EQ(blocks::moe_capacity(s, 100), 31);  // int(ceil(100 * 2 / 8) * 1.25)
  s.capacity_factor = -1.f;
  s.top_k = 9;
  EXPECT_THROW(blocks::moe_params(s), Error);
}

// ---- attention with a value head size of its own ---------------------------------------------

struct AttnCase {
  blocks::AttentionBlockSpec spec;
  std::vector<std::string> names;
  std::vector<Shape> shapes;
  std::vector<std::vector<float>> vals;  // x, then wq wk wv wo
  int64_t B = 1, T = 0;
};

AttnCase make_attn_case(int64_t dk, int64_t dv, std::mt19937_64& rng) {
  AttnCase c;
  auto& s = c.spec;
  s.d_model = 8;
  s.heads = 4;
  s.kv_heads = 2;
  s.head_dim = dk;
  s.v_head_dim = dv;
  s.use_rope = false;
  c.B = 2;
  c.T = 5;
  c.shapes.push_back({c.B, c.T, s.d_model});
  for (const auto& p : blocks::attention_params(s)) {
    c.names.push_back(p.name);
    c.shapes.push_back(p.shape);
  }
  for (size_t i = 0; i < c.shapes.size(); ++i)
    c.vals.push_back(rand_vec(shape_numel(c.shapes[i]), rng, i == 0 ? 1.f : 0.4f));
  return c;
}

// Causal attention with GQA, scale 1 / sqrt(head_dim), on the host.
std::vector<float> host_attention(const AttnCase& c) {
  const auto& s = c.spec;
  const int64_t d = s.d_model, H = s.heads, Hk = s.kv_heads, dk = s.head_dim, dv = s.v_head_dim;
  const auto &x = c.vals[0], &wq = c.vals[1], &wk = c.vals[2], &wv = c.vals[3], &wo = c.vals[4];
  auto proj = [&](const std::vector<float>& w, int64_t cols, int64_t b, int64_t t) {
    std::vector<double> r(static_cast<size_t>(cols), 0);
    for (int64_t o = 0; o < cols; ++o)
      for (int64_t i = 0; i < d; ++i) r[o] += double(x[(b * c.T + t) * d + i]) * w[i * cols + o];
    return r;
  };
  std::vector<float> y(static_cast<size_t>(c.B * c.T * d), 0.f);
  const double scale = 1.0 / std::sqrt(double(dk));
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t < c.T; ++t) {
      const auto q = proj(wq, H * dk, b, t);
      std::vector<double> a(static_cast<size_t>(H * dv), 0);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t kh = h / (H / Hk);
        std::vector<double> sc;
        std::vector<std::vector<double>> vs;
        for (int64_t u = 0; u <= t; ++u) {
          const auto k = proj(wk, Hk * dk, b, u);
          double dot = 0;
          for (int64_t i = 0; i < dk; ++i) dot += q[h * dk + i] * k[kh * dk + i];
          sc.push_back(dot * scale);
          const auto v = proj(wv, Hk * dv, b, u);
          vs.emplace_back(v.begin() + kh * dv, v.begin() + (kh + 1) * dv);
        }
        const double mx = *std::max_element(sc.begin(), sc.end());
        double z = 0;
        for (double& e : sc) z += (e = std::exp(e - mx));
        for (size_t u = 0; u < sc.size(); ++u)
          for (int64_t i = 0; i < dv; ++i) a[h * dv + i] += sc[u] / z * vs[u][i];
      }
      for (int64_t o = 0; o < d; ++o) {
        double acc = 0;
        for (int64_t i = 0; i < H * dv; ++i) acc += a[i] * wo[i * d + o];
        y[(b * c.T + t) * d + o] = static_cast<float>(acc);
      }
    }
  return y;
}

Tensor positions(Backend& be, int64_t B, int64_t t0, int64_t t) {
  std::vector<int32_t> p;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < t; ++i) p.push_back(static_cast<int32_t>(t0 + i));
  return test::from_ints(be, {B, t}, p);
}

TEST(GraphOps, AttentionWithAnotherValueHeadSize) {
  MT_SEEDED_RNG(rng);
  Backend& be = test::cpu();
  auto kernel = test::attention("dot_product", be);
  for (auto [dk, dv] : {std::pair<int64_t, int64_t>{6, 4}, {4, 6}}) {
    SCOPED_TRACE("head_dim " + std::to_string(dk) + " v_head_dim " + std::to_string(dv));
    const AttnCase c = make_attn_case(dk, dv, rng);
    auto run = [&](Graph& g, const std::vector<Tensor>& in) {
      const Params p(c.names, std::vector<Tensor>(in.begin() + 1, in.end()));
      LayerInputs li;
      li.positions = positions(be, c.B, 0, c.T);
      li.attention = kernel.get();
      return blocks::attention(g, p, c.spec, in[0], li);
    };
    std::vector<Tensor> in;
    for (size_t i = 0; i < c.shapes.size(); ++i)
      in.push_back(test::from_vector(be, c.shapes[i], c.vals[i]));
    Graph plain(be, false);
    const std::vector<float> full = test::to_vector(run(plain, in));
    EXPECT_LT(norm_err(full, host_attention(c)), 1e-5);

    // Gradients reach every projection through the padding and the cut.
    check_gradients(
        [&](Graph& g, const std::vector<Tensor>& ins) { return std::vector<Tensor>{run(g, ins)}; },
        c.shapes, c.vals, rng);

    // Decode: a prefill of 2 tokens, then one token at a time, through a cache of padded entries;
    // each step's output equals the full forward's row.
    const CacheSpec cs = blocks::attention_cache_spec(c.spec);
    const int64_t rows = c.T, D = std::max(dk, dv);
    ASSERT_EQ(cs.entries[1], (Shape{c.spec.kv_heads, D}));
    KVCache cache;
    for (const Shape& e : cs.entries) {
      Shape sh = {c.B, rows + 1};
      sh.insert(sh.end(), e.begin(), e.end());
      cache.tensors.push_back(be.zeros(sh, DType::f32));
    }
    const Params p(c.names, std::vector<Tensor>(in.begin() + 1, in.end()));
    const int64_t d = c.spec.d_model;
    for (int64_t t0 = 0; t0 < c.T;) {
      const int64_t t = t0 == 0 ? 2 : 1;
      std::vector<float> xs;
      std::vector<int32_t> wr;
      for (int64_t b = 0; b < c.B; ++b) {
        xs.insert(xs.end(), c.vals[0].begin() + (b * c.T + t0) * d,
                  c.vals[0].begin() + (b * c.T + t0 + t) * d);
        for (int64_t i = 0; i < t; ++i) wr.push_back(static_cast<int32_t>(b * (rows + 1) + t0 + i));
      }
      cache.write_rows = test::from_ints(be, {c.B * t}, wr);
      cache.lengths = test::from_ints(be, {c.B}, std::vector<int32_t>(c.B, int32_t(t0 + t)));
      cache.fresh = t0 == 0;
      LayerInputs li;
      li.positions = positions(be, c.B, t0, t);
      li.attention = kernel.get();
      li.cache = &cache;
      Graph g(be, false);
      const std::vector<float> y = test::to_vector(
          blocks::attention(g, p, c.spec, test::from_vector(be, {c.B, t, d}, xs), li));
      for (int64_t b = 0; b < c.B; ++b)
        for (int64_t i = 0; i < t * d; ++i)
          EXPECT_NEAR(y[b * t * d + i], full[(b * c.T + t0) * d + i], 1e-5)
              << "batch " << b << " token " << t0 + i / d;
      t0 += t;
    }
  }
}

}  // namespace
}  // namespace mt
