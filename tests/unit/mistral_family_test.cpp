// The mistral and mixtral families (plugins/models/mistral) against transformers 5: tiny random
// f32 models saved by save_pretrained (tests/golden/<family>, made by
// tools/make_family_golden.py), scored and decoded through the mt CLI as users run it, with
// config.json in the transformers 5 and the legacy form; the round trip through mt convert; bad
// input; training on the shipped corpus, resume, and the FLOPs of the active experts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config_loader.h"
#include "family_test_support.h"
#include "model_info.h"
#include "mt/config.h"
#include "mt/model.h"
#include "safetensors.h"
#include "test_support.h"
#include "trainer.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

const fs::path kGolden = fs::path(test::source_dir()) / "tests" / "golden";

// max |mt - transformers| / max |transformers| over the logits. Measured: 4.5e-7 (mistral),
// 4.1e-7 (mixtral), on logits whose largest magnitude is about 4.
constexpr double kTol = 1e-4;

using test::Reference;
using test::replace_first;

// A scratch directory of this test, removed afterwards.
struct Scratch : test::Scratch {
  // A copy of the family's HF directory, config.json replaced by `config` when given.
  fs::path copy_hf(const std::string& family, const std::string& config = "") const {
    const fs::path dir = root / ("hf_" + std::to_string(copies++));
    fs::create_directories(dir);
    for (const auto& e : fs::directory_iterator(kGolden / family / "hf"))
      fs::copy_file(e.path(), dir / e.path().filename());
    if (!config.empty()) std::ofstream(dir / "config.json") << config;
    return dir;
  }
  mutable int copies = 0;
};

// `mt score hf_path=<dir> tokens=<the reference input> output=...`: the logits [SEQ, V].
std::vector<float> score(const std::string& family, const fs::path& dir, const std::string& extra,
                         const Scratch& s, std::string& out) {
  return test::score(dir, Reference(kGolden / family), s, out, extra);
}

// Rows [begin, end) of a [SEQ, 128] logits matrix.
std::vector<float> rows(const std::vector<float>& m, size_t begin, size_t end) {
  if (m.size() < end * 128) return {};
  return std::vector<float>(m.begin() + static_cast<ptrdiff_t>(begin * 128),
                            m.begin() + static_cast<ptrdiff_t>(end * 128));
}

class FamilyGolden : public ::testing::TestWithParam<std::string> {};

INSTANTIATE_TEST_SUITE_P(Families, FamilyGolden, ::testing::Values("mistral", "mixtral"),
                         [](const auto& info) { return info.param; });

// The directories are what the tests take them to be: transformers 5's config.json and, for
// Mixtral, the experts one tensor each, as save_pretrained writes them.
TEST_P(FamilyGolden, TheDirectoryIsWhatTransformersFiveWrote) {
  const std::string cfg = test::slurp(kGolden / GetParam() / "hf" / "config.json");
  EXPECT_NE(cfg.find("\"rope_parameters\""), std::string::npos);
  EXPECT_NE(cfg.find("\"transformers_version\": \"5."), std::string::npos);
  EXPECT_EQ(cfg.find("\"rope_theta\": 1"), cfg.find("\"rope_theta\": 1"));
  const std::string legacy = test::slurp(kGolden / GetParam() / "legacy_config.json");
  EXPECT_EQ(legacy.find("rope_parameters"), std::string::npos);
  EXPECT_NE(legacy.find("\"torch_dtype\""), std::string::npos);
  SafeTensorsFile w(kGolden / GetParam() / "hf" / "model.safetensors");
  const auto names = w.names();
  if (GetParam() == "mixtral") {
    EXPECT_TRUE(std::count(names.begin(), names.end(),
                           "model.layers.1.block_sparse_moe.experts.7.w2.weight"));
    EXPECT_TRUE(
        std::count(names.begin(), names.end(), "model.layers.0.block_sparse_moe.gate.weight"));
  } else {
    EXPECT_NE(cfg.find("\"sliding_window\": 16"), std::string::npos);
  }
}

// mt's logits equal transformers' for 80 tokens (five times Mistral's window of 16); the
// comparison sees a model configured otherwise (no window; Mixtral's weights not renormalised).
TEST_P(FamilyGolden, ScoresLikeTransformers) {
  Scratch s;
  const Reference ref(kGolden / GetParam());
  const std::vector<float> want = ref.floats("logits");
  std::string out;
  const std::vector<float> got = score(GetParam(), kGolden / GetParam() / "hf", "", s, out);
  ASSERT_EQ(got.size(), want.size()) << out;
  EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;  // config.json understood whole
  EXPECT_LT(test::scaled_err(got, want), kTol);
  EXPECT_LT(test::scaled_err(rows(got, 16, 80), rows(want, 16, 80)), kTol);
  const std::string other =
      GetParam() == "mistral" ? "sliding_window_size=0" : "norm_topk_prob=false";
  const std::vector<float> wrong = score(GetParam(), kGolden / GetParam() / "hf", other, s, out);
  ASSERT_EQ(wrong.size(), want.size()) << out;
  EXPECT_GT(test::scaled_err(rows(wrong, 16, 80), rows(want, 16, 80)), 100 * kTol) << other;
}

// config.json in the transformers 4 form beside the same weights configures the same model.
TEST_P(FamilyGolden, LegacyConfigGivesTheSameLogits) {
  Scratch s;
  const fs::path dir =
      s.copy_hf(GetParam(), test::slurp(kGolden / GetParam() / "legacy_config.json"));
  std::string out;
  const std::vector<float> legacy = score(GetParam(), dir, "", s, out);
  EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
  const std::vector<float> v5 = score(GetParam(), kGolden / GetParam() / "hf", "", s, out);
  ASSERT_EQ(legacy.size(), v5.size());
  EXPECT_EQ(legacy, v5);
}

// `mt decode hf_path=... tokens=<prompt>` equals transformers' greedy generate: a short prompt
// and one of 60 tokens (Mistral's ring-buffer cache of 16 rows wraps several times).
TEST_P(FamilyGolden, DecodeEqualsTransformersGenerate) {
  const Reference ref(kGolden / GetParam());
  for (const char* name : {"generate", "generate_long"}) {
    SCOPED_TRACE(name);
    ASSERT_NO_FATAL_FAILURE(
        test::expect_decode_equals_generate(ref, name, kGolden / GetParam() / "hf", 20));
  }
}

// mt convert --from=hf, then --to=hf: every tensor of the original comes back bit for bit, and
// the config.json written configures the same model (its logits are transformers').
TEST_P(FamilyGolden, ConvertRoundTrips) {
  Scratch s;
  const fs::path hf = kGolden / GetParam() / "hf", m = s.root / "mt", back = s.root / "back";
  ASSERT_NO_FATAL_FAILURE(test::convert_round_trip(hf, m, back));
  const std::string cfg = test::slurp(back / "config.json");
  EXPECT_NE(cfg.find(GetParam() == "mistral" ? "MistralForCausalLM" : "MixtralForCausalLM"),
            std::string::npos)
      << cfg;
  if (GetParam() == "mixtral") {
    // The directory's load-balancing weight is kept, into mt's key and back (before: 0.01).
    EXPECT_NE(test::slurp(m / "model.yml").find("load_balance_loss_weight: 0.001"),
              std::string::npos);
    EXPECT_NE(cfg.find("\"router_aux_loss_coef\": 0.001"), std::string::npos) << cfg;
  }
  std::string out;
  const std::vector<float> got = score(GetParam(), back, "", s, out);
  EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
  EXPECT_LT(test::scaled_err(got, Reference(kGolden / GetParam()).floats("logits")), kTol);
}

// Bad input: one clear error each, exit code 2, nothing written.
TEST(FamilyBadInput, RefusedWithExitCode2) {
  Scratch s;
  const std::string mistral = test::slurp(kGolden / "mistral" / "hf" / "config.json");
  const std::string mixtral = test::slurp(kGolden / "mixtral" / "hf" / "config.json");
  struct Case {
    const char* what;
    std::string family, config, want;
  };
  const std::vector<Case> cases = {
      {"more experts per token than experts", "mixtral",
       replace_first(mixtral, "\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 9"),
       "num_experts_per_tok=9 is more than num_local_experts=8"},
      {"shapes that disagree with config.json", "mistral",
       replace_first(mistral, "\"intermediate_size\": 128", "\"intermediate_size\": 96"),
       "config.json and the weights disagree"},
      {"expert shapes that disagree with config.json", "mixtral",
       replace_first(mixtral, "\"intermediate_size\": 32", "\"intermediate_size\": 48"),
       "block_sparse_moe.experts.0.w1.weight"},
      {"fewer experts than the weights hold", "mixtral",
       replace_first(mixtral, "\"num_local_experts\": 8", "\"num_local_experts\": 4"),
       "block_sparse_moe.gate.weight"},
      {"a soft-cap the family does not implement", "mistral",
       replace_first(mistral, "\"head_dim\"", "\"attn_logit_softcapping\": 30.0, \"head_dim\""),
       "attn_logit_softcapping=30.0, which changes the computation"},
      {"a rope type the family does not implement", "mixtral",
       replace_first(mixtral, "\"rope_type\": \"default\"",
                     "\"rope_type\": \"yarn\", \"factor\": 4.0"),
       "rope_parameters.factor=4.0"},
      {"router jitter", "mixtral",
       replace_first(mixtral, "\"router_jitter_noise\": 0.0", "\"router_jitter_noise\": 0.1"),
       "router_jitter_noise=0.1"},
      {"experts in a mistral config.json", "mistral",
       replace_first(mistral, "\"head_dim\"", "\"num_local_experts\": 8, \"head_dim\""),
       "Is this a Mistral model?"},
      {"layer types that mix attention kinds", "mistral",
       replace_first(mistral, "\"head_dim\"",
                     "\"layer_types\": [\"sliding_attention\", \"full_attention\"], \"head_dim\""),
       "mixes attention kinds"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const fs::path dir = s.copy_hf(c.family, c.config);
    const fs::path file = s.root / "never.safetensors";
    const test::MtResult r =
        test::run_mt("score hf_path=" + dir.string() + " tokens=1,2,3 output=" + file.string(), 60);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find(c.want), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "one paragraph: " << r.out;
    EXPECT_FALSE(fs::exists(file));
  }
  // The named configs, with keys the families refuse: nothing written but the run's lock (which
  // mt run takes before it builds the model, for every family).
  for (const std::string args :
       {"--model=mixtral-test num_experts_per_tok=9", "--model=mistral-test num_experts=8",
        "--model=mixtral-test rope_type=yarn", "--model=mistral-test final_logits_soft_cap=30"}) {
    SCOPED_TRACE(args);
    const fs::path o = s.root / "o";
    fs::remove_all(o);
    const test::MtResult r =
        test::run_mt("run " + args + " steps=1 base_output_directory=" + o.string(), 60);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << "one paragraph: " << r.out;
    std::error_code ec;
    for (auto it = fs::recursive_directory_iterator(o, ec); !ec && it != fs::end(it); ++it)
      EXPECT_TRUE(it->is_directory() || it->path().filename() == "run.lock") << it->path();
  }
}

// ---- training -------------------------------------------------------------------------------

// A run directory of its own per test and tag, removed afterwards.
struct TrainDir {
  explicit TrainDir(const std::string& tag) {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = std::string(t->test_suite_name()) + "_" + t->name() + "_" + tag;
    std::replace(name.begin(), name.end(), '/', '_');
    dir = fs::temp_directory_path() / ("mt_family_" + std::to_string(::getpid()) + "_" + name);
    fs::remove_all(dir);
  }
  ~TrainDir() { fs::remove_all(dir); }
  fs::path dir;
  Config config(const std::string& model, std::vector<std::string> extra) const {
    ConfigRequest req;
    req.configs_dir = test::source_dir() + "/configs";
    req.model = model;
    req.overrides = {"base_output_directory=" + dir.string(), "run_name=r", "eval_interval=-1",
                     "num_threads=2"};
    req.overrides.insert(req.overrides.end(), extra.begin(), extra.end());
    return load_config(req);
  }
  std::vector<std::string> metrics() const {
    std::ifstream f(dir / "r" / "metrics.jsonl");
    std::vector<std::string> lines;
    for (std::string l; std::getline(f, l);) lines.push_back(l);
    return lines;
  }
};

double field(const std::string& line, const std::string& key) {
  const size_t at = line.find("\"" + key + "\": ");
  if (at == std::string::npos) return NAN;
  return std::stod(line.substr(at + key.size() + 4));
}

class FamilyTraining : public ::testing::TestWithParam<std::string> {};

INSTANTIATE_TEST_SUITE_P(Families, FamilyTraining, ::testing::Values("mistral", "mixtral"),
                         [](const auto& info) { return info.param; });

// 30 steps on the shipped corpus (its 8192-token vocabulary): the loss falls from ln 8192 ~ 9.0
// by well over a nat. Mixtral's metrics carry the auxiliary losses and each layer's load.
TEST_P(FamilyTraining, LossFallsOnTheShippedCorpus) {
  const TrainDir run("corpus");
  const std::string data = test::source_dir() + "/data/";
  train(run.config(
            GetParam() + "-test",
            {"dataset_type=tokens", "dataset_path=" + data + "corpus.train.tokens",
             "vocab_size=8192", "steps=30", "learning_rate=1e-2", "enable_checkpointing=false"}),
        test::plugins(), true);
  const auto lines = run.metrics();
  ASSERT_EQ(lines.size(), 30u);
  double first = 0, last = 0;
  for (size_t i = 0; i < 5; ++i) {
    first += field(lines[i], "loss") / 5;
    last += field(lines[lines.size() - 1 - i], "loss") / 5;
  }
  EXPECT_LT(last, first - 1.0) << lines.front() << "\n" << lines.back();
  if (GetParam() == "mixtral") {
    for (const char* k : {"moe_lb_loss", "moe_z_loss", "moe_load_min/0", "moe_load_max/0",
                          "moe_load_min/1", "moe_load_max/1"})
      EXPECT_TRUE(std::isfinite(field(lines.back(), k))) << k << " in " << lines.back();
    EXPECT_LE(field(lines.back(), "moe_load_min/0"), 1.0 / 8);
    EXPECT_GE(field(lines.back(), "moe_load_max/0"), 1.0 / 8);
    EXPECT_EQ(lines.back().find("moe_dropped_fraction"), std::string::npos);  // dropless
  } else {
    EXPECT_EQ(lines.back().find("moe_"), std::string::npos);
  }
}

// The auxiliary losses enter the objective as their mean over the MoE layers, as MaxText's
// train.py adds jnp.mean of the layers' moe_lb_loss: on 4 layers, the first step's loss with
// load_balance_loss_weight=0.5 is the one with weight 0 plus 0.5 x the logged moe_lb_loss (the
// same at any depth), not 4 x that (before: the layers' sum).
TEST(FamilyAuxLoss, TheLoadBalanceLossIsTheLayersMean) {
  for (const char* layers : {"1", "4"}) {
    SCOPED_TRACE(std::string("layers ") + layers);
    const TrainDir off("off"), on("on");
    auto run = [&](const TrainDir& d, const std::string& w) {
      train(d.config("mixtral-test",
                     {"dataset_type=synthetic", "steps=1", "enable_checkpointing=false",
                      "moe_z_loss_weight=0", std::string("base_num_decoder_layers=") + layers,
                      "load_balance_loss_weight=" + w}),
            test::plugins(), true);
      return d.metrics().at(0);
    };
    const std::string a = run(off, "0"), b = run(on, "0.5");
    ASSERT_TRUE(std::isfinite(field(b, "moe_lb_loss"))) << b;
    EXPECT_GT(field(b, "moe_lb_loss"), 0.5) << b;  // about num_experts_per_tok (2)
    EXPECT_NEAR(field(b, "loss") - field(a, "loss"), 0.5 * field(b, "moe_lb_loss"), 1e-5)
        << a << "\n"
        << b;
  }
}

// Eight steps straight, or four, a stop and four more: the same losses and final parameters,
// bit for bit (Mixtral with token dropping, whose metrics say what it dropped).
TEST_P(FamilyTraining, ResumedRunEqualsStraightRun) {
  const TrainDir straight("straight"), resumed("resumed");
  std::vector<std::string> common = {"dataset_type=synthetic", "checkpoint_period=4",
                                     "learning_rate_schedule_steps=8"};
  if (GetParam() == "mixtral") common.push_back("capacity_factor=1.0");
  auto with = [&](const std::string& steps) {
    std::vector<std::string> v = common;
    v.push_back("steps=" + steps);
    return v;
  };
  const std::string model = GetParam() + "-test";
  train(straight.config(model, with("8")), test::plugins(), true);
  train(resumed.config(model, with("4")), test::plugins(), true);
  train(resumed.config(model, with("8")), test::plugins(), true);
  const auto a = straight.metrics(), b = resumed.metrics();
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    EXPECT_EQ(field(a[i], "loss"), field(b[i], "loss")) << "step " << i + 1;
    if (GetParam() == "mixtral") {
      EXPECT_EQ(field(a[i], "moe_dropped_fraction"), field(b[i], "moe_dropped_fraction"));
      EXPECT_GT(field(a[i], "moe_dropped_fraction"), 0.0) << a[i];
    }
  }
  const std::string pa =
      test::slurp(straight.dir / "r" / "checkpoints" / "8" / "params.safetensors");
  ASSERT_GT(pa.size(), 1000u);
  EXPECT_TRUE(pa == test::slurp(resumed.dir / "r" / "checkpoints" / "8" / "params.safetensors"))
      << "final parameters differ";
}

// Model FLOPs count the experts a token uses (2 of 8), not all of them: Mixtral 8x7B has 46.7B
// parameters of which 12.9B are active (the embedding lookup included).
TEST(FamilyFlops, MixtralCountsTheTopKExperts) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "mixtral-8x7b";
  const Config cfg = load_config(req);
  const auto model = test::plugins().make_model_family("mixtral")->build(cfg);
  const ParamCounts c = count_parameters(*model);
  const double d = 4096, layers = 32, ffn = 14336, vocab = 32000;
  const double attention = d * d * 2 + d * 1024 * 2, router = d * 8, expert = 3 * d * ffn;
  EXPECT_NEAR(static_cast<double>(c.total), 46.70e9, 0.01e9);
  const double active = layers * (attention + router + 2 * expert) + d * vocab;  // + LM head
  EXPECT_NEAR(c.active_matmul, active, 1e-6 * active);
  EXPECT_NEAR((c.active_matmul + static_cast<double>(c.embedding)) / 1e9, 12.9, 0.05);
  const int64_t seq = cfg.get_int("max_target_length");
  const double attn_flops = layers * 12 * 32 * 128 * static_cast<double>(seq) / 2;
  EXPECT_NEAR(model->flops_per_token(seq), 6 * active + attn_flops, 1e-6 * 6 * active);
}

}  // namespace
}  // namespace mt
