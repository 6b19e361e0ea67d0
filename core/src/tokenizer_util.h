// UTF-8 helpers shared by the tokenizers and the JSON reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

// read_file moved to file_util.h; included here so the tokenizers and their tests still find it.
#include "file_util.h"

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
// utf8_encode without the temporary, for decoders that build a string piece by piece.
void utf8_append(std::string& out, uint32_t cp);
// The code point of one complete sequence (as utf8_len measures it).
uint32_t utf8_decode(std::string_view s);
// Byte offset of the first byte that is not part of valid UTF-8 (overlong forms, surrogates and
// code points above U+10FFFF are invalid), or npos.
size_t utf8_invalid_at(std::string_view s);
// s with each maximal invalid subsequence replaced by one U+FFFD (Unicode's "substitution of
// maximal subparts", as Rust's String::from_utf8_lossy, which Hugging Face's ByteLevel decoder
// applies).
std::string utf8_lossy(std::string_view s);

}  // namespace mt
