// Tokenizer: text <-> token ids (SentencePiece models and Hugging Face tokenizer.json BPE).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mt/export.h"

namespace mt {

class MT_API Tokenizer {
 public:
  virtual ~Tokenizer();
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when none
  virtual int32_t eos_id() const = 0;  // -1 when none
};

}  // namespace mt
