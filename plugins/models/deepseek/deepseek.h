// The DeepSeek families (deepseek_v2, deepseek_v3): one implementation, built into one plugin
// file per family name (libmt_model_<name>.so: the core finds a family, and a Hugging Face
// config.json's model_type, by the file name).
#pragma once

#include <string>

#include "mt/registry.h"

namespace mt_deepseek {

// Registers the family `name` ("deepseek_v2" or "deepseek_v3") with the registry.
void register_deepseek_family(mt::Registry& r, const std::string& name);

}  // namespace mt_deepseek
