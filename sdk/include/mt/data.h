// DatasetSource: what a data plugin provides. Yields token batches for one data-parallel shard.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mt/export.h"

namespace mt {

struct DataShard {
  int rank = 0;   // data-parallel rank
  int count = 1;  // data-parallel ranks
};

// One batch on the host: [batch, seq] row-major. targets < 0 are ignored by the loss.
struct HostBatch {
  int64_t batch = 0, seq = 0;
  std::vector<int32_t> inputs, targets, segment_ids, positions;
};

// The contract the trainer checks (a breach stops the run with an error naming the plugin):
// - Every batch is per_device_batch_size x max_target_length, with batch x seq input ids and as
//   many targets (segment_ids and positions: empty, or as many).
// - The training stream never ends: next(eval=false) cycles through epochs and returns true.
// - An evaluation is a run of consecutive next(eval=true) calls: the first eval call after a
//   training call (or the first call of all) starts the eval stream again at its first batch,
//   so every evaluation sees the same rows; eval calls never move the training stream.
// - A step needs at least one target >= 0 in its global batch.
// The factory (Registry::add_dataset) returns a source, or throws mt::UsageError saying why the
// config cannot have one; never null.
class MT_API DatasetSource {
 public:
  virtual ~DatasetSource();
  virtual std::string name() const = 0;
  // Fills the next batch of the training (eval=false) or eval stream; returns false when an
  // eval stream is exhausted (training streams cycle through epochs).
  virtual bool next(HostBatch& out, bool eval) = 0;
  // Serialisable position of the training stream: a source restored from it yields exactly the
  // batch it would have yielded next. restore() of a string that is not one throws
  // mt::UsageError naming the source.
  virtual std::string state() const = 0;
  virtual void restore(const std::string& state) = 0;
};

}  // namespace mt
