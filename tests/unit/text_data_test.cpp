// dataset_type=text: text and JSON-lines files tokenized at load, batched like `tokens`.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "config_impl.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/tokenizer.h"
#include "test_support.h"
#include "tokenizer_factory.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using Pairs = std::vector<std::pair<std::string, std::string>>;
using Row = std::vector<int32_t>;

const Tokenizer& shipped() {
  static const auto tok = make_tokenizer(test::source_dir() + "/data/tokenizer.json", "");
  return *tok;
}

const std::vector<std::string> kDocs = {
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife.",
    "Emma Woodhouse, handsome, clever, and rich.",
    "\u201cMy dear Mr. Bennet,\u201d said his lady to him one day.",
    "Sir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own amusement, "
    "never took up any book but the Baronetage.",
    "No one who had ever seen Catherine Morland in her infancy would have supposed her born to be "
    "an heroine.",
    "The family of Dashwood had long been settled in Sussex.",
};

std::string json_quote(const std::string& s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (c == '\n') {
      o += "\\n";
      continue;
    }
    o += c;
  }
  return o + "\"";
}

class TextData : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / ("mt_text_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }
  std::string write(const std::string& name, const std::string& content) const {
    std::ofstream(file(name), std::ios::binary) << content;
    return file(name);
  }
  std::string write_jsonl(const std::string& name, const std::vector<std::string>& docs,
                          const std::string& field = "text") const {
    std::string s;
    for (const auto& d : docs) s += "{\"id\": 3, \"" + field + "\": " + json_quote(d) + "}\n";
    return write(name, s);
  }

  static Pairs cfg(const std::string& path, Pairs extra = {}) {
    Pairs kv = {{"dataset_path", path},         {"vocab_size", "8192"}, {"max_target_length", "8"},
                {"per_device_batch_size", "1"}, {"packing", "true"},    {"eval_split", "0.0"},
                {"data_shuffle_seed", "3"},     {"add_bos", "true"},    {"add_eos", "true"}};
    for (auto& e : extra) {  // (no structured binding: clang before 16 cannot capture one)
      const auto& k = e.first;
      const auto& v = e.second;
      auto it = std::find_if(kv.begin(), kv.end(), [&](auto& p) { return p.first == k; });
      if (it != kv.end())
        it->second = v;
      else
        kv.emplace_back(k, v);
    }
    return kv;
  }

  static std::unique_ptr<DatasetSource> make(const Pairs& kv, const Tokenizer* tok = &shipped(),
                                             int rank = 0, int count = 1) {
    DataShard shard;
    shard.rank = rank;
    shard.count = count;
    return test::plugins().dataset_factory("text")(config_from_pairs(kv), shard, tok);
  }

  fs::path dir_;
};

HostBatch next_batch(DatasetSource& s, bool eval = false) {
  HostBatch b;
  EXPECT_TRUE(s.next(b, eval));
  return b;
}

Row field(const HostBatch& b, const std::vector<int32_t>& f, int64_t r) {
  return {f.begin() + r * b.seq, f.begin() + (r + 1) * b.seq};
}
// A row's identity: inputs, targets, segment ids, positions.
Row row(const HostBatch& b, int64_t r) {
  Row v;
  for (const auto* f : {&b.inputs, &b.targets, &b.segment_ids, &b.positions}) {
    Row x = field(b, *f, r);
    v.insert(v.end(), x.begin(), x.end());
  }
  return v;
}
std::vector<Row> rows(DatasetSource& s, int batches, bool eval = false) {
  std::vector<Row> out;
  for (int i = 0; i < batches; ++i) {
    HostBatch b = next_batch(s, eval);
    for (int64_t r = 0; r < b.batch; ++r) out.push_back(row(b, r));
  }
  return out;
}

// The packed rows the documents must give, built independently of the plugin: the stream of
// [bos] ids [eos] per document, cut into rows of T+1 ids with stride T.
std::vector<Row> expected_packed_rows(const std::vector<std::string>& docs, const Tokenizer& tok,
                                      int64_t T, bool bos, bool eos) {
  std::vector<int32_t> stream;
  std::vector<uint8_t> start;
  for (const auto& d : docs) {
    std::vector<int32_t> ids = tok.encode(d);
    if (bos) ids.insert(ids.begin(), tok.bos_id());
    if (eos) ids.push_back(tok.eos_id());
    for (size_t i = 0; i < ids.size(); ++i) {
      stream.push_back(ids[i]);
      start.push_back(i == 0);
    }
  }
  std::vector<Row> out;
  const size_t n_rows = (stream.size() - 1) / static_cast<size_t>(T);
  for (size_t k = 0; k < n_rows; ++k) {
    Row in, tg, seg, pos;
    int32_t s = 1, p = 0;
    for (size_t j = 0; j < static_cast<size_t>(T); ++j) {
      const size_t g = k * static_cast<size_t>(T) + j;
      if (j > 0 && start[g]) ++s, p = 0;
      in.push_back(stream[g]);
      tg.push_back(start[g + 1] ? -1 : stream[g + 1]);
      seg.push_back(s);
      pos.push_back(p++);
    }
    Row r = in;
    for (const Row* x : {&tg, &seg, &pos}) r.insert(r.end(), x->begin(), x->end());
    out.push_back(r);
  }
  return out;
}

TEST_F(TextData, JsonLinesPackedWithBosAndEos) {
  const std::string path = write_jsonl("a.jsonl", kDocs);
  for (const auto& [bos, eos] : std::vector<std::pair<bool, bool>>{
           {true, true}, {false, true}, {true, false}, {false, false}}) {
    SCOPED_TRACE("add_bos=" + std::to_string(bos) + " add_eos=" + std::to_string(eos));
    auto want = expected_packed_rows(kDocs, shipped(), 8, bos, eos);
    auto s =
        make(cfg(path, {{"add_bos", bos ? "true" : "false"}, {"add_eos", eos ? "true" : "false"}}));
    EXPECT_EQ(s->name(), "text");
    auto got = rows(*s, static_cast<int>(want.size()));  // one epoch
    std::sort(got.begin(), got.end());
    std::sort(want.begin(), want.end());
    EXPECT_EQ(got, want);
  }
}

TEST_F(TextData, UnpackedRowsAreWholeDocumentsWithBosAndEos) {
  const std::vector<std::string> docs = {"Emma", "Mr. Knightley", "Harriet Smith"};
  const std::string path = write_jsonl("a.jsonl", docs);
  auto s = make(cfg(
      path, {{"packing", "false"}, {"max_target_length", "16"}, {"per_device_batch_size", "3"}}));
  HostBatch b = next_batch(*s);
  std::set<Row> got, want;
  for (int64_t r = 0; r < 3; ++r) {
    Row in = field(b, b.inputs, r), tg = field(b, b.targets, r);
    const auto n = static_cast<size_t>(std::count_if(b.segment_ids.begin() + r * 16,
                                                     b.segment_ids.begin() + (r + 1) * 16,
                                                     [](int32_t x) { return x == 1; }));
    Row doc(in.begin(), in.begin() + static_cast<long>(n));
    doc.push_back(tg[n - 1]);  // the last target is the document's last id (its eos)
    got.insert(doc);
  }
  for (const auto& d : docs) {
    Row ids = shipped().encode(d);
    ids.insert(ids.begin(), 0);
    ids.push_back(1);
    want.insert(ids);
  }
  EXPECT_EQ(got, want);
}

TEST_F(TextData, PlainTextFilesDirectoriesGlobsAndLists) {
  write("b.txt", kDocs[1]);
  write("a.txt", kDocs[0] + "\n\n" + kDocs[2]);  // one document per file, blank lines included
  write("skip.dat", "not read from a directory");
  const std::vector<std::string> in_order = {kDocs[0] + "\n\n" + kDocs[2], kDocs[1]};
  auto want = expected_packed_rows(in_order, shipped(), 8, true, true);
  std::sort(want.begin(), want.end());
  for (const std::string& spec :
       {dir_.string(), file("*.txt"), file("a.txt") + " , " + file("b.txt")}) {
    SCOPED_TRACE(spec);
    auto s = make(cfg(spec));
    auto got = rows(*s, static_cast<int>(want.size()));
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, want);
  }
}

TEST_F(TextData, TrainDataColumnsAndSentencePiece) {
  const std::string path = write_jsonl("a.jsonl", kDocs, "body");
  auto sp = make_tokenizer(test::source_dir() + "/tests/golden/tokenizer/sp.model", "");
  auto want = expected_packed_rows(kDocs, *sp, 8, true, true);
  EXPECT_EQ(sp->bos_id(), 1);  // sentencepiece's own ids, not the shipped tokenizer's
  EXPECT_EQ(want.front()[0], 1);
  auto s = make(cfg(path, {{"train_data_columns", "body"}, {"vocab_size", "1000"}}), sp.get());
  auto got = rows(*s, static_cast<int>(want.size()));
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

TEST_F(TextData, EvalSplitAndEvalPath) {
  std::vector<std::string> many;
  for (int i = 0; i < 8; ++i) many.insert(many.end(), kDocs.begin(), kDocs.end());
  const std::string path = write_jsonl("a.jsonl", many);
  const auto all = expected_packed_rows(many, shipped(), 8, true, true);
  const size_t n_eval = all.size() / 4, n_train = all.size() - n_eval;
  auto s = make(cfg(path, {{"eval_split", "0.25"}, {"per_device_batch_size", "2"}}));
  std::vector<Row> eval, again;
  HostBatch b;
  while (s->next(b, true))
    for (int64_t r = 0; r < b.batch; ++r) eval.push_back(row(b, r));
  next_batch(*s);
  while (s->next(b, true))
    for (int64_t r = 0; r < b.batch; ++r) again.push_back(row(b, r));
  EXPECT_EQ(eval, again);
  // The eval rows are the last rows of the stream in order (a padded last batch aside).
  eval.resize(n_eval);
  EXPECT_EQ(eval, std::vector<Row>(all.begin() + static_cast<long>(n_train), all.end()));
  // Training covers exactly the other rows in an epoch.
  auto t = make(cfg(path, {{"eval_split", "0.25"}}));
  auto train = rows(*t, static_cast<int>(n_train));
  std::sort(train.begin(), train.end());
  std::vector<Row> want(all.begin(), all.begin() + static_cast<long>(n_train));
  std::sort(want.begin(), want.end());
  EXPECT_EQ(train, want);

  // eval_dataset_path: its own files.
  const std::string ev = write("eval.txt", kDocs[3]);
  auto e = make(cfg(path, {{"eval_dataset_path", ev}}));
  auto ev_rows = rows(*e, 1, true);
  auto ev_want = expected_packed_rows({kDocs[3]}, shipped(), 8, true, true);
  EXPECT_EQ(ev_rows[0], ev_want[0]);
}

TEST_F(TextData, StateRestoreAndSharding) {
  std::vector<std::string> many;
  for (int i = 0; i < 5; ++i) many.insert(many.end(), kDocs.begin(), kDocs.end());
  const std::string path = write_jsonl("a.jsonl", many);
  auto a = make(cfg(path, {{"per_device_batch_size", "2"}}));
  rows(*a, 7);
  const std::string st = a->state();
  auto next_a = rows(*a, 5);
  auto b = make(cfg(path, {{"per_device_batch_size", "2"}}));
  b->restore(st);
  EXPECT_EQ(rows(*b, 5), next_a);
  EXPECT_THROW(b->restore("nonsense"), Error);

  // Two ranks: disjoint batches whose union, interleaved, is the single-rank stream.
  auto one = make(cfg(path, {{"per_device_batch_size", "2"}}));
  auto r0 = make(cfg(path, {{"per_device_batch_size", "2"}}), &shipped(), 0, 2);
  auto r1 = make(cfg(path, {{"per_device_batch_size", "2"}}), &shipped(), 1, 2);
  auto single = rows(*one, 8);
  std::vector<Row> merged;
  for (int i = 0; i < 4; ++i) {
    auto x = rows(*r0, 1), y = rows(*r1, 1);
    merged.insert(merged.end(), x.begin(), x.end());
    merged.insert(merged.end(), y.begin(), y.end());
  }
  EXPECT_EQ(merged, single);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "no error";
}

TEST_F(TextData, ClearErrors) {
  const std::string good = write_jsonl("good.jsonl", kDocs);
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };
  std::string m = error_of([&] { make(cfg(good), nullptr); });
  EXPECT_TRUE(has(m, "dataset_type=text needs tokenizer_path")) << m;

  m = error_of([&] { make(cfg(file("missing.jsonl"))); });
  EXPECT_TRUE(has(m, file("missing.jsonl")) && has(m, "does not exist")) << m;

  m = error_of([&] { make(cfg(file("nothing*.jsonl"))); });
  EXPECT_TRUE(has(m, "matches no file")) << m;

  const std::string bad = write("bad.jsonl", "{\"text\": \"ok\"}\n\n{\"text\": \"unterminated}\n");
  m = error_of([&] { make(cfg(bad)); });
  EXPECT_TRUE(has(m, bad + ":3") && has(m, "malformed JSON")) << m;

  const std::string nofield = write("nofield.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
  m = error_of([&] { make(cfg(nofield)); });
  EXPECT_TRUE(has(m, nofield + ":2") && has(m, "no \"text\" field")) << m;

  const std::string notstr = write("notstr.jsonl", "{\"text\": 42}\n");
  m = error_of([&] { make(cfg(notstr)); });
  EXPECT_TRUE(has(m, notstr + ":1") && has(m, "not a string")) << m;

  const std::string latin1 = write("latin1.txt", "caf\xe9");
  m = error_of([&] { make(cfg(latin1)); });
  EXPECT_TRUE(has(m, latin1) && has(m, "not valid UTF-8")) << m;

  m = error_of([&] { make(cfg(good, {{"vocab_size", "1000"}})); });
  EXPECT_TRUE(has(m, "vocab_size") && has(m, "8192")) << m;

  const std::string empty = write("empty.jsonl", "\n\n");
  m = error_of([&] { make(cfg(empty)); });
  EXPECT_TRUE(has(m, "no training rows")) << m;
  // An eval set named that gives no row (before: every evaluation was left out silently).
  m = error_of([&] { make(cfg(good, {{"eval_dataset_path", empty}})); });
  EXPECT_TRUE(has(m, "eval_dataset_path") && has(m, empty) && has(m, "no eval rows")) << m;

  m = error_of([&] { make(cfg(good, {{"train_data_columns", ""}})); });
  EXPECT_TRUE(has(m, "train_data_columns")) << m;
}

// Issue 24, item 5: only regular files are read (dataset_path=/dev/zero grew to 16.8 GB in two
// minutes; a FIFO would block the open forever), and one record is bounded: a JSON line, or a
// whole text file, of more than 256 MiB is refused with the line it is on.
TEST_F(TextData, ReadsAreBounded) {
  auto has = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };
  std::string m = error_of([&] { make(cfg("/dev/zero")); });
  EXPECT_TRUE(has(m, "'/dev/zero' is not a regular file")) << m;
  const std::string fifo = file("pipe.jsonl");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  m = error_of([&] { make(cfg(fifo)); });
  EXPECT_TRUE(has(m, fifo) && has(m, "not a regular file")) << m;
  // Sparse files of zeros without a newline: nothing is written to disk.
  const std::string jsonl = write("long.jsonl", "{\"text\": \"ok\"}\n");
  fs::resize_file(jsonl, (uint64_t{256} << 20) + 100);
  m = error_of([&] { make(cfg(jsonl)); });
  EXPECT_TRUE(has(m, jsonl) && has(m, "line 2 is longer than 256 MiB")) << m;
  const std::string txt = write("long.txt", "text");
  fs::resize_file(txt, (uint64_t{256} << 20) + 1);
  m = error_of([&] { make(cfg(txt)); });
  EXPECT_TRUE(has(m, txt) && has(m, "larger than 256 MiB")) << m;
}

// A UTF-8 byte order mark at the start of a JSON-lines file (editors on Windows write one) is
// skipped, not refused as malformed JSON at byte 0; elsewhere U+FEFF stays text.
TEST_F(TextData, ByteOrderMarkAtTheFileStartIsSkipped) {
  std::string content = "\xEF\xBB\xBF";
  for (const auto& d : kDocs) content += "{\"text\": " + json_quote(d) + "}\n";
  auto s = make(cfg(write("bom.jsonl", content)));
  auto want = expected_packed_rows(kDocs, shipped(), 8, true, true);
  auto got = rows(*s, static_cast<int>(want.size()));
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  const std::string second =
      write("bom2.jsonl", "{\"text\": \"a\"}\n\xEF\xBB\xBF{\"text\": \"b\"}\n");
  const std::string m = error_of([&] { make(cfg(second)); });
  EXPECT_NE(m.find(second + ":2: not a JSON line: malformed JSON at column 1"), std::string::npos)
      << m;
}

TEST_F(TextData, NonStrictSkipsBadRecords) {
  std::string content;
  for (const auto& d : kDocs) content += "{\"text\": " + json_quote(d) + "}\n";
  content += "{\"text\": \"unterminated}\n{\"body\": \"x\"}\n{\"text\": 7}\n[1]\n";
  content += "{\"text\": \"caf\xe9\"}\n";
  const std::string path = write("mixed.jsonl", content);
  EXPECT_THROW(make(cfg(path)), Error);  // strict by default
  testing::internal::CaptureStderr();
  auto s = make(cfg(path, {{"data_strict", "false"}}));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("skipped 5 bad record(s)"), std::string::npos) << err;
  EXPECT_NE(err.find(path + ":7"), std::string::npos) << err;  // the first bad line
  auto want = expected_packed_rows(kDocs, shipped(), 8, true, true);
  auto got = rows(*s, static_cast<int>(want.size()));
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

// The files are read and tokenized a chunk of text at a time (16 MB; before: each file's whole
// text and every document's ids were held at once). Chunks of one document (MT_TOKENIZE_CHUNK_BYTES
// =1) give the same rows in the same order, across three files of which one is plain text, and
// data_strict=false counts bad lines that fall in different chunks.
TEST_F(TextData, ChunkedReadingGivesTheSameRows) {
  const std::string a = write_jsonl("a.jsonl", {kDocs[0], kDocs[1], kDocs[2]});
  const std::string b = write("b.txt", kDocs[3]);
  const std::string c =
      write("c.jsonl", "{\"text\": " + json_quote(kDocs[4]) +
                           "}\nnot json\n{\"text\": " + json_quote(kDocs[5]) + "}\n[2]\n");
  const Pairs kv = cfg(a + "," + b + "," + c, {{"data_strict", "false"}});
  std::vector<Row> want = expected_packed_rows(kDocs, shipped(), 8, true, true);
  auto read_all = [&](const char* chunk) {
    if (chunk)
      ::setenv("MT_TOKENIZE_CHUNK_BYTES", chunk, 1);
    else
      ::unsetenv("MT_TOKENIZE_CHUNK_BYTES");
    testing::internal::CaptureStderr();
    auto src = make(kv);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_NE(err.find("skipped 2 bad record(s)"), std::string::npos) << err;
    EXPECT_NE(err.find(c + ":2: not a JSON line"), std::string::npos) << err;
    return rows(*src, static_cast<int>(want.size()));  // one epoch, in the shuffled order
  };
  const std::vector<Row> whole = read_all(nullptr), chunked = read_all("1");
  ::unsetenv("MT_TOKENIZE_CHUNK_BYTES");
  EXPECT_EQ(chunked, whole);
  std::vector<Row> got = whole;
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace mt
