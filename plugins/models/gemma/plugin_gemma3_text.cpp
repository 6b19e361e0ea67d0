// libmt_model_gemma3_text.so: the gemma3 family under the model_type of Gemma 3 text-only
// config.json files (Gemma3ForCausalLM), so that hf_path= and mt convert find it; gemma.cpp.
#include "gemma.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gemma::register_gemma_family(r, "gemma3_text");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gemma3_text", "0.1.0", register_family, nullptr)
