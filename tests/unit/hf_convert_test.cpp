// Hugging Face interop: import a transformers LlamaForCausalLM directory, check its logits
// against transformers, export it back and get the same tensors; hf_path= for score.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "checkpoint_manager.h"
#include "config_loader.h"
#include "model_runner.h"
#include "mt/data.h"
#include "safetensors.h"
#include "test_support.h"

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
  ASSERT_EQ(mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 0) << out;
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
  ASSERT_EQ(mt_cmd("convert --from=hf --input=" + d.back.string() + " --output=" + again.string(), out), 0) << out;
  std::ifstream y1(d.mt / "model.yml"), y2(again / "model.yml");
  std::string l1, l2;
  std::getline(y1, l1), std::getline(y2, l2);  // the comment lines name different inputs
  std::getline(y1, l1), std::getline(y2, l2);
  std::stringstream s1, s2;
  s1 << y1.rdbuf();
  s2 << y2.rdbuf();
  EXPECT_EQ(s1.str(), s2.str());
}

TEST(HfConvert, HfPathScoresLikeTheConvertedCheckpoint) {
  Dirs d;
  std::string out, a, b;
  ASSERT_EQ(mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 0) << out;
  ASSERT_EQ(mt_cmd("score hf_path=" + d.hf.string() + " tokens=3,17,200,5,9,1,77", a), 0) << a;
  ASSERT_EQ(mt_cmd("score --config=" + (d.mt / "model.yml").string() + " load_parameters_path=" +
                       d.mt.string() + " tokens=3,17,200,5,9,1,77",
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
  EXPECT_EQ(mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + d.mt.string(), out), 2) << out;
  EXPECT_NE(out.find("not empty"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(d.mt / "x"));  // nothing existing is lost
  EXPECT_EQ(mt_cmd("convert --input=a --output=b", out), 2) << out;
  EXPECT_EQ(mt_cmd("convert --from=hf --input=/nonexistent --output=" + (d.root / "o").string(), out), 2) << out;
  EXPECT_NE(out.find("/nonexistent"), std::string::npos) << out;
  std::string cfg = kConfig;
  cfg.replace(cfg.find("\"attention_bias\": false"), 23, "\"attention_bias\": true");
  std::ofstream(d.hf / "config.json") << cfg;
  EXPECT_EQ(mt_cmd("convert --from=hf --input=" + d.hf.string() + " --output=" + (d.root / "o2").string(), out), 2) << out;
  EXPECT_NE(out.find("attention_bias"), std::string::npos) << out;
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
