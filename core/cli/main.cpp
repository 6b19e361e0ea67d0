// mt: the command-line entry point. Dispatches to subcommands and turns errors into one
// paragraph on stderr and an exit code (2: bad input refused before work; 1: failure at work).
#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <system_error>
#include <thread>

#include "cli.h"
#include "communicator.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "mt/version.h"

namespace {

struct Command {
  const char* name;
  int (*fn)(const mt::cli::Args&);
  const char* summary;
  const char* usage;
  size_t positional = 0;  // bare words it takes (`mt bench train`); any other is refused
  bool ranks = false;     // runs as one rank of several under mpirun / srun (train_on_ranks)
};

constexpr const char* kCommonOptions =
    "Options shared by the commands that take a config:\n"
    "  --model=NAME       a named model config from configs/models (`mt models` lists them)\n"
    "  --config=FILE      a YAML file of overrides, applied after the model's config\n"
    "  key=value          any key of configs/base.yml or of the model family (also written\n"
    "                     --key=value); last wins\n"
    "Layering, last wins: configs/base.yml, configs/models/<model>.yml, --config, M_<KEY>\n"
    "environment variables (MaxText's: M_STEPS=5 is steps=5), overrides.\n";

const Command kCommands[] = {
    {"run", mt::cli::cmd_run, "train a model (MaxText's train.py)",
     "mt run [--model=NAME] [--config=FILE] [key=value ...]\n\n"
     "Trains the configured model on the configured backend and data, printing loss,\n"
     "throughput and MFU every log_period steps; metrics go to\n"
     "<base_output_directory>/<run_name>/metrics.jsonl. With no arguments it trains the\n"
     "embedded default (a small Llama on the shipped corpus, on the CPU).\n",
     0, true},
    {"plan", mt::cli::cmd_plan, "memory and FLOPs of a config before any work, and how to fit",
     "mt plan [--model=NAME] [plan_device=h100-80gb|h200|a100-40gb|a100-80gb|cpu-<N>gb] "
     "[key=value ...]\n\n"
     "Builds the model and runs one training step, a prefill and a decode step on a backend\n"
     "that only counts bytes (nothing is allocated), then prints parameters, the bytes of\n"
     "weights, gradients, optimizer state, activations and KV cache, the peak per device,\n"
     "model FLOPs per step and the step time at the device's peak and an assumed MFU. When the\n"
     "training peak does not fit, it lists the cheapest key=value changes that make it fit.\n"
     "mt run and mt decode make the same check first. Exit status: 0 fits, 3 does not fit.\n"},
    {"decode", mt::cli::cmd_decode, "generate text from a model (prefill + KV-cache decode)",
     "mt decode [--model=NAME] load_parameters_path=DIR | hf_path=DIR prompt=\"...\" | "
     "tokens=ID,... [key=value ...]\n\n"
     "With load_parameters_path= (a run, its checkpoints/ or one step) and no model named, the\n"
     "model is the checkpoint's (the config its run saved); with hf_path=, config.json's.\n"},
    {"convert", mt::cli::cmd_convert, "convert checkpoints from and to Hugging Face",
     "mt convert --from=hf --input=DIR --output=DIR\n"
     "       mt convert --to=hf --input=DIR --output=DIR [--model=NAME | --config=FILE]\n"
     "       mt convert --to=hf --model=NAME --output=DIR\n\n"
     "--from=hf imports a Hugging Face model directory (--input is hf_path) into an mt\n"
     "checkpoint; --to=hf exports an mt checkpoint (--input) or, without --input, the model's\n"
     "initial weights (init_weights_seed) as a Hugging Face directory.\n"},
    {"score", mt::cli::cmd_score, "loss and perplexity of a model on text or token ids",
     "mt score [--model=NAME] load_parameters_path=DIR | hf_path=DIR\n"
     "                prompt=\"...\" | input=FILE | tokens=ID,ID,... [output=FILE.safetensors]\n\n"
     "Prints the mean loss and perplexity of one text (prompt=), of each document of a file\n"
     "(input=: .jsonl/.json lines are JSON with a train_data_columns field, .txt lines are\n"
     "text, other files' lines JSON when they begin with '{'; a file of only digits, commas\n"
     "and blanks is token ids) or of comma-separated token ids (tokens=); output= also writes\n"
     "the logits and per-position log-likelihoods.\n"},
    {"bench", mt::cli::cmd_bench, "throughput benchmarks (JSON output)",
     "mt bench train|decode|moe|gemm|attention [--model=NAME] [key=value ...]\n\n"
     "  train      tokens/s, TFLOP/s and MFU of a short synthetic run (default llama-bench-m,\n"
     "             steps=6; the first steps are not timed)\n"
     "  decode     prefill and decode throughput (default llama-bench-m and llama-bench-1b);\n"
     "             steps=N decode steps timed (16), depth=N prompt tokens before them (128,\n"
     "             llama-bench's -d), dtypes=float32,bfloat16 (both),\n"
     "             parts=batch8,prefill,batch1 (all; the others print null)\n"
     "  gemm       shapes=MxKxN,... tokens=N trans_a=true trans_b=true dtype=\n"
     "  attention  shapes=BxTxHxD,... attention=flash|dot_product kv_heads=N causal=false dtype=\n"
     "  moe        tokens=N backward=false (default mixtral-8x7b's layer)\n"
     "gemm, attention and moe also take backend= (default cpu), warmup=, iters= and repeats=.\n",
     1, true},
    {"tokenize", mt::cli::cmd_tokenize, "text or JSONL -> the pre-tokenized `tokens` format",
     "mt tokenize tokenizer_path=FILE input=FILE[,FILE...] output=FILE.tokens\n\n"
     "Tokenizes every document (a .jsonl line's train_data_columns field, or a whole file) on\n"
     "all cores, adding BOS/EOS per add_bos/add_eos, and writes a file dataset_type=tokens "
     "reads.\n"},
    {"plugins", mt::cli::cmd_plugins, "list the plugins found and why any failed to load",
     "mt plugins [plugin_dirs=[DIR,...]]\n\n"
     "Searches the install directory, then MT_PLUGIN_PATH, then plugin_dirs, and prints\n"
     "each plugin's kind, name, version, ABI and path, or why it could not be loaded.\n"},
    {"models", mt::cli::cmd_models, "list the named model configs with family and size",
     "mt models\n\nLists configs/models/*.yml (and models/ beside plugins on MT_PLUGIN_PATH)\n"
     "with their family (decoder_block) and parameter count.\n"},
    {"config", mt::cli::cmd_config, "print the fully resolved config as YAML",
     "mt config [--model=NAME] [--config=FILE] [key=value ...] [--origins]\n\n"
     "Prints every key with its resolved value; --origins adds where each was set.\n"},
};

void print_help() {
  std::printf("mt %s: LLM training and inference in C++, MaxText rebuilt natively.\n\n",
              MT_VERSION_STRING);
  std::printf("Usage: mt <command> [options]\n\nCommands:\n");
  for (const auto& c : kCommands) std::printf("  %-9s %s\n", c.name, c.summary);
  std::printf(
      "\n%s\nRun `mt <command> --help` for a command's own options; `mt --version` prints\n"
      "the version, plugin ABI, op set and compiler.\n",
      kCommonOptions);
}

}  // namespace

namespace {

// Standard descriptors closed at start (`mt ... >&-`) would be the numbers the next files open
// get: run.lock or metrics.jsonl took mt's printing. They are opened on /dev/null instead, and a
// closed stdout (the result: true) is reported at the end as the write error it is.
bool open_standard_descriptors() {
  bool stdout_was_closed = false;
  for (int fd = 0; fd <= 2; ++fd) {
    if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    if (fd == 1) stdout_was_closed = true;
    const int n = open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (n >= 0 && n != fd) {
      dup2(n, fd);
      close(n);
    }
  }
  return stdout_was_closed;
}

// What was printed to stdout and could not be written (a full disk, a closed descriptor, a
// reader gone with SIGPIPE ignored) is a failed command: the results are lost (before: exit 0).
int checked_exit(int code, bool stdout_was_closed) {
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout) || stdout_was_closed;
  if (!failed || code != 0) return code;
  std::fprintf(stderr,
               "mt: error: writing to standard output failed (%s): what mt printed there "
               "is lost.\n",
               stdout_was_closed ? "it was closed" : std::strerror(errno));
  return 1;
}

int run_main(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  const bool stdout_was_closed = open_standard_descriptors();
  // A file size limit (ulimit -f) fails the write that reaches it (EFBIG, reported as any write
  // error) instead of killing mt with SIGXFSZ and no message.
  std::signal(SIGXFSZ, SIG_IGN);
  return checked_exit(run_main(argc, argv), stdout_was_closed);
}

namespace {

int run_main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h") ||
      !std::strcmp(argv[1], "help")) {
    print_help();
    return argc < 2 ? 2 : 0;
  }
  if (!std::strcmp(argv[1], "--version") || !std::strcmp(argv[1], "version")) {
    std::printf("mt %s (plugin ABI %u, op set %d, C++ %ld, %s)\n", MT_VERSION_STRING,
                MT_ABI_VERSION, MT_OPSET_VERSION, static_cast<long>(__cplusplus),
                "built with " __VERSION__);
    return 0;
  }
  const std::string name = argv[1];
  for (const auto& c : kCommands) {
    if (name != c.name) continue;
    try {
      mt::cli::Args a = mt::cli::parse_args(name, argc, argv, 2, c.positional);
      if (a.help) {
        std::printf("%s: %s\n\nUsage: %s\n%s", c.name, c.summary, c.usage, kCommonOptions);
        return 0;
      }
      // A command that is not one rank of several would run whole on every rank (printing it N
      // times, writing the same output files at once).
      if (const int n = mt::launcher_world_size(); n > 1 && !c.ranks)
        throw mt::UsageError(
            "mt " + name + " runs as one process, but was started as one of " + std::to_string(n) +
            " ranks (mpirun or srun): every rank would run it alone. Run it without the "
            "launcher; mt run and mt bench are the commands that use ranks.");
      return c.fn(a);
    } catch (const mt::Error& e) {
      std::fflush(stdout);
      // Under mpirun every rank refuses bad input alike (the same arguments and files): rank 0
      // says it once, and its exit ends the others. A rank still here after a while refused
      // alone (a file missing on its node, another environment): it says why, with its rank
      // (before: it exited with no word, and the job with it).
      if (e.kind() == mt::ErrorKind::usage && mt::launcher_world_size() > 1 &&
          mt::launcher_rank() != 0) {
        std::this_thread::sleep_for(std::chrono::seconds(10));
        std::fprintf(stderr, "mt %s: error on rank %d of %d: %s\n", c.name, mt::launcher_rank(),
                     mt::launcher_world_size(), e.what());
        return e.exit_code();
      }
      std::fprintf(stderr, "mt %s: error: %s\n", c.name, e.what());
      return e.exit_code();
    } catch (const std::bad_alloc&) {
      std::fflush(stdout);
      std::fprintf(stderr,
                   "mt %s: error: out of memory (a memory limit, ulimit -v, or what the machine "
                   "has): `mt plan` with the same arguments shows what the model needs.\n",
                   c.name);
      return 1;
    } catch (const std::exception& e) {
      std::fflush(stdout);
      // A thread or mapping the system refused (EAGAIN, ENOMEM) is the environment's limit,
      // not mt's bug (before: "internal error: Resource temporarily unavailable").
      const auto* sys = dynamic_cast<const std::system_error*>(&e);
      if (sys && (sys->code() == std::errc::resource_unavailable_try_again ||
                  sys->code() == std::errc::not_enough_memory))
        std::fprintf(stderr,
                     "mt %s: error: the system refused a thread or memory (%s): a limit on "
                     "processes or memory (ulimit -u, ulimit -v), or fewer num_threads.\n",
                     c.name, e.what());
      else
        std::fprintf(stderr, "mt %s: internal error: %s\n", c.name, e.what());
      return 1;
    } catch (...) {  // a plugin's throw of something else (`throw 7`)
      std::fflush(stdout);
      std::fprintf(stderr,
                   "mt %s: internal error: an exception that is not a std::exception, which mt "
                   "never throws: a plugin threw it (plugins throw mt::Error or mt::UsageError)\n",
                   c.name);
      return 1;
    }
  }
  std::string list;
  for (const auto& c : kCommands) list += (list.empty() ? "" : ", ") + std::string(c.name);
  std::fprintf(stderr, "mt: unknown command '%s'. The commands are: %s. Run `mt --help`.\n",
               name.c_str(), list.c_str());
  return 2;
}

}  // namespace
