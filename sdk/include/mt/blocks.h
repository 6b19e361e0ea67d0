// Shared blocks: the pieces every family's layers are composed of (MaxText's layers/,
// llama.cpp's build_attn / build_ffn / build_moe_ffn). Each block declares its parameters
// (names relative to the layer, under an optional prefix) and computes from them by name, so a
// family's DecoderLayer is a short composition:
//
//   parameters: norm_params("attn_norm", ...) + attention_params(a) + norm_params("mlp_norm", ...)
//               + mlp_params(m)
//   forward:    r = x + attention(g, p, a, norm(g, p, "attn_norm", x, n), in)
//               return r + mlp(g, p, m, norm(g, p, "mlp_norm", r, n))
//
// Dense weights are stored [in, out] (y = x @ W) and initialised as MaxText does: truncated
// normal with variance 1 / fan_in. Implemented in libmt_core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/export.h"
#include "mt/model.h"
#include "mt/tensor.h"

namespace mt {

class Graph;

namespace blocks {

// A dense [in, out] weight (truncated normal, stddev 1 / sqrt(in)) and a bias [out] (zeros, no
// weight decay, not a matmul).
MT_API ParamSpec dense_param(const std::string& name, int64_t in, int64_t out);
MT_API ParamSpec bias_param(const std::string& name, int64_t out);

// ---- norms ----------------------------------------------------------------------------------
enum class NormKind : uint8_t {
  rms,           // x * rstd * w (Llama, Mistral, Qwen)
  rms_plus_one,  // x * rstd * (1 + w), w initialised to 0 (Gemma)
  layer,         // (x - mean) * rstd * w + b (GPT)
  layer_no_bias  // (x - mean) * rstd * w
};
struct NormSpec {
  NormKind kind = NormKind::rms;
  float eps = 1e-5f;
};
// `name` is the scale; a layer norm's bias is `name` + "_bias".
MT_API std::vector<ParamSpec> norm_params(const std::string& name, int64_t d, const NormSpec& s);
// x [..., d] normalised over its last dimension.
MT_API Tensor norm(Graph& g, const Params& p, const std::string& name, const Tensor& x,
                   const NormSpec& s);

// ---- attention ------------------------------------------------------------------------------
// rope_type (default, llama3.1, yarn) and that scaling's own keys into `rope`: rope_factor and
// original_max_position_embeddings for either, rope_low/high_freq_factor for llama3.1,
// beta_fast/slow for yarn. Only those are read, so one set for another rope_type is refused as
// a key the family does not use. theta and rotary_dim are the family's to set.
MT_API void rope_scaling_from_config(const Config& c, RopeSpec& rope);

struct AttentionBlockSpec {
  int64_t d_model = 0;
  int64_t heads = 0;       // query heads
  int64_t kv_heads = 0;    // key/value heads: heads for MHA, 1 for MQA, a divisor for GQA
  int64_t head_dim = 0;    // of queries and keys
  int64_t v_head_dim = 0;  // of values (and of the output before wo); 0 = head_dim
  bool qkv_bias = false;   // biases bq, bk, bv (Qwen2, GPT)
  bool out_bias = false;   // bias bo (GPT)
  // Per-head norms of q and k before the rotary embedding (Qwen3, Gemma 3): q_norm, k_norm [D].
  bool qk_norm = false;
  NormSpec qk_norm_spec;
  bool use_rope = true;  // false: positions come from elsewhere (GPT's learned table)
  RopeSpec rope;
  // Causal mask, sliding window (per layer: local layers set it, global ones leave 0), logit
  // soft-cap and scale (0 = 1 / sqrt(head_dim); Gemma 2's query_pre_attn_scalar sets it).
  AttentionSpec attn;
};
// wq [d, H*D], wk [d, Hkv*D], wv [d, Hkv*Dv], wo [H*Dv, d], then bq bk bv bo and q_norm k_norm
// when the spec has them; each name after `prefix`.
MT_API std::vector<ParamSpec> attention_params(const AttentionBlockSpec& s,
                                               const std::string& prefix = "");
// x [B, T, d] (already normalised) -> [B, T, d]: projections, q/k norms, rotary embedding,
// attention over the batch or through in.cache when decoding, output projection. Values of
// another head size than q and k are zero-padded to it for the kernel and cut back after.
MT_API Tensor attention(Graph& g, const Params& p, const AttentionBlockSpec& s, const Tensor& x,
                        const LayerInputs& in, const std::string& prefix = "");
// k [Hkv, D] and v [Hkv, Dv] per token, within the spec's window.
MT_API CacheSpec attention_cache_spec(const AttentionBlockSpec& s);

// ---- multi-head latent attention (DeepSeek-V2/V3; MaxText's attention_type mla) -------------
// Queries: x @ wq, or with q_lora_rank > 0 norm(x @ wq_a) @ wq_b; each head's qk_nope_head_dim +
// qk_rope_head_dim features, the last qk_rope_head_dim of them rotated. Keys and values come from
// one compressed latent: [c, k_rope] = x @ wkv_a (c of kv_lora_rank features, k_rope of
// qk_rope_head_dim, rotated and shared by every head), c = norm(c), [k_nope, v] per head =
// c @ wkv_b; a head's key is [k_nope, k_rope]. Output: the heads' v_head_dim values @ wo.
struct MlaSpec {
  int64_t d_model = 0;
  int64_t heads = 0;
  int64_t q_lora_rank = 0;  // 0: no query compression (DeepSeek-V2-Lite)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  NormSpec norm;  // of the compressed q and kv (q_norm, kv_norm)
  RopeSpec rope;  // over the qk_rope_head_dim features (rotary_dim = qk_rope_head_dim)
  // Causal mask, window; scale 0 = 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim).
  AttentionSpec attn;
  // Decode caches every head's expanded key and value (MaxText's mla_naive_kvcache), padded to
  // one head size, as attention() does, instead of the latent: for comparison only, as it
  // needs (2 x heads x max(nope + rope, v)) / (kv_lora_rank + rope) times the memory.
  bool naive_cache = false;
};
// wq [d, H*(nope+rope)] or wq_a [d, q_lora_rank], q_norm [q_lora_rank], wq_b [q_lora_rank,
// H*(nope+rope)]; wkv_a [d, kv_lora_rank + rope], kv_norm [kv_lora_rank], wkv_b [kv_lora_rank,
// H*(nope+v)], wo [H*v, d]; each name after `prefix`.
MT_API std::vector<ParamSpec> mla_params(const MlaSpec& s, const std::string& prefix = "");
// x [B, T, d] (already normalised) -> [B, T, d]. Training and prefill (no cache, or a fresh
// one) expand keys and values from the latent (every head's k and v); values are zero-padded to
// the query/key head size for the kernel, as attention() does. With a cache, the latent
// [c, k_rope] is stored; a decode step (cache not fresh) absorbs the up-projections: each
// head's q_nope times its W_uk^T (wkv_b's k columns) attends in latent space, as multi-query
// attention over the cached latent rows (keys and values both), with the spec's scale; the
// weighted latent times the head's W_uv (wkv_b's v columns) is its value, then wo. The
// per-head W_uk and W_uv are kept in the cache's `derived` map after the first step. With
// naive_cache the cache holds the expanded keys and values and a step attends to them.
MT_API Tensor mla(Graph& g, const Params& p, const MlaSpec& s, const Tensor& x,
                  const LayerInputs& in, const std::string& prefix = "");
// What decode keeps per token: the compressed latent, one entry [1, kv_lora_rank +
// qk_rope_head_dim] (the normalised c, then the rotated key), not every head's k and v; with
// naive_cache, k and v [heads, max(nope + rope, v)].
MT_API CacheSpec mla_cache_spec(const MlaSpec& s);

// ---- feed-forward -----------------------------------------------------------------------------
struct MlpSpec {
  int64_t d_model = 0;
  int64_t hidden = 0;
  Activation act = Activation::silu;
  // Gated (SwiGLU / GeGLU): down(act(x @ w_gate) * (x @ w_up)); plain: w_out(act(x @ w_in)).
  bool gated = true;
  bool bias = false;  // b_gate/b_up/b_down or b_in/b_out
};
MT_API std::vector<ParamSpec> mlp_params(const MlpSpec& s, const std::string& prefix = "");
// x [..., d] -> [..., d]
MT_API Tensor mlp(Graph& g, const Params& p, const MlpSpec& s, const Tensor& x,
                  const std::string& prefix = "");

// ---- embeddings -----------------------------------------------------------------------------
// embedding [V, d], normal with stddev `stddev`; matmul = tied (it is the LM head too).
MT_API ParamSpec embedding_param(const std::string& name, int64_t vocab, int64_t d, float stddev,
                                 bool tied);
// logits [B, T, V] = h @ embedding^T (tied) or h @ lm_head [d, V]; on a vocabulary-parallel
// graph (Graph::set_vocab_part) this rank's columns of them.
MT_API Tensor lm_head(Graph& g, const Params& p, const Tensor& h, bool tied,
                      const std::string& embedding = "embedding",
                      const std::string& head = "lm_head");

// The top of a decoder as most families have it: "embedding" [V, d] (normal with stddev
// `embedding_stddev`; 0 = 1/sqrt(d) when tied to the LM head, else 1; logical axes vocab,
// embed; ParamSpec::table: the family looks tokens up with Graph::embedding(top, "embedding",
// ids)), "final_norm" and "lm_head" [d, V] (embed, vocab) unless tied.
MT_API std::vector<ParamSpec> decoder_top_params(int64_t vocab, int64_t d, const NormSpec& norm,
                                                 bool tied, float embedding_stddev = 0.f);
// hidden [B, T, d] -> logits [B, T, V]: final_norm, the LM head, and the final logits' soft-cap
// when `softcap` > 0.
MT_API Tensor decoder_head(Graph& g, const Params& top, const Tensor& hidden, const NormSpec& norm,
                           bool tied, float softcap = 0.f);

// ---- mixture of experts -----------------------------------------------------------------------
struct MoeSpec {
  int64_t d_model = 0;
  int64_t hidden = 0;  // per expert
  int64_t num_experts = 0;
  int64_t top_k = 1;
  Activation act = Activation::silu;
  // Gated experts: down(act(x @ w_gate[e]) * (x @ w_up[e])); plain: down(act(x @ w_up[e])).
  bool gated = true;
  bool normalize_topk = false;  // norm_topk_prob: the k weights divided by their sum
  bool sigmoid_scores = false;  // router scores sigmoid(logits) (DeepSeek-V3) instead of softmax
  // MaxText's load balancing (Switch Transformer's, as HF's Mixtral computes it), per sequence
  // and averaged over the sequences: E * sum_e f_e P_e, f_e = (token-slots routed to expert e) /
  // T (summing to k over the experts), P_e the mean router score of e over the T tokens. Uniform
  // routing gives k.
  float load_balance_weight = 0.f;
  float z_loss_weight = 0.f;  // router z-loss: mean over tokens of logsumexp(logits)^2
  // Token dropping as MaxText's dropping MoE does it: > 0 gives every expert a capacity of
  // C = int(max(ceil(T k / E) * capacity_factor, capacity_factor)) token-slots per sequence of T
  // tokens; a sequence's slots claim places in token order (a token's choices by descending
  // score) and those past C are dropped: they add nothing (the residual carries the token).
  // <= 0 (-1): dropless, every token reaches its k experts.
  float capacity_factor = -1.f;
  // The layer's index, which names its expert-load metrics ("moe_load_max/3"); -1: unnamed
  // ("moe_load_max", averaged over the layers).
  int layer = -1;
};
// router [d, E]; w_gate (gated only) and w_up [E, d, hidden], w_down [E, hidden, d], each expert
// weight with ParamSpec::active = top_k / E; names after `prefix`.
MT_API std::vector<ParamSpec> moe_params(const MoeSpec& s, const std::string& prefix = "");
// The capacity of each expert per sequence of `seq_len` tokens under token dropping (see
// MoeSpec::capacity_factor); 0 when the spec is dropless.
MT_API int64_t moe_capacity(const MoeSpec& s, int64_t seq_len);
// x [..., T, d] (sequences of T tokens; [d] is one token) -> [..., T, d] and these auxiliary
// losses, in this order:
//   "moe_lb_loss" (weight load_balance_weight) and "moe_z_loss" (weight z_loss_weight);
//   "moe_load_min" and "moe_load_max" (weight 0: logged, not trained): the smallest and largest
//     share of the layer's N k token-slots routed to one expert (before dropping; uniform routing
//     gives 1 / E), suffixed "/<layer>" when MoeSpec::layer >= 0;
//   with token dropping only, "moe_dropped_fraction" (weight 0): the share of the N k token-slots
//     dropped.
// None of them where the graph says no one reads them (Graph::wants_aux false: inference).
// Every token's k copies are sorted by expert (on the host, Graph::sort_by_expert), dropped ones
// left out, and each projection is one grouped matmul; the experts' outputs are combined with
// the routing weights by one weighted scatter-add.
MT_API LayerOutput moe(Graph& g, const Params& p, const MoeSpec& s, const Tensor& x,
                       const std::string& prefix = "");
// The experts' MLP that blocks::moe runs, for a family that routes its own way: xs [m, d], token
// copies sorted by expert (Graph::sort_by_expert's offsets [E + 1] on the device and counts [E]
// on the host) -> [m, d], each row through its expert's w_gate (gated only), w_up and w_down
// (under `prefix`; s gives gated, act, d_model and hidden), in whichever layouts inference
// stored them (Graph::grouped_project; at decode's few rows an expert, the gates and ups fused
// into one grouped product where ModelRunner stored them so).
MT_API Tensor moe_expert_mlp(Graph& g, const Params& p, const MoeSpec& s, const Tensor& xs,
                             const Tensor& offsets, const std::vector<int64_t>& counts,
                             const std::string& prefix = "");

}  // namespace blocks
}  // namespace mt
