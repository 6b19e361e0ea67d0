#include "model_info.h"

#include <fmt/format.h>

namespace mt {

ParamCounts count_parameters(const Model& m, bool tied_embedding) {
  ParamCounts c;
  auto add = [&](const ParamSpec& p) {
    const int64_t n = shape_numel(p.shape);
    c.total += n;
    if (p.matmul) c.matmul += n;
  };
  for (const auto& p : m.top_parameters()) {
    if (p.name == "embedding") {
      // The table is a lookup (no FLOPs) unless it doubles as the LM head.
      c.total += shape_numel(p.shape);
      if (tied_embedding) c.matmul += shape_numel(p.shape);
      else c.embedding += shape_numel(p.shape);
      continue;
    }
    add(p);
  }
  for (int i = 0; i < m.num_layers(); ++i)
    for (const auto& p : m.layer(i).parameters()) add(p);
  return c;
}

double training_flops_per_token(const Model& m, bool tied_embedding, int64_t seq_len,
                                bool causal) {
  const ParamCounts c = count_parameters(m, tied_embedding);
  const ModelDims d = m.dims();
  double attn = 12.0 * static_cast<double>(d.num_layers) * static_cast<double>(d.num_query_heads) *
                static_cast<double>(d.head_dim) * static_cast<double>(seq_len);
  if (causal) attn /= 2;
  return 6.0 * static_cast<double>(c.matmul) + attn;
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.1f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace mt
