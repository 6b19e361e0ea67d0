// The GPT families (plugins/models/gpt: gpt2, gpt3): tiny random GPT2LMHeadModel directories that
// transformers 5 saved (tests/golden/gpt2/{tied,untied}, made by tools/make_gpt_golden.py)
// scored and greedily decoded through the mt CLI as users run it, in both config.json forms; the
// tiny GPT-2-format tokenizer against transformers' GPT2TokenizerFast; the export back to
// Hugging Face; training on the shipped corpus and resuming; the named configs' sizes; and bad
// input refused with exit code 2.
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "family_test_support.h"
#include "json.h"
#include "mt/io.h"
#include "safetensors.h"
#include "test_support.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

const fs::path kGolden = fs::path(test::source_dir()) / "tests" / "golden" / "gpt2";
const char* const kDirs[] = {"tied", "untied"};

// max |mt - transformers| / max |transformers| over all logits. Measured: 2.5e-7 (tied, largest
// logit 30.5), 3.3e-7 (untied, 3.8).
constexpr double kTol = 1e-4;

using test::edit_file;
using test::expect_refused;
using test::losses;
using test::Reference;
using test::score;
using test::Scratch;
using test::slurp;

// What the golden directories are: transformers 5's GPT2LMHeadModel files (Conv1D weights
// [in, out], q/k/v fused in c_attn), tied and untied, and the legacy config.json beside them.
TEST(GptGolden, TheDirectoriesAreWhatTransformersFiveWrote) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const bool tied = std::string(d) == "tied";
    const std::string v5 = slurp(kGolden / d / "config.json");
    const std::string legacy = slurp(kGolden / d / "legacy_config.json");
    EXPECT_NE(v5.find("\"transformers_version\": \"5."), std::string::npos);
    EXPECT_NE(v5.find("\"model_type\": \"gpt2\""), std::string::npos);
    EXPECT_NE(v5.find("\"dtype\": \"float32\""), std::string::npos);
    EXPECT_NE(legacy.find("\"torch_dtype\": \"float32\""), std::string::npos);
    EXPECT_NE(legacy.find("\"n_ctx\": 128"), std::string::npos);
    EXPECT_EQ(v5.find("\"tie_word_embeddings\": true") != std::string::npos, tied);
    EXPECT_NE(v5.find(tied ? "\"activation_function\": \"gelu_new\""
                           : "\"activation_function\": \"gelu\""),
              std::string::npos);
    SafeTensorsFile w(kGolden / d / "model.safetensors");
    EXPECT_EQ(w.info("transformer.h.0.attn.c_attn.weight").shape, (Shape{32, 96}));
    EXPECT_EQ(w.info("transformer.h.0.attn.c_attn.bias").shape, (Shape{96}));
    EXPECT_EQ(w.info("transformer.h.1.mlp.c_fc.weight").shape, (Shape{32, tied ? 128 : 48}));
    EXPECT_EQ(w.info("transformer.wpe.weight").shape, (Shape{128, 32}));
    bool has_head = false;
    for (const auto& n : w.names()) has_head |= n == "lm_head.weight";
    EXPECT_EQ(has_head, !tied);
  }
}

// Both models score the 100 tokens as transformers did, from config.json in the transformers 5
// form and in the hub's legacy one (equal logits), with every field understood.
TEST(GptGolden, LogitsMatchTransformersInBothConfigForms) {
  Scratch s;
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    ASSERT_NO_FATAL_FAILURE(test::expect_logits_in_both_forms(s, kGolden, d, kTol));
  }
}

// In bfloat16 (weights and compute) mt stays as close to the float32 logits as transformers in
// bfloat16 does (within 1.25x its error; tools/make_bf16_reference.py): 0.69% against 0.73%.
TEST(GptGolden, Bf16IsAsCloseAsTransformersBf16) {
  Scratch s;
  ASSERT_NO_FATAL_FAILURE(test::expect_bf16_as_close_as_transformers(s, kGolden / "tied"));
}

// The hub's gpt2 stores the base model's weights without GPT2LMHeadModel's "transformer."
// prefix ("h.0.attn.c_attn.weight", "wte.weight"); transformers adds its base_model_prefix when
// loading them, and so does mt: the same logits as from the prefixed file.
TEST(GptGolden, WeightsWithoutTheBaseModelPrefixLoad) {
  Scratch s;
  const fs::path dir = s.root / "hub";
  fs::create_directories(dir);
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(kGolden / "tied" / f, dir / f);
  const SafeTensorsFile src(kGolden / "tied" / "model.safetensors");
  std::vector<SafeTensorsEntry> entries;
  const std::string prefix = "transformer.";
  for (const auto& n : src.names()) {
    const SafeTensorInfo& info = src.info(n);
    entries.emplace_back(n.rfind(prefix, 0) == 0 ? n.substr(prefix.size()) : n, info.dtype,
                         info.shape, info.data);
  }
  write_safetensors(dir / "model.safetensors", entries);
  const Reference ref(kGolden / "tied");
  std::string out_hub, out_golden;
  const std::vector<float> hub = test::score(dir, ref, s, out_hub);
  const std::vector<float> golden = test::score(kGolden / "tied", ref, s, out_golden);
  ASSERT_FALSE(hub.empty()) << out_hub;
  EXPECT_EQ(hub, golden);
}

// `mt decode hf_path=... tokens=<prompt>` prints the prompt and its 20 greedy tokens, equal to
// transformers' generate(do_sample=False). Smallest top-1/top-2 gaps on the way: 3.0 (tied),
// 0.021 (untied), against logit errors of ~1e-6.
TEST(GptGolden, GreedyDecodeEqualsTransformersGenerate) {
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const Reference ref(kGolden / d);
    ASSERT_NO_FATAL_FAILURE(test::expect_decode_equals_generate(ref, "generate", kGolden / d, 20));
  }
}

// The tiny GPT-2-format tokenizer (byte-level BPE, GPT-2's regex, no normalizer) encodes and
// decodes as transformers' GPT2TokenizerFast did (reference.json's tokenizer_cases).
TEST(GptGolden, TokenizerMatchesTransformers) {
  const json::Value ref =
      json::parse(read_file((kGolden / "tied" / "reference.json").string(), "reference"));
  auto tok = make_tokenizer((kGolden / "tied" / "tokenizer.json").string(), "");
  EXPECT_EQ(tok->vocab_size(), 384);
  const auto* cases = ref.find("tokenizer_cases");
  ASSERT_NE(cases, nullptr);
  ASSERT_GE(cases->items.size(), 10u);
  for (const auto& c : cases->items) {
    const std::string text = c.find("text")->str;
    std::vector<int32_t> want;
    for (const auto& id : c.find("ids")->items) want.push_back(static_cast<int32_t>(id.integer));
    EXPECT_EQ(tok->encode(text), want) << text;
    EXPECT_EQ(tok->decode(want), c.find("decoded")->str) << text;
  }
}

// Hugging Face -> mt -> Hugging Face: the exported directory has the tensors transformers wrote
// (names, shapes, bytes: c_attn's fused weight and bias reassembled, no lm_head when tied), and
// its config.json scores as transformers did.
TEST(GptGolden, ConvertRoundTripWritesWhatTransformersWrote) {
  Scratch s;
  for (const char* d : kDirs) {
    SCOPED_TRACE(d);
    const fs::path mtdir = s.root / (std::string(d) + "_mt"),
                   back = s.root / (std::string(d) + "_hf");
    ASSERT_NO_FATAL_FAILURE(test::convert_round_trip(kGolden / d, mtdir, back));
    const std::string config = slurp(back / "config.json");
    EXPECT_NE(config.find("\"architectures\": [\"GPT2LMHeadModel\"]"), std::string::npos);
    const Reference ref(kGolden / d);
    std::string out;
    const std::vector<float> got = score(back, ref, s, out);
    EXPECT_EQ(out.find("mt: note"), std::string::npos) << out;
    EXPECT_LT(test::scaled_err(got, ref.floats("logits")), kTol);
  }
}

// A gpt2 model small enough for unit tests (the named ones are 124M and up).
const char* const kSmallGpt2 =
    " base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 head_dim=16 base_mlp_dim=256 "
    "base_num_decoder_layers=2 max_target_length=64";

// Each family learns from the shipped corpus (its tokenizer's 8192 ids): the mean loss of the
// last five of 40 steps is well below the first step's.
TEST(GptTraining, LossFallsOnTheShippedCorpus) {
  Scratch s;
  for (const std::string model : {"gpt3-52k", "gpt2"}) {
    SCOPED_TRACE(model);
    const test::MtResult r =
        test::run_training(model,
                           test::corpus_options(40, "1e-2") + " max_target_length=64" +
                               (model == "gpt2" ? kSmallGpt2 : ""),
                           s.root, model);
    ASSERT_EQ(r.code, 0) << r.out;
    const std::vector<std::string> l = losses(s.root / model);
    ASSERT_EQ(l.size(), 40u) << r.out;
    EXPECT_LT(test::last_five_mean(l), std::stod(l[0]) - 1.0) << r.out;
  }
}

// 8 steps straight, or 4 then a restart to 8: the losses of steps 5..8 and the final
// parameters (the position table among them) are bitwise identical (CPU, fixed thread count).
TEST(GptTraining, ResumedRunEqualsStraightRun) {
  Scratch s;
  for (const std::string model : {"gpt3-52k", "gpt2"}) {
    SCOPED_TRACE(model);
    auto run = [&](const std::string& name, int steps) {
      const test::MtResult r = test::run_training(
          model,
          test::resume_options(4, 8) + " vocab_size=512 max_target_length=32 steps=" +
              std::to_string(steps) + (model == "gpt2" ? kSmallGpt2 : ""),
          s.root, name);
      EXPECT_EQ(r.code, 0) << r.out;
    };
    const std::string straight = model + "_straight", resumed = model + "_resumed";
    run(straight, 8);
    run(resumed, 4);
    run(resumed, 8);
    ASSERT_NO_FATAL_FAILURE(test::expect_same_runs(s.root / straight, s.root / resumed, 8));
    EXPECT_NE(slurp(s.root / straight / "checkpoints" / "8" / "params.safetensors")
                  .find("position_embedding"),
              std::string::npos);
  }
}

// `mt models` lists the named configs with the published parameter counts (tied embeddings:
// the LM head is the token table): GPT-2 124M / 355M / 774M / 1.5B as Hugging Face counts them,
// MaxText's gpt3-52k, -6b and -175b.
TEST(GptModel, NamedConfigsHaveThePublishedSizes) {
  test::expect_named_sizes({{"gpt2", "124.4M"},
                            {"gpt2-medium", "354.8M"},
                            {"gpt2-large", "774.0M"},
                            {"gpt2-xl", "1.56B"},
                            {"gpt3-52k", "52.5K"},
                            {"gpt3-6b", "5.59B"},
                            {"gpt3-175b", "174.78B"}},
                           "gpt");
}

// Bad input, each refused before any work with exit code 2 and one paragraph naming it.
TEST(GptBadInput, IsRefusedWithOneClearError) {
  Scratch s;
  expect_refused("run --model=gpt3-52k head_dim=4 steps=1", "head_dim=4");
  expect_refused("run --model=gpt3-52k max_target_length=4096 steps=1",
                 "trainable_position_size=2048");
  expect_refused("run --model=gpt3-52k mlp_activations=[silu,linear] steps=1", "mlp_activations");
  expect_refused("run --model=gpt3-52k trainable_position_size=-1 steps=1",
                 "trainable_position_size");
  // config.json: fields mt does not implement, and impossible shapes.
  const std::vector<std::pair<std::string, std::string>> edits = {
      {"\"scale_attn_by_inverse_layer_idx\": false", "\"scale_attn_by_inverse_layer_idx\": true"},
      {"\"reorder_and_upcast_attn\": false", "\"reorder_and_upcast_attn\": true"},
      {"\"scale_attn_weights\": true", "\"scale_attn_weights\": false"},
      {"\"add_cross_attention\": false", "\"add_cross_attention\": true"},
      {"\"activation_function\": \"gelu_new\"", "\"activation_function\": \"quick_gelu\""},
      {"\"n_head\": 4", "\"n_head\": 5"},
      {"\"n_embd\": 32", "\"n_embd\": 32, \"rope_theta\": 10000.0"}};
  const std::vector<std::string> says = {"scale_attn_by_inverse_layer_idx=true",
                                         "reorder_and_upcast_attn=true",
                                         "scale_attn_weights=false",
                                         "add_cross_attention=true",
                                         "activation_function=quick_gelu",
                                         "n_embd must be a multiple of n_head",
                                         "rope_theta"};
  for (size_t i = 0; i < edits.size(); ++i) {
    const fs::path dir = test::with_config(s, kGolden, "tied", "config.json");
    edit_file(dir / "config.json", edits[i].first, edits[i].second);
    expect_refused("score hf_path=" + dir.string() + " tokens=1,2,3", says[i]);
    fs::remove_all(dir);
  }
  // An MLP of another width than the weights have: bad input naming the tensor.
  {
    const fs::path dir = test::with_config(s, kGolden, "untied", "config.json");
    edit_file(dir / "config.json", "\"n_inner\": 48", "\"n_inner\": 64");
    const test::MtResult r = test::run_mt("score hf_path=" + dir.string() + " tokens=1,2,3", 60);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("'transformer.h.0.mlp.c_fc.weight'"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("config.json and the weights disagree"), std::string::npos) << r.out;
  }
  // An mt checkpoint of another width: every disagreeing tensor named, exit code 2.
  {
    const std::string common =
        " steps=2 eval_interval=-1 max_target_length=32 num_threads=2 "
        "base_output_directory=" +
        s.root.string();
    test::MtResult r = test::run_mt(
        "run --model=gpt3-52k checkpoint_period=2 async_checkpointing=false run_name=a" + common,
        60);
    ASSERT_EQ(r.code, 0) << r.out;
    r = test::run_mt(
        "run --model=gpt3-52k base_emb_dim=32 head_dim=16 run_name=b "
        "load_parameters_path=" +
            (s.root / "a" / "checkpoints" / "2").string() + common,
        60);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.out.find("tensor 'position_embedding' has shape [2048, 16] in the checkpoint but "
                         "[2048, 32] in the model"),
              std::string::npos)
        << r.out;
  }
}

}  // namespace
}  // namespace mt
