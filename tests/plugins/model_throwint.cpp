// A plugin whose registration throws something that is not a std::exception.
#include "mt/plugin.h"

namespace {
void register_throws(mt::Registry&) {
  throw 7;
}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "throwint", "1.0.0", register_throws, nullptr)
