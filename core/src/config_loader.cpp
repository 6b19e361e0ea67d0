#include "config_loader.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "file_util.h"
#include "mt/error.h"

namespace mt {

namespace fs = std::filesystem;

namespace {

struct LayerFile;
// The keys a file (or text) in base.yml's format declares, in order.
std::vector<KeySpec> schema_of(const LayerFile& f);

// ---- Small text helpers -------------------------------------------------------------------------

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

// Whole-string integer: optional sign, decimal digits only (no hex or octal surprises).
std::optional<int64_t> parse_int(std::string_view s) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  if (s.empty()) return std::nullopt;
  int64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size()) return std::nullopt;
  return v;
}

// Digits with an optional sign: what parse_int refuses only when it overflows.
bool integer_syntax(std::string_view s) {
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) s.remove_prefix(1);
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// Whole-string finite number: configs never want inf or nan, and accepting them would let a
// typo pass as a value.
std::optional<double> parse_float(std::string_view s) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  if (s.empty()) return std::nullopt;
  double v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

// YAML 1.2 core-schema booleans only: "yes"/"on" are strings, as in every modern YAML reader.
std::optional<bool> parse_bool(std::string_view s) {
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  return std::nullopt;
}

std::string flow_text(const YAML::Node& n) {
  YAML::Emitter e;
  e << YAML::Flow << n;
  return e.c_str();
}

// How a value is shown in messages: the scalar as written, or a container in flow style.
std::string node_text(const YAML::Node& n) {
  if (!n.IsDefined() || n.IsNull()) return "";
  if (n.IsScalar()) return n.Scalar();
  return flow_text(n);
}

const char* node_kind(const YAML::Node& n) {
  if (n.IsNull()) return "empty";
  if (n.IsSequence()) return "a list";
  if (n.IsMap()) return "a mapping";
  return "a string";
}

// ---- Files --------------------------------------------------------------------------------------

// How a file is named in origins: relative to the configs dir's parent when it lies inside the
// configs dir ("configs/models/llama2-7b.yml"), else as given.
std::string display_path(const fs::path& p, const fs::path& configs_dir) {
  std::error_code ec1, ec2;
  const fs::path file = fs::weakly_canonical(p, ec1);
  const fs::path dir = fs::weakly_canonical(configs_dir, ec2);
  if (!ec1 && !ec2 && !dir.empty()) {
    const fs::path rel = file.lexically_relative(dir);
    if (!rel.empty() && *rel.begin() != "..") return (dir.filename() / rel).generic_string();
  }
  return p.generic_string();
}

struct Entry {
  std::string key;
  YAML::Node value;
  int line = 0;  // 1-based
};

struct LayerFile {
  std::string shown;  // display path
  std::vector<std::string> lines;
  std::vector<Entry> entries;
  std::string origin(int line) const { return fmt::format("{}:{}", shown, line); }
};

// Parses one config file's text: a flat mapping of key: value lines (an empty file is an empty
// mapping). Refuses malformed YAML with file:line:column, and a key set twice in the same file
// (yaml-cpp would silently keep both).
LayerFile parse_layer(const std::string& text, const std::string& shown) {
  LayerFile f;
  f.shown = shown;
  {
    std::istringstream ls(text);
    for (std::string l; std::getline(ls, l);) f.lines.push_back(l);
  }
  YAML::Node root;
  try {
    // Every document: a second one ("---") would otherwise be dropped without a word.
    const std::vector<YAML::Node> docs = YAML::LoadAll(text);
    if (docs.size() > 1)
      throw UsageError(fmt::format(
          "{} holds {} YAML documents (separated by ---); a config file is one mapping of `key: "
          "value` lines, and the documents after the first would be ignored. Merge them.",
          shown, docs.size()));
    if (!docs.empty()) root = docs[0];
  } catch (const YAML::Exception& e) {
    const std::string where =
        e.mark.is_null() ? shown
                         : fmt::format("{}:{}:{}", shown, e.mark.line + 1, e.mark.column + 1);
    throw UsageError(fmt::format(
        "{}: malformed YAML: {}. A config file is a YAML mapping of `key: value` lines.", where,
        e.msg));
  }
  if (!root.IsDefined() || root.IsNull()) return f;
  if (!root.IsMap()) {
    throw UsageError(fmt::format(
        "{} is not a YAML mapping of `key: value` lines: its top level is {}.", shown,
        root.IsSequence() ? "a list" : fmt::format("the single value '{}'", node_text(root))));
  }
  std::map<std::string, int> first_line;
  for (const auto& kv : root) {
    const int line = kv.first.Mark().line + 1;
    if (!kv.first.IsScalar()) {
      throw UsageError(fmt::format("{}:{}: a config key must be a plain name, not {}.", shown, line,
                                   node_kind(kv.first)));
    }
    const std::string key = kv.first.Scalar();
    if (auto [it, fresh] = first_line.emplace(key, line); !fresh) {
      throw UsageError(
          fmt::format("{}:{}: the key '{}' is set twice in this file (first at line {}).", shown,
                      line, key, it->second));
    }
    f.entries.push_back({key, kv.second, line});
  }
  return f;
}

LayerFile read_layer(const fs::path& path, const std::string& shown) {
  // Bounded and regular files only: a FIFO or /dev/zero named as --config must not hang.
  return parse_layer(read_file(path.string(), "config", kMaxConfigFileBytes), shown);
}

// The comment of a YAML line: from the first '#' that is outside quotes and starts the line or
// follows a space ("a#b" is a plain scalar in YAML, not a comment). A quote opens a quoted scalar
// only where a value starts (I'm in a plain scalar is just an apostrophe).
std::string line_comment(const std::string& line) {
  char quote = 0;
  char prev = ':';  // last non-space character outside quotes
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quote) {
      if (c == '\\' && quote == '"') {
        ++i;
      } else if (c == quote) {
        quote = 0;
        prev = c;
      }
      continue;
    }
    if ((c == '"' || c == '\'') && (prev == ':' || prev == '[' || prev == ',' || prev == '-')) {
      quote = c;
    } else if (c == '#' && (i == 0 || line[i - 1] == ' ' || line[i - 1] == '\t')) {
      return trim(std::string_view(line).substr(i + 1));
    } else if (c != ' ' && c != '\t') {
      prev = c;
    }
  }
  return "";
}

// ---- Schema -------------------------------------------------------------------------------------

ValueType infer_type(const YAML::Node& n) {
  if (n.IsSequence()) return ValueType::list;
  if (!n.IsScalar()) return ValueType::null_;
  if (n.Tag() == "!") return ValueType::string;  // quoted
  const std::string& s = n.Scalar();
  if (parse_int(s)) return ValueType::int_;
  if (parse_float(s)) return ValueType::float_;
  if (parse_bool(s)) return ValueType::bool_;
  return ValueType::string;
}

// Bounds are shown as written in annotations: 0, 1, -1, 0.5.
std::string format_bound(double v) {
  return fmt::format("{}", v);
}

// Parses the annotation's text (without brackets) into the spec; returns "" or what is wrong.
std::string parse_annotation(const std::string& text, KeySpec& spec) {
  const bool numeric = spec.type == ValueType::int_ || spec.type == ValueType::float_;
  if (text.rfind("choices:", 0) == 0) {
    if (spec.type != ValueType::string && spec.type != ValueType::list)
      return "choices apply only to string and list keys";
    std::string rest = text.substr(8);
    size_t start = 0;
    while (true) {
      const size_t bar = rest.find('|', start);
      const std::string c = trim(rest.substr(start, bar == std::string::npos ? bar : bar - start));
      if (c.empty()) return "an empty choice";
      spec.choices.push_back(c == "\"\"" ? std::string() : c);  // "": the empty string
      if (bar == std::string::npos) break;
      start = bar + 1;
    }
    return "";
  }
  if (!numeric) return "bounds apply only to integer and float keys";
  if (const size_t dots = text.find(".."); dots != std::string::npos) {
    // A..B inclusive; A<..B leaves A out, A..<B leaves B out.
    std::string lo_text = trim(text.substr(0, dots)), hi_text = trim(text.substr(dots + 2));
    const bool lo_open = !lo_text.empty() && lo_text.back() == '<';
    const bool hi_open = !hi_text.empty() && hi_text.front() == '<';
    if (lo_open) lo_text.pop_back();
    if (hi_open) hi_text.erase(0, 1);
    auto lo = parse_float(trim(lo_text));
    auto hi = parse_float(trim(hi_text));
    if (!lo || !hi || *lo > *hi) return "expected a range such as 0..1, 0<..1 or 0..<1";
    spec.min = lo;
    spec.max = hi;
    spec.min_exclusive = lo_open;
    spec.max_exclusive = hi_open;
    return "";
  }
  for (const char* op : {">=", "<=", ">", "<"}) {
    const std::string o = op;
    if (text.rfind(o, 0) != 0) continue;
    auto v = parse_float(trim(text.substr(o.size())));
    if (!v) return "expected a number after " + o;
    if (o[0] == '>') {
      spec.min = v;
      spec.min_exclusive = o.size() == 1;
    } else {
      spec.max = v;
      spec.max_exclusive = o.size() == 1;
    }
    return "";
  }
  return "expected [>N], [>=N], [<N], [<=N], [A..B] (A<..B, A..<B: without the bound) or "
         "[choices: a|b|c]";
}

// ---- Suggestions --------------------------------------------------------------------------------

// Optimal string alignment distance: insertions, deletions, substitutions and transpositions of
// neighbours (the commonest typo) each cost 1.
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i) {
    for (size_t j = 1; j <= m; ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[n][m];
}

std::string normalize_key(std::string s) {
  for (auto& ch : s) {
    ch = ch == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  return s;
}

// "learning_rate" -> "lr"
std::string initials(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] != '_' && (i == 0 || s[i - 1] == '_')) out += s[i];
  return out;
}

std::vector<std::string> words(const std::string& s) {
  std::vector<std::string> out;
  std::string w;
  std::istringstream in(s);
  while (std::getline(in, w, '_'))
    if (!w.empty()) out.push_back(w);
  return out;
}

// The best candidate and its score in half edits (lower is better). A near-typo (one or two
// edits) wins; then a key that contains what was typed ("batch_size" -> "per_device_batch_size"),
// holds all its words ("num_layers" -> "base_num_decoder_layers") or has it as initials ("lr" ->
// "learning_rate"), which beats an unrelated key three edits away.
std::pair<std::string, size_t> nearest(const std::string& key,
                                       const std::vector<std::string>& candidates) {
  const std::string k = normalize_key(key);
  const std::vector<std::string> kw = words(k);
  std::string best;
  size_t best_score = SIZE_MAX;
  for (const auto& c : candidates) {
    const std::string cn = normalize_key(c);
    size_t score = 2 * edit_distance(k, cn);
    if (score > 4) {
      const std::vector<std::string> cw = words(cn);
      const bool all_words =
          !kw.empty() && std::all_of(kw.begin(), kw.end(), [&](const std::string& w) {
            return std::find(cw.begin(), cw.end(), w) != cw.end();
          });
      if ((k.size() >= 3 && cn.find(k) != std::string::npos) || all_words ||
          (k.size() >= 2 && initials(cn) == k)) {
        score = 5;
      }
    }
    // Ties go to the shorter candidate: "dtyp" means "dtype" more than "weight_dtype".
    if (score < best_score || (score == best_score && c.size() < best.size())) {
      best_score = score;
      best = c;
    }
  }
  return {best, best_score};
}

// " Did you mean 'x'?" when some candidate is plausibly what was meant, else "".
std::string suggest(const std::string& key, const std::vector<std::string>& candidates) {
  const auto [best, score] = nearest(key, candidates);
  if (best.empty() || score > 2 * std::max<size_t>(3, key.size() / 3)) return "";
  return fmt::format(" Did you mean '{}'?", best);
}

// ---- Values -------------------------------------------------------------------------------------

std::string where(const std::string& origin) {
  return config_set_where(origin);
}

const char* type_phrase(ValueType t) {
  switch (t) {
    case ValueType::int_:
      return "an integer";
    case ValueType::float_:
      return "a number";
    case ValueType::bool_:
      return "true or false";
    case ValueType::list:
      return "a list such as [a, b]";
    case ValueType::string:
      return "a single value";
    case ValueType::null_:
      break;
  }
  return "a value";
}

struct Schema {
  std::string base_shown;            // "configs/base.yml"
  std::vector<std::string> plugins;  // how the plugins' schema files and texts are shown
  std::vector<KeySpec> specs;
  std::map<std::string, size_t> index;
  std::vector<std::string> names;

  const KeySpec* find(const std::string& key) const {
    auto it = index.find(key);
    return it == index.end() ? nullptr : &specs[it->second];
  }
};

std::string default_text(const KeySpec& spec) {
  return config_value_yaml(spec.default_value);
}

[[noreturn]] void wrong_type(const KeySpec& spec, const std::string& text,
                             const std::string& origin, const std::string& what_it_is) {
  throw UsageError(fmt::format("{}={} ({}) must be {}, not {}; its default is {} ({}).", spec.name,
                               text, where(origin), type_phrase(spec.type), what_it_is,
                               default_text(spec), spec.default_value.origin));
}

// Converts a parsed YAML value to the key's type. `text` is the value as the user wrote it.
ConfigValue make_value(const KeySpec& spec, const YAML::Node& n, const std::string& text,
                       const std::string& origin) {
  ConfigValue v;
  v.type = spec.type;
  v.s = text;
  v.origin = origin;
  if (n.IsMap()) wrong_type(spec, text, origin, "a mapping");
  if (n.IsSequence()) {
    if (spec.type != ValueType::list) wrong_type(spec, text, origin, "a list");
    for (const auto& e : n) {
      if (!e.IsScalar())
        wrong_type(spec, text, origin, "a list holding " + std::string(node_kind(e)));
      v.list.push_back(e.Scalar());
    }
    return v;
  }
  if (!n.IsDefined() || n.IsNull()) {
    if (spec.type == ValueType::string) {
      v.s.clear();
      return v;
    }
    if (spec.type == ValueType::list) return v;
    wrong_type(spec, text, origin, "empty");
  }
  const std::string& s = n.Scalar();
  const bool quoted = n.Tag() == "!";
  // What a scalar that is no number is, for the integer and number keys' refusals.
  const auto not_a_number = [&] {
    return std::string(!quoted && parse_bool(s) ? "true or false" : "a string");
  };
  switch (spec.type) {
    case ValueType::int_: {
      auto i = quoted ? std::nullopt : parse_int(s);
      if (!i) {
        wrong_type(spec, text, origin,
                   !quoted && integer_syntax(s) ? "an integer beyond the 64-bit range (at most "
                                                  "9223372036854775807)"
                   : !quoted && parse_float(s)
                       ? (*parse_float(s) == std::trunc(*parse_float(s)) &&
                                  std::fabs(*parse_float(s)) < 9.2e18
                              ? fmt::format("a number in floating-point form (write it as {:.0f})",
                                            *parse_float(s))
                              : std::string("a fractional number"))
                       : not_a_number());
      }
      v.i = *i;
      return v;
    }
    case ValueType::float_: {
      auto f = quoted ? std::nullopt : parse_float(s);
      if (!f) wrong_type(spec, text, origin, not_a_number());
      v.f = *f;
      return v;
    }
    case ValueType::bool_: {
      auto b = quoted ? std::nullopt : parse_bool(s);
      if (!b) wrong_type(spec, text, origin, parse_float(s) ? "a number" : "a string");
      v.b = *b;
      return v;
    }
    case ValueType::list:
      // A single value is a one-element list, so `plugin_dirs=/opt/p` needs no brackets.
      if (!s.empty() || !quoted) v.list.push_back(s);
      return v;
    case ValueType::string:
    case ValueType::null_:
      v.type = ValueType::string;
      v.s = s;
      return v;
  }
  return v;
}

// The first key set in the layers that no schema declares.
struct Unknown {
  std::string key, origin;
};

// Refuses an unknown key once every layer is applied, so that the message can say which family
// the final decoder_block names (a family's own keys exist only when it is named).
[[noreturn]] void unknown_key(const Schema& schema, const Unknown& u, const Config& c) {
  // Keys mt once had: what became of them (a run directory's config.yml from then holds them).
  if (u.key == "init_weights_stddev")
    throw UnknownKeyError(fmt::format(
        "init_weights_stddev ({}) is no longer a key: nothing ever read it (each family draws each "
        "parameter with its own initialiser, as MaxText does, and init_weights_seed chooses the "
        "draw), so a value set there was ignored. Delete the line; a config.yml that an older mt "
        "wrote into a run directory holds it with its default, 0.02.",
        where(u.origin)));
  std::string listed = schema.base_shown;
  for (const auto& p : schema.plugins) listed += ", " + p;
  std::string family;
  if (c.has("decoder_block")) {
    const auto& v = c.impl().at("decoder_block");
    family = fmt::format(
        " A model family's own keys exist only when decoder_block names that family (here "
        "decoder_block={}, {}).",
        v.s, where(v.origin));
  }
  throw UnknownKeyError(fmt::format(
      "Unknown config key '{}' ({}).{} Every key is listed with its default and meaning in {}.{}",
      u.key, where(u.origin), suggest(u.key, schema.names), listed, family));
}

void apply_layer(Config& c, const Schema& schema, const LayerFile& f,
                 std::optional<Unknown>& unknown) {
  for (const auto& e : f.entries) {
    const KeySpec* spec = schema.find(e.key);
    if (!spec) {
      if (!unknown) unknown = Unknown{e.key, f.origin(e.line)};
      continue;
    }
    c.impl().set(e.key, make_value(*spec, e.value, node_text(e.value), f.origin(e.line)));
  }
}

struct Override {
  std::string key, text, arg;
};

Override split_override(const std::string& arg) {
  std::string a = arg;
  if (a.rfind("--", 0) == 0) a = a.substr(2);
  const size_t eq = a.find('=');
  if (eq == std::string::npos || trim(a.substr(0, eq)).empty()) {
    throw UsageError(fmt::format(
        "The command-line argument '{}' is not a config override: overrides are written "
        "key=value (or --key=value), for example steps=100.",
        arg));
  }
  return {trim(a.substr(0, eq)), a.substr(eq + 1), arg};
}

ConfigValue override_value(const KeySpec& spec, const Override& o, const std::string& origin) {
  // A string key takes the text verbatim (a prompt may hold '#' or ': '), unless it is quoted.
  const bool quoted = !o.text.empty() && (o.text[0] == '"' || o.text[0] == '\'');
  if (spec.type == ValueType::string && !quoted) {
    ConfigValue v;
    v.type = ValueType::string;
    v.s = o.text;
    v.origin = origin;
    return v;
  }
  YAML::Node n;
  try {
    n = YAML::Load(o.text);
  } catch (const YAML::Exception& e) {
    throw UsageError(
        fmt::format("The command-line override '{}' is not valid YAML: {}.", o.arg, e.msg));
  }
  return make_value(spec, n, o.text, origin);
}

void check_constraint(const KeySpec& spec, const ConfigValue& v) {
  if (!spec.choices.empty()) {
    const bool is_list = v.type == ValueType::list;
    std::vector<std::string> shown = spec.choices;
    for (auto& c : shown)
      if (c.empty()) c = "\"\" (none)";
    for (const auto& x : is_list ? v.list : std::vector<std::string>{v.s}) {
      if (std::find(spec.choices.begin(), spec.choices.end(), x) != spec.choices.end()) continue;
      throw UsageError(fmt::format(
          "{}={} ({}) {} not one of the choices: {}.{}", spec.name, config_value_yaml(v),
          where(v.origin), is_list ? fmt::format("holds '{}', which is", x) : std::string("is"),
          join(shown, ", "), suggest(x, spec.choices)));
    }
    return;
  }
  if (!spec.min && !spec.max) return;
  const double x = v.type == ValueType::int_ ? static_cast<double>(v.i) : v.f;
  const bool low = spec.min && (spec.min_exclusive ? x <= *spec.min : x < *spec.min);
  const bool high = spec.max && (spec.max_exclusive ? x >= *spec.max : x > *spec.max);
  if (!low && !high) return;
  std::string rule;
  if (spec.min && spec.max && !spec.min_exclusive && !spec.max_exclusive) {
    rule = fmt::format("between {} and {} inclusive", format_bound(*spec.min),
                       format_bound(*spec.max));
  } else {
    std::vector<std::string> parts;
    if (spec.min)
      parts.push_back(
          fmt::format("{} {}", spec.min_exclusive ? ">" : ">=", format_bound(*spec.min)));
    if (spec.max)
      parts.push_back(
          fmt::format("{} {}", spec.max_exclusive ? "<" : "<=", format_bound(*spec.max)));
    rule = join(parts, " and ");
  }
  throw UsageError(fmt::format("{}={} ({}) is out of range: {} must be {} (see {}).", spec.name,
                               v.s, where(v.origin), spec.name, rule, spec.default_value.origin));
}

// Rules that involve several keys.
void check_combinations(const Config& c) {
  auto shown = [&](const std::string& k) {
    const auto& v = c.impl().at(k);
    return fmt::format("{}={} ({})", k, v.s, where(v.origin));
  };
  auto has = [&](std::initializer_list<const char*> keys) {
    return std::all_of(keys.begin(), keys.end(), [&](const char* k) { return c.has(k); });
  };
  if (has({"base_num_query_heads", "base_num_kv_heads"}) &&
      c.get_int("base_num_query_heads") % c.get_int("base_num_kv_heads") != 0) {
    throw UsageError(fmt::format(
        "{} must be a multiple of {}: each key/value head serves a whole group of query heads.",
        shown("base_num_query_heads"), shown("base_num_kv_heads")));
  }
  if (has({"num_experts", "num_experts_per_tok"}) &&
      c.get_int("num_experts_per_tok") > c.get_int("num_experts")) {
    throw UsageError(
        fmt::format("{} cannot exceed {}.", shown("num_experts_per_tok"), shown("num_experts")));
  }
  for (const char* k : {"eval_interval", "learning_rate_schedule_steps"}) {
    if (has({k}) && c.get_int(k) == 0) {
      throw UsageError(fmt::format("{} must be -1 ({}) or at least 1.", shown(k),
                                   std::string(k) == "eval_interval" ? "never" : "= steps"));
    }
  }
  if (has({"max_target_length", "max_position_embeddings"}) &&
      c.get_int("max_position_embeddings") > 0 &&
      c.get_int("max_target_length") > c.get_int("max_position_embeddings")) {
    throw UsageError(fmt::format(
        "{} is longer than the model supports: {}. Positions past it were never trained (and "
        "rotary tables stop there); lower max_target_length.",
        shown("max_target_length"), shown("max_position_embeddings")));
  }
  if (has({"decode_sampling_strategy", "decode_sampling_top_k"}) &&
      (c.get_string("decode_sampling_strategy") == "top_k" ||
       c.get_string("decode_sampling_strategy") == "topk") &&
      c.get_int("decode_sampling_top_k") < 1) {
    throw UsageError(fmt::format("{} must be at least 1 when {}.", shown("decode_sampling_top_k"),
                                 shown("decode_sampling_strategy")));
  }
}

Schema read_schema(const fs::path& configs_dir, const std::vector<fs::path>& schema_files,
                   const std::vector<SchemaText>& schema_texts) {
  const fs::path base = configs_dir / "base.yml";
  Schema s;
  s.base_shown = display_path(base, configs_dir);
  std::error_code ec;
  if (!fs::is_regular_file(base, ec)) {
    throw UsageError(fmt::format(
        "The configs directory {} has no base.yml (the shared keys and their defaults live "
        "there); is mt installed completely?",
        configs_dir.generic_string()));
  }
  s.specs = load_schema(base);
  for (const auto& f : schema_files) {
    if (!fs::is_regular_file(f, ec)) {
      throw UsageError(
          fmt::format("The config schema file {} does not exist.", f.generic_string()));
    }
    s.plugins.push_back(display_path(f, configs_dir));
    for (auto& spec : schema_of(read_layer(f, s.plugins.back())))
      s.specs.push_back(std::move(spec));
  }
  for (const auto& t : schema_texts) {
    s.plugins.push_back(t.shown);
    for (auto& spec : schema_of(parse_layer(t.yaml, t.shown))) s.specs.push_back(std::move(spec));
  }
  for (size_t i = 0; i < s.specs.size(); ++i) {
    const auto& spec = s.specs[i];
    if (auto [it, fresh] = s.index.emplace(spec.name, i); !fresh) {
      throw UsageError(fmt::format(
          "{} declares the config key '{}' again (first declared at {}). A plugin's schema may "
          "only add keys of its own (named after the plugin, e.g. tiny_residual_scale); keys that "
          "several model families share belong in configs/base.yml.",
          spec.default_value.origin, spec.name, s.specs[it->second].default_value.origin));
    }
    s.names.push_back(spec.name);
  }
  return s;
}

// Model names are file stems: refuse anything that could walk out of the model directories.
bool plausible_model_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name != "." && name != "..";
}

std::vector<fs::path> model_search_dirs(const fs::path& configs_dir,
                                        const std::vector<fs::path>& model_dirs) {
  std::vector<fs::path> dirs{configs_dir / "models"};
  dirs.insert(dirs.end(), model_dirs.begin(), model_dirs.end());
  return dirs;
}

// Natural order, so llama2-7b sorts before llama2-13b.
bool natural_less(const std::string& a, const std::string& b) {
  size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (std::isdigit(static_cast<unsigned char>(a[i])) &&
        std::isdigit(static_cast<unsigned char>(b[j]))) {
      size_t ie = i, je = j;
      while (ie < a.size() && std::isdigit(static_cast<unsigned char>(a[ie]))) ++ie;
      while (je < b.size() && std::isdigit(static_cast<unsigned char>(b[je]))) ++je;
      const std::string_view na = std::string_view(a).substr(i, ie - i);
      const std::string_view nb = std::string_view(b).substr(j, je - j);
      // Compare numerically without overflow: strip leading zeros, then by length, then digits.
      const std::string_view za = na.substr(std::min(na.find_first_not_of('0'), na.size()));
      const std::string_view zb = nb.substr(std::min(nb.find_first_not_of('0'), nb.size()));
      if (za.size() != zb.size()) return za.size() < zb.size();
      if (za != zb) return za < zb;
      i = ie;
      j = je;
    } else {
      if (a[i] != b[j]) return a[i] < b[j];
      ++i;
      ++j;
    }
  }
  return a.size() - i < b.size() - j;
}

}  // namespace

// ---- Public -------------------------------------------------------------------------------------

std::vector<KeySpec> load_schema(const fs::path& base_yml) {
  return schema_of(read_layer(base_yml, display_path(base_yml, base_yml.parent_path())));
}

namespace {

std::vector<KeySpec> schema_of(const LayerFile& f) {
  std::vector<KeySpec> specs;
  for (const auto& e : f.entries) {
    KeySpec spec;
    spec.name = e.key;
    spec.type = infer_type(e.value);
    if (spec.type == ValueType::null_) {
      throw UsageError(fmt::format(
          "{}: the default of '{}' must be a number, boolean, string or list (its type is the "
          "type of every value it accepts), not {}.",
          f.origin(e.line), e.key, node_kind(e.value)));
    }
    spec.default_value = make_value(spec, e.value, node_text(e.value), f.origin(e.line));
    std::string comment =
        e.line - 1 < static_cast<int>(f.lines.size()) ? line_comment(f.lines[e.line - 1]) : "";
    if (!comment.empty() && comment.back() == ']') {
      const size_t open = comment.rfind('[');
      if (open == std::string::npos) {
        throw UsageError(
            fmt::format("{}: the constraint of '{}' has no opening '['.", f.origin(e.line), e.key));
      }
      spec.constraint = trim(std::string_view(comment).substr(open + 1, comment.size() - open - 2));
      if (const std::string bad = parse_annotation(spec.constraint, spec); !bad.empty()) {
        throw UsageError(fmt::format("{}: the constraint [{}] of '{}' is not understood: {}.",
                                     f.origin(e.line), spec.constraint, e.key, bad));
      }
      comment = trim(std::string_view(comment).substr(0, open));
    }
    spec.doc = comment;
    for (int l = std::min(e.line - 1, static_cast<int>(f.lines.size())) - 1; l >= 0; --l) {
      const std::string_view line = f.lines[static_cast<size_t>(l)];
      if (line.rfind("# ----", 0) != 0) continue;
      std::string_view name = line.substr(6);
      while (!name.empty() && (name.back() == '-' || name.back() == ' ')) name.remove_suffix(1);
      while (!name.empty() && name.front() == ' ') name.remove_prefix(1);
      spec.section = std::string(name);
      break;
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

}  // namespace

std::string nearest_key(const std::string& key, const std::vector<std::string>& candidates) {
  return nearest(key, candidates).first;
}

std::vector<ModelEntry> list_models(const fs::path& configs_dir,
                                    const std::vector<fs::path>& model_dirs) {
  std::string default_family;
  {
    std::error_code ec;
    if (fs::is_regular_file(configs_dir / "base.yml", ec)) {
      try {
        YAML::Node base = YAML::LoadFile((configs_dir / "base.yml").string());
        if (base.IsMap() && base["decoder_block"].IsScalar())
          default_family = base["decoder_block"].Scalar();
      } catch (const YAML::Exception&) {
        // load_config reports a malformed base.yml with its location; a listing does without.
      }
    }
  }
  std::vector<ModelEntry> out;
  std::map<std::string, size_t> seen;  // name -> its entry in `out`
  for (const auto& dir : model_search_dirs(configs_dir, model_dirs)) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& de : fs::directory_iterator(dir, ec)) {
      if (de.path().extension() == ".yml" && de.is_regular_file(ec)) files.push_back(de.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& p : files) {
      ModelEntry m;
      m.name = p.stem().string();
      if (const auto it = seen.find(m.name); it != seen.end()) {
        out[it->second].shadowed.push_back(p);
        continue;
      }
      seen.emplace(m.name, out.size());
      m.path = p;
      m.family = default_family;
      std::ifstream in(p);
      for (std::string line; std::getline(in, line);) {
        const std::string t = trim(line);
        if (t.empty()) continue;
        if (t[0] == '#') m.description = trim(std::string_view(t).substr(1));
        break;
      }
      try {
        YAML::Node n = YAML::LoadFile(p.string());
        if (n.IsMap() && n["decoder_block"].IsScalar()) m.family = n["decoder_block"].Scalar();
      } catch (const YAML::Exception& e) {
        // Listed all the same, so that `mt models` shows the broken file instead of hiding it;
        // its family is unknown (not base.yml's, which it may not be).
        m.description = "malformed YAML: " + e.msg;
        m.family = "?";
      }
      out.push_back(std::move(m));
    }
  }
  std::sort(out.begin(), out.end(),
            [](const ModelEntry& a, const ModelEntry& b) { return natural_less(a.name, b.name); });
  return out;
}

namespace {

// The layers over the schema's defaults. lenient: keys the schema does not declare are left out
// and no constraint is checked (preview_config); else the first such key is refused.
Config resolve_layers(const ConfigRequest& req, bool lenient) {
  const Schema schema = read_schema(req.configs_dir, req.schema_files, req.schema_texts);
  std::optional<Unknown> unknown;

  // Layer 1: the defaults.
  Config c;
  for (const auto& spec : schema.specs) {
    c.impl().set(spec.name, spec.default_value);
    c.impl().sections[spec.name] = spec.section;
    c.impl().defaults[spec.name] = config_value_yaml(spec.default_value);
  }

  // Read the later layers first: the --config file and the overrides may name the model, whose
  // file is applied before them.
  std::optional<LayerFile> user;
  if (!req.config_file.empty()) {
    const fs::path p = req.config_file;
    std::error_code ec;
    if (!fs::exists(p, ec)) {
      throw UsageError(
          fmt::format("The config file '{}' given by --config does not exist.", req.config_file));
    }
    if (!fs::is_regular_file(p, ec)) {
      throw UsageError(
          fmt::format("The config file '{}' given by --config is not a file.", req.config_file));
    }
    user = read_layer(p, display_path(p, req.configs_dir));
  }
  std::vector<Override> overrides;
  for (const auto& arg : req.overrides) overrides.push_back(split_override(arg));
  // M_<KEY> variables that name a key, each with its origin.
  std::vector<std::pair<Override, std::string>> environment;
  for (const auto& [name, value] : req.environment) {
    if (name.size() <= 2 || name.rfind("M_", 0) != 0) continue;
    std::string key = name.substr(2);
    for (char& ch : key) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    if (!schema.find(key)) continue;
    for (const auto& o : overrides)
      if (o.key == key)
        throw UsageError(fmt::format(
            "{} is set both on the command line ({}) and by the environment variable {}={}: "
            "give it one way (MaxText refuses this too).",
            key, o.arg, name, value));
    if (key == "model_name" && !req.model.empty() && value != req.model)
      throw UsageError(
          fmt::format("--model={} and the environment variable {}={} name two models: "
                      "give one of them.",
                      req.model, name, value));
    environment.push_back(
        {Override{key, value, name + "=" + value}, "environment variable " + name});
  }

  // The model: --model, else the last model_name= override, else the --config file's
  // model_name, else base.yml's. A name given by a layer is type-checked before it is used.
  const KeySpec* model_spec = schema.find("model_name");
  std::string model;
  std::string model_origin;
  if (!req.model.empty()) {
    model = req.model;
    model_origin = "command line (--model)";
  } else {
    for (auto it = overrides.rbegin(); it != overrides.rend() && model_origin.empty(); ++it) {
      if (it->key != "model_name" || !model_spec) continue;
      model = override_value(*model_spec, *it, "command line").s;
      model_origin = "command line";
    }
    for (const auto& [o, origin] : environment) {
      if (o.key != "model_name" || !model_spec || !model_origin.empty()) continue;
      model = override_value(*model_spec, o, origin).s;
      model_origin = origin;
    }
    if (model_origin.empty() && user && model_spec) {
      for (const auto& e : user->entries) {
        if (e.key != "model_name") continue;
        model = make_value(*model_spec, e.value, node_text(e.value), user->origin(e.line)).s;
        model_origin = user->origin(e.line);
      }
    }
    if (model_origin.empty() && c.has("model_name")) {
      model = c.get_string("model_name");
      model_origin = c.origin("model_name");
    }
  }

  // Layer 2: the model file.
  if (!model.empty()) {
    std::optional<fs::path> found;
    if (plausible_model_name(model)) {
      for (const auto& dir : model_search_dirs(req.configs_dir, req.model_dirs)) {
        std::error_code ec;
        if (fs::is_regular_file(dir / (model + ".yml"), ec)) {
          found = dir / (model + ".yml");
          break;
        }
      }
    }
    if (!found) {
      std::vector<std::string> names;
      for (const auto& m : list_models(req.configs_dir, req.model_dirs)) names.push_back(m.name);
      std::vector<std::string> searched;
      for (const auto& d : model_search_dirs(req.configs_dir, req.model_dirs))
        searched.push_back(display_path(d, req.configs_dir));
      throw UsageError(
          fmt::format("Unknown model '{}' ({}).{} The available models are: {} (searched {}).",
                      model, where(model_origin), suggest(model, names),
                      names.empty() ? "none" : join(names, ", "), join(searched, ", ")));
    }
    const LayerFile mf = read_layer(*found, display_path(*found, req.configs_dir));
    for (const auto& e : mf.entries) {
      if (e.key == "model_name") {
        throw UsageError(fmt::format(
            "{}: a model file cannot set model_name: a model is named by its file name.",
            mf.origin(e.line)));
      }
    }
    apply_layer(c, schema, mf, unknown);
  }

  // Keys imported from another format, then layer 3: the --config file; layer 4: the
  // overrides, in command-line order.
  for (const auto& arg : req.imported) {
    const Override o = split_override(arg);
    const KeySpec* spec = schema.find(o.key);
    if (!spec) {
      if (!unknown) unknown = Unknown{o.key, req.imported_origin};
      continue;
    }
    c.impl().set(o.key, override_value(*spec, o, req.imported_origin));
  }
  if (user) apply_layer(c, schema, *user, unknown);
  for (const auto& [o, origin] : environment)
    c.impl().set(o.key, override_value(*schema.find(o.key), o, origin));
  for (const auto& o : overrides) {
    const KeySpec* spec = schema.find(o.key);
    if (!spec) {
      if (!unknown) unknown = Unknown{o.key, "command line"};
      continue;
    }
    c.impl().set(o.key, override_value(*spec, o, "command line"));
  }
  if (model_spec && !req.model.empty()) {
    ConfigValue v;
    v.type = ValueType::string;
    v.s = model;
    v.origin = model_origin;
    c.impl().set("model_name", std::move(v));
  }

  if (lenient) return c;
  if (unknown) unknown_key(schema, *unknown, c);

  // Constraints are checked on the final values, so a later layer may repair an earlier one.
  for (const auto& spec : schema.specs) check_constraint(spec, c.impl().at(spec.name));
  check_combinations(c);
  return c;
}

}  // namespace

Config preview_config(const ConfigRequest& req) {
  return resolve_layers(req, /*lenient=*/true);
}

Config load_config(const ConfigRequest& req) {
  if (!req.schemas_for) return resolve_layers(req, /*lenient=*/false);
  ConfigRequest full = req;
  for (auto& t : req.schemas_for(preview_config(req))) full.schema_texts.push_back(std::move(t));
  full.schemas_for = nullptr;
  return resolve_layers(full, /*lenient=*/false);
}

}  // namespace mt
