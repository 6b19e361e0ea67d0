// The Gemma families, one implementation with switches (as MaxText composes shared blocks):
//   gemma   Gemma 1 (2B, 7B): pre-norm layers, RMSNorm scaled by (1 + w), a GeGLU MLP (the tanh
//           approximation of gelu), rotary embeddings, multi-query (2B) or multi-head (7B)
//           attention with head_dim 256, embeddings multiplied by sqrt(d_model), tied output.
//   gemma2  Gemma 2 (2B, 9B, 27B): gemma's pieces, plus norms after attention and after the MLP
//           (each block is x + post_norm(block(pre_norm(x)))), layers alternating between a
//           sliding window and global attention, tanh soft-caps on the attention logits and on
//           the final logits, and scores scaled by 1 / sqrt(query_pre_attn_scalar).
//   gemma3  Gemma 3 text (1B, 4B, 12B, 27B): gemma2's layer with RMSNorm (1 + w) of each head's
//           q and k before the rotary embedding, five local layers to one global, local layers
//           with their own rope theta (local_rope_max_timescale) and global ones with linear rope
//           scaling (rope_linear_scaling_factor); no soft-caps in the released models. The
//           vision tower of the multimodal checkpoints is out of scope.
// Numerics follow transformers 5's modeling_gemma*.py; the embedding normaliser sqrt(d_model)
// is rounded to the compute dtype first, as Hugging Face rounds it to the model's dtype.
// Written against the SDK only; each family name is a plugin file (plugin_<name>.cpp) over this.
#include "gemma.h"

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
#include "mt/dtype.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/hf.h"
#include "mt/model.h"

namespace mt_gemma {

namespace {

using mt::Activation;
using mt::ParamSpec;
using mt::Tensor;

enum class Variant { gemma, gemma2, gemma3 };

Variant variant_of(const std::string& name) {
  if (name == "gemma") return Variant::gemma;
  if (name == "gemma2") return Variant::gemma2;
  if (name == "gemma3" || name == "gemma3_text") return Variant::gemma3;
  throw mt::Error("mt_gemma: no Gemma family named '" + name + "'");
}

// gemma2's and gemma3's own keys (ModelFamily::config_schema), Hugging Face's names; the shared
// ones (sliding_window_size, attn_logits_soft_cap, final_logits_soft_cap,
// local_rope_max_timescale, rope_linear_scaling_factor) are base.yml's.
std::string schema(Variant v) {
  if (v == Variant::gemma) return {};
  return std::string("sliding_window_pattern: ") + (v == Variant::gemma2 ? "2" : "6") +
         "  # layer i attends globally when (i + 1) is a multiple of this, else over the last "
         "sliding_window_size tokens (Hugging Face's sliding_window_pattern / layer_types: " +
         (v == Variant::gemma2 ? "Gemma 2 alternates, 2" : "Gemma 3 has 5 local to 1 global, 6") +
         ") [>0]\n"
         "query_pre_attn_scalar: 0.0  # attention scores are q.k / sqrt(this) (Hugging Face's "
         "query_pre_attn_scalar); 0.0 = head_dim [>=0]\n";
}

const char* display(Variant v) {
  switch (v) {
    case Variant::gemma:
      return "Gemma";
    case Variant::gemma2:
      return "Gemma 2";
    case Variant::gemma3:
      return "Gemma 3";
  }
  return "";
}

struct GemmaConfig {
  Variant variant = Variant::gemma;
  int64_t vocab = 0, d = 0, layers = 0;
  bool tied = true;
  bool post_norms = false;  // gemma2, gemma3: norms after attention and after the MLP
  float embed_scale = 1.f;  // sqrt(d_model), rounded to the compute dtype
  float final_softcap = 0.f;
  mt::blocks::NormSpec norm;
  mt::blocks::AttentionBlockSpec global, local;  // the two layer kinds' attention
  mt::blocks::MlpSpec mlp;
  std::vector<bool> is_local;  // per layer

  GemmaConfig(const mt::Config& c, Variant v) : variant(v) {
    vocab = c.get_int("vocab_size");
    d = c.get_int("base_emb_dim");
    layers = c.get_int("base_num_decoder_layers");
    tied = c.get_bool("logits_via_embedding");
    post_norms = v != Variant::gemma;
    norm.kind = mt::blocks::NormKind::rms_plus_one;
    norm.eps = static_cast<float>(c.get_float("normalization_layer_epsilon"));
    embed_scale = static_cast<float>(std::sqrt(static_cast<double>(d)));
    if (c.get_string("dtype") == "bfloat16")
      embed_scale = mt::bf16_to_f32(mt::f32_to_bf16(embed_scale));
    final_softcap = static_cast<float>(c.get_float("final_logits_soft_cap"));

    mt::blocks::AttentionBlockSpec& a = global;
    a.d_model = d;
    a.heads = c.get_int("base_num_query_heads");
    a.kv_heads = c.get_int("base_num_kv_heads");
    a.head_dim = c.get_int("head_dim");
    a.qk_norm = v == Variant::gemma3;
    a.qk_norm_spec = norm;
    a.rope.type = mt::RopeSpec::Type::standard;
    a.rope.theta = static_cast<float>(c.get_float("rope_max_timescale"));
    a.rope.rotary_dim = static_cast<int>(a.head_dim);
    a.attn.causal = true;
    a.attn.softcap = static_cast<float>(c.get_float("attn_logits_soft_cap"));
    double scalar = static_cast<double>(a.head_dim);
    if (v != Variant::gemma && c.get_float("query_pre_attn_scalar") > 0.0)
      scalar = c.get_float("query_pre_attn_scalar");
    a.attn.scale = static_cast<float>(1.0 / std::sqrt(scalar));
    local = global;
    local.attn.window = c.get_int("sliding_window_size");  // 0: every layer global
    if (v == Variant::gemma3) {
      const double factor = c.get_float("rope_linear_scaling_factor");
      if (factor != 1.0) {
        global.rope.type = mt::RopeSpec::Type::linear;
        global.rope.factor = static_cast<float>(factor);
      }
      if (c.get_float("local_rope_max_timescale") > 0.0)
        local.rope.theta = static_cast<float>(c.get_float("local_rope_max_timescale"));
    }

    mlp.d_model = d;
    mlp.hidden = c.get_int("base_mlp_dim");
    mlp.act = Activation::gelu_tanh;
    mlp.gated = true;  // GeGLU

    is_local.assign(static_cast<size_t>(layers), false);
    if (v != Variant::gemma) {
      const int64_t pattern = c.get_int("sliding_window_pattern");
      for (int64_t i = 0; i < layers; ++i)
        is_local[static_cast<size_t>(i)] = (i + 1) % pattern != 0;
    }
  }
};

// gemma:         x + attention(norm(x)), then + mlp(norm(.))
// gemma2/gemma3: x + post_attn_norm(attention(norm(x))), then + post_mlp_norm(mlp(norm(.)))
class GemmaLayer final : public mt::DecoderLayer {
 public:
  GemmaLayer(const GemmaConfig& c, bool local) : c_(c), attn_(local ? c.local : c.global) {}

  std::vector<ParamSpec> parameters() const override {
    using namespace mt::blocks;
    std::vector<ParamSpec> r = norm_params("attn_norm", c_.d, c_.norm);
    for (auto& p : attention_params(attn_)) r.push_back(p);
    if (c_.post_norms)
      for (auto& p : norm_params("post_attn_norm", c_.d, c_.norm)) r.push_back(p);
    for (auto& p : norm_params("mlp_norm", c_.d, c_.norm)) r.push_back(p);
    for (auto& p : mlp_params(c_.mlp)) r.push_back(p);
    if (c_.post_norms)
      for (auto& p : norm_params("post_mlp_norm", c_.d, c_.norm)) r.push_back(p);
    return r;
  }

  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    using namespace mt::blocks;
    Tensor a = attention(g, p, attn_, norm(g, p, "attn_norm", x, c_.norm), in);
    if (c_.post_norms) a = norm(g, p, "post_attn_norm", a, c_.norm);
    const Tensor r = g.add(x, a);
    Tensor m = mlp(g, p, c_.mlp, norm(g, p, "mlp_norm", r, c_.norm));
    if (c_.post_norms) m = norm(g, p, "post_mlp_norm", m, c_.norm);
    return g.add(r, m);
  }

  mt::CacheSpec cache_spec() const override { return mt::blocks::attention_cache_spec(attn_); }

 private:
  GemmaConfig c_;
  mt::blocks::AttentionBlockSpec attn_;
};

class GemmaModel final : public mt::Model {
 public:
  GemmaModel(const mt::Config& cfg, Variant v) : c_(cfg, v) {
    for (int64_t i = 0; i < c_.layers; ++i)
      layers_.push_back(std::make_unique<GemmaLayer>(c_, c_.is_local[static_cast<size_t>(i)]));
  }

  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = c_.vocab;
    m.d_model = c_.d;
    m.num_layers = c_.layers;
    m.num_query_heads = c_.global.heads;
    m.num_kv_heads = c_.global.kv_heads;
    m.head_dim = c_.global.head_dim;
    m.mlp_dim = c_.mlp.hidden;
    return m;
  }

  // embedding [V, D] (N(0, 1/D): times sqrt(D) on the way in, unit-size inputs), final_norm
  // [D], lm_head [D, V] (absent when tied, as every released Gemma is).
  std::vector<ParamSpec> top_parameters() const override {
    return mt::blocks::decoder_top_params(c_.vocab, c_.d, c_.norm, c_.tied,
                                          1.f / std::sqrt(static_cast<float>(c_.d)));
  }
  int num_layers() const override { return static_cast<int>(c_.layers); }
  const mt::DecoderLayer& layer(int i) const override {
    return *layers_.at(static_cast<size_t>(i));
  }

  // The looked-up rows times sqrt(d_model) (Hugging Face's embed_scale in the model's dtype).
  Tensor embed(mt::Graph& g, const mt::Params& top, const Tensor& tokens) const override {
    return g.scale(g.embedding(top, "embedding", tokens), c_.embed_scale);
  }
  // hidden [B, T, D] -> logits [B, T, V]: final norm, LM head, then the final soft-cap.
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied, c_.final_softcap);
  }

  // GemmaForCausalLM's, Gemma2ForCausalLM's and Gemma3ForCausalLM's names. Gemma's
  // post_attention_layernorm is the norm before the MLP; Gemma 2 and 3 call that one
  // pre_feedforward_layernorm, and post_attention_layernorm the norm after attention.
  HfName hf_name(const std::string& n) const override {
    if (HfName top; mt::hf_causal_lm_top(n, c_.tied, top)) return top;
    std::string index, p;  // "layers.<i>.<param>"
    if (!mt::hf_split_layer(n, index, p)) return {};
    const std::string prefix = "model.layers." + index + ".";
    const bool v1 = c_.variant == Variant::gemma;
    static const mt::HfNameTable kNames = {
        {"attn_norm", {"input_layernorm.weight", false}},
        {"post_attn_norm", {"post_attention_layernorm.weight", false}},
        {"post_mlp_norm", {"post_feedforward_layernorm.weight", false}},
        {"wq", {"self_attn.q_proj.weight", true}},
        {"wk", {"self_attn.k_proj.weight", true}},
        {"wv", {"self_attn.v_proj.weight", true}},
        {"wo", {"self_attn.o_proj.weight", true}},
        {"q_norm", {"self_attn.q_norm.weight", false}},
        {"k_norm", {"self_attn.k_norm.weight", false}},
        {"w_gate", {"mlp.gate_proj.weight", true}},
        {"w_up", {"mlp.up_proj.weight", true}},
        {"w_down", {"mlp.down_proj.weight", true}}};
    if (p == "mlp_norm")
      return mt::hf_tensor(
          prefix + (v1 ? "post_attention_layernorm.weight" : "pre_feedforward_layernorm.weight"));
    return mt::hf_from_table(kNames, p, prefix);
  }

 private:
  GemmaConfig c_;
  std::vector<std::unique_ptr<GemmaLayer>> layers_;
};

// ---- config.json ------------------------------------------------------------------------------

// A whole number as a JSON integer ("256"), else as a float: transformers declares
// query_pre_attn_scalar an int.
std::string whole_or_num(double v) {
  return v == std::floor(v) && std::fabs(v) < 1e15 ? std::to_string(static_cast<int64_t>(v))
                                                   : mt::hf_json_number(v);
}

class GemmaFamily final : public mt::ModelFamily {
 public:
  explicit GemmaFamily(std::string name) : name_(std::move(name)), v_(variant_of(name_)) {}

  std::string name() const override { return name_; }
  std::string config_schema() const override { return schema(v_); }

  void validate(const mt::Config& c) const override {
    const std::string fam = "the " + name_ + " family";
    const int64_t heads = c.get_int("base_num_query_heads");
    const int64_t kv = c.get_int("base_num_kv_heads");
    if (heads % kv != 0)
      c.reject("base_num_kv_heads", "must divide base_num_query_heads=" + std::to_string(heads) +
                                        " (each group of query heads shares one key/value head).");
    if (c.get_int("head_dim") % 2 != 0)
      c.reject("head_dim", "must be even: the rotary embedding turns pairs of features.");
    if (c.get_string("rope_type") != "default")
      c.reject("rope_type", "must be default for " + fam +
                                " (Gemma 3's global layers scale their rotary frequencies with "
                                "rope_linear_scaling_factor instead).");
    if (c.get_float("partial_rotary_factor") != 1.0)
      c.reject("partial_rotary_factor",
               "must be 1.0 for " + fam + ": Gemma rotates every feature of each head.");
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 2 || acts[0] != "gelu" || acts[1] != "linear")
      c.reject("mlp_activations",
               "must be [gelu, linear] for " + fam +
                   " (GeGLU with the tanh approximation of gelu, MaxText's and flax's gelu).");
    if (c.get_int("num_experts") != 1)
      c.reject("num_experts", "must be 1 for " + fam + ": Gemma's MLPs are dense.");
    if (v_ == Variant::gemma) {
      for (const char* k : {"attn_logits_soft_cap", "final_logits_soft_cap"})
        if (c.get_float(k) != 0.0)
          c.reject(k,
                   "must be 0.0 for the gemma family: Gemma 1 has no soft-capping (Gemma 2 "
                   "does: decoder_block=gemma2).");
      if (c.get_int("sliding_window_size") != 0)
        c.reject("sliding_window_size",
                 "must be 0 for the gemma family: every Gemma 1 layer attends globally (Gemma 2 "
                 "and 3 have local layers).");
    }
    if (v_ != Variant::gemma3) {
      if (c.get_float("local_rope_max_timescale") > 0.0 &&
          c.get_float("local_rope_max_timescale") != c.get_float("rope_max_timescale"))
        c.reject("local_rope_max_timescale",
                 "must be -1 (rope_max_timescale on every layer) for " + fam +
                     ": its local and global layers share one rope theta (Gemma 3's differ).");
      if (c.get_float("rope_linear_scaling_factor") != 1.0)
        c.reject("rope_linear_scaling_factor",
                 "must be 1.0 for " + fam + ": only Gemma 3's global layers scale rope linearly.");
    }
    // A window at least as long as the context is harmless: the local layers then see every
    // earlier token, as global ones do, which is what transformers computes for such a model.
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<GemmaModel>(c, v_);
  }

  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override;
  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override;

 private:
  std::string name_;
  Variant v_;
};

std::vector<std::string> GemmaFamily::from_hf_config(const mt::HfConfig& hf,
                                                     std::vector<std::string>& unused) const {
  const std::string model = display(v_);
  const std::string who =
      "mt's " + std::string(v_ == Variant::gemma3 ? "gemma3" : name_) + " family";
  auto get = [&](const std::string& k) { return mt::hf_get(hf, k); };
  std::set<std::string> used;  // fields read (or known not to change the logits)
  auto use = [&](const std::string& k) {
    used.insert(k);
    return get(k);
  };
  auto need = [&](const std::string& k) -> const std::string& {
    used.insert(k);
    return mt::hf_need(hf, k, model);
  };
  auto refuse = [&](const std::string& k, const std::string& v, const std::string& what) {
    mt::hf_refuse(k, v, what, who);
  };
  const auto integer = mt::hf_integer;
  const auto number = mt::hf_number;

  // Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration, model_type gemma3) nest
  // the text model's config under text_config beside a vision tower.
  for (const auto& [k, v] : hf)
    if (k.rfind("text_config.", 0) == 0 || k.rfind("vision_config.", 0) == 0)
      throw mt::UsageError(
          "config.json describes a multimodal " + model + " checkpoint (" +
          k.substr(0, k.find('.')) +
          "): mt implements Gemma's text model only (Gemma3ForCausalLM, model_type gemma3_text, "
          "as the 1B checkpoint has it); the vision tower is out of scope.");

  std::vector<std::string> o = {"decoder_block=" +
                                std::string(v_ == Variant::gemma3 ? "gemma3" : name_.c_str())};
  const std::string& heads = need("num_attention_heads");
  o.push_back("vocab_size=" + need("vocab_size"));
  o.push_back("base_emb_dim=" + need("hidden_size"));
  o.push_back("base_mlp_dim=" + need("intermediate_size"));
  o.push_back("base_num_decoder_layers=" + need("num_hidden_layers"));
  const int64_t layers = integer("num_hidden_layers", need("num_hidden_layers"));
  o.push_back("base_num_query_heads=" + heads);
  const std::string* kv = use("num_key_value_heads");
  o.push_back("base_num_kv_heads=" + (kv ? *kv : heads));
  // Every Gemma config class defaults head_dim to 256 (not hidden_size / heads).
  const std::string* hd = use("head_dim");
  o.push_back("head_dim=" + (hd ? *hd : std::string("256")));
  mt::hf_refuse_null(hf, "rms_norm_eps");
  const std::string* eps = use("rms_norm_eps");
  o.push_back("normalization_layer_epsilon=" + (eps ? *eps : std::string("1e-06")));
  used.insert("tie_word_embeddings");
  o.push_back(std::string("logits_via_embedding=") +
              (mt::hf_flag(hf, "tie_word_embeddings", true) ? "true" : "false"));
  const std::string* maxpos = use("max_position_embeddings");
  o.push_back("max_position_embeddings=" +
              (maxpos ? *maxpos : std::string(v_ == Variant::gemma3 ? "131072" : "8192")));
  o.push_back("mlp_activations=[gelu,linear]");

  // The MLP's activation. Gemma 1's field is hidden_act, whose "gelu" transformers reads as the
  // tanh approximation (the original releases wrote it so); transformers 4 also had
  // hidden_activation, which transformers 5 no longer reads: anything but the tanh gelu there is
  // ambiguous. Gemma 2 and 3 read hidden_activation.
  auto tanh_gelu = [](const std::string& a) { return a == "gelu_pytorch_tanh"; };
  if (v_ == Variant::gemma) {
    if (const std::string* a = use("hidden_act"); a && !tanh_gelu(*a) && *a != "gelu")
      refuse("hidden_act", *a, "an MLP activation other than the tanh approximation of gelu");
    if (const std::string* a = use("hidden_activation"); a && !tanh_gelu(*a))
      refuse("hidden_activation", *a,
             "an MLP activation other than gelu_pytorch_tanh (transformers 5 ignores this field "
             "and uses the tanh gelu; transformers 4 would not)");
  } else {
    if (const std::string* a = use("hidden_activation"); a && !tanh_gelu(*a))
      refuse("hidden_activation", *a, "an MLP activation other than gelu_pytorch_tanh");
    if (const std::string* a = use("hidden_act"); a && !tanh_gelu(*a) && *a != "gelu")
      refuse("hidden_act", *a, "an MLP activation other than the tanh approximation of gelu");
  }
  for (const auto& [k, what] : {std::pair<const char*, const char*>{
                                    "attention_bias", "biases on the attention projections"},
                                {"use_bidirectional_attention", "attention without a causal mask"}})
    if (used.insert(k), mt::hf_flag(hf, k, false)) refuse(k, "true", what);

  // Soft-caps, query_pre_attn_scalar and local layers (Gemma 2 and 3); absent fields take the
  // transformers classes' defaults (Gemma 2: caps 50 and 30; Gemma 3: none; both: scalar 256,
  // window 4096).
  if (v_ != Variant::gemma) {
    const bool g2 = v_ == Variant::gemma2;
    auto cap = [&](const char* k, const char* key, const char* def) {
      used.insert(k);
      auto it = hf.find(k);
      std::string value = it == hf.end()         ? std::string(def)
                          : it->second == "null" ? "0.0"
                                                 : it->second;
      if (number(k, value) < 0) refuse(k, value, "a negative soft-cap");
      o.push_back(std::string(key) + "=" + value);
    };
    // transformers' Gemma 3 attention never applies attn_logit_softcapping (Gemma 2's does),
    // and every released Gemma 3 has null: a number there means a model whose reference is
    // ambiguous, refused rather than guessed.
    if (!g2)
      if (const auto it = hf.find("attn_logit_softcapping");
          it != hf.end() && it->second != "null" &&
          number("attn_logit_softcapping", it->second) != 0)
        refuse("attn_logit_softcapping", it->second,
               "an attention soft-cap on Gemma 3 (transformers' Gemma 3 ignores the field)");
    cap("attn_logit_softcapping", "attn_logits_soft_cap", g2 ? "50.0" : "0.0");
    cap("final_logit_softcapping", "final_logits_soft_cap", g2 ? "30.0" : "0.0");
    const std::string* qs = use("query_pre_attn_scalar");
    const std::string scalar = qs ? *qs : "256";
    if (number("query_pre_attn_scalar", scalar) <= 0)
      refuse("query_pre_attn_scalar", scalar, "a scale that is not positive");
    o.push_back("query_pre_attn_scalar=" + scalar);
    used.insert("sliding_window");
    auto sw = hf.find("sliding_window");
    if (sw != hf.end() && sw->second == "null")
      throw mt::UsageError(
          "config.json's sliding_window is null: a " + model +
          " model's local layers need a window (transformers 5.24 fails on it too).");
    const std::string window = sw == hf.end() ? "4096" : sw->second;
    if (integer("sliding_window", window) < 1)
      throw mt::UsageError("config.json's sliding_window is " + window +
                           "; it must be a positive number of tokens.");
    o.push_back("sliding_window_size=" + window);

    // Which layers are local: layer_types (transformers 5 writes it; it wins), else Gemma 3's
    // sliding_window_pattern (the legacy form), else the class's default. mt's pattern P says
    // layer i is global when (i + 1) % P == 0: any list of that form is read, others refused.
    int64_t pattern = g2 ? 2 : 6;
    used.insert("_sliding_window_pattern");
    if (const std::string* p = use("sliding_window_pattern"); p && !g2)
      pattern = integer("sliding_window_pattern", *p);
    if (const std::string* p = get("_sliding_window_pattern");
        p && !g2 && !get("sliding_window_pattern"))
      pattern = integer("_sliding_window_pattern", *p);
    if (pattern < 1)
      refuse("sliding_window_pattern", std::to_string(pattern), "a pattern that is not positive");
    if (const std::string* lt = use("layer_types")) {
      std::vector<bool> global;
      for (size_t at = 0; (at = lt->find('"', at)) != std::string::npos;) {
        const size_t end = lt->find('"', at + 1);
        if (end == std::string::npos) break;
        const std::string t = lt->substr(at + 1, end - at - 1);
        if (t != "full_attention" && t != "sliding_attention")
          refuse("layer_types", *lt,
                 "a layer type other than full_attention and sliding_attention");
        global.push_back(t == "full_attention");
        at = end + 1;
      }
      if (static_cast<int64_t>(global.size()) != layers)
        throw mt::UsageError("config.json's layer_types lists " + std::to_string(global.size()) +
                             " layers, but num_hidden_layers is " + std::to_string(layers) + ".");
      // The first global layer fixes the pattern (none: every layer local).
      const auto first = std::find(global.begin(), global.end(), true);
      pattern = first == global.end() ? layers + 1 : (first - global.begin()) + 1;
      for (int64_t i = 0; i < layers; ++i)
        if (global[static_cast<size_t>(i)] != ((i + 1) % pattern == 0))
          refuse("layer_types", *lt,
                 "local and global layers in an order other than every P-th layer global (mt's "
                 "sliding_window_pattern)");
    }
    o.push_back("sliding_window_pattern=" + std::to_string(pattern));
  }

  // Rotary embeddings. Gemma and Gemma 2: transformers 5 writes rope_parameters {rope_theta,
  // rope_type}, transformers 4 a top-level rope_theta beside rope_scaling (null). Gemma 3's
  // transformers 5 form has one rope_parameters object per layer type (full_attention,
  // sliding_attention); its legacy form has rope_theta (global layers), rope_local_base_freq
  // (local layers) and rope_scaling (global layers: linear, factor 8 in the 4B and larger).
  for (const char* k : {"rope_theta", "rope_scaling", "rope_local_base_freq", "rope_parameters"})
    used.insert(k);
  const bool v5 = std::any_of(hf.begin(), hf.end(), [](const auto& e) {
    return e.first.rfind("rope_parameters.", 0) == 0;
  });
  if (v5 && get("rope_scaling"))
    throw mt::UsageError(
        "config.json has both rope_parameters and rope_scaling: which one transformers would use "
        "is ambiguous; keep one.");
  // Reads one rope parameter object (prefix ends with '.'); returns theta (or nullptr) and puts
  // the linear factor in `factor` when linear scaling is allowed there.
  auto rope_object = [&](const std::string& prefix, bool allow_linear, double& factor) {
    const std::string* type = get(prefix + "rope_type");
    if (!type) type = get(prefix + "type");
    const bool linear = type && *type == "linear";
    if (type && *type != "default" && !(linear && allow_linear))
      refuse(prefix + "rope_type", *type,
             "a rotary embedding type other than default" +
                 std::string(allow_linear ? " and linear" : "") + " there");
    for (const auto& [k, v] : hf) {
      if (k.rfind(prefix, 0) != 0 || v == "null") continue;
      const std::string field = k.substr(prefix.size());
      if (field == "rope_type" || field == "type" || field == "rope_theta") continue;
      if (field == "factor" && linear) continue;
      if (v5 && v_ == Variant::gemma3 && prefix == "rope_parameters." &&
          (field.rfind("full_attention.", 0) == 0 || field.rfind("sliding_attention.", 0) == 0))
        continue;
      refuse(
          k, v,
          "a rotary embedding setting" + (type ? " of rope type '" + *type + "'" : std::string()));
    }
    if (linear) {
      const std::string* f = get(prefix + "factor");
      if (!f)
        throw mt::UsageError("config.json's " + prefix +
                             "rope_type is linear but it has no factor.");
      factor = number(prefix + "factor", *f);
      if (factor <= 0) refuse(prefix + "factor", *f, "a linear rope factor that is not positive");
    }
    return get(prefix + "rope_theta");
  };
  double factor = 1.0;
  const std::string* theta = nullptr;
  const std::string* local_theta = nullptr;
  if (v_ == Variant::gemma3 && v5) {
    for (const char* k : {"rope_parameters.rope_theta", "rope_parameters.rope_type"})
      if (const std::string* v = get(k))
        refuse(k, *v,
               "one rotary embedding for every layer (Gemma 3's rope_parameters has one object "
               "per layer type: full_attention and sliding_attention)");
    double unused_factor = 1.0;
    theta = rope_object("rope_parameters.full_attention.", true, factor);
    local_theta = rope_object("rope_parameters.sliding_attention.", false, unused_factor);
    rope_object("rope_parameters.", false, unused_factor);  // nothing else under it
  } else if (v5) {
    theta = rope_object("rope_parameters.", false, factor);
  } else {
    theta = rope_object("rope_scaling.", v_ == Variant::gemma3, factor);
    const std::string* t = get("rope_theta");
    if (t) theta = t;
    if (v_ == Variant::gemma3) local_theta = get("rope_local_base_freq");
  }
  if (!theta) theta = get("rope_theta");
  // transformers' defaults when config.json has none: 10000 (Gemma, Gemma 2); Gemma 3: 1e6 on
  // global and 10000 on local layers.
  o.push_back("rope_max_timescale=" +
              (theta ? *theta : std::string(v_ == Variant::gemma3 ? "1000000.0" : "10000.0")));
  if (v_ == Variant::gemma3) {
    o.push_back("local_rope_max_timescale=" +
                (local_theta ? *local_theta : std::string("10000.0")));
    o.push_back("rope_linear_scaling_factor=" + mt::hf_json_number(factor));
  }
  if (const std::string* prf = use("partial_rotary_factor");
      prf && number("partial_rotary_factor", *prf) != 1.0)
    refuse("partial_rotary_factor", *prf, "a rotary embedding of part of each head");

  // Fields that change the computation in other families and that this one does not implement:
  // refused with their name, never ignored.
  std::vector<std::string> numerics = {"logits_scaling",
                                       "logit_scale",
                                       "embedding_multiplier",
                                       "residual_multiplier",
                                       "attention_multiplier",
                                       "mlp_bias",
                                       "qk_layernorm",
                                       "use_qk_norm",
                                       "num_local_experts",
                                       "num_experts",
                                       "num_experts_per_tok",
                                       "kv_lora_rank",
                                       "q_lora_rank",
                                       "no_rope_layers",
                                       "use_sliding_window",
                                       "final_logit_softcapping_enabled",
                                       "altup_num_inputs",
                                       "laurel_rank",
                                       "hidden_size_per_layer_input"};
  if (v_ == Variant::gemma)
    for (const char* k :
         {"attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
          "sliding_window", "layer_types", "sliding_window_pattern"})
      numerics.push_back(k);
  for (const auto& k : numerics) {
    const std::string* v = get(k);
    used.insert(k);
    if (!v || *v == "false" || *v == "0" || *v == "0.0" || *v == "[]") continue;
    refuse(k, *v, "a setting of another architecture (is this a " + model + " model?)");
  }
  // Fields that only describe training, tooling or generation and never change the logits.
  static const char* const kIgnorable[] = {"architectures",        "model_type",
                                           "torch_dtype",          "dtype",
                                           "transformers_version", "use_cache",
                                           "initializer_range",    "attention_dropout",
                                           "bos_token_id",         "eos_token_id",
                                           "pad_token_id",         "_name_or_path",
                                           "output_attentions",    "output_hidden_states",
                                           "return_dict",          "cache_implementation"};
  for (const char* k : kIgnorable) used.insert(k);
  for (const auto& [k, v] : hf) {
    const bool rope = k.rfind("rope_scaling.", 0) == 0 || k.rfind("rope_parameters.", 0) == 0;
    if (!rope && !used.count(k)) unused.push_back(k + "=" + v);
  }
  return o;
}

// config.json in the transformers 4 form Google's checkpoints have (top-level rope_theta;
// Gemma 3: rope_local_base_freq, rope_scaling and sliding_window_pattern), which transformers 5
// reads to the same model.
std::map<std::string, std::string> GemmaFamily::to_hf_config(const mt::Config& cfg) const {
  validate(cfg);
  const GemmaConfig c(cfg, v_);
  static const char* const kArch[] = {"GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"};
  static const char* const kType[] = {"gemma", "gemma2", "gemma3_text"};
  const size_t i = static_cast<size_t>(v_);
  std::map<std::string, std::string> m = {
      {"architectures", std::string("[\"") + kArch[i] + "\"]"},
      {"model_type", std::string("\"") + kType[i] + "\""},
      {"vocab_size", std::to_string(c.vocab)},
      {"hidden_size", std::to_string(c.d)},
      {"intermediate_size", std::to_string(c.mlp.hidden)},
      {"num_hidden_layers", std::to_string(c.layers)},
      {"num_attention_heads", std::to_string(c.global.heads)},
      {"num_key_value_heads", std::to_string(c.global.kv_heads)},
      {"head_dim", std::to_string(c.global.head_dim)},
      // From the config's doubles: c's floats would print 1e-6 as 9.99999997e-07.
      {"rms_norm_eps", mt::hf_json_number(cfg.get_float("normalization_layer_epsilon"))},
      {"rope_theta", mt::hf_json_number(cfg.get_float("rope_max_timescale"))},
      {"tie_word_embeddings", c.tied ? "true" : "false"},
      {"attention_bias", "false"},
      {"attention_dropout", "0.0"},
      // The Gemma configs default pad_token_id to 0, which gives transformers' embedding
      // padding_idx 0: fine-tuning the export there would leave row 0's input-side gradient at
      // zero (2.5% of gemma2-test's gradient norm), where mt trains every row.
      {"pad_token_id", "null"},
      {"torch_dtype",
       cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""},
      {"max_position_embeddings", std::to_string(cfg.get_int("max_position_embeddings") > 0
                                                     ? cfg.get_int("max_position_embeddings")
                                                     : cfg.get_int("max_target_length"))}};
  if (v_ == Variant::gemma) {
    m["hidden_act"] = "\"gelu_pytorch_tanh\"";
    m["rope_scaling"] = "null";
    return m;
  }
  m["hidden_activation"] = "\"gelu_pytorch_tanh\"";
  auto cap = [&](const char* key) {
    const double v = cfg.get_float(key);
    return v > 0 ? mt::hf_json_number(v) : std::string("null");
  };
  m["attn_logit_softcapping"] = cap("attn_logits_soft_cap");
  m["final_logit_softcapping"] = cap("final_logits_soft_cap");
  const double scalar = cfg.get_float("query_pre_attn_scalar") > 0
                            ? cfg.get_float("query_pre_attn_scalar")
                            : static_cast<double>(c.global.head_dim);
  m["query_pre_attn_scalar"] = whole_or_num(scalar);
  const int64_t window = cfg.get_int("sliding_window_size");
  bool any_local = false;
  for (const bool l : c.is_local) any_local = any_local || l;
  if (window == 0 && any_local)
    throw mt::UsageError(
        "sliding_window_size=0 (every layer global) has no " + std::string(display(v_)) +
        " config.json form: its local layers always have a window. Set sliding_window_pattern=1 "
        "for a model of global layers only, or a window.");
  m["sliding_window"] = std::to_string(window > 0 ? window : 4096);
  // The layer kinds spelled out (transformers 4.5x and 5 read layer_types; it wins over the
  // pattern), and Gemma 3's pattern beside it as Google's files have it.
  std::string types = "[";
  for (size_t l = 0; l < c.is_local.size(); ++l)
    types += std::string(l ? ", " : "") +
             (c.is_local[l] ? "\"sliding_attention\"" : "\"full_attention\"");
  m["layer_types"] = types + "]";
  if (v_ == Variant::gemma2) {
    m["hidden_act"] = "\"gelu_pytorch_tanh\"";
    m["rope_scaling"] = "null";
    return m;
  }
  m["sliding_window_pattern"] = std::to_string(cfg.get_int("sliding_window_pattern"));
  const double local_theta = cfg.get_float("local_rope_max_timescale");
  m["rope_local_base_freq"] =
      mt::hf_json_number(local_theta > 0 ? local_theta : cfg.get_float("rope_max_timescale"));
  const double factor = cfg.get_float("rope_linear_scaling_factor");
  if (factor != 1.0) {
    m["rope_scaling.rope_type"] = "\"linear\"";
    m["rope_scaling.factor"] = mt::hf_json_number(factor);
  } else {
    m["rope_scaling"] = "null";
  }
  return m;
}

}  // namespace

void register_gemma_family(mt::Registry& r, const std::string& name) {
  (void)variant_of(name);
  r.add_model_family(name, [name] { return std::make_unique<GemmaFamily>(name); });
}

}  // namespace mt_gemma
