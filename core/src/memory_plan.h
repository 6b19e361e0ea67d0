// The memory and FLOPs plan (`mt plan`, and the check before `mt run` and `mt decode`): the
// configured model is built and one training step (or a prefill and a decode step) is run on a
// MetaBackend, which counts what the real backend would hold without allocating or computing
// anything. When the peak does not fit the device, the plan lists the cheapest changes that make
// it fit, each as the key=value words to add and the peak they give.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "meta_backend.h"
#include "model_info.h"
#include "mt/backend.h"
#include "mt/config.h"

namespace mt {

class PluginManager;

// Bytes one training step holds: what lives for the whole run (weights, gradients, AdamW's
// moments), the step's micro-batches of token ids, and the peak of everything else above them
// (activations saved for the backward pass, their gradients, temporaries, the compute-dtype
// copies of the weights): peak = weights + gradients + optimizer + batches + activations, plus
// host_optimizer and checkpoint where the device is the host.
// On a device whose memory is the host's (the CPU backend) the peak also holds what lives in
// host memory: offloaded moments, and the asynchronous checkpoint's snapshot of the weights and
// moments, kept for the run after its first save.
struct TrainingPlan {
  size_t weights = 0, gradients = 0, optimizer = 0, batches = 0, activations = 0, peak = 0;
  size_t host_optimizer = 0;  // AdamW's moments in host memory (optimizer_memory_host_offload)
  size_t checkpoint = 0;      // host memory of async_checkpointing's snapshot
  // Tensor parallelism: the f32 bytes the step's tensor-parallel sums all-reduce and each
  // rank's bytes of its all-gathers, as the trace made them (Graph::count_tensor_collectives).
  double tensor_sum_bytes = 0, tensor_gather_bytes = 0;
  // The parameter elements a tensor (and expert) rank holds before FSDP divides them: its parts
  // of the split tensors and the replicated ones (exact, where `gradients` is as allocated).
  double local_elements = 0;
};

// Bytes of inference: weights (in the compute dtype once loaded), the KV caches of `batch`
// sequences of `max_len` tokens, and the peak above them during a prefill of `prefill` tokens
// and a decode step.
struct DecodePlan {
  int64_t batch = 1, max_len = 0, prefill = 0;
  bool int8_projections = false;  // quantization=int8: the projections stored as int8 rows
  bool int8_table = false;        // and the embedding table tied to the head
  DType weight_dtype = DType::f32;  // the dtype the weights are held in (inference_config's)
  size_t weights = 0, kv_cache = 0, activations = 0, peak = 0;
  // While loading: the weights and one parameter's temporaries (on the CPU, the host copies
  // the loaders make of it too); the peak is the larger of this and running's.
  size_t loading = 0;
};

// Data parallelism's collectives per training step: every rank's gradients summed (all-reduce),
// 2 (N - 1) / N of the bytes through each rank's links. communicator=mpi's all-reduce exchanges
// every rank's slice with every other rank directly, so (N - ici) / N of each phase comes from
// the other nodes; nccl's is taken as hierarchical: first among the `ici` ranks of a node, then
// across the `dcn` nodes (a 1 / ici share each).
struct CollectivePlan {
  int64_t ici = 1, dcn = 1;             // data-parallel ranks within a node, and nodes
  size_t gradient_bytes = 0;            // all-reduced each step (float32 gradients)
  double ici_bytes = 0, dcn_bytes = 0;  // through one rank's links, per direction
  bool sharded_optimizer = false;       // shard_optimizer_over_data: reduce-scatter + all-gather
  // FSDP: per micro-batch, the weights all-gathered `gathers` times (2 when remat re-runs the
  // layers, 1 else) and the gradients reduce-scattered once, as float32.
  bool fsdp = false;
  int64_t fsdp_ranks = 1, copies = 1;  // FSDP's group, and HSDP's copies of it (the data axis)
  int gathers = 0;
  int64_t micro_batches = 1;
  // Tensor parallelism: `tensor` ranks per batch sum `tensor_sums` activations of
  // `tensor_sum_bytes` each (f32) a step, as the trace counts them (TrainingPlan); tensor_bytes
  // through one rank's link per direction.
  int64_t tensor = 1;
  int64_t tensor_sums = 0;
  size_t tensor_sum_bytes = 0;
  double tensor_bytes = 0;
  // vocab:tensor in logical_axis_rules: the embedding's lookup and the LM head's input gradient
  // are among the sums above, and each token's log-sum-exp and loss are all-gathered (in
  // tensor_bytes).
  bool vocab = false;
  // Expert parallelism: `expert` ranks divide the experts of `moe_layers` layers. Their
  // gradients (expert_gradient_bytes, a rank's part) are summed over the data axis only (the
  // rest over every batch rank, as gradient_bytes says); per layer and micro-batch each
  // forward (two when remat re-runs the layer) sums a table of the ranks' expert counts and
  // sends each kept token copy to its expert's rank and the output back (two all-to-alls), the
  // backward the reverse of both: expert_bytes through one rank's link per direction, in f32,
  // for routing that spreads the copies evenly over the ranks (a rank keeps 1 / expert of its
  // copies); skewed routing moves more or less.
  int64_t expert = 1, moe_layers = 0;
  size_t expert_gradient_bytes = 0;
  double expert_bytes = 0;
};

struct PlanFix {
  std::vector<std::string> words;  // key=value
  size_t peak = 0;
  bool fits = false;
};

struct Plan {
  DeviceProfile device;
  ParamCounts counts;
  DType compute = DType::f32, weights = DType::f32;
  double flops_per_token = 0;  // Model::flops_per_token at max_target_length
  int64_t tokens_per_step = 0;
  double assumed_mfu = 0.4;
  std::optional<TrainingPlan> train;
  std::optional<DecodePlan> decode;
  std::optional<CollectivePlan> collectives;  // training with more than one data-parallel rank
  // The full plan's training activations under each remat policy.
  std::vector<std::pair<std::string, size_t>> activations_by_remat;
  std::vector<PlanFix> fixes;  // for what was planned (train, else decode) when it does not fit
  // Set when even every change available leaves it over: what still exceeds the device.
  std::string beyond_fixes;
  size_t peak() const { return train ? train->peak : decode ? decode->peak : 0; }
  bool fits() const { return device.bytes == 0 || peak() <= device.bytes; }
};

// The device a plan is for: plan_device when set (and use_plan_device), else `real` (the
// configured backend: its bytes_limit and peak FLOP/s; nothing known without one).
DeviceProfile plan_target(const Config& cfg, const Backend* real, bool use_plan_device = true);

// What the plan covers.
enum class PlanFor { train, decode, both };

// Builds the model on a MetaBackend for `device` and traces what `what` asks; with
// `with_fixes`, searches the changes that make the first part (training, else decode) fit.
// decode_batch: the sequences decoded at once.
Plan make_plan(const Config& cfg, PluginManager& plugins, const DeviceProfile& device, PlanFor what,
               bool with_fixes, int64_t decode_batch = 1);

// The plan as `mt plan` prints it.
std::string format_plan(const Plan& plan, const Config& cfg);

// Before `mt run` (train) or `mt decode`: when the predicted peak exceeds what `device` can
// hold, throws UsageError (exit 2) with the plan and its fixes; nothing has been allocated.
// `ranks`: the job's (mpirun's) ranks, which a data axis of -1 takes what is left of (the plan
// alone cannot count them): sharded optimizer state is planned per rank. On the CPU backend the
// device is the host's memory, which the job's ranks on this host (OMPI_COMM_WORLD_LOCAL_SIZE,
// MPI_LOCALNRANKS) share: each is checked against its part.
// `decode_batch`: the sequences mt decode decodes at once (its prompts).
void check_fits(const Config& cfg, PluginManager& plugins, Backend& device, PlanFor what,
                const char* command, int ranks = 1, int64_t decode_batch = 1);

// Before a command that holds the model's weights but plans nothing else of its own (mt score:
// one forward a window; mt convert: the weights only): when loading the weights alone exceeds what
// `device` can hold (DecodePlan::loading), throws UsageError (exit 2) with mt decode's plan and its
// fixes; nothing has been allocated. Anything beyond the weights is left to the allocator.
void check_weights_fit(const Config& cfg, PluginManager& plugins, Backend& device,
                       const char* command);

// "512 B", "3.2 MiB", "25.1 GiB"
std::string human_bytes(double bytes);

}  // namespace mt
