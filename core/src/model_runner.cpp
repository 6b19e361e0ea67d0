#include "model_runner.h"

#include "config_impl.h"

#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <utility>

#include "checkpoint_manager.h"
#include "collective_queue.h"
#include "communicator.h"
#include "fnv1a.h"
#include "fused_projections.h"
#include "graph_internal.h"
#include "model_info.h"
#include "mt/data.h"
#include "mt/env.h"
#include "mt/error.h"
#include "mt/q8.h"
#include "plugin_manager.h"
#include "progress.h"
#include "rope_scaling.h"
#include "tensor_split.h"

namespace mt {

namespace {

// The int8 rows a projection weight becomes under quantization=int8 ([N, K + K / 16], or
// experts' [E, N, K + K / 16]; a tied table's [V, D + D / 16]), or nothing where it stays in the
// compute dtype (not a projection or tied table, split among ranks, or rows not a multiple of
// 32 long).
std::optional<Shape> q8_shape(const Param& p) {
  const Shape& s = p.spec.shape;
  if (p.tied_table() && p.tensor_dim < 0) {
    if (s[1] % kQ8Block != 0) return {};
    return Shape{s[0], q8_row_bytes(s[1])};
  }
  if (!p.spec.projection || p.tensor_dim >= 0 || (s.size() != 2 && s.size() != 3)) return {};
  const int64_t k = s[s.size() - 2], n = s.back();
  if (k % kQ8Block != 0) return {};
  Shape q = {n, q8_row_bytes(k)};
  if (s.size() == 3) q.insert(q.begin(), s[0]);
  return q;
}

DType dtype_key(const Config& cfg, const std::string& key) {
  DType t;
  if (!parse_dtype(cfg.get_string(key), t) || !(t == DType::f32 || t == DType::bf16))
    cfg.reject(key, "must be float32 or bfloat16.");
  return t;
}

std::vector<std::string> tensor_axis_rules(const Config& cfg) {
  // logical_axis_rules: "logical:mesh" pairs; only the tensor axis places parameter dimensions
  // (FSDP divides flattened elements, and the data axis holds whole copies). Checked on every
  // run, with tensor parallelism or not (before: only with it, so a typo passed until then).
  std::vector<std::string> on_tensor;
  for (const std::string& rule : cfg.get_string_list("logical_axis_rules")) {
    const size_t colon = rule.find(':');
    const std::string mesh = colon == std::string::npos ? "" : rule.substr(colon + 1);
    if (colon == std::string::npos || colon == 0 || mesh != "tensor")
      cfg.reject("logical_axis_rules",
                 "must be a list of \"logical:tensor\" pairs (e.g. \"heads:tensor\"), each "
                 "putting a logical axis of the parameters on the tensor mesh axis; \"" +
                     rule + "\" is not one.");
    // The blocks compute on parts of these axes only (vocab: the embedding's lookup, the LM
    // head and the cross-entropy, Graph::set_vocab_part); a split model dimension would need
    // kernels of its own (and would be wrong without).
    const std::string logical = rule.substr(0, colon);
    if (logical != "heads" && logical != "kv_heads" && logical != "mlp" && logical != "experts" &&
        logical != "vocab")
      cfg.reject("logical_axis_rules",
                 "puts '" + logical +
                     "' on the tensor axis; only heads, kv_heads, mlp, experts and vocab can be "
                     "divided among the tensor ranks (the attention, MLP and MoE blocks, the "
                     "embedding and the LM head compute on their parts).");
    on_tensor.push_back(logical);
  }
  return on_tensor;
}

}  // namespace

ModelRunner::ModelRunner(const Config& cfg, PluginManager& plugins)
    : ModelRunner(cfg, plugins, nullptr, nullptr) {}

ModelRunner::ModelRunner(const Config& cfg, PluginManager& plugins,
                         std::unique_ptr<Backend> given_backend,
                         std::unique_ptr<AttentionKernel> given_attention, ParamSharding sharding,
                         TensorSharding tensor, ExpertSharding expert, bool int8_from_start)
    : sharding_(sharding), tensor_(tensor), expert_(expert) {
  reset_config_reads(cfg);
  compute_dtype_ = dtype_key(cfg, "dtype");
  weight_dtype_ = dtype_key(cfg, "weight_dtype");
  if (!parse_remat_policy(cfg.get_string("remat_policy"), remat_))
    cfg.reject("remat_policy", "must be none, minimal or full.");
  if (cfg.has("num_vocab_tiling")) {
    vocab_tiles_ = cfg.get_int("num_vocab_tiling");
    if (vocab_tiles_ < 1)
      cfg.reject("num_vocab_tiling",
                 "must be >= 1: the number of runs of positions the LM head and loss take in turn "
                 "(1 = all at once).");
  }
  const std::string family_name = cfg.get_string("decoder_block");
  family_ = plugins.make_model_family(family_name);
  // The family's own sentences (mt::Error, UsageError) pass as they are; anything else it throws
  // is a bug in the plugin, said so with its name (before: "internal error: boom").
  try {
    family_->validate(cfg);
    model_ = family_->build(cfg);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error("The model plugin '" + family_name +
                "' failed while building the model: " + e.what() +
                " (it threw an exception that is not an mt::Error: a bug in the plugin).");
  }
  if (!model_)
    throw Error("The model plugin '" + family_name +
                "' built no model: its ModelFamily::build returned null.");
  // A model key set to something other than its default that neither the family nor the core
  // read would change nothing: the run would silently be another model than the one asked for.
  if (const std::vector<std::string> unread = unread_model_keys(cfg); !unread.empty()) {
    std::string list;
    for (const auto& k : unread)
      list += (list.empty() ? "" : ", ") + k + "=" + config_value_yaml(cfg.impl().values.at(k)) +
              " (" + config_set_where(cfg.impl().values.at(k).origin) + ")";
    // A rope scaling's keys are read for that rope_type only (rope_scaling_keys()).
    bool rope_key = false;
    std::string scalings;  // "llama3.1: rope_factor, ...; yarn: ..."
    for (const auto& [type, keys] : rope_scaling_keys()) {
      scalings += (scalings.empty() ? "" : "; ") + std::string(type) + ":";
      for (const auto k : keys) {
        scalings += (scalings.back() == ':' ? " " : ", ") + std::string(k);
        rope_key = rope_key || std::find(unread.begin(), unread.end(), k) != unread.end();
      }
    }
    const std::string rope_type = cfg.has("rope_type") ? cfg.get_string("rope_type") : "";
    throw UsageError(
        "The " + cfg.get_string("decoder_block") + " model family does not use " + list +
        (rope_key && !rope_type.empty() ? " with rope_type=" + rope_type : std::string()) +
        ": the model would be built as if " + (unread.size() == 1 ? "it were" : "they were") +
        " left at the default. Remove " + (unread.size() == 1 ? "it" : "them") +
        (rope_key ? ", set the rope_type whose scaling takes it (" + scalings + ")"
                  : std::string()) +
        ", or choose a decoder_block (model) that implements " +
        (unread.size() == 1 ? "it." : "them."));
  }
  // The decode cache: int8 or the compute dtype.
  if (cfg.has("quantize_kvcache") && cfg.get_bool("quantize_kvcache")) {
    if (const std::string t = cfg.get_string("kv_quant_dtype"); t != "int8")
      cfg.reject("kv_quant_dtype",
                 t == "int4" ? "int4 KV caches are not implemented; int8 is."
                             : "must be int8 (the one KV cache quantization implemented).");
    const std::string axis = cfg.get_string("kv_quant_axis");
    if (axis != "dkv" && axis != "heads_and_dkv")
      cfg.reject("kv_quant_axis",
                 "must be dkv (a scale per token and key/value head) or heads_and_dkv (a scale "
                 "per token over all heads).");
    kv_quant_ = {true, axis == "dkv"};
  }
  // Sizes that overflow are refused here, before any allocation (an allocator asked for 2^63
  // bytes must never be reached from a config value).
  check_model_sizes(*model_, cfg.get_int("per_device_batch_size"),
                    cfg.get_int("max_target_length"));
  const std::string backend_name = cfg.get_string("backend");
  backend_ = given_backend ? std::move(given_backend) : plugins.make_backend(backend_name, cfg);
  attention_ = given_attention
                   ? std::move(given_attention)
                   : plugins.make_attention(backend_name, cfg.get_string("attention"), *backend_);
  if (!attention_)
    throw UsageError("attention=" + cfg.get_string("attention") + " is registered by the " +
                     backend_name + " backend but not implemented there yet.");

  if (cfg.get_bool("profile") && backend_->name() != "meta") {
    profiler_ = std::make_unique<ProfilingBackend>(*backend_);
    prof_attention_ = profiler_->wrap(*attention_);
  }
  auto declare = [this](const ParamSpec& s, const std::string& full,
                        std::vector<std::string>& names) {
    for (const auto& n : names)
      if (n == s.name) throw Error("The model family declares the parameter '" + full + "' twice.");
    names.push_back(s.name);
    params_.push_back({full, s, {}, {}});
  };
  for (const auto& s : model_->top_parameters()) declare(s, s.name, top_names_);
  num_top_ = params_.size();
  mtp_depths_ = model_->mtp_depths();
  MT_CHECK(mtp_depths_ >= 0,
           "the model declares " + std::to_string(mtp_depths_) + " multi-token prediction depths");
  layer_names_.resize(static_cast<size_t>(model_->num_layers() + mtp_depths_));
  for (int i = 0; i < model_->num_layers(); ++i) {
    layer_begin_.push_back(params_.size());
    for (const auto& s : model_->layer(i).parameters())
      declare(s, "layers." + std::to_string(i) + "." + s.name,
              layer_names_[static_cast<size_t>(i)]);
    cache_specs_.push_back(model_->layer(i).cache_spec());
  }
  // Multi-token prediction depth k's module and layer share one namespace, "mtp.<k>.", after
  // the decoder's layers (training only: decode's caches are the decoder's).
  for (int k = 1; k <= mtp_depths_; ++k) {
    layer_begin_.push_back(params_.size());
    std::vector<std::string>& names =
        layer_names_[static_cast<size_t>(model_->num_layers() + k - 1)];
    const std::string prefix = "mtp." + std::to_string(k) + ".";
    for (const auto& s : model_->mtp_parameters(k)) declare(s, prefix + s.name, names);
    for (const auto& s : model_->mtp_layer(k).parameters()) declare(s, prefix + s.name, names);
  }
  // Full names are what checkpoints key tensors by: a top-level parameter named like a layer's
  // ("layers.0.attn_norm") would share its checkpoint entry, and a resume would load one
  // tensor into both.
  {
    std::set<std::string> full;
    for (const auto& p : params_)
      if (!full.insert(p.name).second)
        throw Error("The model family declares two parameters named '" + p.name +
                    "' (a top-level one named like a layer's, \"layers.<i>.\" or \"mtp.<k>.\"): "
                    "checkpoints key tensors by these names, so one would overwrite the other. "
                    "Rename the top-level parameter.");
  }
  if (expert_.on()) split_for_expert_parallelism(cfg);
  if (tensor_.on())
    split_for_tensor_parallelism(cfg);
  else
    tensor_axis_rules(cfg);
  // Tensor (or expert) parallelism's part first, then FSDP's part of that.
  for (auto& p : params_) {
    p.local_shape = p.spec.shape;
    if (p.tensor_dim >= 0) p.local_shape[static_cast<size_t>(p.tensor_dim)] /= p.split_parts;
    const int64_t n = shape_numel(p.local_shape);
    if (sharding_.on()) {
      const auto [b, e] = shard_range(static_cast<size_t>(n), sharding_.rank, sharding_.ranks);
      p.shard_begin = static_cast<int64_t>(b);
      p.shard_end = static_cast<int64_t>(e);
      p.value = backend().empty({p.shard_end - p.shard_begin}, weight_dtype_);
    } else {
      p.shard_end = n;
      if (int8_from_start && q8_shape(p)) {
        p.value = backend().empty(*q8_shape(p), DType::i8);
        p.layout = WeightLayout::q8;
        any_layout_ = true;
      } else {
        p.value = backend().empty(p.local_shape, weight_dtype_);
      }
    }
  }
}

ModelRunner::~ModelRunner() = default;

double ModelRunner::take_communication_seconds() {
  double s = std::exchange(comm_seconds_, 0.0);
  if (queue_) s += queue_->take_wait_seconds();
  return s;
}

namespace {
constexpr const char* kOverlapWhat =
    "gradients are reduced after the backward (0) or overlapped with it, FSDP's next gathers "
    "started early too (1)";
constexpr const char* kOverlapDefault = "plain data parallelism overlaps, FSDP does not";
}  // namespace

bool ModelRunner::overlaps_communication(const Communicator& comm) const {
  if (env_flag("MT_OVERLAP_COMMUNICATION", kOverlapWhat, kOverlapDefault) == 0) return false;
  // (Tensor and expert parallelism communicate from the training thread during the backward.)
  return comm.size() > 1 && comm.serialized_threads() && !tensor_.on() && !expert_.on() &&
         !profiler_ && backend_->name() == "cpu";
}

bool ModelRunner::fsdp_overlaps() const {
  return env_flag("MT_OVERLAP_COMMUNICATION", kOverlapWhat, kOverlapDefault) == 1 &&
         sharding_.comm && overlaps_communication(*sharding_.comm);
}

CollectiveQueue* ModelRunner::fsdp_queue() {
  if (!queue_ && fsdp_overlaps()) queue_ = std::make_unique<CollectiveQueue>();
  return queue_.get();
}

void ModelRunner::start_gather(size_t i) {
  const Param& p = params_[i];
  auto host = std::make_shared<std::vector<float>>(static_cast<size_t>(shape_numel(p.local_shape)));
  Communicator* comm = sharding_.comm;
  const Tensor value = p.value;  // this rank's part, unchanged until the optimizer step
  const int64_t b = p.shard_begin;
  const uint64_t t =
      queue_->submit({[host, value, b] { part_to_host(value, 0, value.numel(), host->data() + b); },
                      [host, comm] { comm->all_gather(host->data(), host->size()); },
                      {}});
  prefetched_[i] = {host, t};
}

void ModelRunner::prefetch_after(size_t block) {
  // The pass's direction: the blocks come in rising order in the forward, in falling order in
  // a remat backward's re-runs.
  const bool down = last_block_ != SIZE_MAX && block < last_block_;
  last_block_ = block;
  if (down ? block == 0 : block + 1 >= layer_begin_.size()) return;
  const size_t next = down ? block - 1 : block + 1;
  for (size_t j = block_begin(next); j < block_end(next); ++j)
    if (!prefetched_.count(j)) start_gather(j);
}

void ModelRunner::settle_fsdp_queue() {
  if (!queue_) return;
  queue_->drain();
  prefetched_.clear();
  last_block_ = SIZE_MAX;
}

Param* ModelRunner::find(const std::string& name) {
  for (auto& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

void ModelRunner::init_parameters(uint64_t seed, Progress* progress) {
  // On the backend, straight into each parameter in its own dtype: zeros and ones by fill, the
  // normals by fill_random from the parameter's own stream (seed ^ fnv1a(name)), whose values
  // depend on neither the order, the backend nor its thread count (mt/random_fill.h).
  // FSDP: a normal draw is a function of the element's index in the whole tensor, so a rank
  // draws the whole parameter and keeps its part (one parameter at a time).
  for (auto& p : params_) {
    MT_CHECK(p.layout == WeightLayout::dense,
             "init_parameters: " + p.name +
                 " is held in an inference layout (int8 rows or transposed); it draws the "
                 "declared layout only");
    switch (p.spec.init) {
      case Init::zeros:
        backend().fill(p.value, 0.f);
        break;
      case Init::ones:
        backend().fill(p.value, 1.f);
        break;
      case Init::normal:
      case Init::truncated_normal: {
        RandomFill spec;
        spec.key = seed ^ fnv1a(p.name);
        spec.distribution = p.spec.init == Init::normal
                                ? RandomFill::Distribution::normal
                                : RandomFill::Distribution::truncated_normal;
        spec.stddev = p.spec.stddev;
        if (sharding_.on() || p.tensor_dim >= 0) {
          Tensor whole = backend().empty(p.spec.shape, p.value.dtype());
          backend().fill_random(whole, spec);
          const Tensor local = tensor_part(p, whole);
          backend().cast(flat_part(local, p.shard_begin, p.shard_end), p.value);
        } else {
          backend().fill_random(p.value, spec);
        }
        break;
      }
    }
    if (progress) progress->add(static_cast<double>(p.value.nbytes()));
  }
}

Config inference_config(const Config& cfg) {
  if (!(dtype_key(cfg, "weight_dtype") == DType::f32 && dtype_key(cfg, "dtype") == DType::bf16))
    return cfg;
  Config c = cfg;
  ConfigValue v = c.impl().at("weight_dtype");
  v.s = "bfloat16";
  v.origin = "inference: the weights stored in dtype=bfloat16 from the start (" + v.origin + ")";
  c.impl().set("weight_dtype", std::move(v));
  return c;
}

void load_checkpoint_weights(const std::filesystem::path& path, ModelRunner& runner) {
  std::map<std::string, Tensor> whole;
  std::map<std::string, Shape> int8;  // read in f32 one at a time (set_q8_from_declared rounds)
  for (auto& p : runner.params()) {
    if (p.layout == WeightLayout::q8)
      int8[p.name] = p.spec.shape;
    else
      whole[p.name] = p.value;
  }
  Backend& be = runner.backend();
  load_parameters(path, whole, int8, be, [&](const std::string& name, const Tensor& f32) {
    std::vector<float> host(static_cast<size_t>(f32.numel()));
    be.copy_to_host(f32, host.data());
    runner.set_q8_from_declared(*runner.find(name), std::move(host));
  });
  be.release_cached_memory();  // the temporaries' blocks, as load_hf_weights
}

bool ModelRunner::store_weights_in_compute_dtype() {
  if (!(weight_dtype_ == DType::f32 && compute_dtype_ == DType::bf16)) return false;
  for (auto& p : params_)
    MT_CHECK(!p.grad.defined(), "store_weights_in_compute_dtype: " + p.name +
                                    " has a gradient buffer; it is for inference only");
  for (auto& p : params_) {
    Tensor narrow = backend().empty(p.value.shape(), compute_dtype_);
    backend().cast(p.value, narrow);
    p.value = std::move(narrow);
  }
  weight_dtype_ = compute_dtype_;
  return true;
}

namespace {

// dst [cols, rows] = src [rows, cols]^T, in 64 x 64 tiles; the tile columns (rows of dst) in
// parallel. Each tile is transposed into a local buffer and its rows copied out whole: written
// straight to dst, a tile's 64 stores went to 64 rows of dst, 4 KiB apart for a bf16 weight of
// 2048 rows, all in one L1 set, and each evicted the last (llama-bench-1b's projections took
// ~1.5 s to transpose at load).
template <class T>
void transpose_tiles(const T* src, T* dst, int64_t rows, int64_t cols) {
  constexpr int64_t kTile = 64;
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, (cols + kTile - 1) / kTile),
      [&](const tbb::blocked_range<int64_t>& blocks) {
        std::vector<T> buf(static_cast<size_t>(kTile * kTile));
        for (int64_t cb = blocks.begin(); cb < blocks.end(); ++cb) {
          const int64_t c0 = cb * kTile, c1 = std::min(cols, c0 + kTile);
          for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
            const int64_t r1 = std::min(rows, r0 + kTile);
            for (int64_t r = r0; r < r1; ++r)
              for (int64_t c = c0; c < c1; ++c)
                buf[static_cast<size_t>((c - c0) * kTile + (r - r0))] = src[r * cols + c];
            for (int64_t c = c0; c < c1; ++c)
              std::copy_n(buf.data() + (c - c0) * kTile, r1 - r0, dst + c * rows + r0);
          }
        }
      });
}

// v [rows, cols] (elements of T's size) transposed into a new tensor [cols, rows], or each
// matrix of experts' weights [E, rows, cols] into [E, cols, rows], through two host buffers the
// caller keeps for the next weight (each grows to the largest weight once: a fresh pair for
// every weight made transposing llama-bench-1b's f32 projections take ~9 s, most of it the
// kernel zeroing new pages).
template <class T>
Tensor transposed_copy(Backend& be, const Tensor& v, std::vector<T>& a, std::vector<T>& b) {
  const int64_t mats = v.ndim() == 3 ? v.dim(0) : 1, rows = v.dim(-2), cols = v.dim(-1);
  const size_t n = static_cast<size_t>(mats * rows * cols);
  if (a.size() < n) a.resize(n);
  if (b.size() < n) b.resize(n);
  be.copy_to_host(v, a.data());
  for (int64_t e = 0; e < mats; ++e)
    transpose_tiles(a.data() + e * rows * cols, b.data() + e * rows * cols, rows, cols);
  Shape ts = v.shape();
  std::swap(ts[ts.size() - 2], ts[ts.size() - 1]);
  Tensor t = be.empty(ts, v.dtype());
  be.copy_from_host(t, b.data());
  return t;
}

}  // namespace

bool ModelRunner::rows_layout_pays(size_t sequences) {
  if (!backend().extension("mt.matvec_rows_layout")) return false;
  if (sequences <= 2) return true;
  return sequences <= 8 && compute_dtype_ == DType::bf16 && weight_dtype_ == DType::bf16 &&
         backend().extension("mt.matvec_rows_bf16dot") != nullptr;
}

size_t ModelRunner::transpose_projections() {
  if (!backend().extension("mt.matvec_rows_layout")) return 0;
  if (!env_switch("MT_TRANSPOSE_PROJECTIONS", true,
                  "decode keeps the projection weights [K, N] as declared (0) or stores them "
                  "transposed where the backend streams rows faster (1)"))
    return 0;
  if (sharding_.on()) return 0;
  const bool experts = backend().extension("mt.grouped_rows_layout") != nullptr;
  std::vector<uint16_t> a16, b16;
  std::vector<uint32_t> a32, b32;
  // Largest first, those of one size together: the host buffers grow once, and each replaced
  // tensor's block, cached, is the next one's new tensor while the size lasts; at a change of
  // size the cache goes back to the system. So the transposition holds the weights, the two
  // buffers and one more tensor: the plan's three copies of the largest. (In declared order the
  // last layer's blocks stayed cached while the LM head was transposed: mixtral-bench-100m f32
  // decode peaked 25 MiB above its plan.)
  std::vector<Param*> order;
  for (auto& p : params_) {
    // A projection [K, N], or experts' [E, K, N] where the backend's grouped products stream
    // [E, N, K] faster too (Graph::grouped_project reads them).
    if (!p.spec.projection || p.layout != WeightLayout::dense || p.tensor_dim >= 0 ||
        !(p.value.ndim() == 2 || (p.value.ndim() == 3 && experts)))
      continue;
    order.push_back(&p);
  }
  std::stable_sort(order.begin(), order.end(), [](const Param* a, const Param* b) {
    return a->value.nbytes() > b->value.nbytes();
  });
  for (size_t i = 0; i < order.size(); ++i) {
    Param& p = *order[i];
    MT_CHECK(!p.grad.defined(), "transpose_projections: " + p.name +
                                    " has a gradient buffer; it is for inference only");
    const size_t size = dtype_size(p.value.dtype());
    MT_CHECK(size == 2 || size == 4, "transpose_projections: " + p.value.str());
    fused_.clear();  // a fused group's tensor would no longer hold its weights
    p.value = size == 2 ? transposed_copy(backend(), p.value, a16, b16)
                        : transposed_copy(backend(), p.value, a32, b32);
    p.layout = WeightLayout::transposed;
    // The [K, N] tensors' blocks, which nothing will ask for again, back to the system.
    if (i + 1 == order.size() || order[i + 1]->value.nbytes() != p.value.nbytes())
      backend().release_cached_memory();
  }
  any_layout_ = any_layout_ || !order.empty();
  return order.size();
}

size_t ModelRunner::fuse_projections() {
  if (!env_switch("MT_FUSE_PROJECTIONS", true,
                  "decode keeps each block's q/k/v and gate/up weights apart (0) or joins "
                  "those stored as rows into one product (1)"))
    return 0;
  if (sharding_.on() || backend().name() == "meta") return 0;
  fused_.resize(layer_begin_.size());
  size_t count = 0;
  for (size_t block = 0; block < layer_begin_.size(); ++block) {
    const size_t begin = block_begin(block), end = block_end(block);
    const std::vector<std::string>& names = layer_names_[block];
    Fused& fused = fused_[block];
    auto index = [&](const std::string& name) -> int64_t {
      for (size_t j = begin; j < end; ++j)
        if (names[j - begin] == name) return static_cast<int64_t>(j);
      return -1;
    };
    for (const auto& group : fused_projection_groups()) {
      // Every prefix the block declares the group's first weight under (an MoE layer's shared
      // experts' beside its own, say).
      for (size_t j = begin; j < end; ++j) {
        const std::string& first = names[j - begin];
        if (!first.ends_with(group[0])) continue;
        const std::string prefix = first.substr(0, first.size() - group[0].size());
        const std::string name = fused_projection_name(prefix, group);
        if (std::find(fused.names.begin(), fused.names.end(), name) != fused.names.end())
          continue;  // fused already
        std::vector<Param*> ps;
        for (auto w : group) {
          const int64_t at = index(prefix + std::string(w));
          if (at < 0) break;
          ps.push_back(&params_[static_cast<size_t>(at)]);
        }
        if (ps.size() != group.size()) continue;
        const Param& p0 = *ps[0];
        // Rows of one width, read as stored (int8, or the compute dtype: a weight that
        // compute_param casts per forward cannot be fused).
        bool ok = p0.layout == WeightLayout::q8 ||
                  (p0.layout == WeightLayout::transposed && p0.value.dtype() == compute_dtype_);
        // Experts' weights [E, ...] (w_gate and w_up of an MoE layer) join as 2 E experts.
        const int64_t nd = p0.value.ndim();
        int64_t rows = 0;
        for (const Param* p : ps) {
          ok = ok && p->spec.projection && p->layout == p0.layout && p->tensor_dim < 0 &&
               !p->grad.defined() && (nd == 2 || nd == 3) && p->value.ndim() == nd &&
               p->value.dtype() == p0.value.dtype();
          for (int64_t i = 1; ok && i < nd; ++i) ok = p->value.dim(i) == p0.value.dim(i);
          if (!ok) break;
          rows += p->value.dim(0);
        }
        if (!ok) continue;
        Shape joined = p0.value.shape();
        joined[0] = rows;
        Tensor whole = backend().empty(joined, p0.value.dtype());
        int64_t at = 0;
        for (Param* p : ps) {
          Tensor dst = whole.slice0(at, at + p->value.dim(0));
          backend().cast(p->value, dst);  // same dtype: a copy
          at += p->value.dim(0);
          p->value = std::move(dst);  // a view of its rows: the same bytes as before
        }
        if (fused.names.empty())
          fused.names.assign(names.begin(), names.end());  // the block's own names first
        fused.names.push_back(name);
        fused.values.push_back(std::move(whole));
        fused.layouts.push_back(p0.layout);
        ++count;
        // The group's former tensors back to the system at once: held in the allocator's cache
        // (no later joined tensor has their size) they kept a second copy of q/k/v and gate/up
        // (2.1 GB of llama-bench-1b's 3.8 GB, in RSS for the whole decode when released only
        // at the end, and until then every block's: mt decode's peak above its plan).
        backend().release_cached_memory();
      }
    }
  }
  return count;
}

size_t ModelRunner::apply_quantization(const Config& cfg) {
  const std::string q = cfg.get_string("quantization");
  if (q.empty()) return 0;
  if (q != "int8")
    cfg.reject("quantization",
               "must be \"\" (none) or \"int8\"; MaxText's other modes (fp8, "
               "int8w, int4w, intmp, ...) are not implemented.");
  return quantize_projections();
}

size_t ModelRunner::quantize_projections() {
  if (sharding_.on())
    throw UsageError(
        "quantization=int8 is for inference on one rank; this run shards its parameters.");
  size_t count = 0;
  for (auto& p : params_) {
    // A projection [K, N], or experts' [E, K, N]: each expert's rows quantized alike; a tied
    // table [V, D], the rows of its head.
    const int64_t nd = p.value.ndim();
    const bool table = p.tied_table();
    if (!(p.spec.projection || table) || p.layout == WeightLayout::q8 || (nd != 2 && nd != 3))
      continue;
    MT_CHECK(!p.grad.defined(), "quantize_projections: " + p.name +
                                    " has a gradient buffer; it is for inference only");
    MT_CHECK(p.tensor_dim < 0, "quantize_projections: " + p.name + " is split");
    // Rows of W [N, K]: K the input dimension.
    const bool t = table || p.layout == WeightLayout::transposed;
    const int64_t mats = nd == 3 ? p.value.dim(0) : 1;
    const int64_t k = t ? p.value.dim(-1) : p.value.dim(-2),
                  n = t ? p.value.dim(-2) : p.value.dim(-1);
    if (k % kQ8Block != 0) continue;  // stays in the compute dtype
    const int64_t rb = q8_row_bytes(k);
    const Shape qs = nd == 3 ? Shape{mats, n, rb} : Shape{n, rb};
    fused_.clear();  // a fused group's tensor would no longer hold its weights
    // The rows are made before the weight is replaced: a weight they cannot hold is refused
    // with the parameter as it was. A memory plan's trace (the meta backend) has the sizes
    // only, no values to convert.
    std::vector<int8_t> q;
    if (backend().name() != "meta") {
      std::vector<float> host(static_cast<size_t>(mats * k * n));
      if (p.value.dtype() == DType::f32) {
        backend().copy_to_host(p.value, host.data());
      } else {
        MT_CHECK(p.value.dtype() == DType::bf16, "quantize_projections: " + p.value.str());
        std::vector<uint16_t> b(host.size());
        backend().copy_to_host(p.value, b.data());
        for (size_t i = 0; i < b.size(); ++i) host[i] = bf16_to_f32(b[i]);
      }
      q = q8_rows(p, host, t);
    }
    p.value = backend().empty(qs, DType::i8);
    p.layout = WeightLayout::q8;
    any_layout_ = true;  // now, not after the loop: a later weight's refusal leaves this one int8
    if (!q.empty()) backend().copy_from_host(p.value, q.data());
    ++count;
  }
  if (count > 0) backend().release_cached_memory();  // the float weights' blocks
  return count;
}

std::vector<int8_t> ModelRunner::q8_rows(const Param& p, std::vector<float>& host,
                                         bool rows_already) const {
  const Shape& s = p.spec.shape;  // [K, N] or [E, K, N]; a tied table [V, D]: its rows already
  const bool table = p.tied_table();
  MT_CHECK(!table || rows_already, "q8_rows: the table " + p.name + " is its rows");
  const int64_t mats = s.size() == 3 ? s[0] : 1, k = table ? s[1] : s[s.size() - 2],
                n = table ? s[0] : s.back();
  const int64_t rb = q8_row_bytes(k);
  std::vector<float> rows = rows_already ? std::move(host) : std::vector<float>(host.size());
  if (!rows_already) {
    for (int64_t e = 0; e < mats; ++e)
      transpose_tiles(host.data() + e * k * n, rows.data() + e * k * n, k, n);
    std::vector<float>().swap(host);  // one f32 copy at a time beside the int8 rows
  }
  std::vector<int8_t> q(static_cast<size_t>(mats * n * rb));
  std::atomic<int64_t> bad{mats * n};  // the first row that cannot be held, if any
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, mats * n, 64),
                    [&](const tbb::blocked_range<int64_t>& rs) {
                      for (int64_t r = rs.begin(); r < rs.end(); ++r)
                        if (!quantize_q8_row(rows.data() + r * k, k, q.data() + r * rb)) {
                          int64_t seen = bad.load();
                          while (r < seen && !bad.compare_exchange_weak(seen, r)) {
                          }
                        }
                    });
  if (const int64_t r = bad.load(); r < mats * n)
    throw Error(fmt::format(
        "quantization=int8: {} cannot be held as int8 rows: its row {} of {} ({} input "
        "values{}) holds NaN, an infinity or a value beyond 127 x 65504 (about 8.3e6), which an "
        "int8 row's f16 block scale cannot hold. The f32 or bf16 model would compute with it: "
        "run without quantization=int8, or mend the checkpoint.",
        p.name, r % n, n, k, mats > 1 ? fmt::format(", of expert {}", r / n) : std::string()));
  return q;
}

void ModelRunner::set_q8_from_declared(Param& p, std::vector<float>&& declared) {
  MT_CHECK(p.layout == WeightLayout::q8 && q8_shape(p) && p.value.shape() == *q8_shape(p),
           "set_q8_from_declared: " + p.name + " is not held as int8 rows");
  MT_CHECK(declared.size() == static_cast<size_t>(shape_numel(p.spec.shape)),
           "set_q8_from_declared: " + p.name + " needs " +
               std::to_string(shape_numel(p.spec.shape)) + " values");
  std::vector<float> host = std::move(declared);
  if (weight_dtype_ == DType::bf16)  // the weight's own values: rounded as the loaders round
    for (float& v : host) v = bf16_to_f32(f32_to_bf16(v));
  const std::vector<int8_t> q =
      q8_rows(p, host, /*rows_already=*/p.tied_table());  // a table's declared layout: its rows
  backend().copy_from_host(p.value, q.data());
}

void ModelRunner::enable_gradients() {
  for (auto& p : params_) {
    p.grad = backend().zeros(p.value.shape(), DType::f32);
    Graph::track(p.value, p.grad);
  }
}

void ModelRunner::zero_gradients() {
  for (auto& p : params_)
    if (p.grad.defined()) Graph::mark_fresh(p.value);
}

void ModelRunner::finish_gradients() {
  settle_fsdp_queue();  // the backward's reduce-scatters write the parts' gradients
  for (auto& p : params_)
    if (p.grad.defined()) Graph::finish_fresh(backend(), p.value);
}

DeviceBatch ModelRunner::upload(const HostBatch& hb) {
  DeviceBatch d;
  const Shape s{hb.batch, hb.seq};
  auto put = [&](const std::vector<int32_t>& v) {
    if (v.empty()) return Tensor();
    MT_CHECK(static_cast<int64_t>(v.size()) == hb.batch * hb.seq,
             "batch field has " + std::to_string(v.size()) + " ids for shape " + shape_str(s));
    Tensor t = backend().empty(s, DType::i32);
    backend().copy_from_host(t, v.data());
    return t;
  };
  d.inputs = put(hb.inputs);
  d.targets = put(hb.targets);
  if (hb.positions.empty()) {
    std::vector<int32_t> pos(static_cast<size_t>(hb.batch * hb.seq));
    for (int64_t i = 0; i < hb.batch * hb.seq; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(i % hb.seq);
    d.positions = put(pos);
  } else {
    d.positions = put(hb.positions);
  }
  d.segment_ids = put(hb.segment_ids);
  const int64_t vocab = model_->dims().vocab_size;
  for (size_t i = 0; i < hb.inputs.size(); ++i)
    if (hb.inputs[i] < 0 || hb.inputs[i] >= vocab)
      throw Error("Token id " + std::to_string(hb.inputs[i]) + " at position " +
                  std::to_string(i) + " of the batch is outside the model's vocabulary [0, " +
                  std::to_string(vocab) + ").");
  for (auto t : hb.targets) d.valid_targets += t >= 0;
  // Multi-token prediction: depth k reads position i + k's token and predicts its target, in
  // the same packed document only; beyond the sequence nothing (-1).
  if (mtp_depths_ > 0 && !hb.targets.empty()) {
    const std::vector<int32_t>& pos = hb.positions;
    const std::vector<int32_t>& seg = hb.segment_ids;
    for (int k = 1; k <= mtp_depths_; ++k) {
      const auto n = static_cast<size_t>(hb.batch * hb.seq);
      std::vector<int32_t> in(n, 0), at(n, 0), tg(n, -1);
      for (int64_t b = 0; b < hb.batch; ++b)
        for (int64_t i = 0; i + k < hb.seq; ++i) {
          const auto src = static_cast<size_t>(b * hb.seq + i);
          const auto dst = static_cast<size_t>(b * hb.seq + i + k);
          in[src] = hb.inputs[dst];
          at[src] = pos.empty() ? static_cast<int32_t>(i + k) : pos[dst];
          if (seg.empty() || seg[dst] == seg[src]) tg[src] = hb.targets[dst];
        }
      MtpBatch m;
      m.inputs = put(in);
      m.positions = put(at);
      m.targets = put(tg);
      for (auto t : tg) m.valid_targets += t >= 0;
      d.mtp.push_back(std::move(m));
    }
  }
  return d;
}

DeviceBatch ModelRunner::shaped_batch(int64_t batch, int64_t seq) {
  auto ids = [&] { return backend().empty({batch, seq}, DType::i32); };
  DeviceBatch d;
  d.inputs = ids();
  d.targets = ids();
  d.positions = ids();
  d.valid_targets = batch * seq;
  for (int k = 1; k <= mtp_depths_; ++k) {
    MtpBatch m;
    m.inputs = ids();
    m.positions = ids();
    m.targets = ids();
    m.valid_targets = batch * std::max<int64_t>(0, seq - k);
    d.mtp.push_back(std::move(m));
  }
  return d;
}

Tensor ModelRunner::forward(Graph& g, const DeviceBatch& batch) {
  LayerInputs in;
  in.positions = batch.positions;
  in.segment_ids = batch.segment_ids;
  refuse_vocab_parts("forward");
  settle_fsdp_queue();  // no gather started before this pass (of older weights) is used
  const std::vector<Tensor> ps = compute_params(g);
  return model_->head(g, top_params(ps), run_layers(g, ps, batch.inputs, in, nullptr, nullptr));
}

void ModelRunner::refuse_vocab_parts(const char* what) const {
  if (vocab_param_ >= 0)
    throw Error(std::string("ModelRunner::") + what +
                ": the model's vocabulary is divided among the tensor ranks (vocab:tensor in "
                "logical_axis_rules), so each rank holds only its columns of the logits; "
                "training's loss combines them, but logits are made for a model that holds its "
                "whole vocabulary (leave vocab out of logical_axis_rules).");
}

void ModelRunner::mark_vocab_part(Graph& g, const std::vector<Tensor>& ps) const {
  if (vocab_param_ < 0) return;
  const Tensor& t = ps[static_cast<size_t>(vocab_param_)];
  g.set_vocab_part(t, static_cast<int64_t>(tensor_.rank) * t.dim(0), model_->dims().vocab_size);
}

Tensor ModelRunner::forward_cached(Graph& g, const Tensor& tokens, const Tensor& positions,
                                   std::vector<KVCache>& caches, bool last_only) {
  MT_CHECK(static_cast<int>(caches.size()) == model_->num_layers(),
           "forward_cached: " + std::to_string(caches.size()) + " caches for " +
               std::to_string(model_->num_layers()) + " layers");
  refuse_vocab_parts("forward_cached");
  LayerInputs in;
  in.positions = positions;
  settle_fsdp_queue();  // no gather started before this pass (of older weights) is used
  const std::vector<Tensor> ps = compute_params(g);
  Tensor h = run_layers(g, ps, tokens, in, &caches, nullptr);
  if (last_only && h.ndim() == 3 && h.dim(1) > 1) {
    MT_CHECK(h.dim(0) == 1, "forward_cached: last_only takes a batch of one sequence, not " +
                                std::to_string(h.dim(0)));
    const int64_t t = h.dim(1), d = h.dim(2);
    h = g.reshape(g.reshape(h, {t, d}).slice0(t - 1, t), {1, 1, d});
  }
  return model_->head(g, top_params(ps), h);
}

std::vector<Tensor> ModelRunner::compute_params(Graph& g) {
  std::vector<Tensor> ps;
  ps.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i)
    ps.push_back(i < num_top_ || !sharding_.on() ? compute_param(g, i) : Tensor());
  return ps;
}

Tensor ModelRunner::compute_param(Graph& g, size_t i) {
  const Tensor v = sharding_.on() ? gather(g, i) : params_[i].value;
  // int8 rows are read as they are (Backend::matmul_q8).
  if (v.dtype() == compute_dtype_ || params_[i].layout == WeightLayout::q8) return v;
  return g.cast(v, compute_dtype_);
}

void ModelRunner::split_for_tensor_parallelism(const Config& cfg) {
  const std::vector<std::string> on_tensor = tensor_axis_rules(cfg);
  // The attention and MLP blocks sum their output projections (wo, w_down) over the tensor
  // ranks, and the attention pairs each rank's query heads with its key/value heads: right only
  // when all three are divided (Megatron's split). A rule set leaving one out trained silently
  // wrong (llama-test: 0.6-2.2% off one rank's losses), so it is refused.
  for (const char* axis : {"heads", "kv_heads", "mlp"})
    if (std::find(on_tensor.begin(), on_tensor.end(), axis) == on_tensor.end())
      cfg.reject("logical_axis_rules",
                 std::string("leaves '") + axis + "' off the tensor axis under tensor " +
                     "parallelism: the attention and MLP blocks sum their output projections " +
                     "over the tensor ranks, which is right only when the query heads, the " +
                     "key/value heads and the MLP columns are all divided among them. List " +
                     "heads:tensor, kv_heads:tensor and mlp:tensor (experts and vocab are " +
                     "optional), or train without tensor parallelism.");
  const ModelDims dims = model_->dims();
  const int t = tensor_.ranks;
  for (auto& p : params_) {
    if (p.by_expert) continue;  // the expert axis holds its experts
    for (size_t d = 0; d < p.spec.axes.size() && d < p.spec.shape.size(); ++d) {
      const std::string& axis = p.spec.axes[d];
      if (std::find(on_tensor.begin(), on_tensor.end(), axis) == on_tensor.end()) continue;
      // The first such dimension is split and later ones stay whole (an expert weight
      // [experts, embed, mlp] divides its experts when both are on the tensor axis).
      if (p.tensor_dim >= 0) break;
      // Whole heads on each rank: the attention block counts its heads from the columns.
      const int64_t units = axis == "heads"      ? dims.num_query_heads
                            : axis == "kv_heads" ? dims.num_kv_heads
                                                 : p.spec.shape[d];
      const char* what = axis == "heads"      ? "query heads (base_num_query_heads)"
                         : axis == "kv_heads" ? "key/value heads (base_num_kv_heads)"
                                              : nullptr;
      if (units % t != 0 || p.spec.shape[d] % t != 0)
        throw UsageError(
            "Tensor parallelism over " + std::to_string(t) + " ranks divides the '" + axis +
            "' axis, but " + model_label(cfg) + " has " + std::to_string(units) + " " +
            (what ? what : "elements there (parameter " + p.name + ")") + ", which " +
            std::to_string(t) +
            " does not divide. Choose ici_tensor_parallelism x dcn_tensor_parallelism dividing "
            "it" +
            (axis == "experts" || axis == "vocab"
                 ? ", or leave that axis out of logical_axis_rules."
                 : "."));
      p.tensor_dim = static_cast<int>(d);
      p.split_parts = t;
      p.split_part = tensor_.rank;
    }
  }
  // A vocabulary split: the embedding ("embedding" [vocab, embed], blocks::decoder_top_params)
  // holds this rank's rows, which the graph's lookup, LM head and loss work on
  // (Graph::set_vocab_part); anything else split along the vocabulary needs it.
  std::string other;
  bool any = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (p.tensor_dim < 0 || p.spec.axes[static_cast<size_t>(p.tensor_dim)] != "vocab") continue;
    any = true;
    if (i < num_top_ && p.name == "embedding" && p.tensor_dim == 0 && p.spec.shape.size() == 2)
      vocab_param_ = static_cast<int64_t>(i);
    else if (p.name != "lm_head")
      other = p.name;
  }
  if (!other.empty() || (any && vocab_param_ < 0))
    throw UsageError(
        "logical_axis_rules puts 'vocab' on the tensor axis, but " + model_label(cfg) + " (" +
        cfg.get_string("decoder_block") + " family) splits " +
        (other.empty() ? std::string("an LM head without an embedding table named 'embedding'")
                       : "the parameter '" + other + "'") +
        " along its vocabulary: only the embedding and LM head of blocks::decoder_top_params "
        "can be divided so. Leave vocab out of logical_axis_rules for this model.");
}

void ModelRunner::split_for_expert_parallelism(const Config& cfg) {
  const int x = expert_.ranks;
  bool any = false;
  for (auto& p : params_) {
    if (p.spec.axes.empty() || p.spec.axes[0] != "experts" || p.spec.shape.empty()) continue;
    if (p.spec.shape[0] % x != 0)  // resolve_mesh checked num_experts; a family's own stack
      throw UsageError("Expert parallelism over " + std::to_string(x) + " ranks divides the " +
                       "experts of " + p.name + ", but " + model_label(cfg) + " gives it " +
                       std::to_string(p.spec.shape[0]) + ", which " + std::to_string(x) +
                       " does not divide.");
    p.tensor_dim = 0;
    p.split_parts = x;
    p.split_part = expert_.rank;
    p.by_expert = true;
    any = true;
  }
  if (!any)
    throw UsageError(
        "Expert parallelism over " + std::to_string(x) +
        " ranks divides the experts of the "
        "mixture-of-experts layers that the core's MoE block computes, but " +
        model_label(cfg) + " (" + cfg.get_string("decoder_block") +
        " family) has none: its family computes its own experts. Use ici_data_parallelism "
        "instead of ici_expert_parallelism for it.");
}

Tensor ModelRunner::tensor_part(const Param& p, const Tensor& whole) {
  if (p.tensor_dim < 0) return whole;
  const auto [rows, cols, width] = split_of(whole.shape(), p.tensor_dim, p.split_parts);
  const auto t = static_cast<int64_t>(p.split_part), parts = static_cast<int64_t>(p.split_parts);
  Shape s = whole.shape();
  s[static_cast<size_t>(p.tensor_dim)] /= parts;
  Tensor out = backend().empty(s, whole.dtype());
  if (rows == 1) {  // one contiguous range
    backend().cast(flat_part(whole, t * width, (t + 1) * width), out);
    return out;
  }
  Tensor dst = out.view({rows, width});
  backend().copy_columns(whole.view({rows, cols}), t * width, dst, 0, width, false);
  return out;
}

std::vector<char> ModelRunner::local_part(const Param& p, const void* whole, size_t elem) const {
  // The tensor-parallel part (all of the tensor when not split), FSDP's range of it.
  const bool split = p.tensor_dim >= 0;
  const Split s = split_of(p.spec.shape, split ? p.tensor_dim : -1, p.split_parts);
  const auto* src = static_cast<const char*>(whole);
  std::vector<char> out(static_cast<size_t>(p.shard_end - p.shard_begin) * elem);
  for_each_run(s, p.split_part, p.shard_begin, p.shard_end, [&](int64_t w, int64_t j, int64_t n) {
    std::copy_n(src + w * static_cast<int64_t>(elem), n * static_cast<int64_t>(elem),
                out.data() + (j - p.shard_begin) * static_cast<int64_t>(elem));
  });
  return out;
}

Tensor ModelRunner::whole_value(size_t i) {
  if (!sharding_.on()) return params_[i].value;
  Graph g(backend(), /*record=*/false);
  return gather(g, i);
}

Tensor ModelRunner::gather(Graph& g, size_t i) {
  Param& p = params_[i];
  Backend& be = backend();
  Tensor whole = be.empty(p.local_shape, p.value.dtype());
  const auto n = static_cast<size_t>(whole.numel());
  Communicator* comm = sharding_.comm;
  const int64_t b = p.shard_begin, e = p.shard_end;
  double* seconds = &comm_seconds_;
  CollectiveQueue* queue = comm ? fsdp_queue() : nullptr;
  if (queue) {  // prefetched, or started now; the wait is what counts as exposed
    if (!prefetched_.count(i)) start_gather(i);
    const Prefetch got = prefetched_.at(i);
    prefetched_.erase(i);
    queue->wait(got.ticket);
    part_from_host(whole, 0, whole.numel(), got.host->data());
  } else if (comm) {
    be.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<float> host(n);
    part_to_host(p.value, 0, e - b, host.data() + b);
    comm->all_gather(host.data(), n);
    part_from_host(whole, 0, whole.numel(), host.data());
    *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (!g.recording() || !graph_detail::tracked(p.value)) return whole;
  // The backward: every rank's whole gradient, reduce-scattered (summed in rank order, as data
  // parallelism's all-reduce sums), added into this rank's part of the master gradient. The
  // whole tensor is a leaf whose gradient buffer is made on first use, so a matmul of its
  // compute-dtype cast writes its weight gradient there in f32 (as it does into an unsharded
  // master's buffer); the buffer is dropped once reduced.
  auto node = std::make_shared<GradNode*>(nullptr);
  graph_detail::record(
      true, g.internals().tape, whole, {&p.value},
      [comm, n, b, e, node, seconds, &be, queue](const Tensor& dout, const graph_detail::Grads& d) {
        if (queue) {
          // On the queue's thread while the backward goes on: the part's gradient buffer and
          // whether to overwrite it are decided here, in the backward's order.
          const bool overwrite = d.overwrite(0);
          Tensor dst = overwrite ? *d.raw(0) : d[0] ? *d[0] : Tensor();
          auto host = std::make_shared<std::vector<float>>(n, 0.f);
          const Tensor grad = dout;
          queue->submit({[host, grad] {
                           if (grad.defined()) part_to_host(grad, 0, grad.numel(), host->data());
                         },
                         [host, comm] { comm->reduce_scatter_sum(host->data(), host->size()); },
                         [host, dst, overwrite, b, e] {
                           if (!dst.defined()) return;
                           Tensor part = dst;
                           if (overwrite) {
                             part_from_host(part, 0, e - b, host->data() + b);
                             return;
                           }
                           std::vector<float> sum(static_cast<size_t>(e - b));
                           part_to_host(part, 0, e - b, sum.data());
                           for (size_t k = 0; k < sum.size(); ++k)
                             sum[k] += (*host)[static_cast<size_t>(b) + k];
                           part_from_host(part, 0, e - b, sum.data());
                         }});
          (*node)->grad = Tensor();
          return;
        }
        be.synchronize();
        const auto t0 = std::chrono::steady_clock::now();
        // (No communicator: the memory plan's trace, which allocates as this does.)
        std::vector<float> host(comm ? n : 0, 0.f);
        if (comm) {
          if (dout.defined()) part_to_host(dout, 0, static_cast<int64_t>(n), host.data());
          comm->reduce_scatter_sum(host.data(), n);
        }
        if (d.overwrite(0)) {
          if (comm) part_from_host(*d.raw(0), 0, e - b, host.data() + b);
        } else if (Tensor* acc = d[0]) {
          Tensor mine = be.empty({e - b}, DType::f32);
          if (comm) part_from_host(mine, 0, e - b, host.data() + b);
          be.axpy(1.f, mine, *acc);
        }
        (*node)->grad = Tensor();
        *seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      });
  // Every rank of the group joins the reduce-scatter, also where its forward left this weight
  // unused (an expert rank whose experts no token chose): zeros then, the others' sum kept.
  g.internals().tape.back().collective = true;
  *node = whole.grad_node().get();
  (*node)->leaf = true;
  (*node)->dtype = DType::f32;  // as a master's gradient, whatever the weight dtype
  return whole;
}

Params ModelRunner::block_params(Graph& g, const std::vector<Tensor>& ps, size_t block) {
  std::vector<Tensor> values;
  for (size_t j = block_begin(block); j < block_end(block); ++j)
    values.push_back(sharding_.on() ? compute_param(g, j) : ps[j]);
  if (sharding_.on() && fsdp_queue()) prefetch_after(block);
  if (block < fused_.size() && !fused_[block].values.empty()) {
    const Fused& f = fused_[block];
    std::vector<WeightLayout> ls = layouts(block_begin(block), block_end(block));
    values.insert(values.end(), f.values.begin(), f.values.end());
    ls.insert(ls.end(), f.layouts.begin(), f.layouts.end());
    return Params(f.names, std::move(values), std::move(ls), compute_dtype_);
  }
  return Params(layer_names_[block], std::move(values),
                layouts(block_begin(block), block_end(block)), compute_dtype_);
}

Params ModelRunner::top_params(const std::vector<Tensor>& ps) const {
  return Params(top_names_,
                std::vector<Tensor>(ps.begin(), ps.begin() + static_cast<ptrdiff_t>(num_top_)),
                layouts(0, num_top_), compute_dtype_);
}

std::vector<WeightLayout> ModelRunner::layouts(size_t begin, size_t end) const {
  std::vector<WeightLayout> r;
  if (!any_layout_) return r;
  for (size_t j = begin; j < end; ++j) r.push_back(params_[j].layout);
  return r;
}

const DecoderLayer& ModelRunner::block_layer(size_t i) const {
  const auto n = static_cast<size_t>(model_->num_layers());
  return i < n ? model_->layer(static_cast<int>(i))
               : model_->mtp_layer(static_cast<int>(i - n) + 1);
}

Tensor ModelRunner::run_layer(Graph& g, const DecoderLayer& layer, const std::vector<Tensor>& ps,
                              const Tensor& x, const LayerInputs& in, KVCache* cache,
                              std::vector<AuxLoss>* aux, std::vector<LayerStats>* stats,
                              size_t slot) {
  LayerOutput out;
  g.set_wants_aux(aux != nullptr || stats != nullptr);  // else dropped below: not computed
  if (cache) {
    LayerInputs li = in;
    li.cache = cache;
    out = layer.forward(g, block_params(g, ps, slot), x, li);
  } else {
    // The parameters are made on the graph the layer runs on: FSDP's gathers happen inside the
    // block, so remat frees them with its activations and gathers again for the backward.
    // (remat's re-run comes after this call returns: the lambda keeps what it needs by value.)
    const bool gather = sharding_.on();
    const Params lp = gather ? Params() : block_params(g, ps, slot);
    Tensor input = x;
    if (layer_ready_ && g.recording() && graph_detail::tracked(x) &&
        slot < static_cast<size_t>(model_->num_layers())) {
      // The layer's input through an identity whose backward, after every op of the layer's
      // (recorded after it, so run before it), says the layer's gradients are final.
      input = x.view(x.shape());
      Backend* be = &backend();
      const std::function<void(size_t)> ready = layer_ready_;
      graph_detail::record(true, g.internals().tape, input, {&x},
                           [be, ready, slot](const Tensor& dout, const graph_detail::Grads& d) {
                             if (!d.adopt(0, dout)) {
                               if (d.overwrite(0))
                                 be->cast(dout, *d.raw(0));
                               else
                                 be->axpy(1.f, dout, *d[0]);
                             }
                             ready(slot);
                           });
    }
    out = g.remat_layer(
        remat_,
        [this, &layer, lp, gather, slot, in](Graph& gg, const Tensor& h) {
          return layer.forward(gg, gather ? block_params(gg, {}, slot) : lp, h, in);
        },
        input);
  }
  if (aux)
    for (auto& a : out.aux) aux->push_back(std::move(a));
  // The forward's statistics: remat_layer returns those of its first run, not the re-run's.
  if (stats)
    for (const auto& st : out.stats) {
      std::vector<double>& acc = (*stats)[slot][st.name];
      if (acc.empty()) acc.assign(st.values.size(), 0.0);
      MT_CHECK(acc.size() == st.values.size(), "layer " + std::to_string(slot) + "'s statistic '" +
                                                   st.name + "' has " +
                                                   std::to_string(st.values.size()) + " values, " +
                                                   std::to_string(acc.size()) + " before");
      for (size_t j = 0; j < acc.size(); ++j) acc[j] += st.values[j];
    }
  return std::move(out.x);
}

Tensor ModelRunner::run_layers(Graph& g, const std::vector<Tensor>& ps, const Tensor& tokens,
                               LayerInputs in, std::vector<KVCache>* caches,
                               std::vector<AuxLoss>* aux, std::vector<LayerStats>* stats) {
  if (stats) stats->resize(layer_begin_.size());
  in.attention = &attention();
  // Tensor parallelism: the blocks sum their row-parallel projections over the group.
  if (tensor_.on()) g.set_tensor_group(tensor_.group, &comm_seconds_);
  if (tensor_.on() && !tensor_.group)
    g.count_tensor_collectives(&planned_sum_bytes_, &planned_gather_bytes_);
  mark_vocab_part(g, ps);  // vocab:tensor: the graph's lookup, LM head and loss work on parts
  // Expert parallelism: the MoE blocks send the tokens to their experts' ranks.
  if (expert_.on())
    g.set_expert_group(expert_.group, expert_.ranks, expert_.rank, expert_.tensor_ranks);
  Tensor x = model_->embed_at(g, top_params(ps), tokens, in.positions);
  for (int i = 0; i < model_->num_layers(); ++i) {
    const auto ui = static_cast<size_t>(i);
    x = run_layer(g, model_->layer(i), ps, x, in, caches ? &(*caches)[ui] : nullptr, aux, stats,
                  ui);
  }
  return x;
}

Tensor ModelRunner::loss(Graph& g, const DeviceBatch& batch, float z_loss, double weight_scale,
                         std::map<std::string, double>* aux_values, std::vector<LayerStats>* stats,
                         double aux_scale, const std::vector<double>* mtp_scales) {
  if (aux_scale < 0) aux_scale = weight_scale;
  LayerInputs in;
  in.positions = batch.positions;
  in.segment_ids = batch.segment_ids;
  std::vector<AuxLoss> aux;
  settle_fsdp_queue();  // no gather started before this pass (of older weights) is used
  const std::vector<Tensor> ps = compute_params(g);
  const Params top = top_params(ps);
  const Tensor hidden =
      run_layers(g, ps, batch.inputs, in, nullptr, aux_values ? &aux : nullptr, stats);
  const double w = batch.valid_targets ? weight_scale / static_cast<double>(batch.valid_targets) : 0.0;
  Tensor total = head_loss(g, ps, hidden, batch.targets, z_loss, static_cast<float>(w));
  // Multi-token prediction, in training only: depth k combines h^{k-1} with the embeddings of
  // the tokens k ahead, runs its layer, and the shared head predicts the token k + 1 ahead.
  // Objective: scale / D x sum over depths of their mean cross-entropy (DeepSeek-V3's lambda /
  // D; MaxText pools the depths' tokens instead, which is the same for D = 1).
  if (aux_values && mtp_depths_ > 0) {
    MT_CHECK(static_cast<int>(batch.mtp.size()) == mtp_depths_,
             "loss: the batch has " + std::to_string(batch.mtp.size()) +
                 " multi-token prediction depths for the model's " + std::to_string(mtp_depths_) +
                 " (make it with ModelRunner::upload, with targets)");
    const double per_depth = static_cast<double>(model_->mtp_loss_scale()) / mtp_depths_;
    Tensor h = hidden;
    for (int k = 1; k <= mtp_depths_; ++k) {
      const MtpBatch& mb = batch.mtp[static_cast<size_t>(k - 1)];
      const size_t slot = static_cast<size_t>(model_->num_layers() + k - 1);
      const Tensor e = model_->embed_at(g, top, mb.inputs, mb.positions);
      const Tensor x = model_->mtp_combine(g, block_params(g, ps, slot), h, e, k);
      LayerInputs li = in;
      li.attention = &attention();
      h = run_layer(g, model_->mtp_layer(k), ps, x, li, nullptr, &aux, stats, slot);
      const double wk = mb.valid_targets ? 1.0 / static_cast<double>(mb.valid_targets) : 0.0;
      const Tensor ce = head_loss(g, ps, h, mb.targets, 0.f, static_cast<float>(wk));
      float host = 0;
      backend().copy_to_host(ce, &host);
      MT_CHECK(!mtp_scales || mtp_scales->size() == static_cast<size_t>(mtp_depths_),
               "loss: mtp_scales has " + std::to_string(mtp_scales ? mtp_scales->size() : 0) +
                   " depths for the model's " + std::to_string(mtp_depths_));
      const double sk = mtp_scales ? (*mtp_scales)[static_cast<size_t>(k - 1)] : weight_scale;
      (*aux_values)["mtp_loss/" + std::to_string(k)] += sk * static_cast<double>(host);
      (*aux_values)["mtp_loss"] += sk * per_depth * static_cast<double>(host);
      total = g.add(total, g.scale(ce, static_cast<float>(per_depth * sk)));
    }
  }
  if (aux.empty()) return total;
  std::map<std::string, int> per_name;
  for (const auto& a : aux) ++per_name[a.name];
  for (const auto& a : aux) {
    MT_CHECK(a.value.defined() && a.value.numel() == 1 && a.value.dtype() == DType::f32,
             "auxiliary loss '" + a.name + "' must be a scalar [1] f32, got " +
                 (a.value.defined() ? a.value.str() : std::string("nothing")));
    float host = 0;
    backend().copy_to_host(a.value, &host);
    (*aux_values)[a.name] += aux_scale * static_cast<double>(host) / per_name[a.name];
    // The objective takes each name's mean over the layers reporting it, as MaxText's train.py
    // adds jnp.mean of the layers' moe_lb_loss (the sum made the weight L times as strong).
    if (a.weight != 0.f)
      total = g.add(total,
                    g.scale(a.value, static_cast<float>(a.weight * aux_scale / per_name[a.name])));
  }
  return total;
}

Tensor ModelRunner::head_loss(Graph& g, const std::vector<Tensor>& ps, const Tensor& hidden,
                              const Tensor& targets, float z_loss, float weight) {
  const Params top = top_params(ps);
  const int64_t d = hidden.dim(-1), n = hidden.numel() / d;
  if (vocab_tiles_ <= 1 || n <= 1) {
    const Tensor logits = model_->head(g, top, hidden);
    const int64_t v = logits.dim(-1);
    return g.cross_entropy(g.reshape(logits, {logits.numel() / v, v}), targets, z_loss, weight);
  }
  // num_vocab_tiling: the positions in `tiles` runs of rows, each through the head and the
  // cross-entropy as one remat block (full): the forward keeps a run's hidden rows and its loss,
  // never its logits, and the backward recomputes one run's logits at a time. Every row's loss
  // and logit gradient are those of the whole; the sums over rows (the loss, the head's weight
  // gradient) are taken run by run.
  const int64_t tiles = std::min(vocab_tiles_, n);
  const Tensor rows = g.reshape(hidden, {n, d});
  const Tensor flat_targets = targets.view({n});
  // Row numbers 0 .. n - 1, uploaded once: each run gathers its rows through a slice of them
  // (a memory plan's trace holds no values: no host copy of 10^9 row numbers there).
  Tensor all_rows = backend().empty({n}, DType::i32);
  if (backend().name() != "meta") {
    std::vector<int32_t> index(static_cast<size_t>(n));
    std::iota(index.begin(), index.end(), 0);
    backend().copy_from_host(all_rows, index.data());
  }
  Tensor total;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t b = n * t / tiles, e = n * (t + 1) / tiles;
    const Tensor idx = all_rows.slice0(b, e);
    const Tensor tile_targets = flat_targets.slice0(b, e);
    const Tensor ce = g.remat(
        RematPolicy::full,
        [this, ps, tile_targets, z_loss, weight](Graph& gg, const Tensor& h) {
          mark_vocab_part(gg, ps);  // (a graph's vocabulary part is not passed to remat's)
          const Tensor logits =
              model_->head(gg, top_params(ps), gg.reshape(h, {1, h.dim(0), h.dim(1)}));
          const int64_t v = logits.dim(-1);
          return gg.cross_entropy(gg.reshape(logits, {logits.numel() / v, v}), tile_targets, z_loss,
                                  weight);
        },
        g.gather_rows(rows, idx));
    total = total.defined() ? g.add(total, ce) : ce;
  }
  return total;
}

void ModelRunner::after_step(const std::vector<LayerStats>& stats) {
  static const LayerStats kNone;
  for (size_t i = 0; i < layer_begin_.size(); ++i) {
    const LayerStats& st = i < stats.size() ? stats[i] : kNone;
    // FSDP: the layer sees its whole master parameters, gathered, and every rank keeps its part
    // of what it wrote (every rank computes the same update from the same summed statistics).
    // Only layers that reported statistics are called there, so a step gathers nothing for
    // the others.
    if (sharding_.on() && st.empty()) continue;
    std::vector<Tensor> values;
    for (size_t j = block_begin(i); j < block_end(i); ++j) values.push_back(whole_value(j));
    const Params lp(layer_names_[i], values);
    block_layer(i).after_step(backend(), lp, st);
    if (sharding_.on())
      for (size_t j = block_begin(i); j < block_end(i); ++j) {
        Param& p = params_[j];
        backend().cast(flat_part(values[j - block_begin(i)], p.shard_begin, p.shard_end), p.value);
      }
  }
}

}  // namespace mt
