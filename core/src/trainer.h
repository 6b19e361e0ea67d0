// The training loop (MaxText's train.py): data -> forward/backward over micro-batches ->
// global-norm clipping -> AdamW with warmup + cosine schedule -> metrics (loss, throughput,
// TFLOP/s, MFU) on the terminal and in <base_output_directory>/<run_name>/metrics.jsonl.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model_runner.h"
#include "mt/backend.h"
#include "mt/config.h"
#include "mt/dtype.h"

namespace mt {

class Communicator;
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
  // Median time per step in collectives (several ranks), exposed: not overlapped with compute.
  double communication_ms = 0;
  // Median bytes a rank received per step in those collectives (what the plan's "a ring
  // moves, per rank and direction" predicts); 0 for one rank or an uncounting communicator.
  double communication_bytes = 0;
  int64_t timed_steps = 0;
  double checkpoint_seconds = 0;  // training time blocked by checkpoint saves
  int64_t failed_checkpoints = 0;  // saves that failed with checkpoint_error_policy=continue
  std::string run_dir;
  // SIGINT or SIGTERM when one stopped the run (mt run watches them: stop_signals.h) after step
  // `steps`, 0 when it ran to its end; `last_checkpoint` is then the newest complete checkpoint's
  // step (-1: none), on rank 0.
  int stopped_by = 0;
  int64_t last_checkpoint = -1;
};

// MaxText's learning-rate schedule (create_learning_rate_schedule, an optax schedule of the
// updates done before a step: step s, 1-based, takes its value at s - 1), over schedule_steps
// (learning_rate_schedule_steps; -1 = steps):
// 1. warm-up: warmup = int(schedule_steps x warmup_steps_fraction) steps rising linearly from 0
//    at the first to `peak` at the last (one step of warm-up is 0);
// 2. decay to peak x final_fraction by the schedule's last step: cosine over the rest, or with
//    lr_schedule_type=wsd a stable phase at peak, then int(schedule_steps x
//    wsd_decay_steps_fraction) steps of linear or cosine decay (wsd_decay_style);
// 3. 0 for the steps past schedule_steps.
struct LrSchedule {
  double peak = 0, final_fraction = 0.1;
  int64_t schedule_steps = 1, warmup = 0;
  bool wsd = false, wsd_cosine = false;
  int64_t decay = 0;  // wsd's decay steps
  // From the config's keys; refuses a WSD schedule whose warm-up and decay overlap.
  static LrSchedule from_config(const Config& cfg, int64_t steps);
  double at(int64_t step) const;
};

// The line mt run prints when dtype=float32 leaves most of the device unused (bf16 peak at least
// four times the f32 one), suggesting mixed precision; empty otherwise.
std::string precision_hint(DType compute, double peak_f32, double peak_bf16);

// A warning on stderr ("<command>: warning: ...") when the model keys of `cfg` differ from those
// the checkpoint at `path` (load_parameters_path or load_full_state_path, `key`) was written
// with: its weights would be read into another model (a sliding window, a soft cap, rope theta)
// with nothing else to see. A checkpoint without a readable config is not compared.
void warn_changed_model_keys(const Config& cfg, const std::string& key, const std::string& path,
                             const std::string& command);

// AdamW's state beside the parameters: the first moment (mu) in mu_dtype (MaxText's key; ""
// = weight_dtype), the second (nu) always in float32. With optimizer_memory_host_offload the
// moments live on `host` (a CPU backend: host memory) and each parameter's are streamed through
// the device for its update.
//
// With shard_optimizer_over_data (MaxText's ZeRO-1) and several data-parallel ranks, the
// parameters flattened and laid end to end in order are split among the ranks as
// Communicator::reduce_scatter_sum splits a buffer (shard_range): each rank keeps the moments of
// its part only, receives only its part of the summed gradients, updates only its part of the
// parameters and gathers the others' parts. `shard` holds, per parameter, the [first, second)
// of its flattened elements that this rank owns (possibly empty); m[i] and v[i] have that many
// elements. Unsharded, `shard` is empty and the moments have the parameters' shapes.
struct OptimizerState {
  std::unique_ptr<Backend> host;  // declared first: the moments go before their allocator
  std::vector<Tensor> m, v;
  std::vector<std::pair<int64_t, int64_t>> shard;
  bool sharded() const { return !shard.empty(); }
};
// `host`: where offloaded moments live (the trainer passes a CPU backend, the plan a
// MetaBackend); required when optimizer_memory_host_offload is set, else unused. `rank` of
// `ranks` data-parallel ranks: the part this rank keeps when shard_optimizer_over_data is set
// (one rank keeps everything, unsharded).
OptimizerState make_optimizer_state(ModelRunner& runner, const Config& cfg,
                                    std::unique_ptr<Backend> host = nullptr, int rank = 0,
                                    int ranks = 1);

// One optimizer step's forward and backward passes over its micro-batches (gradients
// accumulate; the loss is weighted by each micro-batch's share of the valid targets), then the
// gradients finished and their global norm.
struct StepGradients {
  double loss = 0, grad_norm = 0;  // the norm before clipping
  int64_t valid_targets = 0;       // the global batch's targets (MaxText's total_weights)
  // Wall time in the step's collectives over the ranks, with the host copies around them (none
  // overlaps compute: it is all exposed); 0 for one rank.
  double communication_s = 0;
  std::map<std::string, double> aux;    // the layers' auxiliary losses, batch-weighted
  std::vector<LayerStats> layer_stats;  // their statistics, summed over the micro-batches
};
//
// With a communicator of several ranks (data parallelism), each rank passes its own share of the
// global batch: the valid-target count that weights the loss is the sum over the ranks, and the
// gradients, the loss, the auxiliary losses and the layers' statistics are summed over them
// (before the norm), so every rank ends with the same step as one rank given the whole batch.
// With a sharded `opt`, the gradients are reduce-scattered instead: each rank's part of them
// (opt.shard) is the sum over the ranks, the rest is left as this rank's own, and the global
// norm adds the parts' squares over the ranks.
StepGradients forward_backward(ModelRunner& runner, std::vector<DeviceBatch>& micro, float z_loss,
                               Communicator* comm = nullptr, const OptimizerState* opt = nullptr);
// AdamW on every parameter (weight decay where ParamSpec::weight_decay says), then the layers'
// updates outside the gradient (after_step), then the gradients are made fresh for the next
// step. A sharded `opt` updates this rank's part of each parameter, then gathers the other
// ranks' parts over `comm` (null: no gather, as the memory plan's trace runs it). Returns the
// seconds that gather took (0 without one).
double apply_update(ModelRunner& runner, OptimizerState& opt, AdamWParams adam, float weight_decay,
                    const std::vector<LayerStats>& layer_stats, Communicator* comm = nullptr);

// Trains as the config says. quiet: no terminal output (bench); throws mt::Error on NaN/Inf.
// While a StopOnSignals is alive (mt run's), a SIGINT or SIGTERM stops the run after the step
// under way, with a checkpoint of it when checkpointing is on; every rank stops after the same
// step.
// comm: the job's ranks (data parallelism; null = one rank). Rank 0 alone prints, writes
// metrics, TensorBoard events and checkpoints and holds the run lock; every rank restores the
// same checkpoint. Throughput and MFU count every rank's tokens.
TrainSummary train(const Config& cfg, PluginManager& plugins, bool quiet = false,
                   Communicator* comm = nullptr);

}  // namespace mt
