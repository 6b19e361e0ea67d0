// The SDK's shared blocks (mt/blocks.h), written with Graph's ops only: what they compute is
// what a family would write by hand, with the backward from the tape.
#include "mt/blocks.h"

#include <cmath>
#include <string>
#include <vector>

#include "mt/error.h"
#include "mt/graph.h"

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
  Tensor y = g.matmul(x, p[w]);
  return bias ? add_bias(g, y, p[b]) : y;
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

Tensor norm(Graph& g, const Params& p, const std::string& name, const Tensor& x,
            const NormSpec& s) {
  switch (s.kind) {
    case NormKind::rms:
      return g.rmsnorm(x, p[name], s.eps);
    case NormKind::rms_plus_one:
      return g.rmsnorm(x, p[name], s.eps, /*plus_one=*/true);
    case NormKind::layer:
      return g.layernorm(x, p[name], p[name + "_bias"], s.eps);
    case NormKind::layer_no_bias:
      return g.layernorm(x, p[name], Tensor(), s.eps);
  }
  throw Error("norm: unknown kind");
}

std::vector<ParamSpec> attention_params(const AttentionBlockSpec& s, const std::string& prefix) {
  const int64_t q = s.heads * s.head_dim, k = s.kv_heads * s.head_dim;
  const int64_t v = s.kv_heads * v_dim(s), o = s.heads * v_dim(s);
  std::vector<ParamSpec> r = {
      dense_param(prefix + "wq", s.d_model, q), dense_param(prefix + "wk", s.d_model, k),
      dense_param(prefix + "wv", s.d_model, v), dense_param(prefix + "wo", o, s.d_model)};
  if (s.qkv_bias) {
    r.push_back(bias_param(prefix + "bq", q));
    r.push_back(bias_param(prefix + "bk", k));
    r.push_back(bias_param(prefix + "bv", v));
  }
  if (s.out_bias) r.push_back(bias_param(prefix + "bo", s.d_model));
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
  Tensor q = g.reshape(linear(g, p, prefix + "wq", prefix + "bq", x, s.qkv_bias),
                       {b, t, s.heads, s.head_dim});
  Tensor k = g.reshape(linear(g, p, prefix + "wk", prefix + "bk", x, s.qkv_bias),
                       {b, t, s.kv_heads, s.head_dim});
  Tensor v =
      g.reshape(linear(g, p, prefix + "wv", prefix + "bv", x, s.qkv_bias), {b, t, s.kv_heads, dv});
  if (s.qk_norm) {
    q = norm(g, p, prefix + "q_norm", q, s.qk_norm_spec);
    k = norm(g, p, prefix + "k_norm", k, s.qk_norm_spec);
  }
  if (s.use_rope) {
    q = g.rope(q, in.positions, s.rope);
    k = g.rope(k, in.positions, s.rope);
  }
  AttentionSpec spec = s.attn;
  if (spec.scale == 0.f) spec.scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  if (dv != s.head_dim)
    throw Error("attention block: a value head size (" + std::to_string(dv) +
                ") other than the query/key "
                "head size (" +
                std::to_string(s.head_dim) + ") needs Graph::concat, not in this build.");
  Tensor a;
  if (in.cache) {  // decode: the core's cache (linear or sliding-window ring)
    a = g.cached_attention(*in.attention, q, k, v, *in.cache, spec);
  } else {
    a = g.attention(*in.attention, q, k, v, in.segment_ids, in.segment_ids, spec);
  }
  a = g.reshape(a, {b, t, s.heads * dv});
  return linear(g, p, prefix + "wo", prefix + "bo", a, s.out_bias);
}

std::vector<ParamSpec> mlp_params(const MlpSpec& s, const std::string& prefix) {
  std::vector<ParamSpec> r;
  if (s.gated) {
    r = {dense_param(prefix + "w_gate", s.d_model, s.hidden),
         dense_param(prefix + "w_up", s.d_model, s.hidden),
         dense_param(prefix + "w_down", s.hidden, s.d_model)};
    if (s.bias) {
      r.push_back(bias_param(prefix + "b_gate", s.hidden));
      r.push_back(bias_param(prefix + "b_up", s.hidden));
      r.push_back(bias_param(prefix + "b_down", s.d_model));
    }
  } else {
    r = {dense_param(prefix + "w_in", s.d_model, s.hidden),
         dense_param(prefix + "w_out", s.hidden, s.d_model)};
    if (s.bias) {
      r.push_back(bias_param(prefix + "b_in", s.hidden));
      r.push_back(bias_param(prefix + "b_out", s.d_model));
    }
  }
  return r;
}

Tensor mlp(Graph& g, const Params& p, const MlpSpec& s, const Tensor& x,
           const std::string& prefix) {
  if (s.gated) {
    Tensor gate = linear(g, p, prefix + "w_gate", prefix + "b_gate", x, s.bias);
    Tensor up = linear(g, p, prefix + "w_up", prefix + "b_up", x, s.bias);
    return linear(g, p, prefix + "w_down", prefix + "b_down", g.gated(s.act, gate, up), s.bias);
  }
  Tensor h = g.activation(s.act, linear(g, p, prefix + "w_in", prefix + "b_in", x, s.bias));
  return linear(g, p, prefix + "w_out", prefix + "b_out", h, s.bias);
}

ParamSpec embedding_param(const std::string& name, int64_t vocab, int64_t d, float stddev,
                          bool tied) {
  return {name, {vocab, d}, Init::normal, stddev, /*weight_decay=*/true, /*matmul=*/tied};
}

Tensor lm_head(Graph& g, const Params& p, const Tensor& h, bool tied, const std::string& embedding,
               const std::string& head) {
  // Tied: logits = h @ embedding^T, the table shared with the input lookup.
  return tied ? g.matmul(h, p[embedding], false, true) : g.matmul(h, p[head]);
}

}  // namespace mt::blocks
