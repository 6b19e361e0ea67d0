// mt run: train (MaxText's train.py).
#include <cstdio>
#include <string>

#include "cli.h"
#include "communicator.h"
#include "model_info.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "trainer.h"

namespace mt::cli {

namespace {
std::string fmt_eval(double v) {
  char b[64];
  std::snprintf(b, sizeof b, ", eval loss %.4f", v);
  return b;
}
}  // namespace

int cmd_run(const Args& args) {
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  // Under mpirun: one rank of a data-parallel job (communicator=auto|mpi).
  std::unique_ptr<Communicator> comm = make_communicator(cfg, pm);
  const TrainSummary s = train_on_ranks(cfg, pm, /*quiet=*/false, *comm, "mt run");
  if (comm->rank() != 0) return 0;
  if (s.tokens == 0) {  // the run was already at steps: no loss or speed of this invocation
    std::printf(
        "\nmt run: done. No step ran: the run is at step %ld. Its metrics and the resolved "
        "config are in %s\n",
        static_cast<long>(s.steps), s.run_dir.c_str());
    return 0;
  }
  char speed[256];
  if (s.timed_steps > 0)
    std::snprintf(speed, sizeof speed,
                  "median %.0f tokens/s, %.4f TFLOP/s per device, MFU %.1f%%, %.1f ms/step",
                  s.tokens_per_sec, s.tflops_per_device, 100 * s.mfu, s.step_time_ms);
  else
    std::snprintf(speed, sizeof speed,
                  "no throughput (the first %ld steps of a run warm up and are not timed; run "
                  "%ld or more for medians)",
                  static_cast<long>(kUntimedSteps), static_cast<long>(kUntimedSteps + 1));
  std::printf(
      "\nmt run: done. %ld steps, %s tokens; final train loss %.4f%s; %s.\nmt run: metrics and "
      "the resolved config are in %s\n",
      static_cast<long>(s.steps), human_count(static_cast<double>(s.tokens)).c_str(), s.final_loss,
      s.final_eval_loss >= 0 ? fmt_eval(s.final_eval_loss).c_str() : "", speed, s.run_dir.c_str());
  return 0;
}

}  // namespace mt::cli
