// ModelRunner: a configured model with its parameters on a backend, and the core's transformer
// skeleton around the family's pieces: embed -> decoder layers (with remat) -> head.
// Used by the trainer, the decoder and the tests.
#pragma once

#include <cstdint>
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

class PluginManager;

struct Param {
  std::string name;  // "embedding", "layers.3.wq"
  ParamSpec spec;
  Tensor value;  // master copy, weight_dtype
  Tensor grad;   // same dtype as value; accumulated by backward
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
  ModelRunner(const Config& cfg, PluginManager& plugins, std::unique_ptr<Backend> backend,
              std::unique_ptr<AttentionKernel> attention = nullptr);
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
  DType compute_dtype() const { return compute_dtype_; }
  DType weight_dtype() const { return weight_dtype_; }
  bool tied_embedding() const { return tied_; }
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
  // Allocates zeroed gradient buffers and makes the parameters tracked leaves.
  void enable_gradients();
  // Starts a step's gradients: the first backward overwrites instead of accumulating.
  void zero_gradients();
  // Ends them: zeroes any gradient no backward reached. Call before reading gradients.
  void finish_gradients();

  // tokens [B, T] -> logits [B, T, V] in the compute dtype, recorded on g when it records.
  Tensor forward(Graph& g, const DeviceBatch& batch);
  // Decode: tokens [B, T] at `positions` [B, T], appending to one KVCache per layer.
  Tensor forward_cached(Graph& g, const Tensor& tokens, const Tensor& positions,
                        std::vector<KVCache>& caches);
  // Mean cross-entropy over the batch's valid targets times `weight_scale`; scalar [1] f32.
  // With `aux` (training), the layers' auxiliary losses join the objective (each weight x value
  // x weight_scale) and their values, averaged over the layers reporting each name and times
  // weight_scale, are added to (*aux)[name]. Without it (evaluation, scoring) they do not.
  // With `stats` (training), each layer's LayerOutput::stats are summed elementwise into
  // (*stats)[layer][name] (resized to the layers, then the MTP layers), from the forward only
  // (not remat's re-run).
  // Multi-token prediction runs in training only (with `aux`): its objective term joins the
  // total, and (*aux) gets "mtp_loss" (the term added: scale / D x the depths' mean
  // cross-entropies) and "mtp_loss/<k>" (depth k's mean cross-entropy), times weight_scale.
  Tensor loss(Graph& g, const DeviceBatch& batch, float z_loss, double weight_scale = 1.0,
              std::map<std::string, double>* aux = nullptr,
              std::vector<LayerStats>* stats = nullptr);
  // After the optimizer step: each layer's (and MTP layer's) DecoderLayer::after_step with its
  // master parameters and its step statistics (`stats` as loss() summed them; empty for a layer
  // with none).
  void after_step(const std::vector<LayerStats>& stats);

  DeviceBatch upload(const struct HostBatch& hb);

 private:
  // The parameters in the compute dtype: a recorded cast of each master copy (gradients reach it).
  std::vector<Tensor> compute_params(Graph& g);
  Params top_params(const std::vector<Tensor>& ps) const;
  // The decoder: tokens -> the last layer's output [B, T, D], before the head.
  Tensor run_layers(Graph& g, const std::vector<Tensor>& ps, const Tensor& tokens, LayerInputs in,
                    std::vector<KVCache>* caches, std::vector<AuxLoss>* aux,
                    std::vector<LayerStats>* stats = nullptr);
  // One layer's output, under the remat policy (or with its cache), its aux and stats collected
  // (stats at index `slot`).
  Tensor run_layer(Graph& g, const DecoderLayer& layer, const Params& lp, const Tensor& x,
                   const LayerInputs& in, KVCache* cache, std::vector<AuxLoss>* aux,
                   std::vector<LayerStats>* stats, size_t slot);
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
  size_t num_top_ = 0;                  // params_[0, num_top_) are the model's top parameters
  std::vector<size_t> layer_begin_;     // params_ index of each layer's first parameter
  std::vector<std::string> top_names_;  // the names Params hands the model (relative to a layer)
  std::vector<std::vector<std::string>> layer_names_;  // then one entry per MTP depth
  int mtp_depths_ = 0;
  std::vector<CacheSpec> cache_specs_;
  DType compute_dtype_ = DType::f32, weight_dtype_ = DType::f32;
  bool tied_ = false;
  RematPolicy remat_ = RematPolicy::none;
};

}  // namespace mt
