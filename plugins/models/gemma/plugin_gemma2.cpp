// The gemma2 family's plugin file (libmt_model_gemma2.so); the code is gemma.cpp's.
#include "gemma.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gemma::register_gemma_family(r, "gemma2");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gemma2", "0.1.0", register_family, nullptr)
