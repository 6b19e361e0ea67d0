// The `mt` command line: shared argument handling and one function per subcommand.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "mt/config.h"

namespace mt {
class Communicator;
class PluginManager;
struct TrainSummary;
}  // namespace mt

namespace mt::cli {

// Arguments after the subcommand, split into what every command understands.
struct Args {
  std::string command;
  std::string model;                   // --model=
  std::string config_file;             // --config=
  std::vector<std::string> overrides;  // key=value / --key=value, in order
  std::vector<std::string> positional; // anything else (e.g. `mt bench train`)
  bool help = false;
};

// Parses argv[first..]; throws UsageError for malformed arguments and for bare words (neither
// key=value nor --flag) beyond the `max_positional` the command takes.
Args parse_args(const std::string& command, int argc, char** argv, int first,
                size_t max_positional = 0);

// The configs directory (share/mt/configs beside the install or build tree) and extra model
// config directories (`models/` inside each plugin search directory).
std::filesystem::path configs_dir();
std::vector<std::filesystem::path> model_dirs(const Args& a);

// Resolves the layered config for these arguments (configs/base.yml, the model, --config,
// overrides) and validates the plugin-independent part. With hf_path, the directory's
// config.json replaces the named model; `notes`: print the config.json fields mt does not use
// (once per command: a second resolution passes false).
Config resolve_config(const Args& a, bool notes = true);

// train() on this rank of `comm`'s job. A failure with one rank is thrown as usual; with more,
// a refusal (which every rank reaches alike) is printed once by rank 0 and any other failure
// as "error on rank r of N", and the rank ends the whole job (Communicator::abort) so that no
// rank waits forever in a collective. `command` prefixes the messages ("mt run").
TrainSummary train_on_ranks(const Config& cfg, PluginManager& pm, bool quiet, Communicator& comm,
                            const char* command);

// The sequences mt decode runs at once: prompt_file's prompts (read as mt decode reads them),
// else 1.
int64_t prompt_file_prompts(const Config& cfg);

// Refuses (UsageError) quantization and quantize_kvcache for a command they would not change
// (`command`, e.g. "mt convert", and why), where they would be accepted and ignored.
void refuse_quantization(const Config& cfg, const std::string& command, const std::string& why);

// Refuses (UsageError), before any work, an output file `key`=`path` that would lose something: a
// path whose directory does not exist, a directory, one of `inputs` (the files the command
// reads), or an existing file that `ours` does not recognise as this command's own output (a
// file it wrote before, which it replaces). `what` names the kind of file the command writes.
void check_output_file(const std::string& key, const std::string& path,
                       const std::vector<std::string>& inputs,
                       bool (*ours)(const std::filesystem::path&), const std::string& what);

int cmd_plugins(const Args& a);
int cmd_models(const Args& a);
int cmd_config(const Args& a);
int cmd_run(const Args& a);
int cmd_plan(const Args& a);
int cmd_decode(const Args& a);
int cmd_score(const Args& a);
int cmd_convert(const Args& a);
int cmd_bench(const Args& a);
int cmd_tokenize(const Args& a);

}  // namespace mt::cli
