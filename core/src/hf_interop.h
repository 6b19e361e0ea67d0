// Hugging Face model directories: config.json + safetensors (single file or sharded with
// model.safetensors.index.json) + tokenizer files. The family plugin supplies the config and
// parameter-name mappings; this file does the I/O.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "mt/config.h"

namespace mt {

class ModelRunner;
class PluginManager;

struct HfImport {
  std::string family;                  // config.json's model_type
  std::vector<std::string> overrides;  // mt config key=value equal to config.json
  std::vector<std::string> unused;     // config.json fields mt does not use, for the user
};

// What a model directory says about special tokens, beside config.json: tokenizer_config.json's
// bos_token / eos_token (a string or {"content": ...}) and add_bos_token, and
// generation_config.json's bos_token_id and eos_token_id (one id or a list: every one stops
// generate). Absent files and fields leave their members empty.
// Without add_bos_token, `add_bos_token` is what tokenizer.json's post_processor does, as
// transformers' fast tokenizers apply it: a TemplateProcessing whose single template starts
// with a special token adds it (Llama's "<s>"), ByteLevel or none adds nothing (GPT-2, Qwen).
struct HfTokenSettings {
  std::string bos_token, eos_token;
  std::optional<bool> add_bos_token;
  int32_t bos_token_id = -1;
  std::vector<int32_t> eos_token_ids;
};
// `tokenizer_config_only`: that file's bos/eos tokens and add_bos_token alone (what a tokenizer
// takes from beside its tokenizer.json).
HfTokenSettings read_hf_token_settings(const std::filesystem::path& dir,
                                       bool tokenizer_config_only = false);

// Reads <dir>/config.json and asks the family plugin of its model_type for the mt config.
HfImport read_hf_config(const std::filesystem::path& dir, PluginManager& plugins);

// Loads every parameter of `runner` from the directory's safetensors by its Hugging Face name
// (transposing where the family says the layouts differ). Throws mt::Error naming a missing
// tensor or a shape mismatch, and mt::UsageError naming the tensors of the directory that no
// parameter takes (config.json and the weights disagree).
void load_hf_weights(const std::filesystem::path& dir, ModelRunner& runner);

// Writes config.json and model.safetensors (Hugging Face names and layouts) for `runner`.
void write_hf_model(const std::filesystem::path& dir, ModelRunner& runner, const Config& cfg,
                    PluginManager& plugins);
// The tensors alone, as one safetensors file: each parameter under its Model::hf_name, in
// Hugging Face's layout (transposed, split into stacked parts, fused with the other column
// slices of the same tensor, which must cover its columns exactly once).
void write_hf_tensors(const std::filesystem::path& file, ModelRunner& runner);

// Copies tokenizer.json, tokenizer.model, tokenizer_config.json, special_tokens_map.json and
// generation_config.json from `from` (a directory, or a tokenizer file's directory) if present.
void copy_tokenizer_files(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace mt
