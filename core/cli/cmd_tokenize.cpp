// mt tokenize: text or JSON-lines files -> the `tokens` format (data/README.md) that
// dataset_type=tokens memory-maps. Documents are tokenized in parallel on all cores.
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
#include "file_util.h"
#include "json.h"
#include "mt/error.h"
#include "mt/tokenizer.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt::cli {

namespace {

// One document and where it came from ("file:line" for a JSON line, the file otherwise).
struct Document {
  std::string text, where;
};

// Every document of the inputs: a .jsonl/.json file gives one per line (the train_data_columns
// field), any other file is one document. A malformed line is refused with its file and line, or
// with `strict` false (data_strict=false) skipped and counted in `skipped` (the first one's reason
// in `first_skip`).
std::vector<Document> read_documents(const std::vector<std::string>& paths,
                                     const std::string& field, bool strict, size_t& bytes,
                                     size_t& skipped, std::string& first_skip) {
  std::vector<Document> docs;
  bytes = 0;
  auto bad = [&](const std::string& why) {
    if (strict) throw UsageError(why + ". With data_strict=false such lines are skipped.");
    if (skipped++ == 0) first_skip = why;
  };
  for (const auto& p : paths) {
    const std::string ext = fs::path(p).extension().string();
    if (ext != ".jsonl" && ext != ".json") {
      docs.push_back({read_file(p, "input", kMaxRecordBytes), p});
      bytes += docs.back().text.size();
      continue;
    }
    // Line by line, each bounded: a corpus may be larger than any one read should be.
    LineReader in(p, "input", kMaxRecordBytes);
    for (std::string_view line; in.next(line);) {
      const uint64_t line_no = in.line_number();
      bytes += line.size() + 1;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      json::Value v;
      try {
        v = json::parse(line);
      } catch (const json::ParseError& e) {
        bad(fmt::format("{}:{}: not a JSON line ({} at byte {})", p, line_no, e.what, e.offset));
        continue;
      }
      const json::Value* f = v.is_object() ? v.find(field) : nullptr;
      if (!f || !f->is_string()) {
        bad(fmt::format("{}:{}: no string field \"{}\" (set train_data_columns)", p, line_no,
                        field));
        continue;
      }
      docs.push_back({f->str, fmt::format("{}:{}", p, line_no)});
    }
  }
  return docs;
}

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
  size_t bytes = 0, skipped = 0;
  std::string first_skip;
  std::vector<Document> docs = read_documents(paths, cfg.get_string("train_data_columns"), strict,
                                              bytes, skipped, first_skip);
  const int32_t bos = cfg.get_bool("add_bos") ? tok->bos_id() : -1;
  const int32_t eos = cfg.get_bool("add_eos") ? tok->eos_id() : -1;
  // A tokens file marks its documents by their eos (or bos) ids alone: without either, its
  // documents are read back as one stream (packed rows attend across them). Said, not refused:
  // a corpus meant as one stream is a choice.
  if (bos < 0 && eos < 0 && docs.size() > 1)
    std::fprintf(stderr,
                 "mt tokenize: warning: no bos or eos id is written (add_bos=%s, add_eos=%s, the "
                 "tokenizer's bos %d, eos %d), so the %zu documents are not marked: "
                 "dataset_type=tokens reads them as one stream. Set add_eos=true (or add_bos) to "
                 "keep them apart.\n",
                 cfg.get_bool("add_bos") ? "true" : "false",
                 cfg.get_bool("add_eos") ? "true" : "false", tok->bos_id(), tok->eos_id(),
                 docs.size());
  // Documents are dealt to threads in small blocks taken in turn; results land in place, so the
  // output order does not depend on scheduling.
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::atomic<size_t> next{0}, done{0};
  const bool tty = isatty(fileno(stderr));
  std::vector<std::thread> threads;
  // num_threads, as for every command (0 = the cores; before: always the cores).
  const unsigned n = cfg.get_int("num_threads") > 0
                         ? static_cast<unsigned>(cfg.get_int("num_threads"))
                         : std::max(1u, std::thread::hardware_concurrency());
  // A document the tokenizer refuses (text that is not UTF-8): its index and the reason, the
  // first in document order; with data_strict=false every such document is skipped.
  std::vector<std::string> refused(docs.size());
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
      ++done;
    }
  };
  // A thread that cannot be started (a process limit) ends the command with the reason; the
  // ones started are joined first (before: their destructors called std::terminate).
  try {
    for (unsigned t = 0; t < n; ++t) threads.emplace_back(work);
  } catch (const std::system_error& e) {
    stop = true;
    for (auto& t : threads) t.join();
    throw Error(std::string("mt tokenize cannot start its threads: ") + e.what() +
                " (a limit on processes or memory: ulimit -u, ulimit -v).");
  }
  while (tty && done < docs.size() && !stop) {
    std::fprintf(stderr, "\rmt tokenize: %zu/%zu documents", done.load(), docs.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& t : threads) t.join();
  if (out_of_memory)
    throw Error("mt tokenize ran out of memory while tokenizing (" + std::to_string(docs.size()) +
                " documents held at once): tokenize the input in parts, or raise the memory "
                "limit. Nothing was written.");
  size_t kept = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    if (refused[i].empty()) {
      ++kept;
      continue;
    }
    const std::string why = docs[i].where + ": " + refused[i];
    if (strict) throw UsageError(why + ". With data_strict=false such documents are skipped.");
    if (skipped++ == 0) first_skip = why;
  }
  if (skipped > 0)
    std::fprintf(stderr,
                 "mt tokenize: warning: skipped %zu malformed line(s) or document(s) "
                 "(data_strict=false); the first: %s.\n",
                 skipped, first_skip.c_str());
  if (kept == 0) throw UsageError("the input holds no documents.");
  size_t count = 0;
  for (const auto& v : ids) count += v.size();
  const uint32_t width = tok->vocab_size() <= 65536 ? 2 : 4;
  // The file is written under a temporary name and renamed, so a failure leaves nothing behind.
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw Error(fmt::format("cannot write {}: {}.", tmp, std::strerror(errno)));
    const uint32_t version = 1, none = 0xFFFFFFFFu;
    const uint64_t cnt = count;
    const uint32_t e = eos >= 0 ? static_cast<uint32_t>(eos) : none;
    const uint32_t b = bos >= 0 ? static_cast<uint32_t>(bos) : none;
    f.write("MTTOKENS", 8);
    f.write(reinterpret_cast<const char*>(&version), 4);
    f.write(reinterpret_cast<const char*>(&width), 4);
    f.write(reinterpret_cast<const char*>(&cnt), 8);
    f.write(reinterpret_cast<const char*>(&e), 4);
    f.write(reinterpret_cast<const char*>(&b), 4);
    for (const auto& v : ids)
      for (int32_t id : v) {
        if (width == 2) {
          const uint16_t x = static_cast<uint16_t>(id);
          f.write(reinterpret_cast<const char*>(&x), 2);
        } else {
          const uint32_t x = static_cast<uint32_t>(id);
          f.write(reinterpret_cast<const char*>(&x), 4);
        }
      }
    if (!f.flush()) {
      const std::string why = std::strerror(errno);
      f.close();
      fs::remove(tmp);
      throw Error(fmt::format("writing {} failed: {}.", tmp, why));
    }
  }
  std::error_code ec;
  fs::rename(tmp, out_path, ec);
  if (ec) {
    fs::remove(tmp);
    throw Error(fmt::format("cannot write {}: {}.", out_path, ec.message()));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "%s", tty ? "\r" : "");
  std::printf(
      "mt tokenize: %zu documents, %.2f MB of text -> %zu tokens (uint%u) in %s; %.1f MB/s "
      "on %u thread%s\n",
      kept, static_cast<double>(bytes) / 1e6, count, width * 8, out_path.c_str(),
      static_cast<double>(bytes) / 1e6 / s, n, n == 1 ? "" : "s");
  return 0;
}

}  // namespace mt::cli
