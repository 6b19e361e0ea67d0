// Autograd: the tape against finite differences on a composed graph (shared inputs, reshapes,
// casts, several consumers), remat policies against each other, memory and determinism.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "config_loader.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/graph.h"
#include "test_support.h"

namespace mt {
namespace {

// loss(x, w1, w2, n) = mean CE(matmul(silu(matmul(rmsnorm(x) + x, w1)) * (x @ w1), w2), targets)
// x feeds three consumers; the product and the sum make gradients meet.
Tensor composed(Graph& g, const Tensor& x, const Tensor& w1, const Tensor& w2, const Tensor& n,
                const Tensor& targets) {
  Tensor h = g.add(g.rmsnorm(x, n, 1e-5f), x);
  Tensor a = g.activation(Activation::silu, g.matmul(h, w1));
  Tensor b = g.matmul(x, w1);
  Tensor m = g.reshape(g.mul(a, b), {a.dim(0) * a.dim(1), a.dim(2)});
  Tensor logits = g.matmul(g.scale(m, 0.5f), w2);
  return g.cross_entropy(logits, targets, 1e-3f, 1.f / static_cast<float>(targets.numel()));
}

TEST(Graph, ComposedGradientsMatchFiniteDifferences) {
  Backend& be = test::cpu();
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int64_t B = 2, T = 3, D = 5, F = 7, V = 11;
  std::vector<float> xv = test::randn(B * T * D, rng), w1v = test::randn(D * F, rng, 0.5f),
                     w2v = test::randn(F * V, rng, 0.5f), nv = test::randn(D, rng, 0.2f);
  for (auto& v : nv) v += 1.f;
  std::vector<int32_t> tv(B * T);
  for (auto& t : tv) t = static_cast<int32_t>(rng() % V);
  Tensor targets = test::from_ints(be, {B * T}, tv);

  auto eval = [&](const std::vector<std::vector<float>*>& vals) {
    Graph g(be, false);
    Tensor x = test::from_vector(be, {B, T, D}, *vals[0]);
    Tensor w1 = test::from_vector(be, {D, F}, *vals[1]);
    Tensor w2 = test::from_vector(be, {F, V}, *vals[2]);
    Tensor n = test::from_vector(be, {D}, *vals[3]);
    return double(test::to_vector(composed(g, x, w1, w2, n, targets))[0]);
  };
  std::vector<std::vector<float>*> vals = {&xv, &w1v, &w2v, &nv};
  std::vector<Shape> shapes = {{B, T, D}, {D, F}, {F, V}, {D}};

  Graph g(be);
  std::vector<Tensor> ts, grads;
  for (size_t i = 0; i < vals.size(); ++i) {
    ts.push_back(test::from_vector(be, shapes[i], *vals[i]));
    grads.push_back(be.zeros(shapes[i], DType::f32));
    Graph::track(ts.back(), grads.back());
  }
  Tensor loss = composed(g, ts[0], ts[1], ts[2], ts[3], targets);
  g.backward(loss);
  EXPECT_EQ(g.tape_size(), 0u);
  for (size_t i = 0; i < vals.size(); ++i) {
    const std::vector<float> got = test::to_vector(grads[i]);
    for (size_t j = 0; j < vals[i]->size(); ++j) {
      const float keep = (*vals[i])[j];
      const float h = 1e-2f * std::max(1.f, std::fabs(keep));
      (*vals[i])[j] = keep + h;
      const double up = eval(vals);
      (*vals[i])[j] = keep - h;
      const double down = eval(vals);
      (*vals[i])[j] = keep;
      const double fd = (up - down) / (2.0 * h);
      EXPECT_NEAR(got[j], fd, 2e-3 + 2e-2 * std::fabs(fd)) << "input " << i << " element " << j;
    }
  }
}

TEST(Graph, GradientsAccumulateAcrossBackwards) {
  Backend& be = test::cpu();
  Tensor w = test::from_vector(be, {2, 2}, {1, 2, 3, 4});
  Tensor gw = be.zeros({2, 2}, DType::f32);
  Graph::track(w, gw);
  Tensor x = test::from_vector(be, {1, 2}, {1, 1});
  Tensor t = test::from_ints(be, {1}, {0});
  for (int i = 0; i < 2; ++i) {
    Graph g(be);
    g.backward(g.cross_entropy(g.matmul(x, w), t, 0.f, 1.f));
  }
  Tensor once = be.zeros({2, 2}, DType::f32);
  Tensor w2 = test::from_vector(be, {2, 2}, {1, 2, 3, 4});
  Graph::track(w2, once);
  Graph g(be);
  g.backward(g.cross_entropy(g.matmul(x, w2), t, 0.f, 1.f));
  const auto a = test::to_vector(gw), b = test::to_vector(once);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_FLOAT_EQ(a[i], 2 * b[i]);
}

// A llama-test model large enough for activation memory to dominate.
struct RunResult {
  std::vector<std::vector<float>> grads;
  float loss;
  size_t peak_bytes;
};

RunResult train_step(const std::string& remat, const std::string& attention = "flash") {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = {"remat_policy=" + remat, "attention=" + attention, "max_target_length=128",
                   "per_device_batch_size=2", "base_num_decoder_layers=4", "num_threads=2"};
  Config cfg = load_config(req);
  ModelRunner r(cfg, test::plugins());
  r.init_parameters(7);
  r.enable_gradients();
  HostBatch hb;
  hb.batch = 2;
  hb.seq = 128;
  std::mt19937_64 rng(3);
  for (int i = 0; i < 256; ++i) {
    hb.inputs.push_back(static_cast<int32_t>(rng() % 256));
    hb.targets.push_back(static_cast<int32_t>(rng() % 256));
  }
  DeviceBatch db = r.upload(hb);
  Backend& be = r.backend();
  be.reset_peak_memory();
  const size_t base = be.memory_stats().bytes_in_use;
  RunResult out;
  {
    Graph g(be);
    Tensor loss = r.loss(g, db, 0.f);
    out.loss = test::to_vector(loss)[0];
    g.backward(loss);
  }
  out.peak_bytes = be.memory_stats().peak_bytes_in_use - base;
  for (auto& p : r.params()) out.grads.push_back(test::to_vector(p.grad));
  return out;
}

TEST(Graph, RematPoliciesGiveTheSameGradientsWithLessMemory) {
  const RunResult none = train_step("none"), minimal = train_step("minimal"),
                  full = train_step("full");
  EXPECT_EQ(none.loss, minimal.loss);
  EXPECT_EQ(none.loss, full.loss);
  for (size_t i = 0; i < none.grads.size(); ++i) {
    EXPECT_LT(test::max_rel_err(minimal.grads[i], none.grads[i], 1e-6), 1e-6) << "param " << i;
    EXPECT_LT(test::max_rel_err(full.grads[i], none.grads[i], 1e-6), 1e-6) << "param " << i;
  }
  std::printf("peak activation memory: none %.2f MB, minimal %.2f MB, full %.2f MB\n",
              none.peak_bytes / 1e6, minimal.peak_bytes / 1e6, full.peak_bytes / 1e6);
  EXPECT_LT(full.peak_bytes, minimal.peak_bytes);
  EXPECT_LT(minimal.peak_bytes, none.peak_bytes);
}

TEST(Graph, TrainingStepIsDeterministic) {
  const RunResult a = train_step("none"), b = train_step("none");
  EXPECT_EQ(a.loss, b.loss);
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_EQ(a.grads[i], b.grads[i]) << "param " << i;
}

}  // namespace
}  // namespace mt
