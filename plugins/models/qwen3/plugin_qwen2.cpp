// The qwen2 family's plugin file (libmt_model_qwen2.so); the code is qwen.cpp's.
#include "mt/plugin.h"
#include "qwen.h"

namespace {
void register_family(mt::Registry& r) {
  mt_qwen::register_qwen_family(r, "qwen2");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "qwen2", "0.1.0", register_family, nullptr)
