// The tokenizers against the ids the reference libraries (Hugging Face `tokenizers`,
// `sentencepiece`) produce: tests/golden/tokenizer/cases.json, made by
// tools/make_tokenizer_golden.py, and added_tokens_cases.json, made by
// tools/make_added_tokens_golden.py.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "fnv1a.h"
#include "json.h"
#include "mt/error.h"
#include "test_support.h"
#include "tokenizer_bpe.h"
#include "tokenizer_factory.h"
#include "tokenizer_util.h"

namespace mt {
namespace {

namespace fs = std::filesystem;

struct Case {
  std::string text, decoded;
  std::vector<int32_t> ids;
};
struct Golden {
  std::string name, path, type;
  int64_t vocab_size = 0;
  int32_t bos = -1, eos = -1;
  std::vector<Case> cases;
};

// `file` in tests/golden/tokenizer/.
std::vector<Golden> load_golden(const std::string& file) {
  const std::string path = test::source_dir() + "/tests/golden/tokenizer/" + file;
  const json::Value root = json::parse(read_file(path, "golden"));
  std::vector<Golden> out;
  for (const auto& t : root.find("tokenizers")->items) {
    Golden g;
    g.name = t.find("name")->str;
    g.path = test::source_dir() + "/" + t.find("path")->str;
    g.type = t.find("type")->str;
    g.vocab_size = t.find("vocab_size")->integer;
    g.bos = static_cast<int32_t>(t.find("bos_id")->integer);
    g.eos = static_cast<int32_t>(t.find("eos_id")->integer);
    for (const auto& c : t.find("cases")->items) {
      Case k;
      k.text = c.find("text")->str;
      k.decoded = c.find("decoded")->str;
      for (const auto& id : c.find("ids")->items) k.ids.push_back(static_cast<int32_t>(id.integer));
      g.cases.push_back(std::move(k));
    }
    out.push_back(std::move(g));
  }
  return out;
}

const std::vector<Golden>& golden() {
  static const std::vector<Golden> g = load_golden("cases.json");
  return g;
}

std::string show(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The reference's ids and decoding for every case of `g`.
void expect_golden(const Golden& g, size_t min_cases) {
  SCOPED_TRACE(g.name + " (" + g.path + ")");
  // Both the inferred and the named type must give the same tokenizer.
  for (const std::string& type : {std::string(), g.type}) {
    auto tok = make_tokenizer(g.path, type);
    EXPECT_EQ(tok->vocab_size(), g.vocab_size);
    EXPECT_EQ(tok->bos_id(), g.bos);
    EXPECT_EQ(tok->eos_id(), g.eos);
    ASSERT_GE(g.cases.size(), min_cases);
    int mismatches = 0;
    size_t exact = 0;
    for (size_t i = 0; i < g.cases.size(); ++i) {
      const Case& c = g.cases[i];
      const auto ids = tok->encode(c.text);
      if (ids != c.ids) ++mismatches;
      EXPECT_EQ(ids, c.ids) << "case " << i << " text \"" << c.text << "\"\n  got      "
                            << show(ids) << "\n  expected " << show(c.ids);
      EXPECT_EQ(tok->decode(c.ids), c.decoded) << "case " << i;
      // Where the reference decodes back to the input, so must we (normalizers and Strip
      // decoders make some not).
      if (c.decoded == c.text) {
        EXPECT_EQ(tok->decode(ids), c.text) << "case " << i;
        ++exact;
      }
    }
    EXPECT_EQ(mismatches, 0);
    // Byte-level BPE and SentencePiece with identity normalization round-trip everything.
    if (g.name != "qwen_nfc" && g.name != "llama2_hf" && g.name != "split_behaviors" &&
        g.name != "added_tokens" && g.name.rfind("metaspace", 0) != 0) {
      EXPECT_EQ(exact, g.cases.size());
    }
  }
}

class GoldenTokenizer : public ::testing::TestWithParam<size_t> {};

TEST_P(GoldenTokenizer, MatchesReferenceIdsAndDecoding) {
  expect_golden(golden()[GetParam()], 60);
}

INSTANTIATE_TEST_SUITE_P(All, GoldenTokenizer, ::testing::Range<size_t>(0, 10),
                         [](const ::testing::TestParamInfo<size_t>& i) {
                           return golden()[i.param].name;
                         });

TEST(Tokenizer, GoldenCoversEveryKind) {
  ASSERT_EQ(golden().size(), 10u);
  std::vector<std::string> names;
  for (const auto& g : golden()) names.push_back(g.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"gpt2_bytelevel", "llama3_split", "byte_fallback",
                                      "split_behaviors", "qwen_nfc", "llama2_hf", "metaspace",
                                      "metaspace_first", "tiktoken_llama3", "sentencepiece_bpe"}));
}

// Added tokens with each flag, under an NFKC normalizer: lstrip/rstrip swallow any Unicode
// whitespace ("a\u3000<m>b" is [66, 1024, 67]; it was [66, 222, 1024, 67] while only ASCII's
// was), tokens with normalized=true are found in the normalized text ("\ufb01!" is the token
// "fi!"), and single_word ones only where no word character touches them ("swordfish" held the
// token "word").
TEST(Tokenizer, AddedTokenFlagsMatchReference) {
  const std::vector<Golden> g = load_golden("added_tokens_cases.json");
  ASSERT_EQ(g.size(), 1u);
  expect_golden(g[0], 60);
}

TEST(Tokenizer, ShippedTokenizerMatchesShippedTokens) {
  // data/corpus.eval.tokens was made by the reference library from corpus.eval.jsonl: the first
  // document's ids (after <s>) must be ours.
  auto tok = make_tokenizer(test::source_dir() + "/data/tokenizer.json", "");
  std::ifstream f(test::source_dir() + "/data/corpus.eval.jsonl");
  std::string line;
  ASSERT_TRUE(std::getline(f, line));
  const std::string text = json::parse(line).find("text")->str;
  const auto ids = tok->encode(text);
  const std::string bytes = read_file(test::source_dir() + "/data/corpus.eval.tokens", "tokens");
  ASSERT_GT(bytes.size(), 32 + 2 * (ids.size() + 2));
  std::vector<int32_t> ref;
  for (size_t i = 0; i < ids.size() + 2; ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + 32 + 2 * i);
    ref.push_back(p[0] | (p[1] << 8));
  }
  EXPECT_EQ(ref.front(), 0);
  EXPECT_EQ(ref.back(), 1);
  EXPECT_EQ(std::vector<int32_t>(ref.begin() + 1, ref.end() - 1), ids);
  EXPECT_EQ(tok->decode(ids), text);
}

TEST(Tokenizer, SpecialTokensAreMatchedInText) {
  auto tok = make_tokenizer(test::source_dir() + "/data/tokenizer.json", "huggingface");
  const auto ids = tok->encode("<s>a</s>");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids.front(), 0);
  EXPECT_EQ(ids.back(), 1);
  EXPECT_TRUE(tok->encode("").empty());
}

TEST(Tokenizer, RejectsInvalidUtf8) {
  for (const std::string path : {"/data/tokenizer.json", "/tests/golden/tokenizer/sp.model"}) {
    auto tok = make_tokenizer(test::source_dir() + path, "");
    for (const std::string& bad : {std::string("ab\xff"), std::string("\xc3"),
                                   std::string("\xed\xa0\x80"), std::string("\xc0\xaf")}) {
      try {
        tok->encode(bad);
        ADD_FAILURE() << "accepted invalid UTF-8 with " << path;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(Tokenizer, EncodeIsThreadSafe) {
  const Golden& g = golden()[0];
  auto tok = make_tokenizer(g.path, "");
  std::vector<int> bad(2, 0);
  std::vector<std::thread> ts;
  for (int t = 0; t < 2; ++t)
    ts.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep)
        for (const auto& c : g.cases)
          if (tok->encode(c.text) != c.ids) ++bad[static_cast<size_t>(t)];
    });
  for (auto& t : ts) t.join();
  EXPECT_EQ(bad[0] + bad[1], 0);
}

TEST(Tokenizer, DecodeSkipsIdsOutsideTheVocabulary) {
  for (const std::string path : {"/data/tokenizer.json", "/tests/golden/tokenizer/sp.model"}) {
    auto tok = make_tokenizer(test::source_dir() + path, "");
    auto ids = tok->encode("Emma");
    const std::string want = tok->decode(ids);
    ids.push_back(static_cast<int32_t>(tok->vocab_size()));
    ids.insert(ids.begin(), -5);
    EXPECT_EQ(tok->decode(ids), want) << path;
  }
}

// Byte-level decoding replaces invalid UTF-8 as Hugging Face's decoder does (from_utf8_lossy:
// one U+FFFD per maximal invalid subsequence), where it wrote the raw bytes (a lone 0xC3 in mt
// decode's output, which a reader of text fails on); valid text is unchanged.
TEST(Tokenizer, ByteLevelDecodingReplacesInvalidUtf8) {
  auto tok = make_tokenizer(test::source_dir() + "/data/tokenizer.json", "");
  const auto* bpe = dynamic_cast<const BpeTokenizer*>(tok.get());
  ASSERT_NE(bpe, nullptr);
  const int32_t lead = bpe->token_to_id("\xC3\x83");  // "Ã", the byte 0xC3 alone
  const int32_t a = bpe->token_to_id("a");
  ASSERT_GE(lead, 0);
  ASSERT_GE(a, 0);
  EXPECT_EQ(tok->decode({lead, a}),
            "\xEF\xBF\xBD"
            "a");
  EXPECT_EQ(tok->decode({a, lead}), "a\xEF\xBF\xBD");
  const auto ids = tok->encode("caf\xC3\xA9 \xE2\x82\xAC");
  EXPECT_EQ(tok->decode(ids), "caf\xC3\xA9 \xE2\x82\xAC");
  EXPECT_EQ(utf8_lossy("\xE2\x82x\xF0\x9F\x98\x80\xED\xA0\x80"),
            "\xEF\xBF\xBD"
            "x\xF0\x9F\x98\x80\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

// ---- factory -------------------------------------------------------------------------------

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() /
            ("mt_tok_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name, const std::string& content) const {
    const fs::path p = path_ / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
  std::string dir() const { return path_.string(); }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

std::string error_of(const std::string& path, const std::string& type) {
  try {
    make_tokenizer(path, type);
  } catch (const UsageError& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not a UsageError: ") + e.what();
  }
  return "no error";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(TokenizerFactory, InfersTheTypeFromContentWithoutExtension) {
  TempDir d;
  const std::string json =
      d.file("tok", read_file(test::source_dir() + "/data/tokenizer.json", ""));
  const std::string sp =
      d.file("spm", read_file(test::source_dir() + "/tests/golden/tokenizer/sp.model", ""));
  EXPECT_EQ(make_tokenizer(json, "")->vocab_size(), 8192);
  EXPECT_NE(dynamic_cast<BpeTokenizer*>(make_tokenizer(json, "").get()), nullptr);
  EXPECT_EQ(make_tokenizer(sp, "")->vocab_size(), 1000);
  EXPECT_EQ(dynamic_cast<BpeTokenizer*>(make_tokenizer(sp, "").get()), nullptr);

  // A model directory: its tokenizer.json first, else its tokenizer.model.
  TempDir m;
  m.file("tokenizer.model", read_file(sp, ""));
  EXPECT_EQ(make_tokenizer(m.dir(), "")->vocab_size(), 1000);
  m.file("tokenizer.json", read_file(json, ""));
  EXPECT_EQ(make_tokenizer(m.dir(), "")->vocab_size(), 8192);
}

TEST(TokenizerFactory, ClearErrors) {
  TempDir d;
  const std::string missing = d.dir() + "/nope.json";
  EXPECT_TRUE(contains(error_of(missing, ""), "'" + missing + "' does not exist"))
      << error_of(missing, "");
  EXPECT_TRUE(contains(error_of(d.dir(), ""), "is a directory without tokenizer.json"))
      << error_of(d.dir(), "");
  EXPECT_TRUE(contains(error_of("", ""), "tokenizer_path is empty"));

  const std::string bad = d.file("bad.json", "{\"model\": {\"vocab\": [1, 2,}");
  const std::string e = error_of(bad, "");
  EXPECT_TRUE(contains(e, bad) && contains(e, "malformed JSON at byte")) << e;

  const std::string unk = d.file("t.json", "{}");
  EXPECT_TRUE(contains(error_of(unk, "wordpiece"), "tokenizer_type=wordpiece is unknown"));
  EXPECT_TRUE(contains(error_of(unk, "tiktoken"), "line 1 is not \"<base64 token> <rank>\""))
      << error_of(unk, "tiktoken");
  EXPECT_TRUE(contains(error_of(unk, ""), "has no \"model\"")) << error_of(unk, "");

  const std::string sp = test::source_dir() + "/tests/golden/tokenizer/sp.model";
  EXPECT_TRUE(contains(error_of(sp, "huggingface"), "malformed JSON"))
      << error_of(sp, "huggingface");
  const std::string js = test::source_dir() + "/data/tokenizer.json";
  EXPECT_TRUE(contains(error_of(js, "sentencepiece"), "is not a SentencePiece model"))
      << error_of(js, "sentencepiece");
  const std::string junk = d.file("x.model", "this is not a model");
  EXPECT_TRUE(contains(error_of(junk, ""),
                       "is not a SentencePiece model: its bytes are not a "
                       "model protobuf"))
      << error_of(junk, "");  // (before: the library's source file and line)
  const std::string nothing = d.file("empty.model", "");
  EXPECT_TRUE(contains(error_of(nothing, ""), "(the file is empty)")) << error_of(nothing, "");

  const std::string wordpiece =
      d.file("wp.json", R"({"model": {"type": "WordPiece", "vocab": {}}})");
  EXPECT_TRUE(contains(error_of(wordpiece, ""), "model type \"WordPiece\" is not supported"));
  const std::string badmerge = d.file(
      "m.json", R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a b"]}})");
  EXPECT_TRUE(contains(error_of(badmerge, ""), "not in the vocabulary")) << error_of(badmerge, "");
  // An empty vocabulary tokenized every text to its special tokens alone.
  const std::string empty =
      d.file("e.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []}})");
  EXPECT_TRUE(contains(error_of(empty, ""), "model.vocab is empty")) << error_of(empty, "");

  // A member of the wrong kind is refused, naming it (before: a flag in quotes, a string that
  // was a number, were read as their defaults and changed the ids without a word; a normalizer
  // that was not an object was 'type "" is not supported').
  const std::string model = R"("model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": [])";
  for (const auto& [member, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"("pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": "true"})",
            R"("add_prefix_space" is a string, not true or false)"},
           {R"("pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": 1})",
            R"("behavior" is a number, not a string)"},
           {R"("decoder": {"type": "Strip", "content": " ", "start": "x", "stop": 0})",
            R"(the Strip decoder's "start" is not a count of characters)"},
           {R"("normalizer": "NFC")", "the normalizer is a string, not a JSON object"},
           {R"("normalizer": {"foo": 1})", R"(the normalizer has no "type")"},
           {R"("pre_tokenizer": 7)", "the pre-tokenizer is a number, not a JSON object"},
           {R"("decoder": {"type": 7})", R"("type" is a number, not a string)"},
           {R"("added_tokens": [{"id": 1, "content": "b", "special": "yes"}])",
            R"("special" is a string, not true or false)"}}) {
    const std::string t = d.file("kind.json", "{" + member + ", " + model + "}}");
    EXPECT_TRUE(contains(error_of(t, ""), needle)) << member << ": " << error_of(t, "");
  }
  // null is "not set", as the library writes it.
  const std::string nulls =
      d.file("null.json", R"({"normalizer": null, "pre_tokenizer": {"type": "ByteLevel",
      "add_prefix_space": null}, )" +
                              model + R"(, "unk_token": null}})");
  EXPECT_NO_THROW(make_tokenizer(nulls, "")) << error_of(nulls, "");
}

// Issue 24, items 2 and 3: the tables are indexed by id, so an id far above the file's own
// number of tokens is refused (id 2147483647 used to overflow `id + 1` and write out of bounds;
// 100000000 took 3.2 GB, 2000000000 was std::bad_alloc, a one-line tiktoken file with rank
// 300000000 took 19 GB) before anything is sized by it.
TEST(TokenizerFactory, IdsAreBoundedByTheFile) {
  TempDir d;
  auto bpe = [&](const std::string& vocab_id, const std::string& added_id) {
    return d.file("ids.json", R"({"added_tokens": [{"id": )" + added_id +
                                  R"(, "content": "<eos>"}],
      "model": {"type": "BPE", "vocab": {"a": 0, "b": )" +
                                  vocab_id + R"(, "ab": 2}, "merges": ["a b"]}})");
  };
  for (const auto& [vocab_id, added_id] : std::vector<std::pair<std::string, std::string>>{
           {"2147483647", "3"}, {"100000000", "3"}, {"1", "2000000000"}, {"1", "2147483647"}}) {
    const std::string e = error_of(bpe(vocab_id, added_id), "");
    const std::string big = vocab_id == "1" ? added_id : vocab_id;
    EXPECT_TRUE(contains(e, "has id " + big) && contains(e, "the file holds 4 tokens") &&
                contains(e, "below 65536"))
        << e;
  }
  // Holes below the bound are fine: an id past the tokens, as padded vocabularies have.
  EXPECT_EQ(make_tokenizer(bpe("1", "65535"), "")->vocab_size(), 65536);

  const std::string tik = d.file("big.tiktoken", "IQ== 300000000\n");
  const std::string e = error_of(tik, "tiktoken");
  EXPECT_TRUE(contains(e, "rank 300000000") && contains(e, "below 65536")) << e;
  EXPECT_TRUE(contains(error_of(tik, ""), "rank 300000000")) << error_of(tik, "");
  // A rank with holes under the bound loads (then 256 special tokens follow the ranks).
  EXPECT_EQ(make_tokenizer(d.file("ok.tiktoken", "IQ== 1000\n"), "tiktoken")->vocab_size(),
            1001 + 256);
}

// ---- Gemma's tokenizer at Gemma's size -------------------------------------------------------

// SentencePiece ModelProto `pieces` entries <unused0>.. (piece, score 0, type NORMAL), the
// bytes tools/make_gemma_tokenizer_golden.py appends to gemma_sp.model (protobuf concatenates
// repeated fields).
std::string unused_pieces(int64_t count) {
  auto varint = [](std::string& out, uint64_t n) {
    do {
      const auto b = static_cast<unsigned char>(n & 0x7F);
      n >>= 7;
      out.push_back(static_cast<char>(b | (n ? 0x80 : 0)));
    } while (n);
  };
  std::string out;
  for (int64_t i = 0; i < count; ++i) {
    const std::string name = "<unused" + std::to_string(i) + ">";
    std::string body = "\x0a";
    varint(body, name.size());
    body += name;
    body += std::string("\x15\0\0\0\0", 5);  // score 0.0f
    body += "\x18";
    varint(body, 1);  // NORMAL: a piece no merge reaches
    out += "\x0a";
    varint(out, body.size());
    out += body;
  }
  return out;
}

// A Gemma-style SentencePiece (BPE, byte fallback, no dummy prefix, whitespace-only pieces,
// <pad> 0 <eos> 1 <bos> 2 <unk> 3, <start_of_turn>/<end_of_turn>, newline and space runs) of
// Gemma's 256000 pieces, built as the tool built it (the same bytes: size and FNV-1a hash),
// gives transformers' GemmaTokenizer ids and SentencePiece's decoding for every case; the last
// ids decode to their pieces, and an id past the vocabulary is skipped.
TEST(Tokenizer, GemmaSentencePieceAt256kPieces) {
  const std::string dir = test::source_dir() + "/tests/golden/tokenizer/";
  const json::Value g = json::parse(read_file(dir + "gemma.json", "golden"));
  const int64_t pad_to = g.find("pad_to")->integer;
  ASSERT_EQ(pad_to, 256000);
  std::string model = read_file(dir + "gemma_sp.model", "model");
  model += unused_pieces(pad_to - g.find("trained_pieces")->integer);
  EXPECT_EQ(static_cast<int64_t>(model.size()), g.find("padded_bytes")->integer);
  EXPECT_EQ(fmt::format("{:016x}", fnv1a(model)), g.find("padded_fnv1a64")->str);
  const fs::path file =
      fs::temp_directory_path() / ("mt_gemma_tokenizer_" + std::to_string(::getpid()) + ".model");
  {
    std::ofstream f(file, std::ios::binary);
    f << model;
  }
  auto tok = make_tokenizer(file.string(), "sentencepiece");
  EXPECT_EQ(tok->vocab_size(), 256000);
  EXPECT_EQ(tok->bos_id(), 2);
  EXPECT_EQ(tok->eos_id(), 1);
  size_t n = 0;
  for (const auto& c : g.find("cases")->items) {
    std::vector<int32_t> want;
    for (const auto& id : c.find("ids")->items) want.push_back(static_cast<int32_t>(id.integer));
    const std::string text = c.find("text")->str;
    EXPECT_EQ(tok->encode(text), want) << "text \"" << text << "\"";
    EXPECT_EQ(tok->decode(want), c.find("decoded")->str) << "text \"" << text << "\"";
    ++n;
  }
  EXPECT_GE(n, 85u);
  EXPECT_EQ(tok->decode({255999, 4}), "<unused251999><start_of_turn>");
  EXPECT_EQ(tok->decode({256000}), "");
  // A model whose vocab_size is smaller than the tokenizer's is refused, naming both: scoring
  // the Gemma golden model (vocab 128), and training gemma-test (vocab 256) on text.
  const std::string src = test::source_dir();
  test::MtResult r =
      test::run_mt("score hf_path=" + src + "/tests/golden/gemma tokenizer_path=" + file.string() +
                       " prompt=hello",
                   60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("has 256000 tokens, more than the model's vocab_size=128"),
            std::string::npos)
      << r.out;
  r = test::run_mt("run --model=gemma-test steps=1 dataset_type=text dataset_path=" + src +
                       "/data/corpus.train.jsonl base_output_directory=" +
                       (fs::temp_directory_path() / "mt_gemma_tokenizer_run").string() +
                       " tokenizer_path=" + file.string(),
                   60);
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.out.find("vocab_size=256 (set at configs/models/gemma-test.yml:4) is smaller than "
                       "the tokenizer's vocabulary (256000 ids)"),
            std::string::npos)
      << r.out;
  fs::remove(file);
}

TEST(TokenizerFactory, MinimalBpeFile) {
  // Both merge forms, an unk token with fuse_unk, and no pre-tokenizer or decoder.
  TempDir d;
  const std::string path = d.file("m.json", R"({
    "added_tokens": [{"id": 5, "content": "<eos>", "special": true}],
    "model": {"type": "BPE", "unk_token": "?", "fuse_unk": true,
              "vocab": {"?": 0, "a": 1, "b": 2, "ab": 3, "abb": 4},
              "merges": ["a b", ["ab", "b"]]}})");
  auto tok = make_tokenizer(path, "");
  EXPECT_EQ(tok->vocab_size(), 6);
  EXPECT_EQ(tok->eos_id(), 5);
  EXPECT_EQ(tok->bos_id(), -1);
  EXPECT_EQ(tok->encode("abbxyab<eos>"), (std::vector<int32_t>{4, 0, 3, 5}));
  EXPECT_EQ(tok->decode({4, 3}), "abb ab");  // no decoder: tokens joined by spaces
}

// A tokenizer_config.json beside tokenizer.json names the bos and eos, as transformers reads
// them: DeepSeek's <｜begin▁of▁sentence｜> is none of the common names (before: no bos, so a
// text dataset refused add_bos); an object {"content": ...} too; names it lacks leave the guess.
TEST(TokenizerFactory, TokenizerConfigNamesTheSpecialTokens) {
  TempDir d;
  const std::string vocab = R"({
    "added_tokens": [{"id": 5, "content": "<eos>", "special": true},
                     {"id": 6, "content": "<｜begin▁of▁sentence｜>", "special": true},
                     {"id": 7, "content": "<｜end▁of▁sentence｜>", "special": true}],
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "c": 3, "d": 4},
              "merges": ["a b"]}})";
  const std::string path = d.file("tokenizer.json", vocab);
  EXPECT_EQ(make_tokenizer(path, "")->bos_id(), -1);
  EXPECT_EQ(make_tokenizer(path, "")->eos_id(), 5);
  d.file("tokenizer_config.json",
         R"({"bos_token": "<｜begin▁of▁sentence｜>",
             "eos_token": {"content": "<｜end▁of▁sentence｜>", "special": true}})");
  EXPECT_EQ(make_tokenizer(path, "")->bos_id(), 6);
  EXPECT_EQ(make_tokenizer(path, "")->eos_id(), 7);
  d.file("tokenizer_config.json", R"({"bos_token": null, "eos_token": "<missing>"})");
  EXPECT_EQ(make_tokenizer(path, "")->bos_id(), -1);
  EXPECT_EQ(make_tokenizer(path, "")->eos_id(), 5);
}

TEST(TokenizerFactory, AddedTokenNormalizedDefaultsToNotSpecial) {
  // Without the flag (the reference library always writes it) a token is normalized unless it
  // is special, as the library's own default for a new token: "XII" is the normalized form of
  // the token U+216B, but "1", that of the special U+2460, is not that token.
  TempDir d;
  const std::string path = d.file("n.json", R"({
    "added_tokens": [{"id": 4, "content": "\u216b"},
                     {"id": 5, "content": "\u2460", "special": true}],
    "normalizer": {"type": "NFKC"},
    "model": {"type": "BPE", "unk_token": "?",
              "vocab": {"?": 0, "X": 1, "I": 2, "1": 3}, "merges": []}})");
  auto tok = make_tokenizer(path, "");
  EXPECT_EQ(tok->encode("XII"), (std::vector<int32_t>{4}));
  EXPECT_EQ(tok->encode("\u216b"), (std::vector<int32_t>{4}));
  EXPECT_EQ(tok->encode("\u2460"), (std::vector<int32_t>{5}));
  EXPECT_EQ(tok->encode("1"), (std::vector<int32_t>{3}));
  EXPECT_EQ(tok->decode({4, 5}), "XII \u2460");  // the normalized form, as the reference
}

}  // namespace
}  // namespace mt
