// Model families: what a family plugin (llama, gemma, ...) provides.
//
// A family declares its parameters and writes each decoder layer's forward from the shared
// blocks of blocks.h and the differentiable ops of graph.h; the core's tape gives the backward.
// The core owns the loop over layers (remat, decode caches, checkpoints), so every layer has the
// same call signature; layers of one model may be of different kinds.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mt/attention.h"
#include "mt/export.h"
#include "mt/tensor.h"

namespace mt {

class Backend;
class Config;
class Graph;

enum class Init : uint8_t { normal, truncated_normal, zeros, ones };

struct ParamSpec {
  std::string name;  // relative to the layer inside DecoderLayer ("wq"), else global
  Shape shape;
  Init init = Init::normal;
  float stddev = 0.02f;        // for normal / truncated_normal (truncated at 2 stddev)
  bool weight_decay = true;    // false for norms and biases
  bool matmul = true;          // counts towards model FLOPs (6 x matmul params per token)
  // The share of this parameter one token uses: 1, or k / E for the stacked weights of E
  // experts of which each token is routed to k. Model FLOPs and MFU count active parameters.
  float active = 1.f;
  // Logical axis of each dimension (MaxText's names: "embed", "heads", "kv_heads", "mlp",
  // "vocab", ...), or empty. The config's logical_axis_rules map them onto mesh axes: a
  // dimension on the tensor axis is split among the tensor-parallel ranks (Megatron), and the
  // layer's forward must then work on its part (blocks::attention and blocks::mlp do).
  std::vector<std::string> axes = {};
  // Read only as the right operand of x @ w, through Graph::project (blocks' projections do),
  // or for experts' weights [E, K, N] through Graph::grouped_project: inference may then store
  // it transposed ([N, K] for a [K, N] weight, [E, N, K] for experts'), the layout the CPU's
  // matrix-vector products stream fastest (ModelRunner::transpose_projections), or as int8 rows
  // (quantization=int8). A layer that reads it any other way must leave this false: Params
  // refuses such a read.
  bool projection = false;
  // An embedding table [V, D] read only through Graph::embedding(params, name, ids) and, when it
  // is the LM head too (matmul: tied), as x @ table^T through blocks::lm_head. Inference with
  // quantization=int8 then stores a tied table as int8 rows [V, D + D / 16] (mt/q8.h), which the
  // lookup widens row by row and the head reads through Backend::matmul_q8: a decode step reads
  // the whole table for the logits. blocks::decoder_top_params sets it.
  bool table = false;
};

// How the core stored a projection weight (ParamSpec::projection) for inference: as declared
// ([K, N]), transposed ([N, K]), or as int8 rows with a scale per 32 values (mt/q8.h: an i8
// tensor [N, K + K / 16], quantization=int8). Experts' weights [E, K, N] likewise per expert
// ([E, N, K], [E, N, K + K / 16]). Graph::project and Graph::grouped_project read all three.
// A tied embedding table (ParamSpec::table) [V, D] is dense or q8: its own rows [V, D + D / 16],
// which are those of the head it is (W = table^T [D, V]), so Graph::project reads them as the
// head and Graph::embedding(params, ...) looks tokens up in them.
enum class WeightLayout : uint8_t { dense, transposed, q8 };

// A layer's parameters (or the model's top parameters) by name, in the compute dtype: what
// DecoderLayer::forward, Model::embed and Model::head read their tensors from.
class MT_API Params {
 public:
  Params() = default;
  // names[i] is the name of values[i]; `names` must outlive this object (the core keeps them
  // for the model's lifetime).
  // layouts[i]: how values[i] is stored (empty: every one as declared). `dtype`: the compute
  // dtype, which a table stored as int8 rows is looked up in (Graph::embedding).
  Params(const std::vector<std::string>& names, std::vector<Tensor> values,
         std::vector<WeightLayout> layouts = {}, DType dtype = DType::f32);
  // The tensor called `name`; throws mt::Error naming it and the names there are, or when it
  // is not stored as declared (read those with Graph::project).
  const Tensor& operator[](std::string_view name) const;
  // Null when there is no such parameter (optional ones: biases, q/k norms); throws as above
  // for one not stored as declared.
  const Tensor* find(std::string_view name) const;
  // How `name` is stored (dense for an absent name).
  WeightLayout layout(std::string_view name) const;
  bool transposed(std::string_view name) const { return layout(name) == WeightLayout::transposed; }
  // The tensor called `name` as stored, any layout (throws as operator[] when absent).
  const Tensor& stored(std::string_view name) const;
  // The logical shape of `name` ([K, N], or experts' [E, K, N], for a projection weight stored
  // otherwise; a tied table stored as int8 rows gives its head's, [D, V]).
  Shape shape(std::string_view name) const;
  size_t size() const { return values_.size(); }
  DType dtype() const { return dtype_; }
  const std::vector<Tensor>& values() const { return values_; }

 private:
  const Tensor* lookup(std::string_view name, size_t* index) const;
  const std::vector<std::string>* names_ = nullptr;
  std::vector<Tensor> values_;
  std::vector<WeightLayout> layouts_;
  DType dtype_ = DType::f32;
};

// What a layer keeps per token when decoding; the core's decoder allocates it per layer:
// tensors [B, rows, entries[i]...] in the compute dtype, rows = window when 0 < window < the
// context (a ring buffer: position p lives in row p % window), else the context length.
// Attention's entries are k [Hkv, Dk] and v [Hkv, Dv]; a latent cache (DeepSeek's MLA) has one
// entry of its own shape. No entries: the layer keeps nothing.
struct CacheSpec {
  int64_t window = 0;  // > 0: each token attends to at most the last `window` positions
  std::vector<Shape> entries;
  bool operator==(const CacheSpec&) const = default;
};

// One layer's decode cache, shaped by its CacheSpec. The core fills the bookkeeping for each
// call; the layer calls Graph::cached_attention (or Graph::write_cache and its own attention
// over a latent cache).
struct KVCache {
  std::vector<Tensor> tensors;  // one per CacheSpec entry: [B, rows + 1, entry...]
  // An int8 cache (quantize_kvcache): tensors are i8 and scales[i] holds f32 [B, rows + 1, G],
  // each row of entry i in G groups of equal size with one scale each (Backend::scatter_rows_q8).
  // Empty: the tensors hold the compute dtype. Graph::write_cache and attention_decode read both;
  // a layer reading cache tensors itself must dequantize them (Backend::dequantize_rows_q8).
  std::vector<Tensor> scales;
  // The rows of each sequence this call's attention may read (every `lengths` is at most it),
  // so an int8 cache widens only those; 0: all of them (a recorded step keeps its shapes).
  int64_t read_rows = 0;
  int64_t window = 0;  // the CacheSpec's window
  Tensor lengths;     // [B] i32: valid rows once this call's T tokens are written
  Tensor write_rows;  // [B * T] i32: row of tensors[i] viewed as [B * (rows + 1), entry] per token
  // The call's tokens start an empty cache (prefill): they attend among themselves with the
  // ordinary kernel, then are stored. Otherwise they are stored first and attend to the cache.
  bool fresh = false;
  // Tensors a layer derives from its weights for decoding and keeps while the decoder lives
  // (latent attention's absorbed up-projections): made at its first step, by name, in the one
  // map the decoder gives each layer (every call's view shares it); the weights do not change
  // while a decoder decodes. Null: nothing is kept, the layer derives them at every call.
  std::shared_ptr<std::map<std::string, Tensor>> derived;
  // Attention's k and v (entries 0 and 1).
  const Tensor& k() const { return tensors.at(0); }
  const Tensor& v() const { return tensors.at(1); }
};

// Everything a layer needs besides its parameters and input.
struct LayerInputs {
  Tensor positions;    // [B, T] i32 absolute positions
  Tensor segment_ids;  // [B, T] i32 or undefined (no packing)
  AttentionKernel* attention = nullptr;
  KVCache* cache = nullptr;  // decode only
};

// A term a layer adds to the training objective (MoE load balancing, router z-loss): the core
// adds weight x value, averaged over the layers that report `name`, to the loss it
// differentiates (MaxText's mean over layers: the weight's strength does not grow with the
// depth), and logs value's average under `name` in metrics.jsonl.
struct AuxLoss {
  std::string name;
  Tensor value;  // scalar [1] f32, computed on the graph the layer was given
  float weight = 1.f;
};

// A statistic a layer reports from its forward in training, on the host and not
// differentiated (DeepSeek-V3: how many token-slots each expert was given). The core sums each
// name's values elementwise over a step's micro-batches (counting the forward only, not remat's
// re-run) and hands the sums to DecoderLayer::after_step after the optimizer update.
struct LayerStat {
  std::string name;
  std::vector<double> values;  // the same length in every forward of the layer
};
// A layer's statistics of one step, summed over its micro-batches, by name.
using LayerStats = std::map<std::string, std::vector<double>>;

struct LayerOutput {
  Tensor x;  // [B, T, D]
  std::vector<AuxLoss> aux;
  std::vector<LayerStat> stats;
  LayerOutput() = default;
  LayerOutput(Tensor out) : x(std::move(out)) {}  // NOLINT: a plain layer returns its tensor
};

class MT_API DecoderLayer {
 public:
  virtual ~DecoderLayer();
  virtual std::vector<ParamSpec> parameters() const = 0;
  // x [B, T, D] -> [B, T, D] and any auxiliary losses. p: this layer's parameters by name.
  virtual LayerOutput forward(Graph& g, const Params& p, const Tensor& x,
                              const LayerInputs& in) const = 0;
  // What decode keeps per token for this layer (blocks::attention_cache_spec for attention).
  virtual CacheSpec cache_spec() const = 0;
  // Called by the trainer once per step, after the optimizer has updated every parameter and
  // before the step's checkpoint: `p` is this layer's master parameters (weight_dtype), which
  // the layer may overwrite in place (be.copy_from_host / be.cast into p's tensors), and
  // `stats` the step's LayerOutput::stats summed over its micro-batches. For updates outside
  // the gradient (DeepSeek-V3's router_bias nudge toward balanced load). Default: nothing.
  // Under tensor parallelism `p` holds this rank's parts. Under FSDP it holds tensors gathered
  // for the call (whole, or the rank's tensor-parallel part), of which each rank keeps its part
  // after, and only layers that reported statistics that step are called (so that no step
  // gathers for nothing): an update must come from `stats`. Every rank must make the same one.
  virtual void after_step(Backend& be, const Params& p, const LayerStats& stats) const {
    (void)be;
    (void)p;
    (void)stats;
  }
};

// The dimensions the core needs for checks and reports.
struct ModelDims {
  int64_t vocab_size = 0;
  int64_t d_model = 0;
  int64_t num_layers = 0;
  int64_t num_query_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t mlp_dim = 0;
};

// One configured model of a family.
class MT_API Model {
 public:
  virtual ~Model();
  virtual ModelDims dims() const = 0;
  // Parameters outside the decoder layers (embedding, final norm, LM head), full names.
  virtual std::vector<ParamSpec> top_parameters() const = 0;
  virtual int num_layers() const = 0;
  // Layers may differ in kind (dense and MoE, local and global attention).
  virtual const DecoderLayer& layer(int index) const = 0;
  // tokens [B, T] i32 -> hidden [B, T, D]. top: the tensors of top_parameters().
  virtual Tensor embed(Graph& g, const Params& top, const Tensor& tokens) const = 0;
  // tokens [B, T] i32 and their absolute positions [B, T] i32 (0-based; restarting per packed
  // document) -> hidden [B, T, D]: what the core calls, in training and decode. The default is
  // embed(g, top, tokens); a family with learned absolute positions (GPT's position table)
  // overrides this one.
  virtual Tensor embed_at(Graph& g, const Params& top, const Tensor& tokens,
                          const Tensor& positions) const {
    (void)positions;
    return embed(g, top, tokens);
  }
  // hidden [B, T, D] -> logits [B, T, V] (final norm, LM head, soft-cap), each position on its
  // own: num_vocab_tiling calls it on runs of positions ([1, rows, D]) in turn.
  virtual Tensor head(Graph& g, const Params& top, const Tensor& hidden) const = 0;

  // Multi-token prediction (DeepSeek-V3 section 2.2; MaxText's mtp_num_layers): D modules run
  // after the decoder in training only. Depth k = 1..D takes the previous depth's hidden state
  // h^{k-1} [B, T, D] (depth 0: the last decoder layer's output, before the final norm) and the
  // embeddings of the tokens k ahead (embed_at of the inputs shifted left by k), combines them
  // with mtp_combine, runs mtp_layer(k), and the shared head() predicts the token k + 1 ahead.
  // The core adds mtp_loss_scale() / D x the sum of the depths' mean cross-entropies to the
  // training objective; evaluation, scoring and decode never run the modules. Depth k's
  // parameters are mtp_parameters(k) and mtp_layer(k).parameters(), named "mtp.<k>.<name>" (one
  // namespace: no name twice), and both mtp_combine and the layer read them from one Params.
  virtual int mtp_depths() const { return 0; }
  virtual float mtp_loss_scale() const { return 0.f; }
  virtual std::vector<ParamSpec> mtp_parameters(int depth) const {
    (void)depth;
    return {};
  }
  virtual const DecoderLayer& mtp_layer(int depth) const;
  // hidden [B, T, D] (h^{k-1}), embedded [B, T, D] (the tokens k ahead) -> mtp_layer's input.
  virtual Tensor mtp_combine(Graph& g, const Params& p, const Tensor& hidden,
                             const Tensor& embedded, int depth) const;

  // Model FLOPs of one trained token (forward and backward) at context length seq_len, for
  // TFLOP/s and MFU. The default: 6 x the matmul parameters a token uses (ParamSpec::matmul x
  // ParamSpec::active; the embedding counts when it is a matmul, i.e. tied to the LM head) plus
  // attention's 12 x heads x head_dim x attended keys per layer, each layer's keys limited by its
  // CacheSpec window, half of them when causal. Override for attention of another shape.
  virtual double flops_per_token(int64_t seq_len) const;

  // Hugging Face name of a parameter ("layers.3.wq" -> "model.layers.3.self_attn.q_proj
  // .weight") and how its tensor is laid out there. Empty name and stack: unmapped.
  struct HfName {
    std::string name;
    // Stored [out, in] there (each stacked part, when stacked).
    bool transposed = false;
    // Many-to-one: the parameter is these tensors stacked along a new first dimension (E
    // experts' [K, N] matrices -> [E, K, N]); `name` is then empty.
    std::vector<std::string> stack;
    // One-to-many: the parameter is columns [slice_begin, slice_end) of the last dimension of
    // tensor `name` as mt orients it (after the transpose), e.g. q of a fused qkv projection,
    // or elements [slice_begin, slice_end) of a vector (bq of GPT-2's fused c_attn.bias).
    // slice_end == 0: the whole tensor.
    int64_t slice_begin = 0, slice_end = 0;
  };
  virtual HfName hf_name(const std::string& mt_name) const {
    (void)mt_name;
    return {};
  }
};

// A Hugging Face config.json flattened: nested objects as dotted keys ("rope_scaling.factor"),
// values as text (strings without quotes, null as "null", lists as JSON text).
using HfConfig = std::map<std::string, std::string>;

class MT_API ModelFamily {
 public:
  virtual ~ModelFamily();
  virtual std::string name() const = 0;
  // Checks the family's part of the config; throws UsageError via Config::reject.
  virtual void validate(const Config& cfg) const = 0;
  virtual std::unique_ptr<Model> build(const Config& cfg) const = 0;

  // Hugging Face interop (mt convert, hf_path=). The core finds the family of a config.json by
  // its model_type (libmt_model_<model_type>.so). from_hf_config returns the mt config overrides
  // ("key=value") equal to `hf` and lists every field it did not use in `unused`; it throws
  // UsageError for anything mt cannot represent. to_hf_config returns config.json's fields,
  // each value as JSON text ("4096", "\"llama\"", "true"); dotted keys become nested objects.
  virtual std::vector<std::string> from_hf_config(const HfConfig& hf,
                                                  std::vector<std::string>& unused) const;
  virtual std::map<std::string, std::string> to_hf_config(const Config& cfg) const;

  // The family's own config keys, in configs/base.yml's format (each key with its default, a
  // comment saying what it does and an optional [constraint] annotation). The config loader
  // adds them to the schema when decoder_block names this family, so `mt config` shows them and
  // validate() reads them like any key. A key base.yml has already is an error; keys shared by
  // several families (MaxText's) belong in base.yml.
  virtual std::string config_schema() const { return {}; }
};

}  // namespace mt
