// Loading the layered config: configs/base.yml (the schema and the defaults), the named model
// file, the user's --config file and command-line overrides, validated before any work starts.
//
// The schema is base.yml itself: a key's type is the type of its default, and its constraint is
// the bracketed annotation at the end of its comment ([>0], [>=0], [>=-1], [0..1],
// [choices: a|b|c]). Plugins add keys of their own in the same format, as files (schema_files)
// or as text (schema_texts: a model family's config_schema()); a key declared twice is refused.
// Every refusal is an mt::UsageError of one paragraph that names the key, the value and where it
// was set.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config_impl.h"
#include "mt/config.h"
#include "mt/error.h"

namespace mt {

// Keys declared as text in base.yml's format: a model family's ModelFamily::config_schema().
struct SchemaText {
  std::string shown;  // how origins and messages name it: "model family 'tiny' config_schema()"
  std::string yaml;
};

struct ConfigRequest {
  std::filesystem::path configs_dir;  // holds base.yml and models/
  // Extra directories searched for <model>.yml after configs_dir/models, in order.
  std::vector<std::filesystem::path> model_dirs;
  // Files declaring extra keys in base.yml's format (a plugin's own settings), after base.yml's.
  std::vector<std::filesystem::path> schema_files;
  // Keys declared as text, after schema_files'.
  std::vector<SchemaText> schema_texts;
  // When set, load_config first resolves the layers with preview_config and calls this with the
  // result; the texts it returns are added to schema_texts. The CLI returns the config_schema()
  // of the family the final decoder_block names, so any layer may set that family's keys, the
  // one naming the family included.
  std::function<std::vector<SchemaText>(const Config& preview)> schemas_for;
  std::string model;                   // from --model; "" = model_name from the layers
  std::string config_file;             // --config; "" = none
  std::vector<std::string> overrides;  // "key=value" (or "--key=value") in command-line order
  // MaxText's environment overrides: {"M_STEPS", "5"} sets `steps` as steps=5 would (the part
  // after M_, lower-cased, when it names a key; other variables are ignored). A key set both
  // here and by an override is refused, as MaxText refuses it.
  std::vector<std::pair<std::string, std::string>> environment;
  // "key=value" read from another format (hf_path's config.json), layered after the model file
  // and before the --config file and the overrides, each value's origin `imported_origin`.
  std::vector<std::string> imported;
  std::string imported_origin;
};

// Resolves and validates the config; throws mt::UsageError (UnknownKeyError for a key no schema
// declares).
Config load_config(const ConfigRequest& req);

// The layers resolved as load_config resolves them, except that keys no schema declares are
// left out instead of refused and no constraint is checked: the final values of the keys that
// decide which schema applies (decoder_block, plugin_dirs, hf_path). Ignores schemas_for.
Config preview_config(const ConfigRequest& req);

// load_config's refusal of a key that no schema declares.
class UnknownKeyError : public UsageError {
 public:
  using UsageError::UsageError;
};

struct ModelEntry {
  std::string name;    // file stem: what --model takes
  std::string family;  // its decoder_block (base.yml's default when the file has none)
  std::filesystem::path path;
  std::string description;  // the file's first comment line, without '#'
  // Files of the same name in later directories: not used (the first found is the model).
  std::vector<std::filesystem::path> shadowed;
};

// The named model configs, sorted by name; a name found in several directories is listed once,
// from the first directory (configs_dir/models, then model_dirs in order), as load_config picks,
// with the later files in `shadowed`.
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
  // The "# ---- <name> ----" heading the key stands under in its file ("Model", "Run", ...).
  std::string section;
};

// Reads base.yml into the schema, in file order; throws mt::UsageError.
std::vector<KeySpec> load_schema(const std::filesystem::path& base_yml);

}  // namespace mt
