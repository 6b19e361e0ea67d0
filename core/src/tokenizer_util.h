// UTF-8 and file helpers shared by the tokenizers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mt {

// Length of the UTF-8 sequence a lead byte starts (1 for stray continuation bytes, so that a
// scan over unvalidated text always advances).
inline size_t utf8_len(unsigned char lead) {
  if (lead < 0x80) return 1;
  if ((lead >> 5) == 0x6) return 2;
  if ((lead >> 4) == 0xE) return 3;
  if ((lead >> 3) == 0x1E) return 4;
  return 1;
}

std::string utf8_encode(uint32_t cp);
// The code point of one complete sequence (as utf8_len measures it).
uint32_t utf8_decode(std::string_view s);
// Byte offset of the first byte that is not part of valid UTF-8 (overlong forms, surrogates and
// code points above U+10FFFF are invalid), or npos.
size_t utf8_invalid_at(std::string_view s);

// Whole file; throws mt::UsageError "<what> file '<path>' ..." when missing or unreadable.
std::string read_file(const std::string& path, const std::string& what);

}  // namespace mt
