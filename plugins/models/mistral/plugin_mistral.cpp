// libmt_model_mistral.so: the mistral family (mistral.cpp).
#include "mistral_family.h"
#include "mt/plugin.h"

namespace {
void register_mistral(mt::Registry& r) {
  mt_mistral::register_family(r, /*moe=*/false);
}
}  // namespace

MT_PLUGIN(mt::PluginKind::model, "mistral", "0.1.0", register_mistral, nullptr)
