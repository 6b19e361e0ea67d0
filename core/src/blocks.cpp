// The SDK's shared blocks (mt/blocks.h), written with Graph's ops only: what they compute is
// what a family would write by hand, with the backward from the tape.
#include "mt/blocks.h"
#include "mt/config.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "fused_projections.h"
#include "mt/comm.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "rope_scaling.h"

namespace mt::blocks {

namespace {

// x [..., n] + b [n]: ones [..., 1] @ b [1, n] is a rank-1 product whose backward sums dout over
// the rows into db, so the composition is differentiable with the existing ops.
Tensor add_bias(Graph& g, const Tensor& x, const Tensor& b) {
  Shape ones_shape = x.shape();
  ones_shape.back() = 1;
  Tensor ones = g.backend().empty(ones_shape, x.dtype());
  g.backend().fill(ones, 1.f);
  return g.add(x, g.matmul(ones, g.reshape(b, {1, b.numel()})));
}

Tensor linear(Graph& g, const Params& p, const std::string& w, const std::string& b,
              const Tensor& x, bool bias) {
  Tensor y = g.project(x, p, w);
  return bias ? add_bias(g, y, p[b]) : y;
}

// Up to this many rows of x (an expert's, for the experts' weights) read a fused group of
// projections (decode's steps); more read each weight on its own.
constexpr int64_t kFusedRows = 8;

// x @ w + b for each projection weight w of `ws` (and bias b of `bs` when `bias`), which read
// the same x: for up to 8 rows of x (decode steps), one product where inference stored them as
// one tensor of rows, which p holds under their joined name (ModelRunner::fuse_projections), its
// columns split into the outputs; otherwise one product each. (On an H200, llama-bench-1b bf16:
// fused, decode at batch 1 gained 11% and at batch 8 3%, but a 512-token prefill lost 15%.)
// `whole` (optional): set to the fused product before its split (undefined when not fused).
std::vector<Tensor> linear_each(Graph& g, const Params& p, const std::string& prefix,
                                const std::vector<std::string_view>& ws,
                                const std::vector<std::string_view>& bs, const Tensor& x, bool bias,
                                Tensor* whole = nullptr) {
  std::vector<Tensor> ys;
  const std::string fused = fused_projection_name(prefix, ws);
  // The fused tensor is held only where fused (transposed or int8 rows).
  if (x.numel() <= kFusedRows * x.dim(-1) && p.layout(fused) != WeightLayout::dense) {
    std::vector<int64_t> sizes;
    for (auto w : ws) sizes.push_back(p.shape(prefix + std::string(w)).back());
    const Tensor y = g.project(x, p, fused);
    ys = g.split(y, sizes);
    if (whole) *whole = y;
    if (bias)
      for (size_t i = 0; i < ys.size(); ++i)
        ys[i] = add_bias(g, ys[i], p[prefix + std::string(bs[i])]);
    return ys;
  }
  for (size_t i = 0; i < ws.size(); ++i)
    ys.push_back(linear(g, p, prefix + std::string(ws[i]), prefix + std::string(bs[i]), x, bias));
  return ys;
}

// A row-parallel projection (wo, w_down): under tensor parallelism each rank holds some rows of
// w and its x holds the matching features, so x @ w is a part of the sum; the parts are added
// over the ranks before the (replicated) bias.
Tensor row_linear(Graph& g, const Params& p, const std::string& w, const std::string& b,
                  const Tensor& x, bool bias) {
  Tensor y = g.tensor_parallel_sum(g.project(x, p, w));
  return bias ? add_bias(g, y, p[b]) : y;
}

ParamSpec with_axes(ParamSpec s, std::vector<std::string> axes) {
  s.axes = std::move(axes);
  return s;
}

int64_t v_dim(const AttentionBlockSpec& s) {
  return s.v_head_dim > 0 ? s.v_head_dim : s.head_dim;
}

}  // namespace

ParamSpec dense_param(const std::string& name, int64_t in, int64_t out) {
  return {name,
          {in, out},
          Init::truncated_normal,
          static_cast<float>(1.0 / std::sqrt(static_cast<double>(in))),
          true,
          true};
}

}  // namespace mt::blocks

namespace mt {
const std::vector<RopeScalingKeys>& rope_scaling_keys() {
  static const std::vector<RopeScalingKeys> kKeys = {
      {"llama3.1",
       {"rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "original_max_position_embeddings"}},
      {"yarn", {"rope_factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}}};
  return kKeys;
}
}  // namespace mt

namespace mt::blocks {

// Reads the keys rope_scaling_keys() lists for c's rope_type.
void rope_scaling_from_config(const Config& c, RopeSpec& rope) {
  const std::string rt = c.get_string("rope_type");
  rope.type = rt == "llama3.1" ? RopeSpec::Type::llama3
              : rt == "yarn"   ? RopeSpec::Type::yarn
                               : RopeSpec::Type::standard;
  // Each scaling's own keys only (before: rope_factor=4 with rope_type=default was taken and
  // changed nothing, silently).
  if (rope.type != RopeSpec::Type::standard) {
    rope.factor = static_cast<float>(c.get_float("rope_factor"));
    rope.original_max_position = c.get_int("original_max_position_embeddings");
  }
  if (rope.type == RopeSpec::Type::llama3) {
    rope.low_freq_factor = static_cast<float>(c.get_float("rope_low_freq_factor"));
    rope.high_freq_factor = static_cast<float>(c.get_float("rope_high_freq_factor"));
  }
  if (rope.type == RopeSpec::Type::yarn) {
    rope.beta_fast = static_cast<float>(c.get_float("beta_fast"));
    rope.beta_slow = static_cast<float>(c.get_float("beta_slow"));
  }
}

// A dense weight read only through Graph::project (ParamSpec::projection).
ParamSpec projection_param(const std::string& name, int64_t in, int64_t out) {
  ParamSpec s = dense_param(name, in, out);
  s.projection = true;
  return s;
}

ParamSpec bias_param(const std::string& name, int64_t out) {
  return {name, {out}, Init::zeros, 0.f, /*weight_decay=*/false, /*matmul=*/false};
}

std::vector<ParamSpec> norm_params(const std::string& name, int64_t d, const NormSpec& s) {
  std::vector<ParamSpec> r;
  // (1 + w) scaling starts from w = 0, the others from w = 1.
  r.push_back({name,
               {d},
               s.kind == NormKind::rms_plus_one ? Init::zeros : Init::ones,
               0.f,
               /*weight_decay=*/false,
               /*matmul=*/false});
  if (s.kind == NormKind::layer) r.push_back(bias_param(name + "_bias", d));
  return r;
}

namespace {

// The norm with weight w and bias b (layer norms).
Tensor norm_with(Graph& g, const Tensor& w, const Tensor& b, const Tensor& x, const NormSpec& s) {
  switch (s.kind) {
    case NormKind::rms:
      return g.rmsnorm(x, w, s.eps);
    case NormKind::rms_plus_one:
      return g.rmsnorm(x, w, s.eps, /*plus_one=*/true);
    case NormKind::layer:
      return g.layernorm(x, w, b, s.eps);
    case NormKind::layer_no_bias:
      return g.layernorm(x, w, Tensor(), s.eps);
  }
  throw Error("norm: unknown kind");
}

// A per-head norm (q_norm, k_norm) on this rank's heads: its replicated weight gets a part of
// its gradient on each tensor rank, summed over them (tensor_parallel_input's backward).
Tensor head_norm(Graph& g, const Params& p, const std::string& name, const Tensor& x,
                 const NormSpec& s) {
  const Tensor* b = p.find(name + "_bias");
  return norm_with(g, g.tensor_parallel_input(p[name]), b ? g.tensor_parallel_input(*b) : Tensor(),
                   x, s);
}

}  // namespace

Tensor norm(Graph& g, const Params& p, const std::string& name, const Tensor& x,
            const NormSpec& s) {
  const Tensor* b = s.kind == NormKind::layer ? &p[name + "_bias"] : nullptr;
  return norm_with(g, p[name], b ? *b : Tensor(), x, s);
}

std::vector<ParamSpec> attention_params(const AttentionBlockSpec& s, const std::string& prefix) {
  const int64_t q = s.heads * s.head_dim, k = s.kv_heads * s.head_dim;
  const int64_t v = s.kv_heads * v_dim(s), o = s.heads * v_dim(s);
  // Megatron's split: the heads' columns of wq, wk, wv (and their biases) and the heads' rows
  // of wo, when logical_axis_rules put heads and kv_heads on the tensor axis.
  std::vector<ParamSpec> r = {
      with_axes(projection_param(prefix + "wq", s.d_model, q), {"embed", "heads"}),
      with_axes(projection_param(prefix + "wk", s.d_model, k), {"embed", "kv_heads"}),
      with_axes(projection_param(prefix + "wv", s.d_model, v), {"embed", "kv_heads"}),
      with_axes(projection_param(prefix + "wo", o, s.d_model), {"heads", "embed"})};
  if (s.qkv_bias) {
    r.push_back(with_axes(bias_param(prefix + "bq", q), {"heads"}));
    r.push_back(with_axes(bias_param(prefix + "bk", k), {"kv_heads"}));
    r.push_back(with_axes(bias_param(prefix + "bv", v), {"kv_heads"}));
  }
  if (s.out_bias) r.push_back(with_axes(bias_param(prefix + "bo", s.d_model), {"embed"}));
  if (s.qk_norm) {
    for (const char* n : {"q_norm", "k_norm"})
      for (auto& ps : norm_params(prefix + n, s.head_dim, s.qk_norm_spec)) r.push_back(ps);
  }
  return r;
}

CacheSpec attention_cache_spec(const AttentionBlockSpec& s) {
  CacheSpec c;
  c.window = s.attn.window;
  // The kernels take one head size: values of another size are stored padded to the larger.
  const int64_t d = std::max(s.head_dim, v_dim(s));
  c.entries = {{s.kv_heads, d}, {s.kv_heads, d}};
  return c;
}

Tensor attention(Graph& g, const Params& p, const AttentionBlockSpec& s, const Tensor& x,
                 const LayerInputs& in, const std::string& prefix) {
  MT_CHECK(
      x.ndim() == 3 && x.dim(2) == s.d_model,
      "attention block: input " + x.str() + ", want [B, T, " + std::to_string(s.d_model) + "]");
  MT_CHECK(in.attention != nullptr, "attention block: no attention kernel given to the layer");
  const int64_t b = x.dim(0), t = x.dim(1), dv = v_dim(s);
  // This rank's heads: all of them, or its part under tensor parallelism (the weights' columns).
  const int64_t heads = p.shape(prefix + "wq").back() / s.head_dim;
  const int64_t kv_heads = p.shape(prefix + "wk").back() / s.head_dim;
  const Tensor xin = g.tensor_parallel_input(x);
  Tensor whole;
  const std::vector<Tensor> qkv =
      linear_each(g, p, prefix, {"wq", "wk", "wv"}, {"bq", "bk", "bv"}, xin, s.qkv_bias, &whole);
  Tensor q = g.reshape(qkv[0], {b, t, heads, s.head_dim});
  Tensor k = g.reshape(qkv[1], {b, t, kv_heads, s.head_dim});
  Tensor v = g.reshape(qkv[2], {b, t, kv_heads, dv});
  if (s.qk_norm) {
    q = head_norm(g, p, prefix + "q_norm", q, s.qk_norm_spec);
    k = head_norm(g, p, prefix + "k_norm", k, s.qk_norm_spec);
  }
  if (s.use_rope && whole.defined() && b * t == 1 && !s.qk_norm && !s.qkv_bias) {
    // One token's fused q/k/v: q and k lie side by side in its row, so one rope over their
    // heads together rotates both (split as views of one row: no copies), one launch instead of
    // two in a decode step.
    const int64_t nq = heads * s.head_dim, nk = kv_heads * s.head_dim;
    const Tensor qk = g.split(whole, {nq + nk, whole.dim(-1) - nq - nk})[0];
    const Tensor r =
        g.rope(g.reshape(qk, {b, t, heads + kv_heads, s.head_dim}), in.positions, s.rope);
    const std::vector<Tensor> rq = g.split(g.reshape(r, {b, t, nq + nk}), {nq, nk});
    q = g.reshape(rq[0], {b, t, heads, s.head_dim});
    k = g.reshape(rq[1], {b, t, kv_heads, s.head_dim});
  } else if (s.use_rope) {
    q = g.rope(q, in.positions, s.rope);
    k = g.rope(k, in.positions, s.rope);
  }
  AttentionSpec spec = s.attn;
  if (spec.scale == 0.f) spec.scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  // The kernels take one head size: q, k and v are zero-padded to the larger of the two (zero
  // features add nothing to q . k, and the scale stays 1 / sqrt(head_dim)); the output's padded
  // features are cut before wo. The decode cache holds the padded entries
  // (attention_cache_spec).
  const int64_t dp = std::max(s.head_dim, dv);
  auto pad = [&](const Tensor& t) {
    if (t.dim(-1) == dp) return t;
    Shape zs = t.shape();
    zs.back() = dp - t.dim(-1);
    return g.concat({t, g.backend().zeros(zs, t.dtype())});
  };
  q = pad(q);
  k = pad(k);
  v = pad(v);
  Tensor a;
  if (in.cache) {  // decode: the core's cache (linear or sliding-window ring)
    a = g.cached_attention(*in.attention, q, k, v, *in.cache, spec);
  } else {
    a = g.attention(*in.attention, q, k, v, in.segment_ids, in.segment_ids, spec);
  }
  if (dv != dp) a = g.split(a, {dv, dp - dv})[0];
  a = g.reshape(a, {b, t, heads * dv});
  return row_linear(g, p, prefix + "wo", prefix + "bo", a, s.out_bias);
}

// ---- multi-head latent attention ------------------------------------------------------------

namespace {

void check_mla(const MlaSpec& s, const char* what) {
  MT_CHECK(s.d_model > 0 && s.heads > 0 && s.q_lora_rank >= 0 && s.kv_lora_rank > 0 &&
               s.qk_nope_head_dim >= 0 && s.qk_rope_head_dim > 0 && s.qk_rope_head_dim % 2 == 0 &&
               s.v_head_dim > 0,
           std::string(what) + ": d_model " + std::to_string(s.d_model) + ", heads " +
               std::to_string(s.heads) + ", q_lora_rank " + std::to_string(s.q_lora_rank) +
               ", kv_lora_rank " + std::to_string(s.kv_lora_rank) + ", qk_nope_head_dim " +
               std::to_string(s.qk_nope_head_dim) + ", qk_rope_head_dim " +
               std::to_string(s.qk_rope_head_dim) + ", v_head_dim " + std::to_string(s.v_head_dim) +
               " (want positive sizes, an even rope dimension, q_lora_rank >= 0)");
}

int64_t mla_padded_dim(const MlaSpec& s) {
  return std::max(s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim);
}

}  // namespace

std::vector<ParamSpec> mla_params(const MlaSpec& s, const std::string& prefix) {
  check_mla(s, "mla_params");
  const int64_t qk = s.qk_nope_head_dim + s.qk_rope_head_dim;
  std::vector<ParamSpec> r;
  if (s.q_lora_rank > 0) {
    r.push_back(projection_param(prefix + "wq_a", s.d_model, s.q_lora_rank));
    for (auto& ps : norm_params(prefix + "q_norm", s.q_lora_rank, s.norm)) r.push_back(ps);
    r.push_back(projection_param(prefix + "wq_b", s.q_lora_rank, s.heads * qk));
  } else {
    r.push_back(projection_param(prefix + "wq", s.d_model, s.heads * qk));
  }
  r.push_back(projection_param(prefix + "wkv_a", s.d_model, s.kv_lora_rank + s.qk_rope_head_dim));
  for (auto& ps : norm_params(prefix + "kv_norm", s.kv_lora_rank, s.norm)) r.push_back(ps);
  r.push_back(
      dense_param(prefix + "wkv_b", s.kv_lora_rank, s.heads * (s.qk_nope_head_dim + s.v_head_dim)));
  r.push_back(projection_param(prefix + "wo", s.heads * s.v_head_dim, s.d_model));
  return r;
}

CacheSpec mla_cache_spec(const MlaSpec& s) {
  CacheSpec c;
  c.window = s.attn.window;
  if (s.naive_cache) {  // every head's key and value, padded to one head size
    c.entries = {{s.heads, mla_padded_dim(s)}, {s.heads, mla_padded_dim(s)}};
    return c;
  }
  // One entry: the normalised latent c and the rotary key, as one kv head [c, k_rope].
  c.entries = {{1, s.kv_lora_rank + s.qk_rope_head_dim}};
  return c;
}

namespace {

// u [n0, n1, ...] -> [n1, n0, ...] (the rest flattened into rows of w features): one row gather.
Tensor swap01(Graph& g, const Tensor& u, int64_t n0, int64_t n1) {
  const int64_t w = n0 * n1 > 0 ? u.numel() / (n0 * n1) : 0;
  if (n0 == 1 || n1 == 1) return g.reshape(u, {n1, n0, w});
  std::vector<int32_t> rows(static_cast<size_t>(n0 * n1));
  for (int64_t i1 = 0; i1 < n1; ++i1)
    for (int64_t i0 = 0; i0 < n0; ++i0)
      rows[static_cast<size_t>(i1 * n0 + i0)] = static_cast<int32_t>(i0 * n1 + i1);
  Tensor idx = g.backend().empty({n0 * n1}, DType::i32);
  g.backend().copy_from_host(idx, rows.data());
  return g.reshape(g.gather_rows(g.reshape(u, {n0 * n1, w}), idx), {n1, n0, w});
}

}  // namespace

Tensor mla(Graph& g, const Params& p, const MlaSpec& s, const Tensor& x, const LayerInputs& in,
           const std::string& prefix) {
  check_mla(s, "mla block");
  MT_CHECK(x.ndim() == 3 && x.dim(2) == s.d_model,
           "mla block: input " + x.str() + ", want [B, T, " + std::to_string(s.d_model) + "]");
  MT_CHECK(in.attention != nullptr, "mla block: no attention kernel given to the layer");
  const int64_t b = x.dim(0), t = x.dim(1), h = s.heads;
  const int64_t nope = s.qk_nope_head_dim, rope = s.qk_rope_head_dim, dv = s.v_head_dim;
  const int64_t qk = nope + rope, dp = mla_padded_dim(s);
  RopeSpec rs = s.rope;
  rs.rotary_dim = static_cast<int>(rope);

  // Queries [B, T, H, nope + rope]: the rotary part is the last `rope` features of each head.
  Tensor q =
      s.q_lora_rank > 0
          ? g.project(norm(g, p, prefix + "q_norm", g.project(x, p, prefix + "wq_a"), s.norm), p,
                      prefix + "wq_b")
          : g.project(x, p, prefix + "wq");
  q = g.reshape(q, {b, t, h, qk});
  std::vector<Tensor> qs = g.split(q, {nope, rope});
  const Tensor q_rot = g.rope(qs[1], in.positions, rs);

  // The latent: c [B, T, kv_lora_rank] (normalised) and one rotary key [B, T, 1, rope] for all
  // heads.
  std::vector<Tensor> kv_a =
      g.split(g.project(x, p, prefix + "wkv_a"), {s.kv_lora_rank, rope});  // [B, T, ...]
  const Tensor c = norm(g, p, prefix + "kv_norm", kv_a[0], s.norm);
  const Tensor k_rot = g.rope(g.reshape(kv_a[1], {b, t, 1, rope}), in.positions, rs);
  AttentionSpec spec = s.attn;
  if (spec.scale == 0.f) spec.scale = 1.f / std::sqrt(static_cast<float>(qk));

  // Decode: the cache keeps the latent [c, k_rope] per token (mla_cache_spec), written by the
  // prefill too. A step attends to it with the up-projections absorbed: q_nope of head h times
  // W_uk[h]^T (wkv_b's k columns of h, [L, nope]) is a query in latent space, so scores are
  // q_abs . c + q_rope . k_rope: multi-query attention with one kv head of L + rope features
  // whose values are the same rows (the output's rope features are dropped). The weighted sum of
  // latents times W_uv[h] (the v columns, [L, dv]) is head h's value, then wo. The scale stays
  // the spec's (DeepSeek's), not 1 / sqrt(L + rope).
  if (in.cache && !s.naive_cache) {
    const int64_t lat = s.kv_lora_rank;
    g.write_cache(*in.cache, 0,
                  g.reshape(g.concat({c, g.reshape(k_rot, {b, t, rope})}), {b, t, 1, lat + rope}));
    if (!in.cache->fresh) {
      const int64_t m = b * t;
      // wkv_b [L, H * (nope + dv)] -> [H, L, nope + dv] -> W_uk [H, L, nope], W_uv [H, L, dv]:
      // made once per decoder when it keeps them (KVCache::derived), else at every step.
      std::vector<Tensor> w;
      auto* kept = in.cache->derived.get();
      const std::string uk = prefix + "mla.w_uk", uv = prefix + "mla.w_uv";
      if (kept && kept->count(uk) && kept->count(uv)) {
        w = {kept->at(uk), kept->at(uv)};
      } else {
        w = g.split(swap01(g, p[prefix + "wkv_b"], s.kv_lora_rank, h), {nope, dv});
        if (kept) {
          (*kept)[uk] = w[0];
          (*kept)[uv] = w[1];
        }
      }
      Tensor q_lat = nope > 0 ? g.reshape(swap01(g,
                                                 g.matmul(swap01(g, qs[0], m, h), w[0],
                                                          /*trans_a=*/false, /*trans_b=*/true),
                                                 h, m),
                                          {b, t, h, lat})
                              : g.backend().zeros({b, t, h, lat}, q_rot.dtype());
      KVCache both = *in.cache;  // the latent rows serve as keys and as values (widened once
      const Tensor latent = g.cache_values(*in.cache, 0, q_rot.dtype());  // if int8)
      both.tensors = {latent, latent};
      both.scales.clear();
      const Tensor a =
          g.split(g.attention_decode(*in.attention, g.concat({q_lat, q_rot}), both, spec),
                  {lat, rope})[0];                                           // [B, T, H, L]
      const Tensor o = swap01(g, g.matmul(swap01(g, a, m, h), w[1]), h, m);  // [M, H, dv]
      return g.project(g.reshape(o, {b, t, h * dv}), p, prefix + "wo");
    }
  }

  // Every head's copy of the rotary key: rows gathered H times per token (the backward sums
  // the heads' gradients back into the one key).
  std::vector<int32_t> rows(static_cast<size_t>(b * t * h));
  for (int64_t tok = 0, i = 0; tok < b * t; ++tok)
    for (int64_t j = 0; j < h; ++j) rows[static_cast<size_t>(i++)] = static_cast<int32_t>(tok);
  Tensor idx = g.backend().empty({b * t * h}, DType::i32);
  if (!rows.empty()) g.backend().copy_from_host(idx, rows.data());
  const Tensor k_rot_h =
      g.reshape(g.gather_rows(g.reshape(k_rot, {b * t, rope}), idx), {b, t, h, rope});
  // Per head [k_nope, v] from the latent.
  std::vector<Tensor> kv =
      g.split(g.reshape(g.matmul(c, p[prefix + "wkv_b"]), {b, t, h, nope + dv}), {nope, dv});
  Tensor qf = nope > 0 ? g.concat({qs[0], q_rot}) : q_rot;
  Tensor kf = nope > 0 ? g.concat({kv[0], k_rot_h}) : k_rot_h;
  Tensor v = kv[1];

  // One head size for the kernels: zero features add nothing to q . k, and the padded output
  // features are cut before wo (as attention() does).
  auto pad = [&](const Tensor& u) {
    if (u.dim(-1) == dp) return u;
    Shape zs = u.shape();
    zs.back() = dp - u.dim(-1);
    return g.concat({u, g.backend().zeros(zs, u.dtype())});
  };
  qf = pad(qf);
  kf = pad(kf);
  v = pad(v);
  // A fresh cache (prefill): the tokens attend among themselves; their latent is stored above.
  // The naive cache stores the expanded keys and values instead, and a step attends to them.
  Tensor a =
      in.cache && s.naive_cache ? g.cached_attention(*in.attention, qf, kf, v, *in.cache, spec)
      : in.cache                ? g.attention(*in.attention, qf, kf, v, Tensor(), Tensor(), spec)
                 : g.attention(*in.attention, qf, kf, v, in.segment_ids, in.segment_ids, spec);
  if (dv != dp) a = g.split(a, {dv, dp - dv})[0];
  return g.project(g.reshape(a, {b, t, h * dv}), p, prefix + "wo");
}

std::vector<ParamSpec> mlp_params(const MlpSpec& s, const std::string& prefix) {
  std::vector<ParamSpec> r;
  // Megatron's split: the hidden columns of the input projections and rows of the output one,
  // when logical_axis_rules put mlp on the tensor axis.
  const std::vector<std::string> in_axes{"embed", "mlp"}, out_axes{"mlp", "embed"};
  if (s.gated) {
    r = {with_axes(projection_param(prefix + "w_gate", s.d_model, s.hidden), in_axes),
         with_axes(projection_param(prefix + "w_up", s.d_model, s.hidden), in_axes),
         with_axes(projection_param(prefix + "w_down", s.hidden, s.d_model), out_axes)};
    if (s.bias) {
      r.push_back(with_axes(bias_param(prefix + "b_gate", s.hidden), {"mlp"}));
      r.push_back(with_axes(bias_param(prefix + "b_up", s.hidden), {"mlp"}));
      r.push_back(with_axes(bias_param(prefix + "b_down", s.d_model), {"embed"}));
    }
  } else {
    r = {with_axes(projection_param(prefix + "w_in", s.d_model, s.hidden), in_axes),
         with_axes(projection_param(prefix + "w_out", s.hidden, s.d_model), out_axes)};
    if (s.bias) {
      r.push_back(with_axes(bias_param(prefix + "b_in", s.hidden), {"mlp"}));
      r.push_back(with_axes(bias_param(prefix + "b_out", s.d_model), {"embed"}));
    }
  }
  return r;
}

Tensor mlp(Graph& g, const Params& p, const MlpSpec& s, const Tensor& x,
           const std::string& prefix) {
  // Under tensor parallelism this rank computes its hidden columns and its part of the output.
  const Tensor xin = g.tensor_parallel_input(x);
  if (s.gated) {
    const std::vector<Tensor> gate_up =
        linear_each(g, p, prefix, {"w_gate", "w_up"}, {"b_gate", "b_up"}, xin, s.bias);
    return row_linear(g, p, prefix + "w_down", prefix + "b_down",
                      g.gated(s.act, gate_up[0], gate_up[1]), s.bias);
  }
  Tensor h = g.activation(s.act, linear(g, p, prefix + "w_in", prefix + "b_in", xin, s.bias));
  return row_linear(g, p, prefix + "w_out", prefix + "b_out", h, s.bias);
}

ParamSpec embedding_param(const std::string& name, int64_t vocab, int64_t d, float stddev,
                          bool tied) {
  return {name, {vocab, d}, Init::normal, stddev, /*weight_decay=*/true, /*matmul=*/tied};
}

Tensor lm_head(Graph& g, const Params& p, const Tensor& h, bool tied, const std::string& embedding,
               const std::string& head) {
  // Tied: logits = h @ embedding^T, the table shared with the input lookup.
  // Vocabulary-parallel (Graph::set_vocab_part): this rank's columns of the logits, from its
  // rows of the table (or columns of the head); each rank's part of h's gradient is summed.
  // An int8 table (quantization=int8) holds the head's rows: Graph::project reads them.
  const Tensor x = g.vocab_parallel() ? g.tensor_parallel_input(h) : h;
  if (!tied) return g.project(x, p, head);
  return p.layout(embedding) == WeightLayout::q8 ? g.project(x, p, embedding)
                                                 : g.matmul(x, p[embedding], false, true);
}

std::vector<ParamSpec> decoder_top_params(int64_t vocab, int64_t d, const NormSpec& norm, bool tied,
                                          float embedding_stddev) {
  if (embedding_stddev == 0.f) embedding_stddev = tied ? 1.f / std::sqrt(float(d)) : 1.f;
  std::vector<ParamSpec> r = {embedding_param("embedding", vocab, d, embedding_stddev, tied)};
  r.back().axes = {"vocab", "embed"};
  r.back().table = true;  // read through Graph::embedding(params, ...) and lm_head
  for (auto& p : norm_params("final_norm", d, norm)) r.push_back(p);
  if (!tied) {
    r.push_back(projection_param("lm_head", d, vocab));
    r.back().axes = {"embed", "vocab"};
  }
  return r;
}

Tensor decoder_head(Graph& g, const Params& top, const Tensor& hidden, const NormSpec& norm,
                    bool tied, float softcap) {
  Tensor logits = lm_head(g, top, mt::blocks::norm(g, top, "final_norm", hidden, norm), tied);
  return softcap > 0.f ? g.softcap(logits, softcap) : logits;
}

// ---- mixture of experts ---------------------------------------------------------------------

namespace {

void check_moe(const MoeSpec& s, const char* what) {
  MT_CHECK(s.d_model > 0 && s.hidden > 0 && s.num_experts > 0 && s.top_k >= 1 &&
               s.top_k <= s.num_experts,
           std::string(what) + ": d_model " + std::to_string(s.d_model) + ", hidden " +
               std::to_string(s.hidden) + ", " + std::to_string(s.num_experts) + " experts, top " +
               std::to_string(s.top_k) + " (want positive sizes and 1 <= top_k <= experts)");
  MT_CHECK(std::isfinite(s.capacity_factor),
           std::string(what) + ": capacity_factor " + std::to_string(s.capacity_factor));
}

// A [1] f32 tensor holding v (a logged metric: no gradient).
Tensor scalar(Backend& be, float v) {
  Tensor t = be.empty({1}, DType::f32);
  be.copy_from_host(t, &v);
  return t;
}

// An expert weight [E, in, out]: each expert's matrix initialised as a dense [in, out] one; a
// token uses top_k of the E. Read only through Graph::grouped_project (or, under expert
// parallelism, which inference's layouts never meet, grouped_matmul).
ParamSpec expert_param(const MoeSpec& s, const std::string& name, int64_t in, int64_t out,
                       std::vector<std::string> axes) {
  ParamSpec ps = projection_param(name, in, out);
  ps.shape = {s.num_experts, in, out};
  ps.active = static_cast<float>(s.top_k) / static_cast<float>(s.num_experts);
  ps.axes = std::move(axes);  // experts first: logical_axis_rules may divide them
  return ps;
}

// The experts' gate and up products in one grouped product, where inference stored them as one
// tensor of 2 E experts, the gates' then the ups' (ModelRunner::fuse_projections, under the
// joined name): xs's rows twice ([xs; xs]) against it, so each expert's rows meet its gate and
// then its up, and the first half of the rows is the gates' output, the second the ups'. For
// decode's few rows an expert (the CPU runs the products of one call concurrently: one fork
// instead of two); an undefined result where not so stored or not so few.
Tensor fused_gate_up(Graph& g, const Params& p, const std::string& prefix, const Tensor& xs,
                     const std::vector<int64_t>& counts) {
  const std::string fused = fused_projection_name(prefix, {"w_gate", "w_up"});
  if (g.recording() || p.layout(fused) == WeightLayout::dense || xs.ndim() != 2) return {};
  const int64_t m = xs.dim(0), local = static_cast<int64_t>(counts.size());
  if (m == 0 || p.shape(fused)[0] != 2 * local) return {};
  for (const int64_t c : counts)
    if (c > kFusedRows) return {};
  Backend& be = g.backend();
  Tensor twice = be.empty({2 * m, xs.dim(1)}, xs.dtype());
  for (int64_t half = 0; half < 2; ++half) {
    Tensor rows = twice.slice0(half * m, (half + 1) * m);
    be.cast(xs, rows);  // same dtype: a copy
  }
  std::vector<int64_t> counts2(counts);
  counts2.insert(counts2.end(), counts.begin(), counts.end());
  std::vector<int32_t> off(counts2.size() + 1, 0);
  for (size_t e = 0; e < counts2.size(); ++e)
    off[e + 1] = off[e] + static_cast<int32_t>(counts2[e]);
  Tensor offsets = be.empty({static_cast<int64_t>(off.size())}, DType::i32);
  be.copy_from_host(offsets, off.data());
  return g.grouped_project(twice, p, fused, offsets, counts2);  // [2 m, hidden]
}

}  // namespace

Tensor moe_expert_mlp(Graph& g, const Params& p, const MoeSpec& s, const Tensor& xs,
                      const Tensor& offsets, const std::vector<int64_t>& counts,
                      const std::string& prefix) {
  auto proj = [&](const Tensor& x, const char* w) {
    return g.grouped_project(x, p, prefix + w, offsets, counts);
  };
  Tensor h;
  if (!s.gated) {
    h = g.activation(s.act, proj(xs, "w_up"));
  } else if (const Tensor both = fused_gate_up(g, p, prefix, xs, counts); both.defined()) {
    const int64_t m = xs.dim(0);
    h = g.gated(s.act, both.slice0(0, m), both.slice0(m, 2 * m));
  } else {
    h = g.gated(s.act, proj(xs, "w_gate"), proj(xs, "w_up"));
  }
  return proj(h, "w_down");
}

namespace {

// One rank's MoE (or the tensor ranks' parts of it): the sorted slots of its own experts
// through one grouped matmul per projection, weighted back onto their tokens.
Tensor moe_experts(Graph& g, const Params& p, const MoeSpec& s, const std::string& prefix,
                   const Tensor& x, const Tensor& x2, const Tensor& weights,
                   const Graph::ExpertOrder& order) {
  Backend& be = g.backend();
  const int64_t E = s.num_experts, n = x2.dim(0), slots = n * s.top_k;
  const int64_t m = order.slots.numel();  // the kept slots
  // Expert parallelism over the tensor ranks (logical_axis_rules puts experts on the tensor
  // axis): every rank routes all tokens alike, computes the slots of its own experts (its
  // weights' first dimension: experts [e0, e0 + local)) and the outputs are summed over the
  // ranks. The expert path's input and routing weights go through tensor_parallel_input, so
  // their gradients (each rank's from its slots) are summed too, while the router's losses,
  // the same on every rank, are not.
  // Or tensor parallelism within the experts (mlp on the tensor axis, experts not): every rank
  // computes every slot with its hidden columns, and the parts are summed the same way.
  const Shape up = p.shape(prefix + "w_up");  // [local, d, hidden part], any layout
  const int64_t local = up[0];
  const bool by_hidden = up.back() != s.hidden;
  const bool split = local != E || by_hidden;  // tensor ranks' parts to sum
  const Communicator* group = g.tensor_group();
  // (No group: the memory plan's trace, which plans tensor rank 0.)
  MT_CHECK(!group || by_hidden || local * group->size() == E,
           "moe block: " + std::to_string(local) + " of " + std::to_string(E) +
               " experts' weights here, but the tensor group does not divide them so");
  const int64_t e0 = local != E && group ? static_cast<int64_t>(group->rank()) * local : 0;
  auto in = [&](const Tensor& t) { return split ? g.tensor_parallel_input(t) : t; };
  // The local experts' outputs [n, d] back to x's shape, summed over the tensor ranks.
  auto sum = [&](const Tensor& t) {
    const Tensor y = g.reshape(t, x.shape());
    return split ? g.tensor_parallel_sum(y) : y;
  };
  int64_t r0 = 0, r1 = 0;  // the local experts' rows of the sorted order
  for (int64_t e = 0; e < e0 + local; ++e)
    (e < e0 ? r0 : r1) += order.counts[static_cast<size_t>(e)];
  r1 += r0;
  // Every slot dropped (still on the tape: a backward reaches x), or none of this rank's
  // experts chosen (its part of the sum is 0).
  if (m == 0) return g.scale(x, 0.f);
  if (r1 == r0) return sum(g.scale(in(x2), 0.f));
  Tensor tokens = order.tokens, slot_ids = order.slots, offsets = order.offsets;
  if (local != E) {
    tokens = order.tokens.slice0(r0, r1);
    slot_ids = order.slots.slice0(r0, r1);
    std::vector<int32_t> off(static_cast<size_t>(local + 1), 0);
    for (int64_t e = 0; e < local; ++e)
      off[static_cast<size_t>(e + 1)] =
          off[static_cast<size_t>(e)] +
          static_cast<int32_t>(order.counts[static_cast<size_t>(e0 + e)]);
    offsets = be.empty({local + 1}, DType::i32);
    be.copy_from_host(offsets, off.data());
  }
  const int64_t ml = r1 - r0;
  const std::vector<int64_t> counts(order.counts.begin() + e0, order.counts.begin() + e0 + local);
  const Tensor xs = g.gather_rows(in(x2), tokens);  // [ml, d]
  const Tensor ys = moe_expert_mlp(g, p, s, xs, offsets, counts, prefix);
  // Each copy's routing weight, in the sorted order, then back to its token weighted.
  const Tensor ws = g.reshape(g.gather_rows(g.reshape(in(weights), {slots, 1}), slot_ids), {ml});
  return sum(g.scatter_add_rows(ys, tokens, ws, n));
}

// Expert parallelism (the expert mesh axis, Graph::expert_group): each rank routes and sorts its
// own tokens (capacity per sequence, as one rank does: a sequence stays on one rank), sends each
// kept token copy only to the rank that holds its expert (an all-to-all), each rank runs its
// experts on the rows it receives, in the order one rank would sort the group's slots (by
// expert, then by source rank), sends the outputs back (a second all-to-all), and each rank
// adds its tokens' outputs weighted by their routing weights. `routed` and `kept_slots` become
// the group's routed slots per expert and kept slots (the load and drop metrics). The backward
// sends the gradients back along the same paths. About k (X - 1) / X of the tokens leave a rank
// each way, where gathering the group's tokens to every rank would move X - 1 times them.
// With the tensor axis (Graph::expert_tensor_ranks T > 1) the group is the X T ranks of X
// batches: the T tensor ranks of a batch hold the same tokens, so each takes a share of them
// (its input and routing weights through tensor_parallel_input, whose backward sums the
// shares' gradients), and the shares' outputs are summed over the tensor group.
Tensor moe_expert_parallel(Graph& g, const Params& p, const MoeSpec& s, const std::string& prefix,
                           const Tensor& x2, const Tensor& weights, const Tensor& indices,
                           int64_t seq, std::vector<int64_t>& routed, int64_t& kept_slots) {
  Backend& be = g.backend();
  const int ep = g.expert_ranks(), me = g.expert_rank();
  const int64_t E = s.num_experts, d = s.d_model, n = x2.dim(0), k = s.top_k;
  const Shape up = p.shape(prefix + "w_up");  // [local, d, hidden], any layout
  const int64_t local = up[0];
  MT_CHECK(local * ep == E && up.back() == s.hidden,
           "moe block: " + std::to_string(local) + " of " + std::to_string(E) +
               " experts' weights here, but the expert group has " + std::to_string(ep) + " ranks");
  // This rank's share of the batch: tokens [n t / T, n (t + 1) / T), or with token dropping,
  // whose capacity counts within a sequence, sequences [B t / T, B (t + 1) / T) (no tensor
  // group, the plan's trace: all of them, with the tensor group's sums counted).
  const int ts = g.expert_tensor_ranks(), t = me % ts;
  const bool shares = ts > 1;
  const bool part = shares && g.tensor_group() != nullptr;
  const int64_t unit = s.capacity_factor > 0.f ? seq : 1, units = unit ? n / unit : 0;
  const int64_t a = part ? unit * (units * t / ts) : 0;
  const int64_t b = part ? unit * (units * (t + 1) / ts) : n;
  const Tensor mine_idx = part ? indices.slice0(a, b) : indices;
  const Graph::ExpertOrder order = s.capacity_factor > 0.f
                                       ? g.sort_by_expert(mine_idx, E, moe_capacity(s, seq), seq)
                                       : g.sort_by_expert(mine_idx, E);
  Tensor tokens = order.tokens, slot_ids = order.slots;
  if (a > 0 && order.tokens.numel()) {  // the share's numbers, in the batch's
    std::vector<int32_t> tk(static_cast<size_t>(order.tokens.numel())), sl(tk.size());
    be.copy_to_host(order.tokens, tk.data());
    be.copy_to_host(order.slots, sl.data());
    for (size_t i = 0; i < tk.size(); ++i) {
      tk[i] += static_cast<int32_t>(a);
      sl[i] += static_cast<int32_t>(a * k);
    }
    tokens = be.empty(order.tokens.shape(), DType::i32);
    slot_ids = be.empty(order.slots.shape(), DType::i32);
    be.copy_from_host(tokens, tk.data());
    be.copy_from_host(slot_ids, sl.data());
  }
  const Tensor xin = shares ? g.tensor_parallel_input(x2) : x2;
  const Tensor win = shares ? g.tensor_parallel_input(weights) : weights;
  // Every rank's kept slots and routed slots per expert.
  std::vector<int64_t> mine = order.counts;
  mine.insert(mine.end(), order.routed.begin(), order.routed.end());
  const std::vector<int64_t> all = g.expert_gather_counts(mine);
  auto kept = [&](int src, int64_t e) { return all[static_cast<size_t>(src * 2 * E + e)]; };
  routed.assign(static_cast<size_t>(E), 0);
  kept_slots = 0;
  std::vector<int64_t> send(static_cast<size_t>(ep), 0), recv(static_cast<size_t>(ep), 0);
  for (int src = 0; src < ep; ++src)
    for (int64_t e = 0; e < E; ++e) {
      routed[static_cast<size_t>(e)] += all[static_cast<size_t>(src * 2 * E + E + e)];
      kept_slots += kept(src, e);
      if (e / local == me) recv[static_cast<size_t>(src)] += kept(src, e);
    }
  for (int64_t e = 0; e < E; ++e)
    send[static_cast<size_t>(e / local)] += order.counts[static_cast<size_t>(e)];
  const int64_t m = order.tokens.numel();  // this rank's kept slots, sorted by expert
  const Tensor rows = m ? g.gather_rows(xin, tokens) : be.empty({0, d}, x2.dtype());
  const Tensor got = g.expert_exchange(rows, send, recv);  // by source rank, then expert
  const int64_t R = got.dim(0);
  Tensor ys = be.empty({0, d}, got.dtype());  // the experts' outputs, in got's order
  if (R > 0) {
    // got's rows by expert, then source rank: grouped_matmul's order.
    const int64_t e0 = static_cast<int64_t>(me) * local;
    std::vector<int64_t> src_at(static_cast<size_t>(ep), 0);
    for (int src = 1; src < ep; ++src)
      src_at[static_cast<size_t>(src)] =
          src_at[static_cast<size_t>(src - 1)] + recv[static_cast<size_t>(src - 1)];
    std::vector<int32_t> perm, off(static_cast<size_t>(local + 1), 0);
    perm.reserve(static_cast<size_t>(R));
    for (int64_t e = 0; e < local; ++e) {
      for (int src = 0; src < ep; ++src) {
        int64_t at = src_at[static_cast<size_t>(src)];
        for (int64_t f = e0; f < e0 + e; ++f) at += kept(src, f);
        for (int64_t i = 0; i < kept(src, e0 + e); ++i)
          perm.push_back(static_cast<int32_t>(at + i));
      }
      off[static_cast<size_t>(e + 1)] = static_cast<int32_t>(perm.size());
    }
    bool identity = true;
    for (size_t i = 0; i < perm.size() && identity; ++i)
      identity = perm[i] == static_cast<int32_t>(i);
    Tensor offsets = be.empty({local + 1}, DType::i32);
    be.copy_from_host(offsets, off.data());
    Tensor by_expert, back;
    if (!identity) {
      std::vector<int32_t> inverse(perm.size());
      for (size_t i = 0; i < perm.size(); ++i)
        inverse[static_cast<size_t>(perm[i])] = static_cast<int32_t>(i);
      by_expert = be.empty({R}, DType::i32);
      back = be.empty({R}, DType::i32);
      be.copy_from_host(by_expert, perm.data());
      be.copy_from_host(back, inverse.data());
    }
    std::vector<int64_t> counts(static_cast<size_t>(local));
    for (size_t e = 0; e < counts.size(); ++e) counts[e] = off[e + 1] - off[e];
    const Tensor xs = identity ? got : g.gather_rows(got, by_expert);
    const Tensor y = moe_expert_mlp(g, p, s, xs, offsets, counts, prefix);
    ys = identity ? y : g.gather_rows(y, back);
  }
  const Tensor outs = g.expert_exchange(ys, recv, send);  // [m, d], in this rank's sorted order
  Tensor y;
  if (m == 0) {
    y = g.scale(xin, 0.f);  // every slot dropped, or no share (still on the tape)
  } else {
    const Tensor ws = g.reshape(g.gather_rows(g.reshape(win, {n * k, 1}), slot_ids), {m});
    y = g.scatter_add_rows(outs, tokens, ws, n);
  }
  return shares ? g.tensor_parallel_sum(y) : y;
}

}  // namespace

std::vector<ParamSpec> moe_params(const MoeSpec& s, const std::string& prefix) {
  check_moe(s, "moe_params");
  std::vector<ParamSpec> r = {dense_param(prefix + "router", s.d_model, s.num_experts)};
  if (s.gated)
    r.push_back(
        expert_param(s, prefix + "w_gate", s.d_model, s.hidden, {"experts", "embed", "mlp"}));
  r.push_back(expert_param(s, prefix + "w_up", s.d_model, s.hidden, {"experts", "embed", "mlp"}));
  r.push_back(expert_param(s, prefix + "w_down", s.hidden, s.d_model, {"experts", "mlp", "embed"}));
  return r;
}

int64_t moe_capacity(const MoeSpec& s, int64_t seq_len) {
  if (s.capacity_factor <= 0.f) return 0;
  // MaxText (layers/moe.py, generate_masks): int(max(ceil(T k / E) * cf, cf)); may be 0 for
  // cf < 1, which drops every slot.
  const int64_t fair = (seq_len * s.top_k + s.num_experts - 1) / s.num_experts;
  const double cf = s.capacity_factor;
  return static_cast<int64_t>(std::max(static_cast<double>(fair) * cf, cf));
}

LayerOutput moe(Graph& g, const Params& p, const MoeSpec& s, const Tensor& x,
                const std::string& prefix) {
  check_moe(s, "moe block");
  MT_CHECK(x.ndim() >= 1 && x.dim(-1) == s.d_model,
           "moe block: input " + x.str() + ", want [..., " + std::to_string(s.d_model) + "]");
  Backend& be = g.backend();
  const int64_t d = s.d_model, E = s.num_experts, k = s.top_k;
  const int64_t n = x.numel() / d, slots = n * k;
  // Sequences of T tokens: capacity and load balancing are per sequence, as in MaxText.
  const int64_t T = x.ndim() >= 2 ? x.dim(-2) : 1, B = T ? n / T : 0;
  const Tensor x2 = g.reshape(x, {n, d});
  const Tensor logits = g.matmul(x2, p[prefix + "router"]);  // [n, E]
  const Graph::Routing r = g.route(logits, static_cast<int>(k), s.sigmoid_scores, s.normalize_topk);
  // The n k token copies sorted by expert (on the host for now: the indices are read back, one
  // synchronisation per layer), those past an expert's capacity in their sequence left out, then
  // one grouped matmul per projection.
  // (Under expert parallelism, moe_expert_parallel sorts the rank's share.)
  const int ep = g.expert_ranks();
  // The metrics' load per expert and kept slots (under expert parallelism: the group's).
  std::vector<int64_t> routed;
  int64_t kept_slots = 0;
  LayerOutput out;
  if (ep > 1) {
    out.x = g.reshape(
        moe_expert_parallel(g, p, s, prefix, x2, r.weights, r.indices, T, routed, kept_slots),
        x.shape());
  } else {
    const Graph::ExpertOrder order = s.capacity_factor > 0.f
                                         ? g.sort_by_expert(r.indices, E, moe_capacity(s, T), T)
                                         : g.sort_by_expert(r.indices, E);
    routed = order.routed;
    kept_slots = order.slots.numel();
    out.x = moe_experts(g, p, s, prefix, x, x2, r.weights, order);
  }
  if (!g.wants_aux()) return out;  // inference: no losses or metrics to read

  // Load balancing, MaxText's: E / B * sum over sequences b and experts e of f_be P_be, with
  // f_be = count_be / T a constant and P_be = (1/T) sum over b's tokens of the scores, i.e.
  // sum over tokens t and experts e of probs[t, e] * c[t, e], c[t, e] = E f_{b(t)e} / (B T).
  // The per-sequence counts read the indices back once more (a second synchronisation per layer
  // on a device; the sort's host pass could hand them over if that ever shows in a profile).
  std::vector<int32_t> idx(static_cast<size_t>(slots));
  if (slots) be.copy_to_host(r.indices, idx.data());
  std::vector<float> c(static_cast<size_t>(n * E), 0.f);
  for (int64_t b = 0; b < B; ++b) {
    std::vector<int64_t> count(static_cast<size_t>(E), 0);
    for (int64_t i = b * T * k; i < (b + 1) * T * k; ++i) ++count[static_cast<size_t>(idx[i])];
    for (int64_t t = b * T; t < (b + 1) * T; ++t)
      for (int64_t e = 0; e < E; ++e)
        c[static_cast<size_t>(t * E + e)] = static_cast<float>(
            static_cast<double>(E) * static_cast<double>(count[e]) /
            (static_cast<double>(T) * static_cast<double>(T) * static_cast<double>(B)));
  }
  Tensor ct = be.empty({n, E}, DType::f32);
  if (n) be.copy_from_host(ct, c.data());
  Tensor ones_n = be.empty({1, n}, DType::f32), ones_e = be.empty({E, 1}, DType::f32);
  be.fill(ones_n, 1.f);
  be.fill(ones_e, 1.f);
  const Tensor lb = g.reshape(g.matmul(g.matmul(ones_n, g.mul(r.probs, ct)), ones_e), {1});
  out.aux.push_back({"moe_lb_loss", lb, s.load_balance_weight});

  // Router z-loss, mean of logsumexp(logits)^2: the cross-entropy kernel adds z lse^2 to each
  // row's loss, so the difference of its mean with z = 1 and z = 0 (the same targets) is it,
  // and so is the gradient (2 lse softmax per row).
  Tensor targets = be.empty({n}, DType::i32);
  const std::vector<int32_t> zero(static_cast<size_t>(n), 0);
  if (n) be.copy_from_host(targets, zero.data());
  const float inv_n = n ? 1.f / static_cast<float>(n) : 0.f;
  // (row_: the router's logits, also where the graph holds a part of the vocabulary.)
  const Tensor with_z = g.row_cross_entropy(logits, targets, 1.f, inv_n);
  const Tensor without = g.row_cross_entropy(logits, targets, 0.f, inv_n);
  out.aux.push_back({"moe_z_loss", g.add(with_z, g.scale(without, -1.f)), s.z_loss_weight});

  // Metrics (weight 0: logged in metrics.jsonl, not trained): the expert load and the drops.
  // (Under expert parallelism: the group's tokens.)
  const auto [lo, hi] = std::minmax_element(routed.begin(), routed.end());
  const int64_t slots_a = slots * (ep / g.expert_tensor_ranks());  // the group's batches
  const float share = slots_a ? 1.f / static_cast<float>(slots_a) : 0.f;
  std::string tag;
  if (s.layer >= 0) tag.append("/").append(std::to_string(s.layer));
  out.aux.push_back({"moe_load_min" + tag, scalar(be, static_cast<float>(*lo) * share), 0.f});
  out.aux.push_back({"moe_load_max" + tag, scalar(be, static_cast<float>(*hi) * share), 0.f});
  // Each expert's slots, which the trainer sums over a step's micro-batches and ranks for the
  // step's own least and most loaded shares (forward_backward).
  out.stats.push_back({"moe_slots" + tag, std::vector<double>(routed.begin(), routed.end())});
  if (s.capacity_factor > 0.f)
    out.aux.push_back({"moe_dropped_fraction",
                       scalar(be, static_cast<float>(slots_a - kept_slots) * share), 0.f});
  return out;
}

}  // namespace mt::blocks
