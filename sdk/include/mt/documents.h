// The documents of text and JSON-lines files, read a chunk at a time: what dataset_type=text and
// mt tokenize train on, so that neither holds a whole corpus to tokenize it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mt/export.h"

namespace mt {

class LineReader;
class Tokenizer;

// One document and where it came from: "file:line" for a JSON line, the file otherwise.
struct Document {
  std::string text, where;
};

// Text held per chunk (16 MB; the ids of a chunk take about as much again). MT_TOKENIZE_CHUNK_BYTES
// sets a smaller one, for the tests that cross chunk boundaries.
MT_API size_t document_chunk_bytes();

// The files in order. A .jsonl or .json file gives one document per line, the string `field` of
// a JSON object (blank lines skipped); any other file is one document, its whole text (none
// when it is empty). Files and
// records come through the bounded readers of mt/io.h (`what` names the files in their messages);
// no record is longer than kMaxRecordBytes.
class MT_API DocumentReader {
 public:
  // `bad` is called with "<file>:<line>: <why>" for a line that is not a JSON object with a string
  // `field`: it throws to refuse the file, or returns to skip the line.
  DocumentReader(std::vector<std::string> paths, std::string field, std::string what,
                 std::function<void(const std::string&)> bad);
  ~DocumentReader();
  DocumentReader(const DocumentReader&) = delete;
  DocumentReader& operator=(const DocumentReader&) = delete;

  // The next documents, about `max_bytes` of text (at least one document); false at the end.
  bool next(std::vector<Document>& docs, size_t max_bytes);
  // Bytes of input read so far.
  uint64_t bytes() const { return bytes_; }

 private:
  std::vector<std::string> paths_;
  std::string field_, what_;
  std::function<void(const std::string&)> bad_;
  size_t file_ = 0;                    // the file being read
  std::unique_ptr<LineReader> lines_;  // its lines, for a JSON-lines file
  uint64_t bytes_ = 0;
};

// A chunk of documents tokenized: ids[i] are document i's ids (the tokenizer's alone: no BOS or
// EOS), or, when the tokenizer refused its text (not UTF-8), refused[i] says why and ids[i] is
// empty.
struct TokenizedDocuments {
  std::vector<std::vector<int32_t>> ids;
  std::vector<std::string> refused;
};

// Tokenizes `docs` on `threads` threads (0 = the cores; the tokenizers are thread-safe), dealt a
// document at a time; results land in place, so they do not depend on scheduling. Running out of
// memory or failing to start a thread is never a refused document: it throws mt::Error saying
// what to change.
MT_API void tokenize_documents(const std::vector<Document>& docs, const Tokenizer& tok,
                               unsigned threads, TokenizedDocuments& out);

}  // namespace mt
