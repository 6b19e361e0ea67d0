// The Llama family against Hugging Face transformers: logits, loss and every parameter's
// gradient for a fixed batch, from reference data made by tools/make_llama_golden.py
// (LlamaForCausalLM, float32, eager attention). No Python at test time.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include "config_loader.h"
#include "model_runner.h"
#include "mt/data.h"
#include "safetensors.h"
#include "test_support.h"

namespace mt {
namespace {

struct Golden {
  const char* name;
  std::vector<std::string> overrides;
};

// The mt config equal to each reference model's Hugging Face config.
const Golden kGqa{
    "llama_gqa",
    {"vocab_size=256", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
     "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2",
     "normalization_layer_epsilon=1e-5", "rope_max_timescale=10000", "logits_via_embedding=false"}};
const Golden kLlama31{
    "llama31",
    {"vocab_size=256", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2",
     "head_dim=16", "base_mlp_dim=128", "base_num_decoder_layers=2",
     "normalization_layer_epsilon=1e-6", "rope_type=llama3.1", "rope_max_timescale=500000",
     "rope_factor=8", "rope_low_freq_factor=1", "rope_high_freq_factor=4",
     "original_max_position_embeddings=32", "logits_via_embedding=true"}};

double json_number(const std::string& json, const std::string& key) {
  const auto p = json.find("\"" + key + "\":");
  EXPECT_NE(p, std::string::npos) << key;
  return std::strtod(json.c_str() + p + key.size() + 3, nullptr);
}

std::vector<float> host_f32(const SafeTensorsFile& f, const std::string& name) {
  const auto& info = f.info(name);
  EXPECT_EQ(info.dtype, "F32") << name;
  std::vector<float> v(static_cast<size_t>(info.numel()));
  std::memcpy(v.data(), info.data, info.nbytes());
  return v;
}

std::vector<float> transpose(const std::vector<float>& a, int64_t rows, int64_t cols) {
  std::vector<float> t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      t[static_cast<size_t>(c * rows + r)] = a[static_cast<size_t>(r * cols + c)];
  return t;
}

struct Loaded {
  std::unique_ptr<ModelRunner> runner;
  SafeTensorsFile file;
  std::string json;
  DeviceBatch batch;
};

Loaded load(const Golden& g, std::vector<std::string> extra) {
  const std::string dir = test::source_dir() + "/tests/golden/";
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = g.overrides;
  req.overrides.insert(req.overrides.end(), extra.begin(), extra.end());
  Config cfg = load_config(req);
  Loaded l{std::make_unique<ModelRunner>(cfg, test::plugins()),
           SafeTensorsFile(dir + g.name + ".safetensors"),
           "",
           {}};
  std::ifstream js(dir + g.name + ".json");
  std::stringstream ss;
  ss << js.rdbuf();
  l.json = ss.str();
  // Parameters, with HF's [out, in] matrices transposed to mt's [in, out].
  for (auto& p : l.runner->params()) {
    const auto hf = l.runner->model().hf_name(p.name);
    EXPECT_FALSE(hf.name.empty()) << p.name;
    std::vector<float> v = host_f32(l.file, hf.name);
    if (hf.transposed) v = transpose(v, p.spec.shape[1], p.spec.shape[0]);
    Tensor f = test::from_vector(l.runner->backend(), p.spec.shape, v);
    l.runner->backend().cast(f, p.value);
  }
  // Targets: the next token; the last position predicts nothing (HF's shifted labels).
  const auto& ids = l.file.info("input_ids");
  HostBatch hb;
  hb.batch = ids.shape[0];
  hb.seq = ids.shape[1];
  hb.inputs.resize(static_cast<size_t>(hb.batch * hb.seq));
  std::memcpy(hb.inputs.data(), ids.data, ids.nbytes());
  hb.targets.assign(hb.inputs.size(), -1);
  for (int64_t b = 0; b < hb.batch; ++b)
    for (int64_t t = 0; t + 1 < hb.seq; ++t)
      hb.targets[static_cast<size_t>(b * hb.seq + t)] =
          hb.inputs[static_cast<size_t>(b * hb.seq + t + 1)];
  l.batch = l.runner->upload(hb);
  return l;
}

void check(const Golden& g, std::vector<std::string> extra, double logit_tol, double loss_tol,
           double grad_tol) {
  SCOPED_TRACE(std::string(g.name));
  Loaded l = load(g, extra);
  Backend& be = l.runner->backend();
  {
    Graph fwd(be, /*record=*/false);
    Tensor logits = l.runner->forward(fwd, l.batch);
    const double e = test::scaled_err(test::to_vector(logits), host_f32(l.file, "logits"));
    EXPECT_LT(e, logit_tol) << "logits";
    std::printf("%s: logits max error / max |logit| = %.2e\n", g.name, e);
  }
  l.runner->enable_gradients();
  Graph graph(be);
  Tensor loss = l.runner->loss(graph, l.batch, 0.f);
  const double ref = json_number(l.json, "loss");
  const double got = test::to_vector(loss)[0];
  EXPECT_LT(std::fabs(got - ref) / ref, loss_tol) << "loss " << got << " vs " << ref;
  std::printf("%s: loss %.7f vs transformers %.7f (rel %.2e)\n", g.name, got, ref,
              std::fabs(got - ref) / ref);
  graph.backward(loss);
  double worst = 0;
  for (auto& p : l.runner->params()) {
    const auto hf = l.runner->model().hf_name(p.name);
    std::vector<float> want = host_f32(l.file, "grad." + hf.name);
    if (hf.transposed) want = transpose(want, p.spec.shape[1], p.spec.shape[0]);
    const double e = test::scaled_err(test::to_vector(p.grad), want);
    EXPECT_LT(e, grad_tol) << "gradient of " << p.name;
    worst = std::max(worst, e);
  }
  std::printf("%s: worst gradient error (max error / max |grad|) = %.2e\n", g.name, worst);
}

// f32: logits and loss within 1e-4 relative, gradients within 1e-3 (the tolerances).
TEST(LlamaGolden, GqaMatchesTransformersFlash) {
  check(kGqa, {"attention=flash"}, 1e-4, 1e-4, 1e-3);
}
TEST(LlamaGolden, GqaMatchesTransformersDotProduct) {
  check(kGqa, {"attention=dot_product"}, 1e-4, 1e-4, 1e-3);
}
TEST(LlamaGolden, Llama31RopeScalingTiedMatchesTransformers) {
  check(kLlama31, {"attention=flash"}, 1e-4, 1e-4, 1e-3);
}
// Rematerialisation changes memory, never results.
TEST(LlamaGolden, RematFullMatches) {
  check(kGqa, {"remat_policy=full"}, 1e-4, 1e-4, 1e-3);
}
TEST(LlamaGolden, RematMinimalMatches) {
  check(kGqa, {"remat_policy=minimal"}, 1e-4, 1e-4, 1e-3);
}
// num_vocab_tiling: the LM head and loss in runs of positions (uneven: 3 runs), untied and tied.
TEST(LlamaGolden, VocabTilingMatches) {
  check(kGqa, {"num_vocab_tiling=3"}, 1e-4, 1e-4, 1e-3);
  check(kLlama31, {"num_vocab_tiling=3"}, 1e-4, 1e-4, 1e-3);
}
// bf16 compute with f32 master weights: close, within bf16's precision.
TEST(LlamaGolden, Bf16ComputeIsClose) {
  check(kGqa, {"dtype=bfloat16", "weight_dtype=float32"}, 5e-2, 1e-2, 1e-1);
}

}  // namespace
}  // namespace mt
