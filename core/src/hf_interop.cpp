#include "hf_interop.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <oneapi/tbb/parallel_for.h>

#include "file_util.h"
#include "json.h"
#include "model_runner.h"
#include "mt/error.h"
#include "mt/model.h"
#include "plugin_manager.h"
#include "progress.h"
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
    case json::Value::Kind::null:
      out[prefix] = "null";
      break;
    case json::Value::Kind::boolean:
      out[prefix] = v.boolean ? "true" : "false";
      break;
    case json::Value::Kind::number:
      out[prefix] = v.str;
      break;
    case json::Value::Kind::string:
      out[prefix] = v.str;
      break;
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
  std::map<std::string, fs::path> indexed;  // with an index: each tensor's file, as it says
  if (fs::exists(index)) {
    json::Value v;
    try {
      v = json::parse(read_file(index.string(), "Hugging Face index"));
    } catch (const json::ParseError& e) {
      throw UsageError(mt::quoted(index) + " is not valid JSON (at byte " +
                       std::to_string(e.offset) + "): " + e.what);
    }
    const json::Value* map = v.find("weight_map");
    if (!map || !map->is_object())
      throw UsageError(mt::quoted(index) +
                       " has no weight_map object (tensor name -> safetensors file name).");
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
      indexed[k] = dir / f.str;
    }
    for (const auto& n : names) {
      std::error_code ec;
      if (!fs::is_regular_file(dir / n, ec))
        throw UsageError(mt::quoted(index) + " names the shard " + mt::quoted(fs::path(n)) +
                         ", which " + mt::quoted(dir) +
                         " does not hold: an incomplete download, or an index of other files.");
      paths.push_back(dir / n);
    }
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
    for (const auto& n : w.files.back()->names()) {
      // A tensor the index names comes from the file it names (before: from the last file that
      // held it, so a stray copy in another shard replaced it silently).
      if (const auto ix = indexed.find(n); ix != indexed.end()) {
        if (ix->second == p) w.where[n] = w.files.back().get();
        continue;
      }
      // Any other tensor is in one file only: in two it has no one value (before: the last file
      // in name order won, silently).
      const auto [it, added] = w.where.emplace(n, w.files.back().get());
      if (!added)
        throw UsageError(
            "The tensor \"" + n.substr(0, 200) + "\" is in both " + mt::quoted(it->second->path()) +
            " and " + mt::quoted(p) + " of " + mt::quoted(dir) +
            (indexed.empty() ? ": which one is the model's is not said. Remove the stray file, or "
                               "give the directory a model.safetensors.index.json naming each "
                               "tensor's file."
                             : ", and the index's weight_map does not name it: which one is the "
                               "model's is not said. Name its file there, or remove the stray "
                               "copy."));
    }
  }
  for (const auto& [k, f] : indexed)
    if (!w.where.count(k))
      throw UsageError(mt::quoted(index) + " puts the tensor \"" + k.substr(0, 200) + "\" in " +
                       mt::quoted(f.filename()) +
                       ", which does not hold it: the index and the shards disagree.");
  return w;
}

// Row-major [r, c] -> [c, r] on the host.
// In 32 x 32 tiles (both sides stay in cache), the tiles in parallel.
std::vector<float> transpose(const std::vector<float>& a, int64_t r, int64_t c) {
  std::vector<float> t(a.size());
  constexpr int64_t kTile = 32;
  const int64_t tiles_r = (r + kTile - 1) / kTile, tiles_c = (c + kTile - 1) / kTile;
  const float* src = a.data();
  float* dst = t.data();
  tbb::parallel_for(int64_t{0}, tiles_r * tiles_c, [&](int64_t tile) {
    const int64_t i0 = tile / tiles_c * kTile, j0 = tile % tiles_c * kTile;
    const int64_t i1 = std::min(r, i0 + kTile), j1 = std::min(c, j0 + kTile);
    for (int64_t j = j0; j < j1; ++j)  // contiguous writes, reads along a tile's column
      for (int64_t i = i0; i < i1; ++i) dst[j * r + i] = src[i * c + j];
  });
  return t;
}

}  // namespace

HfTokenSettings read_hf_token_settings(const fs::path& dir, bool tokenizer_config_only) {
  HfTokenSettings r;
  auto load = [&dir](const char* name, json::Value& v) {
    const fs::path f = dir / name;
    std::error_code ec;
    if (!fs::exists(f, ec)) return false;
    try {
      v = json::parse(read_file(f.string(), "Hugging Face " + std::string(name)));
    } catch (const json::ParseError& e) {
      throw UsageError(mt::quoted(f) + " is not valid JSON (at byte " + std::to_string(e.offset) +
                       "): " + e.what);
    }
    if (!v.is_object()) throw UsageError(mt::quoted(f) + " is not a JSON object.");
    return true;
  };
  auto bad = [&dir](const char* file, const std::string& field, const char* want) {
    return UsageError(mt::quoted(dir / file) + ": " + field + " must be " + want + ".");
  };
  auto token_id = [&](const char* file, const std::string& field, const json::Value& x) {
    if (!x.is_int || x.integer < 0 || x.integer > INT32_MAX)
      throw bad(file, field, "a token id (an integer from 0 to 2^31 - 1)");
    return static_cast<int32_t>(x.integer);
  };
  json::Value tc;
  if (load("tokenizer_config.json", tc)) {
    for (auto [field, out] : {std::pair<const char*, std::string*>{"bos_token", &r.bos_token},
                              {"eos_token", &r.eos_token}}) {
      const json::Value* t = tc.find(field);
      if (!t || t->is_null()) continue;
      const json::Value* content = t->is_object() ? t->find("content") : t;
      if (!content || !content->is_string())
        throw bad("tokenizer_config.json", field,
                  "a string or an object with a \"content\" string");
      *out = content->str;
    }
    if (const json::Value* a = tc.find("add_bos_token"); a && !a->is_null()) {
      if (a->kind != json::Value::Kind::boolean)
        throw bad("tokenizer_config.json", "add_bos_token", "true or false");
      r.add_bos_token = a->boolean;
    }
  }
  if (tokenizer_config_only) return r;
  json::Value tj;
  if (!r.add_bos_token && load("tokenizer.json", tj)) {
    // The post-processor, or the TemplateProcessing inside a Sequence of them.
    const json::Value* pp = tj.find("post_processor");
    if (pp && pp->is_object()) {
      const json::Value* type = pp->find("type");
      if (type && type->is_string() && type->str == "Sequence") {
        const json::Value* list = pp->find("processors");
        const json::Value* found = nullptr;
        if (list && list->is_array())
          for (const auto& p : list->items)
            if (const json::Value* t = p.is_object() ? p.find("type") : nullptr;
                t && t->is_string() && t->str == "TemplateProcessing")
              found = &p;
        pp = found;
      }
    }
    bool adds = false;
    if (pp && pp->is_object()) {
      const json::Value* type = pp->find("type");
      const json::Value* single = pp->find("single");
      if (type && type->is_string() && type->str == "TemplateProcessing" && single &&
          single->is_array() && !single->items.empty() && single->items[0].is_object())
        adds = single->items[0].find("SpecialToken") != nullptr;
    }
    r.add_bos_token = adds;
  }
  json::Value gc;
  if (load("generation_config.json", gc)) {
    if (const json::Value* b = gc.find("bos_token_id"); b && !b->is_null())
      r.bos_token_id = token_id("generation_config.json", "bos_token_id", *b);
    if (const json::Value* e = gc.find("eos_token_id"); e && !e->is_null()) {
      if (e->is_array()) {
        for (size_t i = 0; i < e->items.size(); ++i)
          r.eos_token_ids.push_back(token_id(
              "generation_config.json", "eos_token_id[" + std::to_string(i) + "]", e->items[i]));
      } else {
        r.eos_token_ids.push_back(token_id("generation_config.json", "eos_token_id", *e));
      }
    }
  }
  return r;
}

HfImport read_hf_config(const fs::path& dir, PluginManager& plugins) {
  const fs::path cfg = dir / "config.json";
  if (!fs::is_directory(dir))
    throw UsageError("The Hugging Face model directory '" + dir.string() +
                     (fs::exists(dir) ? "' is a file, not a directory (give the directory "
                                        "that holds config.json and the safetensors files)."
                                      : "' does not exist."));
  if (!fs::exists(cfg)) throw UsageError(dir.string() + " has no config.json.");
  json::Value v;
  try {
    v = json::parse(read_file(cfg.string(), "Hugging Face config"));
  } catch (const json::ParseError& e) {
    throw UsageError(cfg.string() + " is not valid JSON (at byte " + std::to_string(e.offset) +
                     "): " + e.what);
  }
  if (!v.is_object()) throw UsageError(cfg.string() + " is not a JSON object.");
  // The rope's scaling is an object or null in every transformers version; another kind was
  // flattened to a key no family reads, and the model ran unscaled without a word.
  for (const char* key : {"rope_scaling", "rope_parameters"})
    if (const json::Value* r = v.find(key); r && !r->is_null() && !r->is_object())
      throw UsageError(cfg.string() + ": \"" + key + "\" is " + json::kind_name(r->kind) +
                       ", not an object (such as {\"rope_type\": \"linear\", \"factor\": 8.0}) "
                       "or null.");
  HfConfig flat;
  flatten(v, "", flat);
  auto mt = flat.find("model_type");
  if (mt == flat.end()) throw UsageError(cfg.string() + " has no model_type.");
  HfImport r;
  r.family = mt->second;
  std::unique_ptr<ModelFamily> fam;
  try {
    fam = plugins.make_model_family(r.family);
  } catch (const UsageError& e) {
    throw UsageError(cfg.string() + " has model_type \"" + r.family.substr(0, 200) +
                     "\", which names no model family mt has: " + e.what());
  }
  try {
    r.overrides = fam->from_hf_config(flat, r.unused);
  } catch (const UsageError& e) {
    // The families word their refusals "config.json ...": name the file.
    const std::string what = e.what();
    if (what.rfind("config.json", 0) != 0) throw;
    throw UsageError(cfg.string() + what.substr(11));
  }
  return r;
}

namespace {

// A tensor of the directory as f32 on the host, in mt's orientation ([in, out]: transposed back
// when Hugging Face stores it [out, in]); `expect` (mt orientation) is checked when given.
std::vector<float> read_hf(const Weights& w, const std::string& name, bool transposed,
                           const fs::path& dir, const std::string& param, Shape& shape,
                           const Shape* expect, std::set<std::string>& used) {
  auto it = w.where.find(name);
  // Weights saved from the base model (GPT2Model rather than GPT2LMHeadModel: the hub's gpt2)
  // lack the head model's prefix ("transformer.h.0..." is stored as "h.0..."); transformers
  // loads them by adding its base_model_prefix, and so does mt, for the first component.
  if (it == w.where.end())
    if (const auto dot = name.find('.'); dot != std::string::npos)
      it = w.where.find(name.substr(dot + 1));
  // A missing tensor or a shape other than config.json implies: the directory's config.json and
  // weights disagree, bad input (exit code 2).
  if (it == w.where.end())
    throw UsageError("The weights in " + dir.string() + " have no tensor '" + name +
                     "' (mt parameter " + param + ").");
  Shape hf = it->second->info(it->first).shape;
  if (transposed && hf.size() != 2)
    throw UsageError("Tensor '" + name + "' in " + dir.string() + " has shape " + shape_str(hf) +
                     "; mt parameter " + param + " reads it as a transposed matrix.");
  shape = transposed ? Shape{hf[1], hf[0]} : hf;
  if (expect && shape != *expect)
    throw UsageError("Tensor '" + name + "' in " + dir.string() + " has shape " + shape_str(hf) +
                     ", but mt parameter " + param + " needs " +
                     shape_str(transposed ? Shape{(*expect)[1], (*expect)[0]} : *expect) +
                     " there (config.json and the weights disagree).");
  used.insert(it->first);
  std::vector<float> host = read_f32(*it->second, it->first);
  return transposed ? transpose(host, hf[0], hf[1]) : host;
}

}  // namespace

void load_hf_weights(const fs::path& dir, ModelRunner& runner) {
  Weights w = open_weights(dir);
  std::set<std::string> used;
  Backend& be = runner.backend();
  double bytes = 0;
  for (auto& p : runner.params()) bytes += static_cast<double>(shape_numel(p.spec.shape)) * 4;
  Progress shown("loading " + dir.filename().string(), bytes, "B", true);
  for (auto& p : runner.params()) {
    shown.add(static_cast<double>(shape_numel(p.spec.shape)) * 4);
    // Multi-token prediction modules (mtp.<k>.*, Model::mtp_depths) have no place in
    // transformers' models, which build none: they keep the values they have (mt run
    // initialises every parameter before loading).
    if (p.name.rfind("mtp.", 0) == 0) continue;
    const Model::HfName hf = runner.model().hf_name(p.name);
    if (hf.name.empty() && hf.stack.empty())
      throw Error("The model family has no Hugging Face name for parameter '" + p.name + "'.");
    const Shape& s = p.spec.shape;
    std::vector<float> host;
    Shape got;
    if (!hf.stack.empty()) {
      // [E, ...]: part e is tensor stack[e].
      if (s.empty() || s[0] != static_cast<int64_t>(hf.stack.size()))
        throw Error("mt parameter " + p.name + " of shape " + shape_str(s) + " is mapped to " +
                    std::to_string(hf.stack.size()) + " stacked Hugging Face tensors.");
      const Shape part(s.begin() + 1, s.end());
      host.reserve(static_cast<size_t>(shape_numel(s)));  // no regrowth: one copy of it at a time
      for (const auto& n : hf.stack) {
        std::vector<float> one = read_hf(w, n, hf.transposed, dir, p.name, got, &part, used);
        host.insert(host.end(), one.begin(), one.end());
      }
    } else if (hf.slice_end > 0) {
      // Columns [begin, end) of a fused tensor, in mt orientation [rows, columns]; a vector (a
      // fused bias) is one row.
      std::vector<float> all = read_hf(w, hf.name, hf.transposed, dir, p.name, got, nullptr, used);
      const int64_t width = hf.slice_end - hf.slice_begin;
      const bool vec = s.size() == 1;
      const int64_t rows = vec ? 1 : s.size() == 2 ? s[0] : -1;
      const int64_t cols = got.empty() ? -1 : got.back();
      if (rows < 0 || got.size() != s.size() || (!vec && got[0] != s[0]) || width != s.back() ||
          hf.slice_begin < 0 || hf.slice_end > cols)
        throw UsageError("mt parameter " + p.name + " of shape " + shape_str(s) +
                         " is mapped to columns [" + std::to_string(hf.slice_begin) + ", " +
                         std::to_string(hf.slice_end) + ") of '" + hf.name +
                         "', whose shape (in mt's orientation) is " + shape_str(got) +
                         " (config.json and the weights disagree).");
      host.resize(static_cast<size_t>(rows * width));
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(all.begin() + r * cols + hf.slice_begin, width, host.begin() + r * width);
    } else {
      host = read_hf(w, hf.name, hf.transposed, dir, p.name, got, &s, used);
    }
    if (runner.sharding().on() || p.tensor_dim >= 0) {  // FSDP or tensor parallelism: a part
      const std::vector<char> mine = runner.local_part(p, host.data(), sizeof(float));
      host.assign(reinterpret_cast<const float*>(mine.data()),
                  reinterpret_cast<const float*>(mine.data() + mine.size()));
    }
    if (p.layout == WeightLayout::q8) {  // int8 from the start: quantized as it is read
      runner.set_q8_from_declared(p, std::move(host));
    } else if (p.value.dtype() == DType::f32) {
      be.copy_from_host(p.value, host.data());
    } else {  // the backend's rounding, as every other cast to the weight dtype
      Tensor t = be.empty(p.value.shape(), DType::f32);
      be.copy_from_host(t, host.data());
      be.cast(t, p.value);
    }
  }
  // The temporaries' blocks (an f32 copy of each parameter held narrower, of as many sizes as
  // the parameters have) back to the system: nothing asks for those sizes again, and cached
  // they stayed in the process's memory (218 MiB of llama-bench-1b's bf16 decode, above its
  // plan when decode then transposed the projections).
  be.release_cached_memory();
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
    if (dot == std::string::npos)
      top[k] = v;
    else
      nested[k.substr(0, dot)][k.substr(dot + 1)] = v;
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

  write_hf_tensors(dir / "model.safetensors", runner);
}

void write_hf_tensors(const fs::path& file, ModelRunner& runner) {
  Backend& be = runner.backend();
  // Host f32 copies in Hugging Face's layout, then each converted to the parameter's dtype.
  std::vector<std::pair<std::string, Tensor>> out;
  auto emit = [&](const std::string& name, const Shape& shape, const std::vector<float>& host,
                  DType dt) {
    Tensor t = be.empty(shape, DType::f32);
    be.copy_from_host(t, host.data());
    if (dt != DType::f32) {
      Tensor c = be.empty(shape, dt);
      be.cast(t, c);
      t = c;
    }
    out.emplace_back(name, t);
  };
  auto to_host = [&](const Tensor& v) {
    Tensor f = be.empty(v.shape(), DType::f32);
    be.cast(v, f);
    std::vector<float> host(static_cast<size_t>(f.numel()));
    be.copy_to_host(f, host.data());
    return host;
  };
  // Fused tensors: their columns (mt orientation) gathered from every parameter mapped there.
  struct Fused {
    int64_t rows = -1, cols = 0;
    bool transposed = false;
    DType dtype = DType::f32;
    std::vector<std::pair<int64_t, int64_t>> ranges;
    std::vector<std::pair<int64_t, std::vector<float>>> parts;  // (begin, [rows, width])
  };
  std::map<std::string, Fused> fused;
  for (auto& p : runner.params()) {
    if (p.name.rfind("mtp.", 0) == 0) continue;  // not exported: transformers has no MTP modules
    const Model::HfName hf = runner.model().hf_name(p.name);
    if (hf.name.empty() && hf.stack.empty())
      throw Error("The model family has no Hugging Face name for parameter '" + p.name + "'.");
    const Shape& s = p.spec.shape;
    const DType dt = p.value.dtype();
    if (!hf.transposed && hf.stack.empty() && hf.slice_end == 0) {
      out.emplace_back(hf.name, p.value);
      continue;
    }
    std::vector<float> host = to_host(p.value);
    auto oriented = [&](std::vector<float> m, const Shape& ms) {  // mt [r, c] -> HF layout
      return hf.transposed ? transpose(m, ms[0], ms[1]) : m;
    };
    auto hf_shape = [&](const Shape& ms) { return hf.transposed ? Shape{ms[1], ms[0]} : ms; };
    if (!hf.stack.empty()) {
      MT_CHECK(!s.empty() && s[0] == static_cast<int64_t>(hf.stack.size()),
               "parameter " + p.name + " " + shape_str(s) + " stacked from " +
                   std::to_string(hf.stack.size()) + " tensors");
      const Shape part(s.begin() + 1, s.end());
      const int64_t n = shape_numel(part);
      for (size_t e = 0; e < hf.stack.size(); ++e) {
        std::vector<float> one(host.begin() + static_cast<int64_t>(e) * n,
                               host.begin() + static_cast<int64_t>(e + 1) * n);
        emit(hf.stack[e], hf_shape(part), oriented(std::move(one), part), dt);
      }
    } else if (hf.slice_end > 0) {
      MT_CHECK((s.size() == 2 || (s.size() == 1 && !hf.transposed)) &&
                   hf.slice_end - hf.slice_begin == s.back(),
               "parameter " + p.name + " " + shape_str(s) + " as a column slice");
      Fused& f = fused[hf.name];
      const int64_t rows = s.size() == 2 ? s[0] : 0;  // 0: a vector (a fused bias)
      MT_CHECK(f.rows < 0 || (f.rows == rows && f.transposed == hf.transposed),
               "parameters fused into " + hf.name + " disagree on rows or layout");
      f.rows = rows;
      f.transposed = hf.transposed;
      f.dtype = dt;
      f.cols = std::max(f.cols, hf.slice_end);
      f.ranges.emplace_back(hf.slice_begin, hf.slice_end);
      f.parts.emplace_back(hf.slice_begin, std::move(host));
    } else {
      emit(hf.name, hf_shape(s), oriented(std::move(host), s), dt);
    }
  }
  for (auto& [name, f] : fused) {
    // Every column exactly once, or the file would hold numbers no parameter wrote.
    std::sort(f.ranges.begin(), f.ranges.end());
    int64_t next = 0;
    for (const auto& [b, e] : f.ranges) {
      if (b != next)
        throw Error("The parameters mapped into Hugging Face tensor '" + name +
                    "' do not cover its columns exactly once (gap or overlap at column " +
                    std::to_string(std::min(b, next)) + ").");
      next = e;
    }
    const int64_t rows = std::max<int64_t>(f.rows, 1);
    std::vector<float> all(static_cast<size_t>(rows * f.cols));
    for (const auto& [b, part] : f.parts) {
      const int64_t width = static_cast<int64_t>(part.size()) / rows;
      for (int64_t r = 0; r < rows; ++r)
        std::copy_n(part.begin() + r * width, width, all.begin() + r * f.cols + b);
    }
    const Shape ms = f.rows == 0 ? Shape{f.cols} : Shape{f.rows, f.cols};
    emit(name, f.transposed ? Shape{f.cols, f.rows} : ms,
         f.transposed ? transpose(all, f.rows, f.cols) : all, f.dtype);
  }
  save_tensors(file, out, {{"format", "pt"}});
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
