// A well-formed model plugin for discovery tests: it registers a family "good" whose factory
// returns null (which mt refuses when something asks it for the family).
#include "mt/model.h"
#include "mt/plugin.h"

namespace {
void register_null_family(mt::Registry& r) {
  r.add_model_family("good", []() -> std::unique_ptr<mt::ModelFamily> { return nullptr; });
}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "good", "1.2.3", register_null_family, nullptr)
