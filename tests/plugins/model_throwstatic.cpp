// A plugin with a global object whose constructor throws while the library loads: the
// exception unwinds through the dynamic loader, which mt cannot recover from. Built into a
// directory of its own (tests/plugins-static), so no other test's scan loads it.
#include <stdexcept>

#include "mt/plugin.h"

namespace {
struct Throws {
  Throws() { throw std::runtime_error("static initialiser says no"); }
};
const Throws throws_at_load;
void register_nothing(mt::Registry&) {}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "throwstatic", "1.0.0", register_nothing, nullptr)
