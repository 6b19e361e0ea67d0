// The "counting" data source: the smallest complete data plugin, as a template. Row r of the
// training stream is the ids s + r, s + r + 1, ... modulo vocab_size, s being the plugin's own
// config key counting_start (declared with add_dataset_keys); its state is the number of training
// rows produced (rows, not batches: a run resumed with another batch size goes on at the next
// row). The eval stream is another one (rows from 1000003), started again by each
// evaluation (mt/data.h's contract).
#include <memory>
#include <string>

#include "mt/config.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/plugin.h"

namespace {

class CountingSource final : public mt::DatasetSource {
 public:
  CountingSource(const mt::Config& c, const mt::DataShard& shard)
      : batch_(c.get_int("per_device_batch_size")),
        seq_(c.get_int("max_target_length")),
        vocab_(c.get_int("vocab_size")),
        start_(c.get_int("counting_start")),
        shard_(shard) {}
  std::string name() const override { return "counting"; }
  bool next(mt::HostBatch& out, bool eval) override {
    // An evaluation (consecutive eval calls) starts its stream again; training's goes on.
    if (eval && !in_eval_) eval_produced_ = 0;
    in_eval_ = eval;
    int64_t& produced = eval ? eval_produced_ : produced_;
    out.batch = batch_;
    out.seq = seq_;
    out.inputs.clear();
    out.targets.clear();
    for (int64_t b = 0; b < batch_; ++b) {
      // Rows are dealt to data-parallel ranks in turn.
      const int64_t row = start_ + (produced++) * shard_.count + shard_.rank + (eval ? 1000003 : 0);
      for (int64_t t = 0; t < seq_; ++t) {
        out.inputs.push_back(static_cast<int32_t>((row + t) % vocab_));
        out.targets.push_back(static_cast<int32_t>((row + t + 1) % vocab_));
      }
    }
    return true;
  }
  std::string state() const override { return std::to_string(produced_); }
  void restore(const std::string& s) override {
    size_t used = 0;
    try {
      produced_ = std::stoll(s, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != s.size() || produced_ < 0)
      throw mt::UsageError("counting: the checkpoint's data state '" + s +
                           "' is not a count of rows; it was not written by this source.");
  }

 private:
  int64_t batch_, seq_, vocab_, start_;
  mt::DataShard shard_;
  int64_t produced_ = 0, eval_produced_ = 0;
  bool in_eval_ = false;
};

void register_counting(mt::Registry& r) {
  r.add_dataset("counting", [](const mt::Config& c, const mt::DataShard& s, const mt::Tokenizer*) {
    return std::make_unique<CountingSource>(c, s);
  });
  // Its own key: exists (typed, range-checked, shown by mt config) when dataset_type=counting.
  r.add_dataset_keys("counting",
                     "counting_start: 0  # the id that training row 0 starts at [>=0]\n");
}

}  // namespace

MT_PLUGIN(mt::PluginKind::data, "counting", "1.0.0", register_counting, nullptr)
