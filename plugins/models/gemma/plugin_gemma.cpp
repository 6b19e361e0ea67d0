// The gemma family's plugin file (libmt_model_gemma.so); the code is gemma.cpp's.
#include "gemma.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gemma::register_gemma_family(r, "gemma");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gemma", "0.1.0", register_family, nullptr)
