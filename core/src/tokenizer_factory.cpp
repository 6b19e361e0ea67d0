#include "tokenizer_factory.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <string_view>

#include "hf_interop.h"
#include "mt/error.h"
#include "tokenizer_bpe.h"
#include "tokenizer_sp.h"
#include "tokenizer_util.h"

namespace mt {
namespace {

// Whether the first line is "<base64> <digits>".
bool looks_like_tiktoken(const std::string& bytes) {
  std::string_view line(bytes.data(), std::min(bytes.find('\n'), bytes.size()));
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  const size_t sp = line.find(' ');
  if (sp == 0 || sp == std::string_view::npos || sp + 1 == line.size()) return false;
  for (size_t i = 0; i < sp; ++i) {
    const char c = line[i];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '+' || c == '/' || c == '='))
      return false;
  }
  for (size_t i = sp + 1; i < line.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(line[i]))) return false;
  return true;
}

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& path, const std::string& type) {
  if (path.empty()) throw UsageError("tokenizer_path is empty: name a tokenizer file");
  if (!type.empty() && type != "huggingface" && type != "sentencepiece" && type != "tiktoken")
    throw UsageError("tokenizer_type=" + type +
                     " is unknown: use huggingface, sentencepiece, tiktoken, or \"\" to infer it " +
                     "from the file");
  std::string file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    // A model directory (as downloaded from a hub): its tokenizer.json, else its
    // tokenizer.model.
    for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
      const auto p = std::filesystem::path(path) / name;
      if (std::filesystem::is_regular_file(p, ec)) {
        file = p.string();
        break;
      }
    }
    if (file == path)
      throw UsageError("tokenizer file '" + path +
                       "' is a directory without tokenizer.json or tokenizer.model");
  }
  std::string t = type;
  std::string bytes = read_file(file, "tokenizer");  // errors for missing files come first
  if (t.empty()) {
    // By content first: Llama 3's tiktoken file is also called tokenizer.model. A JSON
    // document starts with '{' after optional whitespace; a tiktoken file with a line
    // "<base64> <digits>"; a SentencePiece model is a protobuf (binary, first byte 0x0A).
    const std::string ext = std::filesystem::path(file).extension().string();
    const size_t first = bytes.find_first_not_of(" \t\r\n");
    if (ext == ".json" || (first != std::string::npos && bytes[first] == '{'))
      t = "huggingface";
    else if (looks_like_tiktoken(bytes))
      t = "tiktoken";
    else
      t = "sentencepiece";
  }
  if (t == "huggingface") {
    auto tok = std::make_unique<BpeTokenizer>(bytes, file);
    // The bos/eos a tokenizer_config.json beside it names, as transformers reads them (before:
    // only the common names were known, so DeepSeek's <｜begin▁of▁sentence｜> was no bos and
    // add_bos was refused).
    const HfTokenSettings names =
        read_hf_token_settings(std::filesystem::path(file).parent_path(), true);
    tok->name_specials(names.bos_token, names.eos_token);
    return tok;
  }
  if (t == "tiktoken")
    return std::make_unique<BpeTokenizer>(bytes, file, BpeTokenizer::Format::tiktoken);
  bytes.clear();
  return std::make_unique<SentencePieceTokenizer>(file);
}

}  // namespace mt
