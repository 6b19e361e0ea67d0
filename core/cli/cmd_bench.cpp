// mt bench: end-to-end throughput as one JSON object on stdout.
//   mt bench train [--model=NAME] [key=value ...]   (default: configuration M, llama-bench-m)
#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <random>
#include <thread>
#include <vector>
#include <filesystem>

#include "cli.h"
#include "decoder.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "trainer.h"

namespace mt::cli {

namespace {

int bench_train(Args args) {
  if (args.model.empty()) args.model = "llama-bench-m";
  // Benchmark defaults, before the user's overrides so those still win.
  const std::string out = (std::filesystem::temp_directory_path() / "mt-bench").string();
  std::vector<std::string> defaults = {"steps=6", "dataset_type=synthetic", "eval_interval=-1",
                                       "enable_checkpointing=false", "base_output_directory=" + out,
                                       "run_name=train"};
  args.overrides.insert(args.overrides.begin(), defaults.begin(), defaults.end());
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  std::fprintf(stderr, "mt bench train: %s, %ld steps (medians exclude the first 2)...\n",
               cfg.get_string("model_name").c_str(), static_cast<long>(cfg.get_int("steps")));
  const TrainSummary s = train(cfg, pm, /*quiet=*/true);
  std::printf(
      "{\"bench\": \"train\", \"model\": \"%s\", \"backend\": \"%s\", \"num_threads\": %ld, "
      "\"batch\": %ld, \"seq\": %ld, \"steps\": %ld, \"dtype\": \"%s\", \"attention\": \"%s\", "
      "\"remat_policy\": \"%s\", \"tokens_per_sec\": %.2f, \"model_tflops_per_sec\": %.5f, "
      "\"mfu\": %.5f, \"step_time_ms\": %.1f, \"final_loss\": %.4f}\n",
      cfg.get_string("model_name").c_str(), cfg.get_string("backend").c_str(),
      static_cast<long>(cfg.get_int("num_threads")), static_cast<long>(cfg.get_int("per_device_batch_size")),
      static_cast<long>(cfg.get_int("max_target_length")), static_cast<long>(s.steps),
      cfg.get_string("dtype").c_str(), cfg.get_string("attention").c_str(),
      cfg.get_string("remat_policy").c_str(), s.tokens_per_sec, s.tflops_per_device, s.mfu,
      s.step_time_ms, s.final_loss);
  return 0;
}

// One model and dtype: prefill of a 512-token prompt, decode at batch 1 and 8 (random weights:
// throughput does not depend on their values).
std::string bench_decode_one(Args args, const std::string& model, const std::string& dtype,
                             int64_t steps) {
  args.model = model;
  args.overrides.insert(args.overrides.begin(),
                        {"dtype=" + dtype, "weight_dtype=" + dtype, "max_target_length=1024"});
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  ModelRunner r(cfg, pm);
  r.init_parameters(1);
  const ModelDims d = r.model().dims();
  std::mt19937_64 rng(5);
  auto prompt = [&](int64_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(d.vocab_size));
    return p;
  };
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  // Prefill: one 512-token prompt (after one warm-up).
  double prefill_tps = 0;
  {
    Decoder dec(r, 1, 1024);
    dec.prefill(0, prompt(512));
    dec.reset();
    const auto t0 = Clock::now();
    dec.prefill(0, prompt(512));
    prefill_tps = 512 / secs(t0);
  }
  size_t weight_bytes = 0;
  for (auto& p : r.params()) weight_bytes += p.value.nbytes();
  const size_t elt = dtype_size(r.compute_dtype());
  auto decode = [&](int64_t batch, double* bytes_per_s) {
    Decoder dec(r, batch, 1024);
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) dec.prefill(b, prompt(128));
    std::vector<bool> active(static_cast<size_t>(batch), true);
    dec.step(next, active);  // warm-up
    const auto t0 = Clock::now();
    double kv_bytes = 0;
    for (int64_t s = 0; s < steps; ++s) {
      kv_bytes += 2.0 * static_cast<double>(d.num_layers * dec.length(0) * d.num_kv_heads *
                                            d.head_dim * static_cast<int64_t>(elt));
      dec.step(next, active);
    }
    const double t = secs(t0);
    if (bytes_per_s) *bytes_per_s = (static_cast<double>(weight_bytes) * steps + kv_bytes) / t;
    return static_cast<double>(batch * steps) / t;
  };
  double bw = 0;
  if (r.profiler()) const_cast<ProfilingBackend*>(r.profiler())->reset();
  const double b1 = decode(1, &bw);
  if (r.profiler())
    std::fprintf(stderr, "mt bench decode: %s %s, batch 1, time per op:\n%s", model.c_str(),
                 dtype.c_str(), r.profiler()->report().c_str());
  const double b8 = decode(8, nullptr);
  return fmt::format(
      "{{\"model\": \"{}\", \"dtype\": \"{}\", \"weight_bytes\": {}, "
      "\"prefill_512_tokens_per_sec\": {:.1f}, \"decode_batch1_tokens_per_sec\": {:.2f}, "
      "\"decode_batch1_bytes_per_sec\": {:.4g}, \"decode_batch8_tokens_per_sec\": {:.2f}}}",
      model, dtype, weight_bytes, prefill_tps, b1, bw, b8);
}

// STREAM-like triad a = b + s * c over arrays far larger than the caches, on all cores: the
// memory bandwidth that batch-1 decode is measured against (bytes counted: 3 per element x 4).
double triad_bytes_per_sec() {
  const size_t n = size_t{1} << 25;  // 128 MiB per array
  std::vector<float> a(n), b(n, 1.f), c(n, 2.f);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  auto run = [&] {
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        for (size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.f * c[i];
      });
    for (auto& t : ts) t.join();
  };
  run();  // first touch
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 3.0 * 4.0 * static_cast<double>(n) / s);
  }
  return best;
}

int bench_decode(const Args& args) {
  std::vector<std::string> models = {"llama-bench-m", "llama-bench-1b"};
  if (!args.model.empty()) models = {args.model};
  Args rest = args;
  rest.model.clear();
  int64_t steps = 16;
  for (auto it = rest.overrides.begin(); it != rest.overrides.end();) {
    if (it->rfind("steps=", 0) == 0) {
      steps = std::stoll(it->substr(6));
      it = rest.overrides.erase(it);
    } else {
      ++it;
    }
  }
  const double triad = triad_bytes_per_sec();
  double peak = 0;
  {
    Config cfg = resolve_config(rest);
    PluginManager pm;
    peak = pm.make_backend(cfg.get_string("backend"), cfg)->peak_flops(DType::f32);
  }
  std::string out = fmt::format(
      "{{\"bench\": \"decode\", \"memory_bandwidth_triad_bytes_per_sec\": {:.4g}, "
      "\"peak_flops_f32\": {:.4g}, \"results\": [",
      triad, peak);
  bool first = true;
  for (const auto& m : models)
    for (const char* dt : {"float32", "bfloat16"}) {
      std::fprintf(stderr, "mt bench decode: %s %s...\n", m.c_str(), dt);
      out += std::string(first ? "" : ", ") + bench_decode_one(rest, m, dt, steps);
      first = false;
    }
  std::printf("%s]}\n", out.c_str());
  return 0;
}

}  // namespace

int cmd_bench(const Args& args) {
  const std::string what = args.positional.empty() ? "" : args.positional[0];
  if (what == "train") return bench_train(args);
  if (what == "decode") return bench_decode(args);
  throw UsageError("mt bench needs what to measure: `mt bench train` (training throughput of "
                   "configuration M or --model=NAME) or `mt bench decode` (prefill and decode "
                   "throughput)" +
                   std::string(what.empty() ? "" : "; '" + what + "' is not one of them") + ".");
}

}  // namespace mt::cli
