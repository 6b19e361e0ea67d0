// Fuzzes mt::json::parse, the reader under tokenizer.json, config.json, safetensors headers,
// JSON-lines data and checkpoint metadata. Any input parses or is refused with json::ParseError;
// besides crashes, hangs and sanitizer reports, a finding is a broken promise of json.h:
// - a ParseError's offset lies within the text;
// - a number's fields agree with its text (is_int/integer, as_uint64);
// - what parses, written back as JSON (strings through quote(), which json.h promises reads
//   back any byte string unchanged, numbers as their own text), parses to the same value.
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "fuzz_support.h"
#include "json.h"

namespace {

using mt::fuzz::finding;
using mt::json::Value;

void write(const Value& v, std::string& out) {
  switch (v.kind) {
    case Value::Kind::null:
      out += "null";
      break;
    case Value::Kind::boolean:
      out += v.boolean ? "true" : "false";
      break;
    case Value::Kind::number:
      out += v.str;
      break;
    case Value::Kind::string:
      out += mt::json::quote(v.str);
      break;
    case Value::Kind::array:
      out += '[';
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i) out += ',';
        write(v.items[i], out);
      }
      out += ']';
      break;
    case Value::Kind::object:
      out += '{';
      for (size_t i = 0; i < v.members.size(); ++i) {
        if (i) out += ',';
        out += mt::json::quote(v.members[i].first);
        out += ':';
        write(v.members[i].second, out);
      }
      out += '}';
      break;
  }
}

// Compares everything the parser fills in; `number` only when both are NaN-free by construction
// (strtod of a JSON number never gives NaN), so == is exact.
bool same(const Value& a, const Value& b) {
  if (a.kind != b.kind || a.boolean != b.boolean || a.str != b.str || a.is_int != b.is_int ||
      a.integer != b.integer || a.items.size() != b.items.size() ||
      a.members.size() != b.members.size())
    return false;
  if (a.kind == Value::Kind::number && a.number != b.number) return false;
  for (size_t i = 0; i < a.items.size(); ++i)
    if (!same(a.items[i], b.items[i])) return false;
  for (size_t i = 0; i < a.members.size(); ++i)
    if (a.members[i].first != b.members[i].first || !same(a.members[i].second, b.members[i].second))
      return false;
  return true;
}

void check_numbers(const Value& v) {
  if (v.kind == Value::Kind::number) {
    int64_t i = 0;
    const auto r = std::from_chars(v.str.data(), v.str.data() + v.str.size(), i);
    const bool fits = r.ec == std::errc() && r.ptr == v.str.data() + v.str.size();
    if (v.is_int != fits || (fits && v.integer != i))
      finding("number " + v.str + ": is_int/integer disagree with its text");
    if (const auto u = v.as_uint64();
        u && (v.str.empty() || v.str[0] == '-' || std::to_string(*u) != v.str))
      finding("number " + v.str + ": as_uint64 gave " + std::to_string(*u));
  }
  for (const auto& item : v.items) check_numbers(item);
  for (const auto& [key, member] : v.members) {
    if (v.find(key) == nullptr) finding("find() misses the member '" + key + "'");
    check_numbers(member);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Value v;
  try {
    v = mt::json::parse(text);
  } catch (const mt::json::ParseError& e) {
    if (e.offset > size)
      finding("ParseError offset " + std::to_string(e.offset) + " beyond the text (" +
              std::to_string(size) + " bytes): " + e.what);
    return 0;
  }
  check_numbers(v);
  std::string again;
  write(v, again);
  try {
    // Written compactly the text nests no deeper than the input did, so the default depth
    // limit accepts it.
    if (!same(v, mt::json::parse(again))) finding("written back, the value parses differently");
  } catch (const mt::json::ParseError& e) {
    finding("written back, the value does not parse: " + e.what + " at byte " +
            std::to_string(e.offset));
  }
  return 0;
}
