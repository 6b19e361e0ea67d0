// Shared helpers of the model-family tests (tests/unit/{qwen,gpt,deepseek,gemma,mistral_family,
// hf_golden}_test.cpp): the reference tensors of a golden directory (tests/golden/*), a scratch
// directory per test, and the mt CLI run as users run it (score, decode, convert, run).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/model.h"
#include "safetensors.h"
#include "test_support.h"

namespace mt::test {

// The tensors of <dir>/reference.safetensors as host vectors.
struct Reference {
  explicit Reference(const std::filesystem::path& dir);
  SafeTensorsFile file;
  std::vector<int32_t> ints(const std::string& name) const;   // expects I32
  std::vector<float> floats(const std::string& name) const;   // expects F32
  std::vector<float> widened(const std::string& name) const;  // F32, or BF16 read into f32
};

// A scratch directory of this test, removed afterwards.
struct Scratch {
  Scratch();
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  std::filesystem::path root;
};

// "1,2,3": ids as the CLI's tokens= takes them.
std::string join_ids(const std::vector<int32_t>& ids);

// The bytes of a file.
std::string slurp(const std::filesystem::path& p);

// `text` with its first `from` replaced by `to` (a failure when there is none).
std::string replace_first(std::string text, const std::string& from, const std::string& to);
// The same, in place on a file.
void edit_file(const std::filesystem::path& file, const std::string& from, const std::string& to);

// A copy of golden directory <golden>/<name> (its model.safetensors) in `s`, whose config.json
// is `config` (a file of that directory).
std::filesystem::path with_config(const Scratch& s, const std::filesystem::path& golden,
                                  const std::string& name, const std::string& config);

// `mt score hf_path=<dir> tokens=<ref's input_ids> output=... [extra]`: the logits mt wrote (empty
// on failure), and in `out` what it printed. `shape`, when given, is the logits' expected shape.
std::vector<float> score(const std::filesystem::path& dir, const Reference& ref, const Scratch& s,
                         std::string& out, const std::string& extra = "",
                         const Shape* shape = nullptr);

// Scores <golden>/<name> from its config.json and from its legacy_config.json: the reference
// logits within `tol`, every field understood (no "mt: note"), both forms the same logits. Fatal
// failures: call it in ASSERT_NO_FATAL_FAILURE.
void expect_logits_in_both_forms(const Scratch& s, const std::filesystem::path& golden,
                                 const std::string& name, double tol);

// bfloat16 against transformers' own (tools/make_bf16_reference.py wrote
// <dir>/bf16_reference.safetensors): `mt score` of <dir> with dtype=weight_dtype=bfloat16 is at
// most `ratio` times as far from the float32 reference logits as transformers in bfloat16 is
// (max error over the largest logit). How often each picks the float32 argmax is printed, not
// asserted: a random model's near-ties flip either way under bf16 rounding.
void expect_bf16_as_close_as_transformers(const Scratch& s, const std::filesystem::path& dir,
                                          double ratio = 1.25);

// `mt decode hf_path=<dir> tokens=<prompt> [extra]` for `length` tokens in all.
MtResult decode(const std::filesystem::path& dir, const std::vector<int32_t>& prompt, size_t length,
                const std::string& extra = "");
// `mt decode hf_path=<dir>` of the reference's <name>.prompt prints its <name>.ids (the prompt and
// `new_tokens` greedy tokens) alone on a line. Fatal failures: call it in ASSERT_NO_FATAL_FAILURE.
void expect_decode_equals_generate(const Reference& ref, const std::string& name,
                                   const std::filesystem::path& dir, size_t new_tokens);
// Whether `out` holds `ids` alone on a line.
bool has_ids_line(const std::string& out, const std::vector<int32_t>& ids);

// mt convert --from=hf <hf> to <mtdir>, then --to=hf to <back>; every tensor of <hf> comes back
// bit for bit (names, shapes, bytes). Fatal failures: call it in ASSERT_NO_FATAL_FAILURE.
void convert_round_trip(const std::filesystem::path& hf, const std::filesystem::path& mtdir,
                        const std::filesystem::path& back);

// `mt run --model=<model> <options> log_period=1 eval_interval=-1 num_threads=2` as run <name>
// under <base>.
MtResult run_training(const std::string& model, const std::string& options,
                      const std::filesystem::path& base, const std::string& name);
// The corpus options of the training tests: the shipped tokens, 8192 ids, `steps` steps at
// `learning_rate`, batches of 4, no checkpoints.
std::string corpus_options(int steps, const std::string& learning_rate);
// The synthetic options of the resume tests: checkpoints every `period` steps, async, the
// schedule `schedule` steps long.
std::string resume_options(int period, int schedule);
// Losses logged in <run>/metrics.jsonl, one per step.
std::vector<std::string> losses(const std::filesystem::path& run);
// The mean of the last five.
double last_five_mean(const std::vector<std::string>& losses);
// Runs <straight> and <resumed> of `steps` steps each logged the same losses and wrote the same
// final parameters. Fatal failures: call it in ASSERT_NO_FATAL_FAILURE.
void expect_same_runs(const std::filesystem::path& straight, const std::filesystem::path& resumed,
                      size_t steps);

// Trains <model> with `options` (resume_options(3, 6) added) 6 steps straight as <base>/straight,
// and 3 steps then a restart to 6 as <base>/resumed; both runs must succeed and be the same
// (expect_same_runs). Fatal failures: call it in ASSERT_NO_FATAL_FAILURE.
void expect_resumed_equals_straight(const std::string& model, const std::string& options,
                                    const std::filesystem::path& base);

// `mt <args>` refused before any work: exit code 2, its output naming `says`.
void expect_refused(const std::string& args, const std::string& says);

// `mt models` lists each named config of `expect` ({name, size}) on a line of its own that names
// `family` and the size.
void expect_named_sizes(const std::vector<std::pair<const char*, const char*>>& expect,
                        const std::string& family);

// A named config resolved with the family's own keys, built by its plugin.
std::unique_ptr<Model> build_named(const std::string& model);

}  // namespace mt::test
