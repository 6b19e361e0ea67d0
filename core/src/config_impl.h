// The representation behind mt::Config (core-private).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "mt/config.h"

namespace mt {

enum class ValueType : uint8_t { null_, int_, float_, bool_, string, list };
const char* value_type_name(ValueType t);

struct ConfigValue {
  ValueType type = ValueType::null_;
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;                  // strings; also the value's text as written
  std::vector<std::string> list;  // list of scalars as text
  std::string origin;             // "configs/base.yml:12", "command line"
};

struct Config::Impl {
  std::vector<std::string> order;
  std::map<std::string, ConfigValue> values;
  // Each schema key's section in its file ("Model", ...), and the keys read through the typed
  // getters since the last reset, shared by the copies of a Config (a family may copy it).
  std::map<std::string, std::string> sections;
  std::map<std::string, std::string> defaults;  // the default's YAML text
  struct Reads {
    std::mutex m;
    std::set<std::string> keys;
  };
  std::shared_ptr<Reads> reads = std::make_shared<Reads>();

  void set(const std::string& key, ConfigValue v) {
    if (!values.count(key)) order.push_back(key);
    values[key] = std::move(v);
  }
  const ConfigValue& at(const std::string& key) const;
};

// A value as YAML in flow style that reads back as the same type: floats always carry a '.' or an
// exponent (1.0, not 1), strings that would read as another type are quoted ("true", "3").
std::string config_value_yaml(const ConfigValue& v);

// How messages say where a value was set: "set at configs/base.yml:12", or "set on the command
// line" (plus any suffix such as " (--model)") for origins that start with "command line".
std::string config_set_where(const std::string& origin);

// Builds a Config from key=value pairs (tests, tools): values are typed as YAML scalars.
// Model keys (base.yml's "Model" and "Multi-head latent attention" sections, less those the
// core itself reads: dtypes, attention kernel, remat, init) whose value is not the default and
// which nothing has read since reset_config_reads(): keys the model family does not implement.
void reset_config_reads(const Config& c);
std::vector<std::string> unread_model_keys(const Config& c);
// The keys of base.yml's model sections that the core reads, not the family: choices of a run
// (dtypes, the attention kernel, matmul precision, remat, vocab tiling, the initialisation),
// which a resumed run or an inference of a checkpoint may set otherwise.
const std::set<std::string>& core_model_keys();

Config config_from_pairs(const std::vector<std::pair<std::string, std::string>>& kv,
                         const std::string& origin = "code");

}  // namespace mt
