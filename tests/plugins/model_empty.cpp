// A plugin whose registration adds nothing: refused as unusable.
#include "mt/plugin.h"

namespace {
void register_nothing(mt::Registry&) {}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "empty", "1.0.0", register_nothing, nullptr)
