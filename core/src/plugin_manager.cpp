#include "plugin_manager.h"

#include <dlfcn.h>
#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/model.h"
#include "mt/plugin.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

std::string kind_dir_name(const std::string& kind) {
  return kind;
}

// "libmt_backend_cpu.so" -> {"backend", "cpu"}
bool split_file_name(const fs::path& p, std::string& kind, std::string& name) {
  std::string f = p.filename().string();
  if (f.rfind("libmt_", 0) != 0 || p.extension() != ".so") return false;
  f = f.substr(6, f.size() - 6 - 3);
  auto us = f.find('_');
  if (us == std::string::npos) return false;
  kind = f.substr(0, us);
  name = f.substr(us + 1);
  return !kind.empty() && !name.empty();
}

// Why a plugin file may not be loaded for its permissions, or "". Anyone may replace a file that
// every user can write, or that sits in a directory every user can write (without the sticky
// bit, which keeps others from renaming it away): loading it would run their code as the user
// of mt. Refused, as ssh refuses such key files.
std::string world_writable(const fs::path& file) {
  auto mode = [](const fs::path& p) {
    std::error_code ec;
    const auto st = fs::status(p, ec);
    return ec ? fs::perms::unknown : st.permissions();
  };
  auto others_write = [](fs::perms m) {
    return m != fs::perms::unknown && (m & fs::perms::others_write) != fs::perms::none;
  };
  const fs::perms f = mode(file);
  fs::path dir = file.parent_path();
  if (dir.empty()) dir = ".";
  const fs::perms d = mode(dir);
  std::string what;
  if (others_write(f))
    what = "the file is writable by every user";
  else if (others_write(d) && (d & fs::perms::sticky_bit) == fs::perms::none)
    what = "its directory " + dir.string() + " is writable by every user";
  if (what.empty()) return {};
  return "was not loaded: " + what +
         ", so anyone on this machine could replace the code mt would run (`chmod o-w` it)";
}

// What a dlopen failure's message suggests doing.
std::string load_hint(const std::string& why, const fs::path& path) {
  if (why.find("undefined symbol") != std::string::npos)
    return " (it uses a symbol no loaded library defines: rebuild it against this mt's SDK; `ldd "
           "-r " +
           path.string() + "` lists what is undefined)";
  if (why.find("invalid ELF header") != std::string::npos ||
      why.find("file too short") != std::string::npos ||
      why.find("wrong ELF class") != std::string::npos)
    return " (it is not a shared library for this machine)";
  if (why.find("Permission denied") != std::string::npos) return " (this user may not read it)";
  return " (a library it depends on is missing or incompatible; `ldd " + path.string() +
         "` shows which)";
}

// A C++ exception thrown by a plugin's static initialisers unwinds through the dynamic loader,
// which then stays locked: the next library any thread loads or unloads (oneTBB's threads at
// their exit) waits forever. The process cannot recover, so it says why and ends at once.
[[noreturn]] void static_initialiser_threw(const fs::path& path, const std::string& what) {
  std::fflush(stdout);
  std::fprintf(stderr,
               "mt: error: the plugin %s threw an exception while it was being loaded (from a "
               "static initialiser: a global object's constructor): %s. The dynamic loader cannot "
               "recover from this in the same process, so mt stops here. Fix the plugin, or move "
               "it out of the plugin search path.\n",
               path.string().c_str(), what.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

std::string join_paths(const std::vector<fs::path>& dirs) {
  std::string s;
  for (const auto& d : dirs) {
    if (!s.empty()) s += ", ";
    s += d.string() + PluginManager::missing_note(d);
  }
  return s.empty() ? "(no directories)" : s;
}

}  // namespace

std::string PluginManager::missing_note(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return "";
  return fs::exists(dir, ec) ? " (not a directory)" : " (does not exist)";
}

fs::path PluginManager::core_library_dir() {
  // Normalised: the loader reports the path it found the library by, "<bin>/../lib" for a
  // binary whose RUNPATH is $ORIGIN/../lib.
  return fs::path(boost::dll::this_line_location().parent_path().string()).lexically_normal();
}

PluginManager::PluginManager(std::vector<fs::path> extra_dirs) {
  auto add = [&](const fs::path& d) {
    if (d.empty()) return;
    std::error_code ec;
    fs::path p = d.is_relative() ? fs::absolute(d, ec) : d;
    if (ec)
      throw UsageError("The plugin directory " + d.string() +
                       " is relative, and the current directory cannot be read (" + ec.message() +
                       "; was it deleted?): give it as an absolute path.");
    p = p.lexically_normal();
    if (std::find(dirs_.begin(), dirs_.end(), p) == dirs_.end()) dirs_.push_back(p);
  };
  add(core_library_dir() / "mt" / "plugins");
  if (const char* env = std::getenv("MT_PLUGIN_PATH")) {
    std::stringstream ss(env);
    std::string item;
    while (std::getline(ss, item, ':'))
      if (!item.empty()) add(item);
  }
  for (const auto& d : extra_dirs) add(d);
}

PluginManager::~PluginManager() {
  // Factories may hold code from the libraries; destroy them while the code is still mapped.
  backends_.clear();
  attention_.clear();
  models_.clear();
  datasets_.clear();
  communicators_.clear();
  // The libraries are opened with RTLD_NODELETE: dlclose never unmaps them, so objects a
  // plugin made that are still alive somewhere keep valid code until process exit.
}

PluginRecord PluginManager::load_file(const fs::path& path, bool do_register) {
  PluginRecord rec;
  rec.path = path;
  split_file_name(path, rec.kind, rec.name);
  if (std::string why = world_writable(path); !why.empty()) {
    rec.error = why;
    return rec;
  }
  // Only a regular file (through links): opening a FIFO would block until someone writes it.
  {
    std::error_code ec;
    const auto st = fs::status(path, ec);
    if (!fs::exists(st)) {
      rec.error = "does not exist (a link to a file that is not there?)";
      return rec;
    }
    if (!fs::is_regular_file(st)) {
      rec.error = "is not a regular file (a FIFO, a directory or a device), so it is no plugin";
      return rec;
    }
  }
  std::shared_ptr<boost::dll::shared_library> lib;
  try {
    lib = std::make_shared<boost::dll::shared_library>(
        boost::dll::fs::path(path.string()),
        boost::dll::load_mode::rtld_now | boost::dll::load_mode::rtld_local |
            static_cast<boost::dll::load_mode::type>(RTLD_NODELETE));
  } catch (const boost::dll::fs::system_error& e) {  // the loader's own refusal (dlerror)
    // The loader's words (boost wraps dlerror's text in its own, with an unrelated errno).
    std::string why = e.what();
    const std::string tag = "dlerror system message: ";
    if (const size_t at = why.find(tag); at != std::string::npos) {
      const size_t end = why.find("):", at);
      why = why.substr(at + tag.size(),
                       end == std::string::npos ? std::string::npos : end - at - tag.size());
    }
    rec.error = "could not be loaded: " + why + load_hint(why, path);
    return rec;
  } catch (const std::exception& e) {
    static_initialiser_threw(path, e.what());
  } catch (...) {
    static_initialiser_threw(path, "an exception that is not a std::exception");
  }
  if (!lib->has("mt_plugin_entry")) {
    rec.error =
        "is not an mt plugin: it exports no registration entry `mt_plugin_entry` (declare one "
        "with MT_PLUGIN from <mt/plugin.h>)";
    libs_.push_back(lib);
    return rec;
  }
  const PluginInfo* info = nullptr;
  try {
    auto entry = lib->get_alias<PluginEntry>("mt_plugin_entry");
    info = entry();
  } catch (const std::exception& e) {
    rec.error = std::string("its registration entry failed: ") + e.what();
    libs_.push_back(lib);
    return rec;
  }
  libs_.push_back(lib);
  if (!info) {
    rec.error = "its registration entry returned nothing";
    return rec;
  }
  rec.abi = info->abi;
  if (info->abi != MT_ABI_VERSION) {
    rec.error = "was built for plugin ABI " + std::to_string(info->abi) + " but this mt (" +
                MT_VERSION_STRING + ") needs ABI " + std::to_string(MT_ABI_VERSION) +
                "; rebuild the plugin against this mt's SDK";
    return rec;
  }
  rec.kind = info->kind ? info->kind : "";
  rec.name = info->name ? info->name : "";
  rec.version = info->version ? info->version : "";
  if (info->probe) {
    const char* why = nullptr;
    try {
      why = info->probe();
    } catch (const std::exception& e) {
      rec.error = std::string("its probe failed: ") + e.what();
      return rec;
    } catch (...) {
      rec.error = "its probe failed with an exception that is not a std::exception";
      return rec;
    }
    if (why) {
      rec.error = std::string("declined to run on this machine: ") + why;
      return rec;
    }
  }
  // What the entry declares must be what the file name says (the name mt looks it up by),
  // of a kind mt knows, and it must register something.
  {
    std::string fk, fn;
    split_file_name(path, fk, fn);
    static const std::set<std::string> kinds = {"backend", "model", "data", "comm"};
    if (!kinds.count(rec.kind)) {
      rec.error = "declares the plugin kind '" + rec.kind +
                  "', which is none of mt's (backend, model, data, comm)";
      return rec;
    }
    if (rec.kind != fk || rec.name != fn) {
      rec.error = "declares itself as " + rec.kind + " '" + rec.name +
                  "', but its file name says " + fk + " '" + fn +
                  "' (mt finds a plugin by its file name: libmt_" + rec.kind + "_" + rec.name +
                  ".so)";
      return rec;
    }
    if (!info->register_fn) {
      rec.error = "has no registration function (MT_PLUGIN's register_fn is null)";
      return rec;
    }
  }
  if (do_register) {
    const size_t before = registered();
    try {
      info->register_fn(*this);
    } catch (const std::exception& e) {
      rec.error = std::string("its registration failed: ") + e.what();
      return rec;
    } catch (...) {
      rec.error = "its registration failed with an exception that is not a std::exception";
      return rec;
    }
    if (registered() == before) {
      rec.error =
          "registered nothing: its register_fn added no backend, model family, dataset "
          "or communicator";
      return rec;
    }
  }
  rec.ok = true;
  return rec;
}

std::vector<PluginRecord> PluginManager::scan() {
  std::vector<PluginRecord> out;
  std::map<std::string, fs::path> seen;  // file name -> the file that wins
  for (const auto& dir : dirs_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      std::string k, n;
      if (e.is_regular_file() && split_file_name(e.path(), k, n)) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::string k, n;
      split_file_name(f, k, n);
      if (auto [it, fresh] = seen.emplace(f.filename().string(), f); !fresh) {
        PluginRecord rec;  // shadowed by an earlier directory: said, not loaded
        rec.path = f;
        rec.kind = k;
        rec.name = n;
        rec.shadowed_by = it->second;
        out.push_back(rec);
        continue;
      }
      auto it = loaded_.find(k + "/" + n);
      if (it != loaded_.end()) {
        out.push_back(it->second);
        continue;
      }
      PluginRecord rec = load_file(f, /*do_register=*/true);
      if (rec.ok) loaded_[rec.kind + "/" + rec.name] = rec;
      out.push_back(rec);
    }
  }
  return out;
}

std::string PluginManager::not_found_message(const std::string& kind, const std::string& name) {
  // The names come from the file names: listing must not load (and so run) every plugin of the
  // kind, least of all for a mistyped name. `mt plugins` loads them to say which work.
  std::set<std::string> names;
  for (const auto& dir : dirs_) {
    std::error_code ec;
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator();
         it.increment(ec)) {
      std::string k, n;
      if (split_file_name(it->path(), k, n) && k == kind_dir_name(kind)) names.insert(n);
    }
  }
  std::string found;
  for (const auto& n : names) found += (found.empty() ? "" : ", ") + n;
  return "No " + kind + " plugin named '" + name + "' was found: looked for libmt_" + kind + "_" +
         name + ".so in " + join_paths(dirs_) + ". Available " + kind +
         " plugins: " + (found.empty() ? "none" : found) +
         " (`mt plugins` says whether each loads). Add a directory with MT_PLUGIN_PATH or the "
         "plugin_dirs key.";
}

void PluginManager::require(const std::string& kind, const std::string& name) {
  const std::string key = kind + "/" + name;
  if (loaded_.count(key)) return;
  const std::string file = "libmt_" + kind_dir_name(kind) + "_" + name + ".so";
  for (const auto& dir : dirs_) {
    fs::path p = dir / file;
    std::error_code ec;
    // symlink_status: a dangling link is found (and refused as such), not passed over.
    if (!fs::exists(fs::symlink_status(p, ec))) continue;
    PluginRecord rec = load_file(p, /*do_register=*/true);
    if (!rec.ok) {
      throw UsageError("The " + kind + " plugin '" + name + "' at " + p.string() + " " + rec.error +
                       ".");
    }
    if (rec.kind != kind || rec.name != name) {
      throw UsageError("The file " + p.string() + " registers itself as " + rec.kind + " '" +
                       rec.name + "', not " + kind + " '" + name +
                       "'; rename it or fix its MT_PLUGIN declaration.");
    }
    loaded_[key] = rec;
    return;
  }
  throw UsageError(not_found_message(kind, name));
}

std::unique_ptr<Backend> PluginManager::make_backend(const std::string& name, const Config& cfg) {
  // A backend registered in-process (add_backend by an embedding program or a test) needs no
  // plugin file.
  if (!backends_.count(name)) require("backend", name);
  auto it = backends_.find(name);
  if (it == backends_.end())
    throw UsageError("The backend plugin '" + name + "' loaded but registered no backend named '" +
                     name + "'.");
  std::unique_ptr<Backend> b = it->second(cfg);
  if (!b)
    throw Error("The backend plugin '" + name +
                "' made no backend: its factory returned null. A factory returns the backend or "
                "throws an mt::UsageError that says why it cannot.");
  return b;
}

std::vector<std::string> PluginManager::attention_names(const std::string& backend) const {
  std::vector<std::string> r;
  for (const auto& [k, f] : attention_)
    if (k.rfind(backend + "/", 0) == 0) r.push_back(k.substr(backend.size() + 1));
  return r;
}

std::unique_ptr<AttentionKernel> PluginManager::make_attention(const std::string& backend,
                                                               const std::string& name,
                                                               Backend& b) {
  auto it = attention_.find(backend + "/" + name);
  if (it == attention_.end()) {
    std::string avail;
    for (const auto& n : attention_names(backend)) avail += (avail.empty() ? "" : ", ") + n;
    throw UsageError("attention=" + name + " is not available on the " + backend +
                     " backend; it offers: " + (avail.empty() ? "none" : avail) + ".");
  }
  return it->second(b);
}

std::unique_ptr<ModelFamily> PluginManager::make_model_family(const std::string& name) {
  require("model", name);
  auto it = models_.find(name);
  if (it == models_.end())
    throw UsageError("The model plugin '" + name + "' registered no family named '" + name + "'.");
  std::unique_ptr<ModelFamily> f = it->second();
  if (!f)
    throw Error("The model plugin '" + name +
                "' made no family: the factory it registered returned null.");
  return f;
}

const DatasetFactory& PluginManager::dataset_factory(const std::string& name) {
  // One registered in-process (add_dataset by an embedding program or a test) needs no file.
  if (!datasets_.count(name)) require("data", name);
  auto it = datasets_.find(name);
  if (it == datasets_.end())
    throw UsageError("The data plugin '" + name + "' registered no dataset named '" + name + "'.");
  return it->second;
}

std::unique_ptr<DatasetSource> PluginManager::make_dataset(const std::string& name,
                                                           const Config& cfg,
                                                           const DataShard& shard,
                                                           const Tokenizer* tokenizer) {
  std::unique_ptr<DatasetSource> d;
  try {
    d = dataset_factory(name)(cfg, shard, tokenizer);
  } catch (const Error&) {
    throw;  // the plugin's own sentence
  } catch (const std::bad_alloc&) {
    throw Error("The data plugin '" + name +
                "' ran out of memory while opening its data: a smaller dataset, or more memory.");
  } catch (const std::exception& e) {
    throw Error("The data plugin '" + name + "' failed while opening its data: " + e.what() +
                " (it threw an exception that is not an mt::Error: a bug in the plugin).");
  }
  if (!d)
    throw Error("The data plugin '" + name +
                "' made no dataset: its factory returned null. A factory returns the source or "
                "throws an mt::UsageError that says why it cannot.");
  return d;
}

std::string PluginManager::dataset_keys(const std::string& name) {
  dataset_factory(name);  // loads its plugin; refuses one that registers no such dataset
  const auto it = dataset_keys_.find(name);
  return it == dataset_keys_.end() ? std::string() : it->second;
}

size_t PluginManager::registered() const {
  return backends_.size() + attention_.size() + models_.size() + datasets_.size() +
         communicators_.size();
}

std::unique_ptr<Communicator> PluginManager::make_communicator(const std::string& name,
                                                               const Config& cfg) {
  if (!communicators_.count(name)) require("comm", name);
  auto it = communicators_.find(name);
  if (it == communicators_.end())
    throw UsageError("The comm plugin '" + name + "' registered no communicator named '" + name +
                     "'.");
  return it->second(cfg);
}

void PluginManager::add_backend(const std::string& name, BackendFactory f) {
  backends_[name] = std::move(f);
}
void PluginManager::add_attention(const std::string& backend, const std::string& name,
                                  AttentionFactory f) {
  attention_[backend + "/" + name] = std::move(f);
}
void PluginManager::add_model_family(const std::string& name, ModelFamilyFactory f) {
  models_[name] = std::move(f);
}
void PluginManager::add_dataset(const std::string& name, DatasetFactory f) {
  datasets_[name] = std::move(f);
}
void PluginManager::add_communicator(const std::string& name, CommunicatorFactory f) {
  communicators_[name] = std::move(f);
}
void PluginManager::add_dataset_keys(const std::string& name, const std::string& schema) {
  dataset_keys_[name] += schema;
}

}  // namespace mt
