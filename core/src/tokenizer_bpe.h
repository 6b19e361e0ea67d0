// Hugging Face `tokenizer.json` BPE tokenizers (GPT-2, Llama 3, Qwen, DeepSeek style).
//
// What is read: the BPE model (vocab, merges in "a b" or ["a", "b"] form, unk_token, fuse_unk,
// byte_fallback, ignore_merges), added tokens (leftmost-longest, as the reference library matches
// them: those with normalized=false in the raw text, then the others in the normalized text between
// them, all before pre-tokenization; lstrip/rstrip take any Unicode whitespace; single_word refuses
// a match that a word character touches), the normalizer (NFC, NFD, NFKC, NFKD through utf8proc;
// Prepend; Replace with a string; a Sequence of these), the pre-tokenizer (ByteLevel with or
// without its GPT-2 regex, Split with a regex or string pattern and any behavior, Digits,
// Metaspace, and a Sequence of these) and the decoder (ByteLevel, ByteFallback, Fuse, Replace,
// Strip, Metaspace, Sequence). Regexes run on PCRE2 with Unicode classes. Anything else is refused
// with an error naming it. The post-processor is not applied: callers add BOS/EOS themselves
// (add_bos/add_eos), so the ids are those of the reference library's encode(text,
// add_special_tokens=False).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "mt/tokenizer.h"

namespace mt {

class BpeTokenizer final : public Tokenizer {
 public:
  enum class Format {
    huggingface,  // tokenizer.json
    // A tiktoken file (Llama 3's tokenizer.model as Meta ships it; MaxText's
    // tokenizer_type=tiktoken): "<base64 token> <rank>" lines, read as MaxText's tiktoken
    // tokenizer does: Llama 3's regex, its 256 special tokens after the ranks
    // (<|begin_of_text|> = BOS, <|end_of_text|> = EOS), special tokens in text encoded as text.
    tiktoken,
  };
  // Parses the contents of a file; `origin` (the file name) prefixes every error. Throws
  // mt::UsageError for malformed or unsupported files.
  BpeTokenizer(std::string_view text, const std::string& origin,
               Format format = Format::huggingface);
  static std::unique_ptr<BpeTokenizer> from_file(const std::string& path);
  ~BpeTokenizer() override;
  BpeTokenizer(const BpeTokenizer&) = delete;
  BpeTokenizer& operator=(const BpeTokenizer&) = delete;

  // Thread-safe. Throws mt::Error for text that is not valid UTF-8.
  std::vector<int32_t> encode(const std::string& text) const override;
  // Ids outside the vocabulary are skipped, as the reference library does. Special tokens are
  // kept (their text), so decode(encode(s)) == s.
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;

  // The bos and eos tokens by name (tokenizer_config.json's bos_token / eos_token, as
  // transformers takes them): each found replaces the one guessed from the common names; ""
  // or a name the vocabulary lacks leaves it.
  void name_specials(const std::string& bos, const std::string& eos);
  int32_t token_to_id(const std::string& token) const;  // -1 when absent
  std::string id_to_token(int32_t id) const;            // "" when absent

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
