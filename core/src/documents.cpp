// mt/documents.h: the documents of text and JSON-lines files, a chunk at a time.
#include "mt/documents.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <new>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "mt/error.h"
#include "mt/io.h"
#include "mt/json.h"
#include "mt/tokenizer.h"

namespace mt {

size_t document_chunk_bytes() {
  if (const char* e = std::getenv("MT_TOKENIZE_CHUNK_BYTES"); e && std::atoll(e) > 0)
    return static_cast<size_t>(std::atoll(e));
  return size_t{16} << 20;
}

DocumentReader::DocumentReader(std::vector<std::string> paths, std::string field, std::string what,
                               std::function<void(const std::string&)> bad)
    : paths_(std::move(paths)),
      field_(std::move(field)),
      what_(std::move(what)),
      bad_(std::move(bad)) {}

DocumentReader::~DocumentReader() = default;

bool DocumentReader::next(std::vector<Document>& docs, size_t max_bytes) {
  docs.clear();
  size_t held = 0;
  while (held < max_bytes) {
    if (!lines_) {
      if (file_ == paths_.size()) break;
      const std::string& p = paths_[file_];
      const std::string ext = std::filesystem::path(p).extension().string();
      if (ext != ".jsonl" && ext != ".json") {
        // An empty file holds no document (it gave one of BOS and EOS alone).
        std::string text = read_file(p, what_, kMaxRecordBytes);
        held += text.size();
        bytes_ += text.size();
        if (!text.empty()) docs.push_back({std::move(text), p});
        ++file_;
        continue;
      }
      // Line by line, each bounded: a corpus may be larger than any one read should be.
      lines_ = std::make_unique<LineReader>(p, what_, kMaxRecordBytes);
    }
    std::string_view line;
    if (!lines_->next(line)) {
      lines_.reset();
      ++file_;
      continue;
    }
    bytes_ += line.size() + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const std::string where = paths_[file_] + ":" + std::to_string(lines_->line_number());
    json::Value v;
    try {
      v = json::parse(line);
    } catch (const json::ParseError& e) {
      bad_(where + ": not a JSON line: malformed JSON at column " + std::to_string(e.offset + 1) +
           ": " + e.what);
      continue;
    }
    const json::Value* f = v.find(field_);  // null for a non-object too
    if (!v.is_object()) {
      bad_(where + ": the line is not a JSON object");
    } else if (!f) {
      bad_(where + ": no \"" + field_ + "\" field (train_data_columns)");
    } else if (!f->is_string()) {
      bad_(where + ": field \"" + field_ + "\" is " + json::kind_name(f->kind) +
           ", not a string (train_data_columns)");
    } else {
      held += f->str.size();
      docs.push_back({f->str, where});
    }
  }
  return !docs.empty();
}

void tokenize_documents(const std::vector<Document>& docs, const Tokenizer& tok, unsigned threads,
                        TokenizedDocuments& out) {
  out.ids.assign(docs.size(), {});
  out.refused.assign(docs.size(), {});
  std::atomic<size_t> next{0};
  std::atomic<bool> out_of_memory{false};
  auto work = [&] {
    for (size_t i; !out_of_memory && (i = next.fetch_add(1)) < docs.size();) {
      try {
        out.ids[i] = tok.encode(docs[i].text);
      } catch (const std::bad_alloc&) {
        // Never a malformed document: data_strict=false skipped every one it hit (242 of 256
        // under ulimit -v) and went on with exit 0.
        out_of_memory = true;
      } catch (const std::exception& e) {
        try {
          out.refused[i] = e.what();
        } catch (const std::bad_alloc&) {
          out_of_memory = true;  // (leaving the thread would be std::terminate)
        }
        out.ids[i].clear();
      }
    }
  };
  const size_t n = std::min<size_t>(
      docs.size(), threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency()));
  size_t held = 0;
  for (const auto& d : docs) held += d.text.size();
  {
    // A thread that cannot be started (a process limit) ends the work with the reason; the ones
    // started are joined first (a std::thread's destructor would call std::terminate).
    std::vector<std::jthread> pool;
    try {
      for (size_t t = 1; t < n; ++t) pool.emplace_back(work);
    } catch (const std::system_error& e) {
      out_of_memory = true;  // stops the started ones at their next document
      pool.clear();
      throw Error(fmt::format(
          "cannot start {} tokenizing threads: {} (a limit on processes or memory: ulimit -u, "
          "ulimit -v; num_threads sets fewer).",
          n, e.what()));
    }
    work();
  }
  if (out_of_memory)
    throw Error(fmt::format(
        "ran out of memory while tokenizing ({} documents, {:.1f} MB of text held at once): "
        "raise the memory limit.",
        docs.size(), static_cast<double>(held) / 1e6));
}

}  // namespace mt
