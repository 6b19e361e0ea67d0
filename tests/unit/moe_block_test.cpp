// The mixture-of-experts block (blocks::moe) against a dense reference that runs every expert on
// every token and masks the combination, forward and backward, dropless and with MaxText's token
// dropping; the capacity rule; which slots a full expert drops; the load metrics it logs.
// (graph_ops_test checks the block against a host loop over the top-k experts and against finite
// differences.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "emulated_cuda.h"
#include "mt/blocks.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "test_support.h"

namespace mt {
namespace {

using Vec = std::vector<float>;

struct Case {
  blocks::MoeSpec s;
  int64_t B = 2, T = 8;
  Vec x, router, gate, up, down;  // x [B, T, d], router [d, E], experts [E, d, h] / [E, h, d]
  Vec dy;                         // the seed of the backward, [B, T, d]
};

Case make_case(int64_t E, int64_t k, bool normalize, float capacity_factor, std::mt19937_64& rng) {
  Case c;
  c.s.d_model = 8;
  c.s.hidden = 6;
  c.s.num_experts = E;
  c.s.top_k = k;
  c.s.normalize_topk = normalize;
  c.s.capacity_factor = capacity_factor;
  const int64_t d = c.s.d_model, h = c.s.hidden, n = c.B * c.T;
  c.x = test::randn(static_cast<size_t>(n * d), rng);
  c.router = test::randn(static_cast<size_t>(d * E), rng, 1.f);
  c.gate = test::randn(static_cast<size_t>(E * d * h), rng, 1.f / std::sqrt(float(d)));
  c.up = test::randn(static_cast<size_t>(E * d * h), rng, 1.f / std::sqrt(float(d)));
  c.down = test::randn(static_cast<size_t>(E * h * d), rng, 1.f / std::sqrt(float(h)));
  c.dy = test::randn(static_cast<size_t>(n * d), rng);
  return c;
}

// A tracked input: its value and the buffer its gradient accumulates into.
struct Leaf {
  Tensor v, g;
};
Leaf leaf(Backend& be, const Shape& s, const Vec& v) {
  Leaf l{test::from_vector(be, s, v), be.zeros(s, DType::f32)};
  Graph::track(l.v, l.g);
  return l;
}

struct Result {
  Vec y, dx, drouter, dgate, dup, ddown;  // expert gradients stacked [E, ...]
  std::vector<AuxLoss> aux;
  std::vector<int32_t> indices;  // the routing, [n, k]
};

// The block: forward, then the backward from y with seed dy.
Result run_block(const Case& c, Backend& be = test::cpu()) {
  const int64_t d = c.s.d_model, h = c.s.hidden, E = c.s.num_experts;
  Graph g(be);
  Leaf x = leaf(be, {c.B, c.T, d}, c.x), r = leaf(be, {d, E}, c.router),
       wg = leaf(be, {E, d, h}, c.gate), wu = leaf(be, {E, d, h}, c.up),
       wd = leaf(be, {E, h, d}, c.down);
  static const std::vector<std::string> names = {"router", "w_gate", "w_up", "w_down"};
  const Params p(names, {r.v, wg.v, wu.v, wd.v});
  LayerOutput o = blocks::moe(g, p, c.s, x.v);
  g.backward(o.x, test::from_vector(be, o.x.shape(), c.dy));
  Result res;
  res.y = test::to_vector(o.x);
  res.dx = test::to_vector(x.g);
  res.drouter = test::to_vector(r.g);
  res.dgate = test::to_vector(wg.g);
  res.dup = test::to_vector(wu.g);
  res.ddown = test::to_vector(wd.g);
  res.aux = o.aux;
  return res;
}

// MaxText's dropping rule, written as MaxText writes it (layers/moe.py, generate_masks): per
// sequence, the one-hot expert choices of the T k slots in order (token by token, a token's
// choices by rank), their running count per expert, and a slot kept while its count is at most
// the capacity.
std::vector<char> maxtext_keep(const std::vector<int32_t>& idx, int64_t B, int64_t T, int64_t k,
                               int64_t E, int64_t capacity) {
  std::vector<char> keep(idx.size(), 1);
  if (capacity < 0) return keep;  // dropless
  for (int64_t b = 0; b < B; ++b) {
    std::vector<std::vector<int>> onehot(static_cast<size_t>(T * k), std::vector<int>(E, 0));
    for (int64_t i = 0; i < T * k; ++i) onehot[i][idx[static_cast<size_t>(b * T * k + i)]] = 1;
    std::vector<int> cumsum(static_cast<size_t>(E), 0);
    for (int64_t i = 0; i < T * k; ++i)
      for (int64_t e = 0; e < E; ++e) {
        cumsum[e] += onehot[i][e];
        if (onehot[i][e] && cumsum[e] > capacity) keep[static_cast<size_t>(b * T * k + i)] = 0;
      }
  }
  return keep;
}

// The dense reference: every expert runs on every token (separate [d, h] matrices per expert),
// and its output is weighted by a combine matrix C [n, E] that holds the routing weight of each
// kept (token, expert) slot and 0 elsewhere. `capacity`: -1 keeps every slot.
Result run_dense(const Case& c, int64_t capacity) {
  Backend& be = test::cpu();
  const int64_t d = c.s.d_model, h = c.s.hidden, E = c.s.num_experts, k = c.s.top_k;
  const int64_t n = c.B * c.T;
  Graph g(be);
  Leaf x = leaf(be, {n, d}, c.x), r = leaf(be, {d, E}, c.router);
  std::vector<Leaf> wg, wu, wd;
  for (int64_t e = 0; e < E; ++e) {
    wg.push_back(
        leaf(be, {d, h}, Vec(c.gate.begin() + e * d * h, c.gate.begin() + (e + 1) * d * h)));
    wu.push_back(leaf(be, {d, h}, Vec(c.up.begin() + e * d * h, c.up.begin() + (e + 1) * d * h)));
    wd.push_back(
        leaf(be, {h, d}, Vec(c.down.begin() + e * h * d, c.down.begin() + (e + 1) * h * d)));
  }
  const Graph::Routing route =
      g.route(g.matmul(x.v, r.v), static_cast<int>(k), false, c.s.normalize_topk);
  Result res;
  res.indices = test::to_ints(route.indices);
  const std::vector<char> keep = maxtext_keep(res.indices, c.B, c.T, k, E, capacity);
  const std::vector<Tensor> w = g.split(route.weights, std::vector<int64_t>(size_t(k), 1));
  const Tensor ones = test::from_vector(be, {1, E}, Vec(size_t(E), 1.f));
  Tensor comb;
  for (int64_t j = 0; j < k; ++j) {
    Vec mask(static_cast<size_t>(n * E), 0.f);
    for (int64_t t = 0; t < n; ++t)
      if (keep[static_cast<size_t>(t * k + j)]) mask[t * E + res.indices[t * k + j]] = 1.f;
    const Tensor term = g.mul(g.matmul(w[j], ones), test::from_vector(be, {n, E}, mask));
    comb = j ? g.add(comb, term) : term;
  }
  Tensor y;
  for (int64_t e = 0; e < E; ++e) {
    Vec sel(static_cast<size_t>(E * d), 0.f);
    std::fill(sel.begin() + e * d, sel.begin() + (e + 1) * d, 1.f);
    const Tensor col = g.matmul(comb, test::from_vector(be, {E, d}, sel));  // C[:, e] per column
    const Tensor ffn = g.matmul(
        g.gated(Activation::silu, g.matmul(x.v, wg[e].v), g.matmul(x.v, wu[e].v)), wd[e].v);
    const Tensor term = g.mul(col, ffn);
    y = e ? g.add(y, term) : term;
  }
  g.backward(y, test::from_vector(be, y.shape(), c.dy));
  res.y = test::to_vector(y);
  res.dx = test::to_vector(x.g);
  res.drouter = test::to_vector(r.g);
  for (int64_t e = 0; e < E; ++e) {
    for (float v : test::to_vector(wg[e].g)) res.dgate.push_back(v);
    for (float v : test::to_vector(wu[e].g)) res.dup.push_back(v);
    for (float v : test::to_vector(wd[e].g)) res.ddown.push_back(v);
  }
  return res;
}

// The router's gradient is scaled by its own largest value, or by 1e-2 of dx's where it is
// nearly 0: with top 1 normalized the routing weight is p / p = 1 whatever the router gives,
// and both gradients are rounding (4.5e-8 against dx's 3.7 for one seed, which two orders of
// summing put 1.01 apart relative to themselves).
void expect_same(const Result& got, const Result& want) {
  EXPECT_LT(test::scaled_err(got.y, want.y), 1e-5);
  EXPECT_LT(test::scaled_err(got.dx, want.dx), 1e-5);
  const double router_scale = std::max(test::max_abs(want.drouter), 1e-2 * test::max_abs(want.dx));
  double router_err = 0;
  for (size_t i = 0; i < got.drouter.size() && i < want.drouter.size(); ++i)
    router_err = std::max(router_err, std::fabs(double(got.drouter[i]) - want.drouter[i]));
  EXPECT_LT(router_err / router_scale, 1e-5);
  EXPECT_LT(test::scaled_err(got.dgate, want.dgate), 1e-5);
  EXPECT_LT(test::scaled_err(got.dup, want.dup), 1e-5);
  EXPECT_LT(test::scaled_err(got.ddown, want.ddown), 1e-5);
}

TEST(MoeBlock, DroplessEqualsADenseReferenceThatRunsEveryExpert) {
  MT_SEEDED_RNG(rng);
  for (int64_t k : {1, 2, 3})
    for (bool normalize : {false, true}) {
      SCOPED_TRACE("top " + std::to_string(k) + (normalize ? " normalized" : ""));
      const Case c = make_case(4, k, normalize, -1.f, rng);
      const Result got = run_block(c);
      expect_same(got, run_dense(c, -1));
      // Top 1 normalized: the router has nothing to learn (its weight is 1 whatever it says).
      if (k == 1 && normalize) {
        EXPECT_LT(test::max_abs(got.drouter), 1e-6 * test::max_abs(got.dx));
      }
    }
}

// With a capacity, the block computes what the dense reference masked by MaxText's rule
// computes, gradients included; and the slots it drops are that rule's. Each capacity draws cases
// until one drops slots that matter: where the masked and the unmasked references differ by far
// more than expect_same's 1e-5, so that a block ignoring the capacity could not pass. (A dropped
// slot with a small routing weight moves y by as little as 1e-5; asserting a fixed difference on
// the first draw once failed at 9.7e-4.)
TEST(MoeBlock, DroppingEqualsTheDenseReferenceMaskedByMaxTextsRule) {
  MT_SEEDED_RNG(rng);
  for (float cf : {0.5f, 1.f, 1.25f}) {
    SCOPED_TRACE("capacity_factor " + std::to_string(cf));
    bool telling = false;
    for (int draw = 0; draw < 50 && !telling; ++draw) {
      SCOPED_TRACE("draw " + std::to_string(draw));
      const Case c = make_case(4, 2, true, cf, rng);
      const int64_t capacity = blocks::moe_capacity(c.s, c.T);
      const Result want = run_dense(c, capacity);
      const Result got = run_block(c);
      expect_same(got, want);
      const std::vector<char> keep = maxtext_keep(want.indices, c.B, c.T, 2, 4, capacity);
      const auto dropped = static_cast<double>(std::count(keep.begin(), keep.end(), 0));
      ASSERT_EQ(got.aux.size(), 5u);
      EXPECT_EQ(got.aux[4].name, "moe_dropped_fraction");
      EXPECT_EQ(got.aux[4].weight, 0.f);
      EXPECT_FLOAT_EQ(test::to_vector(got.aux[4].value)[0],
                      static_cast<float>(dropped / static_cast<double>(keep.size())));
      if (cf < 1.f) {
        EXPECT_GT(dropped, 0) << "capacity " << capacity << " dropped nothing";
      }
      if (dropped > 0 && test::scaled_err(run_dense(c, -1).y, want.y) > 1e-3) {
        telling = true;
        // The dropless block computes the unmasked result, not this one.
        Case dropless = c;
        dropless.s.capacity_factor = -1.f;
        EXPECT_GT(test::scaled_err(run_block(dropless).y, want.y), 1e-3);
      }
    }
    EXPECT_TRUE(telling) << "50 draws never dropped a slot that changes y by 1e-3";
  }
}

// MaxText's capacity, int(max(ceil(T k / E) * cf, cf)), per sequence of T tokens.
TEST(MoeBlock, CapacityFollowsMaxTextsRule) {
  blocks::MoeSpec s;
  s.d_model = 4;
  s.hidden = 4;
  s.num_experts = 8;
  s.top_k = 2;
  EXPECT_EQ(blocks::moe_capacity(s, 512), 0);  // dropless
  struct Row {
    int64_t T, E, k;
    float cf;
    int64_t want;
  };
  for (const Row r : {Row{512, 8, 2, 1.f, 128}, Row{512, 8, 2, 1.25f, 160}, Row{5, 8, 2, 1.25f, 2},
                      Row{1, 8, 1, 2.f, 2}, Row{1, 8, 1, 0.2f, 0}, Row{8, 4, 2, 0.3f, 1},
                      Row{100, 128, 8, 1.5f, 10}}) {
    s.num_experts = r.E;
    s.top_k = r.k;
    s.capacity_factor = r.cf;
    EXPECT_EQ(blocks::moe_capacity(s, r.T), r.want)
        << r.T << " " << r.E << " " << r.k << " " << r.cf;
  }
}

// Every token prefers experts 0 and 1: with capacity C (a sequence of 8 tokens, top 2 of 4, so
// C = ceil(16 / 4) * cf), the first C tokens of each sequence keep both slots and every later
// token is dropped whole: its output is exactly zero.
TEST(MoeBlock, AFullExpertDropsTheLaterTokens) {
  MT_SEEDED_RNG(rng);
  for (float cf : {1.f, 1.5f}) {
    Case c = make_case(4, 2, true, cf, rng);
    const int64_t d = c.s.d_model, E = 4;
    std::fill(c.router.begin(), c.router.end(), 0.f);
    for (int64_t t = 0; t < c.B * c.T; ++t) c.x[t * d] = 1.f + 0.01f * float(t % 3);
    c.router[0 * E + 0] = 8.f;
    c.router[0 * E + 1] = 4.f;
    const int64_t C = blocks::moe_capacity(c.s, c.T);
    ASSERT_EQ(C, cf == 1.f ? 4 : 6);
    const Result got = run_block(c);
    for (int64_t b = 0; b < c.B; ++b)
      for (int64_t t = 0; t < c.T; ++t) {
        double mx = 0;
        for (int64_t j = 0; j < d; ++j)
          mx = std::max(mx, std::fabs(double(got.y[((b * c.T) + t) * d + j])));
        if (t < C) {
          EXPECT_GT(mx, 0.0) << "token " << t << " of sequence " << b << " lost";
        } else {
          EXPECT_EQ(mx, 0.0) << "token " << t << " of sequence " << b << " kept";
        }
      }
    EXPECT_FLOAT_EQ(test::to_vector(got.aux.back().value)[0], float(c.T - C) / float(c.T));
    // Both experts got every token's slot (before dropping): half of the slots each.
    EXPECT_FLOAT_EQ(test::to_vector(got.aux[2].value)[0], 0.f);   // moe_load_min
    EXPECT_FLOAT_EQ(test::to_vector(got.aux[3].value)[0], 0.5f);  // moe_load_max
  }
}

// A capacity of 0 (cf < 1 on a short sequence) drops every slot: the block returns zeros.
TEST(MoeBlock, ACapacityOfZeroDropsEverything) {
  MT_SEEDED_RNG(rng);
  Case c = make_case(8, 1, false, 0.2f, rng);
  c.T = 1;
  c.B = 16;
  ASSERT_EQ(blocks::moe_capacity(c.s, c.T), 0);
  const Result got = run_block(c);
  for (float v : got.y) ASSERT_EQ(v, 0.f);
  EXPECT_FLOAT_EQ(test::to_vector(got.aux.back().value)[0], 1.f);
}

// The load metrics: weight 0 (logged in metrics.jsonl, not trained), the smallest and largest
// share of the token-slots routed to one expert, named after the layer when it has an index.
TEST(MoeBlock, LoadMetricsAreLoggedNotTrained) {
  MT_SEEDED_RNG(rng);
  Case c = make_case(4, 2, true, -1.f, rng);
  Result got = run_block(c);
  const Result dense = run_dense(c, -1);
  ASSERT_EQ(got.aux.size(), 4u);
  EXPECT_EQ(got.aux[0].name, "moe_lb_loss");
  EXPECT_EQ(got.aux[1].name, "moe_z_loss");
  EXPECT_EQ(got.aux[2].name, "moe_load_min");
  EXPECT_EQ(got.aux[3].name, "moe_load_max");
  std::vector<double> share(4, 0);
  for (int32_t e : dense.indices) share[e] += 1.0 / double(dense.indices.size());
  EXPECT_FLOAT_EQ(test::to_vector(got.aux[2].value)[0],
                  float(*std::min_element(share.begin(), share.end())));
  EXPECT_FLOAT_EQ(test::to_vector(got.aux[3].value)[0],
                  float(*std::max_element(share.begin(), share.end())));
  for (size_t i = 2; i < 4; ++i) EXPECT_EQ(got.aux[i].weight, 0.f);
  c.s.layer = 3;
  got = run_block(c);
  EXPECT_EQ(got.aux[2].name, "moe_load_min/3");
  EXPECT_EQ(got.aux[3].name, "moe_load_max/3");
}

// Inference (Graph::wants_aux false, as the core sets it where it drops a layer's auxiliary
// outputs): no losses or metrics, and the same output bits as the block that computes them.
TEST(MoeBlock, InferenceLeavesOutTheRouterLosses) {
  MT_SEEDED_RNG(rng);
  for (const float cf : {-1.f, 1.f}) {
    const Case c = make_case(4, 2, true, cf, rng);
    Backend& be = test::cpu();
    const int64_t d = c.s.d_model, h = c.s.hidden, E = c.s.num_experts;
    const Tensor x = test::from_vector(be, {c.B, c.T, d}, c.x);
    static const std::vector<std::string> names = {"router", "w_gate", "w_up", "w_down"};
    const Params p(
        names, {test::from_vector(be, {d, E}, c.router), test::from_vector(be, {E, d, h}, c.gate),
                test::from_vector(be, {E, d, h}, c.up), test::from_vector(be, {E, h, d}, c.down)});
    Graph with(be, /*record=*/false), without(be, /*record=*/false);
    without.set_wants_aux(false);
    EXPECT_TRUE(with.wants_aux());
    const LayerOutput a = blocks::moe(with, p, c.s, x), b = blocks::moe(without, p, c.s, x);
    EXPECT_EQ(a.aux.size(), cf > 0 ? 5u : 4u);
    EXPECT_TRUE(b.aux.empty());
    EXPECT_EQ(test::to_vector(b.x), test::to_vector(a.x)) << "capacity_factor " << cf;
  }
}

}  // namespace
}  // namespace mt

namespace mt {
namespace {

// The block on the cuda plugin's kernels (run on the host by tests/support/emulated_cuda):
// routing, the sort by expert, the grouped matmuls and the weighted scatter, forward and
// backward, dropless and dropping, give the CPU backend's results.
TEST(MoeBlock, CudaKernelsGiveTheCpuResults) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "the emulated GPU threads switch stacks with _longjmp, which AddressSanitizer "
                  "does not follow (the sanitizer pass leaves the emulation out)";
#endif
  MT_SEEDED_RNG(rng);
  std::unique_ptr<Backend> gpu = test::emulated_cuda();
  for (float capacity : {-1.f, 1.f})
    for (int64_t k : {1, 2}) {
      SCOPED_TRACE("top " + std::to_string(k) + " capacity_factor " + std::to_string(capacity));
      // (Top 1 renormalised has weight 1 whatever the router says: no router gradient to compare.)
      const Case c = make_case(4, k, k > 1, capacity, rng);
      expect_same(run_block(c, *gpu), run_block(c));
    }
}

}  // namespace
}  // namespace mt
