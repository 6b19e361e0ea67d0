// Helpers for a family's Hugging Face interop (Model::hf_name, ModelFamily::from_hf_config and
// to_hf_config): the pieces every family would otherwise write again. Implemented in libmt_core.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "mt/export.h"
#include "mt/model.h"

namespace mt {

// ---- parameter names (Model::hf_name) ----

// One Hugging Face tensor: `name`, stored [out, in] when `transposed`, optionally only columns
// (or elements) [slice_begin, slice_end) of it.
MT_API Model::HfName hf_tensor(std::string name, bool transposed = false, int64_t slice_begin = 0,
                               int64_t slice_end = 0);
// E experts' tensors stacked along a new first dimension, each "<prefix><e><suffix>" for e in
// [0, experts) and stored [out, in] (transformers' per-expert Linear weights).
MT_API Model::HfName hf_experts(const std::string& prefix, int64_t experts,
                                const std::string& suffix);
// The top of Hugging Face's *ForCausalLM (Llama, Mistral, Qwen, Gemma, DeepSeek): embedding ->
// model.embed_tokens.weight, final_norm -> model.norm.weight, lm_head -> lm_head.weight
// (transposed; none when tied). False for any other name.
MT_API bool hf_causal_lm_top(const std::string& mt_name, bool tied, Model::HfName& out);
// Splits "layers.<i>.<param>" into "<i>" and "<param>"; false for any other name.
MT_API bool hf_split_layer(const std::string& mt_name, std::string& index, std::string& param);
// The number a layer index starts with ("3" -> 3); -1 when it starts with none.
MT_API int64_t hf_layer_number(const std::string& index);
// A layer's parameter -> (Hugging Face name under the layer's prefix, stored transposed).
using HfNameTable = std::map<std::string, std::pair<const char*, bool>>;
// prefix + table[param], or an empty HfName (no name, no stack) when param is not in the table.
MT_API Model::HfName hf_from_table(const HfNameTable& table, const std::string& param,
                                   const std::string& prefix);

// ---- config.json (from_hf_config, to_hf_config) ----

// hf[key], or null when config.json has no such field or sets it to null.
MT_API const std::string* hf_get(const HfConfig& hf, const std::string& key);
// hf[key]; throws UsageError "config.json has no '<key>', which a <model> model needs." when
// hf_get finds none.
MT_API const std::string& hf_need(const HfConfig& hf, const std::string& key,
                                  const std::string& model);
// A field's value as an integer / a finite number; throws UsageError naming the field otherwise.
MT_API int64_t hf_integer(const std::string& key, const std::string& value);
MT_API double hf_number(const std::string& key, const std::string& value);
// A boolean field: `absent` when config.json has none (or null), else true or false; throws
// UsageError naming the field for any other value (transformers' configs take only booleans).
MT_API bool hf_flag(const HfConfig& hf, const std::string& key, bool absent);
// Throws UsageError when config.json sets `key` to null: for fields whose null transformers
// does not replace by a default (e.g. rms_norm_eps, which its norms then fail on).
MT_API void hf_refuse_null(const HfConfig& hf, const std::string& key);
// The head width transformers derives when config.json has no head_dim: hidden_size /
// num_attention_heads (the fields' values); throws UsageError unless heads divide the width.
MT_API int64_t hf_derived_head_dim(const std::string& hidden, const std::string& heads);
// Throws UsageError: config.json sets key=value, `what`, which `who` ("mt's llama family") does
// not implement.
[[noreturn]] MT_API void hf_refuse(const std::string& key, const std::string& value,
                                   const std::string& what, const std::string& who);
// A float as a JSON number that reads back as a float ("10000.0", "1e-05"): %.9g, with ".0"
// added to a whole number.
MT_API std::string hf_json_number(double v);

}  // namespace mt
