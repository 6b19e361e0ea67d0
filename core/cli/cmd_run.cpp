// mt run: train (MaxText's train.py).
#include <cstdio>
#include <string>

#include <fmt/format.h>

#include "cli.h"
#include "communicator.h"
#include "host_threads.h"
#include "model_info.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "stop_signals.h"
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
  const HostThreads threads(cfg);  // num_threads for the host work (restoring, loading) too
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  // Under mpirun: one rank of a data-parallel job (communicator=auto|mpi).
  std::unique_ptr<Communicator> comm = make_communicator(cfg, pm);
  // SIGINT / SIGTERM / SIGHUP: the step under way ends, a checkpoint of it is saved, and the exit
  // code is 128 + the signal's number on every rank (so a scheduler or a script sees an unfinished
  // run).
  const StopOnSignals stop_guard(/*announce=*/comm->rank() == 0);
  const TrainSummary s = train_on_ranks(cfg, pm, /*quiet=*/false, *comm, "mt run");
  const int code = s.stopped_by ? 128 + s.stopped_by : 0;
  if (comm->rank() != 0) return code;
  if (s.stopped_by) {
    std::fflush(stdout);
    const char* sig = s.stopped_by == SIGINT   ? "SIGINT"
                      : s.stopped_by == SIGHUP ? "SIGHUP"
                                               : "SIGTERM";
    const std::string ckpt_dir = s.run_dir + "/checkpoints";
    std::string state;
    if (!cfg.get_bool("enable_checkpointing"))
      state = "no checkpoint was saved (enable_checkpointing=false)";
    else if (s.last_checkpoint == s.steps)
      state = "its state is in the checkpoint of step " + std::to_string(s.steps) + " in " +
              ckpt_dir + ": the same command resumes from it";
    else if (s.tokens == 0)
      state = "nothing changed";
    else
      state = "the checkpoint of step " + std::to_string(s.steps) + " failed (above); " +
              (s.last_checkpoint >= 0 ? "the newest complete one is step " +
                                            std::to_string(s.last_checkpoint) + " in " + ckpt_dir
                                      : std::string("no complete checkpoint is in ") + ckpt_dir);
    if (s.tokens == 0)
      std::printf("\nmt run: stopped by %s before its first step (step %ld); %s.\n", sig,
                  static_cast<long>(s.steps + 1), state.c_str());
    else
      std::printf(
          "\nmt run: stopped by %s after step %ld of steps=%ld: %s tokens this run, last train "
          "loss %.4f; %s.\nmt run: metrics and the resolved config are in %s\n",
          sig, static_cast<long>(s.steps), static_cast<long>(cfg.get_int("steps")),
          human_count(static_cast<double>(s.tokens)).c_str(), s.final_loss, state.c_str(),
          s.run_dir.c_str());
    return code;
  }
  if (s.tokens == 0) {  // the run was already at steps: no loss or speed of this invocation
    const long at = static_cast<long>(s.steps), want = static_cast<long>(cfg.get_int("steps"));
    std::printf(
        "\nmt run: done. No step ran: the run is at step %ld%s. Its metrics and the resolved "
        "config are in %s\n",
        at, at > want ? fmt::format(", past steps={}", want).c_str() : "", s.run_dir.c_str());
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
