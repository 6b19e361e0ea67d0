// Projection weights that read the same input in blocks::attention (wq, wk, wv) and blocks::mlp
// (w_gate, w_up): inference may store each group back to back in one tensor, which a layer's
// Params then also hold under the group's joined name (ModelRunner::fuse_projections), and the
// blocks make one product of the group.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace mt {

// Each group's names without the block's prefix, in the order the blocks declare them.
inline std::vector<std::vector<std::string_view>> fused_projection_groups() {
  return {{"wq", "wk", "wv"}, {"w_gate", "w_up"}};
}

// The name of a fused group in a layer's Params: prefix + "wq+wk+wv".
inline std::string fused_projection_name(const std::string& prefix,
                                         const std::vector<std::string_view>& group) {
  std::string name = prefix;
  for (size_t i = 0; i < group.size(); ++i) {
    if (i) name += '+';
    name += group[i];
  }
  return name;
}

}  // namespace mt
