#include <cstdio>
#include <filesystem>
#include <string>

#include "cli.h"
#include "config_impl.h"
#include "config_loader.h"
#include "hf_interop.h"
#include "mt/error.h"
#include "plugin_manager.h"

namespace fs = std::filesystem;

namespace mt::cli {

Args parse_args(const std::string& command, int argc, char** argv, int first,
                size_t max_positional) {
  Args a;
  a.command = command;
  for (int i = first; i < argc; ++i) {
    std::string s = argv[i];
    if (s == "--help" || s == "-h") {
      a.help = true;
      continue;
    }
    std::string kv = s;
    if (s.rfind("--", 0) == 0) {
      kv = s.substr(2);
      if (kv.find('=') == std::string::npos) {
        // "--origins" style flags become key=true; a value-less key that the config does not
        // know is reported by the config layer with a suggestion.
        kv += "=true";
      }
    } else if (s.find('=') == std::string::npos) {
      // A bare word is a typo far more often than not (`steps 5` for steps=5): ignoring it
      // would run with the default instead, so anything a command does not take is refused.
      if (a.positional.size() < max_positional) {
        a.positional.push_back(s);
        continue;
      }
      std::string hint = "write options as key=value or --key=value";
      if (i + 1 < argc && std::string(argv[i + 1]).find('=') == std::string::npos &&
          std::string(argv[i + 1]).rfind("-", 0) != 0)
        hint = "did you mean " + s + "=" + argv[i + 1] + "?";
      throw UsageError("The argument '" + s + "' is not an option of mt " + command + ": " + hint +
                       " (`mt " + command + " --help` lists what it takes).");
    }
    const auto eq = kv.find('=');
    const std::string key = kv.substr(0, eq);
    const std::string value = kv.substr(eq + 1);
    if (key.empty()) throw UsageError("The argument '" + s + "' has no key before '='.");
    if (key == "model") a.model = value;
    else if (key == "config") a.config_file = value;
    else a.overrides.push_back(key + "=" + value);
  }
  return a;
}

fs::path configs_dir() {
  return (PluginManager::core_library_dir().parent_path() / "share" / "mt" / "configs")
      .lexically_normal();
}

std::vector<fs::path> model_dirs() {
  std::vector<fs::path> r;
  PluginManager pm;
  for (const auto& d : pm.search_dirs()) {
    std::error_code ec;
    if (fs::is_directory(d / "models", ec)) r.push_back(d / "models");
  }
  return r;
}

Config resolve_config(const Args& a) {
  ConfigRequest req;
  req.configs_dir = configs_dir();
  req.model_dirs = model_dirs();
  req.model = a.model;
  req.config_file = a.config_file;
  req.overrides = a.overrides;
  Config cfg = load_config(req);
  // hf_path=<dir>: the model's config comes from its config.json (through the family plugin),
  // layered after the model file and before the user's own overrides, which still win.
  if (const std::string hf = cfg.get_string("hf_path"); !hf.empty()) {
    std::vector<fs::path> dirs;
    for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
    PluginManager pm(dirs);
    const HfImport imp = read_hf_config(hf, pm);
    std::vector<std::string> layered = imp.overrides;
    std::error_code ec;
    // The model directory's own tokenizer, unless the user named one.
    bool user_tokenizer = false;
    for (const auto& o : a.overrides) user_tokenizer |= o.rfind("tokenizer_path=", 0) == 0;
    if (!user_tokenizer && (fs::exists(fs::path(hf) / "tokenizer.json", ec) ||
                            fs::exists(fs::path(hf) / "tokenizer.model", ec)))
      layered.push_back("tokenizer_path=" + hf);
    layered.insert(layered.end(), a.overrides.begin(), a.overrides.end());
    req.overrides = layered;
    cfg = load_config(req);
    for (const auto& u : imp.unused)
      std::fprintf(stderr, "mt: note: %s/config.json field not used by mt: %s\n", hf.c_str(), u.c_str());
  }
  // A relative data path that does not exist from the current directory is looked up in
  // share/mt (where the shipped corpus and tokenizer live), so `mt run` works from anywhere.
  const fs::path share = configs_dir().parent_path();
  for (const char* key : {"dataset_path", "eval_dataset_path", "tokenizer_path"}) {
    const std::string v = cfg.get_string(key);
    std::error_code ec;
    if (v.empty() || fs::path(v).is_absolute() || fs::exists(v, ec)) continue;
    if (fs::exists(share / v, ec)) {
      ConfigValue cv = cfg.impl().at(key);
      cv.s = (share / v).string();
      cfg.impl().set(key, cv);
    }
  }
  return cfg;
}

}  // namespace mt::cli
