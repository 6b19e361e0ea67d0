// SentencePiece models (`tokenizer.model`: Llama 2, Gemma, Mistral) through libsentencepiece.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "mt/tokenizer.h"

namespace mt {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Throws mt::UsageError naming the file when it is missing or not a SentencePiece model.
  explicit SentencePieceTokenizer(const std::string& path);
  ~SentencePieceTokenizer() override;
  SentencePieceTokenizer(const SentencePieceTokenizer&) = delete;
  SentencePieceTokenizer& operator=(const SentencePieceTokenizer&) = delete;

  // The model's own normalization and options apply; no BOS/EOS are added (callers do that).
  std::vector<int32_t> encode(const std::string& text) const override;
  // Ids outside the vocabulary are skipped.
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override;
  int32_t bos_id() const override;
  int32_t eos_id() const override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mt
