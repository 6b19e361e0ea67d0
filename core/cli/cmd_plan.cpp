// mt plan: memory and FLOPs of the configured model before any work (MaxText's ahead-of-time
// compile, for mt): the model is built and one training step, a prefill and a decode step are run
// on a backend that only counts bytes (core/src/memory_plan.h).
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "cli.h"
#include "memory_plan.h"
#include "model_info.h"
#include "mt/error.h"
#include "plugin_manager.h"

namespace mt::cli {

int cmd_plan(const Args& args) {
  const auto t0 = std::chrono::steady_clock::now();
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  // The configured backend tells its own device's memory and FLOP/s; plan_device names another.
  // A cpu-<N>gb plan still asks the CPU backend for its FLOP/s when it is the one configured.
  const std::string device = cfg.get_string("plan_device");
  const std::string backend = cfg.get_string("backend");
  std::unique_ptr<Backend> real;
  if (device.empty() || (device.rfind("cpu-", 0) == 0 && backend == "cpu")) {
    try {
      real = pm.make_backend(backend, cfg);
    } catch (const Error& e) {
      if (!device.empty()) throw;
      throw UsageError("mt plan plans for the configured backend's device, and backend=" + backend +
                       " cannot start here: " + e.what() +
                       " To plan for a device that is not present, set plan_device= (one of " +
                       named_devices() + ").");
    }
  }
  const DeviceProfile target = plan_target(cfg, real.get());
  real.reset();
  // The decode batch mt decode would run: prompt_file's prompts (before: always one sequence,
  // where mt decode's own check planned them all).
  const Plan plan =
      make_plan(cfg, pm, target, PlanFor::both, /*with_fixes=*/true, prompt_file_prompts(cfg));
  std::printf("mt plan: %s (%s family)\n%s", model_label(cfg).c_str(),
              cfg.get_string("decoder_block").c_str(), format_plan(plan, cfg).c_str());
  std::printf("mt plan: planned in %.2f s without allocating the model\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  return plan.fits() ? 0 : 3;
}

}  // namespace mt::cli
