// The SDK v2 family contract, through a family built for it (tests/families/contract_test.cpp):
// layers of two kinds with their own windows and cache specs, an auxiliary loss that joins the
// objective under every remat policy, parameters by name, FLOPs from the declarations, and
// Hugging Face names that slice a fused tensor and stack several.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include "config_loader.h"
#include "decoder.h"
#include "hf_interop.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/blocks.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "safetensors.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

PluginManager& family_plugins() {
  static PluginManager pm({fs::path(MT_BUILD_DIR) / "tests" / "families"});
  return pm;
}

Config contract_config(std::vector<std::string> overrides) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = {"decoder_block=contract_test", "base_num_decoder_layers=4",
                   "sliding_window_size=4"};
  for (auto& o : overrides) req.overrides.push_back(std::move(o));
  return load_config(req);
}

std::unique_ptr<ModelRunner> runner(std::vector<std::string> overrides = {}, uint64_t seed = 5) {
  auto r = std::make_unique<ModelRunner>(contract_config(std::move(overrides)), family_plugins());
  r->init_parameters(seed);
  return r;
}

HostBatch batch(int64_t b, int64_t t, uint64_t seed) {
  std::mt19937_64 rng(seed);
  HostBatch hb;
  hb.batch = b;
  hb.seq = t;
  for (int64_t i = 0; i < b * t; ++i) {
    hb.inputs.push_back(static_cast<int32_t>(rng() % 256));
    hb.targets.push_back(static_cast<int32_t>(rng() % 256));
  }
  return hb;
}

TEST(FamilyContract, LayersDeclareTheirOwnCaches) {
  auto r = runner();
  ASSERT_EQ(r->cache_specs().size(), 4u);
  for (int i = 0; i < 4; ++i) {
    const CacheSpec& c = r->cache_specs()[static_cast<size_t>(i)];
    EXPECT_EQ(c.window, i % 2 ? 0 : 4) << "layer " << i;
    ASSERT_EQ(c.entries.size(), 2u);
    EXPECT_EQ(c.entries[0], (Shape{2, 16}));
  }
  Decoder dec(*r, 2, 20);
  EXPECT_EQ(dec.cache_rows(0), 4);   // a ring of the local window
  EXPECT_EQ(dec.cache_rows(1), 20);  // the whole context
}

// KV-cache decode == full forward with local and global layers mixed: each kind keeps its own
// rows (ring or linear) within one call.
TEST(FamilyContract, DecodeEqualsForwardWithPerLayerWindows) {
  auto r = runner();
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> seqs(2);
  const int prompt_len[2] = {3, 6};
  Decoder dec(*r, 2, 16);
  std::vector<int32_t> next(2);
  auto full = [&](const std::vector<int32_t>& ids) {
    HostBatch hb;
    hb.batch = 1;
    hb.seq = static_cast<int64_t>(ids.size());
    hb.inputs = ids;
    Graph g(r->backend(), false);
    return test::to_vector(r->forward(g, r->upload(hb)));
  };
  for (int b = 0; b < 2; ++b) {
    for (int i = 0; i < prompt_len[b]; ++i) seqs[b].push_back(static_cast<int32_t>(rng() % 256));
    EXPECT_LT(test::scaled_err(dec.prefill(b, seqs[b]), full(seqs[b])), 1e-5) << "prefill " << b;
    next[b] = static_cast<int32_t>(rng() % 256);
  }
  for (int step = 0; step < 8; ++step) {  // past the window of 4
    const std::vector<float> logits = dec.step(next, {true, true});
    for (int b = 0; b < 2; ++b) {
      seqs[b].push_back(next[b]);
      const std::vector<float> ref = full(seqs[b]);
      const std::vector<float> last(ref.end() - 256, ref.end());
      const std::vector<float> got(logits.begin() + b * 256, logits.begin() + (b + 1) * 256);
      EXPECT_LT(test::scaled_err(got, last), 1e-5) << "step " << step << " sequence " << b;
      next[b] = static_cast<int32_t>(rng() % 256);
    }
  }
}

// The auxiliary loss joins the objective with its weight, reaches metrics by name, and gives
// the same loss and gradients under every remat policy.
TEST(FamilyContract, AuxiliaryLossUnderEveryRematPolicy) {
  const HostBatch hb = batch(2, 8, 3);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (const char* policy : {"none", "minimal", "full"}) {
    SCOPED_TRACE(policy);
    auto r = runner({std::string("remat_policy=") + policy});
    r->enable_gradients();
    r->zero_gradients();
    DeviceBatch db = r->upload(hb);
    std::map<std::string, double> aux;
    Graph g(r->backend());
    Tensor l = r->loss(g, db, 0.f, 1.0, &aux);
    g.backward(l);
    r->finish_gradients();
    ASSERT_EQ(aux.size(), 1u);
    ASSERT_TRUE(aux.count("test_aux"));
    EXPECT_GT(aux["test_aux"], 0.0);
    // The objective is the cross-entropy plus 0.5 x the mean over the 2 layers of the aux loss
    // (MaxText's mean, not their sum), which is what aux logs.
    Graph plain(r->backend(), false);
    const double ce = test::to_vector(r->loss(plain, db, 0.f))[0];
    const double total = test::to_vector(l)[0];
    EXPECT_NEAR(total, ce + 0.5 * aux["test_aux"], 1e-5 * std::fabs(total));
    losses.push_back(total);
    std::vector<float> all;
    for (auto& p : r->params()) {
      auto v = test::to_vector(p.grad);
      all.insert(all.end(), v.begin(), v.end());
    }
    grads.push_back(all);
  }
  for (size_t i = 1; i < grads.size(); ++i) {
    EXPECT_NEAR(losses[i], losses[0], 1e-6 * std::fabs(losses[0]));
    EXPECT_LT(test::max_rel_err(grads[i], grads[0], 1e-4), 1e-4) << "remat policy " << i;
  }
}

// The auxiliary loss's gradient is the derivative of the objective: central differences on a
// few weights of a layer that reports it (first-layer weights feed it through the residual).
TEST(FamilyContract, AuxiliaryLossGradientMatchesFiniteDifferences) {
  auto r = runner({"remat_policy=full"});
  r->enable_gradients();
  const HostBatch hb = batch(1, 6, 9);
  DeviceBatch db = r->upload(hb);
  auto objective = [&] {
    std::map<std::string, double> aux;
    Graph g(r->backend(), false);
    return static_cast<double>(test::to_vector(r->loss(g, db, 0.f, 1.0, &aux))[0]);
  };
  r->zero_gradients();
  {
    std::map<std::string, double> aux;
    Graph g(r->backend());
    g.backward(r->loss(g, db, 0.f, 1.0, &aux));
  }
  r->finish_gradients();
  for (const char* name : {"layers.1.w_in", "layers.1.bq", "layers.0.wq", "layers.1.bo"}) {
    Param* p = r->find(name);
    ASSERT_NE(p, nullptr) << name;
    std::vector<float> w = test::to_vector(p->value), gr = test::to_vector(p->grad);
    for (size_t i : {size_t{0}, w.size() / 2, w.size() - 1}) {
      const float h = 1e-2f, keep = w[i];
      w[i] = keep + h;
      r->backend().copy_from_host(p->value, w.data());
      const double up = objective();
      w[i] = keep - h;
      r->backend().copy_from_host(p->value, w.data());
      const double down = objective();
      w[i] = keep;
      r->backend().copy_from_host(p->value, w.data());
      const double fd = (up - down) / (2 * h);
      EXPECT_NEAR(gr[i], fd, 2e-3 + 2e-2 * std::fabs(fd)) << name << "[" << i << "]";
    }
  }
}

// FLOPs from the declarations: 6 x matmul parameters (the unused `pair` counts: it is declared
// a matmul) + attention's keys per layer: seq/2 for global layers, fewer within a window.
TEST(FamilyContract, FlopsCountEachLayersWindow) {
  auto r = runner();
  const ParamCounts c = count_parameters(r->model());
  const double s = 32, w = 4;
  const double attn = 12.0 * 4 * 16 * (2 * (s / 2) + 2 * (w - w * w / (2 * s)));
  EXPECT_NEAR(r->model().flops_per_token(32), 6.0 * static_cast<double>(c.matmul) + attn, 1e-6);
  EXPECT_EQ(c.active_matmul, static_cast<double>(c.matmul));
}

TEST(FamilyContract, MissingParameterNameIsAnError) {
  std::vector<std::string> names = {"a", "b"};
  Params p(names, {Tensor(), Tensor()});
  EXPECT_NE(p.find("a"), nullptr);
  EXPECT_EQ(p.find("c"), nullptr);
  try {
    (void)p["c"];
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'c'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("a, b"), std::string::npos) << e.what();
  }
}

// Hugging Face names: q, k and v are column slices of one fused qkv tensor stored [out, in];
// `pair` [2, d, 4] is stacked from two [4, d] tensors. Written, the files hold exactly that
// layout; read back, every parameter is restored.
TEST(FamilyContract, HuggingFaceSlicesAndStacks) {
  auto r = runner({}, 5);
  const fs::path dir = fs::path(::testing::TempDir()) / "contract_hf";
  fs::remove_all(dir);
  fs::create_directories(dir);
  // The tensors only: config.json would need the family's to_hf_config, which it lacks.
  write_hf_tensors(dir / "model.safetensors", *r);
  SafeTensorsFile f(dir / "model.safetensors");
  const int64_t q = 4 * 16, kv = 2 * 16, d = 64;
  EXPECT_EQ(f.info("layers.0.qkv").shape, (Shape{q + 2 * kv, d}));
  EXPECT_EQ(f.info("layers.2.pair.1").shape, (Shape{4, d}));
  EXPECT_FALSE(f.contains("layers.0.wq"));
  Tensor qkv = load_tensor(f, "layers.0.qkv", r->backend(), DType::f32);
  const std::vector<float> fused = test::to_vector(qkv);
  const std::vector<float> wk = test::to_vector(r->find("layers.0.wk")->value);  // [d, kv]
  for (int64_t o = 0; o < kv; o += 7)
    for (int64_t i = 0; i < d; i += 5)
      EXPECT_EQ(fused[static_cast<size_t>((q + o) * d + i)], wk[static_cast<size_t>(i * kv + o)]);
  Tensor p1 = load_tensor(f, "layers.2.pair.1", r->backend(), DType::f32);
  const std::vector<float> pair = test::to_vector(r->find("layers.2.pair")->value);  // [2, d, 4]
  const std::vector<float> part = test::to_vector(p1);                               // [4, d]
  for (int64_t o = 0; o < 4; ++o)
    for (int64_t i = 0; i < d; i += 3)
      EXPECT_EQ(part[static_cast<size_t>(o * d + i)], pair[static_cast<size_t>(d * 4 + i * 4 + o)]);

  auto back = runner({}, 77);
  load_hf_weights(dir, *back);
  for (auto& p : r->params())
    EXPECT_EQ(test::to_vector(p.value), test::to_vector(back->find(p.name)->value)) << p.name;
}

// mt run logs each auxiliary loss by name in metrics.jsonl, beside the loss it joined.
TEST(FamilyContract, TrainingLogsAuxiliaryLosses) {
  const fs::path out = fs::path(::testing::TempDir()) / "contract_run";
  fs::remove_all(out);
  const fs::path families = fs::path(MT_BUILD_DIR) / "tests" / "families";
  auto r = test::run_mt(
      "run --model=llama-test decoder_block=contract_test "
      "base_num_decoder_layers=4 sliding_window_size=4 dataset_type=synthetic "
      "steps=2 log_period=1 enable_checkpointing=false plugin_dirs=[" +
          families.string() + "] base_output_directory=" + out.string(),
      120);
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(out / "default" / "metrics.jsonl");
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) {
    ++lines;
    EXPECT_NE(line.find("\"test_aux\": "), std::string::npos) << line;
  }
  EXPECT_EQ(lines, 2);
}

}  // namespace
}  // namespace mt
