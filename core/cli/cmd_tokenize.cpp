// mt tokenize: text or JSON-lines files -> the `tokens` format (data/README.md) that
// dataset_type=tokens memory-maps. Documents are tokenized in parallel on all cores.
//   mt tokenize tokenizer_path=FILE input=FILE[,FILE...] output=FILE.tokens
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
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

// Every document of the inputs: a .jsonl/.json file gives one per line (the train_data_columns
// field), any other file is one document.
std::vector<std::string> read_documents(const std::vector<std::string>& paths,
                                        const std::string& field, size_t& bytes) {
  std::vector<std::string> docs;
  bytes = 0;
  for (const auto& p : paths) {
    const std::string ext = fs::path(p).extension().string();
    if (ext != ".jsonl" && ext != ".json") {
      docs.push_back(read_file(p, "input", kMaxRecordBytes));
      bytes += docs.back().size();
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
        throw UsageError(fmt::format("{}:{}: not a JSON line ({} at byte {}).", p, line_no, e.what,
                                     e.offset));
      }
      const json::Value* f = v.is_object() ? v.find(field) : nullptr;
      if (!f || !f->is_string())
        throw UsageError(fmt::format("{}:{}: no string field \"{}\" (set train_data_columns).", p,
                                     line_no, field));
      docs.push_back(f->str);
    }
  }
  return docs;
}

}  // namespace

int cmd_tokenize(const Args& args) {
  const Config cfg = resolve_config(args);
  const std::string out_path = cfg.get_string("output");
  if (cfg.get_string("input").empty() || out_path.empty())
    throw UsageError("mt tokenize needs input=<file[,file...]> and output=<file.tokens>.");
  if (cfg.get_string("tokenizer_path").empty())
    throw UsageError("mt tokenize needs tokenizer_path=<tokenizer.json or tokenizer.model>.");
  auto tok = make_tokenizer(cfg.get_string("tokenizer_path"), cfg.get_string("tokenizer_type"));
  std::vector<std::string> paths;
  std::stringstream ss(cfg.get_string("input"));
  for (std::string p; std::getline(ss, p, ',');)
    if (!p.empty()) paths.push_back(p);
  const auto t0 = std::chrono::steady_clock::now();
  size_t bytes = 0;
  const std::vector<std::string> docs = read_documents(paths, cfg.get_string("train_data_columns"), bytes);
  if (docs.empty()) throw UsageError("mt tokenize: the input holds no documents.");
  const int32_t bos = cfg.get_bool("add_bos") ? tok->bos_id() : -1;
  const int32_t eos = cfg.get_bool("add_eos") ? tok->eos_id() : -1;
  // Documents are dealt to threads in small blocks taken in turn; results land in place, so the
  // output order does not depend on scheduling.
  std::vector<std::vector<int32_t>> ids(docs.size());
  std::atomic<size_t> next{0}, done{0};
  const bool tty = isatty(fileno(stderr));
  std::vector<std::thread> threads;
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  std::string failure;
  std::mutex failure_mu;
  for (unsigned t = 0; t < n; ++t)
    threads.emplace_back([&] {
      try {
        for (size_t i; (i = next.fetch_add(1)) < docs.size();) {
          auto& v = ids[i];
          if (bos >= 0) v.push_back(bos);
          const auto e = tok->encode(docs[i]);
          v.insert(v.end(), e.begin(), e.end());
          if (eos >= 0) v.push_back(eos);
          ++done;
        }
      } catch (const std::exception& e) {
        std::lock_guard<std::mutex> lock(failure_mu);
        failure = e.what();
        next = docs.size();
      }
    });
  while (tty && done < docs.size() && failure.empty()) {
    std::fprintf(stderr, "\rmt tokenize: %zu/%zu documents", done.load(), docs.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (auto& t : threads) t.join();
  if (!failure.empty()) throw Error("mt tokenize: " + failure);
  size_t count = 0;
  for (const auto& v : ids) count += v.size();
  const uint32_t width = tok->vocab_size() <= 65536 ? 2 : 4;
  // The file is written under a temporary name and renamed, so a failure leaves nothing behind.
  const std::string tmp = out_path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw Error("mt tokenize: cannot write " + tmp + ".");
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
    if (!f.flush()) throw Error("mt tokenize: writing " + tmp + " failed.");
  }
  fs::rename(tmp, out_path);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::fprintf(stderr, "%s", tty ? "\r" : "");
  std::printf("mt tokenize: %zu documents, %.2f MB of text -> %zu tokens (uint%u) in %s; %.1f MB/s "
              "on %u threads\n",
              docs.size(), static_cast<double>(bytes) / 1e6, count, width * 8, out_path.c_str(),
              static_cast<double>(bytes) / 1e6 / s, n);
  return 0;
}

}  // namespace mt::cli
