// The Mistral families, shared by two plugins: `mistral` (Llama's layers with sliding-window
// grouped-query attention) and `mixtral` (the same attention and a mixture-of-experts MLP). One
// source (mistral.cpp) builds both; each plugin file registers one family name, since the core
// finds a family by its shared object's name (libmt_model_<name>.so).
#pragma once

namespace mt {
class Registry;
}

namespace mt_mistral {

// Registers "mixtral" when `moe`, else "mistral".
void register_family(mt::Registry& r, bool moe);

}  // namespace mt_mistral
