// The Qwen families (plugins/models/qwen3: qwen3, qwen3_moe): tiny random models that
// transformers 5 saved (tests/golden/qwen3_{tied,untied,moe}, made by tools/make_qwen_golden.py)
// scored and greedily decoded through the mt CLI as users run it, in both config.json forms;
// the export back to Hugging Face; training on the shipped corpus and resuming; FLOPs of the
// active experts; and bad input refused with exit code 2.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config_loader.h"
#include "family_test_support.h"
#include "model_info.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "safetensors.h"
#include "test_support.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

const fs::path kGolden = fs::path(test::source_dir()) / "tests" / "golden";
const char* const kDirs[] = {"qwen3_tied", "qwen3_untied", "qwen3_moe", "qwen2"};

// max |mt - transformers| / max |transformers| over all logits. Measured: 2.5e-7 (qwen3 tied,
// largest logit 38), 4.4e-7 (qwen3 untied, 3.8), 4.7e-7 (qwen3_moe, 4.2; 4.7e-7 with
// norm_topk_prob=false), 3.9e-7 (qwen2, 32).
constexpr double kTol = 1e-4;

using test::build_named;
using test::edit_file;
using test::expect_refused;
using test::losses;
using test::Reference;
using test::score;
using test::Scratch;
using test::slurp;

// What the golden directories are: transformers 5's config.json (rope_parameters; Qwen3-MoE's
// expert count under num_local_experts), the legacy form beside it, Qwen3's head_dim other than
// hidden / heads and q/k norms, Qwen2's q/k/v biases, and the experts saved per expert
// (save_pretrained's default).
TEST(QwenGolden, TheDirectoriesAreWhatTransformersFiveWrote) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const bool qwen2 = std::string(d) == "qwen2";
    std::ifstream f(kGolden / d / "config.json"), l(kGolden / d / "legacy_config.json");
    std::string v5((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::string legacy((std::istreambuf_iterator<char>(l)), std::istreambuf_iterator<char>());
    EXPECT_NE(v5.find("\"rope_parameters\""), std::string::npos);
    EXPECT_NE(v5.find("\"transformers_version\": \"5."), std::string::npos);
    EXPECT_EQ(legacy.find("\"rope_parameters\""), std::string::npos);
    EXPECT_NE(legacy.find("\"rope_theta\": 1000000.0"), std::string::npos);
    EXPECT_EQ(v5.find("\"head_dim\": 16") != std::string::npos, !qwen2);
    EXPECT_NE(v5.find("\"hidden_size\": 32"), std::string::npos);
    SafeTensorsFile w(kGolden / d / "model.safetensors");
    bool has_q_norm = false, has_q_bias = false;
    for (const auto& n : w.names()) {
      has_q_norm |= n == "model.layers.0.self_attn.q_norm.weight";
      has_q_bias |= n == "model.layers.0.self_attn.q_proj.bias";
    }
    EXPECT_EQ(has_q_norm, !qwen2);
    EXPECT_EQ(has_q_bias, qwen2);
    const bool tied = std::string(d) == "qwen3_tied" || qwen2;
    EXPECT_EQ(v5.find("\"tie_word_embeddings\": true") != std::string::npos, tied);
    bool has_head = false;
    for (const auto& n : w.names()) has_head |= n == "lm_head.weight";
    EXPECT_EQ(has_head, !tied);
  }
  std::ifstream f(kGolden / "qwen3_moe" / "config.json");
  std::string v5((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  EXPECT_NE(v5.find("\"num_local_experts\": 8"), std::string::npos);
  EXPECT_NE(v5.find("\"norm_topk_prob\": true"), std::string::npos);
  SafeTensorsFile w(kGolden / "qwen3_moe" / "model.safetensors");
  EXPECT_NO_THROW(w.info("model.layers.2.mlp.experts.7.down_proj.weight"));
  EXPECT_NO_THROW(w.info("model.layers.1.mlp.gate_proj.weight"));  // mlp_only_layers=[1]
}

// Every model scores the 100 tokens as transformers did, from config.json in the transformers 5
// form and in the legacy one (the same computation: equal logits), with every field understood.
TEST(QwenGolden, LogitsMatchTransformersInBothConfigForms) {
  Scratch s;
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    ASSERT_NO_FATAL_FAILURE(test::expect_logits_in_both_forms(s, kGolden, d, kTol));
  }
}

// norm_topk_prob=false (the same weights): the top-k weights are the router's softmax
// probabilities as they are; the logits move far more than the tolerance, and match.
TEST(QwenGolden, NormTopkProbFalseMatchesTransformers) {
  Scratch s;
  const Reference ref(kGolden / "qwen3_moe");
  std::string out;
  const std::vector<float> got =
      score(test::with_config(s, kGolden, "qwen3_moe", "no_norm_topk_config.json"), ref, s, out);
  const std::vector<float> want = ref.floats("no_norm_topk.logits");
  ASSERT_EQ(got.size(), want.size()) << out;
  EXPECT_LT(test::scaled_err(got, want), kTol);
  EXPECT_GT(test::scaled_err(got, ref.floats("logits")), 100 * kTol);
}

// Qwen2 with use_sliding_window=true and max_window_layers (28) at or above its 2 layers: no
// layer slides in transformers, so the logits are the golden's (before: refused). A yarn rotary
// embedding without original_max_position_embeddings extends max_position_embeddings, as
// transformers' standardize_rope_params sets it (before: base.yml's 8192, logits ~1.0 off).
TEST(QwenGolden, SlidingWindowOfNoLayerAndYarnContextAreTransformers) {
  Scratch s;
  const Reference ref(kGolden / "qwen2");
  const fs::path dir = test::with_config(s, kGolden, "qwen2", "config.json");
  edit_file(dir / "config.json", "\"use_sliding_window\": false", "\"use_sliding_window\": true");
  std::string out;
  const std::vector<float> got = score(dir, ref, s, out);
  ASSERT_EQ(got.size(), ref.floats("logits").size()) << out;
  EXPECT_LT(test::scaled_err(got, ref.floats("logits")), kTol);
  edit_file(dir / "config.json", "\"max_window_layers\": 28", "\"max_window_layers\": 1");
  expect_refused("score hf_path=" + dir.string() + " tokens=1,2,3", "use_sliding_window=true");
  const fs::path yarn = test::with_config(s, kGolden, "qwen3_tied", "config.json");
  const std::string cfg = slurp(yarn / "config.json");
  const size_t at = cfg.find("\"rope_type\": \"default\"");
  ASSERT_NE(at, std::string::npos) << cfg;
  edit_file(yarn / "config.json", "\"rope_type\": \"default\"",
            "\"rope_type\": \"yarn\", \"factor\": 4.0");
  const size_t mpe = cfg.find("\"max_position_embeddings\": ");
  ASSERT_NE(mpe, std::string::npos) << cfg;
  const std::string context = cfg.substr(mpe + 27, cfg.find_first_of(",\n}", mpe + 27) - mpe - 27);
  const test::MtResult r = test::run_mt("config hf_path=" + yarn.string(), 60);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("\noriginal_max_position_embeddings: " + context + "\n"), std::string::npos)
      << context << "\n"
      << r.out;
}

// `mt decode hf_path=... tokens=<prompt>` prints the prompt and its 20 greedy tokens, equal to
// transformers' generate(do_sample=False). Smallest top-1/top-2 gaps on the way: 8.3 (tied),
// 0.024 (untied), 0.037 (moe), against logit errors of ~2e-6.
TEST(QwenGolden, GreedyDecodeEqualsTransformersGenerate) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const Reference ref(kGolden / d);
    ASSERT_NO_FATAL_FAILURE(test::expect_decode_equals_generate(ref, "generate", kGolden / d, 20));
  }
}

// Hugging Face -> mt -> Hugging Face: the exported directory has the tensors transformers wrote
// (names, shapes, bytes: the experts per expert, the router, the q/k norms; no lm_head when
// tied), and its config.json (Qwen's legacy form) scores as transformers did.
TEST(QwenGolden, ConvertRoundTripWritesWhatTransformersWrote) {
  Scratch s;
  for (const char* d : {"qwen3_tied", "qwen3_moe", "qwen2"}) {
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

// Each family learns from the shipped corpus (its tokenizer's 8192 ids): the mean loss of the
// last five of 40 steps is well below the first step's.
TEST(QwenTraining, LossFallsOnTheShippedCorpus) {
  Scratch s;
  for (const char* model : {"qwen3-test", "qwen3-moe-test", "qwen2-test"}) {
    SCOPED_TRACE(model);
    const test::MtResult r =
        test::run_training(model, test::corpus_options(40, "3e-3"), s.root, model);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<std::string> l = losses(s.root / model);
    ASSERT_EQ(l.size(), 40u) << r.out;
    EXPECT_LT(test::last_five_mean(l), std::stod(l[0]) - 1.0) << r.out;
    if (std::string(model) == "qwen3-moe-test") {
      EXPECT_NE(slurp(s.root / model / "metrics.jsonl").find("\"moe_lb_loss\""), std::string::npos);
    }
  }
}

// 8 steps straight, or 4 then a restart to 8: the losses of steps 5..8 and the final
// parameters are bitwise identical (CPU, fixed thread count), for each family.
TEST(QwenTraining, ResumedRunEqualsStraightRun) {
  Scratch s;
  for (const char* model : {"qwen3-test", "qwen3-moe-test", "qwen2-test"}) {
    SCOPED_TRACE(model);
    auto run = [&](const std::string& name, int steps) {
      const test::MtResult r = test::run_training(
          model, test::resume_options(4, 8) + " steps=" + std::to_string(steps), s.root, name);
      EXPECT_EQ(r.code, 0) << r.out;
    };
    const std::string straight = std::string(model) + "_straight";
    const std::string resumed = std::string(model) + "_resumed";
    run(straight, 8);
    run(resumed, 4);
    run(resumed, 8);
    ASSERT_NO_FATAL_FAILURE(test::expect_same_runs(s.root / straight, s.root / resumed, 8));
  }
}

// FLOPs count the 8 routed experts of 128: Qwen3-30B-A3B has 30.5B parameters of which 3.3B
// are active per token (Qwen's figures, the embedding table included), so 6 x (3.35B - the
// 0.31B lookup table) plus attention; Qwen3-235B-A22B 22B active of 235B.
TEST(QwenModel, FlopsCountActiveExpertsOnly) {
  struct Case {
    const char* model;
    double total, active;  // parameters, embedding table included
  };
  for (const Case c :
       {Case{"qwen3-30b-a3b", 30.53e9, 3.35e9}, Case{"qwen3-235b-a22b", 235.09e9, 22.19e9}}) {
    SCOPED_TRACE(c.model);
    const std::unique_ptr<Model> m = build_named(c.model);
    const ParamCounts n = count_parameters(*m);
    EXPECT_NEAR(static_cast<double>(n.total), c.total, 0.01e9);
    EXPECT_NEAR(n.active_matmul + static_cast<double>(n.embedding), c.active, 0.01e9);
    const ModelDims d = m->dims();
    const double seq = 4096;
    const double attn =
        12.0 * static_cast<double>(d.num_layers * d.num_query_heads * d.head_dim) * seq / 2;
    EXPECT_NEAR(m->flops_per_token(4096), 6.0 * n.active_matmul + attn, 1e3);
    // Not the total: all 128 experts would be ~9x (30B) and ~10x (235B) as many.
    EXPECT_LT(m->flops_per_token(4096), 6.0 * (c.active + 0.1e9) + attn);
  }
  // A dense Qwen3 counts every matmul parameter (tied: the embedding is the LM head).
  const std::unique_ptr<Model> m = build_named("qwen3-0.6b");
  const ParamCounts n = count_parameters(*m);
  EXPECT_NEAR(static_cast<double>(n.total), 596.0e6, 0.1e6);
  EXPECT_EQ(n.active_matmul, static_cast<double>(n.matmul));
  EXPECT_EQ(n.matmul, n.total - 28 * (2 * 1024 + 2 * 128) - 1024);  // all but the norms
}

// `mt models` lists the named configs with the parameter counts Qwen publishes.
TEST(QwenModel, NamedConfigsHaveThePublishedSizes) {
  test::expect_named_sizes({{"qwen3-0.6b", "596.0M"},
                            {"qwen3-1.7b", "1.72B"},
                            {"qwen3-4b", "4.02B"},
                            {"qwen3-8b", "8.19B"},
                            {"qwen3-14b", "14.77B"},
                            {"qwen3-32b", "32.76B"},
                            {"qwen3-30b-a3b", "30.53B"},
                            {"qwen3-235b-a22b", "235.09B"},
                            {"qwen2.5-0.5b", "494.0M"},
                            {"qwen2.5-7b", "7.62B"}},
                           "qwen");
}

// Bad input, each refused before any work with exit code 2 and one paragraph naming it.
TEST(QwenBadInput, IsRefusedWithOneClearError) {
  Scratch s;
  expect_refused("run --model=qwen3-moe-test num_experts_per_tok=9 steps=1",
                 "num_experts_per_tok=9");
  expect_refused("run --model=qwen3-moe-test qwen3_moe_mlp_only_layers='[0,5]' steps=1",
                 "qwen3_moe_mlp_only_layers");
  expect_refused("run --model=qwen3-test num_experts=8 steps=1", "qwen3_moe family");
  // config.json: experts per token beyond the experts, and fields mt does not implement.
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"num_experts_per_tok\": 3", "\"num_experts_per_tok\": 9"},
      {"\"use_sliding_window\": false", "\"use_sliding_window\": true"},
      {"\"attention_bias\": false", "\"attention_bias\": true"},
      {"\"rope_type\": \"default\"", "\"rope_type\": \"dynamic\", \"factor\": 2.0"},
      {"\"decoder_sparse_step\": 1", "\"decoder_sparse_step\": 0"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\""}};
  const std::vector<std::string> says = {"num_experts_per_tok=9", "use_sliding_window=true",
                                         "attention_bias=true",   "rope_parameters.rope_type",
                                         "decoder_sparse_step=0", "hidden_act=gelu"};
  for (size_t i = 0; i < edits.size(); ++i) {
    const fs::path dir = test::with_config(s, kGolden, "qwen3_moe", "config.json");
    edit_file(dir / "config.json", edits[i].first, edits[i].second);
    expect_refused("score hf_path=" + dir.string() + " tokens=1,2,3", says[i]);
    fs::remove_all(dir);
  }
  // Weights for more layers than config.json has: the extra tensors are named.
  {
    const fs::path dir = test::with_config(s, kGolden, "qwen3_untied", "config.json");
    edit_file(dir / "config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    expect_refused("score hf_path=" + dir.string() + " tokens=1,2,3", "model.layers.1.");
    fs::remove_all(dir);
  }
  // Experts of another width than config.json says: bad input naming the tensor and both shapes.
  {
    const fs::path dir = test::with_config(s, kGolden, "qwen3_moe", "config.json");
    edit_file(dir / "config.json", "\"moe_intermediate_size\": 16",
              "\"moe_intermediate_size\": 24");
    const test::MtResult r = test::run_mt("score hf_path=" + dir.string() + " tokens=1,2,3", 60);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("'model.layers.0.mlp.experts.0.gate_proj.weight'"), std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("config.json and the weights disagree"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace mt
