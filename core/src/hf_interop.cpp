#include "hf_interop.h"

#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "file_util.h"
#include "json.h"
#include "model_runner.h"
#include "mt/error.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "safetensors.h"

namespace fs = std::filesystem;

namespace mt {

namespace {

void flatten(const json::Value& v, const std::string& prefix, HfConfig& out) {
  switch (v.kind) {
    case json::Value::Kind::object:
      for (const auto& [k, m] : v.members) flatten(m, prefix.empty() ? k : prefix + "." + k, out);
      if (v.members.empty()) out[prefix] = "{}";
      break;
    case json::Value::Kind::null: out[prefix] = "null"; break;
    case json::Value::Kind::boolean: out[prefix] = v.boolean ? "true" : "false"; break;
    case json::Value::Kind::number: out[prefix] = v.str; break;
    case json::Value::Kind::string: out[prefix] = v.str; break;
    case json::Value::Kind::array: {
      std::string s = "[";
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i) s += ", ";
        const auto& it = v.items[i];
        s += it.kind == json::Value::Kind::string ? "\"" + it.str + "\"" : it.str;
      }
      out[prefix] = s + "]";
      break;
    }
  }
}

// The safetensors files of a model directory, and which file holds each tensor.
struct Weights {
  std::vector<std::unique_ptr<SafeTensorsFile>> files;
  std::map<std::string, const SafeTensorsFile*> where;
};

Weights open_weights(const fs::path& dir) {
  Weights w;
  std::vector<fs::path> paths;
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    json::Value v;
    try {
      v = json::parse(read_file(index.string(), "Hugging Face index"));
    } catch (const json::ParseError& e) {
      throw Error(index.string() + " is not valid JSON: " + e.what);
    }
    const json::Value* map = v.find("weight_map");
    if (!map || !map->is_object()) throw Error(index.string() + " has no weight_map object.");
    std::set<std::string> names;
    for (const auto& [k, f] : map->members) {
      // A shard is a file of this directory: an absolute path or one with ".." in the index
      // (a downloaded directory is not trusted) would open and parse any file on the machine.
      const fs::path rel(f.str);
      bool inside = f.is_string() && !f.str.empty() && rel.is_relative();
      for (const auto& part : rel) inside &= part != "..";
      if (!inside)
        throw UsageError(mt::quoted(index) + ": weight_map[\"" + k.substr(0, 200) + "\"] is " +
                         (f.is_string() ? mt::quoted(fs::path(f.str.substr(0, 200)))
                                        : std::string("not a string")) +
                         ", which is not a file name inside the model directory " +
                         mt::quoted(dir) + ". Shard paths must be relative and stay inside it.");
      names.insert(f.str);
    }
    for (const auto& n : names) paths.push_back(dir / n);
  } else if (fs::exists(dir / "model.safetensors")) {
    paths.push_back(dir / "model.safetensors");
  } else {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") paths.push_back(e.path());
    std::sort(paths.begin(), paths.end());
  }
  if (paths.empty())
    throw UsageError("No safetensors weights in " + dir.string() +
                     " (expected model.safetensors or model.safetensors.index.json).");
  for (const auto& p : paths) {
    w.files.push_back(std::make_unique<SafeTensorsFile>(p));
    for (const auto& n : w.files.back()->names()) w.where[n] = w.files.back().get();
  }
  return w;
}

// Row-major [r, c] -> [c, r] on the host.
std::vector<float> transpose(const std::vector<float>& a, int64_t r, int64_t c) {
  std::vector<float> t(a.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) t[static_cast<size_t>(j * r + i)] = a[static_cast<size_t>(i * c + j)];
  return t;
}

}  // namespace

HfImport read_hf_config(const fs::path& dir, PluginManager& plugins) {
  const fs::path cfg = dir / "config.json";
  if (!fs::is_directory(dir))
    throw UsageError("The Hugging Face model directory '" + dir.string() + "' does not exist.");
  if (!fs::exists(cfg)) throw UsageError(dir.string() + " has no config.json.");
  json::Value v;
  try {
    v = json::parse(read_file(cfg.string(), "Hugging Face config"));
  } catch (const json::ParseError& e) {
    throw UsageError(cfg.string() + " is not valid JSON (at byte " + std::to_string(e.offset) +
                     "): " + e.what);
  }
  if (!v.is_object()) throw UsageError(cfg.string() + " is not a JSON object.");
  HfConfig flat;
  flatten(v, "", flat);
  auto mt = flat.find("model_type");
  if (mt == flat.end()) throw UsageError(cfg.string() + " has no model_type.");
  HfImport r;
  r.family = mt->second;
  auto fam = plugins.make_model_family(r.family);
  r.overrides = fam->from_hf_config(flat, r.unused);
  return r;
}

void load_hf_weights(const fs::path& dir, ModelRunner& runner) {
  Weights w = open_weights(dir);
  std::set<std::string> used;
  Backend& be = runner.backend();
  for (auto& p : runner.params()) {
    const Model::HfName hf = runner.model().hf_name(p.name);
    if (hf.name.empty())
      throw Error("The model family has no Hugging Face name for parameter '" + p.name + "'.");
    auto it = w.where.find(hf.name);
    if (it == w.where.end())
      throw Error("The weights in " + dir.string() + " have no tensor '" + hf.name +
                  "' (mt parameter " + p.name + ").");
    used.insert(hf.name);
    const Shape& s = p.spec.shape;
    const Shape hf_shape = hf.transposed ? Shape{s[1], s[0]} : s;
    Tensor t = load_tensor(*it->second, hf.name, be, DType::f32, hf_shape);
    if (hf.transposed) {
      std::vector<float> host(static_cast<size_t>(t.numel()));
      be.copy_to_host(t, host.data());
      host = transpose(host, s[1], s[0]);
      t = be.empty(s, DType::f32);
      be.copy_from_host(t, host.data());
    }
    be.cast(t, p.value);
  }
  // A tensor no parameter takes means config.json describes another model than the weights do
  // (tie_word_embeddings=true beside a separate lm_head.weight, fewer layers than the files
  // hold): refused, as mt's own checkpoint loader refuses extra tensors. Rotary tables that old
  // checkpoints stored are derived, not weights.
  std::vector<std::string> extra;
  for (const auto& [n, f] : w.where) {
    const std::string suffix = "rotary_emb.inv_freq";
    const bool derived = n.size() >= suffix.size() &&
                         n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0;
    if (!used.count(n) && !derived) extra.push_back(n);
  }
  if (!extra.empty()) {
    std::string list;
    for (size_t i = 0; i < extra.size() && i < 8; ++i) list += (i ? ", " : "") + extra[i];
    if (extra.size() > 8) list += " and " + std::to_string(extra.size() - 8) + " more";
    throw UsageError(
        "The weights in " + mt::quoted(dir) + " hold " + std::to_string(extra.size()) +
        " tensor(s) that the model its config.json describes has no place for: " + list +
        ". config.json disagrees with the weights (tie_word_embeddings, "
        "num_hidden_layers, ...); the logits would not be the checkpoint's.");
  }
}

void write_hf_model(const fs::path& dir, ModelRunner& runner, const Config& cfg,
                    PluginManager& plugins) {
  fs::create_directories(dir);
  auto fam = plugins.make_model_family(cfg.get_string("decoder_block"));
  const auto fields = fam->to_hf_config(cfg);
  // Nest dotted keys one level ("rope_scaling.factor" -> "rope_scaling": {"factor": ...}).
  std::map<std::string, std::map<std::string, std::string>> nested;
  std::map<std::string, std::string> top;
  for (const auto& [k, v] : fields) {
    const auto dot = k.find('.');
    if (dot == std::string::npos) top[k] = v;
    else nested[k.substr(0, dot)][k.substr(dot + 1)] = v;
  }
  std::string js = "{\n";
  bool first = true;
  auto item = [&](const std::string& k, const std::string& v) {
    js += std::string(first ? "" : ",\n") + "  \"" + k + "\": " + v;
    first = false;
  };
  for (const auto& [k, v] : top)
    if (!nested.count(k)) item(k, v);
  for (const auto& [k, m] : nested) {
    std::string o = "{";
    bool f = true;
    for (const auto& [mk, mv] : m) {
      o += std::string(f ? "" : ", ") + "\"" + mk + "\": " + mv;
      f = false;
    }
    item(k, o + "}");
  }
  js += "\n}\n";
  std::ofstream(dir / "config.json") << js;

  Backend& be = runner.backend();
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& p : runner.params()) {
    const Model::HfName hf = runner.model().hf_name(p.name);
    if (hf.name.empty())
      throw Error("The model family has no Hugging Face name for parameter '" + p.name + "'.");
    if (!hf.transposed) {
      out.emplace_back(hf.name, p.value);
      continue;
    }
    const Shape& s = p.spec.shape;
    Tensor f = be.empty(s, DType::f32);
    be.cast(p.value, f);
    std::vector<float> host(static_cast<size_t>(f.numel()));
    be.copy_to_host(f, host.data());
    host = transpose(host, s[0], s[1]);
    Tensor t = be.empty({s[1], s[0]}, DType::f32);
    be.copy_from_host(t, host.data());
    if (p.value.dtype() != DType::f32) {
      Tensor c = be.empty(t.shape(), p.value.dtype());
      be.cast(t, c);
      t = c;
    }
    out.emplace_back(hf.name, t);
  }
  save_tensors(dir / "model.safetensors", out, {{"format", "pt"}});
}

void copy_tokenizer_files(const fs::path& from, const fs::path& to) {
  const fs::path src = fs::is_directory(from) ? from : from.parent_path();
  for (const char* f : {"tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                        "special_tokens_map.json", "generation_config.json"}) {
    std::error_code ec;
    if (fs::exists(src / f, ec))
      fs::copy_file(src / f, to / f, fs::copy_options::overwrite_existing, ec);
  }
  // A bare tokenizer file given by tokenizer_path (e.g. data/tokenizer.json).
  if (!fs::is_directory(from) && fs::exists(from)) {
    std::error_code ec;
    fs::copy_file(from, to / from.filename(), fs::copy_options::overwrite_existing, ec);
  }
}

}  // namespace mt
