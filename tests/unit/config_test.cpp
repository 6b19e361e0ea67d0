// The layered config: base.yml as schema, model files, --config files, overrides, and every
// refusal with the key, the value and where it was set.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/parallel_for.h>

#include "config_impl.h"
#include "config_loader.h"
#include "host_threads.h"
#include "mt/error.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "test_support.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

// Messages are checked for the pieces they must hold (key, value, origin, suggestion); plain
// GoogleTest, as the suite does not link gmock.
struct Needles {
  std::vector<std::string> items;
};
Needles Has(std::string s) {
  return {{std::move(s)}};
}
template <class... T>
Needles All(const T&... n) {
  Needles out;
  (out.items.insert(out.items.end(), n.items.begin(), n.items.end()), ...);
  return out;
}
::testing::AssertionResult contains(const std::string& text, const Needles& n) {
  for (const auto& x : n.items) {
    if (text.find(x) == std::string::npos)
      return ::testing::AssertionFailure() << "'" << x << "' is missing from:\n" << text;
  }
  return ::testing::AssertionSuccess();
}
#define EXPECT_CONTAINS(text, needles) EXPECT_TRUE(contains((text), (needles)))

fs::path real_configs() {
  return fs::path(test::source_dir()) / "configs";
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() /
            ("mt_config_test_" + std::to_string(rd()) + "_" + std::to_string(rd()));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const fs::path& path() const { return path_; }
  fs::path write(const std::string& rel, const std::string& text) const {
    const fs::path p = path_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << text;
    return p;
  }

 private:
  fs::path path_;
};

// The UsageError message of f(), or a test failure when f() throws nothing or something else.
std::string usage_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const UsageError& e) {
    EXPECT_EQ(e.exit_code(), 2);
    return e.what();
  }
  ADD_FAILURE() << "expected an mt::UsageError";
  return "";
}

// 1-based line of the first line of `file` that starts with `prefix`.
int line_of(const fs::path& file, const std::string& prefix) {
  std::ifstream in(file);
  int n = 0;
  for (std::string l; std::getline(in, l);) {
    ++n;
    if (l.rfind(prefix, 0) == 0) return n;
  }
  return -1;
}

ConfigRequest real_request(std::vector<std::string> overrides = {}, std::string model = "") {
  ConfigRequest r;
  r.configs_dir = real_configs();
  r.model = std::move(model);
  r.overrides = std::move(overrides);
  return r;
}

Config load(std::vector<std::string> overrides, std::string model = "") {
  return load_config(real_request(std::move(overrides), std::move(model)));
}

// A small configs tree: base.yml keys on known lines, models that set `marker` to their name.
struct MiniTree {
  TempDir tmp;
  fs::path configs;
  MiniTree() {
    configs = tmp.write("configs/base.yml",
                        "# mini\n"                                            // 1
                        "model_name: \"m1\"  # the model\n"                   // 2
                        "marker: \"base\"  # which layer won\n"               // 3
                        "a: 1  # set by base only [>0]\n"                     // 4
                        "b: 1  # set by the model [>0]\n"                     // 5
                        "c: 1  # set by the config file [>0]\n"               // 6
                        "d: 1  # set by an override [>0]\n"                   // 7
                        "rate: 0.5  # a float [0..1]\n"                       // 8
                        "flag: false  # a bool\n"                             // 9
                        "names: [x, y]  # a list [choices: x|y|z]\n"          // 10
                        "mode: \"fast\"  # a choice [choices: fast|slow]\n")  // 11
                  .parent_path();
    for (const char* m : {"m1", "m2", "m3", "m4"}) {
      tmp.write(std::string("configs/models/") + m + ".yml",
                std::string("# model ") + m + "\nmarker: \"" + m + "\"\nb: 2\nc: 2\nd: 2\n");
    }
  }
  ConfigRequest request() const {
    ConfigRequest r;
    r.configs_dir = configs;
    return r;
  }
};

// ---- Schema ------------------------------------------------------------------------------------

TEST(ConfigSchema, RealBaseDeclaresEveryKeyWithTypeDocAndConstraint) {
  const auto specs = load_schema(real_configs() / "base.yml");
  std::map<std::string, const KeySpec*> by_name;
  for (const auto& s : specs) {
    by_name[s.name] = &s;
    EXPECT_FALSE(s.doc.empty()) << s.name << " has no comment";
  }
  for (const char* k : {"run_name",
                        "model_name",
                        "decoder_block",
                        "backend",
                        "plugin_dirs",
                        "num_threads",
                        "base_output_directory",
                        "steps",
                        "log_period",
                        "device_peak_tflops",
                        "vocab_size",
                        "base_emb_dim",
                        "base_num_query_heads",
                        "base_num_kv_heads",
                        "base_mlp_dim",
                        "base_num_decoder_layers",
                        "head_dim",
                        "mlp_activations",
                        "normalization_layer_epsilon",
                        "logits_via_embedding",
                        "rope_type",
                        "rope_max_timescale",
                        "rope_factor",
                        "rope_low_freq_factor",
                        "rope_high_freq_factor",
                        "original_max_position_embeddings",
                        "beta_fast",
                        "beta_slow",
                        "partial_rotary_factor",
                        "attention",
                        "sliding_window_size",
                        "attn_logits_soft_cap",
                        "final_logits_soft_cap",
                        "dtype",
                        "weight_dtype",
                        "remat_policy",
                        "init_weights_seed",
                        "num_experts",
                        "num_experts_per_tok",
                        "per_device_batch_size",
                        "max_target_length",
                        "learning_rate",
                        "warmup_steps_fraction",
                        "learning_rate_final_fraction",
                        "learning_rate_schedule_steps",
                        "adam_b1",
                        "adam_b2",
                        "adam_eps",
                        "adam_weight_decay",
                        "gradient_clipping_threshold",
                        "gradient_accumulation_steps",
                        "z_loss_multiplier",
                        "eval_interval",
                        "eval_steps",
                        "dataset_type",
                        "dataset_path",
                        "eval_dataset_path",
                        "eval_split",
                        "train_data_columns",
                        "packing",
                        "data_shuffle_seed",
                        "tokenizer_type",
                        "tokenizer_path",
                        "add_bos",
                        "add_eos",
                        "enable_checkpointing",
                        "checkpoint_period",
                        "async_checkpointing",
                        "max_num_checkpoints_to_keep",
                        "load_parameters_path",
                        "load_full_state_path",
                        "hf_path",
                        "prompt",
                        "max_prefill_predict_length",
                        "decode_sampling_strategy",
                        "decode_sampling_temperature",
                        "decode_sampling_top_k",
                        "decode_sampling_nucleus_p",
                        "decode_sampling_seed"}) {
    EXPECT_TRUE(by_name.count(k)) << k << " missing from base.yml";
  }
  EXPECT_EQ(by_name.at("steps")->type, ValueType::int_);
  EXPECT_EQ(by_name.at("learning_rate")->type, ValueType::float_);
  EXPECT_EQ(by_name.at("packing")->type, ValueType::bool_);
  EXPECT_EQ(by_name.at("run_name")->type, ValueType::string);
  EXPECT_EQ(by_name.at("mlp_activations")->type, ValueType::list);
  EXPECT_EQ(by_name.at("plugin_dirs")->type, ValueType::list);

  const KeySpec& steps = *by_name.at("steps");
  ASSERT_TRUE(steps.min.has_value());
  EXPECT_EQ(*steps.min, 0);
  EXPECT_TRUE(steps.min_exclusive);
  EXPECT_EQ(steps.constraint, ">0");
  const KeySpec& eval = *by_name.at("eval_interval");
  EXPECT_EQ(*eval.min, -1);
  EXPECT_FALSE(eval.min_exclusive);
  const KeySpec& split = *by_name.at("eval_split");
  EXPECT_EQ(*split.min, 0);
  EXPECT_EQ(*split.max, 1);
  EXPECT_FALSE(split.min_exclusive);
  EXPECT_TRUE(split.max_exclusive);  // [0..<1]
  EXPECT_EQ(by_name.at("attention")->choices,
            (std::vector<std::string>{"dot_product", "flash", "cudnn_flash"}));
  EXPECT_EQ(by_name.at("rope_type")->choices,
            (std::vector<std::string>{"default", "llama3.1", "yarn"}));
  // The annotation is not part of the documentation.
  EXPECT_EQ(steps.doc.find('['), std::string::npos);
}

TEST(ConfigSchema, BadAnnotationsAndUntypedDefaultsAreReported) {
  TempDir t;
  const auto p1 = t.write("c1/base.yml", "steps: 3  # steps [choices: a|b]\n");
  EXPECT_CONTAINS(usage_error([&] { load_schema(p1); }),
                  All(Has("base.yml:1"), Has("steps"), Has("choices apply only")));
  const auto p2 = t.write("c2/base.yml", "x: 3\nsteps: 3  # steps [about 3]\n");
  EXPECT_CONTAINS(usage_error([&] { load_schema(p2); }), All(Has("base.yml:2"), Has("[about 3]")));
  const auto p3 = t.write("c3/base.yml", "steps:  # nothing\n");
  EXPECT_CONTAINS(usage_error([&] { load_schema(p3); }), All(Has("base.yml:1"), Has("steps")));
  // A '#' inside quotes is not a comment; the bracket of a list default is no annotation.
  const auto p4 =
      t.write("c4/base.yml", "prompt: \"a # b [>0]\"  # text\nl: [a, b]  # list [choices: a|b]\n");
  const auto p5 = t.write("c5/base.yml", "prompt: I'm here  # text [choices: I'm here|b]\n");
  EXPECT_EQ(load_schema(p5).at(0).choices.size(), 2u);
  const auto specs = load_schema(p4);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].default_value.s, "a # b [>0]");
  EXPECT_TRUE(specs[0].constraint.empty());
  EXPECT_EQ(specs[0].doc, "text");
  EXPECT_EQ(specs[1].choices.size(), 2u);
}

// ---- Layering ----------------------------------------------------------------------------------

TEST(ConfigLayers, RealDefaultsComeFromBaseAndTheDefaultModel) {
  const Config c = load({});
  const fs::path base = real_configs() / "base.yml";
  const fs::path small = real_configs() / "models" / "llama-small.yml";
  EXPECT_EQ(c.get_string("model_name"), "llama-small");
  EXPECT_EQ(c.get_int("log_period"), 10);
  EXPECT_EQ(c.origin("log_period"),
            "configs/base.yml:" + std::to_string(line_of(base, "log_period:")));
  // The embedded default's training settings come from its model file.
  EXPECT_EQ(c.get_int("steps"), 800);
  EXPECT_EQ(c.origin("steps"),
            "configs/models/llama-small.yml:" + std::to_string(line_of(small, "steps:")));
  EXPECT_EQ(c.get_int("base_emb_dim"), 384);
  EXPECT_EQ(c.origin("base_emb_dim"),
            "configs/models/llama-small.yml:" + std::to_string(line_of(small, "base_emb_dim:")));
  EXPECT_DOUBLE_EQ(c.get_float("adam_b2"), 0.95);
  EXPECT_TRUE(c.get_bool("packing"));
  EXPECT_EQ(c.get_string("backend"), "cpu");
  EXPECT_EQ(c.get_string_list("mlp_activations"), (std::vector<std::string>{"silu", "linear"}));
  EXPECT_TRUE(c.get_string_list("plugin_dirs").empty());
  // Keys stay in base.yml's order.
  EXPECT_EQ(c.keys().front(), "run_name");
}

TEST(ConfigLayers, EachLayerWinsOverThePreviousWithItsOrigin) {
  MiniTree m;
  const fs::path user = m.tmp.write("user.yml", "# mine\nc: 3\nd: 3\n");
  ConfigRequest r = m.request();
  r.config_file = user.string();
  r.overrides = {"d=4"};
  const Config c = load_config(r);
  EXPECT_EQ(c.get_int("a"), 1);
  EXPECT_EQ(c.origin("a"), "configs/base.yml:4");
  EXPECT_EQ(c.get_int("b"), 2);
  EXPECT_EQ(c.origin("b"), "configs/models/m1.yml:3");
  EXPECT_EQ(c.get_int("c"), 3);
  EXPECT_EQ(c.origin("c"), user.generic_string() + ":2");  // outside configs/: as given
  EXPECT_EQ(c.get_int("d"), 4);
  EXPECT_EQ(c.origin("d"), "command line");
  EXPECT_EQ(c.get_string("marker"), "m1");
  EXPECT_EQ(c.origin("model_name"), "configs/base.yml:2");
}

TEST(ConfigLayers, LaterOverridesWinAndDashesAreAccepted) {
  const Config c = load({"steps=5", "--steps=7", "learning_rate=0.01"});
  EXPECT_EQ(c.get_int("steps"), 7);
  EXPECT_DOUBLE_EQ(c.get_float("learning_rate"), 0.01);
}

TEST(ConfigLayers, ConstraintsApplyToTheFinalValue) {
  MiniTree m;
  const fs::path user = m.tmp.write("user.yml", "a: 0\n");
  ConfigRequest r = m.request();
  r.config_file = user.string();
  r.overrides = {"a=5"};
  EXPECT_EQ(load_config(r).get_int("a"), 5);
}

TEST(ConfigLayers, ModelNameResolution) {
  MiniTree m;
  const fs::path user = m.tmp.write("user.yml", "model_name: m2\n");
  auto run = [&](bool file, bool override_, const std::string& flag) {
    ConfigRequest r = m.request();
    if (file) r.config_file = user.string();
    if (override_) r.overrides = {"model_name=m3"};
    r.model = flag;
    return load_config(r);
  };
  Config c = run(false, false, "");
  EXPECT_EQ(c.get_string("marker"), "m1");
  EXPECT_EQ(c.get_string("model_name"), "m1");

  c = run(true, false, "");
  EXPECT_EQ(c.get_string("marker"), "m2");
  EXPECT_EQ(c.get_string("model_name"), "m2");
  EXPECT_EQ(c.origin("model_name"), user.generic_string() + ":1");

  c = run(true, true, "");
  EXPECT_EQ(c.get_string("marker"), "m3");
  EXPECT_EQ(c.get_string("model_name"), "m3");
  EXPECT_EQ(c.origin("model_name"), "command line");

  c = run(true, true, "m4");
  EXPECT_EQ(c.get_string("marker"), "m4");
  EXPECT_EQ(c.get_string("model_name"), "m4");
  EXPECT_EQ(c.origin("model_name"), "command line (--model)");

  // The model file sits below the config file: the config file's keys win over it.
  const fs::path user2 = m.tmp.write("user2.yml", "model_name: m2\nb: 9\n");
  ConfigRequest r = m.request();
  r.config_file = user2.string();
  c = load_config(r);
  EXPECT_EQ(c.get_int("b"), 9);
  EXPECT_EQ(c.get_string("marker"), "m2");
}

// MaxText's M_<KEY> environment variables set keys as the command line does, above the --config
// file; one that names no key is ignored; a key set by both is refused (as MaxText refuses it).
TEST(ConfigLayers, EnvironmentOverridesAsMaxTextReadsThem) {
  ConfigRequest r = real_request({"learning_rate=0.01"});
  r.environment = {{"M_STEPS", "7"},
                   {"M_NOT_A_KEY", "1"},
                   {"M_MODEL_NAME", "gemma-test"},
                   {"MT_PLUGIN_PATH", "/x"}};
  Config c = load_config(r);
  EXPECT_EQ(c.get_int("steps"), 7);
  EXPECT_EQ(c.origin("steps"), "environment variable M_STEPS");
  EXPECT_EQ(c.get_string("decoder_block"), "gemma");  // the model the variable names
  EXPECT_DOUBLE_EQ(c.get_float("learning_rate"), 0.01);
  r.overrides = {"steps=3"};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("steps is set both on the command line (steps=3)"), Has("M_STEPS=7")));
  r.overrides = {};
  r.model = "llama-test";
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }), Has("name two models"));
  r.environment = {{"M_STEPS", "abc"}};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  Has("set by the environment variable M_STEPS"));
}

TEST(ConfigLayers, RealModelOverridesOnTheCommandLine) {
  const Config c = load({"base_num_decoder_layers=4", "model_name=llama-test"}, "llama2-7b");
  EXPECT_EQ(c.get_string("model_name"), "llama2-7b");
  EXPECT_EQ(c.get_int("base_emb_dim"), 4096);
  EXPECT_EQ(c.get_int("base_num_decoder_layers"), 4);
  EXPECT_EQ(c.origin("base_num_decoder_layers"), "command line");
}

// ---- Types -------------------------------------------------------------------------------------

TEST(ConfigTypes, CoercionRules) {
  const Config c = load({"learning_rate=3", "steps=+12", "packing=false", "run_name=123",
                         "prompt=I love #1: cats", "mlp_activations=[gelu, linear]",
                         "plugin_dirs=/opt/p", "dataset_path=", "adam_eps=1e-9",
                         "logits_via_embedding=True", "tokenizer_path=\"a b\""});
  EXPECT_DOUBLE_EQ(c.get_float("learning_rate"), 3.0);  // an int is a fine float
  EXPECT_CONTAINS(c.to_yaml(), Has("learning_rate: 3.0\n"));
  EXPECT_EQ(c.get_int("steps"), 12);
  EXPECT_FALSE(c.get_bool("packing"));
  EXPECT_TRUE(c.get_bool("logits_via_embedding"));
  EXPECT_EQ(c.get_string("run_name"), "123");            // a string key takes any scalar as text
  EXPECT_EQ(c.get_string("prompt"), "I love #1: cats");  // verbatim, not YAML
  EXPECT_EQ(c.get_string_list("mlp_activations"), (std::vector<std::string>{"gelu", "linear"}));
  EXPECT_EQ(c.get_string_list("plugin_dirs"), (std::vector<std::string>{"/opt/p"}));
  EXPECT_EQ(c.get_string("dataset_path"), "");
  EXPECT_DOUBLE_EQ(c.get_float("adam_eps"), 1e-9);
  EXPECT_EQ(c.get_string("tokenizer_path"), "a b");  // quotes are YAML
}

TEST(ConfigTypes, WrongTypesAreRefusedWithKeyValueOriginAndDefault) {
  const int steps_line = line_of(real_configs() / "base.yml", "steps:");
  std::string msg = usage_error([] { load({"steps=abc"}); });
  EXPECT_CONTAINS(
      msg, All(Has("steps=abc"), Has("command line"), Has("must be an integer"),
               Has("default is 300"), Has("configs/base.yml:" + std::to_string(steps_line))));
  EXPECT_CONTAINS(usage_error([] { load({"steps=3.5"}); }), Has("fractional"));
  // 1e3 is whole: said as a floating-point form, with the integer to write (before: "a
  // fractional number").
  EXPECT_CONTAINS(usage_error([] { load({"steps=1e3"}); }),
                  All(Has("floating-point form"), Has("write it as 1000")));
  // Too many digits is not a fraction (issue 24, item 11).
  for (const char* v : {"steps=9999999999999999999999", "steps=-9999999999999999999999"}) {
    const std::string msg = usage_error([&] { load({v}); });
    EXPECT_CONTAINS(msg, Has("beyond the 64-bit range"));
    EXPECT_EQ(msg.find("fractional"), std::string::npos) << msg;
  }
  EXPECT_CONTAINS(usage_error([] { load({"learning_rate=fast"}); }),
                  All(Has("learning_rate=fast"), Has("must be a number")));
  // A flag where a number belongs (an HF config.json's "hidden_size": true) is said as one
  // (before: "not a string").
  EXPECT_CONTAINS(usage_error([] { load({"steps=true"}); }),
                  All(Has("must be an integer, not true or false")));
  EXPECT_CONTAINS(usage_error([] { load({"learning_rate=False"}); }),
                  All(Has("must be a number, not true or false")));
  EXPECT_CONTAINS(usage_error([] { load({"packing=1"}); }),
                  All(Has("packing=1"), Has("true or false")));
  EXPECT_CONTAINS(usage_error([] { load({"packing=yes"}); }), Has("true or false"));
  EXPECT_CONTAINS(usage_error([] { load({"steps=[1, 2]"}); }),
                  All(Has("steps=[1, 2]"), Has("not a list")));
  // On the command line a string key takes the text as written, brackets included.
  EXPECT_EQ(load({"run_name=[a]"}).get_string("run_name"), "[a]");
  EXPECT_CONTAINS(usage_error([] { load({"steps="}); }), Has("not empty"));
  EXPECT_CONTAINS(usage_error([] { load({"mlp_activations=[[a]]"}); }), Has("a list holding"));

  TempDir t;
  const fs::path user = t.write("u.yml", "# x\nsteps: \"12\"\n");
  ConfigRequest r = real_request();
  r.config_file = user.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("steps=12"), Has(user.generic_string() + ":2"), Has("an integer")));
  const fs::path nested = t.write("n.yml", "steps:\n  a: 1\n");
  r.config_file = nested.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }), Has("not a mapping"));
  r.config_file = t.write("l.yml", "run_name: [a, b]\n").string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("run_name=[a, b]"), Has("a single value"), Has("not a list")));
}

// ---- Errors ------------------------------------------------------------------------------------

TEST(ConfigErrors, MalformedYamlNamesFileLineAndColumn) {
  TempDir t;
  const fs::path user = t.write("bad.yml", "steps: 3\nmlp_activations: [silu, linear\nx: 1\n");
  ConfigRequest r = real_request();
  r.config_file = user.string();
  const std::string msg = usage_error([&] { load_config(r); });
  EXPECT_CONTAINS(msg, All(Has(user.generic_string() + ":3:"), Has("malformed YAML"),
                           Has("end of sequence flow not found")));

  const fs::path bad2 = t.write("bad2.yml", "steps: 3\n  learning_rate: 2\n");
  r.config_file = bad2.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has(bad2.generic_string() + ":2:"), Has("malformed YAML")));
}

TEST(ConfigErrors, MalformedModelFileIsReportedRelativeToConfigs) {
  MiniTree m;
  m.tmp.write("configs/models/m2.yml", "b: [1\n");
  ConfigRequest r = m.request();
  r.model = "m2";
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("configs/models/m2.yml:2:"), Has("malformed YAML")));
}

TEST(ConfigErrors, TopLevelMustBeAMapping) {
  TempDir t;
  const fs::path list = t.write("list.yml", "- steps: 3\n- b\n");
  ConfigRequest r = real_request();
  r.config_file = list.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has(list.generic_string()), Has("not a YAML mapping"), Has("a list")));
  const fs::path scalar = t.write("scalar.yml", "hello\n");
  r.config_file = scalar.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }), Has("the single value 'hello'"));
  // An empty file (or only comments) is an empty layer.
  r.config_file = t.write("empty.yml", "# nothing yet\n").string();
  EXPECT_EQ(load_config(r).get_int("steps"), 800);
  // One document: a second (after ---) was dropped without a word; a leading --- is fine.
  const fs::path two = t.write("two.yml", "steps: 3\n---\nsteps: 5\n");
  r.config_file = two.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has(two.generic_string()), Has("holds 2 YAML documents")));
  r.config_file = t.write("lead.yml", "---\nsteps: 3\n").string();
  EXPECT_EQ(load_config(r).get_int("steps"), 3);
}

TEST(ConfigErrors, UnknownKeysSuggestTheNearestInEveryLayer) {
  TempDir t;
  const fs::path user = t.write("u.yml", "steps: 3\nlerning_rate: 0.1\n");
  ConfigRequest r = real_request();
  r.config_file = user.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("'lerning_rate'"), Has(user.generic_string() + ":2"),
                      Has("Did you mean 'learning_rate'?"), Has("configs/base.yml")));

  EXPECT_CONTAINS(
      usage_error([] { load({"batch_size=8"}); }),
      All(Has("'batch_size'"), Has("command line"), Has("Did you mean 'per_device_batch_size'?")));
  EXPECT_CONTAINS(usage_error([] { load({"--emb_dim=8"}); }), Has("'base_emb_dim'"));
  EXPECT_CONTAINS(usage_error([] { load({"lr=0.1"}); }), Has("Did you mean 'learning_rate'?"));
  // No suggestion beats a wrong one.
  const std::string far = usage_error([] { load({"qqqqqqqq=1"}); });
  EXPECT_CONTAINS(far, All(Has("'qqqqqqqq'"), Has("configs/base.yml")));
  EXPECT_EQ(far.find("Did you mean"), std::string::npos) << far;

  // A removed key says what became of it, in a file as an older run directory's config.yml.
  const fs::path old_run = t.write("config.yml", "steps: 3\ninit_weights_stddev: 0.02\n");
  r.config_file = old_run.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("init_weights_stddev (set at " + old_run.generic_string() + ":2)"),
                      Has("no longer a key"), Has("Delete the line")));

  MiniTree m;
  m.tmp.write("configs/models/m1.yml", "marker: m1\nbb: 3\n");
  EXPECT_CONTAINS(usage_error([&] { load_config(m.request()); }),
                  All(Has("'bb'"), Has("configs/models/m1.yml:2"), Has("Did you mean 'b'?")));
}

TEST(ConfigErrors, OutOfRangeAndChoices) {
  const int steps_line = line_of(real_configs() / "base.yml", "steps:");
  EXPECT_CONTAINS(usage_error([] { load({"steps=0"}); }),
                  All(Has("steps=0"), Has("command line"), Has("out of range"), Has("must be > 0"),
                      Has("configs/base.yml:" + std::to_string(steps_line))));
  EXPECT_CONTAINS(usage_error([] { load({"learning_rate=-1"}); }), Has("must be >= 0"));
  EXPECT_CONTAINS(usage_error([] { load({"eval_split=1.5"}); }),
                  All(Has("eval_split=1.5"), Has("must be >= 0 and < 1")));
  EXPECT_CONTAINS(usage_error([] { load({"eval_split=1"}); }), Has("must be >= 0 and < 1"));
  EXPECT_CONTAINS(usage_error([] { load({"eval_interval=-2"}); }), Has(">= -1"));
  EXPECT_CONTAINS(usage_error([] { load({"attention=flsh"}); }),
                  All(Has("attention=flsh"), Has("command line"),
                      Has("dot_product, flash, cudnn_flash"), Has("Did you mean 'flash'?")));

  MiniTree m;
  const fs::path user = m.tmp.write("user.yml", "names: [x, w]\nmode: quick\n");
  ConfigRequest r = m.request();
  r.config_file = user.string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("names=[x, w]"), Has(user.generic_string() + ":1"), Has("holds 'w'"),
                      Has("x, y, z")));
  r.overrides = {"names=[z]"};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("mode=quick"), Has(user.generic_string() + ":2"), Has("fast, slow")));
  r.overrides = {"names=[z]", "mode=slow", "rate=1"};
  EXPECT_DOUBLE_EQ(load_config(r).get_float("rate"), 1.0);
}

TEST(ConfigErrors, CombinationsOfKeys) {
  EXPECT_CONTAINS(usage_error([] {
                    load({"base_num_query_heads=6", "base_num_kv_heads=4"});
                  }),
                  All(Has("base_num_query_heads=6"), Has("base_num_kv_heads=4"), Has("multiple")));
  EXPECT_CONTAINS(usage_error([] { load({"num_experts_per_tok=2"}); }),
                  All(Has("num_experts_per_tok=2"), Has("num_experts=1")));
  EXPECT_CONTAINS(usage_error([] { load({"eval_interval=0"}); }), Has("eval_interval=0"));
  EXPECT_CONTAINS(usage_error([] { load({"decode_sampling_strategy=top_k"}); }),
                  Has("decode_sampling_top_k=0"));
}

TEST(ConfigErrors, BadOverridesAndMissingFiles) {
  EXPECT_CONTAINS(usage_error([] { load({"steps"}); }), All(Has("'steps'"), Has("key=value")));
  EXPECT_CONTAINS(usage_error([] { load({"=3"}); }), Has("'=3'"));
  EXPECT_CONTAINS(usage_error([] { load({"mlp_activations=[a, b"}); }),
                  All(Has("mlp_activations=[a, b"), Has("not valid YAML")));

  ConfigRequest r = real_request();
  r.config_file = "/nonexistent/dir/my.yml";
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("/nonexistent/dir/my.yml"), Has("does not exist")));
  TempDir t;
  r.config_file = t.path().string();
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }), Has("is not a file"));

  ConfigRequest nobase;
  nobase.configs_dir = t.path();
  EXPECT_CONTAINS(usage_error([&] { load_config(nobase); }), Has("has no base.yml"));
}

TEST(ConfigErrors, UnknownModelListsTheAvailableOnes) {
  const std::string msg = usage_error([] { load({}, "llama9-7b"); });
  EXPECT_CONTAINS(
      msg, All(Has("Unknown model 'llama9-7b'"), Has("--model"), Has("llama2-7b, llama2-13b"),
               Has("llama-test"), Has("llama3.2-1b"), Has("Did you mean")));
  EXPECT_CONTAINS(usage_error([] { load({"model_name=nope"}); }),
                  All(Has("Unknown model 'nope'"), Has("command line")));
  EXPECT_CONTAINS(usage_error([] { load({}, "../base"); }), Has("Unknown model '../base'"));
}

TEST(ConfigErrors, DuplicateKeysAndModelNameInModelFiles) {
  TempDir t;
  const fs::path user = t.write("dup.yml", "steps: 3\nlog_period: 2\nsteps: 4\n");
  ConfigRequest r = real_request();
  r.config_file = user.string();
  EXPECT_CONTAINS(
      usage_error([&] { load_config(r); }),
      All(Has(user.generic_string() + ":3"), Has("'steps'"), Has("twice"), Has("line 1")));

  MiniTree m;
  m.tmp.write("configs/models/m1.yml", "model_name: m2\n");
  EXPECT_CONTAINS(usage_error([&] { load_config(m.request()); }),
                  All(Has("configs/models/m1.yml:1"), Has("model_name")));
}

// ---- Output ------------------------------------------------------------------------------------

TEST(ConfigYaml, RoundTripGivesTheSameValues) {
  const Config a = load({"run_name=true", "prompt=3", "dataset_path=", "adam_eps=1e-9",
                         "learning_rate=2", "mlp_activations=[gelu, \"linear\"]",
                         "plugin_dirs=[/a b, 'c,d']", "rope_max_timescale=500000"},
                        "llama3.1-8b");
  const std::string yaml = a.to_yaml();
  EXPECT_CONTAINS(yaml, Has("learning_rate: 2.0\n"));
  EXPECT_CONTAINS(yaml, Has("rope_max_timescale: 500000.0\n"));
  EXPECT_CONTAINS(yaml, Has("run_name: \"true\"\n"));
  EXPECT_CONTAINS(yaml, Has("dataset_path: \"\"\n"));

  TempDir t;
  const fs::path file = t.write("resolved.yml", yaml);
  ConfigRequest r;
  r.configs_dir = real_configs();
  r.config_file = file.string();
  const Config b = load_config(r);
  ASSERT_EQ(a.keys(), b.keys());
  for (const auto& k : a.keys()) {
    const ConfigValue& va = a.impl().at(k);
    const ConfigValue& vb = b.impl().at(k);
    EXPECT_EQ(va.type, vb.type) << k;
    EXPECT_EQ(va.i, vb.i) << k;
    EXPECT_EQ(va.f, vb.f) << k;  // exact: floats are printed round-trippably
    EXPECT_EQ(va.b, vb.b) << k;
    if (va.type == ValueType::string) {
      EXPECT_EQ(va.s, vb.s) << k;
    }
    EXPECT_EQ(va.list, vb.list) << k;
  }
  EXPECT_EQ(yaml, b.to_yaml());
}

TEST(ConfigYaml, OriginsAsComments) {
  const std::string y = load({"steps=5"}).to_yaml(true);
  EXPECT_CONTAINS(y, Has("# command line\n"));
  EXPECT_CONTAINS(y, Has("# configs/models/llama-small.yml:"));
  EXPECT_CONTAINS(y, Has("# configs/base.yml:"));
}

TEST(ConfigYaml, FloatsStayFloats) {
  ConfigValue v;
  v.type = ValueType::float_;
  for (double f : {1.0, 0.0, -2.0, 1e-5, 3e-4, 1e20, 0.1, 1.0 / 3}) {
    v.f = f;
    const std::string s = config_value_yaml(v);
    EXPECT_NE(s.find_first_of(".n"), std::string::npos) << s;
    EXPECT_EQ(std::stod(s), f) << s;
  }
  v.f = 1e-5;
  EXPECT_EQ(config_value_yaml(v), "1.0e-05");
}

// ---- Models ------------------------------------------------------------------------------------

TEST(ConfigModels, ListFindsTheRealModelsInNaturalOrder) {
  const auto models = list_models(real_configs(), {});
  std::vector<std::string> names;
  for (const auto& m : models) {
    names.push_back(m.name);
    EXPECT_FALSE(m.family.empty()) << m.name;  // the decoder_block the file names
    EXPECT_FALSE(m.description.empty()) << m.name;
    EXPECT_TRUE(fs::is_regular_file(m.path)) << m.name;
  }
  const std::vector<std::string> want = {
      "llama-small", "llama-test",  "llama2-7b",    "llama2-13b",    "llama2-70b",  "llama3-8b",
      "llama3-70b",  "llama3.1-8b", "llama3.1-70b", "llama3.1-405b", "llama3.2-1b", "llama3.2-3b"};
  for (const auto& w : want) EXPECT_NE(std::find(names.begin(), names.end(), w), names.end()) << w;
  auto pos = [&](const std::string& n) { return std::find(names.begin(), names.end(), n); };
  EXPECT_LT(pos("llama2-7b"), pos("llama2-13b"));
  EXPECT_LT(pos("llama3.1-70b"), pos("llama3.1-405b"));
}

// Every named model's family reads every model key its file sets (a key it ignored would be
// refused by the runner: unread_model_keys), and a key the family does not implement is found.
TEST(ConfigModels, EveryRealModelsFamilyUsesTheKeysItsFileSets) {
  for (const auto& m : list_models(real_configs(), {})) {
    SCOPED_TRACE(m.name);
    ConfigRequest req = real_request({}, m.name);
    req.schemas_for = test::family_schemas;
    const Config c = load_config(req);
    auto family = test::plugins().make_model_family(c.get_string("decoder_block"));
    reset_config_reads(c);
    family->validate(c);
    auto model = family->build(c);
    EXPECT_EQ(unread_model_keys(c), std::vector<std::string>{});
  }
  // llama has no linear rope scaling and no experts' groups: both are found.
  ConfigRequest req =
      real_request({"rope_linear_scaling_factor=8", "n_routing_groups=4"}, "llama-test");
  const Config c = load_config(req);
  auto family = test::plugins().make_model_family("llama");
  reset_config_reads(c);
  family->validate(c);
  auto model = family->build(c);
  EXPECT_EQ(unread_model_keys(c),
            (std::vector<std::string>{"rope_linear_scaling_factor", "n_routing_groups"}));
}

TEST(ConfigModels, EveryRealModelLoadsAndSatisfiesTheSchema) {
  for (const auto& m : list_models(real_configs(), {})) {
    SCOPED_TRACE(m.name);
    // With its family's own keys, which a named config may set (gemma2's
    // query_pre_attn_scalar), as mt resolves it.
    ConfigRequest req = real_request({}, m.name);
    req.schemas_for = test::family_schemas;
    const Config c = load_config(req);
    EXPECT_EQ(c.get_string("decoder_block"), m.family);
    EXPECT_EQ(c.get_int("base_num_query_heads") % c.get_int("base_num_kv_heads"), 0);
  }
  Config c = load({}, "llama2-7b");
  EXPECT_EQ(c.get_int("base_emb_dim"), 4096);
  EXPECT_EQ(c.get_int("base_mlp_dim"), 11008);
  EXPECT_EQ(c.get_int("vocab_size"), 32000);
  EXPECT_DOUBLE_EQ(c.get_float("rope_max_timescale"), 10000.0);
  c = load({}, "llama3.1-405b");
  EXPECT_EQ(c.get_int("base_num_decoder_layers"), 126);
  EXPECT_EQ(c.get_string("rope_type"), "llama3.1");
  EXPECT_DOUBLE_EQ(c.get_float("rope_max_timescale"), 500000.0);
  c = load({}, "llama3.2-1b");
  EXPECT_TRUE(c.get_bool("logits_via_embedding"));
  EXPECT_EQ(c.get_int("head_dim"), 64);
  EXPECT_DOUBLE_EQ(c.get_float("rope_factor"), 32.0);
  c = load({}, "llama-test");
  EXPECT_EQ(c.get_int("max_target_length"), 32);
  EXPECT_EQ(c.get_int("per_device_batch_size"), 2);
}

TEST(ConfigModels, ExtraModelDirsComeAfterConfigsModels) {
  TempDir t;
  const fs::path extra = t.path() / "plugin_models";
  t.write("plugin_models/mine.yml", "# my model\ndecoder_block: gpt\nbase_emb_dim: 32\n");
  t.write("plugin_models/llama-test.yml", "# shadowed\nbase_emb_dim: 1\n");
  t.write("plugin_models/broken.yml", "decoder_block: gemma\nbase_emb_dim: [1\n");
  const auto models = list_models(real_configs(), {extra});
  auto find = [&](const std::string& n) {
    return std::find_if(models.begin(), models.end(),
                        [&](const ModelEntry& m) { return m.name == n; });
  };
  ASSERT_NE(find("mine"), models.end());
  EXPECT_EQ(find("mine")->family, "gpt");
  EXPECT_EQ(find("mine")->description, "my model");
  ASSERT_NE(find("llama-test"), models.end());
  EXPECT_EQ(find("llama-test")->description.rfind("llama-test", 0), 0u);
  // The shadowed file is listed with the model that shadows it (mt models says so); before, it
  // was dropped without a word.
  ASSERT_EQ(find("llama-test")->shadowed.size(), 1u);
  EXPECT_EQ(find("llama-test")->shadowed[0], extra / "llama-test.yml");
  EXPECT_TRUE(find("mine")->shadowed.empty());
  // A file that does not parse is listed with its error and no family (before: base.yml's).
  ASSERT_NE(find("broken"), models.end());
  EXPECT_EQ(find("broken")->family, "?");
  EXPECT_EQ(find("broken")->description.rfind("malformed YAML", 0), 0u);

  ConfigRequest r = real_request({}, "mine");
  r.model_dirs = {extra};
  const Config c = load_config(r);
  EXPECT_EQ(c.get_string("decoder_block"), "gpt");
  EXPECT_EQ(c.get_int("base_emb_dim"), 32);
  EXPECT_EQ(c.origin("base_emb_dim"), (extra / "mine.yml").generic_string() + ":3");
  r.model = "llama-test";
  EXPECT_EQ(load_config(r).get_int("base_emb_dim"), 64);
}

TEST(ConfigModels, PluginSchemaFilesDeclareExtraKeys) {
  TempDir t;
  const fs::path extra = t.write("gpt_keys.yml",
                                 "gpt_bias: true  # add biases\n"
                                 "gpt_ratio: 0.5  # a ratio [0..1]\n");
  ConfigRequest r = real_request({"gpt_ratio=0.25"});
  r.schema_files = {extra};
  const Config c = load_config(r);
  EXPECT_TRUE(c.get_bool("gpt_bias"));
  EXPECT_EQ(c.origin("gpt_bias"), extra.generic_string() + ":1");
  EXPECT_DOUBLE_EQ(c.get_float("gpt_ratio"), 0.25);
  r.overrides = {"gpt_ratio=2"};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }), Has("between 0 and 1"));
  // Half-open ranges: the bound marked < is left out.
  r.schema_files = {t.write("open_keys.yml",
                            "gpt_left: 0.5  # [0<..1]\n"
                            "gpt_right: 0.5  # [0..<1]\n")};
  for (const auto& [set, ok] : {std::pair{"gpt_left=0", false}, std::pair{"gpt_left=1", true},
                                std::pair{"gpt_right=0", true}, std::pair{"gpt_right=1", false}}) {
    r.overrides = {set};
    if (ok) {
      EXPECT_NO_THROW(load_config(r)) << set;
    } else {
      EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                      Has(std::string(set).find("left") != std::string::npos ? "> 0 and <= 1"
                                                                             : ">= 0 and < 1"));
    }
  }
  r.schema_files = {extra};
  // Without the plugin's schema the key is unknown.
  EXPECT_CONTAINS(usage_error([] { load({"gpt_bias=false"}); }), Has("'gpt_bias'"));
  // A plugin cannot redeclare a core key.
  r.schema_files = {t.write("dup_keys.yml", "steps: 3  # again\n")};
  r.overrides = {};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("'steps'"), Has("dup_keys.yml:1"), Has("configs/base.yml:")));
}

// A model family's config_schema(), as the CLI passes it.
SchemaText family_schema(const std::string& family, const std::string& yaml) {
  return {"model family '" + family + "' config_schema()", yaml};
}
const char* const kGptSchema =
    "gpt_scale: 1.5  # scales the residual branch [>0]\n"
    "gpt_bias: true  # add biases\n";

TEST(ConfigFamilySchema, KeysResolveWithTheirDefaultOriginAndConstraint) {
  ConfigRequest r = real_request();
  r.schema_texts = {family_schema("gpt", kGptSchema)};
  Config c = load_config(r);
  EXPECT_DOUBLE_EQ(c.get_float("gpt_scale"), 1.5);
  EXPECT_EQ(c.origin("gpt_scale"), "model family 'gpt' config_schema():1");
  EXPECT_TRUE(c.get_bool("gpt_bias"));
  EXPECT_EQ(c.origin("gpt_bias"), "model family 'gpt' config_schema():2");
  // `mt config --origins` shows them like base.yml's keys, after them.
  const std::string yaml = c.to_yaml(true);
  EXPECT_CONTAINS(yaml, Has("# model family 'gpt' config_schema():1"));
  EXPECT_GT(yaml.find("gpt_scale: 1.5"), yaml.find("decoder_block:"));

  // Overridden like any key, from the command line or a --config file.
  r.overrides = {"gpt_scale=3", "--gpt_bias=false"};
  c = load_config(r);
  EXPECT_DOUBLE_EQ(c.get_float("gpt_scale"), 3.0);
  EXPECT_EQ(c.origin("gpt_scale"), "command line");
  EXPECT_FALSE(c.get_bool("gpt_bias"));
  TempDir t;
  r.overrides = {};
  r.config_file = t.write("user.yml", "gpt_scale: 0.25\n").string();
  c = load_config(r);
  EXPECT_DOUBLE_EQ(c.get_float("gpt_scale"), 0.25);
  EXPECT_EQ(c.origin("gpt_scale"), (t.path() / "user.yml").generic_string() + ":1");

  // Its [>0] and its type are enforced, naming where its default comes from.
  r.config_file.clear();
  r.overrides = {"gpt_scale=0"};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("gpt_scale=0"), Has("out of range"), Has("> 0"),
                      Has("model family 'gpt' config_schema():1")));
  r.overrides = {"gpt_bias=maybe"};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("gpt_bias=maybe"), Has("true or false")));
}

TEST(ConfigFamilySchema, AFragmentCannotRedeclareABaseKey) {
  ConfigRequest r = real_request();
  r.schema_texts = {family_schema("gpt", "gpt_scale: 1.0  # fine\nsteps: 3  # again\n")};
  const int steps_line = line_of(real_configs() / "base.yml", "steps:");
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("model family 'gpt' config_schema():2"), Has("'steps'"),
                      Has("configs/base.yml:" + std::to_string(steps_line)),
                      Has("belong in configs/base.yml")));
  // Nor a key another plugin's schema file declares.
  TempDir t;
  r.schema_files = {t.write("plugin_keys.yml", "gpt_scale: 2.0  # mine\n")};
  r.schema_texts = {family_schema("gpt", kGptSchema)};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("model family 'gpt' config_schema():1"), Has("'gpt_scale'"),
                      Has("plugin_keys.yml:1")));
  // A fragment is read as a schema file is: malformed YAML and bad annotations are named.
  r.schema_files.clear();
  r.schema_texts = {family_schema("gpt", "gpt_scale: [1.0\n")};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("model family 'gpt' config_schema()"), Has("malformed YAML")));
  r.schema_texts = {family_schema("gpt", "gpt_scale: 1.0  # a scale [about 1]\n")};
  EXPECT_CONTAINS(usage_error([&] { load_config(r); }),
                  All(Has("model family 'gpt' config_schema():1"), Has("[about 1]")));
}

// What the CLI does: the layers decide decoder_block (a pre-pass that skips keys it does not
// know), then the schema of that family alone joins base.yml's.
struct FamilySchemas {
  std::vector<std::string> asked;  // decoder_block of each call
  ConfigRequest request(std::vector<std::string> overrides, std::string model = "") {
    ConfigRequest r = real_request(std::move(overrides), std::move(model));
    r.schemas_for = [this](const Config& layers) {
      const std::string family = layers.get_string("decoder_block");
      asked.push_back(family);
      if (family == "gpt") return std::vector<SchemaText>{family_schema("gpt", kGptSchema)};
      if (family == "other")
        return std::vector<SchemaText>{family_schema("other", "o_k: 1  # k\n")};
      return std::vector<SchemaText>{};
    };
    return r;
  }
};

TEST(ConfigFamilySchema, TheFinalDecoderBlockSelectsTheFragment) {
  FamilySchemas f;
  // Set before decoder_block names the family, on the same command line.
  Config c = load_config(f.request({"gpt_scale=2", "decoder_block=gpt"}));
  EXPECT_DOUBLE_EQ(c.get_float("gpt_scale"), 2.0);
  EXPECT_EQ(c.get_string("decoder_block"), "gpt");
  EXPECT_EQ(f.asked, std::vector<std::string>{"gpt"});
  EXPECT_FALSE(c.has("o_k"));  // only the named family's keys

  // Named by a model file that also sets the family's key.
  TempDir t;
  t.write("models/mine.yml", "decoder_block: gpt\ngpt_scale: 4\n");
  ConfigRequest r = f.request({}, "mine");
  r.model_dirs = {t.path() / "models"};
  c = load_config(r);
  EXPECT_DOUBLE_EQ(c.get_float("gpt_scale"), 4.0);
  EXPECT_EQ(c.origin("gpt_scale"), (t.path() / "models" / "mine.yml").generic_string() + ":2");

  // A later layer that names another family takes the key away: refused as unknown, saying
  // which decoder_block decided and where it was set.
  r.overrides = {"decoder_block=other"};
  std::string msg = usage_error([&] { load_config(r); });
  EXPECT_CONTAINS(msg, All(Has("'gpt_scale'"), Has("mine.yml:2"),
                           Has("decoder_block=other, set on the command line")));
  EXPECT_THROW(load_config(r), UnknownKeyError);
  // With base.yml's family the key is unknown too; a typo of a family key is suggested.
  msg = usage_error([&] { load_config(f.request({"gpt_scale=2"})); });
  EXPECT_CONTAINS(msg, All(Has("'gpt_scale'"),
                           Has("decoder_block=llama, set at configs/models/llama-small.yml:")));
  EXPECT_EQ(msg.find("model family 'gpt'"), std::string::npos) << msg;
  msg = usage_error([&] { load_config(f.request({"decoder_block=gpt", "gpt_scal=2"})); });
  EXPECT_CONTAINS(msg, All(Has("Did you mean 'gpt_scale'?"),
                           Has("configs/base.yml, model family 'gpt' config_schema()")));
}

TEST(ConfigFamilySchema, ThePreviewSkipsUnknownKeysAndConstraints) {
  ConfigRequest r = real_request({"gpt_scale=2", "steps=0", "decoder_block=gpt"});
  const Config p = preview_config(r);
  EXPECT_EQ(p.get_string("decoder_block"), "gpt");
  EXPECT_EQ(p.get_int("steps"), 0);
  EXPECT_FALSE(p.has("gpt_scale"));
  // Type errors of known keys are refused all the same.
  r.overrides = {"steps=abc"};
  EXPECT_CONTAINS(usage_error([&] { preview_config(r); }), Has("steps=abc"));
}

TEST(ConfigNearest, Suggestions) {
  const std::vector<std::string> keys = {
      "learning_rate", "per_device_batch_size", "base_emb_dim", "steps", "eval_steps",
      "dtype",         "weight_dtype"};
  EXPECT_EQ(nearest_key("lerning_rate", keys), "learning_rate");
  EXPECT_EQ(nearest_key("learning-rate", keys), "learning_rate");
  EXPECT_EQ(nearest_key("LEARNING_RATE", keys), "learning_rate");
  EXPECT_EQ(nearest_key("stpes", keys), "steps");
  EXPECT_EQ(nearest_key("batch_size", keys), "per_device_batch_size");
  EXPECT_EQ(nearest_key("emb_dim", keys), "base_emb_dim");
  EXPECT_EQ(nearest_key("dtyp", keys), "dtype");
  EXPECT_EQ(nearest_key("lr", keys), "learning_rate");
  EXPECT_EQ(nearest_key("x", {}), "");
}

}  // namespace
}  // namespace mt

// The host work of a command (converting and transposing weights at load, int8 quantization,
// Hugging Face conversion) runs in oneTBB's default arena, not the backend's: HostThreads bounds
// it to num_threads while the command runs (before: every CPU, whatever num_threads said).
TEST(HostThreads, BoundsTheHostWorkToNumThreadsWhileItLives) {
  using gc = tbb::global_control;
  const size_t before = gc::active_value(gc::max_allowed_parallelism);
  auto threads_used = [] {
    std::mutex m;
    std::set<std::thread::id> ids;
    tbb::parallel_for(0, 64, [&](int) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      const std::lock_guard<std::mutex> lock(m);
      ids.insert(std::this_thread::get_id());
    });
    return ids.size();
  };
  {
    const mt::HostThreads host(mt::config_from_pairs({{"num_threads", "1"}}));
    EXPECT_EQ(host.threads(), 1);
    EXPECT_EQ(gc::active_value(gc::max_allowed_parallelism), 1u);
    EXPECT_EQ(threads_used(), 1u);  // the calling thread alone
  }
  {
    const mt::HostThreads host(mt::config_from_pairs({{"num_threads", "3"}}));
    EXPECT_EQ(gc::active_value(gc::max_allowed_parallelism), 3u);
  }
  EXPECT_EQ(gc::active_value(gc::max_allowed_parallelism), before);
}
