// The data plugins (synthetic, tokens), loaded through the registry as a run loads them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "config_impl.h"
#include "mt/data.h"
#include "mt/error.h"
#include "test_support.h"

namespace mt {
namespace {

namespace fs = std::filesystem;
using Pairs = std::vector<std::pair<std::string, std::string>>;

std::unique_ptr<DatasetSource> make(const std::string& type, const Pairs& kv, int rank = 0,
                                    int count = 1) {
  DataShard shard;
  shard.rank = rank;
  shard.count = count;
  return test::plugins().dataset_factory(type)(config_from_pairs(kv), shard, nullptr);
}

HostBatch next_batch(DatasetSource& s, bool eval = false) {
  HostBatch b;
  EXPECT_TRUE(s.next(b, eval));
  return b;
}

bool same(const HostBatch& a, const HostBatch& b) {
  return a.batch == b.batch && a.seq == b.seq && a.inputs == b.inputs && a.targets == b.targets &&
         a.segment_ids == b.segment_ids && a.positions == b.positions;
}

// Row r of a batch as (inputs, targets, segment ids, positions) concatenated: a row's identity.
std::vector<int32_t> row(const HostBatch& b, int64_t r) {
  std::vector<int32_t> v;
  for (const auto* f : {&b.inputs, &b.targets, &b.segment_ids, &b.positions})
    v.insert(v.end(), f->begin() + r * b.seq, f->begin() + (r + 1) * b.seq);
  return v;
}
std::vector<int32_t> field(const HostBatch& b, const std::vector<int32_t>& f, int64_t r) {
  return {f.begin() + r * b.seq, f.begin() + (r + 1) * b.seq};
}

// ---------------------------------------------------------------------------------------------
// synthetic

Pairs synthetic_cfg(int seed = 7) {
  return {{"vocab_size", "1000"},
          {"per_device_batch_size", "3"},
          {"max_target_length", "16"},
          {"data_shuffle_seed", std::to_string(seed)}};
}

TEST(SyntheticData, ShapesRangeAndShiftedTargets) {
  auto s = make("synthetic", synthetic_cfg());
  EXPECT_EQ(s->name(), "synthetic");
  HostBatch b = next_batch(*s);
  ASSERT_EQ(b.batch, 3);
  ASSERT_EQ(b.seq, 16);
  for (const auto* f : {&b.inputs, &b.targets, &b.segment_ids, &b.positions})
    ASSERT_EQ(f->size(), 48u);
  for (int64_t r = 0; r < 3; ++r)
    for (int64_t t = 0; t < 16; ++t) {
      const size_t i = static_cast<size_t>(r * 16 + t);
      EXPECT_GE(b.inputs[i], 0);
      EXPECT_LT(b.inputs[i], 1000);
      EXPECT_GE(b.targets[i], 0);
      EXPECT_LT(b.targets[i], 1000);
      EXPECT_EQ(b.positions[i], t);
      EXPECT_EQ(b.segment_ids[i], 1);
      if (t > 0) {
        EXPECT_EQ(b.inputs[i], b.targets[i - 1]);
      }
    }
}

TEST(SyntheticData, DeterministicPerSeed) {
  auto a = make("synthetic", synthetic_cfg(7)), b = make("synthetic", synthetic_cfg(7));
  auto c = make("synthetic", synthetic_cfg(8));
  for (int i = 0; i < 3; ++i) {
    HostBatch x = next_batch(*a), y = next_batch(*b), z = next_batch(*c);
    EXPECT_TRUE(same(x, y));
    EXPECT_FALSE(same(x, z));
  }
}

TEST(SyntheticData, RestoreYieldsTheNextBatch) {
  auto a = make("synthetic", synthetic_cfg());
  for (int i = 0; i < 5; ++i) next_batch(*a);
  const std::string st = a->state();
  EXPECT_EQ(st, "rows:" + std::to_string(5 * 3));
  HostBatch want = next_batch(*a);
  auto b = make("synthetic", synthetic_cfg());
  b->restore(st);
  EXPECT_TRUE(same(next_batch(*b), want));
  b->restore("5");  // the older form: batches of this shape
  EXPECT_TRUE(same(next_batch(*b), want));
  EXPECT_THROW(b->restore("five"), Error);
  EXPECT_THROW(b->restore("rows:"), Error);
}

// The state counts rows: resumed with another batch size (or ranks), the stream goes on at the
// next row. Before, it counted batches, so 2 batches of 4 resumed at batch 2 re-read rows 4-5.
TEST(SyntheticData, ResumeWithAnotherBatchSizeGoesOnAtTheNextRow) {
  Pairs four = synthetic_cfg(), two = synthetic_cfg();
  for (auto& [k, v] : four)
    if (k == "per_device_batch_size") v = "4";
  for (auto& [k, v] : two)
    if (k == "per_device_batch_size") v = "2";
  auto a = make("synthetic", four);
  next_batch(*a);
  next_batch(*a);  // rows 0-7
  auto b = make("synthetic", two);
  b->restore(a->state());
  auto straight = make("synthetic", two);
  for (int i = 0; i < 4; ++i) next_batch(*straight);         // rows 0-7
  EXPECT_TRUE(same(next_batch(*b), next_batch(*straight)));  // rows 8-9
  // On two ranks of batch 2: rank 1's first batch is rows 10-11.
  auto r1 = make("synthetic", two, 1, 2);
  r1->restore(a->state());
  EXPECT_TRUE(same(next_batch(*r1), next_batch(*straight)));
}

TEST(SyntheticData, RanksShareTheSingleRankStream) {
  auto one = make("synthetic", synthetic_cfg());
  auto r0 = make("synthetic", synthetic_cfg(), 0, 2), r1 = make("synthetic", synthetic_cfg(), 1, 2);
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(same(next_batch(*r0), next_batch(*one)));
    EXPECT_TRUE(same(next_batch(*r1), next_batch(*one)));
  }
}

TEST(SyntheticData, EvalIsSeparateAndRepeatsPerEvaluation) {
  auto s = make("synthetic", synthetic_cfg());
  HostBatch t = next_batch(*s);
  HostBatch e0 = next_batch(*s, true), e1 = next_batch(*s, true);
  EXPECT_FALSE(same(t, e0));
  EXPECT_FALSE(same(e0, e1));
  next_batch(*s);  // training resumes; the next evaluation starts over
  EXPECT_TRUE(same(next_batch(*s, true), e0));
  EXPECT_TRUE(same(next_batch(*s, true), e1));
}

// ---------------------------------------------------------------------------------------------
// tokens

// Writes a tokens file (the format of plugins/data/tokens/token_file.h) with the writer a user
// would write: no code shared with the plugin.
void write_tokens(const fs::path& p, const std::vector<uint32_t>& ids, uint32_t eos,
                  uint32_t bos = 0xFFFFFFFFu, uint32_t dtype = 2, const char* magic = "MTTOKENS",
                  int64_t count_override = -1) {
  std::ofstream f(p, std::ios::binary);
  f.write(magic, 8);
  auto put = [&](auto v) { f.write(reinterpret_cast<const char*>(&v), sizeof v); };
  put(uint32_t{1});
  put(dtype);
  put(static_cast<uint64_t>(count_override >= 0 ? count_override
                                                : static_cast<int64_t>(ids.size())));
  put(eos);
  put(bos);
  for (uint32_t id : ids) {
    if (dtype == 2)
      put(static_cast<uint16_t>(id));
    else
      put(id);
  }
}

constexpr uint32_t kEos = 1;

// A corpus of `docs` documents of 3..17 ids each, every id unique except the eos ending each
// document, so any row identifies where it came from.
std::vector<uint32_t> corpus(int docs, uint32_t first_id = 10) {
  std::vector<uint32_t> v;
  uint32_t id = first_id;
  for (int d = 0; d < docs; ++d) {
    const int len = 2 + (d * 7) % 15;
    for (int i = 0; i < len; ++i) v.push_back(id++);
    v.push_back(kEos);
  }
  return v;
}

class TokensData : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ =
        fs::temp_directory_path() / ("mt_data_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string file(const std::string& name) const { return (dir_ / name).string(); }

  // Config of a tokens source over `path`; extra pairs override.
  static Pairs cfg(const std::string& path, Pairs extra = {}) {
    Pairs kv = {{"dataset_path", path},         {"vocab_size", "5000"}, {"max_target_length", "8"},
                {"per_device_batch_size", "2"}, {"packing", "true"},    {"eval_split", "0.0"},
                {"data_shuffle_seed", "3"}};
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

  // Every row of `n` batches.
  static std::vector<std::vector<int32_t>> rows(DatasetSource& s, int n, bool eval = false) {
    std::vector<std::vector<int32_t>> out;
    for (int i = 0; i < n; ++i) {
      HostBatch b = next_batch(s, eval);
      for (int64_t r = 0; r < b.batch; ++r) out.push_back(row(b, r));
    }
    return out;
  }

  fs::path dir_;
};

TEST_F(TokensData, PackingSegmentsPositionsAndMaskedBoundaries) {
  // Three documents, the last without an eos (the end of the file ends it): 9 ids, one row.
  write_tokens(file("a.tokens"), {5, 6, kEos, 7, 8, 9, kEos, 10, 11}, kEos);
  auto s = make("tokens", cfg(file("a.tokens")));
  EXPECT_EQ(s->name(), "tokens");
  HostBatch b = next_batch(*s);
  ASSERT_EQ(b.batch, 2);
  ASSERT_EQ(b.seq, 8);
  for (int r = 0; r < 2; ++r) {  // one row per epoch: both rows of the batch are it
    EXPECT_EQ(field(b, b.inputs, r), (std::vector<int32_t>{5, 6, 1, 7, 8, 9, 1, 10}));
    EXPECT_EQ(field(b, b.targets, r), (std::vector<int32_t>{6, 1, -1, 8, 9, 1, -1, 11}));
    EXPECT_EQ(field(b, b.segment_ids, r), (std::vector<int32_t>{1, 1, 1, 2, 2, 2, 2, 3}));
    EXPECT_EQ(field(b, b.positions, r), (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0}));
  }
}

// A file of documents marked by bos alone (mt tokenize add_eos=false writes one): each bos
// starts a document, as an eos ends one (before: the documents ran together, so packed rows
// attended across them and each bos was a target of the document before it).
TEST_F(TokensData, ABosStartsADocumentWithoutEos) {
  constexpr uint32_t kBos = 2;
  write_tokens(file("b.tokens"), {kBos, 5, 6, kBos, 7, 8, 9, kBos, 10, 11}, 0xFFFFFFFFu, kBos);
  auto s = make("tokens", cfg(file("b.tokens")));
  HostBatch b = next_batch(*s);
  ASSERT_EQ(b.seq, 8);
  EXPECT_EQ(field(b, b.inputs, 0), (std::vector<int32_t>{2, 5, 6, 2, 7, 8, 9, 2}));
  EXPECT_EQ(field(b, b.targets, 0), (std::vector<int32_t>{5, 6, -1, 7, 8, 9, -1, 10}));
  EXPECT_EQ(field(b, b.segment_ids, 0), (std::vector<int32_t>{1, 1, 1, 2, 2, 2, 2, 3}));
  EXPECT_EQ(field(b, b.positions, 0), (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0}));
}

TEST_F(TokensData, PackedRowsCoverTheStreamOncePerEpoch) {
  const auto ids = corpus(40);
  write_tokens(file("a.tokens"), ids, kEos);
  const size_t n_rows = (ids.size() - 1) / 8;
  auto s = make("tokens", cfg(file("a.tokens"), {{"per_device_batch_size", "1"}}));
  auto got = rows(*s, static_cast<int>(n_rows));
  // Each row starts at a multiple of 8 in the stream; its inputs are ids[8k .. 8k+8).
  std::set<size_t> starts;
  for (const auto& r : got) {
    auto it = std::search(ids.begin(), ids.end(), r.begin(), r.begin() + 8,
                          [](uint32_t a, int32_t b) { return static_cast<int32_t>(a) == b; });
    ASSERT_NE(it, ids.end());
    const size_t at = static_cast<size_t>(it - ids.begin());
    EXPECT_EQ(at % 8, 0u);
    starts.insert(at);
    for (int j = 0; j < 8; ++j) {
      const int32_t target = r[8 + static_cast<size_t>(j)];
      const uint32_t next = ids[at + static_cast<size_t>(j) + 1];
      EXPECT_EQ(target, ids[at + static_cast<size_t>(j)] == kEos ? -1 : static_cast<int32_t>(next));
    }
  }
  EXPECT_EQ(starts.size(), n_rows);  // a permutation: every row once
}

TEST_F(TokensData, NoPackingPadsAndTruncates) {
  write_tokens(file("a.tokens"), {5, 6, kEos, 7, 8, 9, kEos, 10, 11}, kEos);
  auto s =
      make("tokens",
           cfg(file("a.tokens"),
               {{"packing", "false"}, {"max_target_length", "4"}, {"per_device_batch_size", "3"}}));
  HostBatch b = next_batch(*s);
  std::map<int32_t, int64_t> by_first;  // first input -> row
  for (int64_t r = 0; r < 3; ++r) by_first[field(b, b.inputs, r)[0]] = r;
  ASSERT_EQ(by_first.size(), 3u);
  auto check = [&](int32_t first, std::vector<int32_t> in, std::vector<int32_t> tg,
                   std::vector<int32_t> seg, std::vector<int32_t> pos) {
    const int64_t r = by_first.at(first);
    EXPECT_EQ(field(b, b.inputs, r), in);
    EXPECT_EQ(field(b, b.targets, r), tg);
    EXPECT_EQ(field(b, b.segment_ids, r), seg);
    EXPECT_EQ(field(b, b.positions, r), pos);
  };
  check(5, {5, 6, 0, 0}, {6, 1, -1, -1}, {1, 1, 0, 0}, {0, 1, 0, 0});
  check(7, {7, 8, 9, 0}, {8, 9, 1, -1}, {1, 1, 1, 0}, {0, 1, 2, 0});
  check(10, {10, 0, 0, 0}, {11, -1, -1, -1}, {1, 0, 0, 0}, {0, 0, 0, 0});

  // Truncation to max_target_length + 1 ids.
  auto t =
      make("tokens",
           cfg(file("a.tokens"),
               {{"packing", "false"}, {"max_target_length", "2"}, {"per_device_batch_size", "3"}}));
  HostBatch c = next_batch(*t);
  for (int64_t r = 0; r < 3; ++r)
    if (field(c, c.inputs, r)[0] == 7) {
      EXPECT_EQ(field(c, c.inputs, r), (std::vector<int32_t>{7, 8}));
      EXPECT_EQ(field(c, c.targets, r), (std::vector<int32_t>{8, 9}));
    }
}

TEST_F(TokensData, ShuffleIsDeterministicPerSeedAndEpochsDiffer) {
  const auto ids = corpus(60);
  write_tokens(file("a.tokens"), ids, kEos);
  const int n_rows = static_cast<int>((ids.size() - 1) / 8);
  ASSERT_EQ(n_rows % 2, 0) << "the test assumes whole batches per epoch";
  const int per_epoch = n_rows / 2;
  auto a = make("tokens", cfg(file("a.tokens")));
  auto b = make("tokens", cfg(file("a.tokens")));
  auto c = make("tokens", cfg(file("a.tokens"), {{"data_shuffle_seed", "4"}}));
  auto ra = rows(*a, 2 * per_epoch), rb = rows(*b, 2 * per_epoch), rc = rows(*c, per_epoch);
  EXPECT_EQ(ra, rb);
  std::vector<std::vector<int32_t>> e0(ra.begin(), ra.begin() + n_rows),
      e1(ra.begin() + n_rows, ra.end());
  EXPECT_NE(e0, rc);  // another seed, another order
  EXPECT_NE(e0, e1);  // another epoch, another order
  // ... of the same rows: each epoch is a permutation of all rows.
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  std::sort(rc.begin(), rc.end());
  EXPECT_EQ(e0, e1);
  EXPECT_EQ(e0, rc);
  EXPECT_EQ(std::adjacent_find(e0.begin(), e0.end()), e0.end());
}

// Evaluations asked for (eval_interval > 0) with no row held out and no eval set: refused, where
// every evaluation was left out silently.
TEST_F(TokensData, EvaluationsWithoutEvalRowsAreRefused) {
  write_tokens(file("a.tokens"), corpus(60), kEos);
  EXPECT_NO_THROW(make("tokens", cfg(file("a.tokens"), {{"eval_split", "0"}})));
  try {
    make("tokens", cfg(file("a.tokens"), {{"eval_split", "0"}, {"eval_interval", "5"}}));
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("holds out no eval rows"), std::string::npos) << e.what();
  }
  // One row: eval_split above 0 holds none out, and the message says why (before: "Set eval_split
  // above 0" with it at 0.05).
  write_tokens(file("b.tokens"), corpus(2), kEos);
  try {
    make("tokens", cfg(file("b.tokens"), {{"eval_split", "0.05"}, {"eval_interval", "5"}}));
    ADD_FAILURE() << "accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("the data makes 1 row(s), too few to hold out "
                                         "eval_split=0.05"),
              std::string::npos)
        << e.what();
  }
}

TEST_F(TokensData, EvalSplitIsDisjointAndRepeats) {
  const auto ids = corpus(60);
  write_tokens(file("a.tokens"), ids, kEos);
  const size_t n_rows = (ids.size() - 1) / 8;
  auto s = make("tokens", cfg(file("a.tokens"), {{"eval_split", "0.25"}}));
  const size_t n_eval = n_rows / 4, n_train = n_rows - n_eval;
  auto train = rows(*s, static_cast<int>((n_train + 1) / 2));
  std::vector<std::vector<int32_t>> eval, again;
  HostBatch b;
  while (s->next(b, true))
    for (int64_t r = 0; r < b.batch; ++r) eval.push_back(row(b, r));
  next_batch(*s);  // back to training; the next evaluation sees the same batches
  while (s->next(b, true))
    for (int64_t r = 0; r < b.batch; ++r) again.push_back(row(b, r));
  EXPECT_EQ(eval, again);
  // A partial last batch is padded with fully masked rows.
  std::erase_if(eval, [](const std::vector<int32_t>& r) {
    return std::all_of(r.begin() + 8, r.begin() + 16, [](int32_t t) { return t == -1; });
  });
  EXPECT_EQ(eval.size(), n_eval);
  std::set<std::vector<int32_t>> ts(train.begin(), train.end());
  EXPECT_EQ(ts.size(), n_train);
  for (const auto& r : eval) EXPECT_EQ(ts.count(r), 0u) << "an eval row is also a train row";
  // With no evaluation (eval_interval=-1) no row is held out (before: eval_split of them were
  // withheld from training all the same).
  {
    auto all =
        make("tokens", cfg(file("a.tokens"), {{"eval_split", "0.25"}, {"eval_interval", "-1"}}));
    const auto every = rows(*all, static_cast<int>((n_rows + 1) / 2));
    EXPECT_EQ(std::set<std::vector<int32_t>>(every.begin(), every.end()).size(), n_rows);
  }

  // A separate eval file: all of its rows are eval rows, all of the train file's train rows.
  write_tokens(file("e.tokens"), corpus(10, 3000), kEos);
  auto t = make("tokens", cfg(file("a.tokens"), {{"eval_split", "0.25"},
                                                 {"eval_dataset_path", file("e.tokens")},
                                                 {"per_device_batch_size", "1"}}));
  int n_eval_file = 0;
  while (t->next(b, true)) {
    ++n_eval_file;
    for (int32_t id : b.inputs) EXPECT_TRUE(id == 1 || id == 0 || id >= 3000) << id;
  }
  EXPECT_GT(n_eval_file, 0);
  auto all = rows(*t, static_cast<int>(n_rows));
  std::sort(all.begin(), all.end());
  EXPECT_EQ(std::unique(all.begin(), all.end()), all.end());
  EXPECT_EQ(all.size(), n_rows);
}

TEST_F(TokensData, TwoRanksSplitWhatOneRankSees) {
  const auto ids = corpus(50);
  write_tokens(file("a.tokens"), ids, kEos);
  auto one = make("tokens", cfg(file("a.tokens")));
  auto r0 = make("tokens", cfg(file("a.tokens")), 0, 2);
  auto r1 = make("tokens", cfg(file("a.tokens")), 1, 2);
  for (int i = 0; i < 10; ++i) {  // spans an epoch boundary
    HostBatch a = next_batch(*r0), b = next_batch(*r1);
    EXPECT_TRUE(same(a, next_batch(*one)));
    EXPECT_TRUE(same(b, next_batch(*one)));
  }
  // Within one epoch the two ranks' rows are disjoint.
  const int n_rows = static_cast<int>((ids.size() - 1) / 8);
  auto q0 = make("tokens", cfg(file("a.tokens"), {{"per_device_batch_size", "1"}}), 0, 2);
  auto q1 = make("tokens", cfg(file("a.tokens"), {{"per_device_batch_size", "1"}}), 1, 2);
  auto a = rows(*q0, n_rows / 2), b = rows(*q1, n_rows / 2);
  std::set<std::vector<int32_t>> sa(a.begin(), a.end());
  for (const auto& r : b) EXPECT_EQ(sa.count(r), 0u);
}

TEST_F(TokensData, RestoreContinuesExactly) {
  write_tokens(file("a.tokens"), corpus(50), kEos);
  for (int k : {0, 3, 17}) {  // 17 batches cross an epoch boundary
    auto a = make("tokens", cfg(file("a.tokens")));
    for (int i = 0; i < k; ++i) next_batch(*a);
    const std::string st = a->state();
    EXPECT_NE(st.find(','), std::string::npos);
    std::vector<HostBatch> want;
    for (int i = 0; i < 6; ++i) want.push_back(next_batch(*a));
    auto b = make("tokens", cfg(file("a.tokens")));
    next_batch(*b);  // a running source restores too (its prefetched batches are dropped)
    b->restore(st);
    EXPECT_EQ(b->state(), st);
    for (int i = 0; i < 6; ++i) EXPECT_TRUE(same(next_batch(*b), want[i])) << k << " " << i;
  }
  auto c = make("tokens", cfg(file("a.tokens")));
  EXPECT_THROW(c->restore("nonsense"), Error);
  EXPECT_THROW(c->restore("0,999999"), Error);
}

TEST_F(TokensData, ListsGlobsDirectoriesAndWideIds) {
  const auto ids = corpus(30);
  const std::vector<uint32_t> first(ids.begin(), ids.begin() + 100),
      second(ids.begin() + 100, ids.end());
  write_tokens(file("a.tokens"), first, kEos);
  write_tokens(file("b.tokens"), second, kEos, 0xFFFFFFFFu, 4);  // uint32 ids
  auto list = make("tokens", cfg(file("a.tokens") + "," + file("b.tokens")));
  auto glob = make("tokens", cfg((dir_ / "*.tokens").string()));
  auto dir = make("tokens", cfg(dir_.string()));
  for (int i = 0; i < 8; ++i) {
    HostBatch a = next_batch(*list);
    EXPECT_TRUE(same(a, next_batch(*glob)));
    EXPECT_TRUE(same(a, next_batch(*dir)));
  }
  EXPECT_THROW(make("tokens", cfg((dir_ / "*.nothing").string())), UsageError);
  EXPECT_THROW(make("tokens", cfg("")), UsageError);
  // A path that exists is itself: "[a].tokens" is not the pattern matching a.tokens, and
  // "c,d.tokens" not a list (before: a.tokens was read in its place, silently).
  fs::copy_file(file("b.tokens"), file("[a].tokens"));
  fs::copy_file(file("b.tokens"), file("c,d.tokens"));
  auto second_only = make("tokens", cfg(file("b.tokens")));
  auto bracket = make("tokens", cfg(file("[a].tokens")));
  auto comma = make("tokens", cfg(file("c,d.tokens")));
  for (int i = 0; i < 4; ++i) {
    HostBatch b = next_batch(*second_only);
    EXPECT_TRUE(same(b, next_batch(*bracket)));
    EXPECT_TRUE(same(b, next_batch(*comma)));
  }
}

// The message of the Error that `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST_F(TokensData, BadFilesNameTheFile) {
  const auto ids = corpus(20);
  write_tokens(file("magic.tokens"), ids, kEos, 0, 2, "NOTTOKEN");
  write_tokens(file("short.tokens"), ids, kEos, 0, 2, "MTTOKENS",
               static_cast<int64_t>(ids.size()) + 5);
  write_tokens(file("dtype.tokens"), ids, kEos, 0, 3);
  {
    std::ofstream f(file("tiny.tokens"), std::ios::binary);
    f << "MTTOK";
  }
  auto big = ids;
  big[150] = 4999;  // fine
  big[151] = 7777;  // >= vocab_size 5000
  write_tokens(file("vocab.tokens"), big, kEos);

  for (const char* name :
       {"magic.tokens", "short.tokens", "dtype.tokens", "tiny.tokens", "missing.tokens"}) {
    const std::string msg = error_of([&] { make("tokens", cfg(file(name))); });
    EXPECT_NE(msg.find(file(name)), std::string::npos) << name << ": " << msg;
  }
  EXPECT_NE(error_of([&] { make("tokens", cfg(file("magic.tokens"))); }).find("magic"),
            std::string::npos);
  EXPECT_NE(error_of([&] { make("tokens", cfg(file("short.tokens"))); }).find("truncated"),
            std::string::npos);

  // Ids are checked when read: the error reaches the consumer at the batch holding it, and
  // names the file, the id and where it is.
  auto s = make("tokens", cfg(file("vocab.tokens"), {{"per_device_batch_size", "1"}}));
  std::string msg;
  for (int i = 0; i < 100 && msg.empty(); ++i) msg = error_of([&] { next_batch(*s); });
  EXPECT_NE(msg.find(file("vocab.tokens")), std::string::npos) << msg;
  EXPECT_NE(msg.find("7777"), std::string::npos) << msg;
  EXPECT_NE(msg.find("index 151"), std::string::npos) << msg;
  // And it stays an error (no hang) when asked again.
  EXPECT_FALSE(error_of([&] { next_batch(*s); }).empty());

  // An eos outside the vocabulary is refused up front; so is a corpus too short for a row.
  write_tokens(file("eos.tokens"), ids, 9000);
  EXPECT_NE(error_of([&] { make("tokens", cfg(file("eos.tokens"))); }).find("eos_id"),
            std::string::npos);
  write_tokens(file("few.tokens"), {5, 6, kEos}, kEos);
  EXPECT_NE(error_of([&] { make("tokens", cfg(file("few.tokens"))); }).find("no training rows"),
            std::string::npos);
}

TEST_F(TokensData, StopsCleanlyWhileThePrefetcherIsAhead) {
  write_tokens(file("a.tokens"), corpus(50), kEos);
  for (int i = 0; i < 20; ++i) {
    auto s = make("tokens", cfg(file("a.tokens"), {{"data_prefetch", "2"}}));
    if (i % 2) next_batch(*s);
  }  // every destructor returned: no hang
}

}  // namespace
}  // namespace mt

namespace mt {
namespace {

// The corpus that ships in data/ (tools/prepare_corpus.py): well-formed, every id inside the
// shipped tokenizer's vocabulary, documents delimited by </s>.
TEST(ShippedCorpus, IsAValidTokensDataset) {
  const std::string dir = test::source_dir() + "/data/";
  if (!fs::exists(dir + "corpus.train.tokens")) GTEST_SKIP() << "no data/corpus.train.tokens";
  for (const char* name : {"corpus.train.tokens", "corpus.eval.tokens"}) {
    std::ifstream f(dir + name, std::ios::binary);
    char header[32];
    ASSERT_TRUE(f.read(header, sizeof header)) << name;
    uint32_t version, dtype, eos, bos;
    std::memcpy(&version, header + 8, 4);
    std::memcpy(&dtype, header + 12, 4);
    std::memcpy(&eos, header + 24, 4);
    std::memcpy(&bos, header + 28, 4);
    EXPECT_EQ(std::string(header, 8), "MTTOKENS");
    EXPECT_EQ(version, 1u);
    EXPECT_EQ(dtype, 2u);
    EXPECT_EQ(bos, 0u);  // <s>
    EXPECT_EQ(eos, 1u);  // </s>
  }
  auto s = make("tokens", {{"dataset_path", dir + "corpus.train.tokens"},
                           {"eval_dataset_path", dir + "corpus.eval.tokens"},
                           {"vocab_size", "8192"},
                           {"max_target_length", "256"},
                           {"per_device_batch_size", "64"},
                           {"packing", "true"},
                           {"data_shuffle_seed", "0"}});
  // A full epoch of train rows (873155 ids / 256 = 3410 rows) and the whole eval split: every
  // id is checked against vocab_size on the way.
  int64_t segments = 0;
  for (int i = 0; i < 54; ++i) {
    HostBatch b = next_batch(*s);
    for (size_t j = 1; j < b.segment_ids.size(); ++j)
      segments += b.segment_ids[j] != b.segment_ids[j - 1] && b.positions[j] == 0;
  }
  EXPECT_GT(segments, 200);  // ~256 chapter boundaries in an epoch
  HostBatch b;
  int eval_batches = 0;
  while (s->next(b, true)) ++eval_batches;
  EXPECT_EQ(eval_batches, 3);  // 45620 ids / 256 = 178 rows in batches of 64
}

}  // namespace
}  // namespace mt
