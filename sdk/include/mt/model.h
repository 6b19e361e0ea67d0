// Model families: what a family plugin (llama, gemma, ...) provides.
//
// A family declares its parameters and writes each decoder layer's forward in terms of the
// differentiable ops of ops.h; the core's tape gives the backward. The core owns the loop over
// layers (remat, decode caches, checkpoints), so every layer has the same call signature.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/export.h"
#include "mt/tensor.h"

namespace mt {

class Config;
class Graph;

enum class Init : uint8_t { normal, truncated_normal, zeros, ones };

struct ParamSpec {
  std::string name;  // relative to the layer inside DecoderLayer ("attn.wq"), else global
  Shape shape;
  Init init = Init::normal;
  float stddev = 0.02f;        // for normal / truncated_normal (truncated at 2 stddev)
  bool weight_decay = true;    // false for norms and biases
  bool matmul = true;          // counts towards model FLOPs (6 x matmul params per token)
};

// Per-layer KV cache for decode: k, v [B, Smax, Hkv, D] in the model's dtype. The core fills
// the bookkeeping for each call; the layer only calls Graph::write_kv_cache and
// Graph::attention_decode.
struct KVCache {
  Tensor k, v;
  Tensor lengths;     // [B] i32: valid rows once this call's T tokens are written
  Tensor write_rows;  // [B * T] i32: row of k/v viewed as [B * Smax, Hkv * D] for each new token
  // The call's tokens start an empty cache (prefill): they attend among themselves with the
  // ordinary kernel, then are stored. Otherwise they are stored first and attend to the cache.
  bool fresh = false;
};

// Everything a layer needs besides its parameters and input.
struct LayerInputs {
  Tensor positions;    // [B, T] i32 absolute positions
  Tensor segment_ids;  // [B, T] i32 or undefined (no packing)
  AttentionKernel* attention = nullptr;
  KVCache* cache = nullptr;  // decode only
};

class MT_API DecoderLayer {
 public:
  virtual ~DecoderLayer();
  virtual std::vector<ParamSpec> parameters() const = 0;
  // x [B, T, D] -> [B, T, D]. params: this layer's tensors, in the order of parameters().
  virtual Tensor forward(Graph& g, const std::vector<Tensor>& params, const Tensor& x,
                         const LayerInputs& in) const = 0;
};

// The dimensions the core needs for FLOP counts, caches and checks.
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
  virtual const DecoderLayer& layer(int index) const = 0;
  // tokens [B, T] i32 -> hidden [B, T, D]. top: tensors of top_parameters().
  virtual Tensor embed(Graph& g, const std::vector<Tensor>& top, const Tensor& tokens) const = 0;
  // hidden [B, T, D] -> logits [B, T, V] (final norm, LM head, soft-cap).
  virtual Tensor head(Graph& g, const std::vector<Tensor>& top, const Tensor& hidden) const = 0;
  // Hugging Face name of a parameter ("layers.3.attn.wq" -> "model.layers.3.self_attn.q_proj
  // .weight") and whether its matrix is stored transposed there. Empty when unmapped.
  struct HfName {
    std::string name;
    bool transposed = false;
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
};

}  // namespace mt
