// The DeepSeek families (plugins/models/deepseek: deepseek_v2, deepseek_v3): tiny random models
// that transformers 5 saved with every feature on (tests/golden/deepseek_{v2,v3}, made by
// tools/make_deepseek_golden.py: latent attention with and without query compression, values of
// another head size, yarn with DeepSeek's mscale, dense first layers, shared experts, grouped
// routing, V3's selection bias) scored and greedily decoded through the mt CLI, in both
// config.json forms; the export back to Hugging Face; training on the shipped corpus and
// resuming; the published sizes; and bad input refused with exit code 2.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "config_loader.h"
#include "decoder.h"
#include "family_test_support.h"
#include "hf_interop.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/graph.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "safetensors.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

const fs::path kGolden = fs::path(test::source_dir()) / "tests" / "golden";
const char* const kDirs[] = {"deepseek_v2", "deepseek_v3"};

// max |mt - transformers| / max |transformers| over all logits. Measured: 5.9e-7 (v2, largest
// logit 4.2), 6.1e-7 (v3, 3.7; 5.7e-7 with rope_interleave false, 5.7e-7 with norm_topk_prob
// false).
constexpr double kTol = 1e-4;

using test::build_named;
using test::edit_file;
using test::expect_refused;
using test::losses;
using test::Reference;
using test::score;
using test::Scratch;
using test::slurp;

// What the golden directories are: transformers 5's config.json with the features on, the
// legacy form beside it, and the weights as save_pretrained wrote them.
TEST(DeepseekGolden, TheDirectoriesHaveEveryFeatureOn) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const bool v3 = std::string(d) == "deepseek_v3";
    const std::string v5 = slurp(kGolden / d / "config.json");
    const std::string legacy = slurp(kGolden / d / "legacy_config.json");
    EXPECT_NE(v5.find("\"transformers_version\": \"5."), std::string::npos);
    EXPECT_NE(v5.find("\"rope_type\": \"yarn\""), std::string::npos);
    EXPECT_NE(v5.find("\"mscale_all_dim\": 0.8"), std::string::npos);
    EXPECT_NE(v5.find("\"first_k_dense_replace\": 1"), std::string::npos);
    EXPECT_NE(v5.find("\"n_group\": 4"), std::string::npos);
    EXPECT_NE(v5.find("\"v_head_dim\": 12"), std::string::npos);
    EXPECT_EQ(v5.find("\"q_lora_rank\": null") != std::string::npos, !v3);
    EXPECT_EQ(legacy.find("\"rope_parameters\""), std::string::npos);
    EXPECT_NE(legacy.find("\"rope_scaling\""), std::string::npos);
    SafeTensorsFile w(kGolden / d / "model.safetensors");
    EXPECT_NO_THROW(w.info("model.layers.0.mlp.gate_proj.weight"));  // dense first layer
    EXPECT_NO_THROW(w.info("model.layers.2.mlp.experts.7.down_proj.weight"));
    EXPECT_NO_THROW(w.info("model.layers.2.mlp.shared_experts.up_proj.weight"));
    bool has_q_a = false, has_bias = false;
    for (const auto& n : w.names()) {
      has_q_a |= n == "model.layers.0.self_attn.q_a_proj.weight";
      has_bias |= n == "model.layers.1.mlp.gate.e_score_correction_bias";
    }
    EXPECT_EQ(has_q_a, v3);
    EXPECT_EQ(has_bias, v3);
  }
}

// Both models score the 100 tokens as transformers did, from config.json in either form, with
// every field understood; V3's variants of the same weights (rotate_half pairs, no
// renormalisation) move the logits far more than the tolerance, and match too.
TEST(DeepseekGolden, LogitsMatchTransformers) {
  Scratch s;
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const Reference ref(kGolden / d);
    const std::vector<float> want = ref.floats("logits");
    std::string out;
    const std::vector<float> v5 = score(kGolden / d, ref, s, out);
    ASSERT_EQ(v5.size(), want.size()) << out;
    EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
    EXPECT_LT(test::scaled_err(v5, want), kTol);
    const std::vector<float> legacy =
        score(test::with_config(s, kGolden, d, "legacy_config.json"), ref, s, out);
    EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
    EXPECT_EQ(legacy, v5) << "the two config.json forms configured different models";
  }
  const Reference ref(kGolden / "deepseek_v3");
  for (const char* v : {"rotate_half", "no_norm_topk"}) {
    SCOPED_TRACE(v);
    std::string out;
    const std::vector<float> got = score(
        test::with_config(s, kGolden, "deepseek_v3", std::string(v) + "_config.json"), ref, s, out);
    const std::vector<float> want = ref.floats(std::string(v) + ".logits");
    ASSERT_EQ(got.size(), want.size()) << out;
    EXPECT_LT(test::scaled_err(got, want), kTol);
    EXPECT_GT(test::scaled_err(got, ref.floats("logits")), 100 * kTol);
  }
}

// A DeepSeek-V3 config.json without norm_topk_prob and routed_scaling_factor is
// DeepseekV3Config's defaults (true, 2.5: the golden's values), not V2's (before: false and 1.0,
// logits off by 2.8 at a scale of 3.8).
TEST(DeepseekGolden, AbsentRoutingFieldsAreTransformersV3Defaults) {
  Scratch s;
  const Reference ref(kGolden / "deepseek_v3");
  const fs::path dir = test::with_config(s, kGolden, "deepseek_v3", "config.json");
  test::edit_file(dir / "config.json", "\"norm_topk_prob\": true,", "");
  test::edit_file(dir / "config.json", "\"routed_scaling_factor\": 2.5,", "");
  std::string out;
  const std::vector<float> got = score(dir, ref, s, out);
  ASSERT_EQ(got.size(), ref.floats("logits").size()) << out;
  EXPECT_LT(test::scaled_err(got, ref.floats("logits")), kTol);
}

// `mt decode hf_path=... tokens=<prompt>` prints the prompt and its 20 greedy tokens, equal to
// transformers' generate(do_sample=False). Smallest top-1/top-2 gaps: 0.032 (v2), 0.020 (v3).
TEST(DeepseekGolden, GreedyDecodeEqualsTransformersGenerate) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const Reference ref(kGolden / d);
    ASSERT_NO_FATAL_FAILURE(test::expect_decode_equals_generate(ref, "generate", kGolden / d, 20));
  }
}

// Hugging Face -> mt -> Hugging Face: the same tensors (names, shapes, bytes), and the exported
// config.json (transformers 5's form) scores as transformers did.
TEST(DeepseekGolden, ConvertRoundTripWritesWhatTransformersWrote) {
  Scratch s;
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const fs::path mtdir = s.root / (std::string(d) + "_mt"),
                   back = s.root / (std::string(d) + "_hf");
    ASSERT_NO_FATAL_FAILURE(test::convert_round_trip(kGolden / d, mtdir, back));
    const Reference ref(kGolden / d);
    std::string out;
    const std::vector<float> got = score(back, ref, s, out);
    EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
    EXPECT_LT(test::scaled_err(got, ref.floats("logits")), kTol);
  }
}

// The loss over the 100 tokens and every parameter's gradient, against transformers' (f32):
// the backward of latent attention (the rotary key shared by the heads, the splits, the
// compressed q and kv norms) and of DeepSeek's routing weights (V2: the softmax gathered; V3:
// the masked sigmoid route, renormalised). The V3 selection bias gets none (a buffer there).
// Measured: loss 7e-8 / 0 relative, worst gradient 1.24e-6 (v2) and 1.20e-6 (v3) of its largest
// element.
TEST(DeepseekGolden, LossAndGradientsMatchTransformers) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const HfImport imp = read_hf_config(kGolden / d, test::plugins());
    ConfigRequest req;
    req.configs_dir = test::source_dir() + "/configs";
    req.model = "";
    req.overrides = imp.overrides;
    req.overrides.push_back("max_target_length=100");
    req.schemas_for = test::family_schemas;
    ModelRunner runner(load_config(req), test::plugins());
    load_hf_weights(kGolden / d, runner);
    const Reference ref(kGolden / d);
    HostBatch hb;
    hb.batch = 1;
    hb.seq = 100;
    hb.inputs = ref.ints("input_ids");
    hb.targets.assign(hb.inputs.begin() + 1, hb.inputs.end());
    hb.targets.push_back(-1);  // the last position predicts nothing
    const DeviceBatch batch = runner.upload(hb);
    runner.enable_gradients();
    Graph graph(runner.backend());
    const Tensor loss = runner.loss(graph, batch, 0.f);
    const double want = ref.floats("loss")[0], got = test::to_vector(loss)[0];
    EXPECT_LT(std::fabs(got - want) / want, 1e-5) << got << " vs " << want;
    graph.backward(loss);
    double worst = 0;
    for (auto& p : runner.params()) {
      const Model::HfName hf = runner.model().hf_name(p.name);
      const std::vector<float> g = test::to_vector(p.grad);
      if (p.name.find("router_bias") != std::string::npos) {
        EXPECT_EQ(g, std::vector<float>(g.size(), 0.f)) << p.name;
        continue;
      }
      // transformers' [out, in] matrices (each expert's, when stacked) into mt's [in, out].
      std::vector<std::string> names = hf.stack;
      if (names.empty()) names.push_back(hf.name);
      std::vector<float> w;
      for (const std::string& n : names) {
        std::vector<float> part = ref.floats("grad." + n);
        if (hf.transposed) {
          const int64_t in = p.spec.shape[p.spec.shape.size() - 2], out = p.spec.shape.back();
          std::vector<float> t(part.size());
          for (int64_t r = 0; r < out; ++r)
            for (int64_t c = 0; c < in; ++c)
              t[static_cast<size_t>(c * out + r)] = part[static_cast<size_t>(r * in + c)];
          part = t;
        }
        w.insert(w.end(), part.begin(), part.end());
      }
      ASSERT_EQ(g.size(), w.size()) << p.name;
      const double e = test::scaled_err(g, w);
      EXPECT_LT(e, 1e-4) << "gradient of " << p.name;
      worst = std::max(worst, e);
    }
    std::printf("%s: loss %.7f vs %.7f; worst gradient error %.2e\n", d, got, want, worst);
  }
}

// deepseek3-test, and the same sizes as a V2 without query compression, learn from the shipped
// corpus: the mean loss of the last five of 30 steps is well below the first step's.
TEST(DeepseekTraining, LossFallsOnTheShippedCorpus) {
  Scratch s;
  const std::pair<const char*, const char*> runs[] = {
      {"v3", ""}, {"v2", " decoder_block=deepseek_v2 q_lora_rank=0 norm_topk_prob=false"}};
  for (const auto& [name, extra] : runs) {
    SCOPED_TRACE(name);
    const test::MtResult r = test::run_training(
        "deepseek3-test", test::corpus_options(30, "3e-3") + extra, s.root, name);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<std::string> l = losses(s.root / name);
    ASSERT_EQ(l.size(), 30u) << r.out;
    EXPECT_LT(test::last_five_mean(l), std::stod(l[0]) - 1.0) << r.out;
    const std::string metrics = slurp(s.root / name / "metrics.jsonl");
    EXPECT_NE(metrics.find("\"moe_load_max/1\""), std::string::npos);
  }
}

// 6 steps straight, or 3 then a restart to 6: the losses and the final parameters are bitwise
// identical; the V3 selection bias gets no gradient (it stays at its initial zeros).
TEST(DeepseekTraining, ResumedRunEqualsStraightRun) {
  Scratch s;
  auto run = [&](const std::string& name, int steps) {
    const test::MtResult r = test::run_training(
        "deepseek3-test", test::resume_options(3, 6) + " steps=" + std::to_string(steps), s.root,
        name);
    EXPECT_EQ(r.code, 0) << r.out;
  };
  run("straight", 6);
  run("resumed", 3);
  run("resumed", 6);
  ASSERT_NO_FATAL_FAILURE(test::expect_same_runs(s.root / "straight", s.root / "resumed", 6));
  SafeTensorsFile p(s.root / "straight" / "checkpoints" / "6" / "params.safetensors");
  const auto& bias = p.info("layers.1.router_bias");
  ASSERT_EQ(bias.dtype, "F32");
  std::vector<float> v(static_cast<size_t>(bias.numel()));
  std::memcpy(v.data(), bias.data, bias.nbytes());
  EXPECT_EQ(v, std::vector<float>(8, 0.f));
  const auto& router = p.info("layers.1.router");  // trained through the routing weights
  std::vector<float> w(static_cast<size_t>(router.numel()));
  std::memcpy(w.data(), router.data, router.nbytes());
  EXPECT_NE(w[0], 0.f);
}

// The named configs have DeepSeek's published sizes: V2-Lite 15.7B parameters of which 2.4B
// are active per token, V2 236B (21B active), V3 671B (37B active) plus its 14B multi-token
// prediction module (DeepSeek's count includes that module's own copies of the embedding and
// the head, 2 x 129280 x 7168, which mt shares with the main model; "14B" is rounded, hence
// its wider bound); totals with the embedding
// table, active ones without its lookup (measured: 2.45B, 20.9B, 36.6B; MTP 11.7B). A training
// token's FLOPs include the module's (one MoE layer, the projection and the head).
TEST(DeepseekModel, NamedConfigsHaveThePublishedSizes) {
  struct Case {
    const char* model;
    double total, active, mtp, tol;
  };
  for (const Case c : {Case{"deepseek2-16b", 15.7e9, 2.4e9, 0, 0.06e9},
                       Case{"deepseek2-236b", 236e9, 21e9, 0, 0.5e9},
                       Case{"deepseek3-671b", 671e9, 37e9, 14e9 - 2.0 * 129280 * 7168, 0.6e9}}) {
    SCOPED_TRACE(c.model);
    const std::unique_ptr<Model> m = build_named(c.model);
    const ParamCounts n = count_parameters(*m);
    EXPECT_NEAR(static_cast<double>(n.total - n.mtp), c.total, c.tol);
    EXPECT_NEAR(n.active_matmul, c.active, c.tol);
    EXPECT_NEAR(static_cast<double>(n.mtp), c.mtp, c.tol);
    std::printf("%s: %.4gB parameters (%.4gB of them MTP), %.4gB active, MTP %.4gB per token\n",
                c.model, n.total / 1e9, n.mtp / 1e9, n.active_matmul / 1e9,
                n.mtp_active_matmul / 1e9);
    if (c.mtp > 0) {
      // One depth: a MoE layer's active weights, the [2d, d] projection and the LM head.
      double layer = 0;
      for (const ParamSpec& p : m->layer(m->num_layers() - 1).parameters())
        if (p.matmul) layer += static_cast<double>(shape_numel(p.shape)) * p.active;
      EXPECT_DOUBLE_EQ(n.mtp_active_matmul, layer + 2.0 * 7168 * 7168 + 129280.0 * 7168);
      EXPECT_GT(default_flops_per_token(*m, 4096), 6 * (n.active_matmul + n.mtp_active_matmul));
    }
  }
}

// A token's FLOPs count latent attention's products at their own widths (scores qk_nope +
// qk_rope = 192, values 128), not both at the padded 192: MaxText's
// calculate_mla_tflops_per_device gives 1.6407e10 per token for deepseek2-16b at 4096
// (calculate_tflops_training_per_device, evaluated); before, mt printed 1.675e10 (+2.1%, its
// attention term +20%).
TEST(DeepseekModel, LatentAttentionFlopsAreMaxTexts) {
  const std::unique_ptr<Model> m = build_named("deepseek2-16b");
  const ParamCounts n = count_parameters(*m);
  const double attn = 27 * 3.0 * 4096 * 16 * (128 + 64 + 128);
  EXPECT_NEAR(m->flops_per_token(4096), 6 * n.active_matmul + attn, 1e3);
  EXPECT_NEAR(m->flops_per_token(4096), 1.6407e10, 0.001 * 1.6407e10);
}

// Bad input, each refused before any work with exit code 2 and one paragraph naming it.
TEST(DeepseekBadInput, IsRefusedWithOneClearError) {
  Scratch s;
  const std::string run = "run --model=deepseek3-test steps=1 ";
  expect_refused(run + "kv_lora_rank=100", "kv_lora_rank=100");
  expect_refused(run + "q_lora_rank=65", "q_lora_rank=65");
  expect_refused(run + "n_routing_groups=3", "must divide num_experts=8");
  expect_refused(run + "topk_routing_group=5", "topk_routing_group=5");
  expect_refused(run + "num_experts_per_tok=5 topk_routing_group=2", "num_experts_per_tok=5");
  expect_refused(run + "n_routing_groups=8 topk_routing_group=2", "two best scores");
  expect_refused(run + "qk_rope_head_dim=15", "qk_rope_head_dim=15");
  expect_refused(run + "first_num_dense_layers=4", "first_num_dense_layers=4");
  // config.json: fields mt does not implement, or settings that cannot be.
  struct Edit {
    const char* dir;
    const char* from;
    const char* to;
    const char* says;
  };
  const Edit edits[] = {
      {"deepseek_v2", "\"norm_topk_prob\": false", "\"norm_topk_prob\": true", "norm_topk_prob"},
      {"deepseek_v2", "\"topk_method\": \"group_limited_greedy\"", "\"topk_method\": \"noaux_tc\"",
       "topk_method=noaux_tc"},
      {"deepseek_v3", "\"attention_bias\": false", "\"attention_bias\": true",
       "attention_bias=true"},
      {"deepseek_v3", "\"num_key_value_heads\": 4", "\"num_key_value_heads\": 2",
       "num_key_value_heads=2"},
      {"deepseek_v3", "\"n_group\": 4", "\"n_group\": 3", "n_routing_groups"},
      {"deepseek_v3", "\"kv_lora_rank\": 16", "\"kv_lora_rank\": 48", "kv_lora_rank"},
      {"deepseek_v3", "\"rope_type\": \"yarn\"", "\"rope_type\": \"longrope\"",
       "rope_parameters.rope_type"}};
  for (const Edit& e : edits) {
    SCOPED_TRACE(e.to);
    const fs::path dir = test::with_config(s, kGolden, e.dir, "config.json");
    edit_file(dir / "config.json", e.from, e.to);
    expect_refused("score hf_path=" + dir.string() + " tokens=1,2,3", e.says);
    fs::remove_all(dir);
  }
}

// ---- decode over the compressed latent cache ----------------------------------------------

// A golden directory's model with its transformers weights, in f32.
std::unique_ptr<ModelRunner> golden_runner(const char* dir, const std::string& attention,
                                           const std::vector<std::string>& extra = {}) {
  const HfImport imp = read_hf_config(kGolden / dir, test::plugins());
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "";
  req.overrides = imp.overrides;
  for (const char* o : {"max_target_length=32", "dtype=float32", "weight_dtype=float32"})
    req.overrides.emplace_back(o);
  req.overrides.push_back("attention=" + attention);
  for (const auto& o : extra) req.overrides.push_back(o);
  req.schemas_for = test::family_schemas;
  auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
  load_hf_weights(kGolden / dir, *r);
  return r;
}

std::vector<float> full_forward(ModelRunner& r, const std::vector<int32_t>& ids) {
  HostBatch hb;
  hb.batch = 1;
  hb.seq = static_cast<int64_t>(ids.size());
  hb.inputs = ids;
  const DeviceBatch db = r.upload(hb);
  Graph g(r.backend(), false);
  return test::to_vector(r.forward(g, db));
}

// The cache holds one latent row per token (kv_lora_rank 16 + qk_rope_head_dim 8), and decode
// steps through it (up-projections absorbed, multi-query attention over the latent) give the
// logits of the full forward: three sequences of different prompt lengths, one paused every other
// step, one given a second prompt chunk after its first (T > 1 tokens attending to a cache);
// both attention kernels, V2 (no query compression) and V3 (q_lora_rank 24), yarn's mscale on the
// scale. The absorbed W_uk and W_uv are made at the first step and kept by the decoder
// (KVCache::derived) for the later ones. The same with mla_naive_kvcache=true: the cache holds
// every head's expanded key and value (4 heads, padded to max(8 + 8, 12) = 16 features).
// Measured worst errors: 7e-7 to 1.1e-6 (the prompts vary with the test seed).
TEST(DeepseekDecode, AbsorbedLatentDecodeEqualsFullForward) {
  for (const char* d : kDirs) {
    for (const char* attention : {"dot_product", "flash"}) {
      for (const bool naive : {false, true}) {
        SCOPED_TRACE(std::string(d) + " " + attention + (naive ? " naive cache" : ""));
        const auto r = golden_runner(
            d, attention, {std::string("mla_naive_kvcache=") + (naive ? "true" : "false")});
        const CacheSpec want =
            naive ? CacheSpec{0, {{4, 16}, {4, 16}}} : CacheSpec{0, {{1, 16 + 8}}};
        for (const CacheSpec& cs : r->cache_specs()) EXPECT_EQ(cs, want);
        const int64_t V = r->model().dims().vocab_size;
        std::mt19937_64 rng(test::seed());
        std::vector<std::vector<int32_t>> seqs(3);
        const int prompt_len[3] = {1, 5, 9};
        Decoder dec(*r, 3, 24);
        double worst = 0;
        auto check = [&](const std::vector<float>& got, const std::vector<float>& want,
                         const std::string& what) {
          const double e = test::scaled_err(got, want);
          EXPECT_LT(e, kTol) << what;
          worst = std::max(worst, e);
        };
        std::vector<int32_t> next(3);
        for (int b = 0; b < 3; ++b) {
          for (int i = 0; i < prompt_len[b]; ++i)
            seqs[b].push_back(static_cast<int32_t>(rng() % V));
          check(dec.prefill(b, seqs[b]), full_forward(*r, seqs[b]), "prefill " + std::to_string(b));
          next[b] = static_cast<int32_t>(rng() % V);
        }
        // A second chunk of 3 tokens for sequence 2: they attend to the cache and each other.
        std::vector<int32_t> chunk(3);
        for (auto& id : chunk) id = static_cast<int32_t>(rng() % V);
        const std::vector<float> cl = dec.prefill(2, chunk);
        seqs[2].insert(seqs[2].end(), chunk.begin(), chunk.end());
        const std::vector<float> cref = full_forward(*r, seqs[2]);
        check(cl, std::vector<float>(cref.end() - 3 * V, cref.end()), "second chunk");
        for (int step = 0; step < 8; ++step) {
          const std::vector<bool> active = {true, step % 2 == 0, true};
          const std::vector<float> logits = dec.step(next, active);
          for (int b = 0; b < 3; ++b) {
            if (!active[static_cast<size_t>(b)]) continue;
            seqs[b].push_back(next[b]);
            const std::vector<float> ref = full_forward(*r, seqs[b]);
            check(std::vector<float>(logits.begin() + b * V, logits.begin() + (b + 1) * V),
                  std::vector<float>(ref.end() - V, ref.end()),
                  "step " + std::to_string(step) + " sequence " + std::to_string(b));
            next[b] = static_cast<int32_t>(rng() % V);
          }
        }
        std::printf("%s %s: %s decode vs full forward, worst error %.2e\n", d, attention,
                    naive ? "naive-cache" : "absorbed", worst);
      }
    }
  }
}

// Cache bytes per token: kv_lora_rank + qk_rope_head_dim values per layer, against the
// per-head k [H, nope + rope] and v [H, v_head_dim] of a plain multi-head cache. V3 in bf16:
// 61 x 576 x 2 = 70272 bytes per token, against 61 x 128 x 320 x 2 = 4997120 (71x).
TEST(DeepseekDecode, CacheHoldsTheLatentOnly) {
  struct Case {
    const char* model;
    int64_t layers, heads, latent, rope, nope, v;
  };
  for (const Case c : {Case{"deepseek3-test", 3, 4, 32, 16, 16, 24},
                       Case{"deepseek2-16b", 27, 16, 512, 64, 128, 128},
                       Case{"deepseek3-671b", 61, 128, 512, 64, 128, 128}}) {
    SCOPED_TRACE(c.model);
    const std::unique_ptr<Model> m = build_named(c.model);
    ASSERT_EQ(m->num_layers(), c.layers);
    int64_t latent = 0;
    for (int i = 0; i < m->num_layers(); ++i) {
      const CacheSpec cs = m->layer(i).cache_spec();
      EXPECT_EQ(cs, (CacheSpec{0, {{1, c.latent + c.rope}}})) << "layer " << i;
      for (const Shape& e : cs.entries) latent += shape_numel(e);
    }
    const int64_t bf16 = static_cast<int64_t>(dtype_size(DType::bf16));
    const int64_t per_head = c.layers * c.heads * (c.nope + c.rope + c.v);
    EXPECT_EQ(latent, c.layers * (c.latent + c.rope));
    std::printf("%s: cache bytes per token (bf16) %lld latent vs %lld per-head k and v (%.1fx)\n",
                c.model, static_cast<long long>(latent * bf16),
                static_cast<long long>(per_head * bf16),
                static_cast<double>(per_head) / static_cast<double>(latent));
  }
}

// deepseek3-test in f32 with `overrides`, its parameters initialised (seed 7), for training.
std::unique_ptr<ModelRunner> named_training_runner(const std::vector<std::string>& overrides) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "deepseek3-test";
  req.overrides = {"dtype=float32", "weight_dtype=float32"};
  for (const auto& o : overrides) req.overrides.push_back(o);
  req.schemas_for = test::family_schemas;
  auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
  r->init_parameters(7);
  r->enable_gradients();
  r->zero_gradients();
  return r;
}

// Central differences of `objective` against the backward's gradients (already in each param's
// grad) at the 3 elements of largest gradient of each named parameter (a tiny one is all
// rounding in a difference), each moved by step(its value) either way. Returns how many.
int check_largest_gradients(ModelRunner& r, const std::vector<std::string>& names,
                            const std::function<double()>& objective,
                            const std::function<float(float)>& step) {
  int checked = 0;
  for (const std::string& name : names) {
    Param* p = r.find(name);
    EXPECT_NE(p, nullptr) << name;
    if (!p) continue;
    std::vector<float> w = test::to_vector(p->value);
    const std::vector<float> grad = test::to_vector(p->grad);
    std::vector<size_t> order(w.size());
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + 3, order.end(),
                      [&](size_t a, size_t b) { return std::fabs(grad[a]) > std::fabs(grad[b]); });
    for (int j = 0; j < 3; ++j) {
      const size_t i = order[static_cast<size_t>(j)];
      const float orig = w[i], hi = orig + step(orig), lo = orig - step(orig);
      w[i] = hi;
      r.backend().copy_from_host(p->value, w.data());
      const double up = objective();
      w[i] = lo;
      r.backend().copy_from_host(p->value, w.data());
      const double down = objective();
      w[i] = orig;
      r.backend().copy_from_host(p->value, w.data());
      const double fd = (up - down) / (static_cast<double>(hi) - static_cast<double>(lo));
      EXPECT_NEAR(fd, grad[i], 2e-2 * std::fabs(grad[i]) + 1e-4) << name << "[" << i << "]";
      ++checked;
    }
  }
  return checked;
}

// V3's aux-loss-free balancing, through ModelRunner as the trainer drives it: two micro-batches
// (2 x 32 tokens, top 2 of 8 experts: 128 token-slots each) are run forward and backward; each
// MoE layer reports its experts' loads (the biased choice), summed over the micro-batches, each
// micro-batch's least and most loaded expert those of the moe_load_min/max metrics (counted by
// sort_by_expert), the re-run of remat_policy=full not counted (the same sums as without remat,
// unchanged by the backward). The bias has no gradient, and AdamW (lr 1, adam_weight_decay 0.1
// where the spec asks for decay) leaves it as it was; after_step then adds rate x sign(mean -
// load) to it, exactly; with rate 0 it stays as it was.
TEST(DeepseekTraining, RouterBiasUpdateFollowsTheStepsLoads) {
  const float rate = 0.01f;
  std::vector<LayerStats> by_policy[2];
  int pi = 0;
  for (const char* policy : {"none", "full"}) {
    SCOPED_TRACE(policy);
    for (const float r : {rate, 0.f}) {
      const auto runner = named_training_runner(
          {std::string("remat_policy=") + policy, "routed_bias_update_rate=" + std::to_string(r)});
      Backend& be = runner->backend();
      // A nonzero starting bias, different per expert and layer.
      std::vector<std::vector<float>> bias0;
      for (const char* name : {"layers.1.router_bias", "layers.2.router_bias"}) {
        Param* p = runner->find(name);
        ASSERT_NE(p, nullptr) << name;
        std::vector<float> b(8);
        for (size_t e = 0; e < b.size(); ++e)
          b[e] = 0.003f * static_cast<float>(e) - 0.01f * static_cast<float>(bias0.size());
        be.copy_from_host(p->value, b.data());
        bias0.push_back(b);
      }
      std::mt19937_64 rng(11);
      std::vector<LayerStats> stats, before;
      for (int micro = 0; micro < 2; ++micro) {
        HostBatch hb;
        hb.batch = 2;
        hb.seq = 32;
        for (int i = 0; i < 64; ++i) {
          hb.inputs.push_back(static_cast<int32_t>(rng() % 256));
          hb.targets.push_back(static_cast<int32_t>(rng() % 256));
        }
        const DeviceBatch db = runner->upload(hb);
        Graph g(be);
        std::map<std::string, double> aux;
        const Tensor l = runner->loss(g, db, 0.f, 0.5, &aux, &stats);
        const std::vector<LayerStats> after_forward = stats;
        g.backward(l);
        EXPECT_EQ(stats, after_forward) << "the backward (remat's re-run) changed the statistics";
        ASSERT_EQ(stats.size(), 3u);
        EXPECT_TRUE(stats[0].empty()) << "the dense layer reports no loads";
        for (int layer = 1; layer < 3; ++layer) {
          SCOPED_TRACE(layer);
          const auto it = stats[layer].find("expert_load");
          ASSERT_NE(it, stats[layer].end());
          ASSERT_EQ(it->second.size(), 8u);
          std::vector<double> mine = it->second;
          if (micro == 1)
            for (size_t e = 0; e < 8; ++e) mine[e] -= before[layer].at("expert_load")[e];
          double total = 0;
          for (double x : mine) total += x;
          EXPECT_EQ(total, 128.0);
          const std::string tag = "/" + std::to_string(layer);
          // aux values are times the weight scale 0.5.
          EXPECT_NEAR(*std::min_element(mine.begin(), mine.end()) / 128.0,
                      2 * aux.at("moe_load_min" + tag), 1e-7);
          EXPECT_NEAR(*std::max_element(mine.begin(), mine.end()) / 128.0,
                      2 * aux.at("moe_load_max" + tag), 1e-7);
        }
        before = stats;
      }
      runner->finish_gradients();
      AdamWParams adam;
      adam.lr = 1.f;
      for (auto& p : runner->params()) {
        if (p.name.find("router_bias") != std::string::npos) {
          EXPECT_EQ(test::to_vector(p.grad), std::vector<float>(8, 0.f)) << p.name;
          EXPECT_FALSE(p.spec.weight_decay) << p.name;
        }
        adam.weight_decay = p.spec.weight_decay ? 0.1f : 0.f;
        Tensor m = be.zeros(p.spec.shape, DType::f32), v = be.zeros(p.spec.shape, DType::f32);
        be.adamw_update(p.value, p.grad, m, v, adam);
      }
      for (int layer = 1; layer < 3; ++layer)
        EXPECT_EQ(test::to_vector(
                      runner->find("layers." + std::to_string(layer) + ".router_bias")->value),
                  bias0[layer - 1])
            << "AdamW moved the bias of layer " << layer;
      runner->after_step(stats);
      for (int layer = 1; layer < 3; ++layer) {
        SCOPED_TRACE(layer);
        const std::vector<double>& load = stats[layer].at("expert_load");
        const double mean = 256.0 / 8;
        std::vector<float> want = bias0[layer - 1];
        int moved = 0;
        for (size_t e = 0; e < 8; ++e) {
          const float sign = load[e] < mean ? 1.f : load[e] > mean ? -1.f : 0.f;
          want[e] += r * sign;
          moved += sign != 0.f;
        }
        EXPECT_GT(moved, 0);
        EXPECT_EQ(test::to_vector(
                      runner->find("layers." + std::to_string(layer) + ".router_bias")->value),
                  want);
        if (r == 0.f) {
          EXPECT_EQ(want, bias0[layer - 1]);
        }
      }
      if (r != 0.f) by_policy[pi] = stats;
    }
    ++pi;
  }
  EXPECT_EQ(by_policy[0], by_policy[1]) << "remat_policy=full counted other loads than none";
}

// Through mt run: one step with routed_bias_update_rate=0.01 moves each MoE layer's bias from
// its zeros to exactly +-0.01 or 0, some experts up and some down; 6 steps straight or 3 then a
// restart to 6 with the update on stay bitwise identical (the bias is in the checkpoint); V2,
// which has no bias, refuses the key.
TEST(DeepseekTraining, RouterBiasUpdateThroughTraining) {
  Scratch s;
  const std::string on = " routed_bias_update_rate=0.01";
  auto bias_of = [](const fs::path& run, int step, int layer) {
    SafeTensorsFile p(run / "checkpoints" / std::to_string(step) / "params.safetensors");
    const auto& b = p.info("layers." + std::to_string(layer) + ".router_bias");
    std::vector<float> v(static_cast<size_t>(b.numel()));
    std::memcpy(v.data(), b.data, b.nbytes());
    return v;
  };
  {
    const test::MtResult r = test::run_training(
        "deepseek3-test", test::resume_options(1, 1) + " steps=1" + on, s.root, "one");
    ASSERT_EQ(r.code, 0) << r.out;
    for (int layer = 1; layer < 3; ++layer) {
      int up = 0, down = 0;
      for (const float b : bias_of(s.root / "one", 1, layer)) {
        EXPECT_TRUE(b == 0.f || b == 0.01f || b == -0.01f) << b;
        up += b > 0;
        down += b < 0;
      }
      EXPECT_GT(up, 0) << "layer " << layer;
      EXPECT_GT(down, 0) << "layer " << layer;
    }
  }
  ASSERT_NO_FATAL_FAILURE(test::expect_resumed_equals_straight("deepseek3-test", on, s.root));
  EXPECT_EQ(bias_of(s.root / "straight", 6, 1), bias_of(s.root / "resumed", 6, 1));
  EXPECT_NE(bias_of(s.root / "straight", 6, 1), std::vector<float>(8, 0.f));
  expect_refused("run --model=deepseek3-test steps=1 decoder_block=deepseek_v2" + on,
                 "routed_bias_update_rate");
}

// ---- multi-token prediction (mtp_num_layers) -----------------------------------------------

// A golden directory's model (f32, load balancing off) with `overrides`, its parameters first
// initialised (seed 3: what the Hugging Face weights leave, the MTP modules) and then loaded.
std::unique_ptr<ModelRunner> golden_mtp_runner(const std::vector<std::string>& overrides) {
  const HfImport imp = read_hf_config(kGolden / "deepseek_v3", test::plugins());
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "";
  req.overrides = imp.overrides;
  for (const char* o : {"max_target_length=100", "dtype=float32", "weight_dtype=float32",
                        "load_balance_loss_weight=0"})
    req.overrides.emplace_back(o);
  for (const auto& o : overrides) req.overrides.push_back(o);
  req.schemas_for = test::family_schemas;
  auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
  r->init_parameters(3);
  load_hf_weights(kGolden / "deepseek_v3", *r);
  return r;
}

// ids [1, T] with next-token targets (the last predicts nothing).
HostBatch next_token_batch(const std::vector<int32_t>& ids) {
  HostBatch hb;
  hb.batch = 1;
  hb.seq = static_cast<int64_t>(ids.size());
  hb.inputs = ids;
  hb.targets.assign(ids.begin() + 1, ids.end());
  hb.targets.push_back(-1);
  return hb;
}

std::vector<float> file_floats(const SafeTensorsFile& f, const std::string& name) {
  const SafeTensorInfo& t = f.info(name);
  EXPECT_EQ(t.dtype, "F32") << name;
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data, t.nbytes());
  return v;
}

// Two MTP depths (scale 0.3) on the golden V3 model, their weights (a MoE layer each, random
// e_score_correction_bias) and the reference losses and gradients from tools/make_mtp_golden.py,
// which builds the modules in PyTorch around transformers' own DeepseekV3DecoderLayer. mt's
// main loss, each depth's cross-entropy, the objective and every MTP weight's gradient agree
// (relative 1e-4). Measured: see the printed line.
TEST(DeepseekMtp, LossesAndGradientsMatchTheReference) {
  const SafeTensorsFile ref(kGolden / "deepseek_v3" / "mtp.safetensors");
  auto r = golden_mtp_runner({"mtp_num_layers=2", "mtp_loss_scaling_factor=0.3"});
  size_t loaded = 0;
  for (auto& p : r->params()) {
    if (p.name.rfind("mtp.", 0) != 0) continue;
    const std::vector<float> v = file_floats(ref, p.name);
    ASSERT_EQ(static_cast<int64_t>(v.size()), p.value.numel()) << p.name;
    r->backend().copy_from_host(p.value, v.data());
    ++loaded;
  }
  EXPECT_GT(loaded, 20u);
  std::vector<int32_t> ids(100);
  {
    const SafeTensorInfo& t = ref.info("input_ids");
    std::memcpy(ids.data(), t.data, t.nbytes());
  }
  const DeviceBatch batch = r->upload(next_token_batch(ids));
  const std::vector<float> want_ce = file_floats(ref, "mtp_loss");
  const double want_main = file_floats(ref, "loss")[0];
  {
    Graph g(r->backend(), false);  // evaluation: no MTP
    const double main = test::to_vector(r->loss(g, batch, 0.f))[0];
    EXPECT_LT(std::fabs(main - want_main) / want_main, 1e-4) << main << " vs " << want_main;
  }
  r->enable_gradients();
  r->zero_gradients();
  Graph g(r->backend());
  std::map<std::string, double> aux;
  const Tensor total = r->loss(g, batch, 0.f, 1.0, &aux);
  double worst = 0;
  for (int k = 1; k <= 2; ++k) {
    const double got = aux.at("mtp_loss/" + std::to_string(k)), want = want_ce[k - 1];
    EXPECT_LT(std::fabs(got - want) / want, 1e-4) << "depth " << k << ": " << got << " vs " << want;
    worst = std::max(worst, std::fabs(got - want) / want);
  }
  const double want_mtp = 0.3 / 2 * (want_ce[0] + want_ce[1]);
  EXPECT_LT(std::fabs(aux.at("mtp_loss") - want_mtp) / want_mtp, 1e-4);
  const double got_total = test::to_vector(total)[0];
  EXPECT_LT(std::fabs(got_total - (want_main + want_mtp)) / (want_main + want_mtp), 1e-4);
  g.backward(total);
  r->finish_gradients();
  double worst_grad = 0;
  for (auto& p : r->params()) {
    if (p.name.rfind("mtp.", 0) != 0) continue;
    const std::vector<float> got = test::to_vector(p.grad);
    if (p.name.find("router_bias") != std::string::npos) {
      EXPECT_EQ(got, std::vector<float>(got.size(), 0.f)) << p.name;
      continue;
    }
    const double e = test::scaled_err(got, file_floats(ref, "grad." + p.name));
    EXPECT_LT(e, 1e-4) << "gradient of " << p.name;
    worst_grad = std::max(worst_grad, e);
  }
  std::printf("mtp: CE %.7f %.7f vs %.7f %.7f; worst loss error %.2e, gradient %.2e\n",
              aux.at("mtp_loss/1"), aux.at("mtp_loss/2"), want_ce[0], want_ce[1], worst,
              worst_grad);
}

// Upload's shifted batches: depth k reads position i + k's token and target, -1 past the end and
// across a packed document's boundary.
TEST(DeepseekMtp, ShiftedTargetsStopAtTheSequenceAndDocumentEnds) {
  auto r = named_training_runner({"mtp_num_layers=2"});
  HostBatch hb;
  hb.batch = 1;
  hb.seq = 6;
  hb.inputs = {10, 11, 12, 20, 21, 22};
  hb.targets = {11, 12, -1, 21, 22, -1};
  hb.positions = {0, 1, 2, 0, 1, 2};
  hb.segment_ids = {1, 1, 1, 2, 2, 2};
  const DeviceBatch d = r->upload(hb);
  ASSERT_EQ(d.mtp.size(), 2u);
  auto ints = [&](const Tensor& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    r->backend().copy_to_host(t, v.data());
    return v;
  };
  EXPECT_EQ(ints(d.mtp[0].inputs), (std::vector<int32_t>{11, 12, 20, 21, 22, 0}));
  EXPECT_EQ(ints(d.mtp[0].targets), (std::vector<int32_t>{12, -1, -1, 22, -1, -1}));
  EXPECT_EQ(ints(d.mtp[0].positions), (std::vector<int32_t>{1, 2, 0, 1, 2, 0}));
  EXPECT_EQ(d.mtp[0].valid_targets, 2);
  EXPECT_EQ(ints(d.mtp[1].targets), (std::vector<int32_t>{-1, -1, -1, -1, -1, -1}));
  EXPECT_EQ(d.mtp[1].valid_targets, 0);
}

// V3's load-balancing loss is on the sigmoid scores normalised over the experts (DeepSeek-V3's
// s' = s / sum s): near-uniform routing at initialisation gives about num_experts_per_tok (2),
// where the raw sigmoids gave about k E / 2 = 8 (8.43 measured) and a gradient pushing every
// routed logit down. Central differences of the objective with the loss at weight 1 against the
// backward through the normalisation, on both MoE layers' routers.
TEST(DeepseekTraining, LoadBalanceLossIsOnNormalisedScores) {
  auto r = named_training_runner({"load_balance_loss_weight=1", "max_target_length=16",
                                  "per_device_batch_size=2", "routed_bias_update_rate=0"});
  std::vector<int32_t> ids;
  std::mt19937 rng(3);
  for (int i = 0; i < 32; ++i) ids.push_back(static_cast<int32_t>(rng() % 256));
  HostBatch hb;
  hb.batch = 2;
  hb.seq = 16;
  for (int i = 0; i < 32; ++i) {
    hb.inputs.push_back(ids[static_cast<size_t>(i)]);
    hb.targets.push_back(ids[static_cast<size_t>((i + 1) % 32)]);
  }
  const DeviceBatch batch = r->upload(hb);
  auto objective = [&](std::map<std::string, double>* aux) {
    Graph g(r->backend(), false);
    std::map<std::string, double> local;
    return static_cast<double>(test::to_vector(r->loss(g, batch, 0.f, 1.0, aux ? aux : &local))[0]);
  };
  std::map<std::string, double> aux;
  objective(&aux);
  ASSERT_TRUE(aux.count("moe_lb_loss"));
  EXPECT_GT(aux.at("moe_lb_loss"), 1.5);
  EXPECT_LT(aux.at("moe_lb_loss"), 3.0);
  {
    Graph g(r->backend());
    std::map<std::string, double> a;
    g.backward(r->loss(g, batch, 0.f, 1.0, &a));
    r->finish_gradients();
  }
  EXPECT_EQ(check_largest_gradients(
                *r, {"layers.1.router", "layers.2.router"}, [&] { return objective(nullptr); },
                [](float) { return 1e-3f; }),
            6);
}

// Central differences of the training objective (main loss + 1 x the MTP term, load balancing
// off) against the backward, on deepseek3-test's tiny sizes: elements of each MTP weight kind
// (norms, projection, the layer's attention, router, experts, shared expert) and of the shared
// final norm and head, which the MTP path also reaches. Not the embedding: moving one of its
// rows moves the main model's MoE routing across a tie (a jump the difference sees, with or
// without MTP); the golden test checks the path from the embedding through MTP's gradients.
TEST(DeepseekMtp, GradientsMatchFiniteDifferences) {
  auto r = named_training_runner({"mtp_num_layers=1", "mtp_loss_scaling_factor=1",
                                  "load_balance_loss_weight=0", "max_target_length=12",
                                  "per_device_batch_size=1"});
  std::vector<int32_t> ids;
  std::mt19937 rng(5);
  for (int i = 0; i < 12; ++i) ids.push_back(static_cast<int32_t>(rng() % 256));
  const DeviceBatch batch = r->upload(next_token_batch(ids));
  auto objective = [&] {
    Graph g(r->backend(), false);
    std::map<std::string, double> aux;
    return static_cast<double>(test::to_vector(r->loss(g, batch, 0.f, 1.0, &aux))[0]);
  };
  {
    Graph g(r->backend());
    std::map<std::string, double> aux;
    const Tensor l = r->loss(g, batch, 0.f, 1.0, &aux);
    EXPECT_GT(aux.at("mtp_loss"), 0.0);
    g.backward(l);
    r->finish_gradients();
  }
  const std::vector<std::string> names = {"mtp.1.mtp_projection",
                                          "mtp.1.mtp_embedding_norm",
                                          "mtp.1.mtp_hidden_norm",
                                          "mtp.1.wq_b",
                                          "mtp.1.wkv_a",
                                          "mtp.1.wo",
                                          "mtp.1.router",
                                          "mtp.1.w_gate",
                                          "mtp.1.w_down",
                                          "mtp.1.shared_w_up",
                                          "final_norm",
                                          "lm_head"};
  EXPECT_EQ(check_largest_gradients(*r, names, objective,
                                    [](float w) { return 1e-2f * std::max(1.f, std::fabs(w)); }),
            36);
}

// Decode and scoring never run the MTP modules: with mtp_num_layers=1 the golden model's logits
// and its evaluation loss are bit for bit those without, and decode's caches are the decoder's.
TEST(DeepseekMtp, ForwardAndEvaluationIgnoreTheModules) {
  auto plain = golden_mtp_runner({});
  auto with = golden_mtp_runner({"mtp_num_layers=1"});
  EXPECT_GT(with->params().size(), plain->params().size());
  EXPECT_EQ(with->cache_specs(), plain->cache_specs());
  const std::vector<int32_t> ids = Reference(kGolden / "deepseek_v3").ints("input_ids");
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 40);
  EXPECT_EQ(full_forward(*with, head), full_forward(*plain, head));
  const DeviceBatch a = plain->upload(next_token_batch(ids));
  const DeviceBatch b = with->upload(next_token_batch(ids));
  Graph ga(plain->backend(), false), gb(with->backend(), false);
  EXPECT_EQ(test::to_vector(plain->loss(ga, a, 0.f)), test::to_vector(with->loss(gb, b, 0.f)));
}

// Training with one MTP depth: the objective's MTP term is logged (mtp_loss, mtp_loss/1), the
// modules are checkpointed, and 3 steps then a restart to 6 equal 6 straight steps bitwise.
TEST(DeepseekMtp, TrainsAndResumesBitwise) {
  Scratch s;
  const std::string on = " mtp_num_layers=1";
  ASSERT_NO_FATAL_FAILURE(test::expect_resumed_equals_straight("deepseek3-test", on, s.root));
  const std::string metrics = slurp(s.root / "straight" / "metrics.jsonl");
  EXPECT_NE(metrics.find("\"mtp_loss\""), std::string::npos);
  EXPECT_NE(metrics.find("\"mtp_loss/1\""), std::string::npos);
  SafeTensorsFile p(s.root / "straight" / "checkpoints" / "6" / "params.safetensors");
  EXPECT_EQ(p.info("mtp.1.mtp_projection").shape, (Shape{128, 64}));
  EXPECT_EQ(p.info("mtp.1.w_gate").shape, (Shape{8, 64, 32}));
}

// Gradient accumulation gives the step one batch's MTP loss: each depth's mean over the step's
// targets of that depth, which rows of unequal length (packing=false) give unequal shares of.
// Before, each micro-batch's MTP mean was weighted by its share of the main loss's targets:
// 2.6e-4 off at step 1 on these rows.
TEST(DeepseekMtp, AccumulationGivesTheLargerBatchsMtpLoss) {
  Scratch s;
  // Documents of 3 to 40 words, tokenized with the shipped tokenizer: rows of 32 positions hold
  // from a few targets to 32.
  {
    std::ofstream f(s.root / "docs.jsonl");
    for (int d = 0; d < 24; ++d) {
      std::string text;
      for (int w = 0; w < 3 + (d * 7) % 38; ++w) {
        text += w ? " word" : "word";
        text += std::to_string(w % 9);
      }
      f << "{\"text\": \"" << text << "\"}\n";
    }
  }
  auto r = test::run_mt("tokenize tokenizer_path=" + test::source_dir() +
                        "/data/tokenizer.json input=" + (s.root / "docs.jsonl").string() +
                        " output=" + (s.root / "docs.tokens").string());
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string common =
      "run --model=deepseek3-test vocab_size=8192 dataset_type=tokens dataset_path=" +
      (s.root / "docs.tokens").string() +
      " packing=false max_target_length=32 steps=2 eval_split=0 "
      "eval_interval=-1 enable_checkpointing=false mtp_num_layers=2 num_threads=1 "
      "base_output_directory=" +
      s.root.string();
  r = test::run_mt(common + " run_name=one per_device_batch_size=4", 120);
  ASSERT_EQ(r.code, 0) << r.out;
  r = test::run_mt(common + " run_name=four per_device_batch_size=1 gradient_accumulation_steps=4",
                   120);
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string one = slurp(s.root / "one" / "metrics.jsonl"),
                    four = slurp(s.root / "four" / "metrics.jsonl");
  auto field = [](const std::string& text, const std::string& key, size_t line) {
    size_t at = 0;
    for (size_t i = 0; i < line; ++i) at = text.find('\n', at) + 1;
    const size_t k = text.find("\"" + key + "\": ", at);
    return k == std::string::npos ? NAN : std::stod(text.substr(k + key.size() + 4));
  };
  for (size_t line = 0; line < 2; ++line)
    for (const char* key : {"loss", "mtp_loss", "mtp_loss/1", "mtp_loss/2"}) {
      const double a = field(one, key, line), b = field(four, key, line);
      ASSERT_TRUE(std::isfinite(a)) << key << "\n" << one;
      EXPECT_NEAR(b, a, 2e-6 * std::fabs(a)) << key << " at step " << line + 1;
    }
}

// `mt convert --from=hf ... mtp_num_layers=1`: transformers' checkpoints hold no MTP modules,
// so they are initialised as `mt run` initialises them (init_weights_seed), the rest is the
// Hugging Face weights: the checkpoint equals golden_mtp_runner's (initialised with seed 3, then
// loaded) parameter for parameter. model.yml keeps mtp_num_layers, so the checkpoint converts
// back with it (the modules left out of config.json and the safetensors).
TEST(DeepseekMtp, ConvertFromHuggingFaceInitialisesTheModules) {
  Scratch s;
  const fs::path out = s.root / "mt", back = s.root / "hf";
  test::MtResult r =
      test::run_mt("convert --from=hf --input=" + (kGolden / "deepseek_v3").string() +
                       " --output=" + out.string() + " mtp_num_layers=1 init_weights_seed=3",
                   120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("multi-token prediction parameters (mtp.*) have no Hugging Face form"),
            std::string::npos)
      << r.out;
  EXPECT_NE(slurp(out / "model.yml").find("\nmtp_num_layers: 1\n"), std::string::npos);
  const auto want = golden_mtp_runner({"mtp_num_layers=1"});
  SafeTensorsFile ck(out / "checkpoints" / "0" / "params.safetensors");
  size_t mtp = 0;
  for (auto& p : want->params()) {
    SCOPED_TRACE(p.name);
    const std::vector<float> v = file_floats(ck, p.name);
    EXPECT_EQ(v, test::to_vector(p.value));
    if (p.name.rfind("mtp.", 0) != 0) continue;
    ++mtp;
    if (p.spec.init == Init::normal) {
      EXPECT_GT(*std::max_element(v.begin(), v.end()), 0.f);
    }
  }
  EXPECT_GT(mtp, 10u);
  r = test::run_mt("convert --to=hf --config=" + (out / "model.yml").string() +
                       " --input=" + out.string() + " --output=" + back.string(),
                   120);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(SafeTensorsFile(back / "model.safetensors").names(),
            SafeTensorsFile(kGolden / "deepseek_v3" / "model.safetensors").names());
}

TEST(DeepseekMtp, BadInputIsRefusedWithOneClearError) {
  Scratch s;
  const std::string run = "run --model=deepseek3-test steps=1 ";
  expect_refused(run + "mtp_num_layers=-1", "mtp_num_layers");
  expect_refused(run + "mtp_loss_scaling_factor=-0.5", "mtp_loss_scaling_factor");
  expect_refused(run + "decoder_block=deepseek_v2 mtp_num_layers=1",
                 "multi-token prediction is DeepSeek-V3's");
  // Depths past the sequence have no target (before: accepted, their losses 0 in the mean).
  expect_refused(run + "max_target_length=8 mtp_num_layers=8", "must be below max_target_length=8");
}

}  // namespace
}  // namespace mt
