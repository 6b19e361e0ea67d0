// The Qwen families, one implementation with switches (as MaxText composes shared blocks):
//   qwen2      Qwen2 / Qwen2.5: Llama's layer with biases on the q, k and v projections.
//   qwen3      Qwen3 dense: no biases, a per-head RMSNorm on q and on k before the rotary
//              embedding, head_dim set on its own (not d_model / heads), tied embeddings for the
//              small ones, rope theta 1e6.
//   qwen3_moe  Qwen3-MoE: qwen3's attention; the MLP of a layer is a mixture of experts (softmax
//              router, top-k, norm_topk_prob, dropless: blocks::moe) or, for the layers that
//              Hugging Face's mlp_only_layers and decoder_sparse_step leave dense, a SwiGLU MLP.
// Every layer is pre-norm: x + attention(norm(x)), then + mlp(norm(.)). Written against the
// SDK only; each family name is its own plugin file (plugin_<name>.cpp) over this code.
#include "qwen.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/hf.h"
#include "mt/model.h"

namespace mt_qwen {

namespace {

using mt::Activation;
using mt::ParamSpec;
using mt::Tensor;

enum class Variant { qwen2, qwen3, qwen3_moe };

Variant variant_of(const std::string& name) {
  if (name == "qwen2") return Variant::qwen2;
  if (name == "qwen3") return Variant::qwen3;
  if (name == "qwen3_moe") return Variant::qwen3_moe;
  throw mt::Error("mt_qwen: no Qwen family named '" + name + "'");
}

// qwen3_moe's own config keys (ModelFamily::config_schema): Hugging Face's two switches of
// which layers are mixtures of experts. The keys every MoE family shares (num_experts,
// num_experts_per_tok, base_moe_mlp_dim, norm_topk_prob, capacity_factor,
// load_balance_loss_weight, moe_z_loss_weight) are base.yml's.
constexpr const char* kMoeSchema =
    "qwen3_moe_decoder_sparse_step: 1  # layer i is a mixture of experts when (i + 1) is a "
    "multiple of this and i is not in qwen3_moe_mlp_only_layers, else a dense MLP of "
    "base_mlp_dim (Hugging Face's decoder_sparse_step) [>0]\n"
    "qwen3_moe_mlp_only_layers: []  # indices of layers with a dense MLP instead of experts "
    "(Hugging Face's mlp_only_layers)\n";

// The indices of qwen3_moe_mlp_only_layers, refused by name when one is not a layer index.
std::set<int64_t> mlp_only_layers(const mt::Config& c) {
  std::set<int64_t> r;
  const int64_t layers = c.get_int("base_num_decoder_layers");
  for (const std::string& s : c.get_string_list("qwen3_moe_mlp_only_layers")) {
    int64_t v = -1;
    const auto res = std::from_chars(s.data(), s.data() + s.size(), v);
    if (res.ec != std::errc() || res.ptr != s.data() + s.size() || v < 0 || v >= layers)
      c.reject("qwen3_moe_mlp_only_layers",
               "must list layer indices from 0 to base_num_decoder_layers - 1 = " +
                   std::to_string(layers - 1) + "; '" + s + "' is not one.");
    r.insert(v);
  }
  return r;
}

struct QwenConfig {
  Variant variant = Variant::qwen3;
  int64_t vocab = 0, d = 0, layers = 0;
  bool tied = false;
  mt::blocks::NormSpec norm;
  mt::blocks::AttentionBlockSpec attn;
  mt::blocks::MlpSpec mlp;   // the dense layers' MLP
  mt::blocks::MoeSpec moe;   // qwen3_moe's expert layers
  std::vector<bool> sparse;  // per layer: a mixture of experts (qwen3_moe only)

  QwenConfig(const mt::Config& c, Variant v) : variant(v) {
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
    attn.qkv_bias = v == Variant::qwen2;
    // Qwen3: RMSNorm over each head's head_dim features of q and of k, before the rotary
    // embedding, with the model's epsilon.
    attn.qk_norm = v != Variant::qwen2;
    attn.qk_norm_spec = norm;
    mt::RopeSpec& rope = attn.rope;
    mt::blocks::rope_scaling_from_config(c, rope);
    rope.theta = static_cast<float>(c.get_float("rope_max_timescale"));
    rope.rotary_dim = static_cast<int>(attn.head_dim);
    attn.attn.causal = true;
    attn.attn.scale = 1.f / std::sqrt(static_cast<float>(attn.head_dim));

    mlp.d_model = d;
    mlp.hidden = c.get_int("base_mlp_dim");
    mlp.act = Activation::silu;
    mlp.gated = true;  // SwiGLU

    sparse.assign(static_cast<size_t>(layers), false);
    if (v == Variant::qwen3_moe) {
      moe.d_model = d;
      moe.hidden = c.get_int("base_moe_mlp_dim") > 0 ? c.get_int("base_moe_mlp_dim") : mlp.hidden;
      moe.num_experts = c.get_int("num_experts");
      moe.top_k = c.get_int("num_experts_per_tok");
      moe.act = Activation::silu;
      moe.gated = true;
      moe.normalize_topk = c.get_bool("norm_topk_prob");
      moe.load_balance_weight = static_cast<float>(c.get_float("load_balance_loss_weight"));
      moe.z_loss_weight = static_cast<float>(c.get_float("moe_z_loss_weight"));
      moe.capacity_factor = static_cast<float>(c.get_float("capacity_factor"));
      const int64_t step = c.get_int("qwen3_moe_decoder_sparse_step");
      const std::set<int64_t> dense = mlp_only_layers(c);
      for (int64_t i = 0; i < layers; ++i)
        sparse[static_cast<size_t>(i)] = !dense.count(i) && (i + 1) % step == 0;
    }
  }
};

// A pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(.)) or + moe(norm(.)).
class QwenLayer final : public mt::DecoderLayer {
 public:
  // `index` names an MoE layer's expert-load metrics ("moe_load_max/<index>").
  QwenLayer(const QwenConfig& c, bool sparse, int index) : c_(c), sparse_(sparse) {
    c_.moe.layer = index;
  }

  std::vector<ParamSpec> parameters() const override {
    std::vector<ParamSpec> r = mt::blocks::norm_params("attn_norm", c_.d, c_.norm);
    for (auto& p : mt::blocks::attention_params(c_.attn)) r.push_back(p);
    for (auto& p : mt::blocks::norm_params("mlp_norm", c_.d, c_.norm)) r.push_back(p);
    for (auto& p : sparse_ ? mt::blocks::moe_params(c_.moe) : mt::blocks::mlp_params(c_.mlp))
      r.push_back(p);
    return r;
  }

  // x [B, T, D] -> [B, T, D] (and the MoE's auxiliary losses)
  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    using namespace mt::blocks;
    Tensor r = g.add(x, attention(g, p, c_.attn, norm(g, p, "attn_norm", x, c_.norm), in));
    Tensor h = norm(g, p, "mlp_norm", r, c_.norm);
    if (!sparse_) return g.add(r, mlp(g, p, c_.mlp, h));
    mt::LayerOutput o = moe(g, p, c_.moe, h);
    o.x = g.add(r, o.x);
    return o;
  }

  mt::CacheSpec cache_spec() const override { return mt::blocks::attention_cache_spec(c_.attn); }

 private:
  QwenConfig c_;
  bool sparse_;
};

class QwenModel final : public mt::Model {
 public:
  QwenModel(const mt::Config& cfg, Variant v) : c_(cfg, v) {
    for (int64_t i = 0; i < c_.layers; ++i)
      layers_.push_back(
          std::make_unique<QwenLayer>(c_, c_.sparse[static_cast<size_t>(i)], static_cast<int>(i)));
  }

  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = c_.vocab;
    m.d_model = c_.d;
    m.num_layers = c_.layers;
    m.num_query_heads = c_.attn.heads;
    m.num_kv_heads = c_.attn.kv_heads;
    m.head_dim = c_.attn.head_dim;
    // The widest MLP activation per token: a dense layer's, or top_k experts' of an MoE layer.
    int64_t widest = 0;
    for (const bool s : c_.sparse)
      widest = std::max(widest, s ? c_.moe.top_k * c_.moe.hidden : c_.mlp.hidden);
    m.mlp_dim = widest;
    return m;
  }

  // embedding [V, D], final_norm [D], lm_head [D, V] (absent when tied to the embedding)
  std::vector<ParamSpec> top_parameters() const override {
    return mt::blocks::decoder_top_params(c_.vocab, c_.d, c_.norm, c_.tied);
  }
  int num_layers() const override { return static_cast<int>(c_.layers); }
  const mt::DecoderLayer& layer(int i) const override {
    return *layers_.at(static_cast<size_t>(i));
  }

  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.embedding(top, "embedding", tokens);
  }
  // hidden [B, T, D] -> logits [B, T, V]
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied);
  }

  // Hugging Face's names (Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM). An expert
  // weight [E, in, out] is the stack of the E per-expert Linear weights
  // mlp.experts.<e>.<proj>.weight [out, in], the layout save_pretrained writes by default.
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
                                           {"wo", {"self_attn.o_proj.weight", true}},
                                           {"bq", {"self_attn.q_proj.bias", false}},
                                           {"bk", {"self_attn.k_proj.bias", false}},
                                           {"bv", {"self_attn.v_proj.bias", false}},
                                           {"q_norm", {"self_attn.q_norm.weight", false}},
                                           {"k_norm", {"self_attn.k_norm.weight", false}}};
    if (kNames.count(p)) return mt::hf_from_table(kNames, p, prefix);
    const int64_t i = mt::hf_layer_number(index);
    if (i < 0 || i >= c_.layers) return {};
    const std::string proj = p == "w_gate" ? "gate_proj" : p == "w_up" ? "up_proj" : "down_proj";
    if (p != "w_gate" && p != "w_up" && p != "w_down" && p != "router") return {};
    if (!c_.sparse[static_cast<size_t>(i)])
      return p == "router" ? HfName{} : mt::hf_tensor(prefix + "mlp." + proj + ".weight", true);
    if (p == "router") return mt::hf_tensor(prefix + "mlp.gate.weight", true);  // [E, D]
    return mt::hf_experts(prefix + "mlp.experts.", c_.moe.num_experts, "." + proj + ".weight");
  }

 private:
  QwenConfig c_;
  std::vector<std::unique_ptr<QwenLayer>> layers_;
};

// ---- config.json ------------------------------------------------------------------------------

struct HfNames {
  const char* model_type;
  const char* architecture;
  const char* display;
};

HfNames hf_names(Variant v) {
  switch (v) {
    case Variant::qwen2:
      return {"qwen2", "Qwen2ForCausalLM", "Qwen2"};
    case Variant::qwen3:
      return {"qwen3", "Qwen3ForCausalLM", "Qwen3"};
    case Variant::qwen3_moe:
      return {"qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE"};
  }
  return {"", "", ""};
}

class QwenFamily final : public mt::ModelFamily {
 public:
  explicit QwenFamily(std::string name) : name_(std::move(name)), v_(variant_of(name_)) {}

  std::string name() const override { return name_; }

  std::string config_schema() const override { return v_ == Variant::qwen3_moe ? kMoeSchema : ""; }

  void validate(const mt::Config& c) const override {
    const std::string fam = "the " + name_ + " family";
    const int64_t heads = c.get_int("base_num_query_heads");
    const int64_t kv = c.get_int("base_num_kv_heads");
    if (heads % kv != 0)
      c.reject("base_num_kv_heads", "must divide base_num_query_heads=" + std::to_string(heads) +
                                        " (each group of query heads shares one key/value head).");
    if (c.get_int("head_dim") % 2 != 0)
      c.reject("head_dim", "must be even: the rotary embedding turns pairs of features.");
    if (c.get_float("partial_rotary_factor") != 1.0)
      c.reject("partial_rotary_factor",
               "must be 1.0 for " + fam + ": Qwen rotates every feature of each head.");
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 2 || acts[0] != "silu" || acts[1] != "linear")
      c.reject("mlp_activations", "must be [silu, linear] for " + fam + " (SwiGLU).");
    for (const char* k : {"attn_logits_soft_cap", "final_logits_soft_cap"})
      if (c.get_float(k) != 0.0)
        c.reject(k, "must be 0.0 for " + fam + ": Qwen models have no soft-capping.");
    if (c.get_int("sliding_window_size") != 0)
      c.reject("sliding_window_size",
               "must be 0 for " + fam +
                   ": mt implements Qwen's full causal attention only (Hugging Face's "
                   "use_sliding_window=false, which every released Qwen model uses).");
    const int64_t experts = c.get_int("num_experts");
    const int64_t k = c.get_int("num_experts_per_tok");
    if (v_ != Variant::qwen3_moe) {
      if (experts != 1)
        c.reject("num_experts", "must be 1 for " + fam +
                                    " (dense MLPs); the mixture-of-experts Qwen3 models are "
                                    "the qwen3_moe family.");
      return;
    }
    if (k > experts)
      c.reject("num_experts_per_tok", "must be at most num_experts=" + std::to_string(experts) +
                                          ": each token is routed to that many distinct "
                                          "experts.");
    (void)mlp_only_layers(c);
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<QwenModel>(c, v_);
  }

  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override;
  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override;

 private:
  std::string name_;
  Variant v_;
};

std::vector<std::string> QwenFamily::from_hf_config(const mt::HfConfig& hf,
                                                    std::vector<std::string>& unused) const {
  const HfNames names = hf_names(v_);
  const std::string who = std::string("mt's ") + name_ + " family";
  auto get = [&](const std::string& k) { return mt::hf_get(hf, k); };
  auto need = [&](const std::string& k) -> const std::string& {
    return mt::hf_need(hf, k, names.display);
  };
  auto refuse = [&](const std::string& k, const std::string& v, const std::string& what) {
    mt::hf_refuse(k, v, what, who);
  };
  std::set<std::string> used;  // fields read (or known not to change the logits)
  auto use = [&](const std::string& k) {
    used.insert(k);
    return get(k);
  };

  if (const std::string* act = use("hidden_act"); act && *act != "silu")
    refuse("hidden_act", *act, "an MLP activation other than silu (SwiGLU)");
  if (used.insert("attention_bias"),
      mt::hf_flag(hf, "attention_bias", false) && v_ != Variant::qwen2)
    refuse("attention_bias", "true", "biases on the attention projections");
  // Sliding-window attention: off in every released Qwen model (use_sliding_window=false, and
  // then transformers ignores sliding_window and max_window_layers).
  // With max_window_layers at or above the layer count no layer slides (transformers' layer i
  // slides when i >= max_window_layers), so that is plain attention and is taken.
  if (used.insert("use_sliding_window"), mt::hf_flag(hf, "use_sliding_window", false)) {
    const std::string* mwl = get("max_window_layers");
    const std::string* layers = get("num_hidden_layers");
    if (!mwl || !layers || *mwl == "null" ||
        mt::hf_integer("max_window_layers", *mwl) < mt::hf_integer("num_hidden_layers", *layers))
      refuse("use_sliding_window", "true", "sliding-window attention");
  }
  if (const std::string* lt = use("layer_types"); lt && lt->find("sliding") != std::string::npos)
    refuse("layer_types", *lt, "sliding-window attention layers");
  use("sliding_window");
  use("max_window_layers");

  std::vector<std::string> o = {"decoder_block=" + name_};
  const std::string& heads = need("num_attention_heads");
  const std::string& hidden = need("hidden_size");
  o.push_back("vocab_size=" + need("vocab_size"));
  o.push_back("base_emb_dim=" + hidden);
  o.push_back("base_mlp_dim=" + need("intermediate_size"));
  o.push_back("base_num_decoder_layers=" + need("num_hidden_layers"));
  o.push_back("base_num_query_heads=" + heads);
  const std::string* kv = get("num_key_value_heads");
  o.push_back("base_num_kv_heads=" + (kv ? *kv : heads));
  // head_dim: Qwen3Config's default is 128; Qwen2 and Qwen3-MoE use hidden_size / heads.
  const std::string* hd = get("head_dim");
  if (hd) {
    o.push_back("head_dim=" + *hd);
  } else if (v_ == Variant::qwen3) {
    o.push_back("head_dim=128");
  } else {
    o.push_back("head_dim=" + std::to_string(mt::hf_derived_head_dim(hidden, heads)));
  }
  // Qwen's defaults where config.json leaves a field out (they differ from base.yml's).
  mt::hf_refuse_null(hf, "rms_norm_eps");
  const std::string* eps = get("rms_norm_eps");
  o.push_back("normalization_layer_epsilon=" + (eps ? *eps : std::string("1e-06")));
  o.push_back(std::string("logits_via_embedding=") +
              (mt::hf_flag(hf, "tie_word_embeddings", false) ? "true" : "false"));
  if (const std::string* v = get("max_position_embeddings"))
    o.push_back("max_position_embeddings=" + *v);
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings"})
    used.insert(k);

  // Rotary embedding: transformers 5 writes rope_parameters {rope_theta, rope_type, ...};
  // earlier versions a top-level rope_theta beside rope_scaling (null for plain rope).
  const bool v5 = std::any_of(hf.begin(), hf.end(), [](const auto& e) {
    return e.first.rfind("rope_parameters.", 0) == 0;
  });
  if (v5 && get("rope_scaling"))
    throw mt::UsageError(
        "config.json has both rope_parameters and rope_scaling: which one transformers would "
        "use is ambiguous; keep one.");
  const std::string rp = v5 ? "rope_parameters." : "rope_scaling.";
  const std::string* theta = get(v5 ? "rope_parameters.rope_theta" : "rope_theta");
  if (!theta) theta = get("rope_theta");
  // transformers' default theta when config.json has none.
  o.push_back("rope_max_timescale=" + (theta ? *theta : std::string("10000.0")));
  const std::string* rt = get(rp + "rope_type");
  if (!rt) rt = get(rp + "type");
  std::vector<std::string> rope_fields = {"rope_type", "type", "rope_theta"};
  if (rt && *rt == "yarn") {
    o.push_back("rope_type=yarn");
    o.push_back("rope_factor=" + need(rp + "factor"));
    if (const std::string* v = get(rp + "beta_fast")) o.push_back("beta_fast=" + *v);
    if (const std::string* v = get(rp + "beta_slow")) o.push_back("beta_slow=" + *v);
    // The context yarn extends; absent, transformers takes max_position_embeddings
    // (standardize_rope_params), not base.yml's 8192.
    const std::string* orig = get(rp + "original_max_position_embeddings");
    if (!orig || *orig == "null") orig = get("original_max_position_embeddings");
    if (!orig || *orig == "null") orig = get("max_position_embeddings");
    if (!orig || *orig == "null")
      throw mt::UsageError(
          "config.json's yarn rotary embedding has neither original_max_position_embeddings "
          "nor max_position_embeddings: the context it extends is unknown.");
    o.push_back("original_max_position_embeddings=" + *orig);
    for (const char* f : {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings"})
      rope_fields.push_back(f);
  } else if (rt && *rt != "default") {
    refuse(rp + "rope_type", *rt, "a rotary embedding type other than default and yarn");
  }
  for (const auto& [k, v] : hf) {
    if (k.rfind(rp, 0) != 0 || v == "null") continue;
    if (std::find(rope_fields.begin(), rope_fields.end(), k.substr(rp.size())) == rope_fields.end())
      refuse(k, v,
             "a rotary embedding setting" + (rt ? " of rope type '" + *rt + "'" : std::string()));
  }
  if (const std::string* prf = get("partial_rotary_factor");
      prf && mt::hf_number("partial_rotary_factor", *prf) != 1.0)
    refuse("partial_rotary_factor", *prf, "a rotary embedding of part of each head");

  // Mixture of experts. transformers 5 writes Qwen3-MoE's num_experts under its alias
  // num_local_experts; Qwen's own config.json files (transformers 4) write num_experts.
  const std::string* ne = get("num_experts");
  const std::string* nle = get("num_local_experts");
  used.insert("num_experts");
  used.insert("num_local_experts");
  if (v_ == Variant::qwen3_moe) {
    if (ne && nle && *ne != *nle)
      throw mt::UsageError("config.json sets num_experts=" + *ne + " and num_local_experts=" +
                           *nle + ", two names of one setting that disagree; keep one.");
    const std::string& experts = ne ? *ne : nle ? *nle : need("num_experts");
    if (experts == "0")
      throw mt::UsageError(
          "config.json sets num_experts=0 (every layer a dense MLP), which mt's qwen3_moe "
          "family does not implement; such a model is a Qwen3 model (model_type qwen3).");
    o.push_back("num_experts=" + experts);
    o.push_back("num_experts_per_tok=" + need("num_experts_per_tok"));
    o.push_back("base_moe_mlp_dim=" + need("moe_intermediate_size"));
    // transformers' defaults: norm_topk_prob false, decoder_sparse_step 1, no dense layers.
    o.push_back(std::string("norm_topk_prob=") +
                (mt::hf_flag(hf, "norm_topk_prob", false) ? "true" : "false"));
    const std::string* step = get("decoder_sparse_step");
    if (step && (step->empty() || step->find_first_not_of("0123456789") != std::string::npos ||
                 std::stoll(*step) < 1))
      refuse("decoder_sparse_step", *step,
             "a sparse step that is not a positive integer (transformers divides by it)");
    o.push_back("qwen3_moe_decoder_sparse_step=" + (step ? *step : std::string("1")));
    std::string only = "[]";
    if (const std::string* m = get("mlp_only_layers")) {
      only = *m;
      only.erase(std::remove(only.begin(), only.end(), ' '), only.end());
    }
    o.push_back("qwen3_moe_mlp_only_layers=" + only);
    if (const std::string* c = get("router_aux_loss_coef"))
      o.push_back("load_balance_loss_weight=" + *c);
    for (const char* k :
         {"num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
          "mlp_only_layers", "router_aux_loss_coef", "output_router_logits"})
      used.insert(k);
  } else if ((ne && *ne != "0" && *ne != "1") || (nle && *nle != "0" && *nle != "1")) {
    refuse(ne ? "num_experts" : "num_local_experts", ne ? *ne : *nle,
           "a mixture of experts (a Qwen3-MoE model has model_type qwen3_moe)");
  }

  // Fields that change the computation in other families (or Qwen variants) and that this
  // family does not implement: refused with their name, never ignored.
  static const char* const kNumerics[] = {"attn_logit_softcapping",
                                          "final_logit_softcapping",
                                          "logits_scaling",
                                          "logit_scale",
                                          "embedding_multiplier",
                                          "residual_multiplier",
                                          "attention_multiplier",
                                          "query_pre_attn_scalar",
                                          "kv_lora_rank",
                                          "q_lora_rank",
                                          "shared_expert_intermediate_size",
                                          "no_rope_layers",
                                          "mlp_bias",
                                          "qk_layernorm",
                                          "use_qk_norm"};
  for (const char* k : kNumerics) {
    const std::string* v = get(k);
    used.insert(k);
    if (!v || *v == "false" || *v == "0" || *v == "0.0" || *v == "[]") continue;
    refuse(k, *v, "a setting of another architecture");
  }
  // Fields that only describe training, tooling or generation and never change the logits.
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
                                           "_name_or_path",
                                           "output_attentions",
                                           "output_hidden_states",
                                           "return_dict",
                                           "rope_theta",
                                           "use_mrope",
                                           "pretraining_tp"};
  for (const char* k : kIgnorable) used.insert(k);
  for (const auto& [k, v] : hf) {
    const bool rope = k.rfind("rope_scaling", 0) == 0 || k.rfind("rope_parameters", 0) == 0;
    if (!rope && !used.count(k)) unused.push_back(k + "=" + v);
  }
  return o;
}

std::map<std::string, std::string> QwenFamily::to_hf_config(const mt::Config& cfg) const {
  const QwenConfig c(cfg, v_);
  const HfNames names = hf_names(v_);
  // The form Qwen's released config.json files have (transformers 4.51: top-level rope_theta,
  // rope_scaling, torch_dtype); transformers 5 reads it to the same model.
  std::map<std::string, std::string> m = {
      {"architectures", std::string("[\"") + names.architecture + "\"]"},
      {"model_type", std::string("\"") + names.model_type + "\""},
      {"vocab_size", std::to_string(c.vocab)},
      {"hidden_size", std::to_string(c.d)},
      {"intermediate_size", std::to_string(c.mlp.hidden)},
      {"num_hidden_layers", std::to_string(c.layers)},
      {"num_attention_heads", std::to_string(c.attn.heads)},
      {"num_key_value_heads", std::to_string(c.attn.kv_heads)},
      {"head_dim", std::to_string(c.attn.head_dim)},
      {"hidden_act", "\"silu\""},
      // From the config's doubles: c's floats would print 1e-6 as 9.99999997e-07.
      {"rms_norm_eps", mt::hf_json_number(cfg.get_float("normalization_layer_epsilon"))},
      {"rope_theta", mt::hf_json_number(cfg.get_float("rope_max_timescale"))},
      {"tie_word_embeddings", c.tied ? "true" : "false"},
      {"use_sliding_window", "false"},
      {"sliding_window", "null"},
      {"max_window_layers", std::to_string(c.layers)},
      {"attention_dropout", "0.0"},
      {"torch_dtype",
       cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""},
      {"max_position_embeddings", std::to_string(cfg.get_int("max_position_embeddings") > 0
                                                     ? cfg.get_int("max_position_embeddings")
                                                     : cfg.get_int("max_target_length"))}};
  if (v_ != Variant::qwen2) m["attention_bias"] = "false";
  if (c.attn.rope.type == mt::RopeSpec::Type::yarn) {
    m["rope_scaling.rope_type"] = "\"yarn\"";
    m["rope_scaling.factor"] = mt::hf_json_number(cfg.get_float("rope_factor"));
    m["rope_scaling.beta_fast"] = mt::hf_json_number(cfg.get_float("beta_fast"));
    m["rope_scaling.beta_slow"] = mt::hf_json_number(cfg.get_float("beta_slow"));
    m["rope_scaling.original_max_position_embeddings"] =
        std::to_string(c.attn.rope.original_max_position);
  } else if (c.attn.rope.type == mt::RopeSpec::Type::llama3) {
    throw mt::UsageError("rope_type=llama3.1 has no Qwen config.json form; the " + name_ +
                         " family exports default and yarn rotary embeddings.");
  } else {
    m["rope_scaling"] = "null";
  }
  if (v_ == Variant::qwen3_moe) {
    m["num_experts"] = std::to_string(c.moe.num_experts);
    m["num_experts_per_tok"] = std::to_string(c.moe.top_k);
    m["moe_intermediate_size"] = std::to_string(c.moe.hidden);
    m["norm_topk_prob"] = c.moe.normalize_topk ? "true" : "false";
    m["decoder_sparse_step"] = std::to_string(cfg.get_int("qwen3_moe_decoder_sparse_step"));
    std::string only = "[";
    for (const int64_t i : mlp_only_layers(cfg)) {
      if (only.size() > 1) only += ", ";
      only += std::to_string(i);
    }
    m["mlp_only_layers"] = only + "]";
    m["router_aux_loss_coef"] = mt::hf_json_number(cfg.get_float("load_balance_loss_weight"));
    m["output_router_logits"] = "false";
  }
  return m;
}

}  // namespace

void register_qwen_family(mt::Registry& r, const std::string& name) {
  (void)variant_of(name);
  r.add_model_family(name, [name] { return std::make_unique<QwenFamily>(name); });
}

}  // namespace mt_qwen
