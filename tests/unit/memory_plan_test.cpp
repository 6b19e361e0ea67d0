// The memory plan (mt plan, and the check before mt run / mt decode): its peak against the CPU
// backend's measured peak for the same step, the changes it proposes, the refusal of a run that
// cannot fit, and its bad inputs.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint_manager.h"
#include "config_loader.h"
#include "decoder.h"
#include "memory_plan.h"
#include "meta_backend.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/env.h"
#include "mt/error.h"
#include "mt/q8.h"
#include "safetensors.h"
#include "test_support.h"
#include "trainer.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

Config config_for(const std::string& model, const std::vector<std::string>& extra) {
  // No checkpoints unless a test asks: their host snapshot is not the allocator's to measure.
  std::vector<std::string> words = {"num_threads=2", "dataset_type=synthetic",
                                    "enable_checkpointing=false"};
  words.insert(words.end(), extra.begin(), extra.end());
  return test::model_config(model, words);
}

// One training step as train() runs it, on the real CPU backend (a fresh one: its peak counts
// from zero), after initialisation: the peak the allocator reached.
size_t measured_training_peak(const Config& cfg) {
  ModelRunner runner(cfg, test::plugins());
  runner.init_parameters(1);
  runner.backend().reset_peak_memory();
  runner.enable_gradients();
  runner.zero_gradients();
  OptimizerState opt = make_optimizer_state(runner, cfg,
                                            cfg.get_bool("optimizer_memory_host_offload")
                                                ? test::plugins().make_backend("cpu", cfg)
                                                : nullptr);
  const int64_t batch = cfg.get_int("per_device_batch_size");
  const int64_t seq = cfg.get_int("max_target_length");
  const int64_t vocab = runner.model().dims().vocab_size;
  std::mt19937 rng(7);
  std::vector<DeviceBatch> micro;
  for (int64_t a = 0; a < cfg.get_int("gradient_accumulation_steps"); ++a) {
    HostBatch hb;
    hb.batch = batch;
    hb.seq = seq;
    for (int64_t i = 0; i < batch * seq; ++i) {
      hb.inputs.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
      hb.targets.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab)));
    }
    micro.push_back(runner.upload(hb));
  }
  AdamWParams adam;
  adam.lr = 1e-3f;
  for (int step = 1; step <= 2; ++step) {
    adam.step = step;
    StepGradients sg = forward_backward(runner, micro, 0.f);
    apply_update(runner, opt, adam, 0.1f, sg.layer_stats);
  }
  return runner.backend().memory_stats().peak_bytes_in_use;
}

// As mt decode runs: weights in the compute dtype (quantized with quantization=int8), a prompt,
// then steps of every sequence until the longest fills the cache (an int8 cache's step needs
// more the longer its sequences).
size_t measured_decode_peak(const Config& cfg, int64_t batch) {
  ModelRunner runner(cfg, test::plugins());
  runner.init_parameters(1);
  runner.store_weights_in_compute_dtype();
  runner.apply_quantization(cfg);
  runner.backend().reset_peak_memory();
  const int64_t max_len = cfg.get_int("max_target_length");
  Decoder dec(runner, batch, max_len);
  const int64_t prefill = std::min(cfg.get_int("max_prefill_predict_length"), max_len - 1);
  std::vector<int32_t> prompt(static_cast<size_t>(prefill));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i % 50 + 1);
  dec.prefill(0, prompt, /*last_only=*/true);
  while (dec.length(0) < max_len)
    dec.step(std::vector<int32_t>(static_cast<size_t>(batch), 3),
             std::vector<bool>(static_cast<size_t>(batch), true));
  return runner.backend().memory_stats().peak_bytes_in_use;
}

DeviceProfile cpu_profile(const Config& cfg) {
  return plan_target(cfg, &test::cpu(), /*use_plan_device=*/false);
}

struct Case {
  std::string model;
  std::vector<std::string> keys;
};

std::string name_of(const Case& c) {
  std::string n = c.model;
  for (const auto& k : c.keys) n += " " + k;
  return n;
}

// The plan's training peak within 10% of the measured one (the issue's bound; the meta trace
// runs the same code, so it is usually exact to the allocator's size classes).
TEST(MemoryPlan, TrainingPeakMatchesTheMeasuredPeak) {
  const std::vector<Case> cases = {
      {"llama-test", {"remat_policy=none", "per_device_batch_size=4", "max_target_length=64"}},
      {"llama-test", {"remat_policy=minimal", "per_device_batch_size=4", "max_target_length=64"}},
      {"llama-test", {"remat_policy=full", "per_device_batch_size=4", "max_target_length=64"}},
      {"llama-test", {"remat_policy=none", "per_device_batch_size=1", "max_target_length=128"}},
      {"llama-test", {"dtype=bfloat16", "remat_policy=none", "per_device_batch_size=2"}},
      {"llama-test", {"dtype=bfloat16", "remat_policy=full", "per_device_batch_size=2"}},
      {"llama-test", {"weight_dtype=bfloat16", "dtype=bfloat16", "mu_dtype=bfloat16"}},
      {"llama-test", {"gradient_accumulation_steps=3", "per_device_batch_size=2"}},
      {"llama-test", {"gradient_accumulation_steps=5", "num_vocab_tiling=2"}},
      {"llama-test", {"attention=dot_product", "max_target_length=96"}},
      {"llama-test", {"optimizer_memory_host_offload=true", "per_device_batch_size=4"}},
      {"llama-test", {"num_vocab_tiling=4", "vocab_size=4096", "per_device_batch_size=2"}},
      {"llama-test", {"num_vocab_tiling=3", "remat_policy=full", "dtype=bfloat16"}},
      {"mixtral-test", {"remat_policy=none", "per_device_batch_size=2"}},
      {"gemma2-test", {"remat_policy=minimal", "per_device_batch_size=2"}},
      {"deepseek3-test", {"remat_policy=none", "per_device_batch_size=2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(name_of(c));
    const Config cfg = config_for(c.model, c.keys);
    const Plan plan = make_plan(cfg, test::plugins(), cpu_profile(cfg), PlanFor::train, false);
    ASSERT_TRUE(plan.train);
    // The allocator's share: offloaded moments are in another (host) allocator.
    const double predicted = static_cast<double>(plan.train->peak - plan.train->host_optimizer);
    const double measured = static_cast<double>(measured_training_peak(cfg));
    // Measured here: 1.0000 but llama-test in bf16 without remat, 1.0035; 3% as for decode.
    EXPECT_NEAR(predicted / measured, 1.0, 0.03)
        << "predicted " << human_bytes(predicted) << ", measured " << human_bytes(measured);
    if (std::getenv("MT_PLAN_VERBOSE"))
      std::printf("%-90s predicted %10.0f measured %10.0f ratio %.4f\n", name_of(c).c_str(),
                  predicted, measured, predicted / measured);
    EXPECT_EQ(plan.train->weights + plan.train->gradients + plan.train->optimizer +
                  plan.train->batches + plan.train->activations + plan.train->host_optimizer,
              plan.train->peak);
  }
}

// Measured on this project's 2-core AVX-512 machine: every decode case planned to the byte
// (ratio 1.0000) once the plan held the CPU flash kernels' per-thread tiles (before, 0.80-0.99:
// qwen3-moe-test's two 57 KiB blocks were a fifth of its step); the 3% allows for kernels that
// take other paths on other CPUs.
TEST(MemoryPlan, DecodePeakMatchesTheMeasuredPeak) {
  const std::vector<Case> cases = {
      {"llama-test", {"max_target_length=128", "max_prefill_predict_length=32"}},
      {"llama-test", {"dtype=bfloat16", "max_target_length=256", "max_prefill_predict_length=64"}},
      {"gemma2-test", {"max_target_length=128"}},
      {"deepseek3-test", {"max_target_length=128"}},
      // An int8 cache's dequantized temporaries grow with the cached length (the prompt is a
      // quarter of the cache); int8 weights; a windowed layer's ring buffer.
      {"llama-test",
       {"max_target_length=256", "max_prefill_predict_length=64", "quantize_kvcache=true"}},
      {"llama-test",
       {"dtype=bfloat16", "max_target_length=256", "max_prefill_predict_length=64",
        "quantize_kvcache=true", "quantization=int8"}},
      {"gemma2-test", {"max_target_length=128", "quantize_kvcache=true"}},
      // Mixtures of experts, their experts' weights in int8 too (one matmul_q8 per expert with
      // rows).
      {"mixtral-test", {"max_target_length=128"}},
      {"mixtral-test", {"max_target_length=128", "quantization=int8"}},
      {"qwen3-moe-test", {"max_target_length=128", "dtype=bfloat16"}},
      {"qwen3-moe-test", {"max_target_length=128", "dtype=bfloat16", "quantization=int8"}},
  };
  for (const Case& c : cases)
    for (int64_t batch : {1, 3}) {
      SCOPED_TRACE(name_of(c) + " batch " + std::to_string(batch));
      const Config cfg = config_for(c.model, c.keys);
      const Plan plan =
          make_plan(cfg, test::plugins(), cpu_profile(cfg), PlanFor::decode, false, batch);
      ASSERT_TRUE(plan.decode);
      const double predicted = static_cast<double>(plan.decode->peak);
      const double measured = static_cast<double>(measured_decode_peak(cfg, batch));
      EXPECT_NEAR(predicted / measured, 1.0, 0.03)
          << "predicted " << human_bytes(predicted) << ", measured " << human_bytes(measured);
      if (std::getenv("MT_PLAN_VERBOSE"))
        std::printf("%-90s predicted %10.0f measured %10.0f ratio %.4f\n",
                    (name_of(c) + " batch " + std::to_string(batch)).c_str(), predicted, measured,
                    predicted / measured);
    }
}

// Loading as mt decode loads (the weights in their final layout from the start, int8 ones
// quantized as each is read): the plan's weights are those loaded, and its loading figure (the
// weights and one parameter's temporaries, on the CPU its host copies as well) holds the
// backend's peak while loading, which stays below the weights in the compute dtype that
// loading everything before quantizing held.
TEST(MemoryPlan, LoadingIsPlanned) {
  const std::vector<Case> cases = {
      {"llama-test", {"dtype=bfloat16"}},
      {"llama-test", {"dtype=bfloat16", "quantization=int8"}},
      {"mixtral-test", {"quantization=int8"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(name_of(c));
    const Config cfg = config_for(c.model, c.keys);
    const Plan plan = make_plan(cfg, test::plugins(), cpu_profile(cfg), PlanFor::decode, false, 1);
    ASSERT_TRUE(plan.decode);
    const fs::path file = fs::path(::testing::TempDir()) /
                          ("plan_loading_" + std::to_string(&c - cases.data()) + ".safetensors");
    {
      ModelRunner source(cfg, test::plugins());
      source.init_parameters(3);
      std::vector<std::pair<std::string, Tensor>> named;
      for (const auto& p : source.params()) named.emplace_back(p.name, p.value);
      save_tensors(file, named);
    }
    const Config icfg = inference_config(cfg);
    const bool int8 = cfg.get_string("quantization") == "int8";
    ModelRunner r(icfg, test::plugins(), test::plugins().make_backend("cpu", icfg), nullptr, {}, {},
                  {}, int8);
    load_checkpoint_weights(file, r);
    const MemoryStats m = r.backend().memory_stats();
    EXPECT_EQ(m.bytes_in_use, plan.decode->weights);
    EXPECT_LE(m.peak_bytes_in_use, plan.decode->loading);
    EXPECT_GE(plan.decode->peak, plan.decode->loading);
    EXPECT_EQ(plan.decode->int8_projections, int8);
    if (int8) {
      EXPECT_GT(m.peak_bytes_in_use, m.bytes_in_use);  // an int8 weight's f32 temporary
      size_t compute = 0;  // every weight in the compute dtype, as before
      for (const auto& p : r.params())
        compute += static_cast<size_t>(shape_numel(p.spec.shape)) * dtype_size(r.weight_dtype());
      EXPECT_LT(m.peak_bytes_in_use, compute);
    }
  }
}

// The GPU's int8 products as the plan's meta backend traces them: up to 8 rows of x (decode)
// read the int8 rows in place, more (a prefill) hold the weights dequantized into x's dtype for
// the call, as the CUDA backend's matmul_q8 does (a 7b's LM head: 262 MB in bf16).
TEST(MemoryPlan, GpuInt8ProductsHoldTheirDequantizedWeights) {
  const DeviceProfile h100 = *named_device("h100-80gb", false);
  MetaBackend meta(h100);
  const int64_t n = 1000, k = 512;
  const Tensor w = meta.empty({n, q8_row_bytes(k)}, DType::i8);
  for (DType dt : {DType::bf16, DType::f32})
    for (int64_t rows : {1, 8, 9, 512}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " rows " + std::to_string(rows));
      const Tensor x = meta.empty({rows, k}, dt);
      Tensor y = meta.empty({rows, n}, dt);
      const size_t before = meta.memory_stats().bytes_in_use;
      meta.reset_peak_memory();
      meta.matmul_q8(x, w, y);
      const size_t held = meta.memory_stats().peak_bytes_in_use - before;
      EXPECT_EQ(held, rows > 8
                          ? planned_block_size(h100, static_cast<size_t>(n * k) * dtype_size(dt))
                          : 0u);
      EXPECT_EQ(meta.memory_stats().bytes_in_use, before);
    }
}

// The parts follow their definitions: f32 weights are 4 bytes a parameter, gradients f32 too,
// and mu_dtype=bfloat16 makes AdamW's state 6 bytes a parameter instead of 8.
TEST(MemoryPlan, PartsFollowTheDtypes) {
  const Config f32 = config_for("llama-test", {});
  const Config lean = config_for("llama-test", {"mu_dtype=bfloat16"});
  const Config bf16w = config_for("llama-test", {"weight_dtype=bfloat16"});
  DeviceProfile dev;  // size classes only
  const Plan a = make_plan(f32, test::plugins(), dev, PlanFor::train, false);
  const Plan b = make_plan(lean, test::plugins(), dev, PlanFor::train, false);
  const Plan c = make_plan(bf16w, test::plugins(), dev, PlanFor::train, false);
  const auto n = static_cast<double>(a.counts.total);
  EXPECT_NEAR(static_cast<double>(a.train->weights) / n, 4.0, 0.2);
  EXPECT_NEAR(static_cast<double>(a.train->gradients) / n, 4.0, 0.2);
  EXPECT_NEAR(static_cast<double>(a.train->optimizer) / n, 8.0, 0.4);
  EXPECT_NEAR(static_cast<double>(b.train->optimizer) / n, 6.0, 0.3);
  EXPECT_NEAR(static_cast<double>(c.train->weights) / n, 2.0, 0.1);
  // MaxText: mu inherits weight_dtype when mu_dtype is unset.
  EXPECT_NEAR(static_cast<double>(c.train->optimizer) / n, 6.0, 0.3);
  // The decode plan names the dtype the weights are held in (before: the compute dtype, so
  // weight_dtype=bfloat16 with dtype=float32 read "stored in float32" beside a bf16 size).
  const Plan d = make_plan(bf16w, test::plugins(), dev, PlanFor::decode, false);
  ASSERT_TRUE(d.decode);
  EXPECT_EQ(d.decode->weight_dtype, DType::bf16);
  EXPECT_NE(format_plan(d, bf16w).find("stored in bfloat16"), std::string::npos);
}

// On the CPU the asynchronous checkpoint's snapshot (weights and both moments, kept after the
// first save) shares the device's memory: the plan counts it, and proposes turning it off.
TEST(MemoryPlan, HostCheckpointSnapshotCounts) {
  const Config off = config_for("llama-test", {});
  const Config on = config_for("llama-test", {"enable_checkpointing=true"});
  DeviceProfile host = cpu_profile(on);
  const Plan a = make_plan(off, test::plugins(), host, PlanFor::train, false);
  const Plan b = make_plan(on, test::plugins(), host, PlanFor::train, false);
  const size_t snapshot = static_cast<size_t>(a.counts.total) * 12;  // f32 weights, m and v
  EXPECT_EQ(b.train->checkpoint, snapshot);
  EXPECT_EQ(b.train->peak, a.train->peak + snapshot);
  host.bytes = a.train->peak + snapshot / 2;
  const Plan c = make_plan(on, test::plugins(), host, PlanFor::train, true);
  ASSERT_FALSE(c.fixes.empty()) << format_plan(c, on);
  EXPECT_EQ(c.fixes[0].words, std::vector<std::string>{"async_checkpointing=false"});
}

// A device too small for the config: the plan lists changes, and each one, applied, fits.
TEST(MemoryPlan, ProposedChangesFitWhenApplied) {
  const Config cfg = config_for(
      "llama-test", {"per_device_batch_size=8", "max_target_length=256", "remat_policy=none"});
  DeviceProfile dev;
  const Plan full = make_plan(cfg, test::plugins(), dev, PlanFor::train, false);
  const TrainingPlan& t = *full.train;
  // Room for the persistent state and a third of the activations.
  dev.name = "test device";
  dev.bytes = t.weights + t.gradients + t.optimizer + t.batches + t.activations / 3;
  const Plan plan = make_plan(cfg, test::plugins(), dev, PlanFor::train, true);
  EXPECT_FALSE(plan.fits());
  ASSERT_FALSE(plan.fixes.empty()) << format_plan(plan, cfg);
  for (const PlanFix& f : plan.fixes) {
    std::vector<std::string> keys = {"per_device_batch_size=8", "max_target_length=256",
                                     "remat_policy=none"};
    keys.insert(keys.end(), f.words.begin(), f.words.end());
    const Plan again =
        make_plan(config_for("llama-test", keys), test::plugins(), dev, PlanFor::train, false);
    EXPECT_TRUE(again.fits()) << testing::PrintToString(f.words) << "\n" << format_plan(again, cfg);
    EXPECT_EQ(again.train->peak, f.peak);
  }
  const std::string text = format_plan(plan, cfg);
  EXPECT_NE(text.find("DOES NOT FIT"), std::string::npos) << text;
  EXPECT_NE(text.find("remat_policy="), std::string::npos) << text;
  // Smaller than the weights, gradients and optimizer state: no change is enough, and it says so.
  dev.bytes = t.weights;
  const Plan hopeless = make_plan(cfg, test::plugins(), dev, PlanFor::train, true);
  EXPECT_TRUE(hopeless.fixes.empty());
  EXPECT_NE(hopeless.beyond_fixes.find("more memory than one device has"), std::string::npos)
      << hopeless.beyond_fixes;
}

// Where the logits are most of a step's activations (a large vocabulary, many positions), the
// plan proposes num_vocab_tiling (about 1,024 positions a run), which fits alone once applied.
TEST(MemoryPlan, LargeLogitsAreTiled) {
  const std::vector<std::string> keys = {"vocab_size=16384", "per_device_batch_size=8",
                                         "max_target_length=256", "remat_policy=full"};
  const Config cfg = config_for("llama-test", keys);
  DeviceProfile dev;
  const Plan full = make_plan(cfg, test::plugins(), dev, PlanFor::train, false);
  const TrainingPlan& t = *full.train;
  dev.name = "test device";
  // The logits and their gradient are ~256 of the 258 MiB of activations; two runs halve them.
  dev.bytes = t.weights + t.gradients + t.optimizer + t.batches + t.activations * 6 / 10;
  const Plan plan = make_plan(cfg, test::plugins(), dev, PlanFor::train, true);
  EXPECT_FALSE(plan.fits());
  bool tiled = false;
  for (const PlanFix& f : plan.fixes)
    if (f.words == std::vector<std::string>{"num_vocab_tiling=2"}) {
      tiled = true;
      std::vector<std::string> with = keys;
      with.push_back("num_vocab_tiling=2");
      const Plan again =
          make_plan(config_for("llama-test", with), test::plugins(), dev, PlanFor::train, false);
      EXPECT_TRUE(again.fits()) << format_plan(again, cfg);
      EXPECT_EQ(again.train->peak, f.peak);
    }
  EXPECT_TRUE(tiled) << format_plan(plan, cfg);
}

// The user's command from the issue: llama2-7b on one 80 GB H100 does not fit in f32 with AdamW
// (108 GB of weights, gradients and moments), and the plan says so in well under two seconds,
// with a change of settings that, added to the command, fits.
TEST(MemoryPlan, Llama2_7bOnAnH100IsPlannedInSecondsAndItsFixFits) {
  const std::string cmd = "plan --model=llama2-7b backend=cpu plan_device=h100-80gb";
  const auto t0 = std::chrono::steady_clock::now();
  const test::MtResult r = test::run_mt(cmd, 60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_LT(s, 10.0) << "the issue asks for under two seconds; this machine is shared";
  for (const char* want : {"6.74B", "DOES NOT FIT", "optimizer", "activations", "KV cache",
                           "model FLOPs per step", "to fit", "activations by remat_policy"})
    EXPECT_NE(r.out.find(want), std::string::npos) << want << " in:\n" << r.out;
  // The suggested words: each line after "to fit, ...", up to "peak". Each fits when added;
  // and since moving the moments to the host (the one change that fits alone) makes every step
  // wait for the host, a combination that keeps them on the device is offered too (on an H100
  // it trained 56 times faster, 2026-11-26).
  const auto at = r.out.find("to fit");
  ASSERT_NE(at, std::string::npos) << r.out;
  std::istringstream lines(r.out.substr(r.out.find('\n', at) + 1));
  std::vector<std::string> fixes;
  for (std::string l;
       std::getline(lines, l) && l.rfind("  ", 0) == 0 && l.find("peak") != std::string::npos;) {
    std::istringstream line(l);
    std::string words;
    for (std::string w; line >> w && w != "peak";) words += " " + w;
    fixes.push_back(words);
  }
  ASSERT_EQ(fixes.size(), 2u) << r.out;
  EXPECT_EQ(fixes[0], " optimizer_memory_host_offload=true") << r.out;
  EXPECT_EQ(fixes[1].find("optimizer_memory_host_offload"), std::string::npos) << r.out;
  for (const std::string& words : fixes) {
    const test::MtResult fixed = test::run_mt(cmd + words, 60);
    EXPECT_EQ(fixed.code, 0) << words << "\n" << fixed.out;
    EXPECT_NE(fixed.out.find("fits:"), std::string::npos) << fixed.out;
  }
  // Host offload of the moments, the issue's other way: fits with remat and one sequence.
  const test::MtResult offload = test::run_mt(
      cmd + " per_device_batch_size=1 remat_policy=full optimizer_memory_host_offload=true", 60);
  EXPECT_EQ(offload.code, 0) << offload.out;
  EXPECT_NE(offload.out.find("in host memory"), std::string::npos) << offload.out;
  // A 70B model: nothing one device can do.
  const test::MtResult big =
      test::run_mt("plan --model=llama2-70b backend=cpu plan_device=h100-80gb", 60);
  EXPECT_EQ(big.code, 3) << big.out;
  EXPECT_NE(big.out.find("more memory than one device has"), std::string::npos) << big.out;
}

// Data parallelism's gradient all-reduce in the plan: 8 ranks on a node and 2 nodes, one flat
// mpi communicator whose reduce-scatter and all-gather exchange every rank's slice directly,
// move per rank 2 x 7/16 of the f32 gradients over NVLink and 2 x 8/16 across nodes (before: a
// hierarchical all-reduce's 2 x 1/2 of an eighth, 4x too little for what the trainer runs), at
// the device's link bandwidths; nccl is planned hierarchical; one rank plans none; tensor
// parallelism is refused as the trainer refuses it.
TEST(MemoryPlan, DataParallelCollectivesArePlanned) {
  const DeviceProfile h100 = *named_device("h100-80gb", false);
  const Config one = config_for("llama-test", {});
  EXPECT_FALSE(make_plan(one, test::plugins(), h100, PlanFor::train, false).collectives);
  const Config many =
      config_for("llama-test", {"ici_data_parallelism=8", "dcn_data_parallelism=2"});
  const Plan p = make_plan(many, test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(p.collectives);
  const CollectivePlan& c = *p.collectives;
  EXPECT_EQ(c.ici, 8);
  EXPECT_EQ(c.dcn, 2);
  EXPECT_EQ(c.gradient_bytes, static_cast<size_t>(p.counts.total) * 4);
  const auto g = static_cast<double>(c.gradient_bytes);
  EXPECT_DOUBLE_EQ(c.ici_bytes, 2.0 * 7 / 16 * g);
  EXPECT_DOUBLE_EQ(c.dcn_bytes, 2.0 * 8 / 16 * g);
  const Plan nccl = make_plan(
      config_for("llama-test",
                 {"ici_data_parallelism=8", "dcn_data_parallelism=2", "communicator=nccl"}),
      test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(nccl.collectives);
  EXPECT_DOUBLE_EQ(nccl.collectives->ici_bytes, 2.0 * 7 / 8 * g);
  EXPECT_DOUBLE_EQ(nccl.collectives->dcn_bytes, 2.0 * 1 / 2 * g / 8);
  const std::string text = format_plan(p, many);
  EXPECT_NE(text.find("data parallelism over 16 ranks (8 per node x 2 nodes)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("(450 GB/s: "), std::string::npos) << text;
  EXPECT_NE(text.find("(50 GB/s: "), std::string::npos) << text;
  const test::MtResult r =
      test::run_mt("plan --model=llama-test ici_tensor_parallelism=4 plan_device=h100-80gb", 60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("Tensor parallelism"), std::string::npos) << r.out;
}

// FSDP over 8 ranks: each holds 1/8 of the weights, gradients and moments (within the
// allocator's size classes, which round the smaller parts up by 7.5% here), plus, while a layer
// runs, its gathered weights and their gradients; the collectives are, per micro-batch, two
// all-gathers of the layers' f32 weights under remat (the backward's re-run gathers again), one
// of the top ones, and one reduce-scatter of the gradients, each moving 7/8 of them through a
// rank's link. A run that does not fit on one device is offered FSDP over its data-parallel
// ranks.
TEST(MemoryPlan, FsdpIsPlannedPerRank) {
  const DeviceProfile h100 = *named_device("h100-80gb", false);
  const Plan whole =
      make_plan(config_for("llama2-7b", {"remat_policy=full", "enable_checkpointing=true"}),
                test::plugins(), h100, PlanFor::train, false);
  const Config cfg =
      config_for("llama2-7b", {"remat_policy=full", "ici_data_parallelism=1",
                               "ici_fsdp_parallelism=8", "enable_checkpointing=true"});
  const Plan fsdp = make_plan(cfg, test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(whole.train && fsdp.train);
  // The host copy an async checkpoint keeps is the rank's parts too (each rank saves its own).
  ASSERT_GT(whole.train->checkpoint, 0u);
  for (auto [part, all] : {std::pair{fsdp.train->weights, whole.train->weights},
                           std::pair{fsdp.train->gradients, whole.train->gradients},
                           std::pair{fsdp.train->optimizer, whole.train->optimizer},
                           std::pair{fsdp.train->checkpoint, whole.train->checkpoint}})
    EXPECT_NEAR(static_cast<double>(part), static_cast<double>(all) / 8, 0.1 * all / 8);
  // A layer's f32 weights and gradients (about 200M parameters x 8 bytes) above the
  // unsharded run's activations, and far below the 7/8 of the state that went.
  EXPECT_GT(fsdp.train->activations, whole.train->activations);
  EXPECT_LT(fsdp.train->peak, whole.train->peak / 5);
  ASSERT_TRUE(fsdp.collectives);
  const CollectivePlan& c = *fsdp.collectives;
  EXPECT_TRUE(c.fsdp);
  EXPECT_EQ(c.gathers, 2);
  EXPECT_EQ(c.ici, 8);
  EXPECT_EQ(c.dcn, 1);
  // The embedding, head and final norm are gathered once a step (outside remat).
  const double top_share = (2.0 * 32000 * 4096 + 4096) / static_cast<double>(fsdp.counts.total);
  EXPECT_NEAR(c.ici_bytes, (3.0 - top_share) * 7 / 8 * static_cast<double>(c.gradient_bytes),
              1e-6 * c.ici_bytes);
  const std::string text = format_plan(fsdp, cfg);
  EXPECT_NE(text.find("FSDP over 8 ranks (8 per node x 1 node)"), std::string::npos) << text;
  EXPECT_NE(text.find("this rank's 1/8 (FSDP)"), std::string::npos) << text;
  // HSDP: 8 fsdp ranks on each of 2 nodes hold 1/8 each, the nodes copies of each other.
  const Config hsdp_cfg =
      config_for("llama2-7b", {"remat_policy=full", "ici_data_parallelism=1",
                               "ici_fsdp_parallelism=8", "dcn_data_parallelism=2"});
  const Plan hsdp = make_plan(hsdp_cfg, test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(hsdp.train && hsdp.collectives);
  EXPECT_EQ(hsdp.train->weights, fsdp.train->weights);
  EXPECT_EQ(hsdp.collectives->copies, 2);
  EXPECT_DOUBLE_EQ(hsdp.collectives->ici_bytes, c.ici_bytes);
  EXPECT_DOUBLE_EQ(hsdp.collectives->dcn_bytes,
                   2.0 * 1 / 2 * static_cast<double>(c.gradient_bytes) / 8);
  EXPECT_NE(format_plan(hsdp, hsdp_cfg).find("in 2 copies (HSDP)"), std::string::npos);
  // Eight data-parallel ranks of llama2-7b do not fit an H100 each; FSDP over them does.
  const Plan dp = make_plan(config_for("llama2-7b", {"ici_data_parallelism=8"}), test::plugins(),
                            h100, PlanFor::train, true);
  bool offered = false;
  for (const PlanFix& f : dp.fixes)
    for (const std::string& w : f.words)
      if (w == "ici_fsdp_parallelism=8") offered = offered || f.fits;
  EXPECT_TRUE(offered) << format_plan(dp, config_for("llama2-7b", {"ici_data_parallelism=8"}));
}

// Tensor parallelism over 8 ranks: each holds 1/8 of the split weights (llama2-7b's
// attention and MLP matrices) and the whole embedding and head, with their gradients and
// moments; the collectives are the blocks' sums, 4 a layer (2 forward, 2 backward) of a
// [B, T, d] f32 activation, each moving 2 x 7/8 of it through a rank's link. Heads the axis does
// not divide are refused.
TEST(MemoryPlan, TensorParallelismIsPlannedPerRank) {
  const DeviceProfile h100 = *named_device("h100-80gb", false);
  const Plan whole =
      make_plan(config_for("llama2-7b", {}), test::plugins(), h100, PlanFor::train, false);
  const Config cfg =
      config_for("llama2-7b", {"ici_data_parallelism=1", "ici_tensor_parallelism=8"});
  const Plan tp = make_plan(cfg, test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(whole.train && tp.train);
  // embedding and lm_head: 2 x 32000 x 4096 whole; the rest (6.48B) in eighths.
  const double top = 2.0 * 32000 * 4096, rest = static_cast<double>(whole.counts.total) - top;
  EXPECT_NEAR(static_cast<double>(tp.train->weights), 4 * (top + rest / 8),
              0.1 * 4 * (top + rest / 8));
  EXPECT_NEAR(static_cast<double>(tp.train->optimizer), 8 * (top + rest / 8),
              0.1 * 8 * (top + rest / 8));
  EXPECT_LT(tp.train->activations, whole.train->activations);
  ASSERT_TRUE(tp.collectives);
  const CollectivePlan& c = *tp.collectives;
  EXPECT_EQ(c.tensor, 8);
  EXPECT_EQ(c.tensor_sums, 32 * 4);
  EXPECT_EQ(c.tensor_sum_bytes, static_cast<size_t>(4 * 512 * 4096 * 4));
  EXPECT_DOUBLE_EQ(c.tensor_bytes, 2.0 * 7 / 8 * 128 * static_cast<double>(c.tensor_sum_bytes));
  // Every micro-step sums again: 5 of them, of which the trace runs two.
  const Plan acc =
      make_plan(config_for("llama2-7b", {"ici_data_parallelism=1", "ici_tensor_parallelism=8",
                                         "gradient_accumulation_steps=5"}),
                test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(acc.collectives);
  EXPECT_EQ(acc.collectives->tensor_sums, 5 * 32 * 4);
  const std::string text = format_plan(tp, cfg);
  EXPECT_NE(text.find("tensor parallelism over 8 ranks per batch"), std::string::npos) << text;
  EXPECT_NE(text.find("this rank's part (tensor parallelism over 8)"), std::string::npos) << text;
  // Each of the 8 ranks sharing the batch does an eighth of its FLOPs (the step time was the
  // whole batch's on one device).
  EXPECT_NE(text.find("on each of the 8 tensor ranks sharing the batch"), std::string::npos)
      << text;
  EXPECT_NE(text.find("tokens/s for a group of 8 tensor ranks"), std::string::npos) << text;
  // The tensor axis across nodes: its sums go over the nodes' links (before: "within the node"
  // at 450 GB/s whatever dcn_tensor_parallelism said).
  const Config dcn_cfg = config_for(
      "llama2-7b",
      {"ici_data_parallelism=1", "ici_tensor_parallelism=4", "dcn_tensor_parallelism=2"});
  const std::string dcn_text =
      format_plan(make_plan(dcn_cfg, test::plugins(), h100, PlanFor::train, false), dcn_cfg);
  const size_t tensor_line = dcn_text.find("tensor parallelism over 8 ranks");
  ASSERT_NE(tensor_line, std::string::npos) << dcn_text;
  const std::string line =
      dcn_text.substr(tensor_line, dcn_text.find('\n', tensor_line) - tensor_line);
  EXPECT_NE(line.find("across nodes (50 GB/s"), std::string::npos) << line;
  // Data x tensor: each tensor rank all-reduces its parts' gradients exactly, not as the
  // allocator rounds them (before: 7.48 GiB planned for 7.01 GiB).
  const Plan dt =
      make_plan(config_for("llama2-7b", {"ici_data_parallelism=2", "ici_tensor_parallelism=4"}),
                test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(dt.collectives);
  const double d = 4096, local = top + d + 32 * (2 * d + (4 * d * d + 3 * d * 11008) / 4);
  EXPECT_EQ(dt.collectives->gradient_bytes, static_cast<size_t>(4 * local));
  EXPECT_THROW(
      make_plan(config_for("llama-test", {"ici_data_parallelism=1", "ici_tensor_parallelism=4"}),
                test::plugins(), h100, PlanFor::train, false),
      UsageError);
}

// shard_optimizer_over_data: each of N data-parallel ranks holds 1/N of the moments (within the
// allocator's size classes: llama2-7b's are large, so 1%), the plan says so, and a run over 8
// ranks that does not fit is told to shard first (it costs no traffic and changes no loss).
TEST(MemoryPlan, ShardedOptimizerStateIsPlannedPerRank) {
  const DeviceProfile h100 = *named_device("h100-80gb", false);
  const Plan whole = make_plan(config_for("llama2-7b", {"ici_data_parallelism=8"}), test::plugins(),
                               h100, PlanFor::train, false);
  const Config sharded_cfg =
      config_for("llama2-7b", {"ici_data_parallelism=8", "shard_optimizer_over_data=true"});
  const Plan sharded = make_plan(sharded_cfg, test::plugins(), h100, PlanFor::train, false);
  ASSERT_TRUE(whole.train && sharded.train);
  const auto w = static_cast<double>(whole.train->optimizer);
  EXPECT_GT(w, 50e9);
  EXPECT_NEAR(static_cast<double>(sharded.train->optimizer), w / 8, 0.01 * w / 8);
  EXPECT_EQ(whole.train->peak - sharded.train->peak,
            whole.train->optimizer - sharded.train->optimizer);
  const std::string text = format_plan(sharded, sharded_cfg);
  EXPECT_NE(text.find("this rank's 1/8 of them (shard_optimizer_over_data)"), std::string::npos)
      << text;
  EXPECT_NE(text.find("reduce-scatters"), std::string::npos) << text;
  // llama2-7b in f32 over 8 ranks: 117 GiB, over an H100; sharding alone fits it (73.1 GiB).
  const test::MtResult r =
      test::run_mt("plan --model=llama2-7b plan_device=h100-80gb ici_data_parallelism=8", 60);
  EXPECT_EQ(r.code, 3) << r.out;
  const size_t fix = r.out.find("to fit, add any one of these");
  ASSERT_NE(fix, std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("shard_optimizer_over_data=true", fix), r.out.find('\n', fix) + 3) << r.out;
}

// mt run refuses a model that cannot fit this machine before allocating it: exit 2, the plan
// on stderr, no run directory left behind, and within seconds (not after initialising 70B
// parameters).
TEST(MemoryPlan, RunRefusesAModelThatCannotFit) {
  const std::string out = ::testing::TempDir() + "mt_plan_refuse";
  const auto t0 = std::chrono::steady_clock::now();
  const test::MtResult r = test::run_mt(
      "run --model=llama2-70b backend=cpu dataset_type=synthetic steps=1 base_output_directory=" +
          out,
      60);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_LT(s, 20.0);
  EXPECT_NE(r.out.find("does not fit"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Nothing was allocated"), std::string::npos) << r.out;
  EXPECT_FALSE(std::filesystem::exists(out + "/default")) << "a refused run leaves nothing";
  std::filesystem::remove_all(out);
  // mt decode: refused before it reads a single weight (the path does not even exist).
  const test::MtResult d =
      test::run_mt("decode --model=llama2-70b backend=cpu load_parameters_path=/nonexistent", 60);
  EXPECT_EQ(d.code, 2) << d.out;
  EXPECT_NE(d.out.find("does not fit"), std::string::npos) << d.out;
  EXPECT_NE(d.out.find("KV cache"), std::string::npos) << d.out;
  // mt score: the weights alone cannot be loaded, so refused alike (before: an allocation
  // failure part-way through loading, with the allocator's generic advice).
  const test::MtResult sc = test::run_mt(
      "score --model=llama2-70b backend=cpu load_parameters_path=/nonexistent tokens=1,2", 60);
  EXPECT_EQ(sc.code, 2) << sc.out;
  EXPECT_NE(sc.out.find("mt score would need"), std::string::npos) << sc.out;
  EXPECT_NE(sc.out.find("to load its weights"), std::string::npos) << sc.out;
  EXPECT_NE(sc.out.find("Nothing was allocated"), std::string::npos) << sc.out;
  // mt convert holds all the weights too: both ways refused alike before any is allocated or a
  // file written (before: an allocation failure part-way, after the output directory was made).
  const std::string hf = ::testing::TempDir() + "mt_plan_refuse_hf";
  const test::MtResult to =
      test::run_mt("convert --to=hf --model=llama2-70b backend=cpu --output=" + hf, 60);
  EXPECT_EQ(to.code, 2) << to.out;
  EXPECT_NE(to.out.find("mt convert would need"), std::string::npos) << to.out;
  EXPECT_FALSE(std::filesystem::exists(hf)) << "a refused conversion leaves nothing";
  // A Llama 2 70B's config.json alone: refused before its (absent) safetensors are looked for.
  const std::string big = ::testing::TempDir() + "mt_plan_refuse_70b";
  std::filesystem::create_directories(big);
  std::ofstream(big + "/config.json")
      << R"({"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
            "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})";
  const std::string imported = ::testing::TempDir() + "mt_plan_refuse_import";
  const test::MtResult from =
      test::run_mt("convert --from=hf --input=" + big + " --output=" + imported, 60);
  EXPECT_EQ(from.code, 2) << from.out;
  EXPECT_NE(from.out.find("mt convert would need"), std::string::npos) << from.out;
  EXPECT_FALSE(std::filesystem::exists(imported)) << "a refused conversion leaves nothing";
  std::filesystem::remove_all(big);
}

// The launcher's local rank picks a process's GPU (the CUDA backend, the nccl communicator):
// OpenMPI's before Slurm's, 0 without either; a value that is not a whole number >= 0 is refused
// (atoi made "-1" a negative device, "x" device 0).
TEST(LauncherEnv, LocalRankIsAWholeNumber) {
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  ::unsetenv("SLURM_LOCALID");
  EXPECT_EQ(env_local_rank(), 0);
  ::setenv("SLURM_LOCALID", "3", 1);
  EXPECT_EQ(env_local_rank(), 3);
  ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", "12", 1);
  EXPECT_EQ(env_local_rank(), 12);
  for (const char* bad : {"-1", "x", "1.5", " 2", "99999999999"}) {
    ::setenv("OMPI_COMM_WORLD_LOCAL_RANK", bad, 1);
    try {
      (void)env_local_rank();
      ADD_FAILURE() << bad << " taken";
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("OMPI_COMM_WORLD_LOCAL_RANK=") + bad +
                                           ": the launcher's local rank must be"),
                std::string::npos)
          << e.what();
    }
  }
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  ::unsetenv("SLURM_LOCALID");
}

// Ranks of one job on one host share its memory: each rank's run is checked against its part
// (before: against the whole host, so two ranks planned at 60% each passed and needed 120%).
// The share is the launcher's local rank count; a 1-rank run or a GPU is not divided.
TEST(MemoryPlan, RanksOnOneHostShareItsMemory) {
  const Config cfg = test::model_config("llama-test", {"dataset_type=synthetic"});
  auto fits = [&](int ranks) {
    try {
      check_fits(cfg, test::plugins(), test::cpu(), PlanFor::train, "run", ranks);
      return std::string();
    } catch (const UsageError& e) {
      return std::string(e.what());
    }
  };
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::unsetenv("MPI_LOCALNRANKS");
  EXPECT_EQ(fits(2), "");
  // So many ranks on this host that llama-test's few MiB do not fit in a share.
  ::setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "100000000", 1);
  EXPECT_EQ(fits(1), "");
  const std::string refused = fits(2);
  EXPECT_NE(refused.find("does not fit"), std::string::npos) << refused;
  EXPECT_NE(refused.find("shared by 100000000 ranks of this job"), std::string::npos) << refused;
  ::unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  ::setenv("MPI_LOCALNRANKS", "100000000", 1);
  EXPECT_NE(fits(2).find("shared by 100000000 ranks"), std::string::npos);
  ::unsetenv("MPI_LOCALNRANKS");
  // srun: this node's count in SLURM_STEP_TASKS_PER_NODE ("N(xM)" repeats a count M nodes).
  ::setenv("SLURM_STEP_TASKS_PER_NODE", "3(x2),100000000,5", 1);
  for (const auto& [node, says] :
       {std::pair{"1", ""}, std::pair{"2", "shared by 100000000 ranks"}, std::pair{"3", ""}}) {
    ::setenv("SLURM_NODEID", node, 1);
    const std::string got = fits(2);
    if (*says)
      EXPECT_NE(got.find(says), std::string::npos) << node << got;
    else
      EXPECT_EQ(got, "") << node;
  }
  ::unsetenv("SLURM_STEP_TASKS_PER_NODE");
  ::unsetenv("SLURM_NODEID");
}

// mt decode plans the prompts it decodes at once, each with a cache of max_target_length
// (before: one, whatever prompt_file held: 8000 prompts of llama-test peaked at 100x the plan).
TEST(MemoryPlan, DecodePlansEveryPrompt) {
  const Config cfg = test::model_config("llama-test", {"max_target_length=65536"});
  EXPECT_NO_THROW(check_fits(cfg, test::plugins(), test::cpu(), PlanFor::decode, "decode"));
  try {
    check_fits(cfg, test::plugins(), test::cpu(), PlanFor::decode, "decode", 1, 100000);
    ADD_FAILURE() << "1e5 caches of 65536 tokens were planned to fit";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("decodes its 100000 prompts at once"), std::string::npos)
        << e.what();
  }
}

TEST(MemoryPlan, BadInputsAreRefusedClearly) {
  const test::MtResult dev = test::run_mt("plan --model=llama-test plan_device=tpu-v9", 30);
  EXPECT_EQ(dev.code, 2) << dev.out;
  EXPECT_NE(dev.out.find("h100-80gb"), std::string::npos) << dev.out;
  const test::MtResult zero = test::run_mt("plan --model=llama-test plan_device=cpu-0gb", 30);
  EXPECT_EQ(zero.code, 2) << zero.out;
  const test::MtResult mu = test::run_mt("plan --model=llama-test mu_dtype=float16", 30);
  EXPECT_EQ(mu.code, 2) << mu.out;
  EXPECT_NE(mu.out.find("mu_dtype"), std::string::npos) << mu.out;
  // A step time divided by zero (before: "inf s ... 0 tokens/s").
  const test::MtResult none = test::run_mt("plan --model=llama-test plan_assumed_mfu=0", 30);
  EXPECT_EQ(none.code, 2) << none.out;
  EXPECT_NE(none.out.find("plan_assumed_mfu=0"), std::string::npos) << none.out;
}

// Sizes far past any machine are planned in an instant (the trace holds no values and runs two
// micro-batches), and say they do not fit (exit 3) or are refused as keys (exit 2). Before:
// max_target_length=10^9 filled 8 GB of host memory with zeros for 49 s, 10^10 ended in
// std::bad_alloc, and 10^5 layers or 10^9 accumulation steps ran for minutes.
TEST(MemoryPlan, AbsurdSizesArePlannedInAnInstant) {
  for (const char* keys : {"max_target_length=1000000000", "max_target_length=2147483647",
                           "gradient_accumulation_steps=1000000000",
                           "max_target_length=1000000000 num_vocab_tiling=64"}) {
    const test::MtResult r = test::run_mt(std::string("plan --model=llama-test ") + keys, 20);
    EXPECT_EQ(r.code, 3) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find("the peak is"), std::string::npos) << keys << "\n" << r.out;
  }
  for (const char* keys : {"max_target_length=10000000000", "base_num_decoder_layers=100000"}) {
    const test::MtResult r = test::run_mt(std::string("plan --model=llama-test ") + keys, 20);
    EXPECT_EQ(r.code, 2) << keys << "\n" << r.out;
    EXPECT_NE(r.out.find("out of range"), std::string::npos) << keys << "\n" << r.out;
  }
  // 2^31 routed slots in a micro-batch (before: the trace's internal check, exit 1).
  const test::MtResult moe = test::run_mt(
      "plan --model=qwen3-moe-test per_device_batch_size=67108864 max_target_length=32", 20);
  EXPECT_EQ(moe.code, 2) << moe.out;
  EXPECT_NE(moe.out.find("routed slots in a micro-batch"), std::string::npos) << moe.out;
}

}  // namespace
}  // namespace mt
