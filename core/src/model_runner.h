// ModelRunner: a configured model with its parameters on a backend, and the core's transformer
// skeleton around the family's pieces: embed -> decoder layers (with remat) -> head.
// Used by the trainer, the decoder and the tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/config.h"
#include "mt/graph.h"
#include "mt/model.h"
#include "profiling_backend.h"

namespace mt {

class CollectiveQueue;
class Communicator;
class PluginManager;

struct Param {
  std::string name;  // "embedding", "layers.3.wq"
  ParamSpec spec;
  Tensor value;  // master copy, weight_dtype; FSDP: this rank's part, 1-D
  Tensor grad;   // f32, value's shape; accumulated by backward
  // The elements [shard_begin, shard_end) of the flattened parameter `value` holds: all of
  // them unless the runner's parameters are sharded (FSDP), where shard_range splits them.
  int64_t shard_begin = 0, shard_end = 0;
  // Tensor or expert parallelism: the dimension split among the ranks of one mesh axis, this
  // rank holding the split_part-th of its split_parts equal parts; -1: whole on every rank
  // (replicated). `by_expert`: the expert axis divides it (blocks::moe's expert weights),
  // else the tensor axis.
  int tensor_dim = -1;
  int split_parts = 1, split_part = 0;
  bool by_expert = false;
  // The shape of this rank's tensor-parallel part (spec.shape unless split): what FSDP divides
  // and gathers.
  Shape local_shape = {};
  // Inference (transpose_projections, quantize_projections): how `value` holds the projection
  // weight (WeightLayout); layers read it through Graph::project.
  WeightLayout layout = WeightLayout::dense;
  // An embedding table tied to the LM head (ParamSpec::table, matmul): quantization=int8 holds
  // it as its own rows [V, D + D / 16], which are the head's (W = table^T [D, V]).
  bool tied_table() const { return spec.table && spec.matmul && spec.shape.size() == 2; }
};

// FSDP (ZeRO-3, MaxText's fsdp axis): every parameter's flattened elements are split among
// `ranks` as Communicator::all_gather splits a buffer (shard_range), each rank keeping only its
// part of the master weights and gradients. A layer's whole weights are gathered from the ranks
// just before it runs (inside the remat block, so remat_policy=full frees them after the layer
// and gathers them again for its backward), and the backward reduce-scatters each whole
// gradient into the ranks' parts. `comm` null with ranks > 1: the memory plan's trace, which
// allocates as a rank does and communicates nothing. `replicas` (HSDP: FSDP within each group
// of `comm`'s ranks, data parallelism across the groups): the ranks holding the same part in
// the other groups, over which the trainer sums the parts' gradients; null when one group.
struct ParamSharding {
  Communicator* comm = nullptr;
  int rank = 0, ranks = 1;
  Communicator* replicas = nullptr;
  bool on() const { return ranks > 1; }
};

// Tensor parallelism (Megatron, MaxText's tensor axis): each parameter dimension whose logical
// axis (ParamSpec::axes) the config's logical_axis_rules put on the tensor axis is divided
// among the `ranks` of `group` (this one the `rank`-th); the layers' blocks compute on their
// parts and sum the row-parallel projections over the group (Graph::tensor_group). `group`
// null with ranks > 1: the memory plan's trace.
struct TensorSharding {
  Communicator* group = nullptr;
  int rank = 0, ranks = 1;
  bool on() const { return ranks > 1; }
};

// Expert parallelism (MaxText's expert axis): the experts of blocks::moe's weights (their
// first dimension, logical axis "experts") are divided among the `ranks` of `group` (this one
// the `rank`-th), whose batches differ: each MoE layer sends each token copy to its expert's
// rank and the output back (Graph::expert_group, expert_exchange). `group` null with ranks > 1:
// the memory plan's trace. `replicas`: the ranks holding the same experts in the other groups
// (data parallelism), over which the trainer sums their gradients; null when one group.
struct ExpertSharding {
  Communicator* group = nullptr;
  int rank = 0, ranks = 1;
  Communicator* replicas = nullptr;
  // With tensor parallelism: the group spans the tensor ranks too (ranks = X T, rank = x T + t),
  // the experts divided among all of them, each tensor rank dispatching a share of the batch.
  int tensor_ranks = 1;
  bool on() const { return ranks > 1; }
};

// The decode cache's storage (MaxText's quantize_kvcache, kv_quant_dtype, kv_quant_axis): int8
// rows with f32 scales per head (dkv) or per token (heads_and_dkv), or the compute dtype.
struct KvCacheQuant {
  bool on = false;
  bool per_head = true;
};

// Multi-token prediction's inputs at depth k (Model::mtp_depths): the batch shifted left by k
// on the host. inputs/positions: those of position i + k (0 past the end); targets: the target
// of position i + k, or -1 where i + k is past the end or in another packed document.
struct MtpBatch {
  Tensor inputs, positions, targets;  // [B, T] i32
  int64_t valid_targets = 0;
};

// One batch on the backend: [B, T] i32 tensors.
struct DeviceBatch {
  Tensor inputs, targets, positions, segment_ids;
  int64_t valid_targets = 0;  // targets >= 0
  std::vector<MtpBatch> mtp;  // one per depth when the model has MTP modules and targets
};

class ModelRunner {
 public:
  // Loads the backend, attention and model family plugins the config names.
  ModelRunner(const Config& cfg, PluginManager& plugins);
  // The same on a backend (and attention kernel) made by the caller: a MetaBackend for
  // `mt plan`, or the backend a memory check already made. A null attention is made from the
  // plugins for the backend's name.
  // `sharding`: the parameters' FSDP split, `tensor` their tensor-parallel one, `expert` the
  // experts' (none by default).
  // `int8_from_start` (inference with quantization=int8, one rank): the projection weights
  // quantize_projections would quantize are allocated as int8 rows from the start (values
  // unset), for the loaders to quantize as they read each (load_hf_weights, load_weights), so
  // the weights are never all held in the compute dtype at once (mixtral-8x7b: 49 GiB in int8
  // against 87 GiB in bf16).
  ModelRunner(const Config& cfg, PluginManager& plugins, std::unique_ptr<Backend> backend,
              std::unique_ptr<AttentionKernel> attention = nullptr, ParamSharding sharding = {},
              TensorSharding tensor = {}, ExpertSharding expert = {}, bool int8_from_start = false);
  ~ModelRunner();

  // The backend ops run on (the profiling wrapper when profile=true).
  Backend& backend() { return profiler_ ? static_cast<Backend&>(*profiler_) : *backend_; }
  AttentionKernel& attention() { return prof_attention_ ? *prof_attention_ : *attention_; }
  // Per-op times when profile=true, else null.
  const ProfilingBackend* profiler() const { return profiler_.get(); }
  // Forgets the per-op times so far (profile=true), e.g. those of setup and warm-up.
  void reset_profile() {
    if (profiler_) profiler_->reset();
  }
  const Model& model() const { return *model_; }
  std::vector<Param>& params() { return params_; }
  Param* find(const std::string& name);
  const ParamSharding& sharding() const { return sharding_; }
  // Data parallelism's overlap: during the backward of a graph recorded while it is set,
  // `ready(i)` is called (on the calling thread) as soon as decoder layer i's parameter
  // gradients are final for that pass: a marker recorded at the layer's input runs after every
  // op of the layer in the backward. Empty: no markers.
  void set_layer_gradients_ready(std::function<void(size_t layer)> ready) {
    layer_ready_ = std::move(ready);
  }
  // The parameters of decoder layer i: params()[first, second).
  std::pair<size_t, size_t> layer_params(size_t i) const { return {block_begin(i), block_end(i)}; }
  const TensorSharding& tensor_sharding() const { return tensor_; }
  // A memory plan's trace: the f32 bytes the tensor-parallel sums would all-reduce, and each
  // rank's bytes of the all-gathers, over the passes run so far (Graph::count_tensor_collectives).
  double planned_tensor_sum_bytes() const { return planned_sum_bytes_; }
  double planned_tensor_gather_bytes() const { return planned_gather_bytes_; }
  const ExpertSharding& expert_sharding() const { return expert_; }
  // Tensor parallelism: this rank's part of a whole tensor of parameter `p` (a new tensor on
  // the backend), or the tensor itself when `p` is replicated.
  Tensor tensor_part(const Param& p, const Tensor& whole);
  // This rank's part of parameter p's whole tensor in host memory (`whole`: elements of `elem`
  // bytes in p's whole shape), in p.value's layout: FSDP's flat range, tensor parallelism's rows
  // or columns, or all of it.
  std::vector<char> local_part(const Param& p, const void* whole, size_t elem) const;
  // FSDP's gathers and reduce-scatters and tensor parallelism's sums: the seconds spent in them
  // since the last call (with the host copies around them, after a synchronize so no compute
  // is counted), then reset.
  double take_communication_seconds();
  // Whether collectives over `comm` may run on a second thread, overlapping compute: host
  // tensors (the CPU backend; a device backend's copies would need a stream of their own), not
  // profiled, no tensor parallelism (whose sums run on the training thread inside the passes),
  // a communicator a second thread may call (Communicator::serialized_threads), and not turned
  // off with MT_OVERLAP_COMMUNICATION=0 (for comparisons). Plain data parallelism then sums
  // each layer's gradients during the backward.
  bool overlaps_communication(const Communicator& comm) const;
  // FSDP's overlap (each block's weights gathered while the block before it computes, its
  // gradients reduce-scattered while the backward goes on): as above, and only when asked for
  // with MT_OVERLAP_COMMUNICATION=1. On a CPU whose cores all compute, the queue's thread
  // busy-waits in MPI for the other ranks' and takes a core from compute: 2 ranks of
  // llama-small on 2 cores ran 12% slower with it (about even with --mca mpi_yield_when_idle 1).
  bool fsdp_overlaps() const;
  // Parameter i's whole master tensor: its value, or (FSDP) a new tensor gathered from the
  // ranks' parts (every rank calls it for the same i).
  Tensor whole_value(size_t i);
  DType compute_dtype() const { return compute_dtype_; }
  // How Decoders made on this runner store their caches (from the config).
  const KvCacheQuant& kv_cache_quant() const { return kv_quant_; }
  DType weight_dtype() const { return weight_dtype_; }
  RematPolicy remat_policy() const { return remat_; }
  // Each layer's decode cache, as its family declares it (DecoderLayer::cache_spec).
  const std::vector<CacheSpec>& cache_specs() const { return cache_specs_; }

  // Initialises every parameter as MaxText does, deterministically from init_weights_seed
  // (each parameter's stream is seeded by its name, so the result does not depend on order),
  // on the backend with Backend::fill_random: the same bits on every backend and thread count.
  // `progress` (optional) advances by each parameter's bytes.
  void init_parameters(uint64_t seed, class Progress* progress = nullptr);
  // Inference only (no gradients): when the compute dtype is narrower than weight_dtype (f32
  // masters, bf16 compute), stores every parameter in the compute dtype, converted once with the
  // rounding of the per-forward cast, so a decode step reads 2 bytes per weight instead of
  // converting the 4-byte masters again (8 bytes moved). Returns whether anything changed.
  bool store_weights_in_compute_dtype();
  // Inference only: on a backend whose matrix-vector products stream W [N, K] faster than
  // [K, N] (it answers Backend::extension("mt.matvec_rows_layout"): the CPU's, one sequential
  // read per thread), stores each projection weight (ParamSpec::projection) transposed, which
  // the layers read through Graph::project, so a decode step reads its weights at close to the
  // memory's rate. Experts' weights [E, K, N] become [E, N, K] (read through
  // Graph::grouped_project) where the backend's grouped products also take that layout
  // (extension("mt.grouped_rows_layout")). MT_TRANSPOSE_PROJECTIONS=0 keeps [K, N] (to
  // compare). Not for sharded or tensor-parallel parameters. Returns how many it transposed.
  size_t transpose_projections();
  // Whether decoding `sequences` at once streams the weights faster transposed: one or two
  // (each step a read of every weight) where the backend reads [N, K] faster, and up to 8 where
  // it also computes bf16 rows against bf16 [N, K] weights on dot products or AMX tiles
  // (extension("mt.matvec_rows_bf16dot"), the compute and weight dtypes bf16); with more rows
  // the [K, N] kernels do the arithmetic faster.
  bool rows_layout_pays(size_t sequences);
  // Inference only, quantization=int8: stores each projection weight (ParamSpec::projection)
  // whose rows are a multiple of 32 long as int8 rows with an f32 scale per 32 values (mt/q8.h,
  // as llama.cpp's q8_0), about a quarter of f32's bytes and half of bf16's, which a decode step
  // reads through Backend::matmul_q8; experts' weights [E, K, N] alike, as [E, N, K + K / 16]
  // (Graph::grouped_project, one matmul_q8 per expert with rows). Other parameters keep the
  // compute dtype. Not for sharded or tensor-parallel parameters (refused). Returns how many
  // it quantized.
  size_t quantize_projections();
  // Sets the int8 rows of `p` (layout q8) from its values in the declared layout ([K, N], or
  // experts' [E, K, N]) as f32 on the host (consumed), rounded first to the weight dtype (the
  // values the weight would have held there), so the bits are those quantize_projections gives.
  // The host holds two f32 copies of p at most meanwhile (the values and their rows).
  void set_q8_from_declared(Param& p, std::vector<float>&& declared);
  // Inference only, after transpose_projections and quantize_projections (each undoes it):
  // stores each group of projection weights a block reads from the same input (wq, wk, wv;
  // w_gate, w_up: fused_projection_groups) back to back in one tensor, where all of the group
  // are rows of one width (transposed, or int8 rows); each weight becomes a view of its rows
  // (the same bytes, no copy kept), and the block's Params also hold the whole under the
  // group's joined name ("wq+wk+wv"), from which blocks::attention and blocks::mlp make one
  // product instead of three or two (a decode step's fixed cost per product, one read of the
  // input). Only weights read as stored are fused (int8 rows, or rows in the compute dtype:
  // store_weights_in_compute_dtype first where the masters are wider). Like the layout steps,
  // not while a Decoder lives (a recorded step reads the weights where they were).
  // MT_FUSE_PROJECTIONS=0 leaves them apart (to compare). Returns how many groups it fused
  // (those fused already are not counted).
  size_t fuse_projections();
  // The config's quantization: "" nothing, "int8" quantize_projections; anything else refused.
  size_t apply_quantization(const Config& cfg);
  // Allocates zeroed gradient buffers and makes the parameters tracked leaves.
  void enable_gradients();
  // Starts a step's gradients: the first backward overwrites instead of accumulating.
  void zero_gradients();
  // Ends them: zeroes any gradient no backward reached. Call before reading gradients.
  void finish_gradients();

  // tokens [B, T] -> logits [B, T, V] in the compute dtype, recorded on g when it records.
  Tensor forward(Graph& g, const DeviceBatch& batch);
  // Decode: tokens [B, T] at `positions` [B, T], appending to one KVCache per layer. Logits
  // [B, T, V], or with `last_only` (B = 1) [1, 1, V] of the last position: the LM head runs on
  // that position only.
  Tensor forward_cached(Graph& g, const Tensor& tokens, const Tensor& positions,
                        std::vector<KVCache>& caches, bool last_only = false);
  // Mean cross-entropy over the batch's valid targets times `weight_scale`; scalar [1] f32.
  // With `aux` (training), the layers' auxiliary losses join the objective (each weight x value
  // x aux_scale) and their values, averaged over the layers reporting each name and times
  // aux_scale, are added to (*aux)[name]. Without it (evaluation, scoring) they do not.
  // aux_scale < 0: weight_scale. The layers' losses are means over the batch's sequences or
  // tokens (MoE load balancing, router z-loss), so a step of several micro-batches or ranks
  // gives each its share of the sequences, where the cross-entropy's share is of the valid
  // targets: then the step's objective is one batch's whatever the split.
  // With `stats` (training), each layer's LayerOutput::stats are summed elementwise into
  // (*stats)[layer][name] (resized to the layers, then the MTP layers), from the forward only
  // (not remat's re-run).
  // Multi-token prediction runs in training only (with `aux`): its objective term joins the
  // total, and (*aux) gets "mtp_loss" (the term added: scale / D x the depths' mean
  // cross-entropies) and "mtp_loss/<k>" (depth k's mean cross-entropy), times the depth's
  // scale: mtp_scales[k - 1], this batch's share of depth k's valid targets over the step (so a
  // step of several micro-batches or ranks means over all of them, as one batch would), or
  // weight_scale without mtp_scales.
  Tensor loss(Graph& g, const DeviceBatch& batch, float z_loss, double weight_scale = 1.0,
              std::map<std::string, double>* aux = nullptr,
              std::vector<LayerStats>* stats = nullptr, double aux_scale = -1.0,
              const std::vector<double>* mtp_scales = nullptr);
  // After the optimizer step: each layer's (and MTP layer's) DecoderLayer::after_step with its
  // master parameters and its step statistics (`stats` as loss() summed them; empty for a layer
  // with none).
  void after_step(const std::vector<LayerStats>& stats);

  DeviceBatch upload(const struct HostBatch& hb);
  // A batch of `batch` x `seq` positions, every target counted valid, whose tensors hold no ids
  // (none are written): what upload makes of such a batch, for `mt plan`'s trace on a
  // MetaBackend, which then needs no host copy of the batch (a plan of 10^9 positions would
  // otherwise fill the host's memory with zeros).
  DeviceBatch shaped_batch(int64_t batch, int64_t seq);

 private:
  // The parameters in the compute dtype: a recorded cast of each master copy (gradients reach
  // it). FSDP: the top parameters gathered; the layers' are undefined, block_params gathers
  // each layer's when it runs.
  std::vector<Tensor> compute_params(Graph& g);
  // Vocabulary parallelism: gives the graph this rank's rows of the embedding (ps: the
  // computed parameters); forward and forward_cached refuse such a model (their logits would
  // be this rank's columns only).
  void mark_vocab_part(Graph& g, const std::vector<Tensor>& ps) const;
  // The head's cross-entropy of `hidden` [B, T, D] against `targets` [B, T] (Graph::cross_entropy's
  // z_loss and weight), in num_vocab_tiling runs of positions.
  Tensor head_loss(Graph& g, const std::vector<Tensor>& ps, const Tensor& hidden,
                   const Tensor& targets, float z_loss, float weight);
  void refuse_vocab_parts(const char* what) const;
  // Parameter i in the compute dtype on g: its master (FSDP: gathered, a recorded op whose
  // backward reduce-scatters the whole gradient into the rank's part) cast when narrower.
  Tensor compute_param(Graph& g, size_t i);
  Tensor gather(Graph& g, size_t i);
  // Block i's (decoder layer i, or MTP depth i - num_layers + 1) parameters on g: those of
  // compute_params(g) in `ps`, or (FSDP) gathered on g (`ps` unused).
  Params block_params(Graph& g, const std::vector<Tensor>& ps, size_t block);
  // Marks each parameter's dimension that logical_axis_rules put on the tensor axis
  // (Param::tensor_dim), refusing what the tensor ranks do not divide.
  void split_for_tensor_parallelism(const Config& cfg);
  // Marks the experts dimension of each expert weight as divided among the expert ranks.
  void split_for_expert_parallelism(const Config& cfg);
  Params top_params(const std::vector<Tensor>& ps) const;
  // Params' layouts for params_[begin, end) (empty when every one is as declared).
  std::vector<WeightLayout> layouts(size_t begin, size_t end) const;
  // The decoder: tokens -> the last layer's output [B, T, D], before the head.
  Tensor run_layers(Graph& g, const std::vector<Tensor>& ps, const Tensor& tokens, LayerInputs in,
                    std::vector<KVCache>* caches, std::vector<AuxLoss>* aux,
                    std::vector<LayerStats>* stats = nullptr);
  // Block `slot`'s output, under the remat policy (or with its cache), its aux and stats
  // collected (stats at index `slot`). Its parameters are block_params(.., ps, slot) on the
  // graph the layer runs on (remat's own when it rematerialises).
  Tensor run_layer(Graph& g, const DecoderLayer& layer, const std::vector<Tensor>& ps,
                   const Tensor& x, const LayerInputs& in, KVCache* cache,
                   std::vector<AuxLoss>* aux, std::vector<LayerStats>* stats, size_t slot);
  // params_ index range [begin, end) of decoder layer i (i < num_layers) or of MTP depth
  // i - num_layers + 1.
  size_t block_begin(size_t i) const { return layer_begin_[i]; }
  size_t block_end(size_t i) const {
    return i + 1 < layer_begin_.size() ? layer_begin_[i + 1] : params_.size();
  }
  const DecoderLayer& block_layer(size_t i) const;

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<AttentionKernel> attention_;
  std::unique_ptr<ProfilingBackend> profiler_;
  std::unique_ptr<AttentionKernel> prof_attention_;
  std::unique_ptr<ModelFamily> family_;
  std::unique_ptr<Model> model_;
  std::vector<Param> params_;
  std::function<void(size_t)> layer_ready_;
  size_t num_top_ = 0;                  // params_[0, num_top_) are the model's top parameters
  // logical_axis_rules' vocab:tensor: the index of the embedding holding this rank's rows of the
  // vocabulary (Graph::set_vocab_part), else -1.
  int64_t vocab_param_ = -1;
  int64_t vocab_tiles_ = 1;             // num_vocab_tiling
  std::vector<size_t> layer_begin_;     // params_ index of each layer's first parameter
  std::vector<std::string> top_names_;  // the names Params hands the model (relative to a layer)
  std::vector<std::vector<std::string>> layer_names_;  // then one entry per MTP depth
  int mtp_depths_ = 0;
  std::vector<CacheSpec> cache_specs_;
  DType compute_dtype_ = DType::f32, weight_dtype_ = DType::f32;
  RematPolicy remat_ = RematPolicy::none;
  ParamSharding sharding_;
  bool any_layout_ = false;  // some parameter is not stored as declared (Param::layout)
  // p's int8 rows (q8_shape's bytes) from `host`, f32 values of p [K, N] / [E, K, N], or
  // already its rows [N, K] / [E, N, K] (`rows_already`); `host` is consumed. Throws, naming
  // the row, where a value cannot be held; p is not touched.
  std::vector<int8_t> q8_rows(const Param& p, std::vector<float>& host, bool rows_already) const;
  // fuse_projections' groups, per block (none: empty): the names the block's Params hold (its
  // own, then each group's joined name) and each group's tensor and layout.
  struct Fused {
    std::vector<std::string> names;
    std::vector<Tensor> values;
    std::vector<WeightLayout> layouts;
  };
  std::vector<Fused> fused_;
  TensorSharding tensor_;
  ExpertSharding expert_;
  KvCacheQuant kv_quant_;
  double comm_seconds_ = 0;
  // The memory plan's trace (tensor ranks with no group): the tensor-parallel collectives'
  // bytes the graphs counted (Graph::count_tensor_collectives).
  double planned_sum_bytes_ = 0, planned_gather_bytes_ = 0;
  // FSDP with overlap (overlaps_communication): the gathers and reduce-scatters run in order on
  // queue_'s thread. A block's gathers start when the block before it (in the pass's direction:
  // forward, or a remat re-run in the backward) has its weights; `prefetched_` holds each
  // started gather's host buffer and ticket until gather() takes it. A pass starts and
  // finish_gradients ends with the queue drained and nothing prefetched, so a gather never
  // outlives the weights it read.
  struct Prefetch {
    std::shared_ptr<std::vector<float>> host;
    uint64_t ticket = 0;
  };
  CollectiveQueue* fsdp_queue();
  void start_gather(size_t i);
  void prefetch_after(size_t block);
  void settle_fsdp_queue();
  std::unique_ptr<CollectiveQueue> queue_;
  std::map<size_t, Prefetch> prefetched_;
  size_t last_block_ = SIZE_MAX;
};

// The config an inference run (mt decode, mt score, and the memory plan of a decode) builds its
// runner from: weight_dtype=dtype where store_weights_in_compute_dtype would narrow the weights
// (f32 masters, bf16 compute), so they are allocated and loaded in bf16 from the start (the
// loaders round as that cast does: the same bits) instead of first in f32 (llama2-7b: 12.6
// GiB rather than 25.1 while loading). Otherwise `cfg` as it is.
Config inference_config(const Config& cfg);

// Loads every parameter of `runner` from a checkpoint (load_parameters_path: as
// load_parameters reads it), each int8 one (int8_from_start) read alone into an f32 temporary
// and quantized before the next.
void load_checkpoint_weights(const std::filesystem::path& path, ModelRunner& runner);

}  // namespace mt
