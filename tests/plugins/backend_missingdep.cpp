// A plugin whose dependency (libmt_test_missing.so) is not on the library path.
#include "mt/plugin.h"

int mt_test_missing_symbol();
namespace {
void register_nothing(mt::Registry&) { (void)mt_test_missing_symbol(); }
}  // namespace
MT_PLUGIN(mt::PluginKind::backend, "missingdep", "0.0.1", register_nothing, nullptr)
