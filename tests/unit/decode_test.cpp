// Decoding: KV-cache decode == full forward, greedy generation == transformers' generate,
// sampling strategies and determinism.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <random>

#include "checkpoint_manager.h"
#include "config_loader.h"
#include "decoder.h"
#include "fused_projections.h"
#include "held_peak_backend.h"
#include "hf_interop.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/q8.h"
#include "plugin_manager.h"
#include "recording_backend.h"
#include "safetensors.h"
#include "test_support.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

std::unique_ptr<ModelRunner> runner(std::vector<std::string> overrides) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = std::move(overrides);
  auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
  r->init_parameters(11);
  return r;
}

// Logits of the full (non-cached) forward over `ids` [1, T] -> [T * V].
std::vector<float> full_forward(ModelRunner& r, const std::vector<int32_t>& ids) {
  HostBatch hb;
  hb.batch = 1;
  hb.seq = static_cast<int64_t>(ids.size());
  hb.inputs = ids;
  DeviceBatch db = r.upload(hb);
  Graph g(r.backend(), false);
  return test::to_vector(r.forward(g, db));
}

void decode_matches_forward(std::vector<std::string> overrides, double tol = 1e-5) {
  SCOPED_TRACE(::testing::PrintToString(overrides));
  auto r = runner(overrides);
  const int64_t V = r->model().dims().vocab_size;
  const uint64_t seed = test::seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  // Three sequences of different prompt lengths decoded together.
  std::vector<std::vector<int32_t>> seqs = {{}, {}, {}};
  const int prompt_len[3] = {1, 5, 9};
  Decoder dec(*r, 3, 24);
  for (int i = 0; i < r->model().num_layers(); ++i) {
    const int64_t window = r->cache_specs()[static_cast<size_t>(i)].window;
    EXPECT_EQ(dec.cache_rows(i), window > 0 && window < 24 ? window : 24);  // a ring: the window
  }
  std::vector<int32_t> next(3);
  for (int b = 0; b < 3; ++b) {
    for (int i = 0; i < prompt_len[b]; ++i) seqs[b].push_back(static_cast<int32_t>(rng() % V));
    const std::vector<float> pl = dec.prefill(b, seqs[b]);
    const std::vector<float> ref = full_forward(*r, seqs[b]);
    EXPECT_LT(test::scaled_err(pl, ref), tol) << "prefill of sequence " << b;
    next[b] = static_cast<int32_t>(rng() % V);
  }
  for (int step = 0; step < 8; ++step) {
    std::vector<bool> active = {true, step % 2 == 0, true};  // sequence 1 pauses every other step
    const std::vector<float> logits = dec.step(next, active);
    for (int b = 0; b < 3; ++b) {
      if (!active[b]) continue;
      seqs[b].push_back(next[b]);
      const std::vector<float> ref = full_forward(*r, seqs[b]);
      const std::vector<float> got(logits.begin() + b * V, logits.begin() + (b + 1) * V);
      const std::vector<float> want(ref.end() - V, ref.end());
      EXPECT_LT(test::scaled_err(got, want), tol) << "step " << step << " sequence " << b;
      next[b] = static_cast<int32_t>(rng() % V);
    }
  }
}

TEST(Decode, CachedDecodeEqualsFullForwardFlashGqa) {
  decode_matches_forward({"attention=flash"});
}
TEST(Decode, CachedDecodeEqualsFullForwardDotProduct) {
  decode_matches_forward({"attention=dot_product"});
}
TEST(Decode, CachedDecodeEqualsFullForwardMha) {
  decode_matches_forward({"base_num_kv_heads=4"});
}
TEST(Decode, CachedDecodeEqualsFullForwardMqa) {
  decode_matches_forward({"base_num_kv_heads=1"});
}
TEST(Decode, CachedDecodeEqualsFullForwardSlidingWindowRope31) {
  decode_matches_forward({"sliding_window_size=4", "rope_type=llama3.1",
                          "original_max_position_embeddings=8", "logits_via_embedding=true"});
}

// bf16 weights and caches (the decode kernels convert only the valid cache rows): equal within
// bf16 rounding of the two computation orders.
// Inference with f32 masters and bf16 compute converts the weights once (mt decode, mt score):
// the logits are those of the per-forward cast, bit for bit, and the parameters are bf16 after.
TEST(Decode, WeightsStoredInTheComputeDtypeGiveTheSameLogits) {
  auto r = runner({"dtype=bfloat16", "weight_dtype=float32"});
  std::mt19937_64 rng(test::seed());
  std::vector<int32_t> ids(7);
  for (auto& t : ids) t = static_cast<int32_t>(rng() % r->model().dims().vocab_size);
  const std::vector<float> cast_each_time = full_forward(*r, ids);
  ASSERT_TRUE(r->store_weights_in_compute_dtype());
  EXPECT_EQ(r->weight_dtype(), DType::bf16);
  for (auto& p : r->params()) EXPECT_EQ(p.value.dtype(), DType::bf16) << p.name;
  EXPECT_EQ(full_forward(*r, ids), cast_each_time);
  EXPECT_FALSE(r->store_weights_in_compute_dtype());  // nothing left to convert

  auto f32 = runner({"dtype=float32", "weight_dtype=float32"});
  EXPECT_FALSE(f32->store_weights_in_compute_dtype());  // nothing narrower to store
  auto training = runner({"dtype=bfloat16", "weight_dtype=float32"});
  training->enable_gradients();
  EXPECT_THROW(training->store_weights_in_compute_dtype(), Error);
  EXPECT_EQ(training->params()[0].value.dtype(), DType::f32);  // untouched
}

// Models with every kind of layer that has projections: GQA + MLP, biases, a window with a tied
// head, MLA, MoE with a dense first layer.
const char* const kProjectionModels[] = {"llama-test", "qwen2-test", "gemma2-test",
                                         "deepseek3-test", "qwen3-moe-test"};

// A named model (its family's keys too) in f32, initialised; on a RecordingBackend over the CPU
// when `recording` is given (set to it).
std::unique_ptr<ModelRunner> family_runner(const std::string& model,
                                           test::RecordingBackend** recording = nullptr,
                                           const std::vector<std::string>& extra = {}) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = model;
  req.overrides = {"dtype=float32", "weight_dtype=float32"};
  req.overrides.insert(req.overrides.end(), extra.begin(), extra.end());
  req.schemas_for = test::family_schemas;
  const Config cfg = load_config(req);
  std::unique_ptr<ModelRunner> r;
  if (recording) {
    auto rec = std::make_unique<test::RecordingBackend>(test::plugins().make_backend("cpu", cfg));
    *recording = rec.get();
    auto attention = std::make_unique<test::RecordingAttention>(
        test::plugins().make_attention("cpu", cfg.get_string("attention"), rec->inner()), *rec);
    r = std::make_unique<ModelRunner>(cfg, test::plugins(), std::move(rec), std::move(attention));
  } else {
    r = std::make_unique<ModelRunner>(cfg, test::plugins());
  }
  r->init_parameters(11);
  return r;
}

// Six random token ids of r's vocabulary (the test seed's).
std::vector<int32_t> random_prompt(ModelRunner& r) {
  std::mt19937_64 rng(test::seed());
  std::vector<int32_t> prompt(6);
  for (auto& t : prompt)
    t = static_cast<int32_t>(rng() % static_cast<uint64_t>(r.model().dims().vocab_size));
  return prompt;
}

// Prefill of `prompt` and 5 greedy steps: every position's logits, and the tokens chosen.
std::vector<int32_t> greedy_logits(ModelRunner& r, const std::vector<int32_t>& prompt,
                                   std::vector<float>& logits) {
  const int64_t V = r.model().dims().vocab_size;
  Decoder dec(r, 1, 16);
  logits = dec.prefill(0, prompt);
  auto next =
      static_cast<int32_t>(std::max_element(logits.end() - V, logits.end()) - (logits.end() - V));
  std::vector<int32_t> ids;
  for (int s = 0; s < 5; ++s) {
    const std::vector<float> step = dec.step({next}, {true});
    logits.insert(logits.end(), step.begin(), step.end());
    next = static_cast<int32_t>(std::max_element(step.begin(), step.end()) - step.begin());
    ids.push_back(next);
  }
  return ids;
}

// Inference stores the projection weights transposed ([N, K]) where the backend's
// matrix-vector products stream them faster (mt decode of one or two sequences), experts'
// weights too ([E, N, K]): the logits of the prefill and of each step are those of the [K, N]
// weights within f32 rounding of the other summation order, greedy picks the same tokens, and
// each layer kind with projections is covered (GQA + MLP, biases, a window with a tied head,
// MLA, MoE with a dense first layer).
TEST(Decode, TransposedProjectionsGiveTheSameLogits) {
  for (const char* model : kProjectionModels) {
    SCOPED_TRACE(model);
    std::unique_ptr<ModelRunner> owner = family_runner(model);
    ModelRunner& r = *owner;
    const std::vector<int32_t> prompt = random_prompt(r);
    std::vector<float> stored, transposed;
    const std::vector<int32_t> want = greedy_logits(r, prompt, stored);
    std::vector<Shape> shapes;
    for (const auto& p : r.params()) shapes.push_back(p.value.shape());
    const size_t n = r.transpose_projections();
    EXPECT_GT(n, 0u);
    size_t seen = 0, experts = 0;
    for (size_t i = 0; i < r.params().size(); ++i) {
      const auto& p = r.params()[i];
      if (p.layout != WeightLayout::transposed) {
        EXPECT_EQ(p.value.shape(), shapes[i]) << p.name;
        continue;
      }
      ++seen;
      EXPECT_TRUE(p.spec.projection) << p.name;
      Shape want = shapes[i];  // [K, N] -> [N, K]; experts' [E, K, N] -> [E, N, K]
      std::swap(want[want.size() - 2], want[want.size() - 1]);
      EXPECT_EQ(p.value.shape(), want) << p.name;
      experts += p.value.ndim() == 3;
    }
    EXPECT_EQ(seen, n);
    // The MoE models' experts too (the CPU's grouped products take [E, N, K]).
    const bool moe = std::string(model).find("moe") != std::string::npos ||
                     std::string(model).starts_with("deepseek");
    EXPECT_EQ(experts > 0, moe);
    EXPECT_EQ(r.transpose_projections(), 0u);  // nothing left to transpose
    EXPECT_EQ(greedy_logits(r, prompt, transposed), want);
    EXPECT_LT(test::scaled_err(transposed, stored), 1e-5);
  }
}

// mt decode builds its runner from inference_config: f32 masters with bf16 compute are
// allocated and loaded in bf16 (half the memory while loading), and hold the bits that loading
// the f32 masters and narrowing them (store_weights_in_compute_dtype, what decode did before)
// gives, from a checkpoint's .safetensors file and from Hugging Face files alike, for a dense
// and a MoE model. Other dtype pairs are left as they are.
TEST(Decode, InferenceLoadsBf16WeightsAsTheNarrowedMasters) {
  for (const char* model : {"llama-test", "mixtral-test"}) {
    SCOPED_TRACE(model);
    ConfigRequest req;
    req.configs_dir = test::source_dir() + "/configs";
    req.model = model;
    req.overrides = {"dtype=bfloat16", "weight_dtype=float32"};
    req.schemas_for = test::family_schemas;
    const Config cfg = load_config(req);
    const Config icfg = inference_config(cfg);
    EXPECT_EQ(icfg.get_string("weight_dtype"), "bfloat16");
    ModelRunner masters(cfg, test::plugins());
    masters.init_parameters(5);
    const fs::path dir = fs::path(::testing::TempDir()) / (std::string("inference_") + model);
    fs::remove_all(dir);
    fs::create_directories(dir / "hf");
    std::vector<std::pair<std::string, Tensor>> named;
    for (const auto& p : masters.params()) named.emplace_back(p.name, p.value);
    save_tensors(dir / "params.safetensors", named);
    write_hf_tensors(dir / "hf" / "model.safetensors", masters);
    ASSERT_TRUE(masters.store_weights_in_compute_dtype());
    for (const bool hf : {false, true}) {
      SCOPED_TRACE(hf ? "Hugging Face" : "checkpoint");
      ModelRunner r(icfg, test::plugins());
      for (const auto& p : r.params()) ASSERT_EQ(p.value.dtype(), DType::bf16) << p.name;
      if (hf) {
        load_hf_weights(dir / "hf", r);
      } else {
        std::map<std::string, Tensor> params;
        for (auto& p : r.params()) params[p.name] = p.value;
        load_parameters(dir / "params.safetensors", params);
      }
      EXPECT_FALSE(r.store_weights_in_compute_dtype());  // nothing left to narrow
      for (const auto& p : masters.params()) {
        const Tensor& got = r.find(p.name)->value;
        ASSERT_EQ(got.dtype(), DType::bf16) << p.name;
        std::vector<uint16_t> a(static_cast<size_t>(got.numel())), b(a.size());
        r.backend().copy_to_host(got, a.data());
        masters.backend().copy_to_host(p.value, b.data());
        EXPECT_EQ(a, b) << p.name;
      }
    }
  }
  for (const auto& pair :
       std::vector<std::vector<std::string>>{{"dtype=float32", "weight_dtype=float32"},
                                             {"dtype=float32", "weight_dtype=bfloat16"},
                                             {"dtype=bfloat16", "weight_dtype=bfloat16"}}) {
    ConfigRequest req;
    req.configs_dir = test::source_dir() + "/configs";
    req.model = "llama-test";
    req.overrides = pair;
    const Config cfg = load_config(req);
    EXPECT_EQ(inference_config(cfg).get_string("weight_dtype"), cfg.get_string("weight_dtype"));
  }
}

// mt decode with quantization=int8 holds the projections as int8 rows from the start and
// quantizes each as it is read (from a checkpoint, or from Hugging Face files): the bits are
// those of loading every weight and then quantizing (quantize_projections), while the
// backend's peak stays below that way's, whose weights were all held in the weight dtype first.
TEST(Decode, Int8FromTheStartIsTheQuantizedModel) {
  for (const char* model : {"llama-test", "mixtral-test", "gemma2-test"})  // gemma2: a tied table
    for (const char* dtype : {"float32", "bfloat16"}) {
      SCOPED_TRACE(std::string(model) + ", " + dtype);
      ConfigRequest req;
      req.configs_dir = test::source_dir() + "/configs";
      req.model = model;
      req.overrides = {std::string("dtype=") + dtype, "weight_dtype=float32", "quantization=int8"};
      req.schemas_for = test::family_schemas;
      const Config cfg = inference_config(load_config(req));
      ModelRunner source(load_config(req), test::plugins());
      source.init_parameters(9);
      const fs::path dir =
          fs::path(::testing::TempDir()) / (std::string("int8_start_") + model + "_" + dtype);
      fs::remove_all(dir);
      fs::create_directories(dir / "hf");
      std::vector<std::pair<std::string, Tensor>> named;
      for (const auto& p : source.params()) named.emplace_back(p.name, p.value);
      save_tensors(dir / "params.safetensors", named);
      write_hf_tensors(dir / "hf" / "model.safetensors", source);
      // The way before: every weight loaded in the weight dtype, then quantized.
      ModelRunner after(cfg, test::plugins());
      {
        std::map<std::string, Tensor> params;
        for (auto& p : after.params()) params[p.name] = p.value;
        load_parameters(dir / "params.safetensors", params);
      }
      ASSERT_GT(after.quantize_projections(), 0u);
      const size_t after_peak = after.backend().memory_stats().peak_bytes_in_use;
      for (const bool hf : {false, true}) {
        SCOPED_TRACE(hf ? "Hugging Face" : "checkpoint");
        ModelRunner r(cfg, test::plugins(), test::plugins().make_backend("cpu", cfg), nullptr, {},
                      {}, {}, /*int8_from_start=*/true);
        if (hf)
          load_hf_weights(dir / "hf", r);
        else
          load_checkpoint_weights(dir / "params.safetensors", r);
        EXPECT_EQ(r.quantize_projections(), 0u);  // all of them int8 already
        EXPECT_LT(r.backend().memory_stats().peak_bytes_in_use, after_peak);
        // The loaders' temporaries (f32 copies of the weights held narrower, of as many sizes
        // as the parameters) went back to the system: cached, nothing asked for them again and
        // they stayed in the process's memory, above what mt plan planned.
        EXPECT_EQ(r.backend().memory_stats().bytes_cached, 0u);
        for (const auto& p : after.params()) {
          const Param& got = *r.find(p.name);
          ASSERT_EQ(got.layout, p.layout) << p.name;
          ASSERT_EQ(got.value.dtype(), p.value.dtype()) << p.name;
          ASSERT_EQ(got.value.shape(), p.value.shape()) << p.name;
          std::vector<char> a(got.value.nbytes()), b(a.size());
          r.backend().copy_to_host(got.value, a.data());
          after.backend().copy_to_host(p.value, b.data());
          EXPECT_EQ(a, b) << p.name;
        }
      }
    }
}

// Inference fuses each block's q/k/v and gate/up weights into one tensor of rows once they are
// rows (transposed, int8): each weight becomes a view of its rows of the group's tensor (the
// same bytes: the model does not grow), and the logits of the prefill and of every step are
// those of the weights apart within f32 rounding, greedy picks the same tokens, for each layer
// kind (GQA + MLP, biases, a window with a tied head, MLA without a q/k/v group, MoE with shared
// experts, whose experts' gate and up join as 2 E experts). A layout step after it undoes it,
// fuse_projections again redoes it. Each layout step leaves nothing in the allocator's cache.
TEST(Decode, FusedProjectionsGiveTheSameLogits) {
  for (const char* model : kProjectionModels) {
    for (bool int8 : {false, true}) {
      SCOPED_TRACE(std::string(model) + (int8 ? ", int8" : ""));
      std::unique_ptr<ModelRunner> owner = family_runner(model);
      ModelRunner& r = *owner;
      const std::vector<int32_t> prompt = random_prompt(r);
      EXPECT_EQ(r.fuse_projections(), 0u);  // [K, N] weights: nothing to fuse
      if (int8)
        r.quantize_projections();
      else
        r.transpose_projections();
      // The replaced tensors' blocks go back to the system, not to the allocator's cache (where
      // they stayed for the whole decode: 2.1 GB of llama-bench-1b's 3.8 GB after fusing).
      EXPECT_EQ(r.backend().memory_stats().bytes_cached, 0u);
      std::vector<float> apart, fused;
      const std::vector<int32_t> want = greedy_logits(r, prompt, apart);
      size_t bytes = 0;
      for (const auto& p : r.params()) bytes += p.value.nbytes();
      const size_t n = r.fuse_projections();
      EXPECT_GT(n, 0u);
      EXPECT_EQ(r.backend().memory_stats().bytes_cached, 0u);
      EXPECT_EQ(r.fuse_projections(), 0u);  // fused already
      size_t after = 0;
      for (const auto& p : r.params()) after += p.value.nbytes();
      EXPECT_EQ(after, bytes);
      // Each group's weights lie back to back, in the declared order.
      size_t groups = 0, experts = 0;
      for (size_t i = 0; i + 1 < r.params().size(); ++i) {
        const auto& p = r.params()[i];
        for (const char* first : {"wq", "w_gate"}) {
          if (!p.name.ends_with(first)) continue;
          const std::string prefix = p.name.substr(0, p.name.size() - std::strlen(first));
          const auto& next = r.params()[i + 1];
          if (next.name != prefix + (std::string(first) == "wq" ? "wk" : "w_up")) continue;
          ++groups;
          if (p.spec.shape.size() == 3) ++experts;
          EXPECT_EQ(static_cast<const char*>(next.value.data()),
                    static_cast<const char*>(p.value.data()) + p.value.nbytes())
              << p.name;
        }
      }
      EXPECT_EQ(groups, n);
      const bool moe = model == std::string("mixtral-test") ||
                       std::string(model).find("moe") != std::string::npos ||
                       std::string(model).find("deepseek") != std::string::npos;
      EXPECT_EQ(experts > 0, moe);
      EXPECT_EQ(greedy_logits(r, prompt, fused), want);
      EXPECT_LT(test::scaled_err(fused, apart), 1e-5);
      // A layout step replaces weights: the groups are undone (still the same logits), and fused
      // again on asking.
      if (!int8) {
        EXPECT_GT(r.quantize_projections(), 0u);
        std::vector<float> q8_apart, q8_fused;
        greedy_logits(r, prompt, q8_apart);
        EXPECT_EQ(r.fuse_projections(), n);
        greedy_logits(r, prompt, q8_fused);
        EXPECT_LT(test::scaled_err(q8_fused, q8_apart), 1e-5);
      }
    }
  }
}

// llama-test in f32, initialised, on the CPU backend wrapped by test::HeldPeakBackend (`held`).
std::unique_ptr<ModelRunner> held_runner(test::HeldPeakBackend*& held) {
  ConfigRequest req;
  req.configs_dir = test::source_dir() + "/configs";
  req.model = "llama-test";
  req.overrides = {"dtype=float32", "weight_dtype=float32"};
  req.schemas_for = test::family_schemas;
  const Config cfg = load_config(req);
  auto backend = std::make_unique<test::HeldPeakBackend>(test::plugins().make_backend("cpu", cfg));
  held = backend.get();
  auto attention =
      test::plugins().make_attention("cpu", cfg.get_string("attention"), held->inner());
  auto r =
      std::make_unique<ModelRunner>(cfg, test::plugins(), std::move(backend), std::move(attention));
  r->init_parameters(11);
  return r;
}

// Transposing the projections holds one more weight's tensor beside the model (besides its two
// host buffers), as the plan's loading row counts: largest first, each replaced block the next
// one's while the size lasts, the cache released at each change of size. In declared order the
// last layer's blocks stayed cached while the LM head was transposed.
TEST(Decode, TransposingHoldsOneMoreWeight) {
  test::HeldPeakBackend* held = nullptr;
  const std::unique_ptr<ModelRunner> owner = held_runner(held);
  ModelRunner& r = *owner;
  size_t largest = 0;
  for (const auto& p : r.params())
    if (p.spec.projection) largest = std::max(largest, p.value.nbytes());
  held->release_cached_memory();
  const size_t weights = held->memory_stats().bytes_in_use;
  held->peak_held = 0;
  ASSERT_GT(r.transpose_projections(), 0u);
  EXPECT_LE(held->peak_held, weights + largest + largest / 8);  // and the allocator's rounding
  EXPECT_EQ(held->memory_stats().bytes_cached, 0u);
}

// Fusing holds one group's former tensors beside the model at a time, each group's given back as
// it is joined: cached until the end, every block's q/k/v and gate/up stayed in the process's
// memory at once (llama-bench-1b's bf16 decode peaked above its plan there).
TEST(Decode, FusingHoldsOneGroupAtATime) {
  test::HeldPeakBackend* held = nullptr;
  const std::unique_ptr<ModelRunner> owner = held_runner(held);
  ModelRunner& r = *owner;
  ASSERT_GT(r.transpose_projections(), 0u);
  // The largest group's bytes, and all groups' together.
  size_t largest = 0, all = 0;
  for (const auto& p : r.params())
    for (const auto& group : fused_projection_groups()) {
      if (!p.name.ends_with(group[0])) continue;
      const std::string prefix = p.name.substr(0, p.name.size() - group[0].size());
      size_t bytes = 0;
      for (const auto w : group) bytes += r.find(prefix + std::string(w))->value.nbytes();
      largest = std::max(largest, bytes);
      all += bytes;
    }
  ASSERT_GT(all, 2 * largest);  // several groups, or the bound below tells nothing
  const MemoryStats before = held->memory_stats();
  ASSERT_EQ(before.bytes_cached, 0u);
  held->peak_held = 0;
  ASSERT_GT(r.fuse_projections(), 0u);
  // The model, one group's new tensor beside its former ones, and the allocator's rounding.
  EXPECT_LE(held->peak_held, before.bytes_in_use + largest + largest / 4);
  EXPECT_EQ(held->memory_stats().bytes_cached, 0u);
}

// Weights a forward casts (f32 masters, bf16 compute) are not fused: the group's tensor would be
// read in the stored dtype. Stored in the compute dtype first, they are, and the logits stay
// those of the weights apart.
TEST(Decode, FusedProjectionsNeedWeightsInTheComputeDtype) {
  std::unique_ptr<ModelRunner> owner = family_runner("llama-test", nullptr, {"dtype=bfloat16"});
  ModelRunner& r = *owner;
  const std::vector<int32_t> prompt = random_prompt(r);
  ASSERT_GT(r.transpose_projections(), 0u);
  EXPECT_EQ(r.fuse_projections(), 0u);
  std::vector<float> apart, fused;
  ASSERT_TRUE(r.store_weights_in_compute_dtype());
  const std::vector<int32_t> want = greedy_logits(r, prompt, apart);
  EXPECT_EQ(r.fuse_projections(), 2u * static_cast<size_t>(r.model().num_layers()));
  EXPECT_EQ(greedy_logits(r, prompt, fused), want);
  EXPECT_LT(test::scaled_err(fused, apart), 1e-5);
}

// Decode steps recorded once and replayed (CUDA graphs; here the same contract on the CPU
// through test::RecordingBackend): two sequences of different lengths, one stopping early, give
// the logits of steps run as they come, bit for bit, at every step. The decoder refills its
// step inputs in place (tokens, positions, cache rows and lengths: a replay reads them there)
// and reads the logits the recording writes. A model whose step reads device data on the host
// (MoE routing) is not recorded and says why; its steps run as they come.
// The same with an int8 cache (quantize_kvcache) for the dense models: its writes and reads are
// recorded too.
TEST(Decode, RecordedStepsGiveTheLogitsOfStepsRunAsTheyCome) {
  std::vector<std::pair<std::string, std::vector<std::string>>> cases;
  for (const char* model : kProjectionModels) cases.push_back({model, {}});
  for (const char* model : {"llama-test", "gemma2-test"})
    cases.push_back({model, {"quantize_kvcache=true", "kv_quant_axis=dkv"}});
  for (const auto& [model, extra] : cases) {
    SCOPED_TRACE(model + (extra.empty() ? "" : ", int8 cache"));
    const bool moe =
        model.find("moe") != std::string::npos || model.find("deepseek") != std::string::npos;
    test::RecordingBackend* rec = nullptr;
    std::unique_ptr<ModelRunner> recorded_runner = family_runner(model, &rec, extra);
    std::unique_ptr<ModelRunner> plain_runner = family_runner(model, nullptr, extra);
    const std::vector<int32_t> prompt = random_prompt(*plain_runner);
    const std::vector<int32_t> shorter(prompt.begin(), prompt.begin() + 2);
    Decoder a(*plain_runner, 2, 16), b(*recorded_runner, 2, 16);
    a.set_recording(false);
    EXPECT_EQ(a.prefill(0, prompt), b.prefill(0, prompt));
    EXPECT_EQ(a.prefill(1, shorter), b.prefill(1, shorter));
    const int64_t V = plain_runner->model().dims().vocab_size;
    std::vector<int32_t> next = {3, 5};
    std::vector<bool> active = {true, true};
    for (int s = 0; s < 7; ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      if (s == 4) active[1] = false;  // sequence 1 stops: its token goes to the sink row
      const std::vector<float> want = a.step(next, active), got = b.step(next, active);
      ASSERT_EQ(got, want);
      for (size_t i = 0; i < 2; ++i) {
        const float* l = want.data() + static_cast<int64_t>(i) * V;
        next[i] = static_cast<int32_t>(std::max_element(l, l + V) - l);
      }
    }
    EXPECT_EQ(a.step_recording(), "");  // turned off: never tried
    if (moe) {
      EXPECT_EQ(b.step_recording().rfind("not recorded: ", 0), 0u) << b.step_recording();
      EXPECT_EQ(rec->recordings, 0);
      EXPECT_EQ(rec->replays, 0);
    } else {
      EXPECT_EQ(b.step_recording(), "recorded");
      EXPECT_EQ(rec->recordings, 1);
      EXPECT_EQ(rec->replays, 6);  // every step after the first
      EXPECT_GT(rec->recorded_ops, 10u);
    }
  }
}

// The mean KL(p || q) of the next-token distributions in rows of V logits.
double mean_kl(const std::vector<float>& p, const std::vector<float>& q, int64_t V) {
  const int64_t n = static_cast<int64_t>(p.size()) / V;
  double kl = 0;
  for (int64_t t = 0; t < n; ++t) {
    const float* a = p.data() + t * V;
    const float* b = q.data() + t * V;
    const double ma = *std::max_element(a, a + V), mb = *std::max_element(b, b + V);
    double za = 0, zb = 0;
    for (int64_t v = 0; v < V; ++v) {
      za += std::exp(double(a[v]) - ma);
      zb += std::exp(double(b[v]) - mb);
    }
    for (int64_t v = 0; v < V; ++v) {
      const double la = double(a[v]) - ma - std::log(za), lb = double(b[v]) - mb - std::log(zb);
      kl += std::exp(la) * (la - lb);
    }
  }
  return n ? kl / static_cast<double>(n) : 0;
}

// quantize_kvcache (MaxText's key, with kv_quant_dtype=int8 and either kv_quant_axis): each
// cache holds int8 rows and an f32 scale per token and key/value head (dkv) or per token
// (heads_and_dkv), so a decoder's caches take under 0.4 of the f32 ones' bytes; the prefill
// (its tokens attend among themselves, then are stored) gives the same logits, and 6 steps fed
// the same tokens give next-token distributions within a mean KL of 1e-3 of the f32 cache's
// (measured 4e-6 to 4e-5 on these random-weight models; routed experts 0.25, as for int8
// weights), and not the same ones (the
// steps read the int8 rows back). GQA, biases, a sliding-window ring with a tied head, MLA's
// latent cache and MoE are covered. A scale written for the wrong group gives KL ~1.
TEST(Decode, Int8KvCacheStaysCloseToTheFullPrecisionCache) {
  for (const char* model : kProjectionModels) {
    for (const char* axis : {"dkv", "heads_and_dkv"}) {
      SCOPED_TRACE(std::string(model) + ", kv_quant_axis=" + axis);
      std::unique_ptr<ModelRunner> full = family_runner(model);
      std::unique_ptr<ModelRunner> q8 = family_runner(
          model, nullptr, {"quantize_kvcache=true", std::string("kv_quant_axis=") + axis});
      EXPECT_TRUE(q8->kv_cache_quant().on);
      const int64_t V = full->model().dims().vocab_size;
      const std::vector<int32_t> prompt = random_prompt(*full);
      const size_t f0 = full->backend().memory_stats().bytes_in_use;
      const size_t q0 = q8->backend().memory_stats().bytes_in_use;
      Decoder a(*full, 1, 16), b(*q8, 1, 16);
      const size_t fbytes = full->backend().memory_stats().bytes_in_use - f0;
      const size_t qbytes = q8->backend().memory_stats().bytes_in_use - q0;
      EXPECT_LT(static_cast<double>(qbytes), 0.4 * static_cast<double>(fbytes));
      std::vector<float> la = a.prefill(0, prompt, true), lb = b.prefill(0, prompt, true);
      EXPECT_EQ(la, lb);
      std::vector<float> sa, sb;
      auto next = static_cast<int32_t>(std::max_element(la.begin(), la.end()) - la.begin());
      for (int s = 0; s < 6; ++s) {
        const std::vector<float> x = a.step({next}, {true}), y = b.step({next}, {true});
        sa.insert(sa.end(), x.begin(), x.end());
        sb.insert(sb.end(), y.begin(), y.end());
        next = static_cast<int32_t>(std::max_element(x.begin(), x.end()) - x.begin());
      }
      const double kl = mean_kl(sa, sb, V);
      const bool routed = std::any_of(full->params().begin(), full->params().end(),
                                      [](const Param& p) { return p.spec.active < 1.f; });
      EXPECT_LT(kl, routed ? 0.25 : 1e-3);
      EXPECT_GT(kl, 0.0);
      std::printf("%s, kv_quant_axis=%s: caches %zu of %zu bytes, mean KL %.3g over 6 steps\n",
                  model, axis, qbytes, fbytes, kl);
    }
  }
}

// The keys' refusals: another type, another axis, and training.
TEST(Decode, Int8KvCacheKeysAreChecked) {
  EXPECT_THROW(
      family_runner("llama-test", nullptr, {"quantize_kvcache=true", "kv_quant_dtype=int4"}),
      UsageError);
  try {
    family_runner("llama-test", nullptr, {"quantize_kvcache=true", "kv_quant_dtype=int4"});
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("int4 KV caches are not implemented; int8 is"),
              std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(family_runner("llama-test", nullptr, {"kv_quant_dtype=int4"})->kv_cache_quant().on);
}

// On a backend that cannot record (the CPU's), steps run as they come and the decoder says why.
TEST(Decode, StepsRunAsTheyComeWhereTheBackendCannotRecord) {
  auto r = runner({});
  Decoder dec(*r, 1, 8);
  dec.prefill(0, {1, 2});
  dec.step({3}, {true});
  EXPECT_EQ(dec.step_recording(), "");
  dec.step({4}, {true});
  EXPECT_NE(dec.step_recording().find("not recorded: the cpu backend"), std::string::npos)
      << dec.step_recording();
}

// prefill's last_only (what generation samples from): the logits of the last position, those of
// the whole prompt's last row, and the caches filled the same (the next step agrees).
TEST(Decode, PrefillOfTheLastPositionOnly) {
  for (const char* model : {"llama-test", "gemma2-test"}) {
    SCOPED_TRACE(model);
    std::unique_ptr<ModelRunner> r = family_runner(model);
    const std::vector<int32_t> prompt = random_prompt(*r);
    const int64_t V = r->model().dims().vocab_size;
    Decoder all(*r, 1, 16), last(*r, 1, 16);
    const std::vector<float> every = all.prefill(0, prompt);
    const std::vector<float> one = last.prefill(0, prompt, /*last_only=*/true);
    ASSERT_EQ(static_cast<int64_t>(one.size()), V);
    EXPECT_LT(test::scaled_err(one, std::vector<float>(every.end() - V, every.end())), 1e-6);
    EXPECT_EQ(last.length(0), all.length(0));
    EXPECT_EQ(last.step({7}, {true}), all.step({7}, {true}));
  }
}

// quantization=int8: every projection weight whose rows are a multiple of 32 long becomes int8
// rows (mt/q8.h), the rest keep the compute dtype, the model shrinks, and decode's next-token
// distributions stay close to the f32 model's: the mean KL(p_f32 || p_int8) over the prefill
// prompt below 1e-3 (measured 7e-5 to 4.4e-4 on these random-weight models, the CPU quantizing
// the activations of decode's rows too; 4e-5 to 1.5e-4 before it did; MoE: see below),
// whether the remaining weights are transposed or not.
TEST(Decode, Int8WeightsStayCloseToTheModel) {
  for (const char* model : kProjectionModels) {
    for (bool transpose_first : {false, true}) {
      SCOPED_TRACE(std::string(model) + (transpose_first ? ", transposed first" : ""));
      std::unique_ptr<ModelRunner> owner = family_runner(model);
      ModelRunner& r = *owner;
      const int64_t V = r.model().dims().vocab_size;
      const std::vector<int32_t> prompt = random_prompt(r);
      std::vector<float> full, q8;
      greedy_logits(r, prompt, full);
      size_t bytes_before = 0, bytes_after = 0;
      for (const auto& p : r.params()) bytes_before += p.value.nbytes();
      if (transpose_first) r.transpose_projections();
      const size_t n = r.quantize_projections();
      EXPECT_GT(n, 0u);
      const bool routed = std::any_of(r.params().begin(), r.params().end(),
                                      [](const Param& p) { return p.spec.active < 1.f; });
      size_t seen = 0, experts = 0, tables = 0;
      for (const auto& p : r.params()) {
        bytes_after += p.value.nbytes();
        if (p.layout != WeightLayout::q8) continue;
        ++seen;
        EXPECT_EQ(p.value.dtype(), DType::i8) << p.name;
        const Shape& s = p.spec.shape;  // [K, N], or experts' [E, K, N] -> [E, N, K + K / 16]
        const size_t d = s.size();
        if (!p.spec.projection) {  // a tied table [V, D]: its own rows [V, D + D / 16]
          EXPECT_TRUE(p.spec.table && p.spec.matmul) << p.name;
          EXPECT_EQ(p.value.shape(), (Shape{s[0], q8_row_bytes(s[1])})) << p.name;
          ++tables;
          continue;
        }
        Shape want = {s[d - 1], q8_row_bytes(s[d - 2])};
        if (d == 3) want.insert(want.begin(), s[0]);
        EXPECT_EQ(p.value.shape(), want) << p.name;
        experts += d == 3;
      }
      EXPECT_EQ(seen, n);
      EXPECT_EQ(experts > 0, routed);  // experts' weights are int8 too
      // A table tied to the head is held as int8 rows only (qwen2-test, gemma2-test).
      const bool tied = std::string(model) == "qwen2-test" || std::string(model) == "gemma2-test";
      EXPECT_EQ(tables, tied ? 1u : 0u);
      // The int8 weights: K + K / 16 bytes a row against 4 K (f32).
      EXPECT_LT(bytes_after, bytes_before);
      EXPECT_EQ(r.quantize_projections(), 0u);  // nothing left to quantize
      // The same prompt again: logits of the int8 model (the greedy path may differ).
      Decoder dec(r, 1, 16);
      q8 = dec.prefill(0, prompt);
      ASSERT_EQ(q8.size(), static_cast<size_t>(6 * V));
      const double kl =
          mean_kl(std::vector<float>(full.begin(), full.begin() + 6 * V), q8, V);  // the prefill's
      // Routed experts are a step function of the hidden state: a near tie in the router picks
      // another expert after the attention's small change, and that token's distribution moves
      // more (deepseek3-test: up to 0.05 over 15 seeds; a weight read in the wrong layout gives
      // several).
      EXPECT_LT(kl, routed ? 0.25 : 1e-3);
      EXPECT_GT(kl, 0.0);  // the weights did change
      std::printf("%s%s: mean KL %.3g over %ld positions, %zu int8 weights\n", model,
                  transpose_first ? " (transposed first)" : "", kl, 6L, n);
    }
  }
}

// A weight that int8 rows cannot hold (NaN, an infinity, or beyond 127 x 65504: a block scale
// f16 cannot hold) is refused by name and row, where before a NaN became 127 x the block's scale,
// a finite number, and the refused weight keeps its values. A value just inside f16's range is
// held.
TEST(Decode, Int8RefusesWeightsItCannotHold) {
  const float kInf = std::numeric_limits<float>::infinity();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -kInf, 127.f * 65520.f, 0.f}) {
    SCOPED_TRACE(bad);
    std::unique_ptr<ModelRunner> r = family_runner("llama-test");
    const std::vector<int32_t> prompt = random_prompt(*r);
    std::vector<float> full;  // the f32 model's logits
    greedy_logits(*r, prompt, full);
    Param* target = nullptr;  // the last projection: the others are int8 when it is refused
    for (auto& p : r->params())
      if (p.spec.projection && p.value.ndim() == 2) target = &p;
    ASSERT_NE(target, nullptr);
    const std::vector<float> original = test::to_vector(target->value);
    std::vector<float> v = original;
    const int64_t n = target->value.dim(1);  // [K, N]: value (k, j) is row j's k-th
    v[static_cast<size_t>(5 * n + 3)] = bad == 0.f ? 127.f * 65000.f : bad;  // row 3
    target->value = test::from_vector(r->backend(), target->value.shape(), v);
    const std::string name = target->name;
    if (bad == 0.f) {  // 65000 rounds to an f16 below 65504: held
      EXPECT_GT(r->quantize_projections(), 0u);
      continue;
    }
    try {
      r->quantize_projections();
      ADD_FAILURE() << "quantized " << bad;
    } catch (const Error& e) {
      const std::string what = e.what();
      const std::string want = "quantization=int8: " + name +
                               " cannot be held as int8 rows: its row 3 of " + std::to_string(n);
      EXPECT_NE(what.find(want), std::string::npos) << what;
      EXPECT_NE(what.find("run without quantization=int8"), std::string::npos) << what;
    }
    // The refused weight is as it was (it was replaced by unfilled int8 rows before).
    EXPECT_NE(target->layout, WeightLayout::q8);
    ASSERT_EQ(target->value.dtype(), DType::f32);
    const std::vector<float> kept = test::to_vector(target->value);
    ASSERT_EQ(kept.size(), v.size());
    for (size_t i = 0; i < v.size(); ++i)
      if (!(kept[i] == v[i] || (std::isnan(kept[i]) && std::isnan(v[i]))))
        FAIL() << "value " << i << ": " << kept[i] << " against " << v[i];
    // The weights quantized before the refusal are read as int8 rows: with the refused weight
    // mended, the model computes as the int8 model does (before, the runner forgot that any
    // weight had left its declared layout, and read the int8 bytes as floats).
    size_t int8_weights = 0;
    for (const auto& p : r->params()) int8_weights += p.layout == WeightLayout::q8;
    EXPECT_GT(int8_weights, 0u);
    target->value = test::from_vector(r->backend(), target->value.shape(), original);
    const int64_t V = r->model().dims().vocab_size;
    Decoder dec(*r, 1, 16);
    const std::vector<float> mixed = dec.prefill(0, prompt);
    ASSERT_EQ(mixed.size(), static_cast<size_t>(6 * V));
    EXPECT_LT(mean_kl(std::vector<float>(full.begin(), full.begin() + 6 * V), mixed, V), 1e-3);
  }
}

// The layout switches take 0 or 1 only: another value was silently the default (on) before;
// now it is refused, naming the variable and what it switches. 0 still turns each off.
TEST(Decode, LayoutSwitchesTakeZeroOrOne) {
  std::unique_ptr<ModelRunner> r = family_runner("llama-test");
  struct Unset {
    ~Unset() {
      ::unsetenv("MT_TRANSPOSE_PROJECTIONS");
      ::unsetenv("MT_FUSE_PROJECTIONS");
    }
  } unset;
  for (const char* bad : {"yes", "off", "2", " 1"}) {
    ::setenv("MT_TRANSPOSE_PROJECTIONS", bad, 1);
    try {
      r->transpose_projections();
      ADD_FAILURE() << "MT_TRANSPOSE_PROJECTIONS=" << bad << " taken";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("MT_TRANSPOSE_PROJECTIONS=") + bad +
                                           ": decode keeps the projection weights"),
                std::string::npos)
          << e.what();
    }
  }
  ::setenv("MT_TRANSPOSE_PROJECTIONS", "0", 1);
  EXPECT_EQ(r->transpose_projections(), 0u);
  ::setenv("MT_TRANSPOSE_PROJECTIONS", "1", 1);
  EXPECT_GT(r->transpose_projections(), 0u);
  ::setenv("MT_FUSE_PROJECTIONS", "true", 1);
  EXPECT_THROW(r->fuse_projections(), UsageError);
  ::setenv("MT_FUSE_PROJECTIONS", "0", 1);
  EXPECT_EQ(r->fuse_projections(), 0u);
  ::unsetenv("MT_FUSE_PROJECTIONS");
  EXPECT_GT(r->fuse_projections(), 0u);
}

// When mt decode transposes the projections: for one or two sequences on the CPU, and for up
// to 8 in bf16 where the CPU computes bf16 rows on dot products or AMX tiles (the backend says
// so); never for more than 8, nor in f32 beyond two.
TEST(Decode, TransposingPaysForFewSequences) {
  auto f32 = runner({"dtype=float32", "weight_dtype=float32"});
  EXPECT_TRUE(f32->rows_layout_pays(1));
  EXPECT_TRUE(f32->rows_layout_pays(2));
  EXPECT_FALSE(f32->rows_layout_pays(3));
  auto bf16 = runner({"dtype=bfloat16", "weight_dtype=bfloat16"});
  const bool dot = bf16->backend().extension("mt.matvec_rows_bf16dot") != nullptr;
  const std::string described = test::cpu().describe();
  EXPECT_EQ(dot, described.find("bf16 x bf16 weight rows on AVX512_BF16 dot products") !=
                         std::string::npos ||
                     described.find("bf16 x bf16 weight rows on AMX tiles") != std::string::npos);
  EXPECT_TRUE(bf16->rows_layout_pays(2));
  EXPECT_EQ(bf16->rows_layout_pays(8), dot);
  EXPECT_FALSE(bf16->rows_layout_pays(9));
  auto mixed = runner({"dtype=bfloat16", "weight_dtype=float32"});
  EXPECT_FALSE(mixed->rows_layout_pays(8));
}

// A layer that reads a transposed projection weight other than through Graph::project is
// refused by name (it would read [N, K] as [K, N]); through project both layouts give x @ w.
TEST(Decode, ATransposedWeightIsReadOnlyThroughProject) {
  Backend& be = test::cpu();
  std::mt19937_64 rng(test::seed());
  const std::vector<float> w = test::randn(12, rng), x = test::randn(8, rng);
  std::vector<float> wt(12);
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 3; ++c)
      wt[static_cast<size_t>(c * 4 + r)] = w[static_cast<size_t>(r * 3 + c)];
  const std::vector<std::string> names = {"w", "b"};
  const Tensor b = test::from_vector(be, {3}, {1.f, 2.f, 3.f});
  const Params plain(names, {test::from_vector(be, {4, 3}, w), b});
  const Params stored(names, {test::from_vector(be, {3, 4}, wt), b},
                      {WeightLayout::transposed, WeightLayout::dense});
  EXPECT_FALSE(plain.transposed("w"));
  EXPECT_TRUE(stored.transposed("w"));
  EXPECT_FALSE(stored.transposed("b"));
  EXPECT_EQ(stored.shape("w"), (Shape{4, 3}));
  EXPECT_EQ(stored.stored("w").shape(), (Shape{3, 4}));
  EXPECT_EQ(stored["b"].shape(), (Shape{3}));
  try {
    (void)stored["w"];
    ADD_FAILURE() << "read a transposed weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'w' directly, but it is stored transposed"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW((void)stored.find("w"), Error);
  EXPECT_EQ(stored.find("nothing"), nullptr);
  Graph g(be, false);
  const Tensor xs = test::from_vector(be, {2, 4}, x);
  const std::vector<float> a = test::to_vector(g.project(xs, plain, "w"));
  const std::vector<float> t = test::to_vector(g.project(xs, stored, "w"));
  ASSERT_EQ(a.size(), 6u);
  for (int r = 0; r < 2; ++r)
    for (int c = 0; c < 3; ++c) {
      double want = 0;
      for (int k = 0; k < 4; ++k)
        want += double(x[static_cast<size_t>(r * 4 + k)]) * w[static_cast<size_t>(k * 3 + c)];
      EXPECT_NEAR(a[static_cast<size_t>(r * 3 + c)], want, 1e-5);
      EXPECT_NEAR(t[static_cast<size_t>(r * 3 + c)], want, 1e-5);
    }
  // int8 rows: refused the same way, and project computes x @ dequantized W.
  const int64_t K = 64, rb = q8_row_bytes(K);
  const std::vector<float> w2 = test::randn(static_cast<size_t>(3 * K), rng),
                           x2 = test::randn(static_cast<size_t>(K), rng);
  std::vector<int8_t> q(static_cast<size_t>(3 * rb));
  std::vector<float> dq(w2.size());
  for (int64_t j = 0; j < 3; ++j) {
    ASSERT_TRUE(quantize_q8_row(w2.data() + j * K, K, q.data() + j * rb));
    dequantize_q8_row(q.data() + j * rb, K, dq.data() + j * K);
  }
  Tensor wq = be.empty({3, rb}, DType::i8);
  be.copy_from_host(wq, q.data());
  const Params int8(names, {wq, b}, {WeightLayout::q8, WeightLayout::dense});
  EXPECT_EQ(int8.layout("w"), WeightLayout::q8);
  EXPECT_EQ(int8.shape("w"), (Shape{K, 3}));
  try {
    (void)int8["w"];
    ADD_FAILURE() << "read an int8 weight";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("stored as int8 rows"), std::string::npos) << e.what();
  }
  const std::vector<float> y =
      test::to_vector(g.project(test::from_vector(be, {1, K}, x2), int8, "w"));
  ASSERT_EQ(y.size(), 3u);
  // The CPU quantizes decode's row of x as well (q8_0 activations): each x[k] moves by at most
  // half its block's step (max |x| / 127 / 2), so the output by at most that times |w| summed,
  // while the layout read as [K, N] would be off by the whole product.
  for (int64_t j = 0; j < 3; ++j) {
    double want = 0, bound = 0;
    for (int64_t b = 0; b < K / kQ8Block; ++b) {
      double amax = 0, wsum = 0;
      for (int64_t k = b * kQ8Block; k < (b + 1) * kQ8Block; ++k) {
        const double xv = x2[static_cast<size_t>(k)], wv = dq[static_cast<size_t>(j * K + k)];
        want += xv * wv;
        amax = std::max(amax, std::fabs(xv));
        wsum += std::fabs(wv);
      }
      bound += amax / 127.0 / 2.0 * wsum;
    }
    EXPECT_NEAR(y[static_cast<size_t>(j)], want, bound + 1e-5 * (1 + std::fabs(want)));
  }
}

TEST(Decode, CachedDecodeEqualsFullForwardBf16) {
  decode_matches_forward({"dtype=bfloat16", "weight_dtype=bfloat16"}, 3e-2);
}

// Greedy generation of the golden models == transformers' generate (tools/make_llama_golden.py).
void greedy_matches_golden(const char* name, std::vector<std::string> overrides) {
  SCOPED_TRACE(name);
  auto r = runner(overrides);
  SafeTensorsFile f(test::source_dir() + "/tests/golden/" + name + ".safetensors");
  for (auto& p : r->params()) {
    const auto hf = r->model().hf_name(p.name);
    const auto& info = f.info(hf.name);
    std::vector<float> v(static_cast<size_t>(info.numel()));
    std::memcpy(v.data(), info.data, info.nbytes());
    if (hf.transposed) {
      std::vector<float> t(v.size());
      const int64_t rows = p.spec.shape[1], cols = p.spec.shape[0];
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j)
          t[static_cast<size_t>(j * rows + i)] = v[static_cast<size_t>(i * cols + j)];
      v.swap(t);
    }
    Tensor tv = test::from_vector(r->backend(), p.spec.shape, v);
    r->backend().cast(tv, p.value);
  }
  const auto& pi = f.info("generate_prompt");
  const auto& gi = f.info("generate_ids");
  std::vector<int32_t> prompt(static_cast<size_t>(pi.numel())),
      want(static_cast<size_t>(gi.numel()));
  std::memcpy(prompt.data(), pi.data, pi.nbytes());
  std::memcpy(want.data(), gi.data, gi.nbytes());
  const GenerateResult g =
      generate(*r, {prompt}, static_cast<int64_t>(want.size()), SamplingParams{}, -1);
  std::vector<int32_t> got = prompt;
  got.insert(got.end(), g.tokens[0].begin(), g.tokens[0].end());
  EXPECT_EQ(got, want);
}

const std::vector<std::string> kGolden = {
    "vocab_size=256", "base_emb_dim=64",  "base_num_query_heads=4",   "base_num_kv_heads=2",
    "head_dim=16",    "base_mlp_dim=128", "base_num_decoder_layers=2"};

TEST(Decode, GreedyMatchesTransformersGqa) {
  auto o = kGolden;
  o.insert(o.end(), {"normalization_layer_epsilon=1e-5", "rope_max_timescale=10000"});
  greedy_matches_golden("llama_gqa", o);
}
TEST(Decode, GreedyMatchesTransformersLlama31) {
  auto o = kGolden;
  o.insert(o.end(),
           {"normalization_layer_epsilon=1e-6", "rope_type=llama3.1", "rope_max_timescale=500000",
            "rope_factor=8", "rope_low_freq_factor=1", "rope_high_freq_factor=4",
            "original_max_position_embeddings=32", "logits_via_embedding=true"});
  greedy_matches_golden("llama31", o);
}

// An int8 cache group holding NaN keeps it NaN (a NaN scale): fmax passed over it, and it was
// stored as -127 x scale, a finite key (and decode's NaN check never saw it). Infinite values
// come back NaN (0 x inf); finite groups as before.
TEST(Decode, Int8CacheGroupsKeepNaN) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> x = {0.5f, -0.25f, nan, 0.125f};
  std::vector<int8_t> q(4);
  EXPECT_TRUE(std::isnan(quantize_q8_group(x.data(), 4, q.data())));
  x[2] = 1.f;
  const float scale = quantize_q8_group(x.data(), 4, q.data());
  EXPECT_FLOAT_EQ(scale, 1.f / 127.f);
  EXPECT_EQ(q[2], 127);
  EXPECT_EQ(q[0], 64);  // round(0.5 x 127)
}

TEST(Decode, SamplingStrategies) {
  std::vector<float> logits = {0.1f, 3.f, 2.9f, -1.f, 2.f};
  std::mt19937_64 rng(1);
  SamplingParams p;
  EXPECT_EQ(sample_token(logits.data(), 5, p, rng), 1);
  // Non-finite logits (a model with a NaN weight) are refused by every strategy (before:
  // greedy took id 0, the samplers a fixed id); -inf (a masked token) is ordinary.
  for (const float bad :
       {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()})
    for (const auto s : {SamplingParams::Strategy::greedy, SamplingParams::Strategy::weighted}) {
      std::vector<float> l = logits;
      l[3] = bad;
      SamplingParams q;
      q.strategy = s;
      EXPECT_THROW(sample_token(l.data(), 5, q, rng), Error);
    }
  std::vector<float> masked = logits;
  masked[1] = -std::numeric_limits<float>::infinity();
  EXPECT_EQ(sample_token(masked.data(), 5, p, rng), 2);
  p.strategy = SamplingParams::Strategy::top_k;
  p.top_k = 1;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits.data(), 5, p, rng), 1);
  p.top_k = 2;
  int counts[5] = {};
  for (int i = 0; i < 4000; ++i) ++counts[sample_token(logits.data(), 5, p, rng)];
  EXPECT_EQ(counts[0] + counts[3] + counts[4], 0);  // only the top 2 are ever drawn
  const double p1 = 1 / (1 + std::exp(-0.1));       // softmax over {3, 2.9}
  EXPECT_NEAR(counts[1] / 4000.0, p1, 0.03);
  p.strategy = SamplingParams::Strategy::nucleus;
  p.top_p = 0.01f;
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits.data(), 5, p, rng), 1);
  p.strategy = SamplingParams::Strategy::weighted;
  p.temperature = 1e-3f;  // nearly greedy
  for (int i = 0; i < 20; ++i) EXPECT_EQ(sample_token(logits.data(), 5, p, rng), 1);
  // Deterministic for a fixed seed.
  p.temperature = 1.f;
  std::mt19937_64 a(42), b(42);
  for (int i = 0; i < 50; ++i)
    EXPECT_EQ(sample_token(logits.data(), 5, p, a), sample_token(logits.data(), 5, p, b));
}

// Sampled rows of one generate: row 0 is the seed's own stream (a one-prompt decode's), and
// the other rows' streams are not the next seeds' (before: seed + row, so seed 0's row 1 was
// seed 1's row 0, and decodes over nearby seeds repeated each other's draws).
TEST(Decode, SampledRowsAreIndependentOfNearbySeeds) {
  auto r = runner({});
  SamplingParams p;
  p.strategy = SamplingParams::Strategy::weighted;
  p.temperature = 2.f;  // near-uniform over the vocabulary: streams of distinct seeds differ
  auto rows = [&](uint64_t seed, size_t n) {
    p.seed = seed;
    return generate(*r, std::vector<std::vector<int32_t>>(n, {1, 2, 3}), 24, p, -1).tokens;
  };
  const auto zero = rows(0, 3), one = rows(1, 1), two = rows(2, 1), alone = rows(0, 1);
  EXPECT_EQ(zero[0], alone[0]);
  EXPECT_NE(zero[1], zero[0]);
  EXPECT_NE(zero[1], one[0]);
  EXPECT_NE(zero[2], two[0]);
  EXPECT_EQ(rows(0, 3), zero);  // deterministic per seed
}

TEST(Decode, GenerationStopsAtMaxLengthAndEos) {
  auto r = runner({});
  const GenerateResult g = generate(*r, {{1, 2, 3}, {4}}, 10, SamplingParams{}, -1);
  EXPECT_EQ(g.tokens[0].size(), 7u);  // 3 prompt + 7 generated = max_target_length
  EXPECT_EQ(g.tokens[1].size(), 9u);
  const int32_t first = g.tokens[0][0];
  const GenerateResult e = generate(*r, {{1, 2, 3}}, 10, SamplingParams{}, first);
  EXPECT_EQ(e.tokens[0].size(), 1u);  // stops at eos
  EXPECT_THROW(generate(*r, {{1, 2, 3}}, 2, SamplingParams{}, -1), UsageError);
  EXPECT_THROW(generate(*r, {{1, 999}}, 10, SamplingParams{}, -1), UsageError);
}

}  // namespace
}  // namespace mt
