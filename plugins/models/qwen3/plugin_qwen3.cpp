// The qwen3 family's plugin file (libmt_model_qwen3.so); the code is qwen.cpp's.
#include "mt/plugin.h"
#include "qwen.h"

namespace {
void register_family(mt::Registry& r) {
  mt_qwen::register_qwen_family(r, "qwen3");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "qwen3", "0.1.0", register_family, nullptr)
