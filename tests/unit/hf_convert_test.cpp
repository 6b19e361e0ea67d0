// Hugging Face interop: import a transformers LlamaForCausalLM directory, check its logits
// against transformers, export it back and get the same tensors; hf_path= for score.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <tuple>

#include "checkpoint_manager.h"
#include "config_loader.h"
#include "family_test_support.h"
#include "hf_interop.h"
#include "model_runner.h"
#include "mt/data.h"
#include "safetensors.h"
#include "test_support.h"
#include "tokenizer_bpe.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

// The golden model's config.json, as transformers 4.44 wrote it (tests/golden/llama_gqa.json).
const char* kConfig = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
  "max_position_embeddings": 128, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "rope_scaling": null, "tie_word_embeddings": false, "attention_bias": false,
  "attention_dropout": 0.0, "mlp_bias": false, "initializer_range": 0.02, "pretraining_tp": 1,
  "torch_dtype": "float32", "bos_token_id": null, "eos_token_id": null, "pad_token_id": null,
  "use_cache": true, "transformers_version": "4.44.2"})";

struct Dirs {
  fs::path root = fs::temp_directory_path() / ("mt_hf_" + std::to_string(::getpid()));
  fs::path hf = root / "hf", mt = root / "mt", back = root / "back";
  Dirs() {
    fs::remove_all(root);
    fs::create_directories(hf);
    std::ofstream(hf / "config.json") << kConfig;
    // model.safetensors: the golden file's parameters only.
    SafeTensorsFile g(test::source_dir() + "/tests/golden/llama_gqa.safetensors");
    std::vector<SafeTensorsEntry> e;
    for (const auto& n : g.names()) {
      if (n.rfind("model.", 0) != 0 && n != "lm_head.weight") continue;
      const auto& i = g.info(n);
      e.emplace_back(n, i.dtype, i.shape, i.data);
    }
    write_safetensors(hf / "model.safetensors", e);
    fs::copy_file(test::source_dir() + "/data/tokenizer.json", hf / "tokenizer.json");
  }
  ~Dirs() { fs::remove_all(root); }
};

int mt_cmd(const std::string& args, std::string& out) {
  return test::run_command("MT_PLUGIN_PATH= " + test::mt_exe() + " " + args, out);
}

TEST(HfConvert, ImportMatchesTransformersAndExportRoundTrips) {
  Dirs d;
  std::string out;
  ASSERT_EQ(
      mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 0)
      << out;
  ASSERT_TRUE(fs::exists(d.mt / "model.yml")) << out;
  ASSERT_TRUE(fs::exists(d.mt / "checkpoints" / "0" / "params.safetensors")) << out;
  EXPECT_TRUE(fs::exists(d.mt / "tokenizer.json"));

  // The imported model's logits equal transformers' (the golden logits).
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.config_file = (d.mt / "model.yml").string();
  ModelRunner r(load_config(req), test::plugins());
  std::map<std::string, Tensor> params;
  for (auto& p : r.params()) params[p.name] = p.value;
  load_parameters(d.mt, params);
  SafeTensorsFile g(test::source_dir() + "/tests/golden/llama_gqa.safetensors");
  const auto& ids = g.info("input_ids");
  HostBatch hb;
  hb.batch = ids.shape[0];
  hb.seq = ids.shape[1];
  hb.inputs.resize(static_cast<size_t>(ids.numel()));
  std::memcpy(hb.inputs.data(), ids.data, ids.nbytes());
  DeviceBatch db = r.upload(hb);
  Graph graph(r.backend(), false);
  const std::vector<float> got = test::to_vector(r.forward(graph, db));
  const auto& li = g.info("logits");
  std::vector<float> want(static_cast<size_t>(li.numel()));
  std::memcpy(want.data(), li.data, li.nbytes());
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    num = std::max(num, std::fabs(double(got[i]) - want[i]));
    den = std::max(den, std::fabs(double(want[i])));
  }
  EXPECT_LT(num / den, 1e-4);

  // Export: every tensor identical to the original, and config.json reads back the same.
  ASSERT_EQ(mt_cmd("convert --to=hf --config=" + (d.mt / "model.yml").string() +
                       " --input=" + d.mt.string() + " --output=" + d.back.string(),
                   out),
            0)
      << out;
  SafeTensorsFile a(d.hf / "model.safetensors"), b(d.back / "model.safetensors");
  EXPECT_EQ(a.names(), b.names());
  for (const auto& n : a.names()) {
    const auto &x = a.info(n), &y = b.info(n);
    EXPECT_EQ(x.shape, y.shape) << n;
    ASSERT_EQ(x.nbytes(), y.nbytes()) << n;
    EXPECT_EQ(std::memcmp(x.data, y.data, x.nbytes()), 0) << n << " differs after the round trip";
  }
  // Importing the export gives the same mt config.
  fs::path again = d.root / "again";
  ASSERT_EQ(
      mt_cmd("convert --from=hf --input=" + d.back.string() + " --output=" + again.string(), out),
      0)
      << out;
  std::ifstream y1(d.mt / "model.yml"), y2(again / "model.yml");
  std::string l1, l2;
  // The comment lines name different inputs, and tokenizer_path each output directory.
  auto body = [](std::ifstream& y) {
    std::string all;
    for (std::string l; std::getline(y, l);)
      if (l.rfind("#", 0) != 0 && l.rfind("tokenizer_path:", 0) != 0) all += l + "\n";
    return all;
  };
  EXPECT_EQ(body(y1), body(y2));
}

// `mt convert --to=hf` without --input exports the model's initial weights (init_weights_seed):
// imported back (`mt convert --from=hf`), they are the parameters ModelRunner::init_parameters
// gives for that seed, bit for bit.
TEST(HfConvert, ExportWithoutInputWritesTheInitialWeights) {
  Dirs d;
  std::string out;
  ASSERT_EQ(
      mt_cmd("convert --to=hf --model=llama-test init_weights_seed=5 --output=" + d.back.string(),
             out),
      0)
      << out;
  ASSERT_EQ(
      mt_cmd("convert --from=hf --input=" + d.back.string() + " --output=" + d.mt.string(), out), 0)
      << out;
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  ModelRunner r(load_config(req), test::plugins());
  r.init_parameters(5);
  SafeTensorsFile ck(d.mt / "checkpoints" / "0" / "params.safetensors");
  ASSERT_EQ(ck.names().size(), r.params().size());
  for (auto& p : r.params()) {
    const auto& i = ck.info(p.name);
    ASSERT_EQ(i.dtype, "F32") << p.name;
    std::vector<float> v(static_cast<size_t>(i.numel()));
    std::memcpy(v.data(), i.data, i.nbytes());
    EXPECT_EQ(v, test::to_vector(p.value)) << p.name;
  }
  // model.yml holds the command's values as YAML (before: as typed, so " # " began a comment
  // and a leading '*' an alias: the value cut short, or the file unreadable).
  const fs::path c = d.root / "c";
  ASSERT_EQ(mt_cmd("convert --from=hf --input=" + d.back.string() + " --output=" + c.string() +
                       " 'prompt=Once upon # a time' 'dataset_path=*.jsonl'",
                   out),
            0)
      << out;
  ASSERT_EQ(mt_cmd("config --config=" + (c / "model.yml").string(), out), 0) << out;
  EXPECT_NE(out.find("prompt: \"Once upon # a time\""), std::string::npos) << out;
  EXPECT_NE(out.find("dataset_path: \"*.jsonl\""), std::string::npos) << out;
  // --from=hf still needs its input.
  EXPECT_EQ(mt_cmd("convert --from=hf --output=" + (d.root / "x").string(), out), 2) << out;
  // A run's checkpoint exports as the run's model with none named (before: base.yml's
  // llama-small, refused with a page of shape differences).
  ASSERT_EQ(mt_cmd("run --model=mixtral-test dataset_type=synthetic steps=1 num_threads=1 "
                   "eval_interval=-1 enable_tensorboard=false base_output_directory=" +
                       d.root.string() + " run_name=r",
                   out),
            0)
      << out;
  ASSERT_EQ(mt_cmd("convert --to=hf --input=" + (d.root / "r").string() +
                       " --output=" + (d.root / "r_hf").string(),
                   out),
            0)
      << out;
  std::ifstream in(d.root / "r_hf" / "config.json");
  const std::string json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(json.find("\"num_local_experts\": 8"), std::string::npos) << json;
  // load_parameters_path= is the checkpoint as --input is (before: ignored, and the default
  // model's random initial weights written).
  ASSERT_EQ(mt_cmd("convert --to=hf load_parameters_path=" + (d.root / "r").string() +
                       " --output=" + (d.root / "r_hf2").string(),
                   out),
            0)
      << out;
  auto bytes = [](const fs::path& f) {
    std::ifstream s(f, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(s)), std::istreambuf_iterator<char>());
  };
  EXPECT_EQ(bytes(d.root / "r_hf2" / "model.safetensors"),
            bytes(d.root / "r_hf" / "model.safetensors"));
  // mt plan plans what mt decode runs: the checkpoint's model (before: base.yml's llama-small)
  // and a prompt_file's prompts as the batch (before: one sequence).
  std::ofstream(d.root / "prompts.txt") << "one\ntwo\nthree\n";
  ASSERT_EQ(mt_cmd("plan load_parameters_path=" + (d.root / "r").string() +
                       " prompt_file=" + (d.root / "prompts.txt").string() + " 2>&1",
                   out),
            0)
      << out;
  EXPECT_NE(out.find("mt plan: mixtral-test (mixtral family)"), std::string::npos) << out;
  EXPECT_NE(out.find("decode (3 sequences"), std::string::npos) << out;
}

// quantization=int8 says which projections stay in the compute dtype (an input width not a
// multiple of 32: w_down of an MLP 80 wide; before, silently), and an end-of-sequence id the
// model cannot produce is a note, as transformers warns (before: refused, even by mt score).
TEST(HfConvert, Int8LeftoversAndAnUnreachableEosAreSaid) {
  Dirs d;
  std::string out;
  ASSERT_EQ(
      mt_cmd("convert --to=hf --model=llama-test base_mlp_dim=80 --output=" + d.back.string(), out),
      0)
      << out;
  ASSERT_EQ(mt_cmd("score hf_path=" + d.back.string() + " tokens=1,2,3 quantization=int8", out), 0)
      << out;
  EXPECT_NE(out.find("quantization=int8: 2 of 15 projection weights stay in float32"),
            std::string::npos)
      << out;
  std::ofstream(d.back / "generation_config.json") << R"({"eos_token_id": 70000})";
  ASSERT_EQ(mt_cmd("decode hf_path=" + d.back.string() + " tokens=1,2 max_target_length=5", out), 0)
      << out;
  EXPECT_NE(out.find("end-of-sequence id 70000 is outside the model's vocabulary"),
            std::string::npos)
      << out;
}

// mt decode of token ids stops at the end-of-sequence id of the tokenizer it has, as for text
// (before: the tokenizer was not loaded for ids, and they ran to max_target_length).
TEST(HfConvert, DecodeOfIdsStopsAtTheTokenizersEos) {
  Dirs d;
  std::string out;
  ASSERT_EQ(
      mt_cmd("convert --to=hf --model=llama-test vocab_size=8192 --output=" + d.back.string(), out),
      0)
      << out;
  auto ids_of = [](const std::string& o) {  // the line of ids (stderr is merged)
    std::vector<int32_t> v;
    const size_t at = o.find("5,6,7,");
    if (at == std::string::npos) return v;
    std::stringstream line(o.substr(at, o.find('\n', at) - at));
    for (std::string x; std::getline(line, x, ',');) v.push_back(std::stoi(x));
    return v;
  };
  const std::string cmd =
      "decode hf_path=" + d.back.string() + " tokens=5,6,7 max_target_length=12 2>/dev/null";
  ASSERT_EQ(mt_cmd(cmd, out), 0) << out;
  const std::vector<int32_t> free_run = ids_of(out);
  ASSERT_EQ(free_run.size(), 12u) << out;
  // The tokenizer beside the weights, its tokenizer_config.json naming the 2nd generated token
  // (one not generated before it) end of sequence.
  size_t stop = 4;
  while (stop < free_run.size() &&
         std::find(free_run.begin() + 3, free_run.begin() + static_cast<std::ptrdiff_t>(stop),
                   free_run[stop]) != free_run.begin() + static_cast<std::ptrdiff_t>(stop))
    ++stop;
  ASSERT_LT(stop, free_run.size());
  fs::copy_file(test::source_dir() + "/data/tokenizer.json", d.back / "tokenizer.json");
  auto tok = make_tokenizer((d.back / "tokenizer.json").string(), "");
  const std::string text = dynamic_cast<const BpeTokenizer&>(*tok).id_to_token(free_run[stop]);
  std::string esc;
  for (char c : text) esc += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  std::ofstream(d.back / "tokenizer_config.json") << "{\"eos_token\": \"" << esc << "\"}";
  ASSERT_EQ(mt_cmd(cmd, out), 0) << out;
  EXPECT_EQ(ids_of(out),
            std::vector<int32_t>(free_run.begin(),
                                 free_run.begin() + static_cast<std::ptrdiff_t>(stop) + 1))
      << out;
}

// mt score output= keeps every token's logits for the file: more than the machine's memory is
// refused before scoring, naming the sizes (before: an out-of-memory error after the whole pass).
TEST(HfConvert, ScoreOutputThatCannotFitIsRefusedFirst) {
  Dirs d;
  std::string out;
  const int64_t vocab = 262144;
  ASSERT_EQ(mt_cmd("convert --to=hf --model=llama-test vocab_size=" + std::to_string(vocab) +
                       " --output=" + d.back.string(),
                   out),
            0)
      << out;
  const double memory = static_cast<double>(::sysconf(_SC_PHYS_PAGES)) *
                        static_cast<double>(::sysconf(_SC_PAGE_SIZE));
  const auto n = static_cast<int64_t>(memory / (2.0 * static_cast<double>(vocab) * 4)) + 100;
  {
    std::ofstream f(d.root / "ids.txt");
    for (int64_t i = 0; i < n; ++i) f << (i % 1000) << (i + 1 < n ? "," : "\n");
  }
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(mt_cmd("score hf_path=" + d.back.string() + " input=" + (d.root / "ids.txt").string() +
                       " output=" + (d.root / "logits.safetensors").string(),
                   out),
            2)
      << out;
  EXPECT_NE(out.find("would hold the logits of " + std::to_string(n) + " tokens"),
            std::string::npos)
      << out;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 60.0);
  EXPECT_FALSE(fs::exists(d.root / "logits.safetensors"));
}

TEST(HfConvert, HfPathScoresLikeTheConvertedCheckpoint) {
  Dirs d;
  std::string out, a, b;
  ASSERT_EQ(
      mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 0)
      << out;
  ASSERT_EQ(mt_cmd("score hf_path=" + d.hf.string() + " tokens=3,17,200,5,9,1,77", a), 0) << a;
  ASSERT_EQ(mt_cmd("score --config=" + (d.mt / "model.yml").string() +
                       " load_parameters_path=" + d.mt.string() + " tokens=3,17,200,5,9,1,77",
                   b),
            0)
      << b;
  EXPECT_NE(a.find("mean loss"), std::string::npos) << a;
  EXPECT_EQ(a.substr(a.find("tokens 7")), b.substr(b.find("tokens 7")));
}

TEST(HfConvert, BadInputIsRefused) {
  Dirs d;
  std::string out;
  fs::create_directories(d.mt);
  std::ofstream(d.mt / "x") << "keep me";
  EXPECT_EQ(
      mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 2)
      << out;
  EXPECT_NE(out.find("not empty"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(d.mt / "x"));  // nothing existing is lost
  EXPECT_EQ(mt_cmd("convert --input=a --output=b", out), 2) << out;
  // Quantization keys change nothing convert writes (before: accepted; model.yml kept them).
  EXPECT_EQ(mt_cmd("convert --to=hf --model=llama-test quantization=int8 --output=" +
                       (d.root / "q").string(),
                   out),
            2)
      << out;
  EXPECT_NE(out.find("has no effect on mt convert"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d.root / "q"));
  // Native llama settings transformers' Llama has no field for are refused, nothing written
  // (before: exported without them, logits 1.3-3.4 off mt's own).
  for (const char* s : {"sliding_window_size=8", "attn_logits_soft_cap=1.0",
                        "final_logits_soft_cap=2.0", "partial_rotary_factor=0.5"}) {
    EXPECT_EQ(mt_cmd(std::string("convert --to=hf --model=llama-test ") + s +
                         " --output=" + (d.root / "native").string(),
                     out),
              2)
        << s << out;
    EXPECT_NE(out.find("has no Llama config.json form"), std::string::npos) << s << out;
    EXPECT_FALSE(fs::exists(d.root / "native")) << s;
  }
  EXPECT_EQ(
      mt_cmd("convert --from=hf --input=/nonexistent --output=" + (d.root / "o").string(), out), 2)
      << out;
  EXPECT_NE(out.find("/nonexistent"), std::string::npos) << out;
  std::string cfg = kConfig;
  cfg.replace(cfg.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
  std::ofstream(d.hf / "config.json") << cfg;
  EXPECT_EQ(
      mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + (d.root / "o2").string(),
             out),
      2)
      << out;
  EXPECT_NE(out.find("attention_bias"), std::string::npos) << out;
  // An output that is a file (before: "internal error: filesystem error", exit 1).
  EXPECT_EQ(mt_cmd("convert --to=hf --model=llama-test --output=" + (d.mt / "x").string(), out), 2)
      << out;
  EXPECT_NE(out.find("exists and is not a directory"), std::string::npos) << out;
  // A write that fails part-way (a file size limit; before: SIGXFSZ killed mt silently and left
  // a 300-byte config.json under the output's name, which a retry refused as not empty) leaves
  // nothing under the name and no staging directory.
  out.clear();
  const int code = test::run_command(
      "MT_PLUGIN_PATH= prlimit --fsize=3000 " + test::mt_exe() +
          " convert --to=hf --model=llama-test --output=" + (d.root / "limited").string(),
      out);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("File too large"), std::string::npos) << out;
  EXPECT_FALSE(fs::exists(d.root / "limited"));
  for (const auto& e : fs::directory_iterator(d.root))
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << e.path();
}

// ---- exact import (issue 16) -----------------------------------------------------------------
// The golden Llama 3.1 model (rope theta 500000, llama3 frequency scaling, tied embeddings) as a
// Hugging Face directory whose config.json is written the way transformers 4 does (top-level
// rope_theta, rope_scaling) or transformers 5 does (rope_parameters, dtype).
struct Llama31Dir {
  fs::path root = fs::temp_directory_path() / ("mt_hf31_" + std::to_string(::getpid()));
  SafeTensorsFile golden{test::source_dir() + "/tests/golden/llama31.safetensors"};
  explicit Llama31Dir(bool v5, const std::string& extra_fields = "") {
    fs::remove_all(root);
    fs::create_directories(root);
    const std::string rope =
        R"("rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32)";
    std::ofstream(root / "config.json")
        << R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
          "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu",
          "max_position_embeddings": 128, "rms_norm_eps": 1e-06, "tie_word_embeddings": true,
          "attention_bias": false, "mlp_bias": false, )"
        << (v5 ? R"("dtype": "float32", "transformers_version": "5.0.0", "rope_parameters": {"rope_theta": 500000.0, )" +
                     rope + "}"
               : R"("torch_dtype": "float32", "rope_theta": 500000.0, "rope_scaling": {)" + rope +
                     "}")
        << extra_fields << "}";
    write_weights(true);
  }
  // The golden parameters (and an untied lm_head.weight when `tied` is false).
  void write_weights(bool tied, int layers = 2) const {
    std::vector<SafeTensorsEntry> e;
    for (const auto& n : golden.names()) {
      if (n.rfind("model.", 0) != 0) continue;
      if (n.rfind("model.layers.", 0) == 0 && std::stoi(n.substr(13)) >= layers) continue;
      const auto& i = golden.info(n);
      e.emplace_back(n, i.dtype, i.shape, i.data);
    }
    if (!tied) {
      const auto& i = golden.info("model.embed_tokens.weight");
      e.emplace_back("lm_head.weight", i.dtype, i.shape, i.data);
    }
    write_safetensors(root / "model.safetensors", e);
  }
  ~Llama31Dir() { fs::remove_all(root); }
  std::vector<int32_t> ints(const std::string& name) const {
    const auto& i = golden.info(name);
    std::vector<int32_t> v(static_cast<size_t>(i.numel()));
    std::memcpy(v.data(), i.data, i.nbytes());
    return v;
  }
  std::vector<float> floats(const std::string& name) const {
    const auto& i = golden.info(name);
    std::vector<float> v(static_cast<size_t>(i.numel()));
    std::memcpy(v.data(), i.data, i.nbytes());
    return v;
  }
};

std::string join_ids(const std::vector<int32_t>& ids, size_t begin, size_t end) {
  std::string s;
  for (size_t i = begin; i < end; ++i) {
    if (i > begin) s += ',';
    s += std::to_string(ids[i]);
  }
  return s;
}

// Both config.json forms give transformers' logits (the v5 form was read with theta 10000 and no
// llama3 scaling: every logit wrong, with only a note about an unused field).
TEST(HfImport, TransformersFiveAndLegacyConfigsGiveTheGoldenLogits) {
  for (const bool v5 : {false, true}) {
    Llama31Dir d(v5);
    const std::vector<int32_t> ids = d.ints("input_ids");  // [2, 16]
    const std::vector<float> want = d.floats("logits");    // [2, 16, 256]
    for (size_t b = 0; b < 2; ++b) {
      std::string out;
      const fs::path f = d.root / ("logits" + std::to_string(b) + ".safetensors");
      ASSERT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=" +
                           join_ids(ids, b * 16, b * 16 + 16) + " output=" + f.string(),
                       out),
                0)
          << out;
      EXPECT_EQ(out.find("note"), std::string::npos) << "v5=" << v5 << ": " << out;
      SafeTensorsFile got(f);
      const auto& li = got.info("logits");
      ASSERT_EQ(li.numel(), 16 * 256);
      std::vector<float> g(static_cast<size_t>(li.numel()));
      std::memcpy(g.data(), li.data, li.nbytes());
      double num = 0, den = 0;
      for (size_t i = 0; i < 16 * 256; ++i) {
        num = std::max(num, std::fabs(double(g[i]) - want[b * 16 * 256 + i]));
        den = std::max(den, std::fabs(double(want[b * 16 * 256 + i])));
      }
      EXPECT_LT(num / den, 1e-4) << "v5=" << v5 << " row " << b;
    }
  }
}

// Fields config.json leaves out take transformers' defaults, not base.yml's: llama3's (and
// yarn's) original_max_position_embeddings is max_position_embeddings (before: refused for llama3,
// base.yml's 8192 for yarn, logits ~1.2 off), rms_norm_eps is LlamaConfig's 1e-6 (before: 1e-5).
// A partial_rotary_factor below 1, which transformers' Llama ignores, is refused (before: mt
// rotated part of each head, 1.5 off transformers).
TEST(HfImport, AbsentFieldsAreTransformersDefaults) {
  const auto edit = test::edit_file;
  Llama31Dir d(true);
  edit(d.root / "config.json", ",\n           \"original_max_position_embeddings\": 32", "");
  edit(d.root / "config.json", "\"max_position_embeddings\": 128",
       "\"max_position_embeddings\": 32");
  edit(d.root / "config.json", "\"rms_norm_eps\": 1e-06, ", "");
  std::string out;
  ASSERT_EQ(mt_cmd("config hf_path=" + d.root.string(), out), 0) << out;
  EXPECT_NE(out.find("\noriginal_max_position_embeddings: 32\n"), std::string::npos) << out;
  EXPECT_NE(out.find("\nnormalization_layer_epsilon: 1.0e-06\n"), std::string::npos) << out;
  const std::vector<int32_t> ids = d.ints("input_ids");
  const std::vector<float> want = d.floats("logits");
  const fs::path f = d.root / "logits.safetensors";
  ASSERT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=" + join_ids(ids, 0, 16) +
                       " output=" + f.string(),
                   out),
            0)
      << out;
  SafeTensorsFile got(f);
  const auto& li = got.info("logits");
  ASSERT_EQ(li.numel(), 16 * 256);
  std::vector<float> g(static_cast<size_t>(li.numel()));
  std::memcpy(g.data(), li.data, li.nbytes());
  EXPECT_LT(test::scaled_err(g, std::vector<float>(want.begin(), want.begin() + 16 * 256)), 1e-4);
  edit(d.root / "config.json", "\"rope_type\"", "\"partial_rotary_factor\": 0.5, \"rope_type\"");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("partial_rotary_factor=0.5"), std::string::npos) << out;
  // A field that is not a number, and heads that do not divide the width (before: "internal
  // error: stod", exit 1, and a division by zero, SIGFPE).
  edit(d.root / "config.json", "\"partial_rotary_factor\": 0.5",
       "\"partial_rotary_factor\": \"x\"");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("partial_rotary_factor is 'x'; it must be a number"), std::string::npos)
      << out;
  edit(d.root / "config.json", "\"partial_rotary_factor\": \"x\", ", "");
  edit(d.root / "config.json", "\"num_attention_heads\": 4", "\"num_attention_heads\": 0");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("is not a multiple of num_attention_heads=0"), std::string::npos) << out;
  edit(d.root / "config.json", "\"num_attention_heads\": 0", "\"num_attention_heads\": 4");
  // A Hugging Face directory names no model: messages name the directory (before: "mt plan:
  // (llama family)", and an empty name in the mesh's refusals).
  ASSERT_EQ(mt_cmd("plan hf_path=" + d.root.string(), out), 0) << out;
  EXPECT_NE(out.find("mt plan: the model at hf_path=" + d.root.string() + " (llama family)"),
            std::string::npos)
      << out;
  // A boolean that is not one (before: read as false, so the tied model wanted an lm_head), and
  // a null epsilon, which transformers' norms cannot add (before: 1e-6 taken silently).
  edit(d.root / "config.json", "\"tie_word_embeddings\": true", "\"tie_word_embeddings\": \"yes\"");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("tie_word_embeddings is 'yes'; it must be true or false"), std::string::npos)
      << out;
  edit(d.root / "config.json", "\"tie_word_embeddings\": \"yes\"", "\"tie_word_embeddings\": true");
  edit(d.root / "config.json", "\"num_key_value_heads\"",
       "\"rms_norm_eps\": null, \"num_key_value_heads\"");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("sets rms_norm_eps to null"), std::string::npos) << out;
}

// `mt decode` of the directory from token ids (stdout: the ids; stderr is dropped).
int decode_ids(const fs::path& dir, const std::vector<int32_t>& prompt, size_t max_len,
               std::string& out) {
  return mt_cmd("decode hf_path=" + dir.string() + " tokens=" + join_ids(prompt, 0, prompt.size()) +
                    " max_target_length=" + std::to_string(max_len) + " 2>/dev/null",
                out);
}

// Greedy decode from token ids equals transformers' generate (the golden's prompt and ids).
TEST(HfImport, DecodeFromIdsEqualsTransformersGenerate) {
  Llama31Dir d(true);
  const std::vector<int32_t> prompt = d.ints("generate_prompt"), want = d.ints("generate_ids");
  std::string out;
  ASSERT_EQ(decode_ids(d.root, prompt, want.size(), out), 0) << out;
  // stdout holds the ids alone; the throughput line goes to stderr (merged here).
  const std::string line = join_ids(want, 0, want.size()) + "\n";
  const size_t at = out.find(line);
  EXPECT_TRUE(at != std::string::npos && (at == 0 || out[at - 1] == '\n')) << out;
  // MaxText's name for top-k sampling is accepted.
  ASSERT_EQ(mt_cmd("decode hf_path=" + d.root.string() +
                       " tokens=1,2 max_target_length=6 "
                       "decode_sampling_strategy=topk decode_sampling_top_k=3 2>/dev/null",
                   out),
            0)
      << out;
}

// generation_config.json's eos ids stop decoding as they stop transformers' generate: the
// continuation ends at the first of them.
TEST(HfImport, GenerationConfigEosIdsStopDecoding) {
  Llama31Dir d(true);
  const std::vector<int32_t> prompt = d.ints("generate_prompt"), want = d.ints("generate_ids");
  // A continuation token at its first occurrence (the latest such one): generate stops there.
  const auto begin = want.begin() + static_cast<ptrdiff_t>(prompt.size());
  size_t stop = prompt.size();
  for (size_t i = prompt.size(); i < want.size(); ++i)
    if (std::find(begin, want.begin() + static_cast<ptrdiff_t>(i), want[i]) ==
        want.begin() + static_cast<ptrdiff_t>(i))
      stop = i;
  ASSERT_LT(stop + 1, want.size()) << "the continuation's last token is its only new one";
  std::ofstream(d.root / "generation_config.json")
      << R"({"bos_token_id": 1, "eos_token_id": [255, )" << want[stop] << "]}";
  std::string out;
  ASSERT_EQ(decode_ids(d.root, prompt, want.size(), out), 0) << out;
  EXPECT_NE(out.find(join_ids(want, 0, stop + 1) + "\n"), std::string::npos)
      << "stops at id " << want[stop] << ": " << out;
  // Malformed special-token files are refused with the file and the field.
  std::ofstream(d.root / "generation_config.json") << R"({"eos_token_id": "two"})";
  EXPECT_EQ(mt_cmd("decode hf_path=" + d.root.string() + " tokens=1,2 2>&1", out), 2);
  EXPECT_NE(out.find("eos_token_id must be a token id"), std::string::npos) << out;
  // An id the model cannot produce is noted and left out, as transformers warns (the other
  // still stops decoding).
  std::ofstream(d.root / "generation_config.json") << R"({"eos_token_id": [1, 1000]})";
  EXPECT_EQ(mt_cmd("decode hf_path=" + d.root.string() + " tokens=1,2 2>&1", out), 0);
  EXPECT_NE(out.find("1000 is outside the model's vocabulary"), std::string::npos) << out;
}

TEST(HfImport, TokenizerConfigSpecialTokens) {
  const fs::path dir = fs::temp_directory_path() / ("mt_tokcfg_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  EXPECT_TRUE(read_hf_token_settings(dir).eos_token_ids.empty());  // no files: nothing said
  std::ofstream(dir / "tokenizer_config.json")
      << R"({"add_bos_token": false, "bos_token": {"content": "<s>", "lstrip": false},
             "eos_token": "</s>"})";
  std::ofstream(dir / "generation_config.json") << R"({"bos_token_id": 1, "eos_token_id": 2})";
  const HfTokenSettings t = read_hf_token_settings(dir);
  EXPECT_EQ(t.bos_token, "<s>");
  EXPECT_EQ(t.eos_token, "</s>");
  ASSERT_TRUE(t.add_bos_token.has_value());
  EXPECT_FALSE(*t.add_bos_token);
  EXPECT_EQ(t.bos_token_id, 1);
  EXPECT_EQ(t.eos_token_ids, std::vector<int32_t>{2});
  std::ofstream(dir / "tokenizer_config.json") << R"({"bos_token": 7})";
  EXPECT_THROW(read_hf_token_settings(dir), UsageError);
  std::ofstream(dir / "tokenizer_config.json") << R"({"add_bos_token": "yes"})";
  EXPECT_THROW(read_hf_token_settings(dir), UsageError);
  // Without add_bos_token, tokenizer.json's post-processor decides, as a fast tokenizer applies
  // it: Llama's TemplateProcessing starting with "<s>" adds it, GPT-2's ByteLevel (or none)
  // adds nothing (before: base.yml's add_bos: true put GPT-2's <|endoftext|> before every
  // prompt, which transformers does not).
  std::ofstream(dir / "tokenizer_config.json") << R"({"eos_token": "</s>"})";
  for (const auto& [post, adds] :
       {std::pair{R"({"type": "ByteLevel", "add_prefix_space": true})", false},
        std::pair{"null", false},
        std::pair{R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>",
                  "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]})",
                  true},
        std::pair{R"({"type": "Sequence", "processors": [{"type": "ByteLevel"},
                  {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}]}]})",
                  false}}) {
    std::ofstream(dir / "tokenizer.json") << std::string(R"({"post_processor": )") + post + "}";
    const HfTokenSettings p = read_hf_token_settings(dir);
    ASSERT_TRUE(p.add_bos_token.has_value()) << post;
    EXPECT_EQ(*p.add_bos_token, adds) << post;
  }
  fs::remove_all(dir);
}

// GPT-2's directory: mt decode's prompt is the ids transformers' tokenizer gives, with no
// <|endoftext|> in front (8 tokens for "It is a truth"); add_bos=true set by the user adds it.
TEST(HfImport, Gpt2PromptsGetNoBosAsInTransformers) {
  const std::string dir = test::source_dir() + "/tests/golden/gpt2/tied";
  std::string out;
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir + " prompt=\"It is a truth\" max_target_length=12", out),
            0);
  EXPECT_NE(out.find("prefill 8 tokens"), std::string::npos) << out;
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir +
                       " prompt=\"It is a truth\" max_target_length=12 add_bos=true",
                   out),
            0);
  EXPECT_NE(out.find("prefill 9 tokens"), std::string::npos) << out;
  // max_target_length bounds the prompt and its continuation: 1 + 1 ids at 2 (before: a prompt
  // of max_target_length tokens got one more), and a prompt that leaves no room is refused
  // before it is printed (before: the error ran into the streamed prompt).
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir + " tokens=5 max_target_length=2", out), 0);
  EXPECT_EQ(std::count(out.begin(), out.end(), ','), 1) << out;
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir + " tokens=5,6 max_target_length=2", out), 2);
  EXPECT_NE(out.find("leaves no room for a generated token"), std::string::npos) << out;
  EXPECT_EQ(
      mt_cmd("decode hf_path=" + dir + " prompt=\"Hi there friend\" max_target_length=4", out), 2);
  EXPECT_EQ(out.find("Hi there friend"), std::string::npos) << out;
  // In a prompt_file, the prompt too long is named (before: "A prompt has ...").
  const std::string pf = ::testing::TempDir() + "mt_prompts_" + std::to_string(::getpid()) + ".txt";
  std::ofstream(pf) << "Hi\nHi there friend, how are you\n";
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir + " prompt_file=" + pf + " max_target_length=5", out),
            2);
  EXPECT_NE(out.find("Prompt 2 of prompt_file=" + pf + " has "), std::string::npos) << out;
  fs::remove(pf);
  // tokens= with no ids is refused (before: the default prompt was decoded), and mt score
  // refuses the int8 KV cache it has no use for (before: accepted, the perplexity the f32's).
  EXPECT_EQ(mt_cmd("decode hf_path=" + dir + " tokens= max_target_length=10", out), 2);
  EXPECT_NE(out.find("holds no token id"), std::string::npos) << out;
  EXPECT_EQ(mt_cmd("score hf_path=" + dir + " tokens=1,2,3 quantize_kvcache=true", out), 2);
  EXPECT_NE(out.find("has no effect on mt score"), std::string::npos) << out;
}

// With hf_path the config is the directory's alone: no named model beneath it (its context
// length and tokenizer leaked in: 256 tokens, data/tokenizer.json), the context bounded by
// max_position_embeddings, and a longer input scored by a strategy that is printed.
TEST(HfImport, TheDirectoryAloneConfiguresTheModel) {
  Llama31Dir d(false);
  std::string out;
  ASSERT_EQ(mt_cmd("config hf_path=" + d.root.string(), out), 0) << out;
  EXPECT_NE(out.find("model_name: \"\""), std::string::npos) << out;
  EXPECT_NE(out.find("max_target_length: 128"), std::string::npos) << out;
  EXPECT_NE(out.find("max_position_embeddings: 128"), std::string::npos) << out;
  EXPECT_NE(out.find("tokenizer_path: \"\""), std::string::npos) << out;
  EXPECT_EQ(mt_cmd("config hf_path=" + d.root.string() + " max_target_length=129", out), 2) << out;
  EXPECT_NE(out.find("max_position_embeddings=128"), std::string::npos) << out;
  // The keys are named as config.json's (before: "command line"), and a named model is refused
  // (before: mistral-test's sliding window stayed under a llama config.json, and decode differed).
  ASSERT_EQ(mt_cmd("config --origins hf_path=" + d.root.string(), out), 0) << out;
  EXPECT_NE(out.find("config.json (hf_path)"), std::string::npos) << out;
  EXPECT_EQ(mt_cmd("decode --model=mistral-test hf_path=" + d.root.string() + " tokens=1,2", out),
            2)
      << out;
  EXPECT_NE(out.find("takes no named model (model_name=mistral-test"), std::string::npos) << out;
  // No tokenizer in the directory: text needs one named, never another model's.
  EXPECT_EQ(mt_cmd("decode hf_path=" + d.root.string() + " prompt=hello", out), 2) << out;
  EXPECT_NE(out.find("needs a tokenizer"), std::string::npos) << out;
  std::vector<int32_t> ids;
  for (int i = 0; i < 200; ++i) ids.push_back((i * 37) % 256);
  ASSERT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=" + join_ids(ids, 0, 200), out), 0)
      << out;
  EXPECT_NE(out.find("more than max_target_length=128: it is scored in 2 independent windows"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("tokens 200"), std::string::npos) << out;
  // Longer than the model's positions: no advice that cannot work (before: "Set
  // max_target_length=128 ... to score it as one sequence", already so).
  EXPECT_NE(out.find("positions for 128 tokens (max_position_embeddings), so it cannot be scored "
                     "as one sequence."),
            std::string::npos)
      << out;
  // A file of token ids needs no tokenizer (before: "needs a tokenizer for text").
  std::ofstream(d.root / "ids.txt") << "1,5,42\n7,9\n";
  ASSERT_EQ(
      mt_cmd("score hf_path=" + d.root.string() + " input=" + (d.root / "ids.txt").string(), out),
      0)
      << out;
  EXPECT_NE(out.find("read as token ids"), std::string::npos) << out;
  EXPECT_NE(out.find("tokens 5"), std::string::npos) << out;
}

// config.json that disagrees with the weights, or asks for numerics the family does not
// implement, is refused with the names; fields mt does not use are noted once.
TEST(HfImport, DisagreementsAndUnimplementedNumericsAreRefused) {
  std::string out;
  {
    Llama31Dir d(true);
    d.write_weights(/*tied=*/false);  // config.json: tie_word_embeddings true
    EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
    EXPECT_NE(out.find("lm_head.weight"), std::string::npos) << out;
  }
  const auto edit = test::edit_file;
  {
    Llama31Dir d(false);
    edit(d.root / "config.json", "\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
    EXPECT_NE(out.find("model.layers.1."), std::string::npos) << out;
  }
  for (const std::string field :
       {R"(, "sliding_window": 4096)", R"(, "attn_logit_softcapping": 50.0)"}) {
    Llama31Dir d(false, field);
    EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
    EXPECT_NE(out.find("does not implement"), std::string::npos) << field << out;
  }
  {
    Llama31Dir d(true);
    edit(d.root / "config.json", "\"factor\"", "\"mscale\": 2.0, \"factor\"");
    EXPECT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 2) << out;
    EXPECT_NE(out.find("rope_parameters.mscale"), std::string::npos) << out;
  }
  {
    Llama31Dir d(true, R"(, "some_new_field": 3)");
    ASSERT_EQ(mt_cmd("score hf_path=" + d.root.string() + " tokens=1,2,3", out), 0) << out;
    const size_t first = out.find("not used by mt: some_new_field=3");
    ASSERT_NE(first, std::string::npos) << out;
    EXPECT_EQ(out.find("not used by mt", first + 1), std::string::npos) << "noted twice: " << out;
  }
}

// Without an index every .safetensors file of the directory is read: a tensor in two of them is
// refused (before: the last file in name order gave its value, silently).
TEST(HfConvert, ATensorInTwoUnindexedShardsIsRefused) {
  Dirs d;
  std::string out;
  ASSERT_EQ(mt_cmd("score hf_path=" + d.hf.string() + " tokens=1,2,3", out), 0) << out;
  fs::rename(d.hf / "model.safetensors", d.hf / "a.safetensors");
  fs::copy_file(d.hf / "a.safetensors", d.hf / "b.safetensors");
  EXPECT_EQ(mt_cmd("score hf_path=" + d.hf.string() + " tokens=1,2,3", out), 2) << out;
  EXPECT_NE(out.find("is in both"), std::string::npos) << out;
  EXPECT_NE(out.find("b.safetensors"), std::string::npos) << out;
}

// With model.safetensors.index.json, each tensor comes from the shard it names, and the index
// and the shards agree (before: a stray copy in a later shard replaced the indexed tensor, loss
// 7.17 for 5.19; a tensor the index named but no shard held, or an index naming a missing
// shard, was found only as a missing tensor or a file that cannot be opened, exit 1).
TEST(HfConvert, AnIndexAndItsShardsMustAgree) {
  Dirs d;
  std::string out, want, got;
  const std::string score = "score hf_path=" + d.hf.string() + " tokens=3,17,200,5,9,1,77";
  ASSERT_EQ(mt_cmd(score, want), 0) << want;
  // a.safetensors: every tensor but the final norm; b.safetensors: the norm and a stray embedding
  // of zeros. The index puts the embedding in a.
  {
    SafeTensorsFile g(d.hf / "model.safetensors");
    std::vector<SafeTensorsEntry> a, b;
    std::vector<float> zeros;
    std::string map;
    for (const auto& n : g.names()) {
      const auto& i = g.info(n);
      (n == "model.norm.weight" ? b : a).emplace_back(n, i.dtype, i.shape, i.data);
      map += (map.empty() ? "" : ", ") + ("\"" + n + "\": ") +
             (n == "model.norm.weight" ? "\"b.safetensors\"" : "\"a.safetensors\"");
      if (n == "model.embed_tokens.weight") {
        ASSERT_EQ(i.dtype, "F32");
        zeros.assign(shape_numel(i.shape), 0.f);
        b.emplace_back(n, i.dtype, i.shape, zeros.data());
      }
    }
    write_safetensors(d.hf / "a.safetensors", a);
    write_safetensors(d.hf / "b.safetensors", b);
    std::ofstream(d.hf / "model.safetensors.index.json")
        << R"({"metadata": {}, "weight_map": {)" << map << "}}";
  }
  fs::remove(d.hf / "model.safetensors");
  ASSERT_EQ(mt_cmd(score, got), 0) << got;
  EXPECT_EQ(got.substr(got.find("tokens 7")), want.substr(want.find("tokens 7")));

  const std::string index = (d.hf / "model.safetensors.index.json").string();
  std::stringstream text;
  text << std::ifstream(index).rdbuf();
  const std::string good = text.str();
  auto refused = [&](const std::string& text, const std::string& needle) {
    std::ofstream(index) << text;
    EXPECT_EQ(mt_cmd(score, out), 2) << text << out;
    EXPECT_NE(out.find(needle), std::string::npos) << text << out;
  };
  std::string extra = good;
  extra.insert(extra.find("\"weight_map\": {") + 15, R"("model.bogus.weight": "a.safetensors", )");
  refused(extra,
          "puts the tensor \"model.bogus.weight\" in 'a.safetensors', which does not hold it");
  std::string missing = good;
  missing.replace(missing.find("b.safetensors"), 13, "c.safetensors");
  refused(missing, "names the shard 'c.safetensors'");
  // A tensor the index leaves out, held by two shards (a's and b's embeddings).
  std::string unnamed = good;
  const std::string embed = R"("model.embed_tokens.weight": "a.safetensors", )";
  ASSERT_NE(unnamed.find(embed), std::string::npos) << unnamed;
  unnamed.erase(unnamed.find(embed), embed.size());
  refused(unnamed, "and the index's weight_map does not name it");
  refused(R"({"weight_map": [}})", "is not valid JSON (at byte");
  refused(R"({"metadata": {}})", "has no weight_map object");
}

// config.json's rope scaling is an object or null (before: a string, a list or a number was
// dropped and the model ran unscaled); a file given as the directory is said to be one; the
// refusals name the file.
TEST(HfConvert, BadConfigJsonIsRefusedNamingTheFile) {
  Dirs d;
  std::string out;
  const std::string score = "score hf_path=" + d.hf.string() + " tokens=3,17,200";
  for (const char* bad : {R"("abc")", "[1, 2]", "5"}) {
    std::string cfg = kConfig;
    cfg.replace(cfg.find("\"rope_scaling\": null"), 20, std::string("\"rope_scaling\": ") + bad);
    std::ofstream(d.hf / "config.json") << cfg;
    EXPECT_EQ(mt_cmd(score, out), 2) << bad << out;
    EXPECT_NE(out.find("\"rope_scaling\" is "), std::string::npos) << bad << out;
    EXPECT_NE(out.find("not an object"), std::string::npos) << bad << out;
  }
  EXPECT_EQ(mt_cmd("score hf_path=" + (d.hf / "config.json").string() + " tokens=3", out), 2)
      << out;
  EXPECT_NE(out.find("is a file, not a directory"), std::string::npos) << out;
  // Refusals name config.json's path, and an unknown model_type is said to be config.json's.
  const std::string path = (d.hf / "config.json").string();
  for (const auto& [from, to, needle] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {R"("model_type": "llama")", R"("model_type": "nosuch")",
            path + " has model_type \"nosuch\", which names no model family"},
           {R"("hidden_size")", R"("hidden_sizes")", path + " has no 'hidden_size'"}}) {
    std::string cfg = kConfig;
    ASSERT_NE(cfg.find(from), std::string::npos) << from;
    cfg.replace(cfg.find(from), from.size(), to);
    std::ofstream(d.hf / "config.json") << cfg;
    EXPECT_EQ(mt_cmd(score, out), 2) << to << out;
    EXPECT_NE(out.find(needle), std::string::npos) << to << out;
  }
}

// Issue 24, item 10: shard paths in model.safetensors.index.json stay inside the model
// directory; an absolute path or one with ".." was opened and parsed.
TEST(HfConvert, ShardPathsStayInsideTheModelDirectory) {
  Dirs d;
  std::string out;
  auto index = [&](const std::string& shard) {
    std::ofstream(d.hf / "model.safetensors.index.json")
        << R"({"metadata": {}, "weight_map": {"model.embed_tokens.weight": )" << shard << "}}";
  };
  const std::vector<std::string> bads = {R"("../../../../etc/passwd")", R"("/etc/passwd")",
                                         R"("sub/../../x.safetensors")", "7"};
  for (size_t n = 0; n < bads.size(); ++n) {
    const std::string& bad = bads[n];
    index(bad);
    const fs::path o = d.root / "out" / std::to_string(n);
    EXPECT_EQ(mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + o.string(), out),
              2)
        << bad << ": " << out;
    EXPECT_NE(out.find("not a file name inside the model directory"), std::string::npos)
        << bad << ": " << out;
  }
  index(R"("model.safetensors")");
  EXPECT_EQ(
      mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 0)
      << out;
}

}  // namespace
}  // namespace mt
