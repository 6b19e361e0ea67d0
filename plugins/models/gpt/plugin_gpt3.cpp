// The gpt3 family's plugin file (libmt_model_gpt3.so); the code is gpt.cpp's.
#include "gpt.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_gpt::register_gpt_family(r, "gpt3");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "gpt3", "0.1.0", register_family, nullptr)
