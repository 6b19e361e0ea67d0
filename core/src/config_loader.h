// Loading the layered config: configs/base.yml (the schema and the defaults), the named model
// file, the user's --config file and command-line overrides, validated before any work starts.
//
// The schema is base.yml itself: a key's type is the type of its default, and its constraint is
// the bracketed annotation at the end of its comment ([>0], [>=0], [>=-1], [0..1],
// [choices: a|b|c]). Every refusal is an mt::UsageError of one paragraph that names the key, the
// value and where it was set.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "config_impl.h"
#include "mt/config.h"

namespace mt {

struct ConfigRequest {
  std::filesystem::path configs_dir;  // holds base.yml and models/
  // Extra directories searched for <model>.yml after configs_dir/models, in order.
  std::vector<std::filesystem::path> model_dirs;
  // Files declaring extra keys in base.yml's format (a plugin's own settings), after base.yml's.
  std::vector<std::filesystem::path> schema_files;
  std::string model;                   // from --model; "" = model_name from the layers
  std::string config_file;             // --config; "" = none
  std::vector<std::string> overrides;  // "key=value" (or "--key=value") in command-line order
};

// Resolves and validates the config; throws mt::UsageError.
Config load_config(const ConfigRequest& req);

struct ModelEntry {
  std::string name;    // file stem: what --model takes
  std::string family;  // its decoder_block (base.yml's default when the file has none)
  std::filesystem::path path;
  std::string description;  // the file's first comment line, without '#'
};

// The named model configs, sorted by name; a name found in several directories is listed once,
// from the first directory (configs_dir/models, then model_dirs in order), as load_config picks.
std::vector<ModelEntry> list_models(const std::filesystem::path& configs_dir,
                                    const std::vector<std::filesystem::path>& model_dirs);

// The candidate closest to `key` (edit distance, preferring candidates that contain `key`);
// "" when there are no candidates.
std::string nearest_key(const std::string& key, const std::vector<std::string>& candidates);

// One key of the schema, as base.yml declares it.
struct KeySpec {
  std::string name;
  ValueType type = ValueType::string;  // never null_
  ConfigValue default_value;
  std::string doc;                 // the comment, without the constraint annotation
  std::string constraint;          // the annotation's text without brackets, "" = none
  std::optional<double> min, max;  // bounds from the annotation
  bool min_exclusive = false, max_exclusive = false;
  std::vector<std::string> choices;
};

// Reads base.yml into the schema, in file order; throws mt::UsageError.
std::vector<KeySpec> load_schema(const std::filesystem::path& base_yml);

}  // namespace mt
