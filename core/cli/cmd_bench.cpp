// mt bench: end-to-end throughput as one JSON object on stdout.
//   mt bench train [--model=NAME] [key=value ...]   (default: configuration M, llama-bench-m)
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>

#include "cli.h"
#include "model_info.h"
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

}  // namespace

int cmd_bench(const Args& args) {
  const std::string what = args.positional.empty() ? "" : args.positional[0];
  if (what == "train") return bench_train(args);
  if (what == "decode")
    throw Error("`mt bench decode` is not implemented yet (it arrives with the inference issue).");
  throw UsageError("mt bench needs what to measure: `mt bench train` (training throughput of "
                   "configuration M or --model=NAME)" +
                   std::string(what.empty() ? "" : "; '" + what + "' is not one of them") + ".");
}

}  // namespace mt::cli
