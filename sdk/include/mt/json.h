// A small JSON reader and string writer (tokenizer.json, JSON lines, safetensors headers,
// checkpoint metadata), part of the SDK so plugins (data sources) read JSON as the core does.
//
// Hand-written so the core needs no JSON dependency. Objects keep their members in file order
// (tokenizer.json's vocab is an object of ~100k members, so lookups by key are linear: callers
// that need many lookups build their own map once).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "mt/export.h"

namespace mt::json {

struct MT_API Value {
  enum class Kind { null, boolean, number, string, array, object };
  Kind kind = Kind::null;
  bool boolean = false;
  double number = 0;
  bool is_int = false;  // a number written without fraction or exponent that fits in int64
  int64_t integer = 0;
  std::string str;  // string value, or the number's text
  std::vector<Value> items;
  std::vector<std::pair<std::string, Value>> members;  // in file order

  // Out of line: a member vector of pairs holding the incomplete Value may not be destroyed
  // inline here (clang instantiates that in C++20, where vector's destructor is constexpr).
  Value();
  ~Value();
  Value(const Value&);
  Value(Value&&) noexcept;
  Value& operator=(const Value&);
  Value& operator=(Value&&) noexcept;

  bool is_null() const { return kind == Kind::null; }
  bool is_string() const { return kind == Kind::string; }
  bool is_object() const { return kind == Kind::object; }
  bool is_array() const { return kind == Kind::array; }
  // The member named `key` of an object, or nullptr (also when this is not an object).
  const Value* find(std::string_view key) const;
  // A number written as plain digits (no sign, fraction or exponent) that fits in uint64; nullopt
  // for anything else. Sizes and offsets above INT64_MAX are valid in some formats (safetensors).
  std::optional<uint64_t> as_uint64() const;
};

MT_API const char* kind_name(Value::Kind k);  // "a string", "an object", ...

struct ParseError {
  std::string what;
  size_t offset = 0;  // byte offset in the parsed text
};

// Parses a whole document; throws ParseError (callers add the file name).
MT_API Value parse(std::string_view text, int max_depth = 64);

// `s` as a JSON string literal, quotes included. Escapes only what JSON requires (quote,
// backslash, control characters) and passes every other byte through, so any byte string, valid
// UTF-8 or not, reads back unchanged with parse().
MT_API std::string quote(std::string_view s);

}  // namespace mt::json
