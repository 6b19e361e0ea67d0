// The GPT families, one implementation (as MaxText composes shared blocks):
//   gpt2  GPT-2 (Hugging Face's GPT2LMHeadModel; llm.c's model): pre-norm layers with LayerNorm
//         and its bias, learned absolute position embeddings added to the token embeddings (no
//         rotary embedding), multi-head attention with biases on the q/k/v and output
//         projections, a plain MLP (c_fc, gelu, c_proj) with biases, a final LayerNorm and the
//         LM head tied to the token embedding.
//   gpt3  MaxText's gpt3 decoder block: the same computation (MaxText's Gpt3LayerNorm stores
//         its scale as 1 + w with w starting at 0; here the scale itself is stored, starting at
//         1, which is the same function of the input, and AdamW without decay on norms takes the
//         same steps on either), position table trainable_position_size rows, mlp_activations
//         [gelu] = jax's tanh-approximate gelu. Hugging Face has no GPT-3 class: export writes a
//         GPT2LMHeadModel directory, which reads back as the gpt2 family.
// Every layer is x + attention(ln_1(x)), then + mlp(ln_2(.)). Written against the SDK only;
// each family name is its own plugin file (plugin_<name>.cpp) over this code.
#include "gpt.h"

#include <algorithm>
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

namespace mt_gpt {

namespace {

using mt::Activation;
using mt::ParamSpec;
using mt::Tensor;

// mlp_activations (a one-element list for a plain MLP) -> the activation. "gelu" is jax's
// nn.gelu (approximate=True, MaxText's gpt3) = Hugging Face's gelu_new (GPT-2's).
bool activation_of(const std::string& name, Activation& out) {
  if (name == "gelu")
    out = Activation::gelu_tanh;
  else if (name == "gelu_exact")
    out = Activation::gelu_exact;
  else if (name == "relu")
    out = Activation::relu;
  else if (name == "silu")
    out = Activation::silu;
  else
    return false;
  return true;
}

struct GptConfig {
  int64_t vocab = 0, d = 0, layers = 0, positions = 0;
  bool tied = true;
  mt::blocks::NormSpec norm;
  mt::blocks::AttentionBlockSpec attn;
  mt::blocks::MlpSpec mlp;

  explicit GptConfig(const mt::Config& c) {
    vocab = c.get_int("vocab_size");
    d = c.get_int("base_emb_dim");
    layers = c.get_int("base_num_decoder_layers");
    positions = c.get_int("trainable_position_size");
    tied = c.get_bool("logits_via_embedding");
    norm.kind = mt::blocks::NormKind::layer;
    norm.eps = static_cast<float>(c.get_float("normalization_layer_epsilon"));

    attn.d_model = d;
    attn.heads = c.get_int("base_num_query_heads");
    attn.kv_heads = attn.heads;
    attn.head_dim = c.get_int("head_dim");
    attn.qkv_bias = true;
    attn.out_bias = true;
    attn.use_rope = false;  // positions are the learned table's
    attn.attn.causal = true;
    attn.attn.scale = 1.f / std::sqrt(static_cast<float>(attn.head_dim));

    mlp.d_model = d;
    mlp.hidden = c.get_int("base_mlp_dim");
    mlp.gated = false;
    mlp.bias = true;
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 1 || !activation_of(acts[0], mlp.act)) mlp.act = Activation::gelu_tanh;
  }
};

// A pre-norm GPT layer: x + attention(ln_1(x)), then + mlp(ln_2(.)).
class GptLayer final : public mt::DecoderLayer {
 public:
  explicit GptLayer(const GptConfig& c) : c_(c) {}

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
  GptConfig c_;
};

class GptModel final : public mt::Model {
 public:
  explicit GptModel(const mt::Config& cfg) : c_(cfg), layer_(c_) {}

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

  // embedding [V, D], position_embedding [P, D], final_norm and final_norm_bias [D], lm_head
  // [D, V] (absent when tied to the embedding). The position table is a lookup (not a matmul);
  // GPT-2's original initialisation gives it stddev 0.01.
  std::vector<ParamSpec> top_parameters() const override {
    // The learned position table right after the token embedding.
    std::vector<ParamSpec> r = mt::blocks::decoder_top_params(c_.vocab, c_.d, c_.norm, c_.tied);
    r.insert(r.begin() + 1,
             mt::blocks::embedding_param("position_embedding", c_.positions, c_.d, 0.01f, false));
    return r;
  }
  int num_layers() const override { return static_cast<int>(c_.layers); }
  const mt::DecoderLayer& layer(int) const override { return layer_; }

  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.embedding(top, "embedding", tokens);
  }
  // wte[tokens] + wpe[positions]
  Tensor embed_at(mt::Graph& g, const mt::Params& top, const Tensor& tokens,
                  const Tensor& positions) const override {
    return g.add(g.embedding(top, "embedding", tokens),
                 g.embedding(top["position_embedding"], positions));
  }
  // hidden [B, T, D] -> logits [B, T, V]
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied);
  }

  // GPT2LMHeadModel's names. Its Conv1D weights are stored [in, out], as mt stores them (not
  // transposed); c_attn fuses q, k and v as columns [0, D), [D, 2D), [2D, 3D) of one [D, 3D]
  // weight and one [3D] bias.
  HfName hf_name(const std::string& n) const override {
    if (n == "embedding") return mt::hf_tensor("transformer.wte.weight");
    if (n == "position_embedding") return mt::hf_tensor("transformer.wpe.weight");
    if (n == "final_norm") return mt::hf_tensor("transformer.ln_f.weight");
    if (n == "final_norm_bias") return mt::hf_tensor("transformer.ln_f.bias");
    if (n == "lm_head") return mt::hf_tensor("lm_head.weight", true);
    std::string index, p;  // "layers.<i>.<param>"
    if (!mt::hf_split_layer(n, index, p)) return {};
    const std::string h = "transformer.h." + index + ".";
    const int64_t d = c_.d;
    static const std::map<std::string, const char*> kNames = {
        {"attn_norm", "ln_1.weight"},   {"attn_norm_bias", "ln_1.bias"},
        {"wo", "attn.c_proj.weight"},   {"bo", "attn.c_proj.bias"},
        {"mlp_norm", "ln_2.weight"},    {"mlp_norm_bias", "ln_2.bias"},
        {"w_in", "mlp.c_fc.weight"},    {"b_in", "mlp.c_fc.bias"},
        {"w_out", "mlp.c_proj.weight"}, {"b_out", "mlp.c_proj.bias"}};
    if (auto it = kNames.find(p); it != kNames.end()) return mt::hf_tensor(h + it->second);
    static const std::map<std::string, std::pair<const char*, int64_t>> kFused = {
        {"wq", {"attn.c_attn.weight", 0}}, {"wk", {"attn.c_attn.weight", 1}},
        {"wv", {"attn.c_attn.weight", 2}}, {"bq", {"attn.c_attn.bias", 0}},
        {"bk", {"attn.c_attn.bias", 1}},   {"bv", {"attn.c_attn.bias", 2}}};
    if (auto it = kFused.find(p); it != kFused.end())
      return mt::hf_tensor(h + it->second.first, false, it->second.second * d,
                           (it->second.second + 1) * d);
    return {};
  }

 private:
  GptConfig c_;
  GptLayer layer_;
};

// config.json's activation_function -> mlp_activations' name.
const char* activation_from_hf(const std::string& f) {
  // gelu_new, gelu_pytorch_tanh and gelu_fast are each 0.5 x (1 + tanh(sqrt(2 / pi) (x +
  // 0.044715 x^3))), written differently.
  if (f == "gelu_new" || f == "gelu_pytorch_tanh" || f == "gelu_fast") return "gelu";
  if (f == "gelu") return "gelu_exact";  // erf
  if (f == "relu") return "relu";
  if (f == "silu" || f == "swish") return "silu";
  return nullptr;
}

class GptFamily final : public mt::ModelFamily {
 public:
  explicit GptFamily(std::string name) : name_(std::move(name)) {}

  std::string name() const override { return name_; }

  void validate(const mt::Config& c) const override {
    const std::string fam = "the " + name_ + " family";
    const int64_t heads = c.get_int("base_num_query_heads");
    const int64_t d = c.get_int("base_emb_dim");
    if (c.get_int("base_num_kv_heads") != heads)
      c.reject("base_num_kv_heads", "must equal base_num_query_heads=" + std::to_string(heads) +
                                        " for " + fam + " (multi-head attention).");
    if (heads * c.get_int("head_dim") != d)
      c.reject("head_dim", "must be base_emb_dim / base_num_query_heads = " + std::to_string(d) +
                               " / " + std::to_string(heads) + " for " + fam +
                               " (the heads together are the model's width).");
    const int64_t positions = c.get_int("trainable_position_size");
    if (positions <= 0)
      c.reject("trainable_position_size",
               "must be positive for " + fam +
                   ": it is the number of rows of the learned position table.");
    if (c.get_int("max_target_length") > positions)
      c.reject("max_target_length",
               "must not exceed trainable_position_size=" + std::to_string(positions) +
                   ", the positions " + fam + " has learned embeddings for.");
    const auto acts = c.get_string_list("mlp_activations");
    Activation a;
    if (acts.size() != 1 || !activation_of(acts[0], a))
      c.reject("mlp_activations",
               "must be one of [gelu] (tanh approximation: MaxText's gpt3, GPT-2's gelu_new), "
               "[gelu_exact], [relu] or [silu] for " +
                   fam + " (a plain, ungated MLP).");
    if (c.get_int("num_experts") != 1)
      c.reject("num_experts", "must be 1 for " + fam + " (dense MLPs).");
    if (c.get_int("sliding_window_size") != 0)
      c.reject("sliding_window_size", "must be 0 for " + fam + " (full causal attention).");
    if (c.get_float("attn_logits_soft_cap") != 0.0)
      c.reject("attn_logits_soft_cap", "must be 0 for " + fam + ".");
    if (c.get_float("final_logits_soft_cap") != 0.0)
      c.reject("final_logits_soft_cap", "must be 0 for " + fam + ".");
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<GptModel>(c);
  }

  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override;
  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override;

 private:
  std::string name_;
};

// GPT2Config's config.json (transformers 5 and 4 write the same fields: n_embd, n_layer,
// n_head, n_positions, n_inner, ...; the hub's files add n_ctx and task_specific_params).
std::vector<std::string> GptFamily::from_hf_config(const mt::HfConfig& hf,
                                                   std::vector<std::string>& unused) const {
  const std::string who = "mt's " + name_ + " family";
  std::set<std::string> used;
  auto get = [&](const std::string& k) {
    used.insert(k);
    return mt::hf_get(hf, k);
  };
  // A field under its GPT-2 name or the generic alias GPT2Config maps to it (attribute_map).
  auto field = [&](const std::string& k, const std::string& alias) -> const std::string* {
    const std::string* a = get(k);
    const std::string* b = get(alias);
    if (a && b && *a != *b)
      throw mt::UsageError("config.json sets " + k + "=" + *a + " and " + alias + "=" + *b +
                           ", two names of one GPT-2 setting that disagree; keep one.");
    return a ? a : b;
  };
  auto need = [&](const std::string& k, const std::string& alias) -> const std::string& {
    const std::string* v = field(k, alias);
    if (!v) throw mt::UsageError("config.json has no '" + k + "', which a GPT-2 model needs.");
    return *v;
  };
  auto refuse = [&](const std::string& k, const std::string& v, const std::string& what) {
    mt::hf_refuse(k, v, what, who);
  };
  auto integer = [&](const std::string& k, const std::string& v) {
    if (v.empty() || v.size() > 18 || v.find_first_not_of("0123456789") != std::string::npos ||
        std::stoll(v) <= 0)
      throw mt::UsageError("config.json's " + k + " is " + v + "; it must be a positive integer.");
    return std::stoll(v);
  };

  const int64_t d = integer("n_embd", need("n_embd", "hidden_size"));
  const int64_t heads = integer("n_head", need("n_head", "num_attention_heads"));
  if (d % heads != 0)
    throw mt::UsageError("config.json sets n_embd=" + std::to_string(d) +
                         " and n_head=" + std::to_string(heads) +
                         ": n_embd must be a multiple of n_head (each "
                         "head is n_embd / n_head wide in GPT-2).");
  const std::string& positions = need("n_positions", "max_position_embeddings");
  integer("n_positions", positions);
  std::vector<std::string> o = {"decoder_block=" + name_};
  o.push_back("vocab_size=" + need("vocab_size", "vocab_size"));
  o.push_back("base_emb_dim=" + std::to_string(d));
  o.push_back("base_num_decoder_layers=" + need("n_layer", "num_hidden_layers"));
  o.push_back("base_num_query_heads=" + std::to_string(heads));
  o.push_back("base_num_kv_heads=" + std::to_string(heads));
  o.push_back("head_dim=" + std::to_string(d / heads));
  const std::string* inner = get("n_inner");
  o.push_back("base_mlp_dim=" + (inner ? *inner : std::to_string(4 * d)));
  o.push_back("trainable_position_size=" + positions);
  o.push_back("max_position_embeddings=" + positions);
  // GPT2Config's defaults where config.json leaves a field out.
  mt::hf_refuse_null(hf, "layer_norm_epsilon");
  const std::string* eps = get("layer_norm_epsilon");
  o.push_back("normalization_layer_epsilon=" + (eps ? *eps : std::string("1e-05")));
  // A flag: read through `get` (marks it used), then as a boolean.
  auto flag = [&](const std::string& k, bool absent) {
    get(k);
    return mt::hf_flag(hf, k, absent);
  };
  o.push_back(std::string("logits_via_embedding=") +
              (flag("tie_word_embeddings", true) ? "true" : "false"));
  const std::string* act = get("activation_function");
  const char* mapped = activation_from_hf(act ? *act : "gelu_new");
  if (!mapped) refuse("activation_function", *act, "an MLP activation mt has no kernel for");
  o.push_back(std::string("mlp_activations=[") + mapped + "]");

  // Settings that change GPT-2's computation and that this family does not implement.
  if (!flag("scale_attn_weights", true))
    refuse("scale_attn_weights", "false", "attention scores not divided by sqrt(head_dim)");
  if (flag("scale_attn_by_inverse_layer_idx", false))
    refuse("scale_attn_by_inverse_layer_idx", "true",
           "attention scores further divided by the layer's index + 1");
  if (flag("reorder_and_upcast_attn", false))
    refuse("reorder_and_upcast_attn", "true",
           "attention scores reordered and upcast (Mistral's "
           "stabilisation for mixed precision)");
  if (flag("add_cross_attention", false))
    refuse("add_cross_attention", "true", "cross-attention to an encoder");
  // Other architectures' settings: a config.json that has them is not a GPT-2 model.
  for (const char* k : {"rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
                        "attn_logit_softcapping", "final_logit_softcapping", "num_key_value_heads",
                        "num_local_experts", "num_experts", "rotary_dim", "rotary_pct"}) {
    for (const auto& [key, v] : hf) {
      if (v == "null" || (key != k && key.rfind(std::string(k) + ".", 0) != 0)) continue;
      refuse(key, v, "a setting of another architecture");
    }
    used.insert(k);
  }
  // Fields that only describe training (dropout, the sequence-summary head of
  // GPT2DoubleHeadsModel), tooling or generation and never change the logits.
  static const char* const kIgnorable[] = {"architectures",
                                           "model_type",
                                           "torch_dtype",
                                           "dtype",
                                           "transformers_version",
                                           "use_cache",
                                           "initializer_range",
                                           "resid_pdrop",
                                           "embd_pdrop",
                                           "attn_pdrop",
                                           "summary_type",
                                           "summary_use_proj",
                                           "summary_activation",
                                           "summary_proj_to_labels",
                                           "summary_first_dropout",
                                           "bos_token_id",
                                           "eos_token_id",
                                           "pad_token_id",
                                           "n_ctx",
                                           "_name_or_path",
                                           "output_attentions",
                                           "output_hidden_states",
                                           "return_dict"};
  for (const char* k : kIgnorable) used.insert(k);
  for (const auto& [k, v] : hf) {
    if (k.rfind("task_specific_params", 0) == 0) continue;  // generation presets of the hub
    if (!used.count(k)) unused.push_back(k + "=" + v);
  }
  return o;
}

std::map<std::string, std::string> GptFamily::to_hf_config(const mt::Config& cfg) const {
  validate(cfg);
  const GptConfig c(cfg);
  const auto act = cfg.get_string_list("mlp_activations").at(0);
  const char* hf_act = act == "gelu" ? "gelu_new" : act == "gelu_exact" ? "gelu" : act.c_str();
  return {{"architectures", "[\"GPT2LMHeadModel\"]"},
          {"model_type", "\"gpt2\""},
          {"vocab_size", std::to_string(c.vocab)},
          {"n_embd", std::to_string(c.d)},
          {"n_layer", std::to_string(c.layers)},
          {"n_head", std::to_string(c.attn.heads)},
          {"n_inner", std::to_string(c.mlp.hidden)},
          {"n_positions", std::to_string(c.positions)},
          {"n_ctx", std::to_string(c.positions)},
          {"activation_function", std::string("\"") + hf_act + "\""},
          // From the config's double: c's float would print 1e-5 as 9.99999975e-06.
          {"layer_norm_epsilon", mt::hf_json_number(cfg.get_float("normalization_layer_epsilon"))},
          {"tie_word_embeddings", c.tied ? "true" : "false"},
          {"scale_attn_weights", "true"},
          {"scale_attn_by_inverse_layer_idx", "false"},
          {"reorder_and_upcast_attn", "false"},
          {"resid_pdrop", "0.0"},
          {"embd_pdrop", "0.0"},
          {"attn_pdrop", "0.0"},
          // GPT-2's <|endoftext|> where the vocabulary has it; transformers' default (50256)
          // would name a token a smaller vocabulary lacks.
          {"bos_token_id", c.vocab > 50256 ? "50256" : "null"},
          {"eos_token_id", c.vocab > 50256 ? "50256" : "null"},
          {"torch_dtype",
           cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""}};
}

}  // namespace

void register_gpt_family(mt::Registry& r, const std::string& name) {
  if (name != "gpt2" && name != "gpt3")
    throw mt::Error("mt_gpt: no GPT family named '" + name + "'");
  r.add_model_family(name, [name] { return std::make_unique<GptFamily>(name); });
}

}  // namespace mt_gpt
