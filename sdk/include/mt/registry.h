// Registry: where plugins register their factories, and where the core looks them up by name.
//
// Plugins fill it from their registration entry (plugin.h); the core never enumerates
// families, backends or data sources itself. The registry also owns the loaded libraries and
// never unloads them: objects made by a plugin must not outlive its code.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mt/comm.h"
#include "mt/export.h"

namespace mt {

class Backend;
class AttentionKernel;
class ModelFamily;
class DatasetSource;
class Tokenizer;
class Config;
struct DataShard;

using BackendFactory = std::function<std::unique_ptr<Backend>(const Config&)>;
// Attention kernels are made for a backend instance they run on.
using AttentionFactory = std::function<std::unique_ptr<AttentionKernel>(Backend&)>;
using ModelFamilyFactory = std::function<std::unique_ptr<ModelFamily>()>;
using DatasetFactory = std::function<std::unique_ptr<DatasetSource>(const Config&, const DataShard&,
                                                                     const Tokenizer*)>;

class MT_API Registry {
 public:
  virtual ~Registry();
  virtual void add_backend(const std::string& name, BackendFactory f) = 0;
  // `backend` names the backend the kernel runs on ("cpu"), `name` the config value
  // (`attention=flash`).
  virtual void add_attention(const std::string& backend, const std::string& name,
                             AttentionFactory f) = 0;
  virtual void add_model_family(const std::string& name, ModelFamilyFactory f) = 0;
  virtual void add_dataset(const std::string& name, DatasetFactory f) = 0;
  // `communicator=<name>` (plugin kind "comm": libmt_comm_<name>.so).
  virtual void add_communicator(const std::string& name, CommunicatorFactory f) = 0;
  // The config keys of the dataset `name` (beside its add_dataset), in configs/base.yml's format
  // ("key: default  # what it means [constraint]" a line), as ModelFamily::config_schema() gives
  // a family's: they exist, typed and checked, when dataset_type names it, and its factory reads
  // them from the Config it gets.
  virtual void add_dataset_keys(const std::string& name, const std::string& schema) = 0;
};

}  // namespace mt
