// The Mistral and Mixtral families. Mistral (7B) is Llama's pre-norm decoder (RMSNorm, rotary
// embeddings, a SwiGLU MLP) with grouped-query attention over a sliding window; Mixtral (8x7B,
// 8x22B) keeps that attention and replaces each layer's MLP by a mixture of experts: 8 SwiGLU
// experts, a softmax router, each token sent to its top 2 with their weights renormalised to sum
// to 1. They differ by that one switch, so both are this file: blocks::attention, and
// blocks::mlp or blocks::moe.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mistral_family.h"
#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/hf.h"
#include "mt/model.h"
#include "mt/registry.h"

namespace mt_mistral {

namespace {

using mt::Activation;
using mt::ParamSpec;
using mt::Tensor;

struct FamilyConfig {
  bool moe = false;
  int64_t vocab = 0, d = 0, layers = 0;
  bool tied = false;
  mt::blocks::NormSpec norm;
  mt::blocks::AttentionBlockSpec attn;
  mt::blocks::MlpSpec mlp;      // mistral
  mt::blocks::MoeSpec experts;  // mixtral

  FamilyConfig(const mt::Config& c, bool is_moe) : moe(is_moe) {
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
    attn.rope.type = mt::RopeSpec::Type::standard;
    attn.rope.theta = static_cast<float>(c.get_float("rope_max_timescale"));
    attn.rope.rotary_dim = static_cast<int>(attn.head_dim);
    attn.attn.causal = true;
    attn.attn.window = c.get_int("sliding_window_size");  // 0: full causal attention
    attn.attn.scale = 1.f / std::sqrt(static_cast<float>(attn.head_dim));

    mlp.d_model = d;
    mlp.hidden = c.get_int("base_mlp_dim");
    mlp.act = Activation::silu;
    mlp.gated = true;  // SwiGLU

    experts.num_experts = c.get_int("num_experts");
    // The experts' keys are read for mixtral only, so that mistral (dense) refuses them as a
    // family that does not use them (before: capacity_factor, the MoE loss weights and
    // norm_topk_prob were taken and changed nothing).
    if (!moe) return;
    experts.d_model = d;
    // Mixtral's experts are base_mlp_dim wide (MaxText's mixtral configs set that);
    // base_moe_mlp_dim, when set, wins.
    const int64_t moe_dim = c.get_int("base_moe_mlp_dim");
    experts.hidden = moe_dim > 0 ? moe_dim : mlp.hidden;
    experts.top_k = c.get_int("num_experts_per_tok");
    experts.act = Activation::silu;
    experts.gated = true;
    experts.normalize_topk = c.get_bool("norm_topk_prob");
    experts.load_balance_weight = static_cast<float>(c.get_float("load_balance_loss_weight"));
    experts.z_loss_weight = static_cast<float>(c.get_float("moe_z_loss_weight"));
    experts.capacity_factor = static_cast<float>(c.get_float("capacity_factor"));
  }
};

// x + attention(norm(x)), then + mlp(norm(.)) or + moe(norm(.)).
class Layer final : public mt::DecoderLayer {
 public:
  Layer(const FamilyConfig& c, int index) : c_(c) { c_.experts.layer = index; }

  std::vector<ParamSpec> parameters() const override {
    using namespace mt::blocks;
    std::vector<ParamSpec> r = norm_params("attn_norm", c_.d, c_.norm);
    for (auto& p : attention_params(c_.attn)) r.push_back(p);
    for (auto& p : norm_params("mlp_norm", c_.d, c_.norm)) r.push_back(p);
    for (auto& p : c_.moe ? moe_params(c_.experts) : mlp_params(c_.mlp)) r.push_back(p);
    return r;
  }

  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    using namespace mt::blocks;
    Tensor r = g.add(x, attention(g, p, c_.attn, norm(g, p, "attn_norm", x, c_.norm), in));
    const Tensor h = norm(g, p, "mlp_norm", r, c_.norm);
    if (!c_.moe) return g.add(r, mlp(g, p, c_.mlp, h));
    mt::LayerOutput out = moe(g, p, c_.experts, h);  // the auxiliary losses and load metrics
    out.x = g.add(r, out.x);
    return out;
  }

  mt::CacheSpec cache_spec() const override { return mt::blocks::attention_cache_spec(c_.attn); }

 private:
  FamilyConfig c_;
};

class Model final : public mt::Model {
 public:
  Model(const mt::Config& cfg, bool moe) : c_(cfg, moe) {
    // One layer object per index: a MoE layer names its load metrics after its index.
    for (int i = 0; i < static_cast<int>(c_.layers); ++i) layers_.emplace_back(c_, i);
  }

  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = c_.vocab;
    m.d_model = c_.d;
    m.num_layers = c_.layers;
    m.num_query_heads = c_.attn.heads;
    m.num_kv_heads = c_.attn.kv_heads;
    m.head_dim = c_.attn.head_dim;
    m.mlp_dim = c_.moe ? c_.experts.hidden : c_.mlp.hidden;
    return m;
  }

  // embedding [V, D], final_norm [D], lm_head [D, V] (absent when tied to the embedding)
  std::vector<ParamSpec> top_parameters() const override {
    return mt::blocks::decoder_top_params(c_.vocab, c_.d, c_.norm, c_.tied);
  }
  int num_layers() const override { return static_cast<int>(c_.layers); }
  const mt::DecoderLayer& layer(int i) const override { return layers_.at(static_cast<size_t>(i)); }

  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.embedding(top, "embedding", tokens);
  }
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied);
  }

  HfName hf_name(const std::string& n) const override {
    if (HfName top; mt::hf_causal_lm_top(n, c_.tied, top)) return top;
    std::string index, p;  // "layers.<i>.<param>"
    if (!mt::hf_split_layer(n, index, p)) return {};
    const std::string prefix = "model.layers." + index + ".";
    static const mt::HfNameTable kNames = {{"attn_norm", {"input_layernorm.weight", false}},
                                           {"mlp_norm", {"post_attention_layernorm.weight", false}},
                                           {"wq", {"self_attn.q_proj.weight", true}},
                                           {"wk", {"self_attn.k_proj.weight", true}},
                                           {"wv", {"self_attn.v_proj.weight", true}},
                                           {"wo", {"self_attn.o_proj.weight", true}}};
    if (kNames.count(p)) return mt::hf_from_table(kNames, p, prefix);
    if (c_.moe) {
      // The experts' matrices of a layer, one tensor each ([out, in]), as transformers 5's
      // save_pretrained writes them (and every Mixtral checkpoint on the Hub has them).
      static const std::map<std::string, const char*> kExperts = {
          {"w_gate", ".w1.weight"}, {"w_down", ".w2.weight"}, {"w_up", ".w3.weight"}};
      if (p == "router") return mt::hf_tensor(prefix + "block_sparse_moe.gate.weight", true);
      auto it = kExperts.find(p);
      if (it == kExperts.end()) return {};
      return mt::hf_experts(prefix + "block_sparse_moe.experts.", c_.experts.num_experts,
                            it->second);
    }
    static const mt::HfNameTable kMlp = {{"w_gate", {"mlp.gate_proj.weight", true}},
                                         {"w_up", {"mlp.up_proj.weight", true}},
                                         {"w_down", {"mlp.down_proj.weight", true}}};
    return mt::hf_from_table(kMlp, p, prefix);
  }

 private:
  FamilyConfig c_;
  std::vector<Layer> layers_;
};

class Family final : public mt::ModelFamily {
 public:
  explicit Family(bool moe) : moe_(moe) {}
  std::string name() const override { return moe_ ? "mixtral" : "mistral"; }

  void validate(const mt::Config& c) const override {
    const std::string fam = "the " + name() + " family";
    const int64_t heads = c.get_int("base_num_query_heads");
    const int64_t kv = c.get_int("base_num_kv_heads");
    if (heads % kv != 0)
      c.reject("base_num_kv_heads", "must divide base_num_query_heads=" + std::to_string(heads) +
                                        " (each group of query heads shares one key/value head).");
    // (before: accepted, and mt run stopped on the rope kernel's internal check, exit 1)
    if (c.get_int("head_dim") % 2 != 0)
      c.reject("head_dim", "must be even: the rotary embedding turns pairs of features.");
    if (c.get_string("rope_type") != "default")
      c.reject("rope_type", "must be default for " + fam +
                                " (plain rotary embeddings with theta rope_max_timescale).");
    if (c.get_float("partial_rotary_factor") != 1.0)
      c.reject("partial_rotary_factor", "must be 1 for " + fam + " (every feature is rotated).");
    for (const char* cap : {"attn_logits_soft_cap", "final_logits_soft_cap"})
      if (c.get_float(cap) != 0.0)
        c.reject(cap, "must be 0 for " + fam + ", which has no soft-capping.");
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 2 || acts[0] != "silu" || acts[1] != "linear")
      c.reject("mlp_activations", "must be [silu, linear] for " + fam + " (SwiGLU).");
    const int64_t experts = c.get_int("num_experts");
    if (!moe_) {
      if (experts != 1)
        c.reject("num_experts",
                 "must be 1 for the mistral family (dense MLPs); Mistral's mixture-of-experts "
                 "models are the mixtral family (decoder_block=mixtral).");
      return;
    }
    const int64_t k = c.get_int("num_experts_per_tok");
    if (k > experts)
      c.reject("num_experts_per_tok", "must be at most num_experts=" + std::to_string(experts) +
                                          ": each token is routed to that many distinct "
                                          "experts.");
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<Model>(c, moe_);
  }

  // MistralForCausalLM's / MixtralForCausalLM's config.json -> mt keys. Fields config.json may
  // leave out take transformers' defaults for the class (MistralConfig: sliding_window 4096,
  // rms_norm_eps 1e-6; MixtralConfig: no window, 1e-5, theta 1e6, 8 experts, top 2).
  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override {
    const std::string model = moe_ ? "Mixtral" : "Mistral";
    auto get = [&](const std::string& k) { return mt::hf_get(hf, k); };
    auto need = [&](const std::string& k) -> const std::string& {
      return mt::hf_need(hf, k, model);
    };
    const auto integer = mt::hf_integer;
    if (const std::string* act = get("hidden_act"); act && *act != "silu")
      throw mt::UsageError("config.json's hidden_act is '" + *act + "'; mt's " + name() +
                           " family implements silu (SwiGLU) only.");
    for (const char* k : {"attention_bias", "mlp_bias"})
      if (mt::hf_flag(hf, k, false))
        throw mt::UsageError("config.json sets " + std::string(k) + "=true: " + model +
                             " has no biases, and mt's " + name() +
                             " family does not implement them.");

    std::vector<std::string> o = {"decoder_block=" + name()};
    const std::string& heads = need("num_attention_heads");
    const std::string& hidden = need("hidden_size");
    o.push_back("vocab_size=" + need("vocab_size"));
    o.push_back("base_emb_dim=" + hidden);
    o.push_back("base_mlp_dim=" + need("intermediate_size"));
    o.push_back("base_num_decoder_layers=" + need("num_hidden_layers"));
    o.push_back("base_num_query_heads=" + heads);
    const std::string* kv = get("num_key_value_heads");
    o.push_back("base_num_kv_heads=" + (kv ? *kv : heads));
    if (const std::string* hd = get("head_dim")) {
      o.push_back("head_dim=" + *hd);
    } else {
      o.push_back("head_dim=" + std::to_string(mt::hf_derived_head_dim(hidden, heads)));
    }
    mt::hf_refuse_null(hf, "rms_norm_eps");
    const std::string* eps = get("rms_norm_eps");
    o.push_back("normalization_layer_epsilon=" + (eps ? *eps : moe_ ? "1e-05" : "1e-06"));
    o.push_back(std::string("logits_via_embedding=") +
                (mt::hf_flag(hf, "tie_word_embeddings", false) ? "true" : "false"));
    const std::string* maxpos = get("max_position_embeddings");
    o.push_back("max_position_embeddings=" + (maxpos ? *maxpos : "131072"));

    // The sliding window: a number, null (none), or absent (MistralConfig's default 4096;
    // MixtralConfig's none).
    int64_t window = 0;
    if (auto it = hf.find("sliding_window"); it != hf.end()) {
      if (it->second != "null") {
        window = integer("sliding_window", it->second);
        if (window < 1)
          throw mt::UsageError("config.json's sliding_window is " + it->second +
                               "; it must be a positive number of tokens, or null for none.");
      }
    } else if (!moe_) {
      window = 4096;
    }
    o.push_back("sliding_window_size=" + std::to_string(window));
    // layer_types (a later transformers field) must say what sliding_window says for every layer.
    if (const std::string* lt = get("layer_types")) {
      const char* other = window > 0 ? "full_attention" : "sliding_attention";
      if (lt->find(other) != std::string::npos)
        throw mt::UsageError("config.json's layer_types " + *lt + " mixes attention kinds; mt's " +
                             name() + " family gives every layer the same attention (" +
                             (window > 0 ? "sliding_window=" + std::to_string(window)
                                         : std::string("no sliding window")) +
                             ").");
    }

    // Rotary embeddings: transformers 5 writes rope_parameters {rope_theta, rope_type};
    // earlier versions a top-level rope_theta beside rope_scaling (null). Only the default kind.
    const bool v5 = std::any_of(hf.begin(), hf.end(), [](const auto& e) {
      return e.first.rfind("rope_parameters.", 0) == 0;
    });
    const std::string rp = v5 ? "rope_parameters." : "rope_scaling.";
    const std::string* theta = get(v5 ? "rope_parameters.rope_theta" : "rope_theta");
    if (!theta && v5) theta = get("rope_theta");
    o.push_back("rope_max_timescale=" + (theta ? *theta : moe_ ? "1000000.0" : "10000.0"));
    for (const auto& [k, v] : hf) {
      if (k.rfind(rp, 0) != 0 || v == "null") continue;
      const std::string field = k.substr(rp.size());
      if (field == "rope_theta") continue;
      if ((field == "rope_type" || field == "type") && v == "default") continue;
      throw mt::UsageError("config.json sets " + k + "=" + v +
                           ", which changes the rotary embedding in a way mt's " + name() +
                           " family does not implement (it has default rotary embeddings "
                           "only).");
    }
    if (v5 && get("rope_scaling"))
      throw mt::UsageError(
          "config.json has both rope_parameters and rope_scaling: which one transformers would "
          "use is ambiguous; keep one.");

    if (moe_) {
      const std::string* e = get("num_local_experts");
      if (!e) e = get("num_experts");
      const std::string experts = e ? *e : "8";
      const std::string* k = get("num_experts_per_tok");
      const std::string top = k ? *k : "2";
      if (integer("num_experts_per_tok", top) > integer("num_local_experts", experts))
        throw mt::UsageError("config.json's num_experts_per_tok=" + top +
                             " is more than num_local_experts=" + experts +
                             ": each token is routed to that many distinct experts.");
      o.push_back("num_experts=" + experts);
      o.push_back("num_experts_per_tok=" + top);
      o.push_back("norm_topk_prob=true");  // MixtralSparseMoeBlock renormalises the top k
      // Fine-tuning keeps the directory's load-balancing weight (before: base.yml's 0.01 for
      // Mixtral's 0.001), as the qwen3_moe import does.
      if (const std::string* c = get("router_aux_loss_coef"))
        o.push_back("load_balance_loss_weight=" + *c);
      if (const std::string* j = get("router_jitter_noise");
          j && mt::hf_number("router_jitter_noise", *j) != 0.0)
        throw mt::UsageError("config.json sets router_jitter_noise=" + *j +
                             ": mt's mixtral family does not implement router jitter (noise on "
                             "the router's inputs in training).");
    }

    // Fields that change the computation of other models and that this family does not
    // implement: refused with their name, never ignored.
    std::vector<std::string> numerics = {"attn_logit_softcapping",
                                         "final_logit_softcapping",
                                         "logits_scaling",
                                         "logit_scale",
                                         "embedding_multiplier",
                                         "residual_multiplier",
                                         "attention_multiplier",
                                         "qk_layernorm",
                                         "use_qk_norm",
                                         "query_pre_attn_scalar",
                                         "moe_intermediate_size",
                                         "shared_expert_intermediate_size",
                                         "n_shared_experts",
                                         "kv_lora_rank",
                                         "q_lora_rank",
                                         "use_sliding_window",
                                         "no_rope_layers",
                                         "partial_rotary_factor"};
    if (!moe_)
      for (const char* k : {"num_local_experts", "num_experts", "num_experts_per_tok"})
        numerics.push_back(k);
    for (const auto& k : numerics) {
      const std::string* v = get(k);
      if (!v || *v == "false" || *v == "0") continue;
      throw mt::UsageError("config.json sets " + k + "=" + *v +
                           ", which changes the computation in a way mt's " + name() +
                           " family does not implement; the logits would be wrong. Is this a " +
                           model + " model?");
    }
    // Fields that only describe training, tooling or generation, and never change the logits.
    static const char* const kIgnorable[] = {"architectures",
                                             "model_type",
                                             "torch_dtype",
                                             "dtype",
                                             "transformers_version",
                                             "use_cache",
                                             "initializer_range",
                                             "attention_dropout",
                                             "bos_token_id",
                                             "eos_token_id",
                                             "pad_token_id",
                                             "attention_bias",
                                             "mlp_bias",
                                             "hidden_act",
                                             "tie_word_embeddings",
                                             "_name_or_path",
                                             "output_attentions",
                                             "output_hidden_states",
                                             "return_dict",
                                             "sliding_window",
                                             "layer_types",
                                             "output_router_logits",
                                             "router_aux_loss_coef",
                                             "router_jitter_noise"};
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
      for (const auto& n : numerics) known = known || k == n;
      if (moe_)
        known =
            known || k == "num_local_experts" || k == "num_experts" || k == "num_experts_per_tok";
      if (!known) unused.push_back(k + "=" + v);
    }
    return o;
  }

  // config.json in the form both transformers 4 and 5 read (top-level rope_theta).
  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override {
    validate(cfg);
    const FamilyConfig c(cfg, moe_);
    std::map<std::string, std::string> m = {
        {"architectures", moe_ ? "[\"MixtralForCausalLM\"]" : "[\"MistralForCausalLM\"]"},
        {"model_type", "\"" + name() + "\""},
        {"vocab_size", std::to_string(c.vocab)},
        {"hidden_size", std::to_string(c.d)},
        {"intermediate_size", std::to_string(moe_ ? c.experts.hidden : c.mlp.hidden)},
        {"num_hidden_layers", std::to_string(c.layers)},
        {"num_attention_heads", std::to_string(c.attn.heads)},
        {"num_key_value_heads", std::to_string(c.attn.kv_heads)},
        {"head_dim", std::to_string(c.attn.head_dim)},
        {"hidden_act", "\"silu\""},
        // From the config's doubles: c's floats would print 1e-5 as 9.99999975e-06.
        {"rms_norm_eps", mt::hf_json_number(cfg.get_float("normalization_layer_epsilon"))},
        {"rope_theta", mt::hf_json_number(cfg.get_float("rope_max_timescale"))},
        {"rope_scaling", "null"},
        {"sliding_window", c.attn.attn.window > 0 ? std::to_string(c.attn.attn.window) : "null"},
        {"tie_word_embeddings", c.tied ? "true" : "false"},
        {"torch_dtype",
         cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""},
        {"max_position_embeddings", std::to_string(cfg.get_int("max_position_embeddings") > 0
                                                       ? cfg.get_int("max_position_embeddings")
                                                       : cfg.get_int("max_target_length"))}};
    if (moe_) {
      if (!c.experts.normalize_topk)
        throw mt::UsageError(
            "norm_topk_prob=false cannot be written as a Hugging Face Mixtral model: "
            "MixtralForCausalLM always renormalises the top-k routing weights.");
      m["num_local_experts"] = std::to_string(c.experts.num_experts);
      m["num_experts_per_tok"] = std::to_string(c.experts.top_k);
      m["router_aux_loss_coef"] = mt::hf_json_number(cfg.get_float("load_balance_loss_weight"));
      m["output_router_logits"] = "false";
      m["router_jitter_noise"] = "0.0";
    }
    return m;
  }

 private:
  bool moe_;
};

}  // namespace

void register_family(mt::Registry& r, bool moe) {
  r.add_model_family(moe ? "mixtral" : "mistral", [moe] { return std::make_unique<Family>(moe); });
}

}  // namespace mt_mistral
