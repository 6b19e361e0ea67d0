#include "model_info.h"

#include <fmt/format.h>

#include "mt/error.h"

namespace mt {

namespace {

std::string dims_text(const ModelDims& d) {
  return fmt::format(
      "vocab_size={} d_model={} mlp_dim={} layers={} query_heads={} kv_heads={} head_dim={}",
      d.vocab_size, d.d_model, d.mlp_dim, d.num_layers, d.num_query_heads, d.num_kv_heads,
      d.head_dim);
}

}  // namespace

void check_model_sizes(const Model& m, int64_t batch, int64_t seq_len) {
  const ModelDims d = m.dims();
  int64_t total = 0;
  auto check = [&](const std::string& what, const Shape& shape) {
    size_t bytes = 0;
    try {
      bytes = shape_bytes(shape, DType::f32);
    } catch (const Error&) {
      throw UsageError(fmt::format(
          "The model cannot be built: {} would have shape {}, an impossible size (a negative "
          "dimension, or more bytes than fit in 64 bits; the model's dimensions: {}; batch {} x "
          "{} tokens). Check those config values.",
          what, shape_str(shape), dims_text(d), batch, seq_len));
    }
    return static_cast<int64_t>(bytes);
  };
  auto add = [&](const std::string& name, const Shape& shape) {
    if (__builtin_add_overflow(total, check("parameter '" + name + "'", shape), &total))
      throw UsageError(fmt::format(
          "The model cannot be built: its parameters add up to more bytes than fit in 64 bits "
          "(the model's dimensions: {}). Check those config values.",
          dims_text(d)));
  };
  for (const auto& p : m.top_parameters()) add(p.name, p.shape);
  for (int i = 0; i < m.num_layers(); ++i)
    for (const auto& p : m.layer(i).parameters())
      add("layers." + std::to_string(i) + "." + p.name, p.shape);
  // The widest activations of one micro-batch: the residual stream, the MLP, the attention
  // heads and the logits.
  check("the residual stream", {batch, seq_len, d.d_model});
  check("the MLP's hidden activations", {batch, seq_len, d.mlp_dim});
  check("the attention heads' activations", {batch, seq_len, d.num_query_heads, d.head_dim});
  check("the logits", {batch, seq_len, d.vocab_size});
}

ParamCounts count_parameters(const Model& m) {
  ParamCounts c;
  auto add = [&](const ParamSpec& p) {
    const int64_t n = shape_numel(p.shape);
    c.total += n;
    if (p.matmul) {
      c.matmul += n;
      c.active_matmul += static_cast<double>(n) * static_cast<double>(p.active);
    } else if (p.name == "embedding") {
      c.embedding += n;  // a lookup: no FLOPs
    }
  };
  for (const auto& p : m.top_parameters()) add(p);
  for (int i = 0; i < m.num_layers(); ++i)
    for (const auto& p : m.layer(i).parameters()) add(p);
  // Multi-token prediction: each depth's module and layer, then the shared head it runs (the
  // top-level matmul parameters: the LM head, or the tied embedding).
  const ParamCounts main = c;
  for (int k = 1; k <= m.mtp_depths(); ++k) {
    for (const auto& p : m.mtp_parameters(k)) add(p);
    for (const auto& p : m.mtp_layer(k).parameters()) add(p);
    for (const auto& p : m.top_parameters())
      if (p.matmul) c.active_matmul += static_cast<double>(shape_numel(p.shape)) * p.active;
  }
  c.mtp = c.total - main.total;
  c.mtp_active_matmul = c.active_matmul - main.active_matmul;
  c.active_matmul = main.active_matmul;
  return c;
}

double default_flops_per_token(const Model& m, int64_t seq_len) {
  const ParamCounts c = count_parameters(m);
  const ModelDims d = m.dims();
  const auto s = static_cast<double>(seq_len);
  double attn = 0;
  for (int i = 0; i < m.num_layers() + m.mtp_depths(); ++i) {
    const CacheSpec cs =
        (i < m.num_layers() ? m.layer(i) : m.mtp_layer(i - m.num_layers() + 1)).cache_spec();
    if (cs.entries.empty()) continue;  // no attention in this layer
    // Keys per query of a causal mask over seq_len positions, within the window (the
    // continuous approximation MaxText and PaLM use: seq_len / 2 without a window).
    const auto w = static_cast<double>(cs.window);
    const double keys = cs.window > 0 && w < s ? w - w * w / (2 * s) : s / 2;
    attn += 12.0 * static_cast<double>(d.num_query_heads) * static_cast<double>(d.head_dim) * keys;
  }
  return 6.0 * (c.active_matmul + c.mtp_active_matmul) + attn;
}

std::string model_label(const Config& cfg) {
  if (std::string m = cfg.get_string("model_name"); !m.empty()) return m;
  if (std::string h = cfg.get_string("hf_path"); !h.empty()) return "the model at hf_path=" + h;
  return "the configured model";
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace mt
