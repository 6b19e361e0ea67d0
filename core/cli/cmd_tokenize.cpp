// mt tokenize: text or JSON-lines files -> the `tokens` format (data/README.md) that
// dataset_type=tokens memory-maps. Documents are tokenized in parallel on num_threads threads, a
// chunk of the corpus at a time.
//   mt tokenize tokenizer_path=FILE input=FILE[,FILE...] output=FILE.tokens
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <new>
#include <sstream>
#include <system_error>
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
  std::vector<std::vector<int32_t>> ids;
  // A document the tokenizer refuses (text that is not UTF-8): the reason, by index in the chunk;
  // with data_strict=false every such document is skipped.
  std::vector<std::string> refused;
  std::vector<char> out;
  while (reader.next(docs, max_chunk)) {
    // Documents are dealt to threads in small blocks taken in turn; results land in place, so
    // the output order does not depend on scheduling.
    ids.assign(docs.size(), {});
    refused.assign(docs.size(), {});
    std::atomic<size_t> next{0};
    std::atomic<bool> stop{false}, out_of_memory{false};
    auto work = [&] {
      for (size_t i; !stop && (i = next.fetch_add(1)) < docs.size();) {
        try {
          auto& v = ids[i];
          if (bos >= 0) v.push_back(bos);
          const auto e = tok->encode(docs[i].text);
          v.insert(v.end(), e.begin(), e.end());
          if (eos >= 0) v.push_back(eos);
        } catch (const std::bad_alloc&) {
          // Never a malformed document: data_strict=false skipped every one it hit (242 of 256
          // under ulimit -v) and wrote the rest with exit 0.
          out_of_memory = stop = true;
        } catch (const std::exception& e) {
          try {
            refused[i] = e.what();
          } catch (const std::bad_alloc&) {
            out_of_memory = stop = true;  // (leaving the thread would be std::terminate)
          }
          ids[i].clear();
          if (strict) stop = true;
        }
      }
    };
    // A thread that cannot be started (a process limit) ends the command with the reason; the
    // ones started are joined first (before: their destructors called std::terminate).
    std::vector<std::thread> threads;
    try {
      for (unsigned t = 0; t < n; ++t) threads.emplace_back(work);
    } catch (const std::system_error& e) {
      stop = true;
      for (auto& t : threads) t.join();
      throw Error(std::string("mt tokenize cannot start its threads: ") + e.what() +
                  " (a limit on processes or memory: ulimit -u, ulimit -v).");
    }
    for (auto& t : threads) t.join();
    if (out_of_memory)
      throw Error(fmt::format(
          "mt tokenize ran out of memory while tokenizing ({} documents, {:.1f} MB of text held "
          "at once): raise the memory limit. Nothing was written.",
          docs.size(), static_cast<double>(max_chunk) / 1e6));
    out.clear();
    for (size_t i = 0; i < docs.size(); ++i) {
      if (!refused[i].empty()) {
        const std::string why = docs[i].where + ": " + refused[i];
        if (strict) throw UsageError(why + ". With data_strict=false such documents are skipped.");
        if (skipped++ == 0) first_skip = why;
        continue;
      }
      ++kept;
      for (int32_t id : ids[i]) {
        const uint32_t x = static_cast<uint32_t>(id);
        const size_t at = out.size();
        out.resize(at + width);
        if (width == 2) {
          const uint16_t h = static_cast<uint16_t>(x);
          std::memcpy(out.data() + at, &h, 2);
        } else {
          std::memcpy(out.data() + at, &x, 4);
        }
      }
      count += ids[i].size();
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
  if (kept == 0) throw UsageError("the input holds no documents.");
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
