// dataset_type=text: plain-text and JSON-lines files, tokenized when the source is made.
//
// Files. dataset_path is a file, a comma-separated list, a directory (its .txt, .jsonl and
// .json files, sorted) or glob patterns. A .jsonl/.json file holds one JSON object per line and
// each object is one document: its train_data_columns field (default "text"), which must be a
// string; blank lines are skipped. Any other file is one document as a whole (UTF-8 text; an
// empty file is none).
//
// Tokens. Each document is tokenized by the run's tokenizer (tokenizer_path), with the
// tokenizer's BOS before it when add_bos and its EOS after it when add_eos. The files are read
// and tokenized 16 MB of text at a time (mt/documents.h); the ids of all documents are kept in
// memory as one stream with the document starts marked, so documents are separate segments when
// packed whether or not they carry BOS/EOS. For corpora whose ids are too large to hold, tokenize
// once into the `tokens` format and use dataset_type=tokens.
//
// Rows, order, eval split (eval_split or eval_dataset_path), sharding, prefetch and state:
// exactly as dataset_type=tokens (../common/row_source.h).
//
// Errors name the file, and for JSON lines the line: a missing file, malformed JSON, a missing
// or non-string field, text that is not UTF-8, a tokenizer larger than vocab_size. With
// data_strict=false (default true) a bad record (a malformed or incomplete JSON line, a
// document that is not UTF-8) is skipped instead, and one warning on stderr counts them.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../common/paths.h"
#include "../common/row_source.h"
#include "mt/config.h"
#include "mt/data.h"
#include "mt/documents.h"
#include "mt/error.h"
#include "mt/plugin.h"
#include "mt/tokenizer.h"

namespace {

struct TextOptions {
  std::string field = "text";
  bool strict = true;  // data_strict: a bad record is an error rather than skipped
  bool add_bos = true, add_eos = true;
  int32_t bos = -1, eos = -1;
  int64_t vocab = 0;
  int64_t threads = 0;  // num_threads: tokenizing threads (0 = the cores)
};

// Records skipped with data_strict=false, for the warning.
struct Skipped {
  uint64_t count = 0;
  std::string first;  // the first one's message

  // Throws `msg` when strict; otherwise counts it.
  void bad_record(const std::string& msg, bool strict) {
    if (strict) throw mt::UsageError(msg);
    if (count++ == 0) first = msg;
  }
};

// The documents of a split, tokenized, as one in-memory stream.
class TextStream final : public mt_data::TokenStream {
 public:
  TextStream(const std::vector<std::string>& files, const mt::Tokenizer& tok,
             const TextOptions& opt) {
    mt::DocumentReader reader(files, opt.field, "text", [&](const std::string& why) {
      skipped_.bad_record("text: " + why, opt.strict);
    });
    const size_t chunk_bytes = mt::document_chunk_bytes();
    mt::TokenizedDocuments chunk;
    for (std::vector<mt::Document> docs; reader.next(docs, chunk_bytes);)
      append(docs, chunk, tok, opt);
    for (const auto& f : files) describe_ += (describe_.empty() ? "" : ", ") + f;
  }

  uint64_t size() const override { return ids_.size(); }

  void read(uint64_t begin, uint64_t n, int32_t* ids, uint8_t* doc_start) const override {
    std::copy_n(ids_.begin() + static_cast<long>(begin), n, ids);
    auto d = std::lower_bound(doc_begin_.begin(), doc_begin_.end(), begin);
    for (uint64_t i = 0; i < n; ++i) {
      const bool start = d != doc_begin_.end() && *d == begin + i;
      doc_start[i] = start ? 1 : 0;
      if (start) ++d;
    }
  }

  std::vector<std::pair<uint64_t, uint64_t>> documents() const override {
    std::vector<std::pair<uint64_t, uint64_t>> out;
    for (size_t i = 0; i < doc_begin_.size(); ++i)
      out.emplace_back(doc_begin_[i], i + 1 < doc_begin_.size() ? doc_begin_[i + 1] : ids_.size());
    return out;
  }

  std::string describe() const override { return describe_; }
  const Skipped& skipped() const { return skipped_; }

 private:
  // Tokenizes a chunk of documents on num_threads threads, then appends them in order.
  void append(const std::vector<mt::Document>& docs, mt::TokenizedDocuments& chunk,
              const mt::Tokenizer& tok, const TextOptions& opt) {
    mt::tokenize_documents(docs, tok, static_cast<unsigned>(std::max<int64_t>(opt.threads, 0)),
                           chunk);
    for (size_t i = 0; i < docs.size(); ++i) {
      // The first refused document in file order, so the message does not depend on timing.
      if (!chunk.refused[i].empty()) {
        skipped_.bad_record("text: " + docs[i].where + ": " + chunk.refused[i], opt.strict);
        continue;
      }
      const uint64_t begin = ids_.size();
      if (opt.add_bos) ids_.push_back(opt.bos);
      ids_.insert(ids_.end(), chunk.ids[i].begin(), chunk.ids[i].end());
      if (opt.add_eos) ids_.push_back(opt.eos);
      for (uint64_t j = begin; j < ids_.size(); ++j)
        if (ids_[j] < 0 || ids_[j] >= opt.vocab)
          throw mt::UsageError("text: " + docs[i].where + ": token id " + std::to_string(ids_[j]) +
                               " is outside vocab_size " + std::to_string(opt.vocab));
      if (ids_.size() > begin)
        doc_begin_.push_back(begin);  // an empty document without BOS/EOS
                                      // adds nothing
    }
  }

  std::vector<int32_t> ids_;
  std::vector<uint64_t> doc_begin_;  // ascending
  std::string describe_;
  Skipped skipped_;
};

// With data_strict=false, one line for all records a split skipped: a million-line corpus with
// one bad line trains, and says so.
void warn_skipped(const TextStream& s, const char* split) {
  if (s.skipped().count == 0) return;
  std::fprintf(stderr,
               "warning: text: skipped %llu bad record(s) of the %s data (%s); the first: %s. Set "
               "data_strict=true to make this an error.\n",
               static_cast<unsigned long long>(s.skipped().count), split, s.describe().c_str(),
               s.skipped().first.c_str());
}

std::string data_column(const mt::Config& cfg) {
  if (!cfg.has("train_data_columns")) return "text";
  std::vector<std::string> cols;
  try {
    cols = {cfg.get_string("train_data_columns")};
  } catch (const mt::UsageError&) {
    cols = cfg.get_string_list("train_data_columns");  // MaxText writes it as a list
  }
  if (cols.size() != 1 || cols[0].empty())
    cfg.reject("train_data_columns", "must name exactly one field for dataset_type=text");
  return cols[0];
}

std::unique_ptr<mt::DatasetSource> make_text_source(const mt::Config& cfg,
                                                    const mt::DataShard& shard,
                                                    const mt::Tokenizer* tok) {
  const auto st = mt_data::RowSource::read_settings(cfg, shard, "text");
  if (!tok)
    throw mt::UsageError(
        "dataset_type=text needs tokenizer_path: the tokenizer.json or tokenizer.model that "
        "turns the text into ids");
  const std::string path = mt_data::string_or(cfg, "dataset_path", "");
  if (path.empty())
    throw mt::UsageError(
        "dataset_type=text needs dataset_path: a .txt or .jsonl file, a comma-separated list, a "
        "directory or a glob");
  if (tok->vocab_size() > st.vocab)
    cfg.reject("vocab_size", "is smaller than the tokenizer's vocabulary (" +
                                 std::to_string(tok->vocab_size()) + " ids)");
  TextOptions opt;
  opt.field = data_column(cfg);
  opt.add_bos = mt_data::bool_or(cfg, "add_bos", true);
  opt.add_eos = mt_data::bool_or(cfg, "add_eos", true);
  opt.bos = tok->bos_id();
  opt.eos = tok->eos_id();
  opt.vocab = st.vocab;
  opt.strict = mt_data::bool_or(cfg, "data_strict", true);
  opt.threads = mt_data::int_or(cfg, "num_threads", 0);
  if (opt.add_bos && opt.bos < 0)
    cfg.reject("add_bos",
               "needs a tokenizer with a beginning-of-sequence token; this one has "
               "none (set add_bos=false)");
  if (opt.add_eos && opt.eos < 0)
    cfg.reject("add_eos",
               "needs a tokenizer with an end-of-sequence token; this one has none "
               "(set add_eos=false)");

  const std::vector<std::string> exts = {".txt", ".jsonl", ".json"};
  auto train = std::make_shared<const TextStream>(
      mt_data::expand_paths(path, "dataset_path", exts, "text or JSON-lines file"), *tok, opt);
  std::shared_ptr<const TextStream> eval;
  const std::string eval_path = mt_data::string_or(cfg, "eval_dataset_path", "");
  if (!eval_path.empty())
    eval = std::make_shared<const TextStream>(
        mt_data::expand_paths(eval_path, "eval_dataset_path", exts, "text or JSON-lines file"),
        *tok, opt);
  warn_skipped(*train, "training");
  if (eval) warn_skipped(*eval, "eval");
  return std::make_unique<mt_data::RowSource>(cfg, shard, "text", train, eval);
}

void register_all(mt::Registry& r) {
  r.add_dataset("text", [](const mt::Config& cfg, const mt::DataShard& shard,
                           const mt::Tokenizer* tok) { return make_text_source(cfg, shard, tok); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::data, "text", "0.1.0", register_all, nullptr)
