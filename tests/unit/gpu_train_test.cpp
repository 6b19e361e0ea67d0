// Training on the CUDA backend against the CPU backend (label `gpu`).
//
// llama-test trains for 20 steps on synthetic data, once per backend, from the same seeds (so the
// same initial weights, which are drawn on the host, and the same batches); the per-step losses
// of metrics.jsonl must agree: within 1e-3 absolute with f32 activations and weights (full-f32
// matmuls, dot_product and flash attention), within 3% relative with bf16 activations.
//
// Built a second time as cuda_emulated_train_test (label slow): "cuda" is then the plugin's
// kernels run on the CPU under tests/support/cuda_emulation.h, registered in-process.
//
// Where the cuda plugin was not built, or declines because this machine has no driver or no
// device, every test skips and says why. Any other failure (the plugin does not load, the backend
// or an attention kernel cannot be made) fails the test.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config_loader.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "test_support.h"
#ifdef MT_CUDA_EMULATED_OPS
#include "emulated_cuda.h"
#endif
#include "decoder.h"
#include "model_runner.h"
#include "trainer.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

constexpr int kSteps = 20;

// Whether the cuda plugin can run here: `skip` says why not (not built, or it declined: no driver
// or no device), `error` why loading it failed otherwise.
struct CudaPlugin {
  std::string skip, error;
};
const CudaPlugin& cuda_plugin() {
  static const CudaPlugin state = [] {
    CudaPlugin s;
#ifdef MT_CUDA_EMULATED_OPS
    // cuda_emulated_train_test: "cuda" is the plugin's kernels emulated on the CPU, registered
    // in-process under the plugin's names.
    test::plugins().add_backend("cuda", [](const Config&) { return test::emulated_cuda(); });
    for (const char* name : {"dot_product", "flash"})
      test::plugins().add_attention(
          "cuda", name, [name](Backend& b) { return test::emulated_cuda_attention(name, b); });
#else
    const test::DevicePlugins d =
        test::device_plugins({{"backend", "cuda"}}, "libmt_backend_cuda.so", "no CUDA toolkit");
    s.skip = d.skip;
    s.error = d.error;
#endif
    return s;
  }();
  return state;
}

class GpuTrain : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_plugin().error.empty()) FAIL() << "the cuda plugin failed: " << cuda_plugin().error;
    if (!cuda_plugin().skip.empty()) GTEST_SKIP() << cuda_plugin().skip;
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Trains llama-test on `backend` with `extra` overrides; returns the loss of each step.
  std::vector<double> losses(const std::string& backend, const std::vector<std::string>& extra) {
    ConfigRequest req;
    req.configs_dir = test::source_dir() + "/configs";
    req.model = "llama-test";
    req.overrides = {"backend=" + backend, "run_name=" + backend,
                     "base_output_directory=" + dir_.string(), "steps=" + std::to_string(kSteps)};
    // The same seeds on both backends: the same initial weights and batches.
    for (const char* kv : {"dataset_type=synthetic", "init_weights_seed=7", "data_shuffle_seed=11",
                           "log_period=1", "eval_interval=-1", "enable_checkpointing=false"})
      req.overrides.emplace_back(kv);
    req.overrides.insert(req.overrides.end(), extra.begin(), extra.end());
    const Config cfg = load_config(req);
    train(cfg, test::plugins(), /*quiet=*/true);

    std::vector<double> out;
    std::ifstream f(dir_ / backend / "metrics.jsonl");
    for (std::string line; std::getline(f, line);) {
      const size_t step = line.find("\"step\": "), loss = line.find("\"loss\": ");
      if (step == std::string::npos || loss == std::string::npos) {
        ADD_FAILURE() << backend << ": metrics line without step or loss: " << line;
        continue;
      }
      EXPECT_EQ(std::stol(line.substr(step + 8)), static_cast<long>(out.size()) + 1)
          << backend << ": " << line;
      out.push_back(std::stod(line.substr(loss + 8)));
    }
    EXPECT_EQ(out.size(), static_cast<size_t>(kSteps)) << backend << ": steps in metrics.jsonl";
    return out;
  }

  // Both runs; every step's loss within `abs_tol` + `rel_tol` * |cpu loss|.
  void compare(const std::vector<std::string>& extra, double abs_tol, double rel_tol) {
    const std::vector<double> cpu = losses("cpu", extra);
    const std::vector<double> gpu = losses("cuda", extra);
    ASSERT_EQ(cpu.size(), gpu.size());
    std::string table;
    double worst = 0;
    bool ok = true;
    for (size_t i = 0; i < cpu.size(); ++i) {
      const double d = std::fabs(gpu[i] - cpu[i]);
      worst = std::max(worst, d);
      const bool step_ok = std::isfinite(gpu[i]) && d <= abs_tol + rel_tol * std::fabs(cpu[i]);
      ok = ok && step_ok;
      char row[128];
      std::snprintf(row, sizeof(row), "  step %2zu  cpu %.7f  cuda %.7f  diff %.2e%s\n", i + 1,
                    cpu[i], gpu[i], d, step_ok ? "" : "  <--");
      table += row;
    }
    EXPECT_TRUE(ok) << "losses differ beyond " << abs_tol << " + " << rel_tol
                    << " * |cpu| (largest difference " << worst << "):\n"
                    << table;
  }

  fs::path dir_ =
      fs::temp_directory_path() / ("mt_gpu_train_" + std::to_string(::getpid()) + "_" +
                                   ::testing::UnitTest::GetInstance()->current_test_info()->name());
};

TEST_F(GpuTrain, Float32DotProductMatchesCpu) {
  compare({"dtype=float32", "weight_dtype=float32", "matmul_precision=highest",
           "attention=dot_product"},
          1e-3, 0.0);
}

// A cuda backend without a flash kernel fails this test: an unknown kernel is never a skip.
TEST_F(GpuTrain, Float32FlashMatchesCpu) {
  compare({"dtype=float32", "weight_dtype=float32", "matmul_precision=highest", "attention=flash"},
          1e-3, 0.0);
}

TEST_F(GpuTrain, Bfloat16MatchesCpu) {
  compare({"dtype=bfloat16", "weight_dtype=float32", "attention=dot_product"}, 0.0, 0.03);
}

// head_dim 64 in bf16 puts the cuda flash kernel on its tensor-core path.
TEST_F(GpuTrain, Bfloat16FlashTensorCoresMatchCpu) {
  compare({"dtype=bfloat16", "weight_dtype=float32", "attention=flash", "head_dim=64"}, 0.0, 0.03);
}

// Decode steps recorded as a CUDA graph and replayed (Decoder, mt/capture.h) give the logits of
// steps run as they come, bit for bit, for two sequences of different lengths, one stopping
// early; the logits are the CPU backend's within the dtype's tolerance. The emulated backend cannot
// record (no CUDA graphs): there both decoders run each op as it comes.
TEST_F(GpuTrain, RecordedDecodeStepsGiveTheLogitsOfStepsRunAsTheyCome) {
  for (const char* dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    auto make = [&](const std::string& backend) {
      ConfigRequest req;
      req.configs_dir = test::source_dir() + "/configs";
      req.model = "llama-test";
      req.overrides = {"backend=" + backend, std::string("dtype=") + dtype,
                       std::string("weight_dtype=") + dtype, "attention=flash",
                       "matmul_precision=highest"};
      auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
      r->init_parameters(7);
      return r;
    };
    std::unique_ptr<ModelRunner> gpu = make("cuda"), cpu = make("cpu");
    const int64_t V = gpu->model().dims().vocab_size;
    Decoder plain(*gpu, 2, 32), recorded(*gpu, 2, 32), host(*cpu, 2, 32);
    plain.set_recording(false);
    const std::vector<int32_t> p0 = {5, 9, 2, 7, 1, 3}, p1 = {4, 4};
    for (Decoder* d : {&plain, &recorded, &host}) {
      d->prefill(0, p0, /*last_only=*/true);
      d->prefill(1, p1, /*last_only=*/true);
    }
    std::vector<int32_t> next = {3, 5};
    std::vector<bool> active = {true, true};
    const double tol = std::string(dtype) == "float32" ? 1e-4 : 5e-2;
    for (int s = 0; s < 12; ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      if (s == 6) active[1] = false;
      const std::vector<float> want = plain.step(next, active), got = recorded.step(next, active);
      const std::vector<float> on_cpu = host.step(next, active);
      ASSERT_EQ(got, want);
      double diff = 0, ref = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        diff = std::max(diff, std::fabs(double(got[i]) - double(on_cpu[i])));
        ref = std::max(ref, std::fabs(double(on_cpu[i])));
      }
      EXPECT_LE(diff, tol * ref) << "the cuda backend's logits against the cpu's";
      for (size_t i = 0; i < 2; ++i) {
        const float* l = want.data() + static_cast<int64_t>(i) * V;
        next[i] = static_cast<int32_t>(std::max_element(l, l + V) - l);
      }
    }
#ifdef MT_CUDA_EMULATED_OPS
    EXPECT_NE(recorded.step_recording(), "recorded");
#else
    EXPECT_EQ(recorded.step_recording(), "recorded");
#endif
  }
}

// Decode on the device with the projections stored as inference lays them out for one or two
// sequences (ModelRunner::rows_layout_pays: [N, K] rows, then q/k/v and gate/up fused into one
// tensor each, fuse_projections; int8 rows with quantization=int8): the logits of batch 1 (the
// fused products' outputs split as views) and batch 2 (split as copies) are those of the weights
// as declared on the same device, and the CPU backend's with the same layout, within the dtype's
// tolerance. (int8: against int8 rows apart.) mixtral-test: its experts' weights are int8 rows
// too (Graph::grouped_project, one matmul_q8 per expert), and [N, K] on the CPU only (the
// backend's grouped products take that layout there). Its int8 steps are not compared across
// backends: the CPU quantizes decode's rows of x as well (q8_0 x q8_0) and the device does not,
// and in the emulation that moved a router's near tie to another expert at batch 2 (0.70 off
// against 0.14 allowed), which no tolerance short of the logits' range would cover.
TEST_F(GpuTrain, DecodeWithFusedRowsMatchesDeclaredWeightsAndCpu) {
  for (const char* model : {"llama-test", "mixtral-test"})
    for (const char* mode : {"float32", "bfloat16", "int8"}) {
      SCOPED_TRACE(std::string(model) + ", " + mode);
      const bool moe = std::string(model) == "mixtral-test";
      const bool int8 = std::string(mode) == "int8";
      const std::string dtype = int8 ? "bfloat16" : mode;
      // rows: as decode lays them out; fuse: then fused (int8 weights are rows either way).
      auto make = [&](const std::string& backend, bool rows, bool fuse) {
        ConfigRequest req;
        req.configs_dir = test::source_dir() + "/configs";
        req.model = model;
        req.overrides = {"backend=" + backend, "dtype=" + dtype, "weight_dtype=" + dtype,
                         "attention=flash", "matmul_precision=highest"};
        auto r = std::make_unique<ModelRunner>(load_config(req), test::plugins());
        r->init_parameters(7);
        if (rows) {
          if (int8) {
            EXPECT_GT(r->quantize_projections(), 0u);
          } else {
            EXPECT_TRUE(r->rows_layout_pays(2)) << backend;
            EXPECT_GT(r->transpose_projections(), 0u) << backend;
          }
          if (fuse) {  // q/k/v, and gate/up of a dense MLP or of the experts where they are
                       // rows (int8, or [N, K] on the CPU)
            const bool experts = int8 || backend == "cpu";
            EXPECT_EQ(r->fuse_projections(),
                      (moe && !experts ? 1u : 2u) * static_cast<size_t>(r->model().num_layers()))
                << backend;
          }
        }
        return r;
      };
      std::unique_ptr<ModelRunner> fused = make("cuda", true, true),
                                   declared = make("cuda", int8, false),
                                   cpu = make("cpu", true, true);
      const double tol = dtype == "float32" ? 1e-4 : 5e-2;
      auto close = [&](const std::vector<float>& got, const std::vector<float>& want,
                       const char* what) {
        ASSERT_EQ(got.size(), want.size());
        double diff = 0, ref = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          diff = std::max(diff, std::fabs(double(got[i]) - double(want[i])));
          ref = std::max(ref, std::fabs(double(want[i])));
        }
        EXPECT_LE(diff, tol * ref) << what;
      };
      for (int64_t batch : {1, 2}) {
        SCOPED_TRACE("batch " + std::to_string(batch));
        Decoder a(*fused, batch, 32), b(*declared, batch, 32), c(*cpu, batch, 32);
        const std::vector<std::vector<int32_t>> prompts = {{5, 9, 2, 7, 1, 3}, {4, 4}};
        for (int64_t i = 0; i < batch; ++i) {
          const auto& p = prompts[static_cast<size_t>(i)];
          const std::vector<float> la = a.prefill(i, p, true), lb = b.prefill(i, p, true),
                                   lc = c.prefill(i, p, true);
          close(la, lb, "prefill: fused rows against the declared weights");
          close(la, lc, "prefill: cuda against cpu");
        }
        std::vector<int32_t> next(static_cast<size_t>(batch), 3);
        const std::vector<bool> active(static_cast<size_t>(batch), true);
        for (int s = 0; s < 6; ++s) {
          const std::vector<float> la = a.step(next, active), lb = b.step(next, active),
                                   lc = c.step(next, active);
          close(la, lb, "step: fused rows against the declared weights");
          if (!(moe && int8)) close(la, lc, "step: cuda against cpu");
          const int64_t V = fused->model().dims().vocab_size;
          for (int64_t i = 0; i < batch; ++i) {
            const float* l = lc.data() + i * V;
            next[static_cast<size_t>(i)] = static_cast<int32_t>(std::max_element(l, l + V) - l);
          }
        }
      }
    }
}

}  // namespace
}  // namespace mt
