// The Llama family (Llama 2, Llama 3, Llama 3.1/3.2): pre-norm decoder layers with RMSNorm,
// rotary embeddings (with Llama 3.1 frequency scaling or YaRN), grouped-query attention and a
// SwiGLU MLP; untied or tied embeddings. Written against the SDK only: the example a new family
// follows (see sdk/ADDING_A_MODEL.md).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/hf.h"
#include "mt/model.h"
#include "mt/plugin.h"

namespace {

using mt::Activation;
using mt::Init;
using mt::ParamSpec;
using mt::Tensor;

struct LlamaConfig {
  int64_t vocab = 0, d = 0, layers = 0;
  bool tied = false;
  mt::blocks::NormSpec norm;
  mt::blocks::AttentionBlockSpec attn;
  mt::blocks::MlpSpec mlp;
  float final_softcap = 0.f;

  explicit LlamaConfig(const mt::Config& c) {
    vocab = c.get_int("vocab_size");
    d = c.get_int("base_emb_dim");
    layers = c.get_int("base_num_decoder_layers");
    tied = c.get_bool("logits_via_embedding");
    norm.kind = mt::blocks::NormKind::rms;
    norm.eps = static_cast<float>(c.get_float("normalization_layer_epsilon"));

    attn.d_model = d;
    attn.heads = c.get_int("base_num_query_heads");
    attn.kv_heads = c.get_int("base_num_kv_heads");
    attn.head_dim = c.get_int("head_dim");
    mt::RopeSpec& rope = attn.rope;
    mt::blocks::rope_scaling_from_config(c, rope);
    rope.theta = static_cast<float>(c.get_float("rope_max_timescale"));
    rope.rotary_dim = static_cast<int>(
        std::lround(static_cast<double>(attn.head_dim) * c.get_float("partial_rotary_factor")));
    attn.attn.causal = true;
    attn.attn.window = c.get_int("sliding_window_size");
    attn.attn.softcap = static_cast<float>(c.get_float("attn_logits_soft_cap"));
    attn.attn.scale = 1.f / std::sqrt(static_cast<float>(attn.head_dim));

    mlp.d_model = d;
    mlp.hidden = c.get_int("base_mlp_dim");
    mlp.act = Activation::silu;
    mlp.gated = true;  // SwiGLU
    final_softcap = static_cast<float>(c.get_float("final_logits_soft_cap"));
  }
};

// A pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(.)).
class LlamaLayer final : public mt::DecoderLayer {
 public:
  explicit LlamaLayer(const LlamaConfig& c) : c_(c) {}

  std::vector<ParamSpec> parameters() const override {
    std::vector<ParamSpec> r = mt::blocks::norm_params("attn_norm", c_.d, c_.norm);
    for (auto& p : mt::blocks::attention_params(c_.attn)) r.push_back(p);
    for (auto& p : mt::blocks::norm_params("mlp_norm", c_.d, c_.norm)) r.push_back(p);
    for (auto& p : mt::blocks::mlp_params(c_.mlp)) r.push_back(p);
    return r;
  }

  // x [B, T, D] -> [B, T, D]
  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    using namespace mt::blocks;
    Tensor r = g.add(x, attention(g, p, c_.attn, norm(g, p, "attn_norm", x, c_.norm), in));
    return g.add(r, mlp(g, p, c_.mlp, norm(g, p, "mlp_norm", r, c_.norm)));
  }

  mt::CacheSpec cache_spec() const override { return mt::blocks::attention_cache_spec(c_.attn); }

 private:
  LlamaConfig c_;
};

class LlamaModel final : public mt::Model {
 public:
  explicit LlamaModel(const mt::Config& cfg) : c_(cfg), layer_(c_) {}

  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = c_.vocab;
    m.d_model = c_.d;
    m.num_layers = c_.layers;
    m.num_query_heads = c_.attn.heads;
    m.num_kv_heads = c_.attn.kv_heads;
    m.head_dim = c_.attn.head_dim;
    m.mlp_dim = c_.mlp.hidden;
    return m;
  }

  // embedding [V, D], final_norm [D], lm_head [D, V] (absent when tied to the embedding)
  std::vector<ParamSpec> top_parameters() const override {
    return mt::blocks::decoder_top_params(c_.vocab, c_.d, c_.norm, c_.tied);
  }
  int num_layers() const override { return static_cast<int>(c_.layers); }
  // Every Llama layer has the same structure; only its parameters differ.
  const mt::DecoderLayer& layer(int) const override { return layer_; }

  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.embedding(top, "embedding", tokens);
  }
  // hidden [B, T, D] -> logits [B, T, V]
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied, c_.final_softcap);
  }

  HfName hf_name(const std::string& n) const override {
    if (HfName top; mt::hf_causal_lm_top(n, c_.tied, top)) return top;
    std::string index, p;  // "layers.<i>.<param>"
    if (!mt::hf_split_layer(n, index, p)) return {};
    static const mt::HfNameTable kNames = {{"attn_norm", {"input_layernorm.weight", false}},
                                           {"mlp_norm", {"post_attention_layernorm.weight", false}},
                                           {"wq", {"self_attn.q_proj.weight", true}},
                                           {"wk", {"self_attn.k_proj.weight", true}},
                                           {"wv", {"self_attn.v_proj.weight", true}},
                                           {"wo", {"self_attn.o_proj.weight", true}},
                                           {"w_gate", {"mlp.gate_proj.weight", true}},
                                           {"w_up", {"mlp.up_proj.weight", true}},
                                           {"w_down", {"mlp.down_proj.weight", true}}};
    return mt::hf_from_table(kNames, p, "model.layers." + index + ".");
  }

 private:
  LlamaConfig c_;
  LlamaLayer layer_;
};

class LlamaFamily final : public mt::ModelFamily {
 public:
  std::string name() const override { return "llama"; }

  void validate(const mt::Config& c) const override {
    const int64_t heads = c.get_int("base_num_query_heads");
    const int64_t kv = c.get_int("base_num_kv_heads");
    if (heads % kv != 0)
      c.reject("base_num_kv_heads", "must divide base_num_query_heads=" + std::to_string(heads) +
                                        " (each group of query heads shares one key/value head).");
    const int64_t hd = c.get_int("head_dim");
    const double prf = c.get_float("partial_rotary_factor");
    const auto rot = std::lround(static_cast<double>(hd) * prf);
    if (prf <= 0 || prf > 1 || rot % 2 != 0)
      c.reject("partial_rotary_factor",
               "must be in (0, 1] and give an even number of rotary features of head_dim=" +
                   std::to_string(hd) + ".");
    if (c.get_int("num_experts") != 1)
      c.reject("num_experts",
               "must be 1 for the llama family (dense MLPs); mixture-of-experts models are "
               "families of their own (mixtral, qwen3_moe, deepseek).");
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 2 || acts[0] != "silu" || acts[1] != "linear")
      c.reject("mlp_activations", "must be [silu, linear] for the llama family (SwiGLU).");
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<LlamaModel>(c);
  }

  // LlamaForCausalLM's config.json <-> mt keys.
  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override {
    auto get = [&](const std::string& k) { return mt::hf_get(hf, k); };
    auto need = [&](const std::string& k) -> const std::string& {
      return mt::hf_need(hf, k, "Llama");
    };
    auto refuse_true = [&](const std::string& k, const std::string& what) {
      if (mt::hf_flag(hf, k, false))
        throw mt::UsageError("config.json sets " + k + "=true: " + what +
                             " are not supported by mt's llama family.");
    };
    refuse_true("attention_bias", "attention biases");
    refuse_true("mlp_bias", "MLP biases");
    if (const std::string* act = get("hidden_act"); act && *act != "silu")
      throw mt::UsageError("config.json's hidden_act is '" + *act +
                           "'; mt's llama family implements silu (SwiGLU) only.");
    std::vector<std::string> o = {"decoder_block=llama"};
    const std::string& heads = need("num_attention_heads");
    const std::string& hidden = need("hidden_size");
    o.push_back("vocab_size=" + need("vocab_size"));
    o.push_back("base_emb_dim=" + hidden);
    o.push_back("base_mlp_dim=" + need("intermediate_size"));
    o.push_back("base_num_decoder_layers=" + need("num_hidden_layers"));
    o.push_back("base_num_query_heads=" + heads);
    const std::string* kv = get("num_key_value_heads");
    o.push_back("base_num_kv_heads=" + (kv ? *kv : heads));
    const std::string* hd = get("head_dim");
    o.push_back("head_dim=" + (hd ? *hd : std::to_string(mt::hf_derived_head_dim(hidden, heads))));
    // Absent: LlamaConfig's default, 1e-6 (base.yml's 1e-5 is MaxText's).
    mt::hf_refuse_null(hf, "rms_norm_eps");
    const std::string* eps = get("rms_norm_eps");
    o.push_back("normalization_layer_epsilon=" + (eps ? *eps : std::string("1e-6")));
    o.push_back(std::string("logits_via_embedding=") +
                (mt::hf_flag(hf, "tie_word_embeddings", false) ? "true" : "false"));
    if (const std::string* v = get("max_position_embeddings"))
      o.push_back("max_position_embeddings=" + *v);

    // Rotary embeddings: transformers 5 writes rope_parameters {rope_theta, rope_type, factor,
    // ...}; earlier versions a top-level rope_theta beside rope_scaling {rope_type, factor, ...}.
    // Both are read (a theta left at its default would make every logit wrong).
    const bool v5 = std::any_of(hf.begin(), hf.end(), [](const auto& kv) {
      return kv.first.rfind("rope_parameters.", 0) == 0;
    });
    const std::string rp = v5 ? "rope_parameters." : "rope_scaling.";
    const std::string* theta = get(v5 ? "rope_parameters.rope_theta" : "rope_theta");
    if (!theta && v5) theta = get("rope_theta");
    if (theta) o.push_back("rope_max_timescale=" + *theta);
    const std::string* rt = get(rp + "rope_type");
    if (!rt) rt = get(rp + "type");
    // The rope fields each type reads; any other one changes the numerics in a way mt does not
    // implement, so it is refused rather than ignored.
    std::vector<std::string> rope_fields = {"rope_type", "type", "rope_theta"};
    // The context llama3 and yarn extend; absent, transformers takes max_position_embeddings
    // (standardize_rope_params), not base.yml's 8192.
    auto original_context = [&]() -> std::string {
      for (const std::string& k : {rp + "original_max_position_embeddings",
                                   std::string("original_max_position_embeddings"),
                                   std::string("max_position_embeddings")})
        if (const std::string* v = get(k); v && *v != "null") return *v;
      throw mt::UsageError("config.json's " + *rt +
                           " rotary embedding has neither original_max_position_embeddings nor "
                           "max_position_embeddings: the context it extends is unknown.");
    };
    // transformers' Llama rotates whole heads whatever partial_rotary_factor says (its default
    // rope ignores the field; yarn and llama3 fail on it), so a value below 1 asks for a model
    // no Llama reference computes: refused rather than guessed.
    for (const std::string& k :
         {rp + "partial_rotary_factor", std::string("partial_rotary_factor")})
      if (const std::string* prf = get(k); prf && *prf != "null" && mt::hf_number(k, *prf) != 1.0)
        throw mt::UsageError("config.json sets " + k + "=" + *prf +
                             ": transformers' Llama rotates every feature of each head whatever "
                             "it says, so the model it means is ambiguous; remove it to load the "
                             "model as transformers does.");
    rope_fields.push_back("partial_rotary_factor");
    if (rt && *rt == "llama3") {
      o.push_back("rope_type=llama3.1");
      o.push_back("rope_factor=" + need(rp + "factor"));
      o.push_back("rope_low_freq_factor=" + need(rp + "low_freq_factor"));
      o.push_back("rope_high_freq_factor=" + need(rp + "high_freq_factor"));
      o.push_back("original_max_position_embeddings=" + original_context());
      for (const char* f :
           {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"})
        rope_fields.push_back(f);
    } else if (rt && *rt == "yarn") {
      o.push_back("rope_type=yarn");
      o.push_back("rope_factor=" + need(rp + "factor"));
      if (const std::string* v = get(rp + "beta_fast")) o.push_back("beta_fast=" + *v);
      if (const std::string* v = get(rp + "beta_slow")) o.push_back("beta_slow=" + *v);
      o.push_back("original_max_position_embeddings=" + original_context());
      for (const char* f : {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings"})
        rope_fields.push_back(f);
    } else if (rt && *rt != "default") {
      throw mt::UsageError("config.json's " + rp.substr(0, rp.size() - 1) + " type '" + *rt +
                           "' is not supported (mt has default, llama3 and yarn).");
    }
    for (const auto& [k, v] : hf) {
      if (k.rfind(rp, 0) != 0 || v == "null") continue;
      const std::string field = k.substr(rp.size());
      if (std::find(rope_fields.begin(), rope_fields.end(), field) == rope_fields.end())
        throw mt::UsageError("config.json sets " + k + "=" + v +
                             ", which changes the rotary "
                             "embedding in a way mt's llama family does not implement" +
                             (rt ? " for rope type '" + *rt + "'" : std::string()) + ".");
    }
    if (v5 && get("rope_scaling"))
      throw mt::UsageError(
          "config.json has both rope_parameters and rope_scaling: which one "
          "transformers would use is ambiguous; keep one.");

    // Fields that change the computation of models of other families (or of Llama variants)
    // and that this family does not implement: refused with their name, never ignored.
    static const char* const kNumerics[] = {"sliding_window",
                                            "attn_logit_softcapping",
                                            "final_logit_softcapping",
                                            "logits_scaling",
                                            "logit_scale",
                                            "embedding_multiplier",
                                            "residual_multiplier",
                                            "attention_multiplier",
                                            "num_local_experts",
                                            "num_experts",
                                            "num_experts_per_tok",
                                            "qk_layernorm",
                                            "use_qk_norm",
                                            "query_pre_attn_scalar",
                                            "moe_intermediate_size",
                                            "kv_lora_rank",
                                            "q_lora_rank",
                                            "use_sliding_window",
                                            "no_rope_layers",
                                            "layer_types"};
    for (const char* k : kNumerics) {
      const std::string* v = get(k);
      if (!v || *v == "false" || *v == "0") continue;
      if (std::string(k) == "layer_types" && v->find("sliding") == std::string::npos) continue;
      throw mt::UsageError("config.json sets " + std::string(k) + "=" + *v +
                           ", which changes the computation in a way mt's llama family does not "
                           "implement; the logits would be wrong. Is this a Llama model?");
    }
    // Fields that only describe training, tooling or generation, and never change the logits.
    static const char* const kIgnorable[] = {
        "architectures",        "model_type",        "torch_dtype",          "dtype",
        "transformers_version", "use_cache",         "initializer_range",    "attention_dropout",
        "pretraining_tp",       "bos_token_id",      "eos_token_id",         "pad_token_id",
        "attention_bias",       "mlp_bias",          "hidden_act",           "tie_word_embeddings",
        "_name_or_path",        "output_attentions", "output_hidden_states", "return_dict"};
    static const char* const kUsed[] = {"vocab_size",
                                        "hidden_size",
                                        "intermediate_size",
                                        "num_hidden_layers",
                                        "num_attention_heads",
                                        "num_key_value_heads",
                                        "head_dim",
                                        "rms_norm_eps",
                                        "rope_theta",
                                        "max_position_embeddings"};
    for (const auto& [k, v] : hf) {
      bool known = k.rfind("rope_scaling", 0) == 0 || k.rfind("rope_parameters", 0) == 0;
      for (const char* i : kIgnorable) known = known || k == i;
      for (const char* u : kUsed) known = known || k == u;
      for (const char* n : kNumerics) known = known || k == n;
      if (!known) unused.push_back(k + "=" + v);
    }
    return o;
  }

  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override {
    const LlamaConfig c(cfg);
    // mt's llama takes these native settings, which transformers' LlamaForCausalLM has no field
    // for (its importer refuses them in config.json): an export would compute other logits
    // (before: written without them, 1.3-3.4 off mt's own).
    for (const char* k : {"sliding_window_size", "attn_logits_soft_cap", "final_logits_soft_cap"})
      if (cfg.get_float(k) != 0.0)
        throw mt::UsageError(std::string(k) + "=" + cfg.get_string(k) +
                             " has no Llama config.json form: transformers' LlamaForCausalLM "
                             "would compute other logits from the exported weights. (A windowed "
                             "model of this shape is a Mistral one: decoder_block=mistral.)");
    if (cfg.get_float("partial_rotary_factor") != 1.0)
      throw mt::UsageError("partial_rotary_factor=" + cfg.get_string("partial_rotary_factor") +
                           " has no Llama config.json form: transformers' LlamaForCausalLM "
                           "rotates whole heads, so it would compute other logits from the "
                           "exported weights.");
    const auto num = mt::hf_json_number;  // floats that read back as floats: "10000.0", "1e-05"
    std::map<std::string, std::string> m = {
        {"architectures", "[\"LlamaForCausalLM\"]"},
        {"model_type", "\"llama\""},
        {"vocab_size", std::to_string(c.vocab)},
        {"hidden_size", std::to_string(c.d)},
        {"intermediate_size", std::to_string(c.mlp.hidden)},
        {"num_hidden_layers", std::to_string(c.layers)},
        {"num_attention_heads", std::to_string(c.attn.heads)},
        {"num_key_value_heads", std::to_string(c.attn.kv_heads)},
        {"head_dim", std::to_string(c.attn.head_dim)},
        {"hidden_act", "\"silu\""},
        // From the config's doubles: c's floats would print 1e-5 as 9.99999975e-06.
        {"rms_norm_eps", num(cfg.get_float("normalization_layer_epsilon"))},
        {"rope_theta", num(cfg.get_float("rope_max_timescale"))},
        {"tie_word_embeddings", c.tied ? "true" : "false"},
        {"attention_bias", "false"},
        {"mlp_bias", "false"},
        {"torch_dtype",
         cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""},
        {"max_position_embeddings", std::to_string(cfg.get_int("max_position_embeddings") > 0
                                                       ? cfg.get_int("max_position_embeddings")
                                                       : cfg.get_int("max_target_length"))}};
    if (c.attn.rope.type == mt::RopeSpec::Type::llama3) {
      m["rope_scaling.rope_type"] = "\"llama3\"";
      m["rope_scaling.factor"] = num(cfg.get_float("rope_factor"));
      m["rope_scaling.low_freq_factor"] = num(cfg.get_float("rope_low_freq_factor"));
      m["rope_scaling.high_freq_factor"] = num(cfg.get_float("rope_high_freq_factor"));
      m["rope_scaling.original_max_position_embeddings"] =
          std::to_string(c.attn.rope.original_max_position);
    } else if (c.attn.rope.type == mt::RopeSpec::Type::yarn) {
      m["rope_scaling.rope_type"] = "\"yarn\"";
      m["rope_scaling.factor"] = num(cfg.get_float("rope_factor"));
      m["rope_scaling.beta_fast"] = num(cfg.get_float("beta_fast"));
      m["rope_scaling.beta_slow"] = num(cfg.get_float("beta_slow"));
      m["rope_scaling.original_max_position_embeddings"] =
          std::to_string(c.attn.rope.original_max_position);
    } else {
      m["rope_scaling"] = "null";
    }
    return m;
  }
};

void register_llama(mt::Registry& r) {
  r.add_model_family("llama", [] { return std::make_unique<LlamaFamily>(); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::model, "llama", "0.1.0", register_llama, nullptr)
