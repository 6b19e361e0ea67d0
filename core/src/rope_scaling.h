// The rope scalings and the config keys each one reads (blocks::rope_scaling_from_config reads
// exactly these): one list, which the runner also names when a key is set without its rope_type.
#pragma once

#include <string_view>
#include <vector>

namespace mt {

struct RopeScalingKeys {
  std::string_view rope_type;  // the value of rope_type that reads them
  std::vector<std::string_view> keys;
};
const std::vector<RopeScalingKeys>& rope_scaling_keys();

}  // namespace mt
