#include "tokenizer_sp.h"

#include <sentencepiece_processor.h>

#include "mt/error.h"
#include "tokenizer_util.h"

namespace mt {

struct SentencePieceTokenizer::Impl {
  std::string path;
  sentencepiece::SentencePieceProcessor sp;
};

SentencePieceTokenizer::SentencePieceTokenizer(const std::string& path)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  // Read the file ourselves: the library's own error for a missing file does not say which.
  const std::string bytes = read_file(path, "tokenizer");
  const auto status = impl_->sp.LoadFromSerializedProto(bytes);
  if (!status.ok()) {
    // The library's words name its own source line when the bytes are no model protobuf at all.
    const std::string why = status.ToString();
    throw UsageError(
        "tokenizer file '" + path + "' is not a SentencePiece model: " +
        (why.find("ParseFromArray") != std::string::npos
             ? std::string("its bytes are not a model protobuf (a tokenizer.model file)")
             : why) +
        (bytes.empty() ? " (the file is empty)" : ""));
  }
}

SentencePieceTokenizer::~SentencePieceTokenizer() = default;

std::vector<int32_t> SentencePieceTokenizer::encode(const std::string& text) const {
  if (const size_t bad = utf8_invalid_at(text); bad != std::string::npos)
    throw Error("tokenizer " + impl_->path + ": text is not valid UTF-8 (byte " +
                std::to_string(bad) + ")");
  std::vector<int> ids;
  const auto status = impl_->sp.Encode(text, &ids);
  if (!status.ok()) throw Error("tokenizer " + impl_->path + ": " + status.ToString());
  return {ids.begin(), ids.end()};
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  const int n = impl_->sp.GetPieceSize();
  std::vector<int> keep;
  keep.reserve(ids.size());
  for (int32_t id : ids)
    if (id >= 0 && id < n) keep.push_back(id);
  std::string out;
  const auto status = impl_->sp.Decode(keep, &out);
  if (!status.ok()) throw Error("tokenizer " + impl_->path + ": " + status.ToString());
  return out;
}

int64_t SentencePieceTokenizer::vocab_size() const {
  return impl_->sp.GetPieceSize();
}
int32_t SentencePieceTokenizer::bos_id() const {
  return impl_->sp.bos_id();
}
int32_t SentencePieceTokenizer::eos_id() const {
  return impl_->sp.eos_id();
}

}  // namespace mt
