// A plugin whose entry declares another name than its file's (libmt_model_misnamed.so).
#include "mt/model.h"
#include "mt/plugin.h"

namespace {
void register_other(mt::Registry& r) {
  r.add_model_family("other", []() -> std::unique_ptr<mt::ModelFamily> { return nullptr; });
}
}  // namespace
MT_PLUGIN(mt::PluginKind::model, "other", "1.0.0", register_other, nullptr)
