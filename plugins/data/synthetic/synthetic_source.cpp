// dataset_type=synthetic: uniformly random token ids in [0, vocab_size), for benchmarking and
// tests that need data without files (MaxText's name for the same thing).
//
// Every row holds max_target_length+1 draws: inputs are the first max_target_length, targets
// the same row shifted by one, positions 0..T-1, one segment. Row k of the global stream is
// drawn from a generator seeded by (data_shuffle_seed, k) alone, so rows are independent of
// each other and of the batch size: restoring is setting a counter, and rank r of n (taking
// global batches r, r+n, ...) sees exactly its share of what one rank with n times the batch
// would see, in the same order; the state is the rows taken, so a resumed run with another
// batch or number of ranks goes on at the next row. The eval stream is another stream of
// the same kind; it never runs out (the trainer bounds it with eval_steps) and each evaluation
// (a run of consecutive eval calls) starts again at its first batch, so evaluations compare.
#include <charconv>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <system_error>

#include "mt/config.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/plugin.h"

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

class SyntheticSource final : public mt::DatasetSource {
 public:
  SyntheticSource(const mt::Config& cfg, const mt::DataShard& shard)
      : rank_(static_cast<uint64_t>(shard.rank)), count_(static_cast<uint64_t>(shard.count)) {
    if (shard.count < 1 || shard.rank < 0 || shard.rank >= shard.count)
      throw mt::UsageError("synthetic: bad data shard rank " + std::to_string(shard.rank) + " of " +
                           std::to_string(shard.count));
    batch_ = cfg.get_int("per_device_batch_size");
    seq_ = cfg.get_int("max_target_length");
    vocab_ = cfg.get_int("vocab_size");
    if (batch_ < 1) cfg.reject("per_device_batch_size", "must be > 0");
    if (seq_ < 1) cfg.reject("max_target_length", "must be > 0");
    if (vocab_ < 1 || vocab_ > INT32_MAX) cfg.reject("vocab_size", "must be in [1, 2^31)");
    seed_ =
        static_cast<uint64_t>(cfg.has("data_shuffle_seed") ? cfg.get_int("data_shuffle_seed") : 0);
  }

  std::string name() const override { return "synthetic"; }

  bool next(mt::HostBatch& out, bool eval) override {
    if (eval) {
      if (!in_eval_) eval_produced_ = 0;
      in_eval_ = true;
      fill(out, splitmix64(seed_ ^ 0xE7A1E7A1E7A1ull), eval_produced_++, 0);
    } else {
      in_eval_ = false;
      fill(out, seed_, produced_++, offset_);
    }
    return true;
  }

  // The rows of the global stream taken so far ("rows:N"), so that a run resumed with another
  // batch size, accumulation or number of ranks goes on at the next row (a count of batches
  // repeated or skipped rows). A plain number is the older form: batches of this shape.
  std::string state() const override {
    return "rows:" + std::to_string(offset_ + produced_ * count_ * static_cast<uint64_t>(batch_));
  }

  void restore(const std::string& s) override {
    const bool rows = s.rfind("rows:", 0) == 0;
    const char* from = s.data() + (rows ? 5 : 0);
    uint64_t v = 0;
    auto r = std::from_chars(from, s.data() + s.size(), v);
    if (from == s.data() + s.size() || r.ec != std::errc() || r.ptr != s.data() + s.size())
      throw mt::Error("synthetic: cannot restore the data position from \"" + s +
                      "\": expected rows:<rows taken>");
    offset_ = rows ? v : 0;
    produced_ = rows ? 0 : v;
  }

 private:
  // This rank's i-th batch of the stream `stream`: global batch i*count + rank, whose row r is
  // row (i*count + rank) * batch + r of the stream (after `first` rows), drawn from that row
  // number alone.
  void fill(mt::HostBatch& b, uint64_t stream, uint64_t i, uint64_t first) const {
    const uint64_t global = i * count_ + rank_;
    // Not std::uniform_int_distribution: its algorithm is the library's choice, and the
    // stream must be the same on every build.
    const auto vocab = static_cast<uint64_t>(vocab_);
    b.batch = batch_;
    b.seq = seq_;
    const auto n = static_cast<size_t>(batch_ * seq_);
    b.inputs.resize(n);
    b.targets.resize(n);
    b.segment_ids.assign(n, 1);
    b.positions.resize(n);
    for (int64_t r = 0; r < batch_; ++r) {
      const uint64_t row =
          first + global * static_cast<uint64_t>(batch_) + static_cast<uint64_t>(r);
      std::mt19937_64 rng(splitmix64(stream ^ splitmix64(row)));
      const size_t o = static_cast<size_t>(r * seq_);
      auto prev = static_cast<int32_t>(rng() % vocab);
      for (int64_t t = 0; t < seq_; ++t) {
        const auto id = static_cast<int32_t>(rng() % vocab);
        b.inputs[o + static_cast<size_t>(t)] = prev;
        b.targets[o + static_cast<size_t>(t)] = id;
        b.positions[o + static_cast<size_t>(t)] = static_cast<int32_t>(t);
        prev = id;
      }
    }
  }

  uint64_t rank_, count_;
  int64_t batch_ = 0, seq_ = 0, vocab_ = 0;
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;  // rows of the stream taken before the restored position
  uint64_t produced_ = 0, eval_produced_ = 0;
  bool in_eval_ = false;
};

void register_all(mt::Registry& r) {
  r.add_dataset("synthetic",
                [](const mt::Config& cfg, const mt::DataShard& shard,
                   const mt::Tokenizer*) -> std::unique_ptr<mt::DatasetSource> {
                  return std::make_unique<SyntheticSource>(cfg, shard);
                });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::data, "synthetic", "0.1.0", register_all, nullptr)
