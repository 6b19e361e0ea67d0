// A plugin declaring a future ABI: the loader must refuse it before calling anything else.
#include "mt/plugin.h"

namespace {
void register_nothing(mt::Registry&) {}
const mt::PluginInfo* entry() {
  static const mt::PluginInfo info{MT_ABI_VERSION + 998u, mt::PluginKind::model, "badabi",
                                   "9.9.9", register_nothing, nullptr};
  return &info;
}
}  // namespace
BOOST_DLL_ALIAS(entry, mt_plugin_entry)
