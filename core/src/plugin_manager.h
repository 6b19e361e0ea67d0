// PluginManager: finds, loads and keeps plugins, and is the Registry they fill.
//
// Search order: the install directory (lib/mt/plugins beside libmt_core), then each directory
// of MT_PLUGIN_PATH, then the config's plugin_dirs. Never the current directory implicitly.
// A plugin is loaded the first time something asks for it by kind and name
// (`backend=cuda` -> libmt_backend_cuda.so) and stays loaded for the life of the process.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mt/registry.h"

namespace boost::dll {
class shared_library;
}

namespace mt {

class AttentionKernel;
class Backend;
class Config;
class ModelFamily;

struct PluginRecord {
  std::filesystem::path path;
  std::string kind, name, version;  // from the plugin's entry; file-name guesses if it failed
  unsigned abi = 0;
  bool ok = false;
  std::string error;  // why it could not be used, as a sentence
  // Not loaded: a file of the same name in an earlier directory of the search path wins.
  std::filesystem::path shadowed_by;
};

class PluginManager final : public Registry {
 public:
  // extra_dirs: the config's plugin_dirs.
  explicit PluginManager(std::vector<std::filesystem::path> extra_dirs = {});
  ~PluginManager() override;

  const std::vector<std::filesystem::path>& search_dirs() const { return dirs_; }

  // Loads every libmt_*.so in the search path (first one wins per file name) and reports each,
  // the shadowed ones too (shadowed_by set, not loaded).
  std::vector<PluginRecord> scan();

  // Loads the plugin for kind ("backend", "model", "data") and name, once. Throws UsageError
  // with what was searched and what was found when it is missing or unusable.
  void require(const std::string& kind, const std::string& name);

  std::unique_ptr<Backend> make_backend(const std::string& name, const Config& cfg);
  std::unique_ptr<AttentionKernel> make_attention(const std::string& backend,
                                                  const std::string& name, Backend& b);
  std::unique_ptr<ModelFamily> make_model_family(const std::string& name);
  const DatasetFactory& dataset_factory(const std::string& name);
  // dataset_factory(name)(...), refusing a factory that returns null.
  std::unique_ptr<DatasetSource> make_dataset(const std::string& name, const Config& cfg,
                                              const DataShard& shard, const Tokenizer* tokenizer);
  // The config keys the dataset `name` declares (add_dataset_keys), "" for none; loads its
  // plugin (throws as require does when there is none).
  std::string dataset_keys(const std::string& name);
  std::unique_ptr<Communicator> make_communicator(const std::string& name, const Config& cfg);
  std::vector<std::string> attention_names(const std::string& backend) const;

  // Registry
  void add_backend(const std::string& name, BackendFactory f) override;
  void add_attention(const std::string& backend, const std::string& name,
                     AttentionFactory f) override;
  void add_model_family(const std::string& name, ModelFamilyFactory f) override;
  void add_dataset(const std::string& name, DatasetFactory f) override;
  void add_communicator(const std::string& name, CommunicatorFactory f) override;
  void add_dataset_keys(const std::string& name, const std::string& schema) override;

  // The directory holding libmt_core (lib/), from which bin/ and share/mt/configs are found.
  static std::filesystem::path core_library_dir();
  // " (does not exist)" or " (not a directory)" for a search directory that is neither, for the
  // listings (a mistyped MT_PLUGIN_PATH was listed like any other); "" for a directory.
  static std::string missing_note(const std::filesystem::path& dir);

 private:
  PluginRecord load_file(const std::filesystem::path& path, bool do_register);
  std::string not_found_message(const std::string& kind, const std::string& name);
  size_t registered() const;  // factories of every kind

  std::vector<std::filesystem::path> dirs_;
  std::vector<std::shared_ptr<boost::dll::shared_library>> libs_;  // never unloaded
  std::map<std::string, PluginRecord> loaded_;                     // "kind/name"
  std::map<std::string, BackendFactory> backends_;
  std::map<std::string, AttentionFactory> attention_;  // "backend/name"
  std::map<std::string, ModelFamilyFactory> models_;
  std::map<std::string, DatasetFactory> datasets_;
  std::map<std::string, std::string> dataset_keys_;
  std::map<std::string, CommunicatorFactory> communicators_;
};

}  // namespace mt
