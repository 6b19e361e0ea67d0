// num_vocab_tiling (MaxText's vocab tiling): the LM head and the cross-entropy over runs of
// positions, each recomputed in the backward, give the loss, the auxiliary values and every
// parameter's gradient of one pass over all positions, for every family's head (tied, soft-cap,
// layer norm, multi-token prediction) and with a z-loss and ignored targets; the memory they
// save is the logits'; a value below 1 is refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "config_loader.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/error.h"
#include "test_support.h"

namespace mt {
namespace {

struct Pass {
  double loss = 0;
  std::map<std::string, double> aux;
  std::map<std::string, std::vector<float>> grads;
};

HostBatch random_batch(int64_t batch, int64_t seq, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostBatch hb;
  hb.batch = batch;
  hb.seq = seq;
  for (int64_t i = 0; i < batch * seq; ++i) {
    hb.inputs.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    // Every fifth target ignored (packing's and padding's -1).
    hb.targets.push_back(i % 5 == 3 ? -1
                                    : static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
  }
  return hb;
}

// One forward and backward of the training objective (with its auxiliary values, so MoE losses
// and MTP depths take part), z_loss 1e-3.
Pass run(const std::string& model, std::vector<std::string> keys, const HostBatch& hb) {
  keys.push_back("num_threads=2");
  ModelRunner r(test::model_config(model, keys), test::plugins());
  r.init_parameters(3);
  r.enable_gradients();
  r.zero_gradients();
  const DeviceBatch db = r.upload(hb);
  Pass out;
  Graph g(r.backend());
  const Tensor loss = r.loss(g, db, 1e-3f, 1.0, &out.aux);
  out.loss = test::to_vector(loss)[0];
  g.backward(loss);
  r.finish_gradients();
  for (auto& p : r.params()) out.grads[p.name] = test::to_vector(p.grad);
  return out;
}

TEST(VocabTiling, EveryHeadGivesTheLossAndGradientsOfOnePass) {
  struct Case {
    std::string model;
    std::vector<std::string> keys;
  };
  // llama-test: an LM head of its own; gemma2-test: tied, final soft-cap, (1 + w) norm;
  // gpt3-52k: layer norm, tied, a position table; deepseek3-test: an MTP depth (a second head
  // and loss) and its MoE's auxiliary losses; mixtral-test: experts, remat full around them.
  const std::vector<Case> cases = {{"llama-test", {}},
                                   {"gemma2-test", {}},
                                   {"gpt3-52k", {}},
                                   {"deepseek3-test", {"mtp_num_layers=1"}},
                                   {"mixtral-test", {"remat_policy=full"}}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model);
    const int64_t batch = 2, seq = 24;
    const HostBatch hb = random_batch(batch, seq, 256, 11);
    const Pass one = run(c.model, c.keys, hb);
    // 2 and 5 runs (48 positions: uneven runs of 9 and 10), one position a run, and more runs
    // than positions (one each).
    for (const int tiles : {2, 5, 48, 1000}) {
      SCOPED_TRACE("num_vocab_tiling=" + std::to_string(tiles));
      std::vector<std::string> keys = c.keys;
      keys.push_back("num_vocab_tiling=" + std::to_string(tiles));
      const Pass tiled = run(c.model, keys, hb);
      EXPECT_NEAR(tiled.loss, one.loss, 1e-6 * std::fabs(one.loss));
      ASSERT_EQ(tiled.aux.size(), one.aux.size());
      for (const auto& [name, v] : one.aux)
        EXPECT_NEAR(tiled.aux.at(name), v, 1e-6 * std::max(1.0, std::fabs(v))) << name;
      ASSERT_EQ(tiled.grads.size(), one.grads.size());
      double largest = 0;
      for (const auto& [name, want] : one.grads) largest = std::max(largest, test::max_abs(want));
      for (const auto& [name, want] : one.grads) {
        const std::vector<float>& got = tiled.grads.at(name);
        if (test::max_abs(want) < 1e-6 * largest) {
          // A gradient that is zero but for rounding (gpt3-52k's key bias: softmax ignores a
          // shift of every score of a query) stays as small.
          EXPECT_LT(test::max_abs(got), 1e-6 * largest) << name;
          continue;
        }
        // Each row's logit gradient is the same; the head's weight gradient and the hidden
        // state's are summed run by run (f32 rounding of the order).
        EXPECT_LT(test::scaled_err(got, want), 2e-6) << name;
      }
    }
  }
}

// The logits are the largest tensor of this configuration's step (positions x vocabulary, with
// their gradient and the softmax's); in 8 runs only an eighth of them exist at a time. The
// memory plan traces the same code: its peak falls by as much.
TEST(VocabTiling, LowersThePeakByTheLogits) {
  const int64_t batch = 2, seq = 64, vocab = 8192;
  const std::vector<std::string> common = {"vocab_size=" + std::to_string(vocab),
                                           "per_device_batch_size=2", "max_target_length=64",
                                           "num_threads=2"};
  const HostBatch hb = random_batch(batch, seq, vocab, 5);
  auto peak = [&](int tiles) {
    std::vector<std::string> keys = common;
    keys.push_back("num_vocab_tiling=" + std::to_string(tiles));
    ModelRunner r(test::model_config("llama-test", keys), test::plugins());
    r.init_parameters(1);
    r.enable_gradients();
    r.zero_gradients();
    const DeviceBatch db = r.upload(hb);
    r.backend().reset_peak_memory();
    const size_t before = r.backend().memory_stats().bytes_in_use;
    {
      Graph g(r.backend());
      g.backward(r.loss(g, db, 0.f));
    }
    return r.backend().memory_stats().peak_bytes_in_use - before;
  };
  const size_t whole = peak(1), tiled = peak(8);
  const double logits = double(batch * seq * vocab) * 4;  // f32
  std::printf("step peak above the weights: %zu bytes whole, %zu in 8 runs; logits %.0f bytes\n",
              whole, tiled, logits);
  // Seven eighths of the logits and of most of their gradient (measured here: 1.75 x the
  // logits saved, 7.34 of 9.31 MB).
  EXPECT_GT(double(whole) - double(tiled), 1.5 * logits * 7 / 8);
}

TEST(VocabTiling, BelowOneIsRefused) {
  for (const char* bad : {"num_vocab_tiling=0", "num_vocab_tiling=-2"}) {
    SCOPED_TRACE(bad);
    try {
      ModelRunner r(test::model_config("llama-test", {bad}), test::plugins());
      ADD_FAILURE() << "accepted";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("num_vocab_tiling"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace mt
