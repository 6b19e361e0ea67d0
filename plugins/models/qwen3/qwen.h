// The Qwen families (qwen2, qwen3, qwen3_moe): one implementation, built into one plugin file
// per family name (libmt_model_<name>.so: the core finds a family, and a Hugging Face
// config.json's model_type, by the file name). Each plugin file's entry point registers its own
// name through register_qwen_family.
#pragma once

#include <string>

#include "mt/registry.h"

namespace mt_qwen {

// Registers the family `name` ("qwen2", "qwen3" or "qwen3_moe") with the registry.
void register_qwen_family(mt::Registry& r, const std::string& name);

}  // namespace mt_qwen
