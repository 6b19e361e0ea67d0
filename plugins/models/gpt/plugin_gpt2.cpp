// The gpt2 family's plugin file (libmt_model_gpt2.so); the code is gpt.cpp's.
#include "gpt.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gpt::register_gpt_family(r, "gpt2");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gpt2", "0.1.0", register_family, nullptr)
