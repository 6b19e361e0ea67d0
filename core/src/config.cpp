#include <sched.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <mutex>
#include <set>
#include <thread>

#include "config_impl.h"
#include "mt/error.h"

namespace mt {

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::null_:
      return "null";
    case ValueType::int_:
      return "integer";
    case ValueType::float_:
      return "number";
    case ValueType::bool_:
      return "boolean";
    case ValueType::string:
      return "string";
    case ValueType::list:
      return "list";
  }
  return "?";
}

Config::Config() : impl_(std::make_unique<Impl>()) {}
Config::~Config() = default;
Config::Config(const Config& o) : impl_(std::make_unique<Impl>(*o.impl_)) {}
Config& Config::operator=(const Config& o) {
  if (this != &o) impl_ = std::make_unique<Impl>(*o.impl_);
  return *this;
}
Config::Config(Config&&) noexcept = default;
Config& Config::operator=(Config&&) noexcept = default;

const ConfigValue& Config::Impl::at(const std::string& key) const {
  auto it = values.find(key);
  // Every key a user can set is declared (the loader refuses others), so this is code asking
  // for a key no schema declares: mt's or a plugin's bug, not the user's config (exit 1).
  if (it == values.end())
    throw Error("The config has no key '" + key +
                "': code asked for a key that neither base.yml nor the model family's "
                "config_schema() declares (a plugin reading a misspelled or undeclared key?).");
  {
    std::lock_guard<std::mutex> lock(reads->m);
    reads->keys.insert(key);
  }
  return it->second;
}

void reset_config_reads(const Config& c) {
  auto& r = *c.impl().reads;
  std::lock_guard<std::mutex> lock(r.m);
  r.keys.clear();
}

const std::set<std::string>& core_model_keys() {
  // Read by the core (ModelRunner, the kernels), not by the family.
  // (logits_via_embedding is the family's: one that does not tie its head must not take it.)
  static const std::set<std::string> kCore = {"attention",        "dtype",
                                              "weight_dtype",     "matmul_precision",
                                              "remat_policy",     "num_vocab_tiling",
                                              "init_weights_seed"};
  return kCore;
}

std::vector<std::string> unread_model_keys(const Config& c) {
  const std::set<std::string>& kCore = core_model_keys();
  const Config::Impl& im = c.impl();
  std::set<std::string> read;
  {
    std::lock_guard<std::mutex> lock(im.reads->m);
    read = im.reads->keys;
  }
  std::vector<std::string> out;
  for (const auto& key : im.order) {
    auto sec = im.sections.find(key);
    auto def = im.defaults.find(key);
    if (sec == im.sections.end() || def == im.defaults.end()) continue;
    if (sec->second != "Model" && sec->second != "Multi-head latent attention (DeepSeek)") continue;
    if (kCore.count(key) || read.count(key)) continue;
    if (config_value_yaml(im.values.at(key)) == def->second) continue;
    out.push_back(key);
  }
  return out;
}

bool Config::has(const std::string& key) const {
  return impl_->values.count(key) != 0;
}

namespace {
[[noreturn]] void wrong_type(const std::string& key, const ConfigValue& v, const char* want) {
  throw UsageError(key + "=" + v.s + " (" + config_set_where(v.origin) + ") must be " + want +
                   ", not a " + value_type_name(v.type) + ".");
}
}  // namespace

int64_t Config::get_int(const std::string& key) const {
  const auto& v = impl_->at(key);
  if (v.type != ValueType::int_) wrong_type(key, v, "an integer");
  return v.i;
}
double Config::get_float(const std::string& key) const {
  const auto& v = impl_->at(key);
  if (v.type == ValueType::int_) return static_cast<double>(v.i);
  if (v.type != ValueType::float_) wrong_type(key, v, "a number");
  return v.f;
}
bool Config::get_bool(const std::string& key) const {
  const auto& v = impl_->at(key);
  if (v.type != ValueType::bool_) wrong_type(key, v, "true or false");
  return v.b;
}
std::string Config::get_string(const std::string& key) const {
  const auto& v = impl_->at(key);
  if (v.type == ValueType::null_) return "";
  if (v.type == ValueType::list) wrong_type(key, v, "a single value");
  return v.s;
}
std::vector<std::string> Config::get_string_list(const std::string& key) const {
  const auto& v = impl_->at(key);
  if (v.type == ValueType::null_) return {};
  if (v.type != ValueType::list) return {v.s};
  return v.list;
}
std::string Config::origin(const std::string& key) const {
  return impl_->at(key).origin;
}
std::vector<std::string> Config::keys() const {
  return impl_->order;
}

void Config::reject(const std::string& key, const std::string& reason) const {
  const auto& v = impl_->at(key);
  throw UsageError(key + "=" + v.s + " (" + config_set_where(v.origin) + ") " + reason);
}

std::string config_set_where(const std::string& origin) {
  if (origin.rfind("command line", 0) == 0) return "set on the " + origin;
  if (origin.rfind("environment", 0) == 0) return "set by the " + origin;
  return "set at " + origin;
}

namespace {

// Shortest text that reads back as the same double, always recognisable as a float.
std::string float_text(double f) {
  if (std::isnan(f)) return ".nan";
  if (std::isinf(f)) return f > 0 ? ".inf" : "-.inf";
  // Plain decimals for everyday magnitudes (500000.0, 0.0003), exponents beyond (1.0e-05).
  const double mag = std::fabs(f);
  const auto fmt = mag == 0 || (mag >= 1e-4 && mag < 1e16) ? std::chars_format::fixed
                                                           : std::chars_format::scientific;
  char buf[400];
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, f, fmt);
  std::string s(buf, ec == std::errc() ? end : buf);
  if (s.find_first_of(".en") == std::string::npos) return s + ".0";
  if (const size_t e = s.find('e'); e != std::string::npos && s.find('.') == std::string::npos)
    s.insert(e, ".0");  // 1e-05 -> 1.0e-05, a float to every YAML reader
  return s;
}

// Would this plain text read as something other than a string (a number, bool or null)?
bool looks_typed(const std::string& s) {
  if (s.empty()) return true;
  static const char* const kWords[] = {"true", "True", "TRUE", "false", "False", "FALSE",
                                       "null", "Null", "NULL", "~",     "yes",   "no",
                                       "on",   "off",  "Yes",  "No",    "On",    "Off"};
  for (const char* w : kWords)
    if (s == w) return true;
  double d;
  const char* b = s.data() + (s[0] == '+' || s[0] == '-' ? 1 : 0);
  auto [p, ec] = std::from_chars(b, s.data() + s.size(), d);
  if (ec == std::errc() && p == s.data() + s.size()) return true;
  return s[0] == '.' && s.size() > 1;  // .inf, .nan, .5
}

void emit_string(YAML::Emitter& e, const std::string& s) {
  if (looks_typed(s)) e << YAML::DoubleQuoted;
  e << s;
}

}  // namespace

std::string config_value_yaml(const ConfigValue& v) {
  YAML::Emitter e;
  e << YAML::Flow;
  switch (v.type) {
    case ValueType::null_:
      e << YAML::Null;
      break;
    case ValueType::int_:
      e << v.i;
      break;
    case ValueType::float_:
      return float_text(v.f);
    case ValueType::bool_:
      e << v.b;
      break;
    case ValueType::string:
      emit_string(e, v.s);
      break;
    case ValueType::list:
      e << YAML::BeginSeq;
      for (const auto& x : v.list) emit_string(e, x);
      e << YAML::EndSeq;
      break;
  }
  return e.c_str();
}

std::string Config::to_yaml(bool with_origins) const {
  std::string out;
  for (const auto& k : impl_->order) {
    const auto& v = impl_->values.at(k);
    std::string line = k + ": " + config_value_yaml(v);
    if (with_origins) {
      // Origins line up in one column where the values are short enough.
      line.resize(std::max<size_t>(line.size() + 2, 48), ' ');
      line += "# " + v.origin;
    }
    out += line + "\n";
  }
  return out;
}

Config config_from_pairs(const std::vector<std::pair<std::string, std::string>>& kv,
                         const std::string& origin) {
  Config c;
  for (const auto& [k, text] : kv) {
    ConfigValue v;
    v.s = text;
    v.origin = origin;
    YAML::Node n = YAML::Load(text);
    if (n.IsNull()) {
      v.type = ValueType::null_;
    } else if (n.IsSequence()) {
      v.type = ValueType::list;
      for (const auto& e : n) v.list.push_back(e.as<std::string>());
    } else {
      int64_t i;
      double f;
      bool b;
      if (YAML::convert<int64_t>::decode(n, i)) {
        v.type = ValueType::int_;
        v.i = i;
      } else if (YAML::convert<double>::decode(n, f)) {
        v.type = ValueType::float_;
        v.f = f;
      } else if (YAML::convert<bool>::decode(n, b)) {
        v.type = ValueType::bool_;
        v.b = b;
      } else {
        v.type = ValueType::string;
        v.s = n.as<std::string>();
      }
    }
    c.impl().set(k, std::move(v));
  }
  return c;
}

int cpu_threads(const Config& cfg) {
  // (Configs from files are bounded by base.yml's [0..4096]; a config built in code is too.)
  const int64_t want = cfg.has("num_threads") ? cfg.get_int("num_threads") : 0;
  int n = want > 0 && want <= 4096 ? static_cast<int>(want) : 0;
  if (n <= 0) {
    // hardware_concurrency counts the machine's cores, not those this process may use.
    cpu_set_t set;
    CPU_ZERO(&set);
    n = sched_getaffinity(0, sizeof set, &set) == 0
            ? CPU_COUNT(&set)
            : static_cast<int>(std::thread::hardware_concurrency());
  }
  return n > 0 ? n : 1;
}

}  // namespace mt
