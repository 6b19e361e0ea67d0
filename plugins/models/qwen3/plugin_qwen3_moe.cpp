// The qwen3_moe family's plugin file (libmt_model_qwen3_moe.so); the code is qwen.cpp's.
#include "mt/plugin.h"
#include "qwen.h"

namespace {
void register_family(mt::Registry& r) {
  mt_qwen::register_qwen_family(r, "qwen3_moe");
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "qwen3_moe", "0.1.0", register_family, nullptr)
