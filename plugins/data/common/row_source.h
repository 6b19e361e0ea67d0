// RowSource: batches of rows cut from a token stream, shared by the file-based data plugins
// (tokens: memory-mapped token files; text: text tokenized at load). Header-only: each plugin is
// its own shared object and compiles its own copy.
//
// A TokenStream is the corpus as one sequence of ids with document starts marked.
//
// Rows. packing=true: the token stream is cut into rows of max_target_length+1 ids with a
// stride of max_target_length (consecutive rows share one id, so every next-token pair of the
// stream is a target exactly once). A new segment starts at each document start, positions
// restart at 0 per segment, and a target that is the first id of another document (the target
// of an eos) is masked with -1, so nothing is learned across documents. packing=false: one
// document per row, truncated to max_target_length+1 ids or padded (targets -1, segment 0).
//
// Order. Train rows are visited in a fresh permutation every epoch, drawn from
// data_shuffle_seed and the epoch number only, so every rank agrees on it. The visited rows
// form one endless stream across epochs, grouped into batches of per_device_batch_size rows;
// rank r of n takes global batches r, r+n, r+2n, ...: ranks see disjoint rows, and their union
// is exactly what a single rank sees (with n x per_device_batch_size rows a batch, in the same
// order). state() is "epoch,position": where in that stream the next global batch starts (rank
// 0's next batch), the same on every rank.
//
// Eval. The last eval_split of the rows (none with eval_interval=-1: no evaluation runs; or all
// rows of eval_dataset_path) in file order,
// sharded the same way; every rank gets the same number of batches (padding rows are fully
// masked), so collective evaluation never waits on a rank that ran out. An evaluation is a run
// of consecutive next(eval=true) calls: the first eval call after a train call (or the first
// call at all) restarts at the first eval batch, so every evaluation sees the same batches
// whether the trainer stops after eval_steps or runs until next() returns false.
//
// Prefetch. Train batches are built on a background thread into a small bounded queue; the
// destructor and restore() stop it without waiting for the consumer.
#pragma once

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "mt/config.h"
#include "mt/data.h"
#include "mt/error.h"
#include "token_stream.h"

namespace mt_data {

// Helpers are `inline` rather than in an anonymous namespace: this header may be included by
// several files of one plugin.

inline int64_t int_or(const mt::Config& c, const char* key, int64_t dflt) {
  return c.has(key) ? c.get_int(key) : dflt;
}
inline double float_or(const mt::Config& c, const char* key, double dflt) {
  return c.has(key) ? c.get_float(key) : dflt;
}
inline bool bool_or(const mt::Config& c, const char* key, bool dflt) {
  return c.has(key) ? c.get_bool(key) : dflt;
}
inline std::string string_or(const mt::Config& c, const char* key, const std::string& dflt) {
  return c.has(key) ? c.get_string(key) : dflt;
}

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// A permutation of [0, n) for one epoch. Fisher-Yates over splitmix64 draws rather than
// std::shuffle: the standard leaves shuffle's algorithm to the library, and the order must be
// the same on every build so that a restored run continues exactly.
inline std::vector<uint64_t> epoch_permutation(uint64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> p(n);
  for (uint64_t i = 0; i < n; ++i) p[i] = i;
  uint64_t s = splitmix64(seed ^ splitmix64(epoch + 0x5EEDull));
  for (uint64_t i = n; i > 1; --i) {
    s = splitmix64(s);
    // Modulo bias is below n / 2^64: irrelevant for a data order.
    std::swap(p[i - 1], p[s % i]);
  }
  return p;
}

inline void resize_batch(mt::HostBatch& b, int64_t rows, int64_t seq) {
  b.batch = rows;
  b.seq = seq;
  const auto n = static_cast<size_t>(rows * seq);
  b.inputs.assign(n, 0);
  b.targets.assign(n, -1);
  b.segment_ids.assign(n, 0);
  b.positions.assign(n, 0);
}

// The rows of one split: a contiguous range of packed rows, or a list of documents.
class RowSet {
 public:
  RowSet(std::shared_ptr<const TokenStream> corpus, bool packing, int64_t seq)
      : corpus_(std::move(corpus)), packing_(packing), seq_(seq) {
    if (packing_) {
      const uint64_t n = corpus_->size();
      total_ = n > 1 ? (n - 1) / static_cast<uint64_t>(seq_) : 0;
    } else {
      for (const auto& d : corpus_->documents())
        if (d.second - d.first >= 2) docs_.push_back(d);  // a 1-id document has no target
      total_ = docs_.size();
    }
    end_ = total_;
  }
  uint64_t total() const { return total_; }  // rows of the whole corpus
  // Restricts the set to rows [first, end).
  void select(uint64_t first, uint64_t end) {
    first_ = first;
    end_ = end;
  }
  uint64_t size() const { return end_ - first_; }
  const TokenStream& corpus() const { return *corpus_; }

  // Writes row i of this set (0 <= i < size()) into row `r` of `out`.
  void fill(uint64_t i, mt::HostBatch& out, int64_t r, std::vector<int32_t>& ids,
            std::vector<uint8_t>& starts) const {
    const uint64_t row = first_ + i;
    const auto T = static_cast<uint64_t>(seq_);
    uint64_t begin, n;
    if (packing_) {
      begin = row * T;
      n = T + 1;
    } else {
      begin = docs_[row].first;
      n = std::min(docs_[row].second - begin, T + 1);
    }
    ids.resize(n);
    starts.resize(n);
    corpus_->read(begin, n, ids.data(), starts.data());
    const size_t o = static_cast<size_t>(r) * T;
    int32_t seg = 1, pos = 0;
    for (uint64_t j = 0; j + 1 < n; ++j) {
      if (packing_ && j > 0 && starts[j]) {
        ++seg;
        pos = 0;
      }
      out.inputs[o + j] = ids[j];
      // The first id of a document is never the target of the previous document's last id.
      out.targets[o + j] = starts[j + 1] ? -1 : ids[j + 1];
      out.segment_ids[o + j] = seg;
      out.positions[o + j] = pos++;
    }
  }

 private:
  std::shared_ptr<const TokenStream> corpus_;
  bool packing_;
  int64_t seq_;
  std::vector<std::pair<uint64_t, uint64_t>> docs_;
  uint64_t total_ = 0, first_ = 0, end_ = 0;
};

// Builds train batches on a thread, in order from a starting cursor, into a bounded queue.
class Prefetcher {
 public:
  using Produce = std::function<void(uint64_t cursor, mt::HostBatch&)>;
  Prefetcher(Produce produce, uint64_t cursor, uint64_t stride, size_t depth)
      : produce_(std::move(produce)), cursor_(cursor), stride_(stride), depth_(depth) {
    thread_ = std::thread([this] { run(); });
  }
  ~Prefetcher() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  void next(mt::HostBatch& out) {
    std::unique_lock<std::mutex> lk(m_);
    cv_.wait(lk, [&] { return !queue_.empty() || error_; });
    if (queue_.empty()) std::rethrow_exception(error_);
    out = std::move(queue_.front());
    queue_.pop_front();
    cv_.notify_all();
  }

 private:
  void run() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || queue_.size() < depth_; });
        if (stop_) return;
      }
      mt::HostBatch b;
      try {
        produce_(cursor_, b);
        std::lock_guard<std::mutex> lk(m_);
        queue_.push_back(std::move(b));  // (may throw bad_alloc: handed on like the rest)
        cursor_ += stride_;
        cv_.notify_all();
      } catch (...) {
        // Handed to the consumer at the batch that failed; batches before it still arrive.
        // (An exception leaving this thread would be std::terminate.)
        std::lock_guard<std::mutex> lk(m_);
        error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
    }
  }

  Produce produce_;
  uint64_t cursor_, stride_;
  size_t depth_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<mt::HostBatch> queue_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;  // last: started once everything it uses exists
};

class RowSource final : public mt::DatasetSource {
 public:
  // name: the dataset_type (used in messages). train: the training stream; eval: the eval
  // stream (eval_dataset_path), or null to hold out eval_split of the training rows.
  RowSource(const mt::Config& cfg, const mt::DataShard& shard, std::string name,
            std::shared_ptr<const TokenStream> train, std::shared_ptr<const TokenStream> eval)
      : name_(std::move(name)), shard_(shard) {
    const Settings st = read_settings(cfg, shard, name_);
    batch_ = st.batch;
    seq_ = st.seq;
    seed_ = st.seed;
    depth_ = st.depth;
    train_ = std::make_unique<RowSet>(train, st.packing, seq_);
    if (eval) {
      eval_ = std::make_unique<RowSet>(eval, st.packing, seq_);
    } else {
      double split = float_or(cfg, "eval_split", 0.0);
      if (split < 0 || split >= 1) cfg.reject("eval_split", "must be in [0, 1)");
      // No evaluation (eval_interval=-1): no row is held out (before: eval_split of the rows
      // was withheld from training all the same).
      if (int_or(cfg, "eval_interval", 100) <= 0) split = 0;
      const uint64_t n = train_->total();
      uint64_t n_eval = static_cast<uint64_t>(static_cast<double>(n) * split);
      // A non-zero split always leaves one eval row when there are two rows to split.
      if (split > 0 && n_eval == 0 && n >= 2) n_eval = 1;
      eval_ = std::make_unique<RowSet>(train, st.packing, seq_);
      eval_->select(n - n_eval, n);
      train_->select(0, n - n_eval);
    }
    if (train_->size() == 0)
      throw mt::UsageError(name_ + ": " + train_->corpus().describe() + ": no training rows (" +
                           std::to_string(train_->corpus().size()) + " tokens; packing needs at " +
                           "least max_target_length+1 = " + std::to_string(seq_ + 1) +
                           ", unpacked rows need documents of 2 or more tokens)");
    // An eval set the user named that gives no row would leave every evaluation out silently.
    if (eval && eval_->size() == 0)
      throw mt::UsageError(
          name_ + ": eval_dataset_path: " + eval_->corpus().describe() + ": no eval rows (" +
          std::to_string(eval_->corpus().size()) +
          " tokens; packing needs at least max_target_length+1 = " + std::to_string(seq_ + 1) +
          ", unpacked rows need documents of 2 or more tokens). Give a larger "
          "eval set, or unset eval_dataset_path to hold out eval_split of the "
          "training rows.");
    // So would evaluations asked for with no row held out for them.
    // (eval_split above 0 with a single row: nothing to hold out without leaving no training.)
    if (!eval && eval_->size() == 0 && int_or(cfg, "eval_interval", -1) > 0) {
      const double split = float_or(cfg, "eval_split", 0.0);
      char share[32];
      std::snprintf(share, sizeof share, "%g", split);
      cfg.reject(
          "eval_interval",
          "asks for an evaluation every " + std::to_string(int_or(cfg, "eval_interval", -1)) +
              " steps, but " + name_ + " holds out no eval rows (" +
              (split > 0 ? "the data makes " + std::to_string(train_->total()) +
                               " row(s), too few to hold out eval_split=" + std::string(share) +
                               " of them and still train"
                         : std::string("eval_split=0")) +
              "). " +
              (split > 0 ? "Give more data, name"
                         : "Set eval_split above 0 (0.05 holds out 5% of the rows), name") +
              " an eval set with eval_dataset_path, or set eval_interval=-1 for no "
              "evaluation.");
    }
    cursor_ = offset();
  }

  // The settings every row source reads, validated (throws mt::UsageError naming the key).
  struct Settings {
    int64_t batch = 0, seq = 0, vocab = 0;
    uint64_t seed = 0;
    size_t depth = 4;
    bool packing = true;
  };
  static Settings read_settings(const mt::Config& cfg, const mt::DataShard& shard,
                                const std::string& name) {
    if (shard.count < 1 || shard.rank < 0 || shard.rank >= shard.count)
      throw mt::UsageError(name + ": bad data shard rank " + std::to_string(shard.rank) + " of " +
                           std::to_string(shard.count));
    Settings st;
    st.batch = int_or(cfg, "per_device_batch_size", 1);
    st.seq = int_or(cfg, "max_target_length", 0);
    const std::string why = "must be > 0 for dataset_type=" + name;
    if (st.batch < 1) cfg.reject("per_device_batch_size", why);
    if (st.seq < 1) cfg.reject("max_target_length", why);
    st.vocab = int_or(cfg, "vocab_size", 0);
    if (st.vocab < 1) cfg.reject("vocab_size", why);
    st.seed = static_cast<uint64_t>(int_or(cfg, "data_shuffle_seed", 0));
    st.depth = static_cast<size_t>(std::max<int64_t>(1, int_or(cfg, "data_prefetch", 4)));
    st.packing = bool_or(cfg, "packing", true);
    return st;
  }

  ~RowSource() override = default;

  std::string name() const override { return name_; }

  bool next(mt::HostBatch& out, bool eval) override {
    if (eval) {
      if (!in_eval_) eval_batch_ = 0;
      in_eval_ = true;
      return next_eval(out);
    }
    in_eval_ = false;
    if (!prefetch_) {
      prefetch_ = std::make_unique<Prefetcher>(
          [this, order = std::make_shared<Order>()](uint64_t c, mt::HostBatch& b) {
            make_train_batch(c, b, *order);
          },
          cursor_, stride(), depth_);
    }
    prefetch_->next(out);
    cursor_ += stride();
    return true;
  }

  // The position of the global batch's first row (rank 0's), the same on every rank: a
  // checkpoint rank 0 writes restores every rank.
  std::string state() const override {
    const uint64_t n = train_->size(), global = cursor_ - offset();
    return std::to_string(global / n) + "," + std::to_string(global % n);
  }

  void restore(const std::string& s) override {
    uint64_t epoch = 0, pos = 0;
    const size_t comma = s.find(',');
    auto parse = [](const std::string& t, uint64_t& v) {
      auto r = std::from_chars(t.data(), t.data() + t.size(), v);
      return r.ec == std::errc() && r.ptr == t.data() + t.size() && !t.empty();
    };
    if (comma == std::string::npos || !parse(s.substr(0, comma), epoch) ||
        !parse(s.substr(comma + 1), pos) || pos >= train_->size())
      throw mt::Error(name_ + ": cannot restore the data position from \"" + s +
                      "\": expected \"epoch,position\" with position < " +
                      std::to_string(train_->size()) + " (the training rows of " +
                      train_->corpus().describe() + ")");
    prefetch_.reset();  // stops the producer; the batches it built are for the old position
    cursor_ = epoch * train_->size() + pos + offset();
  }

 private:
  // The permutation cache of the producer thread: the current epoch's and, when a batch spans
  // an epoch boundary, the next one's.
  struct Order {
    uint64_t epoch = UINT64_MAX;
    std::vector<uint64_t> perm;
  };

  // This rank's first row within each global batch.
  uint64_t offset() const {
    return static_cast<uint64_t>(shard_.rank) * static_cast<uint64_t>(batch_);
  }

  uint64_t stride() const {
    return static_cast<uint64_t>(shard_.count) * static_cast<uint64_t>(batch_);
  }

  void make_train_batch(uint64_t cursor, mt::HostBatch& b, Order& order) const {
    resize_batch(b, batch_, seq_);
    const uint64_t n = train_->size();
    std::vector<int32_t> ids;
    std::vector<uint8_t> starts;
    for (int64_t r = 0; r < batch_; ++r) {
      const uint64_t p = cursor + static_cast<uint64_t>(r);
      const uint64_t epoch = p / n;
      if (order.epoch != epoch) {
        order.perm = epoch_permutation(n, seed_, epoch);
        order.epoch = epoch;
      }
      train_->fill(order.perm[p % n], b, r, ids, starts);
    }
  }

  bool next_eval(mt::HostBatch& out) {
    // Batches of the whole eval set, every rank the same count.
    const uint64_t B = static_cast<uint64_t>(batch_), n = eval_->size();
    const uint64_t global = (n + B - 1) / B;
    const uint64_t count = static_cast<uint64_t>(shard_.count);
    const uint64_t per_rank = (global + count - 1) / count;
    if (eval_batch_ >= per_rank) {
      eval_batch_ = 0;  // the next evaluation starts over
      return false;
    }
    const uint64_t g = eval_batch_ * count + static_cast<uint64_t>(shard_.rank);
    ++eval_batch_;
    resize_batch(out, batch_, seq_);
    for (uint64_t r = 0; r < B; ++r) {
      const uint64_t row = g * B + r;
      if (row < n) eval_->fill(row, out, static_cast<int64_t>(r), eval_ids_, eval_starts_);
    }
    return true;
  }

  std::string name_;
  mt::DataShard shard_;
  int64_t batch_ = 0, seq_ = 0;
  uint64_t seed_ = 0;
  size_t depth_ = 4;
  std::unique_ptr<RowSet> train_, eval_;
  uint64_t cursor_ = 0;  // stream position of this rank's next train batch
  uint64_t eval_batch_ = 0;
  bool in_eval_ = false;
  std::vector<int32_t> eval_ids_;
  std::vector<uint8_t> eval_starts_;
  std::unique_ptr<Prefetcher> prefetch_;  // last: stopped before the rows it reads go away
};

}  // namespace mt_data
