// The training loop (MaxText's train.py): data -> forward/backward over micro-batches ->
// global-norm clipping -> AdamW with warmup + cosine schedule -> metrics (loss, throughput,
// TFLOP/s, MFU) on the terminal and in <base_output_directory>/<run_name>/metrics.jsonl.
#pragma once

#include <cstdint>
#include <string>

#include "mt/config.h"
#include "mt/dtype.h"

namespace mt {

class PluginManager;

// The first steps of a run warm up the allocator, GEMM plans and caches: throughput medians leave
// them out.
inline constexpr int64_t kUntimedSteps = 2;

struct TrainSummary {
  int64_t steps = 0;
  int64_t tokens = 0;
  double final_loss = 0, final_eval_loss = -1;
  // Medians over the steps after the first kUntimedSteps of the run; timed_steps counts them, and
  // with none (a run of kUntimedSteps steps or fewer) these are 0.
  double tokens_per_sec = 0, tflops_per_device = 0, mfu = 0;
  double step_time_ms = 0;
  int64_t timed_steps = 0;
  double checkpoint_seconds = 0;  // training time blocked by checkpoint saves
  int64_t failed_checkpoints = 0;  // saves that failed with checkpoint_error_policy=continue
  std::string run_dir;
};

// Learning rate at `step` (1-based): linear warmup to `peak` over warmup steps, then cosine
// decay to peak * final_fraction at schedule_steps, constant after.
double learning_rate_at(int64_t step, double peak, int64_t warmup, int64_t schedule_steps,
                        double final_fraction);

// The line mt run prints when dtype=float32 leaves most of the device unused (bf16 peak at least
// four times the f32 one), suggesting mixed precision; empty otherwise.
std::string precision_hint(DType compute, double peak_f32, double peak_bf16);

// Trains as the config says. quiet: no terminal output (bench); throws mt::Error on NaN/Inf.
TrainSummary train(const Config& cfg, PluginManager& plugins, bool quiet = false);

}  // namespace mt
