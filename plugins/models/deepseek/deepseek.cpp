// The DeepSeek families, one implementation with switches:
//   deepseek_v2  DeepSeek-V2 and V2-Lite: multi-head latent attention (blocks::mla), the first
//                first_num_dense_layers layers with a dense SwiGLU MLP, the rest a mixture of
//                experts with shared experts beside the routed ones; softmax router scores, top-k
//                (within the topk_routing_group groups of highest best score when
//                n_routing_groups > 0: Hugging Face's group_limited_greedy), the chosen scores
//                as weights, times routed_scaling_factor.
//   deepseek_v3  DeepSeek-V3: the same layers; sigmoid router scores, and a per-expert bias
//                (router_bias, Hugging Face's e_score_correction_bias) added to the scores for
//                the choice only: groups ranked by the sum of their two best biased scores, the
//                top k of the biased scores within the chosen groups, weighted by their unbiased
//                scores (divided by their sum with norm_topk_prob), times routed_scaling_factor.
//                The bias gets no gradient; with routed_bias_update_rate r > 0 it is nudged
//                after each optimizer step (DecoderLayer::after_step): router_bias[e] +=
//                r x sign(mean load - load of e), the loads counted over the step's top-k
//                choices (biased, as chosen) in every micro-batch (aux-loss-free balancing).
// The expert choice is made on the host (the router's scores are read back once per layer, as
// Graph::sort_by_expert reads the choice back anyway); the weights are computed on the graph
// from the chosen experts, so the router is trained through them. Every layer is pre-norm:
// x + mla(norm(x)), then + mlp(norm(.)) or + moe(norm(.)).
#include "deepseek.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <numeric>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "mt/backend.h"
#include "mt/blocks.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/hf.h"
#include "mt/model.h"

namespace mt_deepseek {

namespace {

using mt::Activation;
using mt::ParamSpec;
using mt::Tensor;

// The family's own config keys (ModelFamily::config_schema). The keys of latent attention and
// of DeepSeek's experts are MaxText's, in base.yml.
constexpr const char* kSchema =
    "deepseek_rope_interleave: true  # the rotary embedding turns adjacent feature pairs (2i, "
    "2i + 1), as DeepSeek's weights are laid out; false = Hugging Face's rotate_half pairs (i, i "
    "+ d/2) (config.json's rope_interleave)\n"
    "deepseek_rope_attention_factor: 0.0  # yarn: cos and sin are multiplied by this (Hugging "
    "Face's attention_factor; from config.json's mscale / mscale_all_dim: 1 in every released "
    "model); 0 = 0.1 ln(rope_factor) + 1 [>=0]\n"
    "mla_naive_kvcache: false  # decode caches every head's expanded key and value (MaxText's "
    "key; its default is true) instead of the compressed latent, which a decode step attends to "
    "with the up-projections absorbed: for comparison, as it takes (2 x heads x max(nope + rope, "
    "v)) / (kv_lora_rank + rope) times the memory per token\n"
    "mtp_num_layers: 0  # DeepSeek-V3's multi-token prediction (MaxText's key): D modules after "
    "the decoder, in training only; depth k combines the previous depth's hidden state with the "
    "embeddings of the tokens k ahead, runs one decoder layer (of the last layer's kind) and the "
    "shared head predicts the token k + 1 ahead; 0 = none [>=0]\n"
    "mtp_loss_scaling_factor: 0.1  # the multi-token prediction term in the training objective: "
    "this / mtp_num_layers x the sum of the depths' mean cross-entropies (MaxText's key and "
    "default) [>=0]\n";

// yarn_get_mscale of DeepSeek's code: 0.1 m ln(factor) + 1 for factor > 1.
double yarn_mscale(double factor, double m) {
  return factor <= 1 ? 1.0 : 0.1 * m * std::log(factor) + 1.0;
}

struct DsConfig {
  bool v3 = false;
  int64_t vocab = 0, d = 0, layers = 0;
  bool tied = false;
  mt::blocks::NormSpec norm;
  mt::blocks::MlaSpec mla;
  mt::blocks::MlpSpec dense;   // the first first_dense layers' MLP
  mt::blocks::MlpSpec shared;  // the shared experts, one MLP (hidden 0: none)
  int64_t first_dense = 0;
  int64_t experts = 0, top_k = 0, moe_hidden = 0;
  int64_t groups = 0, top_groups = 0;  // 0: no groups
  bool normalize = false;
  float scaling = 1.f;
  float lb_weight = 0.f;
  float bias_rate = 0.f;  // V3: routed_bias_update_rate
  int mtp_layers = 0;     // V3: mtp_num_layers
  float mtp_scale = 0.f;  // mtp_loss_scaling_factor

  DsConfig(const mt::Config& c, bool is_v3) : v3(is_v3) {
    vocab = c.get_int("vocab_size");
    d = c.get_int("base_emb_dim");
    layers = c.get_int("base_num_decoder_layers");
    tied = c.get_bool("logits_via_embedding");
    norm.kind = mt::blocks::NormKind::rms;
    norm.eps = static_cast<float>(c.get_float("normalization_layer_epsilon"));

    mla.d_model = d;
    mla.heads = c.get_int("base_num_query_heads");
    mla.q_lora_rank = c.get_int("q_lora_rank");
    mla.kv_lora_rank = c.get_int("kv_lora_rank");
    mla.qk_nope_head_dim = c.get_int("qk_nope_head_dim");
    mla.qk_rope_head_dim = c.get_int("qk_rope_head_dim");
    mla.v_head_dim = c.get_int("v_head_dim");
    mla.naive_cache = c.get_bool("mla_naive_kvcache");
    // DeepSeek's compressed q and kv norms have epsilon 1e-6 whatever rms_norm_eps says
    // (Hugging Face's DeepseekV2RMSNorm default); the layer norms use the model's.
    mla.norm.kind = mt::blocks::NormKind::rms;
    mla.norm.eps = 1e-6f;
    mt::RopeSpec& rope = mla.rope;
    const bool yarn = c.get_string("rope_type") == "yarn";
    rope.type = yarn ? mt::RopeSpec::Type::yarn : mt::RopeSpec::Type::standard;
    rope.theta = static_cast<float>(c.get_float("rope_max_timescale"));
    rope.rotary_dim = static_cast<int>(mla.qk_rope_head_dim);
    rope.interleaved = c.get_bool("deepseek_rope_interleave");
    rope.factor = static_cast<float>(c.get_float("rope_factor"));
    rope.original_max_position = c.get_int("original_max_position_embeddings");
    rope.beta_fast = static_cast<float>(c.get_float("beta_fast"));
    rope.beta_slow = static_cast<float>(c.get_float("beta_slow"));
    rope.attention_factor = static_cast<float>(c.get_float("deepseek_rope_attention_factor"));
    mla.attn.causal = true;
    // Softmax scale: 1 / sqrt(qk head dim), times DeepSeek's yarn mscale squared.
    double scale =
        1.0 / std::sqrt(static_cast<double>(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
    const double ms = c.get_float("mscale");
    if (yarn && ms > 0) scale *= std::pow(yarn_mscale(c.get_float("rope_factor"), ms), 2);
    mla.attn.scale = static_cast<float>(scale);

    dense.d_model = d;
    dense.hidden = c.get_int("base_mlp_dim");
    dense.act = Activation::silu;
    dense.gated = true;
    first_dense = c.get_int("first_num_dense_layers");

    experts = c.get_int("num_experts");
    top_k = c.get_int("num_experts_per_tok");
    moe_hidden = c.get_int("base_moe_mlp_dim") > 0 ? c.get_int("base_moe_mlp_dim") : dense.hidden;
    shared = dense;
    shared.hidden = c.get_int("shared_experts") * moe_hidden;
    const int64_t g = c.get_int("n_routing_groups");
    groups = g > 0 ? g : 0;
    const int64_t tg = c.get_int("topk_routing_group");
    top_groups = groups ? (tg > 0 ? tg : groups) : 0;
    normalize = c.get_bool("norm_topk_prob");
    scaling = static_cast<float>(c.get_float("routed_scaling_factor"));
    lb_weight = static_cast<float>(c.get_float("load_balance_loss_weight"));
    bias_rate = static_cast<float>(c.get_float("routed_bias_update_rate"));
    mtp_layers = static_cast<int>(c.get_int("mtp_num_layers"));
    mtp_scale = static_cast<float>(c.get_float("mtp_loss_scaling_factor"));
  }
};

// A tensor's values as f32 on the host, whatever its dtype.
std::vector<float> host_floats(mt::Backend& be, const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (v.empty()) return v;
  if (t.dtype() == mt::DType::f32) {
    be.copy_to_host(t, v.data());
  } else {
    Tensor f = be.empty(t.shape(), mt::DType::f32);
    be.cast(t, f);
    be.copy_to_host(f, v.data());
  }
  return v;
}

// A [1] f32 tensor holding v (a logged metric: no gradient).
Tensor scalar(mt::Backend& be, float v) {
  Tensor t = be.empty({1}, mt::DType::f32);
  be.copy_from_host(t, &v);
  return t;
}

// Each token's top_k experts, chosen as DeepSeek does: `choice` [n, E] holds the scores the
// choice ranks (V3: biased); with groups, a token's experts come from its top_groups groups,
// ranked by the best score in each (V2) or the sum of the two best (V3), ties to the lower group.
// Ties go to the lower index. Returns [n, k] expert indices, by descending choice score. The plan
// and training run this per token and layer (deepseek3-671b: 256 experts, 58 layers): one pass
// over the candidate experts keeping the k best in order, no sort (the validated configs leave
// at least k candidates).
std::vector<int32_t> choose_experts(const DsConfig& c, const std::vector<float>& choice,
                                    int64_t n) {
  const int64_t E = c.experts, k = c.top_k;
  const int64_t groups = c.groups > 0 ? c.groups : 1, per = E / groups;
  const int64_t picked = c.groups > 0 ? c.top_groups : 1;
  std::vector<int32_t> out(static_cast<size_t>(n * k));
  std::vector<std::pair<float, int64_t>> gs(static_cast<size_t>(groups));
  std::vector<int64_t> allowed(static_cast<size_t>(picked));
  for (int64_t t = 0; t < n; ++t) {
    const float* s = choice.data() + t * E;
    if (c.groups > 0) {
      for (int64_t gi = 0; gi < groups; ++gi) {
        // The group's best two scores in one pass (V3 sums them; V2 takes the best).
        float best = -std::numeric_limits<float>::infinity(), second = best;
        for (int64_t e = gi * per; e < (gi + 1) * per; ++e) {
          if (s[e] > best) {
            second = best;
            best = s[e];
          } else if (s[e] > second) {
            second = s[e];
          }
        }
        gs[static_cast<size_t>(gi)] = {c.v3 ? best + second : best, gi};
      }
      std::partial_sort(gs.begin(), gs.begin() + picked, gs.end(),
                        [](const auto& a, const auto& b) {
                          return a.first > b.first || (a.first == b.first && a.second < b.second);
                        });
      for (int64_t j = 0; j < picked; ++j) allowed[static_cast<size_t>(j)] = gs[j].second;
      std::sort(allowed.begin(), allowed.end());  // candidates in ascending expert order
    } else {
      allowed[0] = 0;
    }
    // The k best so far, by descending score; a candidate (in ascending index order) goes after
    // those with an equal score, so ties go to the lower index.
    int32_t* top = out.data() + t * k;
    int64_t have = 0;
    for (const int64_t gi : allowed)
      for (int64_t e = gi * per; e < (gi + 1) * per; ++e) {
        const float v = s[e];
        if (have == k && !(v > s[top[k - 1]])) continue;
        int64_t at = have < k ? have++ : k - 1;
        for (; at > 0 && s[top[at - 1]] < v; --at) top[at] = top[at - 1];
        top[at] = static_cast<int32_t>(e);
      }
  }
  return out;
}

// DeepSeek's mixture of experts: x [B, T, d] (normalised) -> [B, T, d], routed experts plus
// the shared ones, and MaxText's load-balancing loss and the expert-load metrics.
mt::LayerOutput deepseek_moe(mt::Graph& g, const mt::Params& p, const DsConfig& c, const Tensor& x,
                             int layer) {
  mt::Backend& be = g.backend();
  const int64_t d = c.d, E = c.experts, k = c.top_k;
  const int64_t n = x.numel() / d, slots = n * k;
  const int64_t T = x.dim(-2), B = T ? n / T : 0;
  const Tensor x2 = g.reshape(x, {n, d});
  Tensor logits = g.matmul(x2, p["router"]);  // [n, E]
  if (logits.dtype() != mt::DType::f32) logits = g.cast(logits, mt::DType::f32);

  // Every expert's score (V3 sigmoid, V2 softmax) by the backend's route kernel (differentiable:
  // the weights and the balancing loss below use it), read back for the choice on the host.
  const Tensor all_scores = g.route(logits, 1, c.v3, false).probs;  // [n, E]
  // The memory plan traces on the core's "meta" backend, which holds no values: its scores read
  // back as zeros, and the host work on [n, E] of them (the choice, the mask, the balancing
  // counts) took minutes for deepseek3-671b at 8192 tokens. Any valid choice gives the plan
  // the same sizes: there, token t's j-th expert is (t k + j) mod E and the host values are
  // left out.
  const bool planning = be.name() == "meta";
  std::vector<int32_t> chosen;
  if (planning) {
    chosen.resize(static_cast<size_t>(slots));
    for (int64_t i = 0; i < slots; ++i)
      chosen[static_cast<size_t>(i)] = static_cast<int32_t>(i % E);
  } else {
    std::vector<float> score = host_floats(be, all_scores);
    if (c.v3) {
      const std::vector<float> bias = host_floats(be, p["router_bias"]);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t e = 0; e < E; ++e) score[static_cast<size_t>(t * E + e)] += bias[e];
    }
    chosen = choose_experts(c, score, n);
  }

  // The chosen experts' weights on the graph. Sigmoid scores, or softmax ones renormalised over
  // the chosen: the route op over logits with every other expert masked to -1e30 (a score of
  // exactly 0) picks exactly the chosen and computes their weights. Softmax scores as they are:
  // gathered from the softmax over every expert.
  Tensor weights, indices;
  if (c.v3 || c.normalize) {
    Tensor m = be.empty({n, E}, mt::DType::f32);
    if (!planning) {
      std::vector<float> mask(static_cast<size_t>(n * E), -1e30f);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < k; ++j) mask[static_cast<size_t>(t * E + chosen[t * k + j])] = 0.f;
      if (n) be.copy_from_host(m, mask.data());
    }
    const mt::Graph::Routing r = g.route(g.add(logits, m), static_cast<int>(k), c.v3, c.normalize);
    weights = r.weights;
    indices = r.indices;
  } else {
    std::vector<int32_t> flat(static_cast<size_t>(slots));
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < k; ++j)
        flat[t * k + j] = static_cast<int32_t>(t * E + chosen[t * k + j]);
    Tensor fi = be.empty({slots}, mt::DType::i32);
    if (slots) be.copy_from_host(fi, flat.data());
    weights = g.reshape(g.gather_rows(g.reshape(all_scores, {n * E, 1}), fi), {n, k});
    indices = be.empty({n, k}, mt::DType::i32);
    if (slots) be.copy_from_host(indices, chosen.data());
  }
  if (c.scaling != 1.f) weights = g.scale(weights, c.scaling);

  // Dispatch: token copies sorted by expert, one grouped matmul per projection, combined with
  // the weights by one weighted scatter-add.
  const mt::Graph::ExpertOrder order = g.sort_by_expert(indices, E);
  const int64_t m = order.slots.numel();
  const Tensor xs = g.gather_rows(x2, order.tokens);
  mt::blocks::MoeSpec spec;  // SwiGLU experts
  spec.d_model = d;
  spec.hidden = c.moe_hidden;
  spec.num_experts = E;
  spec.top_k = k;
  const Tensor ys = mt::blocks::moe_expert_mlp(g, p, spec, xs, order.offsets, order.counts);
  const Tensor ws = g.reshape(g.gather_rows(g.reshape(weights, {slots, 1}), order.slots), {m});
  mt::LayerOutput out;
  out.x = g.reshape(g.scatter_add_rows(ys, order.tokens, ws, n), x.shape());
  if (c.shared.hidden > 0) out.x = g.add(out.x, mt::blocks::mlp(g, p, c.shared, x, "shared_"));
  if (!g.wants_aux()) return out;  // inference: no losses, metrics or statistics to read

  // MaxText's load balancing per sequence, on the unbiased scores: E / B * sum over sequences
  // and experts of (slots of the expert / T) * (mean score of the expert). V3's sigmoid scores
  // are normalised over the experts first (DeepSeek-V3's s' = s / sum s, eq. 19), as softmax
  // ones are: raw sigmoids gave k E / 2 at uniform routing, not k, and a gradient lowering
  // every routed expert's logit, which the renormalised weights barely feel (the loss fell to
  // 0.06 with nothing balanced).
  std::vector<float> cw(planning ? 0 : static_cast<size_t>(n * E), 0.f);
  std::vector<float> per_expert(static_cast<size_t>(E));
  for (int64_t b = 0; b < (planning ? 0 : B); ++b) {
    std::vector<int64_t> count(static_cast<size_t>(E), 0);
    for (int64_t i = b * T * k; i < (b + 1) * T * k; ++i) ++count[static_cast<size_t>(chosen[i])];
    // The same factor for every token of the sequence: computed once, copied to each row.
    for (int64_t e = 0; e < E; ++e)
      per_expert[static_cast<size_t>(e)] = static_cast<float>(
          static_cast<double>(E) * static_cast<double>(count[e]) /
          (static_cast<double>(T) * static_cast<double>(T) * static_cast<double>(B)));
    for (int64_t t = b * T; t < (b + 1) * T; ++t)
      std::copy(per_expert.begin(), per_expert.end(), cw.begin() + t * E);
  }
  Tensor lb_scores = all_scores;
  if (c.v3) {
    // s' from the route op over every expert (differentiable), in each token's descending
    // order: the factors follow that order.
    const mt::Graph::Routing every = g.route(logits, static_cast<int>(E), true, true);
    lb_scores = every.weights;
    if (n && !planning) {
      std::vector<int32_t> order_e(static_cast<size_t>(n * E));
      be.copy_to_host(every.indices, order_e.data());
      std::vector<float> by_order(cw.size());
      for (int64_t i = 0; i < n * E; ++i)
        by_order[static_cast<size_t>(i)] =
            cw[static_cast<size_t>(i / E * E + order_e[static_cast<size_t>(i)])];
      cw.swap(by_order);
    }
  }
  Tensor ct = be.empty({n, E}, mt::DType::f32);
  if (n && !planning) be.copy_from_host(ct, cw.data());
  Tensor ones_n = be.empty({1, n}, mt::DType::f32), ones_e = be.empty({E, 1}, mt::DType::f32);
  be.fill(ones_n, 1.f);
  be.fill(ones_e, 1.f);
  const Tensor lb = g.reshape(g.matmul(g.matmul(ones_n, g.mul(lb_scores, ct)), ones_e), {1});
  out.aux.push_back({"moe_lb_loss", lb, c.lb_weight});
  // The least and most loaded expert's share of the layer's token-slots (logged, not trained).
  const auto [lo, hi] = std::minmax_element(order.routed.begin(), order.routed.end());
  const float share = slots ? 1.f / static_cast<float>(slots) : 0.f;
  const std::string tag = "/" + std::to_string(layer);
  out.aux.push_back({"moe_load_min" + tag, scalar(be, static_cast<float>(*lo) * share), 0.f});
  out.aux.push_back({"moe_load_max" + tag, scalar(be, static_cast<float>(*hi) * share), 0.f});
  // The step's loads from the slots summed over micro-batches and ranks (the trainer's).
  out.stats.push_back(
      {"moe_slots" + tag, std::vector<double>(order.routed.begin(), order.routed.end())});
  // V3: each expert's token-slots, for the router_bias update after the step (after_step).
  if (c.v3) {
    std::vector<double> load(static_cast<size_t>(E), 0.0);
    for (const int32_t e : chosen) load[static_cast<size_t>(e)] += 1.0;
    out.stats.push_back({"expert_load", std::move(load)});
  }
  return out;
}

// Expert weights [E, in, out]: each expert's matrix initialised as a dense one; a token uses
// top_k of the E. Read only through Graph::grouped_project (ParamSpec::projection), so
// inference may store them transposed or as int8 rows.
ParamSpec expert_param(const DsConfig& c, const std::string& name, int64_t in, int64_t out) {
  ParamSpec ps = mt::blocks::dense_param(name, in, out);
  ps.projection = true;
  ps.shape = {c.experts, in, out};
  ps.active = static_cast<float>(c.top_k) / static_cast<float>(c.experts);
  return ps;
}

class DsLayer final : public mt::DecoderLayer {
 public:
  DsLayer(const DsConfig& c, bool sparse, int index) : c_(c), sparse_(sparse), index_(index) {}

  std::vector<ParamSpec> parameters() const override {
    std::vector<ParamSpec> r = mt::blocks::norm_params("attn_norm", c_.d, c_.norm);
    for (auto& p : mt::blocks::mla_params(c_.mla)) r.push_back(p);
    for (auto& p : mt::blocks::norm_params("mlp_norm", c_.d, c_.norm)) r.push_back(p);
    if (!sparse_) {
      for (auto& p : mt::blocks::mlp_params(c_.dense)) r.push_back(p);
      return r;
    }
    r.push_back(mt::blocks::dense_param("router", c_.d, c_.experts));
    if (c_.v3)  // the selection bias: no gradient, no weight decay, not a matmul
      r.push_back({"router_bias", {c_.experts}, mt::Init::zeros, 0.f, false, false});
    r.push_back(expert_param(c_, "w_gate", c_.d, c_.moe_hidden));
    r.push_back(expert_param(c_, "w_up", c_.d, c_.moe_hidden));
    r.push_back(expert_param(c_, "w_down", c_.moe_hidden, c_.d));
    if (c_.shared.hidden > 0)
      for (auto& p : mt::blocks::mlp_params(c_.shared, "shared_")) r.push_back(p);
    return r;
  }

  mt::LayerOutput forward(mt::Graph& g, const mt::Params& p, const Tensor& x,
                          const mt::LayerInputs& in) const override {
    using namespace mt::blocks;
    Tensor r = g.add(x, mla(g, p, c_.mla, norm(g, p, "attn_norm", x, c_.norm), in));
    Tensor h = norm(g, p, "mlp_norm", r, c_.norm);
    if (!sparse_) return g.add(r, mlp(g, p, c_.dense, h));
    mt::LayerOutput o = deepseek_moe(g, p, c_, h, index_);
    o.x = g.add(r, o.x);
    return o;
  }

  mt::CacheSpec cache_spec() const override { return mt::blocks::mla_cache_spec(c_.mla); }

  // V3's aux-loss-free balancing: router_bias[e] += rate x sign(mean load - load of e), the
  // loads summed over the step's micro-batches; an expert at the mean keeps its bias.
  void after_step(mt::Backend& be, const mt::Params& p,
                  const mt::LayerStats& stats) const override {
    if (!sparse_ || !c_.v3 || c_.bias_rate == 0.f) return;
    const auto it = stats.find("expert_load");
    if (it == stats.end()) return;
    const std::vector<double>& load = it->second;
    MT_CHECK(static_cast<int64_t>(load.size()) == c_.experts,
             "deepseek after_step: expert_load has " + std::to_string(load.size()) +
                 " values for " + std::to_string(c_.experts) + " experts");
    double total = 0;
    for (const double l : load) total += l;
    const double mean = total / static_cast<double>(c_.experts);
    Tensor bias = p["router_bias"];
    std::vector<float> b = host_floats(be, bias);
    for (size_t e = 0; e < b.size(); ++e) {
      const float sign = load[e] < mean ? 1.f : load[e] > mean ? -1.f : 0.f;
      b[e] += c_.bias_rate * sign;
    }
    if (bias.dtype() == mt::DType::f32) {
      be.copy_from_host(bias, b.data());
    } else {
      Tensor f = be.empty(bias.shape(), mt::DType::f32);
      be.copy_from_host(f, b.data());
      be.cast(f, bias);
    }
  }

 private:
  DsConfig c_;
  bool sparse_;
  int index_;
};

class DsModel final : public mt::Model {
 public:
  DsModel(const mt::Config& cfg, bool v3) : c_(cfg, v3) {
    for (int64_t i = 0; i < c_.layers; ++i)
      layers_.push_back(std::make_unique<DsLayer>(c_, i >= c_.first_dense, static_cast<int>(i)));
    // Multi-token prediction layers are of the last decoder layer's kind (MaxText's choice; in
    // DeepSeek-V3 a MoE layer), numbered after the decoder's for their load metrics.
    for (int k = 1; k <= c_.mtp_layers; ++k)
      mtp_layers_.push_back(std::make_unique<DsLayer>(c_, c_.layers > c_.first_dense,
                                                      static_cast<int>(c_.layers) + k - 1));
  }

  mt::ModelDims dims() const override {
    mt::ModelDims m;
    m.vocab_size = c_.vocab;
    m.d_model = c_.d;
    m.num_layers = c_.layers;
    m.num_query_heads = c_.mla.heads;
    m.num_kv_heads = c_.mla.heads;
    // The head size the attention kernels run at (query/key and value heads padded to one).
    m.head_dim = std::max(c_.mla.qk_nope_head_dim + c_.mla.qk_rope_head_dim, c_.mla.v_head_dim);
    int64_t widest = c_.first_dense > 0 ? c_.dense.hidden : 0;
    if (c_.first_dense < c_.layers)
      widest = std::max(widest, c_.top_k * c_.moe_hidden + c_.shared.hidden);
    m.mlp_dim = widest;
    return m;
  }

  // The default counts attention's two products at dims().head_dim, the padded width; latent
  // attention's scores are qk_nope + qk_rope wide and its values v_head_dim (MaxText's
  // calculate_mla_tflops_per_device: 3 x seq x heads x (qk + v) per token and layer, causal).
  double flops_per_token(int64_t seq_len) const override {
    const mt::ModelDims d = dims();
    const double widths = static_cast<double>(c_.mla.qk_nope_head_dim + c_.mla.qk_rope_head_dim +
                                              c_.mla.v_head_dim - 2 * d.head_dim);
    const double keys = static_cast<double>(seq_len) / 2;
    const double layers = static_cast<double>(c_.layers + c_.mtp_layers);
    return mt::Model::flops_per_token(seq_len) +
           layers * 6.0 * static_cast<double>(c_.mla.heads) * widths * keys;
  }

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
  Tensor head(mt::Graph& g, const mt::Params& top, const Tensor& hidden) const override {
    return mt::blocks::decoder_head(g, top, hidden, c_.norm, c_.tied);
  }

  // Multi-token prediction: h' = W [RMSNorm_e(embedding); RMSNorm_h(hidden)], the embedding
  // first, as DeepSeek-V3's released eh_proj and MaxText's current layer order them (the
  // paper writes [h; e]: the same model up to a permutation of W's rows).
  int mtp_depths() const override { return c_.mtp_layers; }
  float mtp_loss_scale() const override { return c_.mtp_scale; }
  std::vector<ParamSpec> mtp_parameters(int) const override {
    std::vector<ParamSpec> r = mt::blocks::norm_params("mtp_embedding_norm", c_.d, c_.norm);
    for (auto& p : mt::blocks::norm_params("mtp_hidden_norm", c_.d, c_.norm)) r.push_back(p);
    r.push_back(mt::blocks::dense_param("mtp_projection", 2 * c_.d, c_.d));
    return r;
  }
  const mt::DecoderLayer& mtp_layer(int depth) const override {
    return *mtp_layers_.at(static_cast<size_t>(depth - 1));
  }
  Tensor mtp_combine(mt::Graph& g, const mt::Params& p, const Tensor& hidden,
                     const Tensor& embedded, int) const override {
    using mt::blocks::norm;
    const Tensor cat = g.concat({norm(g, p, "mtp_embedding_norm", embedded, c_.norm),
                                 norm(g, p, "mtp_hidden_norm", hidden, c_.norm)});
    const Tensor flat = g.reshape(cat, {cat.numel() / (2 * c_.d), 2 * c_.d});
    return g.reshape(g.matmul(flat, p["mtp_projection"]), hidden.shape());
  }

  // Hugging Face's names (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM); experts per expert
  // (mlp.experts.<e>.<proj>.weight, what save_pretrained writes), stacked [E, in, out].
  HfName hf_name(const std::string& n) const override {
    if (HfName top; mt::hf_causal_lm_top(n, c_.tied, top)) return top;
    std::string index, p;  // "layers.<i>.<param>"
    if (!mt::hf_split_layer(n, index, p)) return {};
    const int64_t i = mt::hf_layer_number(index);
    if (i < 0 || i >= c_.layers) return {};
    const std::string prefix = "model.layers." + index + ".";
    static const mt::HfNameTable kNames = {
        {"attn_norm", {"input_layernorm.weight", false}},
        {"mlp_norm", {"post_attention_layernorm.weight", false}},
        {"wq", {"self_attn.q_proj.weight", true}},
        {"wq_a", {"self_attn.q_a_proj.weight", true}},
        {"q_norm", {"self_attn.q_a_layernorm.weight", false}},
        {"wq_b", {"self_attn.q_b_proj.weight", true}},
        {"wkv_a", {"self_attn.kv_a_proj_with_mqa.weight", true}},
        {"kv_norm", {"self_attn.kv_a_layernorm.weight", false}},
        {"wkv_b", {"self_attn.kv_b_proj.weight", true}},
        {"wo", {"self_attn.o_proj.weight", true}},
        {"router", {"mlp.gate.weight", true}},
        {"router_bias", {"mlp.gate.e_score_correction_bias", false}},
        {"shared_w_gate", {"mlp.shared_experts.gate_proj.weight", true}},
        {"shared_w_up", {"mlp.shared_experts.up_proj.weight", true}},
        {"shared_w_down", {"mlp.shared_experts.down_proj.weight", true}}};
    if (kNames.count(p)) return mt::hf_from_table(kNames, p, prefix);
    if (p != "w_gate" && p != "w_up" && p != "w_down") return {};
    const std::string proj = p == "w_gate" ? "gate_proj" : p == "w_up" ? "up_proj" : "down_proj";
    if (i < c_.first_dense) return mt::hf_tensor(prefix + "mlp." + proj + ".weight", true);
    return mt::hf_experts(prefix + "mlp.experts.", c_.experts, "." + proj + ".weight");
  }

 private:
  DsConfig c_;
  std::vector<std::unique_ptr<DsLayer>> layers_;
  std::vector<std::unique_ptr<DsLayer>> mtp_layers_;
};

class DsFamily final : public mt::ModelFamily {
 public:
  explicit DsFamily(std::string name) : name_(std::move(name)), v3_(name_ == "deepseek_v3") {}

  std::string name() const override { return name_; }
  std::string config_schema() const override { return kSchema; }

  void validate(const mt::Config& c) const override {
    const std::string fam = "the " + name_ + " family";
    const int64_t d = c.get_int("base_emb_dim");
    const std::string width = "base_emb_dim=" + std::to_string(d);
    if (c.get_int("kv_lora_rank") > d)
      c.reject("kv_lora_rank", "must be at most the model width " + width +
                                   ": the latent compresses each token's keys and values.");
    if (c.get_int("q_lora_rank") > d)
      c.reject("q_lora_rank",
               "must be at most the model width " + width + " (0 = no query compression).");
    if (c.get_int("qk_rope_head_dim") % 2 != 0)
      c.reject("qk_rope_head_dim", "must be even: the rotary embedding turns pairs of features.");
    if (c.get_int("base_num_kv_heads") != c.get_int("base_num_query_heads"))
      c.reject("base_num_kv_heads",
               "must equal base_num_query_heads=" +
                   std::to_string(c.get_int("base_num_query_heads")) + " for " + fam +
                   ": latent attention expands a key and a value for every query head.");
    if (c.get_float("partial_rotary_factor") != 1.0)
      c.reject("partial_rotary_factor",
               "must be 1.0 for " + fam + ": qk_rope_head_dim says which features are rotated.");
    if (c.get_string("rope_type") == "llama3.1")
      c.reject("rope_type", "must be default or yarn for " + fam + ".");
    const auto acts = c.get_string_list("mlp_activations");
    if (acts.size() != 2 || acts[0] != "silu" || acts[1] != "linear")
      c.reject("mlp_activations", "must be [silu, linear] for " + fam + " (SwiGLU).");
    for (const char* k : {"attn_logits_soft_cap", "final_logits_soft_cap"})
      if (c.get_float(k) != 0.0) c.reject(k, "must be 0.0 for " + fam + ": DeepSeek has none.");
    if (c.get_int("sliding_window_size") != 0)
      c.reject("sliding_window_size", "must be 0 for " + fam +
                                          ": every layer attends to the "
                                          "whole context.");
    if (!v3_ && c.get_float("routed_bias_update_rate") != 0.0)
      c.reject("routed_bias_update_rate",
               "must be 0.0 for " + fam +
                   ": it updates DeepSeek-V3's router_bias (decoder_block=deepseek_v3); V2 "
                   "routes without one.");
    const int64_t mtp = c.get_int("mtp_num_layers");
    if (mtp < 0)
      c.reject("mtp_num_layers",
               "must be 0 (no multi-token prediction) or a positive number of "
               "prediction depths.");
    if (mtp > 0 && c.has("max_target_length") && mtp >= c.get_int("max_target_length"))
      c.reject("mtp_num_layers",
               "must be below max_target_length=" + std::to_string(c.get_int("max_target_length")) +
                   ": depth k predicts the token k + 1 positions ahead, so the depths from there "
                   "on would have no target (their losses read 0 and thin mtp_loss's mean) and "
                   "cost a layer each.");
    if (!v3_ && mtp > 0)
      c.reject("mtp_num_layers",
               "must be 0 for " + fam +
                   ": multi-token prediction is DeepSeek-V3's (decoder_block=deepseek_v3).");
    if (c.get_float("mtp_loss_scaling_factor") < 0)
      c.reject("mtp_loss_scaling_factor", "must be >= 0: it weighs a loss in the objective.");
    if (c.get_float("capacity_factor") > 0)
      c.reject("capacity_factor",
               "must be <= 0 for " + fam + ": its mixture of experts is dropless in mt for now.");
    const int64_t layers = c.get_int("base_num_decoder_layers");
    const int64_t first = c.get_int("first_num_dense_layers");
    if (first > layers)
      c.reject("first_num_dense_layers",
               "must be at most base_num_decoder_layers=" + std::to_string(layers) + ".");
    if (first == layers) return;  // no expert layers: the routing keys are not read
    const int64_t E = c.get_int("num_experts"), k = c.get_int("num_experts_per_tok");
    if (k > E)
      c.reject("num_experts_per_tok", "must be at most num_experts=" + std::to_string(E) +
                                          ": each token is routed to that many distinct experts.");
    const int64_t groups = c.get_int("n_routing_groups"), tg = c.get_int("topk_routing_group");
    if (groups == 0)
      c.reject("n_routing_groups", "must be -1 (no groups) or a positive divisor of num_experts.");
    if (groups > 0) {
      if (E % groups != 0)
        c.reject("n_routing_groups", "must divide num_experts=" + std::to_string(E) + ": the " +
                                         std::to_string(groups) +
                                         " routing groups each hold as many experts.");
      if (v3_ && E / groups < 2)
        c.reject("n_routing_groups", "leaves fewer than 2 experts per group; " + fam +
                                         " ranks a group by the sum of its two best scores.");
      if (tg == 0 || tg > groups)
        c.reject("topk_routing_group",
                 "must be -1 (all) or from 1 to n_routing_groups=" + std::to_string(groups) + ".");
      const int64_t reach = (tg > 0 ? tg : groups) * (E / groups);
      if (k > reach)
        c.reject("num_experts_per_tok", "must be at most the " + std::to_string(reach) +
                                            " experts of a token's topk_routing_group groups.");
    } else if (tg > 0) {
      c.reject("topk_routing_group", "needs n_routing_groups > 0 (there are no groups).");
    }
  }

  std::unique_ptr<mt::Model> build(const mt::Config& c) const override {
    validate(c);
    return std::make_unique<DsModel>(c, v3_);
  }

  std::vector<std::string> from_hf_config(const mt::HfConfig& hf,
                                          std::vector<std::string>& unused) const override;
  std::map<std::string, std::string> to_hf_config(const mt::Config& cfg) const override;

 private:
  std::string name_;
  bool v3_;
};

std::vector<std::string> DsFamily::from_hf_config(const mt::HfConfig& hf,
                                                  std::vector<std::string>& unused) const {
  const std::string display = v3_ ? "DeepSeek-V3" : "DeepSeek-V2";
  const std::string who = "mt's " + name_ + " family";
  auto get = [&](const std::string& k) { return mt::hf_get(hf, k); };
  std::set<std::string> used;
  auto need = [&](const std::string& k) -> const std::string& {
    used.insert(k);
    return mt::hf_need(hf, k, display);
  };
  auto use = [&](const std::string& k) {
    used.insert(k);
    return get(k);
  };
  auto refuse = [&](const std::string& k, const std::string& v, const std::string& what) {
    mt::hf_refuse(k, v, what, who);
  };
  // A boolean field (marked used): `absent` when config.json has none; refused unless a boolean.
  auto flag = [&](const std::string& k, bool absent) {
    used.insert(k);
    return mt::hf_flag(hf, k, absent);
  };

  if (const std::string* a = use("hidden_act"); a && *a != "silu")
    refuse("hidden_act", *a, "an MLP activation other than silu (SwiGLU)");
  for (const char* k : {"attention_bias", "mlp_bias"})
    if (flag(k, false)) refuse(k, "true", "biases on the projections");
  const std::string& heads = need("num_attention_heads");
  if (const std::string* kv = use("num_key_value_heads"); kv && *kv != heads)
    refuse("num_key_value_heads", *kv,
           "key/value heads other than num_attention_heads=" + heads +
               " (latent attention expands a key and value for every head)");

  std::vector<std::string> o = {"decoder_block=" + name_};
  o.push_back("vocab_size=" + need("vocab_size"));
  o.push_back("base_emb_dim=" + need("hidden_size"));
  o.push_back("base_mlp_dim=" + need("intermediate_size"));
  o.push_back("base_num_decoder_layers=" + need("num_hidden_layers"));
  o.push_back("base_num_query_heads=" + heads);
  o.push_back("base_num_kv_heads=" + heads);
  mt::hf_refuse_null(hf, "rms_norm_eps");
  const std::string* eps = use("rms_norm_eps");
  o.push_back("normalization_layer_epsilon=" + (eps ? *eps : std::string("1e-06")));
  o.push_back(std::string("logits_via_embedding=") +
              (flag("tie_word_embeddings", false) ? "true" : "false"));
  if (const std::string* v = use("max_position_embeddings"))
    o.push_back("max_position_embeddings=" + *v);
  // Latent attention. q_lora_rank null: no query compression (V2-Lite).
  const std::string* ql = use("q_lora_rank");
  o.push_back("q_lora_rank=" + (ql ? *ql : std::string("0")));
  for (const char* k : {"kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"})
    o.push_back(std::string(k) + "=" + need(k));
  // Derived fields transformers writes (head_dim = qk_rope_head_dim, qk_head_dim).
  use("head_dim");
  use("qk_head_dim");
  const bool interleave = flag("rope_interleave", true);
  o.push_back(std::string("deepseek_rope_interleave=") + (!v3_ || interleave ? "true" : "false"));
  if (!v3_ && !interleave)
    refuse("rope_interleave", "false", "DeepSeek-V2 with rotate_half pairs (V2 interleaves)");

  // Rotary embedding: transformers 5's rope_parameters, or transformers 4's rope_theta and
  // rope_scaling.
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
  used.insert("rope_theta");
  o.push_back("rope_max_timescale=" + (theta ? *theta : std::string("10000.0")));
  const std::string* rt = get(rp + "rope_type");
  if (!rt) rt = get(rp + "type");
  std::vector<std::string> rope_fields = {"rope_type", "type", "rope_theta"};
  if (rt && *rt == "yarn") {
    const std::string* f = get(rp + "factor");
    const std::string* orig = get(rp + "original_max_position_embeddings");
    if (!f || !orig)
      throw mt::UsageError("config.json's yarn rotary embedding needs " + rp + "factor and " + rp +
                           "original_max_position_embeddings.");
    const double factor = mt::hf_number(rp + "factor", *f);
    o.push_back("rope_type=yarn");
    o.push_back("rope_factor=" + *f);
    o.push_back("original_max_position_embeddings=" + *orig);
    if (const std::string* v = get(rp + "beta_fast")) o.push_back("beta_fast=" + *v);
    if (const std::string* v = get(rp + "beta_slow")) o.push_back("beta_slow=" + *v);
    if (!mt::hf_flag(hf, rp + "truncate", true))
      refuse(rp + "truncate", "false", "a yarn correction range that is not truncated");
    // transformers: cos and sin times attention_factor, else mscale(factor, mscale) /
    // mscale(factor, mscale_all_dim) when both are set, else mscale(factor, 1); the softmax
    // scale times mscale(factor, mscale_all_dim)^2 when that is set.
    const std::string* af = get(rp + "attention_factor");
    const std::string* ms = get(rp + "mscale");
    const std::string* msa = get(rp + "mscale_all_dim");
    const double m = ms ? mt::hf_number(rp + "mscale", *ms) : 0,
                 ma = msa ? mt::hf_number(rp + "mscale_all_dim", *msa) : 0;
    double factor_cs = 0;  // 0: mt's default, mscale(factor, 1)
    if (af)
      factor_cs = mt::hf_number(rp + "attention_factor", *af);
    else if (m != 0 && ma != 0)
      factor_cs = yarn_mscale(factor, m) / yarn_mscale(factor, ma);
    if (factor_cs != 0)
      o.push_back("deepseek_rope_attention_factor=" + mt::hf_json_number(factor_cs));
    o.push_back("mscale=" + mt::hf_json_number(ma));
    for (const char* x : {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
                          "attention_factor", "mscale", "mscale_all_dim", "truncate"})
      rope_fields.push_back(x);
  } else if (rt && *rt != "default") {
    refuse(rp + "rope_type", *rt, "a rotary embedding type other than default and yarn");
  }
  for (const auto& [k, v] : hf) {
    if (k.rfind(rp, 0) != 0 || v == "null") continue;
    if (std::find(rope_fields.begin(), rope_fields.end(), k.substr(rp.size())) == rope_fields.end())
      refuse(k, v,
             "a rotary embedding setting" + (rt ? " of rope type '" + *rt + "'" : std::string()));
  }

  // Experts. transformers 5 writes n_routed_experts; its aliases num_experts (V2) and
  // num_local_experts (V3) are read too.
  const std::string* ne = use("n_routed_experts");
  if (!ne) ne = use(v3_ ? "num_local_experts" : "num_experts");
  if (!ne)
    throw mt::UsageError("config.json has no 'n_routed_experts', which a " + display +
                         " model needs.");
  o.push_back("num_experts=" + *ne);
  o.push_back("num_experts_per_tok=" + need("num_experts_per_tok"));
  o.push_back("base_moe_mlp_dim=" + need("moe_intermediate_size"));
  const std::string* ns = use("n_shared_experts");
  o.push_back("shared_experts=" + (ns ? *ns : std::string("0")));
  const std::string* fk = use("first_k_dense_replace");
  o.push_back("first_num_dense_layers=" + (fk ? *fk : std::string("0")));
  // Absent fields take the transformers classes' defaults, which differ between the versions
  // (DeepseekV2Config: 1.0 and norm_topk_prob false; DeepseekV3Config: 2.5 and true).
  const std::string* rs = use("routed_scaling_factor");
  o.push_back("routed_scaling_factor=" + (rs ? *rs : std::string(v3_ ? "2.5" : "1.0")));
  if (const std::string* f = use("moe_layer_freq"); f && *f != "1")
    refuse("moe_layer_freq", *f, "expert layers other than every layer after the dense ones");
  const std::string* tm = use("topk_method");
  const std::string* sf = use("scoring_func");
  bool grouped = v3_;
  if (!v3_) {
    if (tm && *tm != "greedy" && *tm != "group_limited_greedy")
      refuse("topk_method", *tm,
             "a DeepSeek-V2 expert choice other than greedy and "
             "group_limited_greedy");
    if (sf && *sf != "softmax") refuse("scoring_func", *sf, "DeepSeek-V2 with non-softmax scores");
    // transformers' DeepseekV2 ignores norm_topk_prob and DeepSeek's own code applies it, so
    // the model a true value means is ambiguous (every released V2 model has false).
    if (flag("norm_topk_prob", false))
      refuse("norm_topk_prob", "true",
             "renormalised DeepSeek-V2 routing weights (transformers ignores the field, "
             "DeepSeek's code applies it)");
    o.push_back("norm_topk_prob=false");
    grouped = tm && *tm == "group_limited_greedy";
  } else {
    if (tm && *tm != "noaux_tc")
      refuse("topk_method", *tm, "a DeepSeek-V3 choice other than noaux_tc");
    if (sf && *sf != "sigmoid") refuse("scoring_func", *sf, "DeepSeek-V3 with non-sigmoid scores");
    o.push_back(std::string("norm_topk_prob=") + (flag("norm_topk_prob", true) ? "true" : "false"));
  }
  const std::string* ng = use("n_group");
  const std::string* tg = use("topk_group");
  if (grouped) {
    if (!ng || !tg)
      throw mt::UsageError(
          "config.json's group-limited expert choice needs n_group and "
          "topk_group.");
    o.push_back("n_routing_groups=" + *ng);
    o.push_back("topk_routing_group=" + *tg);
  } else {
    o.push_back("n_routing_groups=-1");
    o.push_back("topk_routing_group=-1");
  }
  if (const std::string* c = use("aux_loss_alpha")) o.push_back("load_balance_loss_weight=" + *c);

  // Multi-token prediction modules: transformers builds none (it skips their weights), and
  // neither does mt yet; the main model's logits do not depend on them.
  use("num_nextn_predict_layers");
  use("num_mtp_layers");

  // Fields that change the computation in other families: refused with their name.
  static const char* const kNumerics[] = {
      "attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "use_sliding_window",
      "query_pre_attn_scalar",  "partial_rotary_factor",   "qk_layernorm",   "use_qk_norm"};
  for (const char* k : kNumerics) {
    const std::string* v = use(k);
    if (!v || *v == "false" || *v == "0" || *v == "0.0" || *v == "1.0" || *v == "[]") continue;
    refuse(k, *v, "a setting of another architecture");
  }
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
                                           "pretraining_tp",
                                           "output_router_logits",
                                           "seq_aux",
                                           "ep_size",
                                           "auto_map",
                                           "quantization_config",
                                           "experts_implementation"};
  for (const char* k : kIgnorable) used.insert(k);
  for (const auto& [k, v] : hf) {
    const bool rope = k.rfind("rope_scaling", 0) == 0 || k.rfind("rope_parameters", 0) == 0;
    if (!rope && !used.count(k)) unused.push_back(k + "=" + v);
  }
  return o;
}

std::map<std::string, std::string> DsFamily::to_hf_config(const mt::Config& cfg) const {
  const DsConfig c(cfg, v3_);
  // transformers 5's form (rope_parameters): it is the one both DeepseekV2Config and
  // DeepseekV3Config read without conversion.
  std::map<std::string, std::string> m = {
      {"architectures", v3_ ? "[\"DeepseekV3ForCausalLM\"]" : "[\"DeepseekV2ForCausalLM\"]"},
      {"model_type", v3_ ? "\"deepseek_v3\"" : "\"deepseek_v2\""},
      {"vocab_size", std::to_string(c.vocab)},
      {"hidden_size", std::to_string(c.d)},
      {"intermediate_size", std::to_string(c.dense.hidden)},
      {"moe_intermediate_size", std::to_string(c.moe_hidden)},
      {"num_hidden_layers", std::to_string(c.layers)},
      {"num_attention_heads", std::to_string(c.mla.heads)},
      {"num_key_value_heads", std::to_string(c.mla.heads)},
      {"q_lora_rank", c.mla.q_lora_rank > 0 ? std::to_string(c.mla.q_lora_rank) : "null"},
      {"kv_lora_rank", std::to_string(c.mla.kv_lora_rank)},
      {"qk_nope_head_dim", std::to_string(c.mla.qk_nope_head_dim)},
      {"qk_rope_head_dim", std::to_string(c.mla.qk_rope_head_dim)},
      {"v_head_dim", std::to_string(c.mla.v_head_dim)},
      {"n_routed_experts", std::to_string(c.experts)},
      {"num_experts_per_tok", std::to_string(c.top_k)},
      {"n_shared_experts", std::to_string(cfg.get_int("shared_experts"))},
      {"first_k_dense_replace", std::to_string(c.first_dense)},
      {"routed_scaling_factor", mt::hf_json_number(cfg.get_float("routed_scaling_factor"))},
      {"norm_topk_prob", c.normalize ? "true" : "false"},
      {"hidden_act", "\"silu\""},
      {"rms_norm_eps", mt::hf_json_number(cfg.get_float("normalization_layer_epsilon"))},
      {"tie_word_embeddings", c.tied ? "true" : "false"},
      {"attention_bias", "false"},
      {"rope_parameters.rope_theta", mt::hf_json_number(cfg.get_float("rope_max_timescale"))},
      {"dtype", cfg.get_string("weight_dtype") == "bfloat16" ? "\"bfloat16\"" : "\"float32\""},
      {"max_position_embeddings", std::to_string(cfg.get_int("max_position_embeddings") > 0
                                                     ? cfg.get_int("max_position_embeddings")
                                                     : cfg.get_int("max_target_length"))}};
  if (v3_) {
    m["n_group"] = std::to_string(c.groups > 0 ? c.groups : 1);
    m["topk_group"] = std::to_string(c.groups > 0 ? c.top_groups : 1);
    m["rope_interleave"] = c.mla.rope.interleaved ? "true" : "false";
    m["num_mtp_layers"] = "0";
    // As DeepSeek's own config.json says them (transformers implies them; other readers,
    // llama.cpp's converter among them, read them).
    m["scoring_func"] = "\"sigmoid\"";
    m["topk_method"] = "\"noaux_tc\"";
  } else {
    if (c.normalize)
      throw mt::UsageError(
          "norm_topk_prob=true has no DeepSeek-V2 config.json form that "
          "transformers honours; the deepseek_v2 family exports false only.");
    if (!c.mla.rope.interleaved)
      throw mt::UsageError("deepseek_rope_interleave=false has no DeepSeek-V2 config.json form.");
    m["topk_method"] = c.groups > 0 ? "\"group_limited_greedy\"" : "\"greedy\"";
    m["n_group"] = c.groups > 0 ? std::to_string(c.groups) : "null";
    m["topk_group"] = c.groups > 0 ? std::to_string(c.top_groups) : "null";
  }
  if (c.mla.rope.type == mt::RopeSpec::Type::yarn) {
    m["rope_parameters.rope_type"] = "\"yarn\"";
    m["rope_parameters.factor"] = mt::hf_json_number(cfg.get_float("rope_factor"));
    m["rope_parameters.beta_fast"] = mt::hf_json_number(cfg.get_float("beta_fast"));
    m["rope_parameters.beta_slow"] = mt::hf_json_number(cfg.get_float("beta_slow"));
    m["rope_parameters.original_max_position_embeddings"] =
        std::to_string(c.mla.rope.original_max_position);
    const double af = cfg.get_float("deepseek_rope_attention_factor");
    if (af > 0) m["rope_parameters.attention_factor"] = mt::hf_json_number(af);
    const double ms = cfg.get_float("mscale");
    if (ms > 0) m["rope_parameters.mscale_all_dim"] = mt::hf_json_number(ms);
  } else {
    m["rope_parameters.rope_type"] = "\"default\"";
  }
  return m;
}

}  // namespace

void register_deepseek_family(mt::Registry& r, const std::string& name) {
  if (name != "deepseek_v2" && name != "deepseek_v3")
    throw mt::Error("mt_deepseek: no DeepSeek family named '" + name + "'");
  r.add_model_family(name, [name] { return std::make_unique<DsFamily>(name); });
}

}  // namespace mt_deepseek
