// The SDK's Hugging Face interop helpers (mt/hf.h).
#include "mt/hf.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <exception>
#include <string>
#include <utility>

#include "mt/error.h"

namespace mt {

Model::HfName hf_tensor(std::string name, bool transposed, int64_t slice_begin, int64_t slice_end) {
  Model::HfName h;
  h.name = std::move(name);
  h.transposed = transposed;
  h.slice_begin = slice_begin;
  h.slice_end = slice_end;
  return h;
}

Model::HfName hf_experts(const std::string& prefix, int64_t experts, const std::string& suffix) {
  Model::HfName h;
  h.transposed = true;
  for (int64_t e = 0; e < experts; ++e) h.stack.push_back(prefix + std::to_string(e) + suffix);
  return h;
}

bool hf_causal_lm_top(const std::string& mt_name, bool tied, Model::HfName& out) {
  if (mt_name == "embedding")
    out = hf_tensor("model.embed_tokens.weight");
  else if (mt_name == "final_norm")
    out = hf_tensor("model.norm.weight");
  else if (mt_name == "lm_head")
    out = tied ? Model::HfName{} : hf_tensor("lm_head.weight", true);
  else
    return false;
  return true;
}

bool hf_split_layer(const std::string& mt_name, std::string& index, std::string& param) {
  const auto dot = mt_name.find('.', 7);
  if (mt_name.rfind("layers.", 0) != 0 || dot == std::string::npos) return false;
  index = mt_name.substr(7, dot - 7);
  param = mt_name.substr(dot + 1);
  return true;
}

int64_t hf_layer_number(const std::string& index) {
  int64_t i = -1;
  std::from_chars(index.data(), index.data() + index.size(), i);
  return i;
}

Model::HfName hf_from_table(const HfNameTable& table, const std::string& param,
                            const std::string& prefix) {
  auto it = table.find(param);
  if (it == table.end()) return {};
  return hf_tensor(prefix + it->second.first, it->second.second);
}

const std::string* hf_get(const HfConfig& hf, const std::string& key) {
  auto it = hf.find(key);
  return it == hf.end() || it->second == "null" ? nullptr : &it->second;
}

const std::string& hf_need(const HfConfig& hf, const std::string& key, const std::string& model) {
  const std::string* v = hf_get(hf, key);
  if (!v) throw UsageError("config.json has no '" + key + "', which a " + model + " model needs.");
  return *v;
}

int64_t hf_integer(const std::string& key, const std::string& value) {
  try {
    size_t n = 0;
    const long long x = std::stoll(value, &n);
    if (n == value.size()) return static_cast<int64_t>(x);
  } catch (const std::exception&) {
  }
  throw UsageError("config.json's " + key + " is '" + value + "'; it must be an integer.");
}

int64_t hf_derived_head_dim(const std::string& hidden, const std::string& heads) {
  const int64_t h = hf_integer("hidden_size", hidden), n = hf_integer("num_attention_heads", heads);
  if (n <= 0 || h % n != 0)
    throw UsageError("config.json has no head_dim and hidden_size=" + hidden +
                     " is not a multiple of num_attention_heads=" + heads + ".");
  return h / n;
}

double hf_number(const std::string& key, const std::string& value) {
  try {
    size_t n = 0;
    const double x = std::stod(value, &n);
    if (n == value.size() && std::isfinite(x)) return x;
  } catch (const std::exception&) {
  }
  throw UsageError("config.json's " + key + " is '" + value + "'; it must be a number.");
}

bool hf_flag(const HfConfig& hf, const std::string& key, bool absent) {
  const std::string* v = hf_get(hf, key);
  if (!v) return absent;
  if (*v == "true") return true;
  if (*v == "false") return false;
  throw UsageError("config.json's " + key + " is '" + *v + "'; it must be true or false.");
}

void hf_refuse_null(const HfConfig& hf, const std::string& key) {
  if (auto it = hf.find(key); it != hf.end() && it->second == "null")
    throw UsageError("config.json sets " + key +
                     " to null; it must be a number (transformers' models have no default for "
                     "a null one). Give the value or leave the field out for the default.");
}

void hf_refuse(const std::string& key, const std::string& value, const std::string& what,
               const std::string& who) {
  throw UsageError("config.json sets " + key + "=" + value + ": " + what + ", which " + who +
                   " does not implement; the logits would be wrong.");
}

std::string hf_json_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  std::string s = buf;
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace mt
