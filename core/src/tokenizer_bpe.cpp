#include "tokenizer_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <initializer_list>
#include <mutex>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "json.h"
#include "mt/error.h"
#include "tokenizer_util.h"

namespace mt {
namespace {

// GPT-2's pre-tokenizer regex: what ByteLevel(use_regex=true) splits with.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Words longer than this are not cached: they are rare, and would crowd out the common ones.
constexpr size_t kMaxCachedWord = 128;
constexpr size_t kMaxCacheEntries = 1 << 16;

struct CodeDeleter {
  void operator()(pcre2_code* c) const { pcre2_code_free(c); }
};
struct MatchDataDeleter {
  void operator()(pcre2_match_data* m) const { pcre2_match_data_free(m); }
};
using MatchData = std::unique_ptr<pcre2_match_data, MatchDataDeleter>;

// A compiled regex; shared by all threads (PCRE2 code is read-only once JIT-compiled).
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& origin) {
    int err = 0;
    PCRE2_SIZE off = 0;
    // PCRE2 refuses UCP together with LITERAL (it has no classes to apply it to).
    const uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    code_.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts,
                              &err, &off, nullptr));
    if (!code_) {
      std::array<PCRE2_UCHAR, 256> msg{};
      pcre2_get_error_message(err, msg.data(), msg.size());
      throw UsageError(origin + ": pre-tokenizer regex does not compile at offset " +
                       std::to_string(off) + ": " + reinterpret_cast<const char*>(msg.data()));
    }
    // Without JIT the interpreter still works, only slower: a failure here is not an error.
    pcre2_jit_compile(code_.get(), PCRE2_JIT_COMPLETE);
  }

  MatchData match_data() const {
    return MatchData(pcre2_match_data_create_from_pattern(code_.get(), nullptr));
  }

  // Calls f(begin, end) for every non-empty match in s, left to right, non-overlapping.
  template <typename F>
  void for_each_match(std::string_view s, pcre2_match_data* md, F&& f) const {
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t start = 0;
    while (start < s.size()) {
      // The text was validated once (encode), so PCRE2 need not check UTF-8 per call.
      const int rc =
          pcre2_match(code_.get(), subject, s.size(), start, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT ||
          rc == PCRE2_ERROR_HEAPLIMIT)
        throw Error("tokenizer: the pre-tokenizer's regex gave up on a text of " +
                    std::to_string(s.size()) + " bytes (PCRE2's match limit, error " +
                    std::to_string(rc) +
                    "): a run of millions of whitespace characters backtracks past it (Hugging "
                    "Face's tokenizers fail on it too). Split such a document, or skip it with "
                    "data_strict=false.");
      if (rc < 0)
        throw Error("tokenizer: regex match failed (PCRE2 error " + std::to_string(rc) + ")");
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      if (ov[1] == ov[0]) {
        if (ov[0] >= s.size()) return;
        // An empty match yields no piece; step over one character so the scan ends.
        start = ov[0] + utf8_len(static_cast<unsigned char>(s[ov[0]]));
        continue;
      }
      f(ov[0], ov[1]);
      start = ov[1];
    }
  }

 private:
  std::unique_ptr<pcre2_code, CodeDeleter> code_;
};

enum class SplitBehavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

enum class PrependScheme { always, first, never };

struct PreStep {
  enum class Kind { byte_level, split, metaspace } kind = Kind::split;
  bool add_prefix_space = false;                  // byte_level
  std::string replacement;                        // metaspace: what spaces become ("▁")
  PrependScheme prepend = PrependScheme::always;  // metaspace
  std::shared_ptr<const Regex> regex;             // null: byte_level without its regex
  SplitBehavior behavior = SplitBehavior::isolated;
  bool invert = false;
};

struct DecodeStep {
  enum class Kind { byte_level, byte_fallback, fuse, replace, strip, metaspace } kind = Kind::fuse;
  std::string pattern, content;  // replace; metaspace: pattern is the replacement character
  PrependScheme prepend = PrependScheme::always;  // metaspace
  std::string strip_char;                         // strip
  int64_t strip_start = 0, strip_stop = 0;
};

struct NormStep {
  enum class Kind { unicode, prepend, replace } kind = Kind::unicode;
  int utf8proc_options = 0;      // unicode: NFC, NFD, NFKC or NFKD
  std::string pattern, content;  // replace: pattern -> content; prepend: content
};

struct AddedToken {
  std::string content;  // as the file has it: what token_to_id finds
  // What is matched in the text: the content, or for a normalized token the content after the
  // normalizer, since it is looked for in normalized text.
  std::string match;
  int32_t id = -1;
  bool special = false, lstrip = false, rstrip = false;
  bool single_word = false;  // only where no word character touches it on either side
  bool normalized = false;   // matched in the normalized text, after the others
};

// The added tokens matched in one pass: the raw text's (normalized=false) or the normalized
// text's (normalized=true).
struct AddedSet {
  std::vector<const AddedToken*> tokens;  // longest match first, for leftmost-longest matching
  std::array<bool, 256> first{};          // bytes that start some token's match
  // The matches as a byte trie: the longest token at a position in one walk (before: a compare
  // with every token sharing its first byte, 11x slower with Gemma 3's 6,000 added tokens).
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    const AddedToken* token = nullptr;                    // the token ending here
  };
  std::vector<Node> trie = std::vector<Node>(1);
  // After `tokens` is sorted: the first of equal matches wins, as in the scan of `tokens`.
  void build_trie() {
    for (const AddedToken* a : tokens) {
      int32_t n = 0;
      for (const char ch : a->match) {
        const auto c = static_cast<unsigned char>(ch);
        auto& next = trie[static_cast<size_t>(n)].next;
        auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t{-1}));
        if (it == next.end() || it->first != c) {
          const auto child = static_cast<int32_t>(trie.size());
          it = next.insert(it, {c, child});
          trie.emplace_back();
        }
        n = it->second;
      }
      if (!trie[static_cast<size_t>(n)].token) trie[static_cast<size_t>(n)].token = a;
    }
  }
  // The longest token whose match starts at text[i], or null.
  const AddedToken* longest_at(std::string_view text, size_t i) const {
    const AddedToken* best = nullptr;
    int32_t n = 0;
    for (size_t j = i; j < text.size(); ++j) {
      const auto& next = trie[static_cast<size_t>(n)].next;
      const auto c = static_cast<unsigned char>(text[j]);
      auto it = std::lower_bound(next.begin(), next.end(), std::make_pair(c, int32_t{-1}));
      if (it == next.end() || it->first != c) break;
      n = it->second;
      if (trie[static_cast<size_t>(n)].token) best = trie[static_cast<size_t>(n)].token;
    }
    return best;
  }
};

struct MergeInfo {
  int32_t rank = 0;
  int32_t new_id = 0;
};

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// GPT-2's reversible map from bytes to printable characters: bytes that are printable Latin-1
// map to themselves, the rest to U+0100 onwards in byte order.
std::array<uint32_t, 256> byte_to_codepoint() {
  std::array<uint32_t, 256> m{};
  uint32_t extra = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    m[b] = keep ? b : extra++;
  }
  return m;
}

// The byte two hex digits spell ("4F"), or -1.
int hex_byte(char hi, char lo) {
  auto digit = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int h = digit(hi), l = digit(lo);
  return h < 0 || l < 0 ? -1 : h * 16 + l;
}

// Unicode's White_Space property: what the reference's lstrip/rstrip swallow (U+3000, U+00A0
// and the other wide spaces too, not only ASCII's).
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// A word character as the reference's single_word test sees one (a Unicode \w: Alphabetic,
// marks, decimal digits, connector punctuation such as '_', and the joiners U+200C/U+200D).
// Alphabetic is the letters, letter numbers and a few symbols: the circled and squared Latin
// letters, the only ones utf8proc's categories do not give.
bool is_word_char(uint32_t cp) {
  if (cp < 0x80)
    return (cp >= '0' && cp <= '9') || (cp >= 'A' && cp <= 'Z') || (cp >= 'a' && cp <= 'z') ||
           cp == '_';
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return cp == 0x200C || cp == 0x200D || (cp >= 0x24B6 && cp <= 0x24E9) ||
             (cp >= 0x1F130 && cp <= 0x1F149) || (cp >= 0x1F150 && cp <= 0x1F169) ||
             (cp >= 0x1F170 && cp <= 0x1F189);
  }
}

// The code point that ends just before byte `i` of valid UTF-8 text (i > 0), and its length.
uint32_t code_point_before(std::string_view s, size_t i, size_t& len) {
  size_t b = i - 1;
  while (b > 0 && (static_cast<unsigned char>(s[b]) & 0xC0) == 0x80) --b;
  len = i - b;
  return utf8_decode(s.substr(b, len));
}

// The code point that starts at byte `i` of valid UTF-8 text (i < size), and its length.
uint32_t code_point_at(std::string_view s, size_t i, size_t& len) {
  len = std::min(utf8_len(static_cast<unsigned char>(s[i])), s.size() - i);
  return utf8_decode(s.substr(i, len));
}

// Lets the maps be searched with a string_view, without building a std::string per lookup.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// Ids at or above this are refused in a file of `count` tokens: tables are indexed by id.
int64_t max_token_id_bound(int64_t count) {
  return std::max<int64_t>(2 * count, 65536);
}

}  // namespace

struct BpeTokenizer::Impl {
  std::string origin;
  StringMap<int32_t> vocab;
  std::vector<std::string> id_to_token;  // every id below vocab_size; "" for holes
  std::vector<uint8_t> is_added;
  std::unordered_map<uint64_t, MergeInfo> merges;
  std::vector<AddedToken> added;
  // As the reference: the raw text is cut at the tokens that are not normalized, each piece
  // between them is normalized and cut at the normalized ones.
  AddedSet raw_added, normalized_added;
  std::vector<PreStep> pre;
  std::vector<DecodeStep> dec;
  std::vector<NormStep> norm;
  bool has_decoder = false;
  bool match_added = true;  // tiktoken as MaxText uses it encodes special tokens as text
  bool byte_level = false;  // the model sees byte-mapped text
  bool byte_fallback = false, ignore_merges = false, fuse_unk = false;
  int32_t unk = -1, bos = -1, eos = -1;
  int64_t n_vocab = 0;
  std::array<std::string, 256> byte_char;  // UTF-8 of each byte's mapped character
  std::array<int32_t, 256> byte_id{};      // vocab id of each byte's mapped character, or -1
  std::array<int32_t, 256> fallback_id{};  // id of "<0xXX>", or -1
  std::vector<int16_t> char_to_byte;       // inverse of the byte map, by code point

  mutable std::mutex cache_mu;
  mutable StringMap<std::vector<int32_t>> cache;

  [[noreturn]] void bad(const std::string& what) const { throw UsageError(origin + ": " + what); }

  void load(const json::Value& root);
  void load_tiktoken(std::string_view text);
  void finalize();
  void load_model(const json::Value& m);
  void load_added(const json::Value& a);
  void load_pre(const json::Value& p);
  void load_decoder(const json::Value& d);
  void load_normalizer(const json::Value& n);
  std::string metaspace_options(const json::Value& v, PrependScheme& scheme) const;
  std::string normalize(std::string_view chunk) const;

  void split_added(std::string_view text, const AddedSet& set,
                   std::vector<std::pair<std::string_view, int32_t>>& out) const;
  void pre_tokenize(std::string_view chunk, bool at_text_start,
                    std::vector<std::string_view>& pieces, std::vector<MatchData>& md,
                    std::deque<std::string>& storage) const;
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;
};

namespace {

// `where` by value: a temporary string bound to a reference parameter of a function returning a
// reference trips GCC 13+'s -Wdangling-reference, though the result refers into v alone.
const json::Value& member(const json::Value& v, std::string_view key, const std::string& origin,
                          std::string_view where) {
  const json::Value* m = v.find(key);
  if (!m)
    throw UsageError(origin + ": " + std::string(where) + " has no \"" + std::string(key) + "\"");
  return *m;
}
// An optional flag or string: absent or null gives the default; another kind is refused (a
// "true" in quotes was read as the default false, and changed the ids without a word).
bool bool_member(const json::Value& v, std::string_view key, bool dflt, const std::string& origin) {
  const json::Value* m = v.find(key);
  if (!m || m->is_null()) return dflt;
  if (m->kind != json::Value::Kind::boolean)
    throw UsageError(origin + ": \"" + std::string(key) + "\" is " + json::kind_name(m->kind) +
                     ", not true or false");
  return m->boolean;
}
std::string string_member(const json::Value& v, std::string_view key, const std::string& origin) {
  const json::Value* m = v.find(key);
  if (!m || m->is_null()) return {};
  if (!m->is_string())
    throw UsageError(origin + ": \"" + std::string(key) + "\" is " + json::kind_name(m->kind) +
                     ", not a string");
  return m->str;
}
// The "type" of a normalizer, pre-tokenizer or decoder (`what`), which must be an object with one.
std::string type_member(const json::Value& v, const char* what, const std::string& origin) {
  if (!v.is_object())
    throw UsageError(origin + ": the " + what + " is " + json::kind_name(v.kind) +
                     ", not a JSON object");
  const std::string type = string_member(v, "type", origin);
  if (type.empty()) throw UsageError(origin + ": the " + what + " has no \"type\"");
  return type;
}

}  // namespace

void BpeTokenizer::Impl::load(const json::Value& root) {
  if (!root.is_object()) bad("not a tokenizer.json (the top level is not a JSON object)");
  const json::Value& model = member(root, "model", origin, "the file");
  load_model(model);
  if (const auto* a = root.find("added_tokens"); a && a->is_array()) load_added(*a);
  if (const auto* n = root.find("normalizer"); n && !n->is_null()) load_normalizer(*n);
  if (const auto* p = root.find("pre_tokenizer"); p && !p->is_null()) load_pre(*p);
  if (const auto* d = root.find("decoder"); d && !d->is_null()) {
    has_decoder = true;
    load_decoder(*d);
  }
  finalize();
}

// The tables every format needs once its vocabulary and added tokens are known.
void BpeTokenizer::Impl::finalize() {
  // The tables are indexed by id, so their size is the largest id + 1, which the file chooses:
  // bound it by what the file holds (holes are allowed, but not gigabytes of them).
  n_vocab = 0;
  int64_t max_id = -1;
  std::string max_what;
  for (const auto& [tok, id] : vocab)
    if (id > max_id) max_id = id, max_what = "the vocabulary's token \"" + tok + "\"";
  for (const auto& a : added)
    if (a.id > max_id) max_id = a.id, max_what = "the added token \"" + a.content + "\"";
  const int64_t count = static_cast<int64_t>(vocab.size() + added.size());
  if (max_id >= max_token_id_bound(count))
    bad(max_what.substr(0, 200) + " has id " + std::to_string(max_id) + ", but the file holds " +
        std::to_string(count) + " tokens: ids must lie below " +
        std::to_string(max_token_id_bound(count)) +
        " (twice the number of tokens, at least 65536), since every id up to the largest gets a "
        "table entry. Is the file damaged?");
  n_vocab = max_id + 1;
  id_to_token.assign(static_cast<size_t>(n_vocab), std::string());
  is_added.assign(static_cast<size_t>(n_vocab), 0);
  for (const auto& [tok, id] : vocab) id_to_token[static_cast<size_t>(id)] = tok;
  for (auto& a : added) {
    // The normalizer is known only now (it follows added_tokens in the file). As the reference,
    // a normalized token decodes to its normalized form too.
    a.match = a.normalized && !norm.empty() ? normalize(a.content) : a.content;
    id_to_token[static_cast<size_t>(a.id)] = a.match;
    is_added[static_cast<size_t>(a.id)] = 1;
  }
  for (const auto& a : added) {
    // (A normalizer could erase a token altogether; an empty one matches nothing.)
    if (a.match.empty()) continue;
    AddedSet& set = a.normalized ? normalized_added : raw_added;
    set.tokens.push_back(&a);
    set.first[static_cast<unsigned char>(a.match[0])] = true;
  }
  for (AddedSet* set : {&raw_added, &normalized_added}) {
    std::stable_sort(
        set->tokens.begin(), set->tokens.end(),
        [](const AddedToken* x, const AddedToken* y) { return x->match.size() > y->match.size(); });
    set->build_trie();
  }

  // BOS/EOS are not marked as such in the file; these are the names the common families use.
  auto find_special = [&](std::initializer_list<const char*> names) {
    for (const char* n : names) {
      for (const auto& a : added)
        if (a.content == n) return a.id;
      if (auto it = vocab.find(n); it != vocab.end()) return it->second;
    }
    return int32_t{-1};
  };
  bos = find_special({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
  eos = find_special({"</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>"});

  const auto cp = byte_to_codepoint();
  uint32_t max_cp = 0;
  for (int b = 0; b < 256; ++b) {
    byte_char[static_cast<size_t>(b)] = utf8_encode(cp[static_cast<size_t>(b)]);
    max_cp = std::max(max_cp, cp[static_cast<size_t>(b)]);
    auto it = vocab.find(byte_char[static_cast<size_t>(b)]);
    byte_id[static_cast<size_t>(b)] = it == vocab.end() ? -1 : it->second;
    char hex[8];
    std::snprintf(hex, sizeof hex, "<0x%02X>", b);
    auto fb = vocab.find(hex);
    fallback_id[static_cast<size_t>(b)] = fb == vocab.end() ? -1 : fb->second;
  }
  char_to_byte.assign(max_cp + 1, -1);
  for (int b = 0; b < 256; ++b) char_to_byte[cp[static_cast<size_t>(b)]] = static_cast<int16_t>(b);
}

// Llama 3's pre-tokenizer regex, which MaxText's tiktoken tokenizer uses.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The bytes of standard base64 text, or false.
bool base64_decode(std::string_view in, std::string& out) {
  auto val = [](char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  out.clear();
  if (in.empty() || in.size() % 4 != 0) return false;
  for (size_t i = 0; i < in.size(); i += 4) {
    int v[4];
    int pad = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = in[i + static_cast<size_t>(k)];
      if (c == '=' && i + 4 == in.size() && k >= 2) {
        v[k] = 0;
        ++pad;
      } else if (pad || (v[k] = val(c)) < 0) {
        return false;
      }
    }
    const uint32_t w = (static_cast<uint32_t>(v[0]) << 18) | (static_cast<uint32_t>(v[1]) << 12) |
                       (static_cast<uint32_t>(v[2]) << 6) | static_cast<uint32_t>(v[3]);
    out += static_cast<char>(w >> 16);
    if (pad < 2) out += static_cast<char>((w >> 8) & 0xFF);
    if (pad < 1) out += static_cast<char>(w & 0xFF);
  }
  return true;
}

// tiktoken's format: one "<base64 bytes> <rank>" per line; the rank is the id and the merge
// priority (the pair whose concatenation has the lowest rank merges first). Stored here as a
// byte-level BPE: tokens under the GPT-2 byte map, and a merge for every split of a token into
// two tokens, ranked by the token.
void BpeTokenizer::Impl::load_tiktoken(std::string_view text) {
  const auto cp = byte_to_codepoint();
  auto mapped = [&](std::string_view bytes) {
    std::string m;
    for (char c : bytes) m += utf8_encode(cp[static_cast<unsigned char>(c)]);
    return m;
  };
  std::vector<std::string> by_rank;  // raw bytes
  // Ranks index by_rank: bound them by the file's own number of lines before sizing anything.
  const int64_t rank_bound =
      max_token_id_bound(static_cast<int64_t>(std::count(text.begin(), text.end(), '\n')) + 1);
  size_t pos = 0, line_no = 0;
  std::string bytes;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    int64_t rank = -1;
    if (sp != std::string_view::npos) {
      auto r = std::from_chars(line.data() + sp + 1, line.data() + line.size(), rank);
      if (r.ec != std::errc() || r.ptr != line.data() + line.size()) rank = -1;
    }
    if (rank < 0 || rank > INT32_MAX - 1024 || !base64_decode(line.substr(0, sp), bytes))
      bad("line " + std::to_string(line_no) +
          " is not \"<base64 token> <rank>\" (a tiktoken file)");
    if (rank >= rank_bound)
      bad("line " + std::to_string(line_no) + ": rank " + std::to_string(rank) +
          " is far above the file's number of lines: ranks must lie below " +
          std::to_string(rank_bound) +
          " (twice the number of lines, at least 65536), since every rank up to the largest gets "
          "a table entry. Is the file damaged?");
    if (static_cast<size_t>(rank) >= by_rank.size()) by_rank.resize(static_cast<size_t>(rank) + 1);
    if (!by_rank[static_cast<size_t>(rank)].empty())
      bad("line " + std::to_string(line_no) + ": rank " + std::to_string(rank) + " appears twice");
    by_rank[static_cast<size_t>(rank)] = bytes;
    if (!vocab.emplace(mapped(bytes), static_cast<int32_t>(rank)).second)
      bad("line " + std::to_string(line_no) + ": token appears twice");
  }
  if (by_rank.empty()) bad("empty tiktoken file");
  for (size_t r = 0; r < by_rank.size(); ++r) {
    const std::string& t = by_rank[r];
    for (size_t k = 1; k < t.size(); ++k) {
      auto a = vocab.find(mapped(std::string_view(t).substr(0, k)));
      auto b = vocab.find(mapped(std::string_view(t).substr(k)));
      if (a != vocab.end() && b != vocab.end())
        merges.emplace(pair_key(a->second, b->second),
                       MergeInfo{static_cast<int32_t>(r), static_cast<int32_t>(r)});
    }
  }
  byte_level = true;
  ignore_merges = true;  // tiktoken takes a piece that is a token as it is
  match_added = false;
  PreStep split;
  split.regex = std::make_shared<const Regex>(kLlama3Pattern, false, origin);
  pre.push_back(std::move(split));
  PreStep bl;
  bl.kind = PreStep::Kind::byte_level;
  pre.push_back(std::move(bl));
  has_decoder = true;
  DecodeStep d;
  d.kind = DecodeStep::Kind::byte_level;
  dec.push_back(std::move(d));
  // Llama 3's special tokens follow the ranks: 256 of them, most reserved.
  const auto base = static_cast<int32_t>(by_rank.size());
  std::vector<std::string> names = {"<|begin_of_text|>",
                                    "<|end_of_text|>",
                                    "<|reserved_special_token_0|>",
                                    "<|reserved_special_token_1|>",
                                    "<|reserved_special_token_2|>",
                                    "<|reserved_special_token_3|>",
                                    "<|start_header_id|>",
                                    "<|end_header_id|>",
                                    "<|reserved_special_token_4|>",
                                    "<|eot_id|>"};
  for (int i = 5; i < 256 - 5; ++i)
    names.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  for (size_t i = 0; i < names.size(); ++i) {
    AddedToken t;
    t.content = names[i];
    t.id = base + static_cast<int32_t>(i);
    t.special = true;
    added.push_back(std::move(t));
  }
  finalize();
}

void BpeTokenizer::Impl::load_model(const json::Value& m) {
  if (!m.is_object()) bad("\"model\" is not an object");
  const std::string type = string_member(m, "type", origin);
  // Files written by old versions of the library omit the type; their model is BPE when it has
  // merges.
  if (!(type == "BPE" || (type.empty() && m.find("merges"))))
    bad("model type \"" + type + "\" is not supported (only BPE is)");
  if (!string_member(m, "continuing_subword_prefix", origin).empty() ||
      !string_member(m, "end_of_word_suffix", origin).empty())
    bad("BPE continuing_subword_prefix / end_of_word_suffix are not supported");
  byte_fallback = bool_member(m, "byte_fallback", false, origin);
  ignore_merges = bool_member(m, "ignore_merges", false, origin);
  fuse_unk = bool_member(m, "fuse_unk", false, origin);

  const json::Value& v = member(m, "vocab", origin, "\"model\"");
  if (!v.is_object()) bad("model.vocab is not an object");
  vocab.reserve(v.members.size() * 2);
  for (const auto& [tok, idv] : v.members) {
    if (!idv.is_int || idv.integer < 0 || idv.integer > INT32_MAX)
      bad("model.vocab[\"" + tok + "\"] is not a valid id");
    vocab[tok] = static_cast<int32_t>(idv.integer);
  }
  // (Text would become its special tokens alone, without a word.)
  if (vocab.empty()) bad("model.vocab is empty: the tokenizer would map every text to nothing");
  if (const std::string u = string_member(m, "unk_token", origin); !u.empty()) {
    auto it = vocab.find(u);
    if (it == vocab.end()) bad("unk_token \"" + u + "\" is not in the vocabulary");
    unk = it->second;
  }

  const json::Value& ms = member(m, "merges", origin, "\"model\"");
  if (!ms.is_array()) bad("model.merges is not an array");
  merges.reserve(ms.items.size() * 2);
  int32_t rank = 0;
  for (const auto& e : ms.items) {
    std::string a, b;
    if (e.is_string()) {
      const size_t sp = e.str.find(' ');
      if (sp == std::string::npos || e.str.find(' ', sp + 1) != std::string::npos)
        bad("merge " + std::to_string(rank) + " \"" + e.str + "\" is not two tokens");
      a = e.str.substr(0, sp);
      b = e.str.substr(sp + 1);
    } else if (e.is_array() && e.items.size() == 2 && e.items[0].is_string() &&
               e.items[1].is_string()) {
      a = e.items[0].str;
      b = e.items[1].str;
    } else {
      bad("merge " + std::to_string(rank) + " is neither \"a b\" nor [\"a\", \"b\"]");
    }
    auto ia = vocab.find(a), ib = vocab.find(b), ic = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || ic == vocab.end())
      bad("merge " + std::to_string(rank) + " (\"" + a + "\", \"" + b +
          "\") uses a token that is not in the vocabulary");
    // The first occurrence of a pair keeps its rank, as in the reference library.
    merges.emplace(pair_key(ia->second, ib->second), MergeInfo{rank, ic->second});
    ++rank;
  }
}

void BpeTokenizer::Impl::load_added(const json::Value& a) {
  for (const auto& e : a.items) {
    if (!e.is_object()) bad("added_tokens holds something that is not an object");
    AddedToken t;
    const json::Value* id = e.find("id");
    if (!id || !id->is_int || id->integer < 0 || id->integer > INT32_MAX)
      bad("an added token has no valid \"id\"");
    t.id = static_cast<int32_t>(id->integer);
    t.content = string_member(e, "content", origin);
    if (t.content.empty()) bad("added token " + std::to_string(t.id) + " has no content");
    t.special = bool_member(e, "special", false, origin);
    t.lstrip = bool_member(e, "lstrip", false, origin);
    t.rstrip = bool_member(e, "rstrip", false, origin);
    t.single_word = bool_member(e, "single_word", false, origin);
    // The reference library writes the flag always; without it, its own default for a new
    // token: special tokens are matched as written, the others in normalized text.
    t.normalized = bool_member(e, "normalized", !t.special, origin);
    added.push_back(std::move(t));
  }
}

void BpeTokenizer::Impl::load_pre(const json::Value& p) {
  const std::string type = type_member(p, "pre-tokenizer", origin);
  if (type == "Sequence") {
    const json::Value& list = member(p, "pretokenizers", origin, "the Sequence pre-tokenizer");
    for (const auto& s : list.items) load_pre(s);
    return;
  }
  if (!pre.empty() && pre.back().kind == PreStep::Kind::byte_level)
    bad("pre-tokenizer " + type + " after ByteLevel is not supported");
  PreStep step;
  if (type == "ByteLevel") {
    step.kind = PreStep::Kind::byte_level;
    step.add_prefix_space = bool_member(p, "add_prefix_space", false, origin);
    if (bool_member(p, "use_regex", true, origin))
      step.regex = std::make_shared<const Regex>(kGpt2Pattern, false, origin);
    byte_level = true;
  } else if (type == "Split") {
    const json::Value& pat = member(p, "pattern", origin, "the Split pre-tokenizer");
    if (const auto* r = pat.find("Regex"); r && r->is_string())
      step.regex = std::make_shared<const Regex>(r->str, false, origin);
    else if (const auto* s = pat.find("String"); s && s->is_string())
      step.regex = std::make_shared<const Regex>(s->str, true, origin);
    else
      bad("Split pre-tokenizer pattern is neither {\"Regex\": ...} nor {\"String\": ...}");
    const std::string b = string_member(p, "behavior", origin);
    if (b == "Removed")
      step.behavior = SplitBehavior::removed;
    else if (b == "Isolated")
      step.behavior = SplitBehavior::isolated;
    else if (b == "MergedWithPrevious")
      step.behavior = SplitBehavior::merged_with_previous;
    else if (b == "MergedWithNext")
      step.behavior = SplitBehavior::merged_with_next;
    else if (b == "Contiguous")
      step.behavior = SplitBehavior::contiguous;
    else
      bad("Split pre-tokenizer behavior \"" + b + "\" is unknown");
    step.invert = bool_member(p, "invert", false, origin);
  } else if (type == "Metaspace") {
    step.kind = PreStep::Kind::metaspace;
    step.replacement = metaspace_options(p, step.prepend);
    // split=true: each replacement character starts a new piece.
    if (bool_member(p, "split", true, origin)) {
      step.regex = std::make_shared<const Regex>(step.replacement, true, origin);
      step.behavior = SplitBehavior::merged_with_next;
    }
  } else if (type == "Digits") {
    // Digits splits off runs of digits (or each digit): a Split on a digit regex.
    step.regex = std::make_shared<const Regex>(
        bool_member(p, "individual_digits", false, origin) ? R"(\p{N})" : R"(\p{N}+)", false,
        origin);
  } else {
    bad("pre-tokenizer type \"" + type + "\" is not supported");
  }
  pre.push_back(std::move(step));
}

// The replacement character and prepend scheme of a Metaspace pre-tokenizer or decoder (older
// files have add_prefix_space instead of prepend_scheme).
std::string BpeTokenizer::Impl::metaspace_options(const json::Value& v,
                                                  PrependScheme& scheme) const {
  std::string rep = string_member(v, "replacement", origin);
  if (rep.empty()) rep = "\xE2\x96\x81";  // U+2581, the library's default
  const std::string ps = string_member(v, "prepend_scheme", origin);
  if (ps == "always")
    scheme = PrependScheme::always;
  else if (ps == "first")
    scheme = PrependScheme::first;
  else if (ps == "never")
    scheme = PrependScheme::never;
  else if (ps.empty())
    scheme = bool_member(v, "add_prefix_space", true, origin) ? PrependScheme::always
                                                              : PrependScheme::never;
  else
    bad("Metaspace prepend_scheme \"" + ps + "\" is unknown");
  return rep;
}

void BpeTokenizer::Impl::load_decoder(const json::Value& d) {
  const std::string type = type_member(d, "decoder", origin);
  DecodeStep s;
  if (type == "Sequence") {
    for (const auto& x : member(d, "decoders", origin, "the Sequence decoder").items)
      load_decoder(x);
    return;
  } else if (type == "ByteLevel") {
    s.kind = DecodeStep::Kind::byte_level;
  } else if (type == "ByteFallback") {
    s.kind = DecodeStep::Kind::byte_fallback;
  } else if (type == "Fuse") {
    s.kind = DecodeStep::Kind::fuse;
  } else if (type == "Replace") {
    s.kind = DecodeStep::Kind::replace;
    const json::Value& pat = member(d, "pattern", origin, "the Replace decoder");
    const json::Value* str = pat.find("String");
    if (!str || !str->is_string() || str->str.empty())
      bad("Replace decoder: only a non-empty {\"String\": ...} pattern is supported");
    s.pattern = str->str;
    s.content = string_member(d, "content", origin);
  } else if (type == "Metaspace") {
    s.kind = DecodeStep::Kind::metaspace;
    s.pattern = metaspace_options(d, s.prepend);
  } else if (type == "Strip") {
    s.kind = DecodeStep::Kind::strip;
    s.strip_char = string_member(d, "content", origin);
    const auto count = [&](const char* key) -> int64_t {
      const json::Value* c = d.find(key);
      if (!c || c->is_null()) return 0;
      if (!c->is_int || c->integer < 0)
        bad(std::string("the Strip decoder's \"") + key + "\" is not a count of characters");
      return c->integer;
    };
    s.strip_start = count("start");
    s.strip_stop = count("stop");
  } else {
    bad("decoder type \"" + type + "\" is not supported");
  }
  dec.push_back(std::move(s));
}

void BpeTokenizer::Impl::load_normalizer(const json::Value& n) {
  const std::string type = type_member(n, "normalizer", origin);
  NormStep s;
  if (type == "Sequence") {
    for (const auto& x : member(n, "normalizers", origin, "the Sequence normalizer").items)
      load_normalizer(x);
    return;
  } else if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    s.kind = NormStep::Kind::unicode;
    s.utf8proc_options = UTF8PROC_STABLE |
                         (type == "NFC" || type == "NFKC" ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) |
                         (type[2] == 'K' ? UTF8PROC_COMPAT : 0);
  } else if (type == "Prepend") {
    s.kind = NormStep::Kind::prepend;
    s.content = string_member(n, "prepend", origin);
  } else if (type == "Replace") {
    s.kind = NormStep::Kind::replace;
    const json::Value& pat = member(n, "pattern", origin, "the Replace normalizer");
    const json::Value* str = pat.find("String");
    if (!str || !str->is_string() || str->str.empty())
      bad("Replace normalizer: only a non-empty {\"String\": ...} pattern is supported");
    s.pattern = str->str;
    s.content = string_member(n, "content", origin);
  } else {
    bad("normalizer type \"" + type + "\" is not supported");
  }
  norm.push_back(std::move(s));
}

std::string BpeTokenizer::Impl::normalize(std::string_view chunk) const {
  std::string t(chunk);
  for (const NormStep& s : norm) {
    switch (s.kind) {
      case NormStep::Kind::unicode: {
        utf8proc_uint8_t* out = nullptr;
        const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(t.data()),
                                                static_cast<utf8proc_ssize_t>(t.size()), &out,
                                                static_cast<utf8proc_option_t>(s.utf8proc_options));
        // utf8proc allocates with malloc; released on every path.
        std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> guard(out, &std::free);
        if (n < 0)
          throw Error("tokenizer " + origin +
                      ": Unicode normalization failed: " + utf8proc_errmsg(n));
        t.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
        break;
      }
      case NormStep::Kind::prepend:
        if (!t.empty()) t.insert(0, s.content);
        break;
      case NormStep::Kind::replace: {
        std::string r;
        for (size_t i = 0; i < t.size();) {
          if (t.compare(i, s.pattern.size(), s.pattern) == 0) {
            r += s.content;
            i += s.pattern.size();
          } else {
            r += t[i++];
          }
        }
        t = std::move(r);
        break;
      }
    }
  }
  return t;
}

// Cuts text at the added tokens of `set`: leftmost match first, the longest at that position.
// Pieces with id >= 0 are added tokens, the others ordinary text. As the reference, the text is
// scanned once, left to right: a single_word match that touches a word character is dropped and
// the scan goes on after it (no shorter or overlapping token is tried there instead), and
// lstrip/rstrip whitespace is taken from this text only, never from an earlier token's.
void BpeTokenizer::Impl::split_added(std::string_view text, const AddedSet& set,
                                     std::vector<std::pair<std::string_view, int32_t>>& out) const {
  size_t plain = 0, i = 0;
  size_t len = 0;
  while (i < text.size()) {
    if (!set.first[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const AddedToken* hit = set.longest_at(text, i);
    if (!hit) {
      ++i;
      continue;
    }
    size_t begin = i, end = i + hit->match.size();
    if (hit->single_word && ((begin > 0 && is_word_char(code_point_before(text, begin, len))) ||
                             (end < text.size() && is_word_char(code_point_at(text, end, len))))) {
      i = end;
      continue;
    }
    // lstrip/rstrip: the token swallows the whitespace beside it.
    if (hit->lstrip)
      while (begin > plain && is_white_space(code_point_before(text, begin, len))) begin -= len;
    if (hit->rstrip)
      while (end < text.size() && is_white_space(code_point_at(text, end, len))) end += len;
    if (begin > plain) out.emplace_back(text.substr(plain, begin - plain), -1);
    out.emplace_back(text.substr(begin, end - begin), hit->id);
    plain = i = end;
  }
  if (plain < text.size()) out.emplace_back(text.substr(plain), -1);
}

// Applies the pre-tokenizer steps to a chunk. The pieces point into `chunk`, or into `storage`
// for pieces that ByteLevel(add_prefix_space) gave a leading space.
void BpeTokenizer::Impl::pre_tokenize(std::string_view chunk, bool at_text_start,
                                      std::vector<std::string_view>& pieces,
                                      std::vector<MatchData>& md,
                                      std::deque<std::string>& storage) const {
  pieces.assign(1, chunk);
  std::vector<std::string_view> next;
  std::vector<std::pair<std::string_view, bool>> segs;  // (segment, is a match)
  for (size_t k = 0; k < pre.size(); ++k) {
    const PreStep& st = pre[k];
    if (st.kind == PreStep::Kind::metaspace) {
      for (auto& p : pieces) {
        if (p.empty()) continue;
        std::string& q = storage.emplace_back();
        const std::string_view rep = st.replacement;
        // "first": only the piece that starts the whole text (not one after an added token).
        // The reference checks for a leading replacement after spaces became replacements.
        const bool prepend =
            p.front() != ' ' && p.compare(0, rep.size(), rep) != 0 &&
            (st.prepend == PrependScheme::always ||
             (st.prepend == PrependScheme::first && at_text_start && p.data() == chunk.data()));
        if (prepend) q += rep;
        for (char c : p) {
          if (c == ' ')
            q += rep;
          else
            q += c;
        }
        p = q;
      }
    }
    if (st.kind == PreStep::Kind::byte_level && st.add_prefix_space) {
      for (auto& p : pieces)
        if (!p.empty() && p.front() != ' ') {
          // Built by appending: GCC 12 warns falsely (-Wrestrict) about " " + std::string&&.
          std::string& q = storage.emplace_back(1, ' ');
          q += p;
          p = q;
        }
    }
    if (!st.regex) continue;
    if (!md[k]) md[k] = st.regex->match_data();
    next.clear();
    for (std::string_view p : pieces) {
      segs.clear();
      size_t last = 0;
      st.regex->for_each_match(p, md[k].get(), [&](size_t b, size_t e) {
        if (b > last) segs.emplace_back(p.substr(last, b - last), false);
        segs.emplace_back(p.substr(b, e - b), true);
        last = e;
      });
      if (last < p.size()) segs.emplace_back(p.substr(last), false);
      if (st.invert)
        for (auto& s : segs) s.second = !s.second;
      const auto start = next.size();
      bool prev_match = false;
      auto extend = [&](std::string_view& a, std::string_view b) {
        a = std::string_view(a.data(), a.size() + b.size());  // adjacent in p
      };
      switch (st.behavior) {
        case SplitBehavior::isolated:
          for (auto& s : segs) next.push_back(s.first);
          break;
        case SplitBehavior::removed:
          for (auto& s : segs)
            if (!s.second) next.push_back(s.first);
          break;
        case SplitBehavior::merged_with_previous:
          for (auto& s : segs) {
            if (s.second && !prev_match && next.size() > start)
              extend(next.back(), s.first);
            else
              next.push_back(s.first);
            prev_match = s.second;
          }
          break;
        case SplitBehavior::merged_with_next: {
          // A match joins the segment after it: walk backwards and merge into the front.
          std::vector<std::string_view> rev;
          for (size_t j = segs.size(); j-- > 0;) {
            const auto& s = segs[j];
            if (s.second && !prev_match && !rev.empty())
              rev.back() = std::string_view(s.first.data(), s.first.size() + rev.back().size());
            else
              rev.push_back(s.first);
            prev_match = s.second;
          }
          next.insert(next.end(), rev.rbegin(), rev.rend());
          break;
        }
        case SplitBehavior::contiguous:
          for (auto& s : segs) {
            if (s.second && prev_match && next.size() > start)
              extend(next.back(), s.first);
            else
              next.push_back(s.first);
            prev_match = s.second;
          }
          break;
      }
    }
    pieces.swap(next);
  }
}

void BpeTokenizer::Impl::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() <= kMaxCachedWord) {
    std::lock_guard<std::mutex> lk(cache_mu);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t before = out.size();
  bpe_uncached(word, out);
  if (word.size() <= kMaxCachedWord) {
    std::lock_guard<std::mutex> lk(cache_mu);
    // Dropping everything when full is crude but bounded, and natural text refills the common
    // words within a few kilobytes.
    if (cache.size() >= kMaxCacheEntries) cache.clear();
    cache.emplace(std::string(word),
                  std::vector<int32_t>(out.begin() + static_cast<long>(before), out.end()));
  }
}

void BpeTokenizer::Impl::bpe_uncached(std::string_view raw, std::vector<int32_t>& out) const {
  // What the model sees: the byte-mapped text under ByteLevel, the text itself otherwise.
  std::string mapped;
  std::string_view word = raw;
  if (byte_level) {
    mapped.reserve(raw.size() * 2);
    for (char c : raw) mapped += byte_char[static_cast<unsigned char>(c)];
    word = mapped;
  }
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }

  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Sym> sym;
  sym.reserve(word.size());
  auto push = [&](int32_t id) {
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, true});
  };
  bool last_unk = false;
  size_t k = 0;  // raw byte of the current character (ByteLevel: one per character)
  for (size_t i = 0; i < word.size(); ++k) {
    const size_t n = std::min(utf8_len(static_cast<unsigned char>(word[i])), word.size() - i);
    int32_t id = -1;
    if (byte_level) {
      id = byte_id[static_cast<unsigned char>(raw[k])];  // no hashing for the common case
    } else if (auto it = vocab.find(word.substr(i, n)); it != vocab.end()) {
      id = it->second;
    }
    if (id >= 0) {
      push(id);
      last_unk = false;
    } else if (byte_fallback &&
               std::all_of(
                   word.begin() + static_cast<long>(i), word.begin() + static_cast<long>(i + n),
                   [&](char c) { return fallback_id[static_cast<unsigned char>(c)] >= 0; })) {
      for (size_t j = i; j < i + n; ++j) push(fallback_id[static_cast<unsigned char>(word[j])]);
      last_unk = false;
    } else if (unk >= 0) {
      if (!(fuse_unk && last_unk)) push(unk);
      last_unk = true;
    }
    // Without an unk token an unknown character is dropped, as in the reference library.
    i += n;
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Cand {
    int32_t rank, pos, new_id;
  };
  // Lowest rank first, then leftmost.
  auto worse = [](const Cand& a, const Cand& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::vector<Cand> heap;
  auto consider = [&](int32_t pos) {
    const int32_t nx = sym[static_cast<size_t>(pos)].next;
    if (nx < 0) return;
    auto m =
        merges.find(pair_key(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(nx)].id));
    if (m == merges.end()) return;
    heap.push_back({m->second.rank, pos, m->second.new_id});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (int32_t p = 0; p + 1 < static_cast<int32_t>(sym.size()); ++p) consider(p);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Cand c = heap.back();
    heap.pop_back();
    Sym& left = sym[static_cast<size_t>(c.pos)];
    if (!left.alive || left.next < 0) continue;
    Sym& right = sym[static_cast<size_t>(left.next)];
    // Stale entry: one side was merged into something else since it was queued.
    auto m = merges.find(pair_key(left.id, right.id));
    if (m == merges.end() || m->second.new_id != c.new_id) continue;
    left.id = c.new_id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[static_cast<size_t>(right.next)].prev = c.pos;
    if (left.prev >= 0) consider(left.prev);
    consider(c.pos);
  }
  for (int32_t p = 0; p >= 0; p = sym[static_cast<size_t>(p)].next)
    out.push_back(sym[static_cast<size_t>(p)].id);
}

BpeTokenizer::BpeTokenizer(std::string_view text, const std::string& origin, Format format)
    : impl_(std::make_unique<Impl>()) {
  impl_->origin = origin;
  if (format == Format::tiktoken) {
    impl_->load_tiktoken(text);
    return;
  }
  const std::string_view json_text = text;
  json::Value root;
  try {
    root = json::parse(json_text);
  } catch (const json::ParseError& e) {
    throw UsageError(origin + ": malformed JSON at byte " + std::to_string(e.offset) + ": " +
                     e.what);
  }
  impl_->load(root);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_file(const std::string& path) {
  return std::make_unique<BpeTokenizer>(read_file(path, "tokenizer"), path);
}

BpeTokenizer::~BpeTokenizer() = default;

std::vector<int32_t> BpeTokenizer::encode(const std::string& text) const {
  const Impl& im = *impl_;
  if (const size_t bad = utf8_invalid_at(text); bad != std::string::npos)
    throw Error("tokenizer " + im.origin + ": text is not valid UTF-8 (byte " +
                std::to_string(bad) + ")");
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  std::vector<std::pair<std::string_view, int32_t>> chunks, parts;
  if (im.match_added)
    im.split_added(text, im.raw_added, chunks);
  else
    chunks.emplace_back(text, -1);
  std::vector<MatchData> md(im.pre.size());
  std::vector<std::string_view> pieces;
  std::deque<std::string> prefixed;
  for (const auto& [chunk, id] : chunks) {
    if (id >= 0) {
      ids.push_back(id);
      continue;
    }
    // Normalizers run on the text between the raw added tokens, as in the reference library;
    // the normalized added tokens are found in what they make.
    std::string_view n = chunk;
    if (!im.norm.empty()) n = prefixed.emplace_back(im.normalize(chunk));
    parts.clear();
    if (im.match_added && !im.normalized_added.tokens.empty())
      im.split_added(n, im.normalized_added, parts);
    else
      parts.emplace_back(n, -1);
    for (const auto& [part, part_id] : parts) {
      if (part_id >= 0) {
        ids.push_back(part_id);
        continue;
      }
      // Only the part at the very start of the text is "first" for Metaspace.
      im.pre_tokenize(part, chunk.data() == text.data() && part.data() == n.data(), pieces, md,
                      prefixed);
      for (std::string_view p : pieces)
        if (!p.empty()) im.bpe_word(p, ids);
    }
  }
  return ids;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& im = *impl_;
  std::vector<std::string> toks;
  toks.reserve(ids.size());
  for (int32_t id : ids)
    if (id >= 0 && id < im.n_vocab && !im.id_to_token[static_cast<size_t>(id)].empty())
      toks.push_back(im.id_to_token[static_cast<size_t>(id)]);
  if (!im.has_decoder) {
    std::string out;
    for (size_t i = 0; i < toks.size(); ++i) {
      if (i) out += ' ';
      out += toks[i];
    }
    return out;
  }
  for (const DecodeStep& s : im.dec) {
    switch (s.kind) {
      case DecodeStep::Kind::byte_level:
        for (auto& t : toks) {
          std::string bytes;
          bool ok = true;
          for (size_t i = 0; i < t.size() && ok;) {
            const size_t n = std::min(utf8_len(static_cast<unsigned char>(t[i])), t.size() - i);
            const uint32_t cp = utf8_decode(std::string_view(t).substr(i, n));
            if (cp < im.char_to_byte.size() && im.char_to_byte[cp] >= 0)
              bytes += static_cast<char>(im.char_to_byte[cp]);
            else
              ok = false;  // not a byte-mapped token (an added one): kept as it is
            i += n;
          }
          if (ok) t = std::move(bytes);
        }
        {
          // As the reference: the bytes of every token as one text, invalid UTF-8 replaced
          // (String::from_utf8_lossy) (before: raw bytes, e.g. a lone 0x98 in mt decode's output,
          // which a reader of text fails on).
          std::string all;
          for (const auto& t : toks) all += t;
          toks.assign(1, utf8_lossy(all));
        }
        break;
      case DecodeStep::Kind::byte_fallback: {
        std::vector<std::string> res;
        std::string pending;
        size_t pending_n = 0;
        auto flush = [&] {
          if (!pending_n) return;
          if (utf8_invalid_at(pending) == std::string::npos) {
            res.push_back(pending);
          } else {
            // As the reference: one replacement character per byte of an invalid run.
            for (size_t i = 0; i < pending_n; ++i) res.push_back("\xEF\xBF\xBD");
          }
          pending.clear();
          pending_n = 0;
        };
        for (auto& t : toks) {
          int v = -1;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>') v = hex_byte(t[3], t[4]);
          if (v >= 0) {
            pending += static_cast<char>(v);
            ++pending_n;
          } else {
            flush();
            res.push_back(std::move(t));
          }
        }
        flush();
        toks.swap(res);
        break;
      }
      case DecodeStep::Kind::fuse: {
        std::string all;
        for (auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecodeStep::Kind::replace:
        for (auto& t : toks) {
          std::string r;
          for (size_t i = 0; i < t.size();) {
            if (t.compare(i, s.pattern.size(), s.pattern) == 0) {
              r += s.content;
              i += s.pattern.size();
            } else {
              r += t[i++];
            }
          }
          t = std::move(r);
        }
        break;
      case DecodeStep::Kind::metaspace:
        // As the reference: replacement characters become spaces, except in the first token,
        // where they are dropped (the prefix the pre-tokenizer added) unless it never adds one.
        for (size_t i = 0; i < toks.size(); ++i) {
          std::string r;
          const std::string& t = toks[i];
          for (size_t j = 0; j < t.size();) {
            if (t.compare(j, s.pattern.size(), s.pattern) == 0) {
              if (i != 0 || s.prepend == PrependScheme::never) r += ' ';
              j += s.pattern.size();
            } else {
              r += t[j++];
            }
          }
          toks[i] = std::move(r);
        }
        break;
      case DecodeStep::Kind::strip:
        for (auto& t : toks) {
          const std::string& c = s.strip_char;
          if (c.empty()) continue;
          for (int64_t k = 0; k < s.strip_start && t.compare(0, c.size(), c) == 0; ++k)
            t.erase(0, c.size());
          for (int64_t k = 0; k < s.strip_stop && t.size() >= c.size() &&
                              t.compare(t.size() - c.size(), c.size(), c) == 0;
               ++k)
            t.erase(t.size() - c.size());
        }
        break;
    }
  }
  std::string out;
  for (auto& t : toks) out += t;
  return out;
}

int64_t BpeTokenizer::vocab_size() const {
  return impl_->n_vocab;
}
int32_t BpeTokenizer::bos_id() const {
  return impl_->bos;
}
int32_t BpeTokenizer::eos_id() const {
  return impl_->eos;
}

void BpeTokenizer::name_specials(const std::string& bos, const std::string& eos) {
  if (const int32_t b = bos.empty() ? -1 : token_to_id(bos); b >= 0) impl_->bos = b;
  if (const int32_t e = eos.empty() ? -1 : token_to_id(eos); e >= 0) impl_->eos = e;
}

int32_t BpeTokenizer::token_to_id(const std::string& token) const {
  for (const auto& a : impl_->added)
    if (a.content == token) return a.id;
  auto it = impl_->vocab.find(token);
  return it == impl_->vocab.end() ? -1 : it->second;
}

std::string BpeTokenizer::id_to_token(int32_t id) const {
  return id >= 0 && id < impl_->n_vocab ? impl_->id_to_token[static_cast<size_t>(id)]
                                        : std::string();
}

}  // namespace mt
