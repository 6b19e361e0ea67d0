#include <fmt/format.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include "checkpoint_manager.h"
#include "cli.h"
#include "communicator.h"
#include "config_impl.h"
#include "config_loader.h"
#include "file_util.h"
#include "hf_interop.h"
#include "mt/error.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "trainer.h"

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
      // --model NAME and --config FILE take the next word as their value; without one they are
      // refused (before: --model read as a model named 'true').
      if (kv == "model" || kv == "config") {
        // A next word that looks like an option or a key=value is one, unless it is the config
        // file (a path with '=' in it, or one starting with '-').
        std::error_code ec;
        if (i + 1 < argc &&
            ((argv[i + 1][0] != '-' && std::string(argv[i + 1]).find('=') == std::string::npos) ||
             (kv == "config" && std::filesystem::is_regular_file(argv[i + 1], ec)))) {
          kv += "=" + std::string(argv[++i]);
        } else {
          throw UsageError("--" + kv + " needs a value: --" + kv + "=" +
                           (kv == "model" ? "<name> (`mt models` lists them)" : "<file.yml>") +
                           (i + 1 < argc
                                ? std::string(" (the next word, ") + argv[i + 1] +
                                      ", looks like an option or a key=value, and is taken as one)"
                                : std::string()) +
                           ".");
        }
      }
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
    // (before: --config= was ignored and the run went on without the file meant)
    if ((key == "config" || key == "model") && value.empty())
      throw UsageError("--" + key + "= has no value: --" + key + "=" +
                       (key == "model" ? "<name> (`mt models` lists them)" : "<file.yml>") + ".");
    // One config file: a second one's keys were silently dropped, so it is refused. A second
    // --model wins, as words do (last wins).
    if (key == "config" && !a.config_file.empty() && a.config_file != value)
      throw UsageError("--config is given twice (" + a.config_file + " and " + value + "): mt " +
                       command +
                       " reads one config file; put the keys of both in one file, or give the "
                       "second's as key=value words.");
    if (key == "model")
      a.model = value;
    else if (key == "config")
      a.config_file = value;
    else
      a.overrides.push_back(key + "=" + value);
  }
  if (!a.model.empty())
    for (const auto& o : a.overrides)
      if (o.rfind("model_name=", 0) == 0 && o.substr(11) != a.model)
        throw UsageError("--model=" + a.model + " and " + o +
                         " name two models: give one of them (--model is model_name).");
  return a;
}

fs::path configs_dir() {
  return (PluginManager::core_library_dir().parent_path() / "share" / "mt" / "configs")
      .lexically_normal();
}

std::vector<fs::path> model_dirs(const Args& a) {
  // plugin_dirs as the words and the --config file give it: the config that names the model is
  // not resolved yet, and a plugin's models/ must be searched to resolve it.
  std::vector<fs::path> extra;
  auto add = [&](const YAML::Node& n) {
    if (n.IsSequence()) {
      for (const auto& d : n)
        if (d.IsScalar()) extra.emplace_back(d.Scalar());
    } else if (n.IsScalar() && !n.Scalar().empty()) {
      extra.emplace_back(n.Scalar());
    }
  };
  try {
    if (!a.config_file.empty()) {
      const YAML::Node n = YAML::Load(read_file(a.config_file, "config", kMaxConfigFileBytes));
      if (n.IsMap() && n["plugin_dirs"]) add(n["plugin_dirs"]);
    }
    for (const auto& o : a.overrides)
      if (o.rfind("plugin_dirs=", 0) == 0) add(YAML::Load(o.substr(12)));
  } catch (const std::exception&) {
    // load_config refuses what does not parse, with the file and line.
  }
  std::vector<fs::path> r;
  PluginManager pm(extra);
  for (const auto& d : pm.search_dirs()) {
    std::error_code ec;
    if (fs::is_directory(d / "models", ec)) r.push_back(d / "models");
  }
  return r;
}

namespace {

// The keys the user set: key=value / --key=value words and the top-level keys of --config.
std::set<std::string> user_keys(const Args& a) {
  std::set<std::string> keys;
  for (const auto& o : a.overrides) keys.insert(o.substr(0, o.find('=')));
  if (!a.config_file.empty()) {
    try {
      const YAML::Node n = YAML::Load(read_file(a.config_file, "config", kMaxConfigFileBytes));
      if (n.IsMap())
        for (const auto& kv : n) keys.insert(kv.first.Scalar());
    } catch (const std::exception&) {
      // load_config has already refused a file that does not parse.
    }
  }
  if (!a.model.empty()) keys.insert("model_name");
  return keys;
}

std::vector<fs::path> plugin_dirs_of(const Config& cfg) {
  std::vector<fs::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  return dirs;
}

// mt decode / mt score / mt plan load_parameters_path=<checkpoint of mt run> (mt convert --to=hf
// --input=<checkpoint>) with no model named (no
// --model, model_name= or decoder_block=, by any layer the user wrote): the checkpoint's config
// is the model, as config.json is with hf_path. Layers into `req` the saved model keys (base.yml's
// model sections less the core's run choices (dtypes, kernels, remat, init), and the family's
// own keys), and the run's tokenizer where the user names none and it still exists; the user's
// settings still win. Returns the saved model_name (for the config's display), or nothing when
// the checkpoint has no config to take (a bare safetensors file, a foreign checkpoint).
std::optional<std::string> checkpoint_model(const Args& a, ConfigRequest& req, const Config& layers,
                                            std::vector<std::string>& notes) {
  const std::set<std::string> user = user_keys(a);
  if (user.count("model_name") || user.count("decoder_block")) return std::nullopt;
  for (const auto& [name, value] : req.environment)
    if (name == "M_MODEL_NAME" || name == "M_DECODER_BLOCK") return std::nullopt;
  const std::string ckpt = layers.get_string("load_parameters_path");
  YAML::Node saved;
  try {
    saved = YAML::Load(checkpoint_config_yaml(ckpt));
  } catch (const YAML::Exception&) {
    return std::nullopt;  // loading the weights says what is wrong with the checkpoint
  }
  if (!saved.IsMap() || !saved["decoder_block"] || !saved["decoder_block"].IsScalar())
    return std::nullopt;
  auto text = [](const YAML::Node& n) {
    if (n.IsScalar()) return n.Scalar();
    YAML::Emitter e;
    e << YAML::Flow << n;
    return std::string(e.c_str());
  };
  const std::string block = saved["decoder_block"].Scalar();
  // The keys the saved family declares, with base.yml's: the family's schema, as load_config
  // will add it.
  ConfigRequest fam = req;
  fam.overrides = {"model_name=", "decoder_block=" + block};
  fam.config_file.clear();
  fam.environment.clear();
  if (req.schemas_for)
    for (auto& t : req.schemas_for(preview_config(fam))) fam.schema_texts.push_back(std::move(t));
  const Config known = preview_config(fam);
  const auto& base = layers.impl().sections;
  std::vector<std::string> layered = {"decoder_block=" + block};
  for (const auto& kv : saved) {
    const std::string key = kv.first.Scalar();
    const auto sec = known.impl().sections.find(key);
    if (sec == known.impl().sections.end() || key == "decoder_block" ||
        core_model_keys().count(key))
      continue;  // a key this mt does not declare (an older run's) is not the model's
    const bool model_key =
        sec->second == "Model" || sec->second == "Multi-head latent attention (DeepSeek)";
    if (model_key || !base.count(key)) layered.push_back(key + "=" + text(kv.second));
  }
  // The run's tokenizer, for text prompts, when it is still where the run found it.
  if (!user.count("tokenizer_path") && saved["tokenizer_path"] &&
      saved["tokenizer_path"].IsScalar() && !saved["tokenizer_path"].Scalar().empty()) {
    std::error_code ec;
    const std::string tok = saved["tokenizer_path"].Scalar();
    if (fs::exists(tok, ec)) {
      layered.push_back("tokenizer_path=" + tok);
      if (!user.count("tokenizer_type") && saved["tokenizer_type"] &&
          saved["tokenizer_type"].IsScalar())
        layered.push_back("tokenizer_type=" + saved["tokenizer_type"].Scalar());
    } else {
      notes.push_back("the checkpoint's tokenizer_path " + tok + " no longer exists" +
                      (fs::path(tok).is_relative()
                           ? " from this directory (a run before this mt recorded it relative)"
                           : "") +
                      "; text needs tokenizer_path= set to a tokenizer.");
    }
  }
  req.imported = std::move(layered);
  req.imported_origin = ckpt + " (load_parameters_path: the checkpoint's config)";
  req.overrides = {"model_name="};
  req.overrides.insert(req.overrides.end(), a.overrides.begin(), a.overrides.end());
  const YAML::Node name = saved["model_name"];
  return name && name.IsScalar() ? name.Scalar() : std::string();
}

}  // namespace

Config resolve_config(const Args& a, bool notes) {
  ConfigRequest req;
  req.configs_dir = configs_dir();
  req.model_dirs = model_dirs(a);
  req.model = a.model;
  req.config_file = a.config_file;
  req.overrides = a.overrides;
  // MaxText's M_<KEY> environment overrides.
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const size_t eq = kv.find('=');
    if (kv.rfind("M_", 0) == 0 && eq != std::string::npos)
      req.environment.emplace_back(kv.substr(0, eq), kv.substr(eq + 1));
  }
  // The family's own keys (ModelFamily::config_schema) join the schema once the layers have
  // decided decoder_block; only that family's plugin is loaded. A family that cannot be loaded
  // adds no keys: commands that need it refuse it by name when they make it, and the others
  // (mt plugins, mt tokenize) do not need it.
  // So do the keys of the data plugin dataset_type names (Registry::add_dataset_keys).
  std::string family_error;
  req.schemas_for = [&family_error](const Config& layers) {
    const std::string name = layers.get_string("decoder_block");
    std::vector<SchemaText> texts;
    PluginManager pm(plugin_dirs_of(layers));
    try {
      std::string yaml = pm.make_model_family(name)->config_schema();
      if (!yaml.empty())
        texts.push_back({"model family '" + name + "' config_schema()", std::move(yaml)});
    } catch (const Error& e) {
      family_error = e.what();
    }
    const std::string data = layers.get_string("dataset_type");
    try {
      std::string yaml = pm.dataset_keys(data);
      if (!yaml.empty())
        texts.push_back({"data plugin '" + data + "' add_dataset_keys()", std::move(yaml)});
    } catch (const Error&) {
      // mt run refuses a dataset_type it cannot load, by name, when it makes the source.
    }
    return texts;
  };
  // hf_path=<dir>: the model's config comes from its config.json (through the family plugin),
  // layered after base.yml and before the user's own settings, which still win. No named model
  // is layered, and naming one is refused: base.yml's default model (its sizes, context length
  // and tokenizer) has nothing to do with the directory's.
  const Config layers = preview_config(req);
  std::vector<std::string> unused;
  std::optional<std::string> saved_model;  // the checkpoint's model_name, when it is the model
  if (const std::string hf = layers.get_string("hf_path"); !hf.empty()) {
    PluginManager pm(plugin_dirs_of(layers));
    const std::set<std::string> user = user_keys(a);
    // A named model beneath the directory's config.json would leave its keys that config.json
    // does not set (a sliding window, a soft cap) in a model built from another's weights.
    if (user.count("model_name") && !layers.get_string("model_name").empty())
      throw UsageError(
          "hf_path=" + hf + " configures the model from " + hf +
          "/config.json alone, so it takes no named model (model_name=" +
          layers.get_string("model_name") +
          ", from --model or a config file): that model's keys that config.json does not set "
          "would be mixed in. Drop the model's name, and set on the command line any key to "
          "change.");
    const HfImport imp = read_hf_config(hf, pm);
    // The directory's keys, a layer named as their origin; model_name= chooses no model file.
    std::vector<std::string> layered = imp.overrides;
    // The context: base.yml's max_target_length unless the model supports less.
    if (!user.count("max_target_length")) {
      for (const auto& o : imp.overrides) {
        if (o.rfind("max_position_embeddings=", 0) != 0) continue;
        int64_t mpe = 0;
        const std::string v = o.substr(o.find('=') + 1);
        std::from_chars(v.data(), v.data() + v.size(), mpe);
        // The context the run would have otherwise: base.yml's (not the default model's, which
        // the directory replaces).
        ConfigRequest base = req;
        base.overrides = {"model_name="};
        base.schemas_for = nullptr;
        const int64_t context = preview_config(base).get_int("max_target_length");
        if (mpe > 0 && mpe < context)
          layered.push_back("max_target_length=" + std::to_string(mpe));
      }
    }
    // The tokenizer: the directory's own, unless the user named one; never another model's.
    std::error_code ec;
    if (!user.count("tokenizer_path")) {
      const bool has_tok = fs::exists(fs::path(hf) / "tokenizer.json", ec) ||
                           fs::exists(fs::path(hf) / "tokenizer.model", ec);
      layered.push_back("tokenizer_path=" + (has_tok ? hf : std::string()));
    }
    req.imported = std::move(layered);
    req.imported_origin = hf + "/config.json (hf_path)";
    req.overrides = {"model_name="};
    req.overrides.insert(req.overrides.end(), a.overrides.begin(), a.overrides.end());
    for (const auto& u : imp.unused)
      unused.push_back(hf + "/config.json field not used by mt: " + u);
  } else if ((a.command == "decode" || a.command == "score" || a.command == "convert" ||
              a.command == "plan") &&
             !layers.get_string("load_parameters_path").empty()) {
    saved_model = checkpoint_model(a, req, layers, unused);
  }
  Config cfg;
  try {
    cfg = load_config(req);
  } catch (const UnknownKeyError& e) {
    if (family_error.empty()) throw;
    throw UnknownKeyError(std::string(e.what()) +
                          " That family's own keys could not be read: " + family_error);
  }
  if (saved_model) {
    ConfigValue v = cfg.impl().at("model_name");
    v.s = *saved_model;
    v.origin = req.imported_origin;
    cfg.impl().set("model_name", v);
  }
  // A model name found in more than one directory: the first is used; say which, once.
  if (const std::string m = cfg.get_string("model_name"); notes && !m.empty() && !saved_model) {
    std::vector<fs::path> found;
    std::vector<fs::path> dirs = {req.configs_dir / "models"};
    dirs.insert(dirs.end(), req.model_dirs.begin(), req.model_dirs.end());
    for (const auto& d : dirs) {
      std::error_code ec;
      if (fs::is_regular_file(d / (m + ".yml"), ec)) found.push_back(d / (m + ".yml"));
    }
    for (size_t i = 1; i < found.size(); ++i)
      unused.push_back("model '" + m + "' is " + found[0].string() + "; " + found[i].string() +
                       " has the same name and is not used (the shipped models come first, "
                       "then plugin_dirs' models/ in order): rename it to use it.");
  }
  if (notes)
    for (const auto& u : unused) std::fprintf(stderr, "mt: note: %s\n", u.c_str());
  // The keys that name files or directories; `data`: a data path, looked up in share/mt too
  // (below).
  struct PathKey {
    const char* key;
    bool data;
  };
  static constexpr PathKey kPathKeys[] = {{"base_output_directory", false},
                                          {"dataset_path", true},
                                          {"eval_dataset_path", true},
                                          {"tokenizer_path", true},
                                          {"load_parameters_path", false},
                                          {"load_full_state_path", false},
                                          {"hf_path", false},
                                          {"prompt_file", false},
                                          {"input", false},
                                          {"output", false}};
  // "~" is the shell's: a quoted 'key=~/x' and a config file's ~/x reach mt as written, and a
  // directory literally named "~" was made in the current one (while the log showed ~/x, as if
  // it were the home directory).
  for (const auto& [key, data] : kPathKeys) {
    if (!cfg.has(key)) continue;
    const std::string v = cfg.get_string(key);
    if (v == "~" || v.rfind("~/", 0) == 0)
      cfg.reject(key,
                 "starts with ~, which mt does not expand (a shell does, where it is not "
                 "quoted; in a config file or in quotes it reaches mt as written): write "
                 "the home directory out, as $HOME" +
                     v.substr(1) + " on the command line, or the full path.");
  }
  // A relative data path that does not exist from the current directory is looked up in
  // share/mt (where the shipped corpus and tokenizer live), so `mt run` works from anywhere. One
  // that exists is made absolute: the run's config.yml and its checkpoints record where it is,
  // and mt decode or mt score of the checkpoint find the same tokenizer from any directory
  // (before: data/tokenizer.json was looked up again from wherever they ran, and another
  // directory's tokenizer used silently).
  const fs::path share = configs_dir().parent_path();
  for (const auto& [key, data] : kPathKeys) {
    if (!data) continue;
    const std::string v = cfg.get_string(key);
    std::error_code ec;
    if (v.empty() || fs::path(v).is_absolute()) continue;
    fs::path found;
    if (fs::exists(v, ec))
      found = fs::absolute(v, ec);
    else if (fs::exists(share / v, ec))
      found = share / v;
    if (!found.empty() && !ec) {
      ConfigValue cv = cfg.impl().at(key);
      cv.s = found.lexically_normal().string();
      cfg.impl().set(key, cv);
    }
  }
  return cfg;
}

TrainSummary train_on_ranks(const Config& cfg, PluginManager& pm, bool quiet, Communicator& comm,
                            const char* command) {
  TrainSummary s;
  try {
    s = train(cfg, pm, quiet, &comm);
  } catch (const Error& e) {
    if (comm.size() == 1) throw;
    // Refusals of the config and the mesh are decided by every rank alike: rank 0 says it once
    // and every rank exits with its code. Any other failure may be this rank's alone while the
    // others wait in a collective: it ends the whole job.
    std::fflush(stdout);
    if (e.kind() == ErrorKind::usage) {
      if (comm.rank() == 0) {
        std::fprintf(stderr, "%s: error: %s\n", command, e.what());
        std::fflush(stderr);
        comm.abort(e.exit_code());
      }
      // The others give rank 0 time to say it: its abort ends them first, while one of theirs
      // could end rank 0 before it has printed. A rank still here refused alone (a file missing
      // on its node) while rank 0 waits in a collective: it says why, with its rank (before:
      // the job ended with no word of it).
      std::this_thread::sleep_for(std::chrono::seconds(10));
    }
    std::fprintf(stderr, "%s: error on rank %d of %d: %s\n", command, comm.rank(), comm.size(),
                 e.what());
    comm.abort(e.exit_code());
  }
  return s;
}

void check_output_file(const std::string& key, const std::string& path,
                       const std::vector<std::string>& inputs,
                       bool (*ours)(const std::filesystem::path&), const std::string& what) {
  const fs::path out(path);
  const fs::path dir = out.has_parent_path() ? out.parent_path() : fs::path(".");
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw UsageError(
        fmt::format("{}={}: {} is a file, not a directory; choose an output path in a "
                    "directory.",
                    key, path, dir.string()));
  if (!fs::is_directory(dir, ec))
    throw UsageError(fmt::format("{}={}: the directory {} does not exist; create it first.", key,
                                 path, dir.string()));
  if (fs::is_directory(out, ec))
    throw UsageError(fmt::format("{}={} is a directory; name the {} to write, such as {}/out.", key,
                                 path, what, path));
  if (!fs::exists(out, ec)) return;
  for (const auto& in : inputs)
    if (!in.empty() && fs::equivalent(out, in, ec))
      throw UsageError(fmt::format(
          "{}={} is also an input of the command ({}); writing it would destroy that input. "
          "Choose another output path.",
          key, path, in));
  if (!ours(out))
    throw UsageError(fmt::format(
        "{}={} exists and is not a {} this command wrote; it is left as it is. Remove it or "
        "choose another output path.",
        key, path, what));
}

void refuse_quantization(const Config& cfg, const std::string& command, const std::string& why) {
  if (!cfg.get_string("quantization").empty())
    cfg.reject("quantization", "has no effect on " + command + ", which " + why +
                                   ": int8 weights are made at load by mt decode, mt score and "
                                   "mt bench decode. Unset it.");
  if (cfg.get_bool("quantize_kvcache"))
    cfg.reject("quantize_kvcache", "has no effect on " + command + ", which " + why +
                                       ": the int8 cache is mt decode's and mt bench decode's. "
                                       "Unset it.");
}

}  // namespace mt::cli
