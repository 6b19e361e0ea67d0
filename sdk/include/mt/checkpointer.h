// Checkpointer: saves and restores the train state (safetensors on disk).
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include "mt/export.h"
#include "mt/tensor.h"

namespace mt {

struct TrainState {
  int64_t step = 0;
  std::map<std::string, Tensor> params;      // by parameter name
  std::map<std::string, Tensor> opt_m, opt_v;  // empty for parameter-only checkpoints
  std::string data_state;                    // DatasetSource::state()
  std::string rng_state;
  std::string config_yaml;
};

class MT_API Checkpointer {
 public:
  virtual ~Checkpointer();
  // Starts saving `state` as step `state.step`; may return before the write is done (async).
  virtual void save(const TrainState& state) = 0;
  // Blocks until every save started so far is complete and durable.
  virtual void wait() = 0;
  // Latest complete step under the run's checkpoint directory, or -1.
  virtual int64_t latest_step() const = 0;
  // Fills the tensors already present in `state` (names and shapes must match).
  virtual void restore(int64_t step, TrainState& state) = 0;
};

}  // namespace mt
