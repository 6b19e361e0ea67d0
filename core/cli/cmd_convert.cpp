// mt convert: Hugging Face model directories <-> mt parameter checkpoints.
//   mt convert --from=hf --input=<hf dir> --output=<mt dir>
//       writes <mt dir>/checkpoints/0/ (parameters) and <mt dir>/model.yml (the mt config keys
//       equal to config.json), and copies the tokenizer files.
//   mt convert --to=hf --input=<mt checkpoint> --output=<hf dir> [--model=... | --config=...]
//       writes config.json + model.safetensors (+ the tokenizer of tokenizer_path); without
//       --input, the model's initial weights (init_weights_seed) instead of a checkpoint's.
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "checkpoint_manager.h"
#include "cli.h"
#include "config_impl.h"
#include "file_util.h"
#include "hf_interop.h"
#include "host_threads.h"
#include "memory_plan.h"
#include "model_runner.h"
#include "mt/checkpointer.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "trainer.h"

namespace fs = std::filesystem;

namespace mt::cli {

namespace {
// Removes key=value from the overrides and returns the value ("" when absent).
std::string take(Args& a, const std::string& key) {
  std::string v;
  for (auto it = a.overrides.begin(); it != a.overrides.end();) {
    if (it->rfind(key + "=", 0) == 0) {
      v = it->substr(key.size() + 1);
      it = a.overrides.erase(it);
    } else {
      ++it;
    }
  }
  return v;
}

// The output is written into a hidden sibling directory and renamed to --output once whole, so
// a failure part-way (a full disk, out of memory, a file size limit) leaves nothing under the
// name (before: a half-written directory that the retry refused as "not empty", and a
// config.json of 0 bytes). The sibling is removed unless committed.
class StagedOutput {
 public:
  explicit StagedOutput(const std::string& output) : final_(output) {
    if (final_.filename().empty()) final_ = final_.parent_path();  // "dir/"
    std::error_code ec;
    const fs::file_status st = fs::status(final_, ec);
    if (fs::exists(st) && !fs::is_directory(st))
      throw UsageError("--output=" + output + " exists and is not a directory; mt convert " +
                       "writes a directory there.");
    if (fs::exists(st) && !fs::is_empty(final_, ec))
      throw UsageError("The output directory '" + output +
                       "' exists and is not empty; mt convert never overwrites, choose another.");
    fs::path parent = fs::absolute(final_, ec).parent_path();
    fs::create_directories(parent, ec);
    if (ec)
      throw UsageError("--output=" + output + ": its parent directory " + quoted(parent) +
                       " cannot be created: " + ec.message() + ".");
    std::string name = ".";
    name += final_.filename().string();
    name += ".tmp-";
    name += std::to_string(::getpid());
    staging_ = parent / name;
    fs::remove_all(staging_, ec);
    if (!fs::create_directory(staging_, ec) || ec)
      throw UsageError("--output=" + output + ": cannot create " + quoted(staging_) + ": " +
                       (ec ? ec.message() : std::string("it exists")) + ".");
  }
  ~StagedOutput() {
    std::error_code ec;
    if (!committed_) fs::remove_all(staging_, ec);
  }
  StagedOutput(const StagedOutput&) = delete;
  StagedOutput& operator=(const StagedOutput&) = delete;
  const fs::path& dir() const { return staging_; }
  void commit() {
    std::error_code ec;
    fs::rename(staging_, final_, ec);  // over an empty directory too
    if (ec)
      throw UsageError("--output=" + final_.string() + ": cannot move the written directory " +
                       quoted(staging_) + " there: " + ec.message() + ".");
    committed_ = true;
  }

 private:
  fs::path final_, staging_;
  bool committed_ = false;
};

// The runner holding the weights mt convert reads or writes, refused first (exit 2, with mt
// decode's plan, nothing allocated or written) when they cannot be loaded on the device (before:
// an allocation failure part-way through reading them, with the allocator's generic advice).
std::unique_ptr<ModelRunner> fitted_runner(const Config& cfg, PluginManager& pm) {
  std::unique_ptr<Backend> device = pm.make_backend(cfg.get_string("backend"), cfg);
  check_weights_fit(cfg, pm, *device, "convert");
  return std::make_unique<ModelRunner>(cfg, pm, std::move(device));
}
}  // namespace

int cmd_convert(const Args& args_in) {
  Args args = args_in;
  const std::string from = take(args, "from"), to = take(args, "to");
  std::string input = take(args, "input");
  const std::string output = take(args, "output");
  if ((from.empty()) == (to.empty()) || (from.empty() ? to : from) != "hf")
    throw UsageError("mt convert needs exactly one of --from=hf (import a Hugging Face model) or "
                     "--to=hf (export an mt checkpoint).");
  // --to=hf without --input exports freshly initialised weights (init_weights_seed): the same
  // random model `mt run` and `mt bench` start from, for other tools (peer benchmarks).
  if (output.empty() || (input.empty() && from == "hf"))
    throw UsageError(
        "mt convert needs --input=<dir> and --output=<dir> (--to=hf without --input writes the "
        "model's initial weights, init_weights_seed).");
  if (from == "hf") {
    args.overrides.insert(args.overrides.begin(), "hf_path=" + input);
    Config cfg = resolve_config(args);
    const HostThreads threads(cfg);
    refuse_quantization(cfg, "mt convert", "writes the weights as they are held");
    std::vector<fs::path> dirs;
    for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
    PluginManager pm(dirs);
    const HfImport imp = read_hf_config(input, pm);
    const std::unique_ptr<ModelRunner> held = fitted_runner(cfg, pm);
    ModelRunner& runner = *held;
    // Multi-token prediction modules (asked for with the family's key among the words) have no
    // form in transformers' checkpoints: they start from the config's initialisation, as in
    // `mt run`, and everything else is loaded over it.
    size_t mtp = 0;
    for (auto& p : runner.params()) mtp += p.name.rfind("mtp.", 0) == 0 ? 1 : 0;
    if (mtp) runner.init_parameters(static_cast<uint64_t>(cfg.get_int("init_weights_seed")));
    load_hf_weights(input, runner);
    if (mtp)
      std::printf(
          "mt convert: the %zu multi-token prediction parameters (mtp.*) have no Hugging "
          "Face form; they are initialised (init_weights_seed=%lld) for training\n",
          mtp, static_cast<long long>(cfg.get_int("init_weights_seed")));
    StagedOutput out(output);
    {
      std::ofstream y(out.dir() / "model.yml");
      // The paths in comments, a line break in one written as \n (before: the rest of the path
      // became a line of the config, `steps: 999` from a directory named so).
      auto one_line = [](std::string t) {
        for (size_t at = 0; (at = t.find_first_of("\n\r", at)) != std::string::npos; at += 2)
          t.replace(at, 1, t[at] == '\n' ? "\\n" : "\\r");
        return t;
      };
      y << "# mt config of the Hugging Face model converted from " << one_line(input)
        << "\n# use with --config=" << one_line((fs::path(output) / "model.yml").string()) << "\n";
      // No named model beneath it: its sizes, context and tokenizer are the directory's.
      y << "model_name: \"\"\n";
      // Each value as the resolved config holds it, written as YAML (before: the text as given,
      // so "prompt=a # b" lost " # b" and "dataset_path=*.jsonl" made the file unreadable).
      auto line = [&](const std::string& key) {
        const auto it = cfg.impl().values.find(key);
        if (it != cfg.impl().values.end())
          y << key << ": " << config_value_yaml(it->second) << "\n";
      };
      for (const auto& o : imp.overrides) line(o.substr(0, o.find('=')));
      // The command's own key=value words (e.g. mtp_num_layers=1) shape the checkpoint too.
      for (const auto& o : args.overrides) {
        const std::string key = o.substr(0, o.find('='));
        if (key == "hf_path" || key == "max_target_length" || key == "tokenizer_path") continue;
        line(key);
      }
      y << "max_target_length: " << cfg.get_int("max_target_length") << "\n";
      // The directory's tokenizer files are copied beside the checkpoint (below).
      std::string tok = cfg.get_string("tokenizer_path");
      if (!tok.empty() && fs::path(tok) == fs::path(input)) tok = output;
      std::string q;
      for (char c : tok) q += c == '"' || c == '\\' ? std::string("\\") + c : std::string(1, c);
      y << "tokenizer_path: \"" << q << "\"\n";
      if (!y.flush())
        throw Error("Writing " + quoted(out.dir() / "model.yml") +
                    " failed: " + std::strerror(errno) + ".");
    }
    CheckpointManager ckpt(out.dir() / "checkpoints", /*async=*/false, 0, runner.backend());
    TrainState st;
    for (auto& p : runner.params()) st.params[p.name] = p.value;
    st.step = 0;
    st.config_yaml = cfg.to_yaml(true);
    ckpt.save(st);
    ckpt.wait();
    copy_tokenizer_files(input, out.dir().string());
    out.commit();
    std::printf("mt convert: %zu parameters of a %s model -> %s (config: %s/model.yml)\n",
                runner.params().size(), imp.family.c_str(),
                (fs::path(output) / "checkpoints" / "0").string().c_str(), output.c_str());
    return 0;
  }
  // --to=hf. A checkpoint's saved config is the model unless one is named, as for mt decode
  // (before: base.yml's default model, refused with a page of shape differences).
  if (!input.empty())
    args.overrides.insert(args.overrides.begin(), "load_parameters_path=" + input);
  Config cfg = resolve_config(args);
  // load_parameters_path= names the checkpoint as --input does (before: ignored, and the
  // model's random initial weights were exported in its place).
  if (input.empty()) input = cfg.get_string("load_parameters_path");
  if (!input.empty()) warn_changed_model_keys(cfg, "--input", input, "mt convert");
  const HostThreads threads(cfg);
  refuse_quantization(cfg, "mt convert", "writes the weights as they are held");
  StagedOutput out(output);
  std::vector<fs::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  const std::unique_ptr<ModelRunner> held = fitted_runner(cfg, pm);
  ModelRunner& runner = *held;
  if (input.empty()) {
    runner.init_parameters(static_cast<uint64_t>(cfg.get_int("init_weights_seed")));
  } else {
    std::map<std::string, Tensor> params;
    for (auto& p : runner.params()) params[p.name] = p.value;
    load_parameters(input, params);
  }
  write_hf_model(out.dir().string(), runner, cfg, pm);
  if (!cfg.get_string("tokenizer_path").empty())
    copy_tokenizer_files(cfg.get_string("tokenizer_path"), out.dir().string());
  // A directory `mt convert --from=hf` wrote keeps the Hugging Face side files beside its
  // checkpoints (generation_config.json: the end-of-sequence ids generate stops at): they go
  // back with the model, where tokenizer_path gave none (before: lost on the way back).
  if (!input.empty()) {
    std::error_code ec;
    fs::path dir = fs::absolute(input, ec);
    for (int up = 0; up < 3 && !dir.empty(); ++up, dir = dir.parent_path()) {
      if (!fs::exists(dir / "model.yml", ec)) continue;
      for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer.model",
                            "tokenizer_config.json", "special_tokens_map.json"})
        if (fs::exists(dir / f, ec) && !fs::exists(out.dir() / f, ec))
          fs::copy_file(dir / f, out.dir() / f, ec);
      break;
    }
  }
  out.commit();
  std::printf("mt convert: %zu parameters -> %s (config.json, model.safetensors)\n",
              runner.params().size(), output.c_str());
  return 0;
}

}  // namespace mt::cli
