// The GPT families (gpt2, gpt3): one implementation, built into one plugin file per family name
// (libmt_model_<name>.so: the core finds a family, and a Hugging Face config.json's model_type,
// by the file name). Each plugin file's entry point registers its own name.
#pragma once

#include <string>

#include "mt/registry.h"

namespace mt_gpt {

// Registers the family `name` ("gpt2" or "gpt3") with the registry.
void register_gpt_family(mt::Registry& r, const std::string& name);

}  // namespace mt_gpt
