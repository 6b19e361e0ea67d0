// A well-formed model plugin that registers nothing but itself, for discovery tests.
#include "mt/plugin.h"

namespace {
void register_nothing(mt::Registry&) {}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "good", "1.2.3", register_nothing, nullptr)
