// libmt_model_mixtral.so: the mixtral family (mistral.cpp).
#include "mistral_family.h"
#include "mt/plugin.h"

namespace {
void register_mixtral(mt::Registry& r) {
  mt_mistral::register_family(r, /*moe=*/true);
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "mixtral", "0.1.0", register_mixtral, nullptr)
