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

class MT_API DatasetSource {
 public:
  virtual ~DatasetSource();
  virtual std::string name() const = 0;
  // Fills the next batch of the training (eval=false) or eval stream; returns false when an
  // eval stream is exhausted (training streams cycle through epochs).
  virtual bool next(HostBatch& out, bool eval) = 0;
  // Serialisable iterator position: a source restored from it yields exactly the batch it
  // would have yielded next.
  virtual std::string state() const = 0;
  virtual void restore(const std::string& state) = 0;
};

}  // namespace mt
