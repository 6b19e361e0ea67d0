// Fuzzes the tokenizer readers through make_tokenizer, as `tokenizer_path=` reaches them: the
// input is the file and its content picks the reader (tokenizer.json, a tiktoken file, else a
// SentencePiece model), so a corpus file is an ordinary tokenizer file. Any file loads or is
// refused with mt::Error. A tokenizer that loads encodes and decodes fixed texts and decodes its
// own first ids and some outside the vocabulary, so the tables built from the file are used;
// besides crashes, hangs and sanitizer reports, a finding is an id outside [0, vocab_size())
// from encode, or a bos/eos id that is neither -1 nor in the vocabulary.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fuzz_support.h"
#include "mt/error.h"
#include "mt/tokenizer.h"
#include "tokenizer_factory.h"
#include "tokenizer_util.h"

namespace {

using mt::fuzz::finding;

// ASCII words, digits, punctuation and runs of spaces; accented Latin, CJK and an emoji (NFC/NFKC
// normalizers, byte fallback); what looks like special tokens of the common families.
const char* const kTexts[] = {
    "Hello, world! It's 2024: 12345 apples -- and   three spaces.\n\n\tTabbed line\r\n",
    "na\xc3\xafve caf\xc3\xa9 \xef\xac\x81 \xe6\x97\xa5\xe6\x9c\xac\xe8\xaa\x9e \xf0\x9f\x98\x80!",
    "<s> </s> <unk> <|begin_of_text|><|endoftext|> \xe2\x96\x81x <0x41>",
    "",
};

std::vector<int32_t> encode(const mt::Tokenizer& tok, const std::string& text) {
  std::vector<int32_t> ids;
  try {
    ids = tok.encode(text);
  } catch (const mt::Error&) {
    // Refusals during work: text that is not UTF-8 (decoded text below may not be), a regex
    // from the file that fails on this text.
    return ids;
  }
  for (int32_t id : ids)
    if (id < 0 || id >= tok.vocab_size())
      finding("encode gave id " + std::to_string(id) + " outside the vocabulary of " +
              std::to_string(tok.vocab_size()));
  return ids;
}

std::string decode(const mt::Tokenizer& tok, const std::vector<int32_t>& ids) {
  try {
    return tok.decode(ids);
  } catch (const mt::Error&) {
    return {};
  }
}

void exercise(const mt::Tokenizer& tok) {
  const int64_t n = tok.vocab_size();
  if (n < 0) finding("negative vocab_size " + std::to_string(n));
  for (int32_t id : {tok.bos_id(), tok.eos_id()})
    if (id < -1 || id >= n) finding("bos/eos id " + std::to_string(id) + " outside the vocabulary");
  for (const char* text : kTexts) {
    std::vector<int32_t> ids = encode(tok, text);
    (void)decode(tok, ids);
  }
  // The first ids (every token a small file defines) and ids just outside the vocabulary, which
  // decode skips; then their text encoded again when it is UTF-8.
  std::vector<int32_t> ids;
  for (int32_t id = 0; id < std::min<int64_t>(n, 512); ++id) ids.push_back(id);
  for (int64_t id : {int64_t{-1}, n, n + 1, int64_t{INT32_MAX}})
    if (id >= INT32_MIN && id <= INT32_MAX) ids.push_back(static_cast<int32_t>(id));
  const std::string text = decode(tok, ids);
  if (mt::utf8_invalid_at(text) == std::string::npos) (void)encode(tok, text);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static mt::fuzz::MemFile file("fuzz.tokenizer");
  const std::string& path = file.write(data, size);
  std::unique_ptr<mt::Tokenizer> tok;
  try {
    tok = mt::make_tokenizer(path, "");
  } catch (const mt::Error&) {
    return 0;  // refused, with a message naming the file: expected for most inputs
  }
  exercise(*tok);
  return 0;
}
