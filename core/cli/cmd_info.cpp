// mt plugins, mt models, mt config: what is installed and what a run would use.
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "cli.h"
#include "config_impl.h"
#include "config_loader.h"
#include "model_info.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "mt/model.h"
#include "mt/ops.h"
#include "plugin_manager.h"

namespace fs = std::filesystem;

namespace mt::cli {

namespace {

std::vector<fs::path> plugin_dirs_of(const Config& cfg) {
  std::vector<fs::path> r;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) r.emplace_back(d);
  return r;
}

// Strips flags that only this command understands from the overrides.
bool take_flag(Args& a, const std::string& key) {
  for (auto it = a.overrides.begin(); it != a.overrides.end(); ++it) {
    if (*it == key + "=true") {
      a.overrides.erase(it);
      return true;
    }
  }
  return false;
}

}  // namespace

int cmd_plugins(const Args& args) {
  Config cfg = resolve_config(args);
  PluginManager pm(plugin_dirs_of(cfg));
  std::printf("Plugin search path (first match wins):\n");
  for (const auto& d : pm.search_dirs())
    std::printf("  %s%s\n", d.string().c_str(), PluginManager::missing_note(d).c_str());
  const auto recs = pm.scan();
  std::printf("\n%-8s %-14s %-8s %-4s %s\n", "KIND", "NAME", "VERSION", "ABI", "PATH");
  int failed = 0, shadowed = 0;
  for (const auto& r : recs) {
    std::printf("%-8s %-14s %-8s %-4s %s\n", r.kind.c_str(), r.name.c_str(),
                r.version.empty() ? "-" : r.version.c_str(),
                r.abi ? std::to_string(r.abi).c_str() : "-", r.path.string().c_str());
    if (!r.shadowed_by.empty()) {
      ++shadowed;
      std::printf("         SHADOWED, not loaded: %s, earlier in the search path, has its name\n",
                  r.shadowed_by.string().c_str());
      continue;
    }
    if (!r.ok) {
      ++failed;
      std::printf("         FAILED: %s\n", r.error.c_str());
      continue;
    }
    if (r.kind == "backend") {
      try {
        auto b = pm.make_backend(r.name, cfg);
        std::printf("         %s\n", b->describe().c_str());
        std::string att;
        for (const auto& n : pm.attention_names(r.name)) att += (att.empty() ? "" : ", ") + n;
        std::printf("         attention kernels: %s\n", att.empty() ? "none" : att.c_str());
        std::string composed;
        for (const OpInfo& op : all_ops())
          if (!b->supports(op.op)) composed += (composed.empty() ? "" : ", ") + op.name;
        if (composed.empty())
          std::printf("         ops: all %zu of op set %d with kernels of its own\n",
                      all_ops().size(), MT_OPSET_VERSION);
        else
          std::printf("         ops composed by the core (slower): %s\n", composed.c_str());
      } catch (const std::exception& e) {
        std::printf("         FAILED to start: %s\n", e.what());
      }
    }
  }
  if (recs.empty()) std::printf("(no plugins found)\n");
  std::printf("\n%zu plugins found, %d unusable%s.\n", recs.size() - static_cast<size_t>(shadowed),
              failed, shadowed ? (", " + std::to_string(shadowed) + " shadowed").c_str() : "");
  return 0;
}

int cmd_models(const Args& args) {
  Config base = resolve_config(args);
  PluginManager pm(plugin_dirs_of(base));
  const auto models = list_models(configs_dir(), model_dirs(args));
  // Each model resolved as the listing found it: with the words' plugin_dirs.
  std::vector<std::string> dirs_words;
  for (const auto& o : args.overrides)
    if (o.rfind("plugin_dirs=", 0) == 0) dirs_words.push_back(o);
  int name_w = 16, family_w = 8;  // widened to the longest, so the columns stay columns
  for (const auto& m : models) {
    name_w = std::max(name_w, static_cast<int>(m.name.size()));
    family_w = std::max(family_w, static_cast<int>(m.family.size()));
  }
  std::printf("%-*s %-*s %10s  %s\n", name_w, "MODEL", family_w, "FAMILY", "PARAMS", "CONFIG");
  for (const auto& m : models) {
    std::string params = "?";  // until the family plugin sizes it
    try {
      Args a;
      a.model = m.name;
      a.overrides = dirs_words;
      Config cfg = resolve_config(a);
      auto fam = pm.make_model_family(cfg.get_string("decoder_block"));
      fam->validate(cfg);
      auto model = fam->build(cfg);
      params = human_count(static_cast<double>(count_parameters(*model).total));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "mt models: %s: %s\n", m.name.c_str(), e.what());
    }
    std::string where = m.path.string();
    for (const auto& p : m.shadowed)
      where += " (SHADOWS " + p.string() + ": the first found is the model; rename the other)";
    std::printf("%-*s %-*s %10s  %s\n", name_w, m.name.c_str(), family_w, m.family.c_str(),
                params.c_str(), where.c_str());
  }
  return 0;
}

int cmd_config(const Args& args_in) {
  Args args = args_in;
  const bool origins = take_flag(args, "origins");
  Config cfg = resolve_config(args);
  // The family checks its part as `mt run` would, so a config shown here is one that runs.
  PluginManager pm(plugin_dirs_of(cfg));
  pm.make_model_family(cfg.get_string("decoder_block"))->validate(cfg);
  std::fputs(cfg.to_yaml(origins).c_str(), stdout);
  return 0;
}

}  // namespace mt::cli
