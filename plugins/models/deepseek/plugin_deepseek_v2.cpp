// The deepseek_v2 family's plugin file (libmt_model_deepseek_v2.so); the code is deepseek.cpp's.
#include "deepseek.h"
#include "mt/plugin.h"

namespace {
void register_family(mt::Registry& r) {
  mt_deepseek::register_deepseek_family(r, "deepseek_v2");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "deepseek_v2", "0.1.0", register_family, nullptr)
