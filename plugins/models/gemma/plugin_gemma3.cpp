// The gemma3 family's plugin file (libmt_model_gemma3.so); the code is gemma.cpp's.
#include "gemma.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gemma::register_gemma_family(r, "gemma3");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gemma3", "0.1.0", register_family, nullptr)
