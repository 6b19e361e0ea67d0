// Makes the tokenizer a run names: tokenizer_type / tokenizer_path, as MaxText spells them.
#pragma once

#include <memory>
#include <string>

#include "mt/tokenizer.h"

namespace mt {

// path: a tokenizer file, or a model directory holding tokenizer.json or tokenizer.model.
// type: "huggingface" (a tokenizer.json), "sentencepiece" (a tokenizer.model), "tiktoken" (Llama
// 3's tokenizer.model as Meta ships it), or "" to infer it from the file (".json" or JSON
// content: huggingface; "<base64> <rank>" lines: tiktoken; anything else: sentencepiece). Throws
// mt::UsageError for an empty path, a missing or unreadable file, a file the type cannot read, or
// an unknown type.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& path, const std::string& type);

}  // namespace mt
