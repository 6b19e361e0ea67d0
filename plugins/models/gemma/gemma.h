// The Gemma families (gemma, gemma2, gemma3): one implementation, built into one plugin file per
// family name (libmt_model_<name>.so: the core finds a family, and a Hugging Face config.json's
// model_type, by the file name). Each plugin file's entry point registers its own name through
// register_gemma_family; "gemma3_text" (the model_type of Gemma 3's text-only checkpoints) is
// the gemma3 family under the name config.json gives it.
#pragma once

#include <string>

#include "mt/registry.h"

namespace mt_gemma {

// Registers the family `name` ("gemma", "gemma2", "gemma3" or "gemma3_text") with the registry.
void register_gemma_family(mt::Registry& r, const std::string& name);

}  // namespace mt_gemma
