// mt tokenize: text or JSON-lines files -> the `tokens` format (data/README.md) that
// dataset_type=tokens memory-maps. Documents are tokenized in parallel on num_threads threads, a
// chunk of the corpus at a time.
//   mt tokenize tokenizer_path=FILE input=FILE[,FILE...] output=FILE.tokens
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "cli.h"
#include "mt/documents.h"
#include "mt/error.h"
#include "mt/tokenizer.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt::cli {

namespace {

bool is_tokens_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  char magic[8] = {};
  return f.read(magic, 8) && std::memcmp(magic, "MTTOKENS", 8) == 0;
}

}  // namespace

int cmd_tokenize(const Args& args) {
  const Config cfg = resolve_config(args);
  const std::string out_path = cfg.get_string("output");
  if (cfg.get_string("input").empty() || out_path.empty())
    throw UsageError("mt tokenize needs input=<file[,file...]> and output=<file.tokens>.");
  if (cfg.get_string("tokenizer_path").empty())
    throw UsageError("mt tokenize needs tokenizer_path=<tokenizer.json or tokenizer.model>.");
  std::vector<std::string> paths;
  std::stringstream ss(cfg.get_string("input"));
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) paths.push_back(p);
  std::vector<std::string> read = paths;
  read.push_back(cfg.get_string("tokenizer_path"));
  check_output_file("output", out_path, read, is_tokens_file, "tokens file");
  auto tok = make_tokenizer(cfg.get_string("tokenizer_path"), cfg.get_string("tokenizer_type"));
  const auto t0 = std::chrono::steady_clock::now();
  const bool strict = cfg.get_bool("data_strict");
  // Lines that are not a JSON object with the field: refused, or skipped and counted.
  size_t line_skips = 0;
  std::string first_line_skip;
  DocumentReader reader(
      paths, cfg.get_string("train_data_columns"), "input", [&](const std::string& why) {
        if (strict) throw UsageError(why + ". With data_strict=false such lines are skipped.");
        if (line_skips++ == 0) first_line_skip = why;
      });
  const int32_t bos = cfg.get_bool("add_bos") ? tok->bos_id() : -1;
  const int32_t eos = cfg.get_bool("add_eos") ? tok->eos_id() : -1;
  const uint32_t width = tok->vocab_size() <= 65536 ? 2 : 4;
  const bool tty = isatty(fileno(stderr));
  // num_threads, as for every command (0 = the cores; before: always the cores).
  const unsigned n = cfg.get_int("num_threads") > 0
                         ? static_cast<unsigned>(cfg.get_int("num_threads"))
                         : std::max(1u, std::thread::hardware_concurrency());

  // The file is written under a temporary name, a chunk at a time, and renamed at the end, so a
  // failure leaves nothing behind.
  const std::string tmp = out_path + ".tmp";
  struct RemoveOnFailure {
    const std::string& path;
    bool keep = false;
    ~RemoveOnFailure() {
      std::error_code ec;
      if (!keep) fs::remove(path, ec);
    }
  } tmp_guard{tmp};
  std::ofstream f(tmp, std::ios::binary);
  if (!f) throw Error(fmt::format("cannot write {}: {}.", tmp, std::strerror(errno)));
  auto check_written = [&](const char* what) {
    if (!f)
      throw Error(fmt::format("writing {} failed ({}): {}.", tmp, what, std::strerror(errno)));
  };
  const uint32_t version = 1, none = 0xFFFFFFFFu;
  uint64_t count = 0;  // patched at the end
  {
    const uint32_t e = eos >= 0 ? static_cast<uint32_t>(eos) : none;
    const uint32_t b = bos >= 0 ? static_cast<uint32_t>(bos) : none;
    f.write("MTTOKENS", 8);
    f.write(reinterpret_cast<const char*>(&version), 4);
    f.write(reinterpret_cast<const char*>(&width), 4);
    f.write(reinterpret_cast<const char*>(&count), 8);
    f.write(reinterpret_cast<const char*>(&e), 4);
    f.write(reinterpret_cast<const char*>(&b), 4);
    check_written("header");
  }

  const size_t max_chunk = document_chunk_bytes();
  size_t kept = 0, seen = 0, skipped = 0;
  std::string first_skip;
  std::vector<Document> docs;
  TokenizedDocuments chunk;
  std::vector<char> out;
  auto append = [&](int32_t id) {
    const uint32_t x = static_cast<uint32_t>(id);
    const size_t at = out.size();
    out.resize(at + width);
    if (width == 2) {
      const uint16_t h = static_cast<uint16_t>(x);
      std::memcpy(out.data() + at, &h, 2);
    } else {
      std::memcpy(out.data() + at, &x, 4);
    }
  };
  while (reader.next(docs, max_chunk)) {
    tokenize_documents(docs, *tok, n, chunk);
    out.clear();
    for (size_t i = 0; i < docs.size(); ++i) {
      if (!chunk.refused[i].empty()) {
        // A document the tokenizer refuses (text that is not UTF-8); with data_strict=false
        // every such document is skipped.
        const std::string why = docs[i].where + ": " + chunk.refused[i];
        if (strict) throw UsageError(why + ". With data_strict=false such documents are skipped.");
        if (skipped++ == 0) first_skip = why;
        continue;
      }
      ++kept;
      if (bos >= 0) append(bos);
      for (int32_t id : chunk.ids[i]) append(id);
      if (eos >= 0) append(eos);
      count += chunk.ids[i].size() + (bos >= 0) + (eos >= 0);
    }
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    check_written("tokens");
    seen += docs.size();
    if (tty)
      std::fprintf(stderr, "\rmt tokenize: %zu documents, %.1f MB", seen,
                   static_cast<double>(reader.bytes()) / 1e6);
  }
  if (tty) std::fprintf(stderr, "\r");
  // Skipped lines (the reader's, in input order) and skipped documents (the tokenizer's).
  skipped += line_skips;
  if (!first_line_skip.empty()) first_skip = first_line_skip;
  if (skipped > 0)
    std::fprintf(stderr,
                 "mt tokenize: warning: skipped %zu malformed line(s) or document(s) "
                 "(data_strict=false); the first: %s.\n",
                 skipped, first_skip.c_str());
  if (kept == 0)
    throw UsageError(
        skipped > 0 ? fmt::format("input={} holds no documents but the {} skipped ones.",
                                  cfg.get_string("input"), skipped)
                    : fmt::format("input={} holds no documents (only empty files or blank lines).",
                                  cfg.get_string("input")));
  // A tokens file marks its documents by their eos (or bos) ids alone: without either, its
  // documents are read back as one stream (packed rows attend across them). Said, not refused:
  // a corpus meant as one stream is a choice.
  if (bos < 0 && eos < 0 && kept > 1)
    std::fprintf(stderr,
                 "mt tokenize: warning: no bos or eos id is written (add_bos=%s, add_eos=%s, the "
                 "tokenizer's bos %d, eos %d), so the %zu documents are not marked: "
                 "dataset_type=tokens reads them as one stream. Set add_eos=true (or add_bos) to "
                 "keep them apart.\n",
                 cfg.get_bool("add_bos") ? "true" : "false",
                 cfg.get_bool("add_eos") ? "true" : "false", tok->bos_id(), tok->eos_id(), kept);
  f.seekp(16);
  f.write(reinterpret_cast<const char*>(&count), 8);
  f.flush();
  check_written("token count");
  f.close();
  check_written("close");
  std::error_code ec;
  fs::rename(tmp, out_path, ec);
  if (ec) throw Error(fmt::format("cannot write {}: {}.", out_path, ec.message()));
  tmp_guard.keep = true;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf(
      "mt tokenize: %zu documents, %.2f MB of text -> %zu tokens (uint%u) in %s; %.1f MB/s "
      "on %u thread%s\n",
      kept, static_cast<double>(reader.bytes()) / 1e6, static_cast<size_t>(count), width * 8,
      out_path.c_str(), static_cast<double>(reader.bytes()) / 1e6 / s, n, n == 1 ? "" : "s");
  return 0;
}

}  // namespace mt::cli
