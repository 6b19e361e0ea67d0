// The device mesh from MaxText's keys: ici_{data,fsdp,tensor}_parallelism within a node and
// their dcn_ twins across nodes; -1 on one axis = whatever the others leave of the ranks. Their
// product must be the number of ranks. Tensor parallelism's ranks are the innermost: rank r is
// tensor rank r % tensor of batch group r / tensor.
#pragma once

#include <cstdint>

namespace mt {

class Config;

struct Mesh {
  int64_t data = 1, fsdp = 1, tensor = 1;  // ici x dcn of each axis
  // The ranks the global batch is split among: the data and fsdp axes (as MaxText shards the
  // batch over both).
  int64_t batch_ranks() const { return data * fsdp; }
};

// Throws UsageError (one sentence naming the keys) when the axes do not multiply to `ranks`,
// more than one axis is -1, or tensor parallelism meets shard_optimizer_over_data (not
// implemented together yet). A pure function of the config and the rank count, so every rank
// of a job decides the same.
Mesh resolve_mesh(const Config& cfg, int ranks);

// The devices the mesh's sizes name (the product of the axes set above 1; -1, the rest of the
// ranks, counts 1): what mt plan plans for without a job to count the ranks.
int64_t mesh_devices_set(const Config& cfg);

}  // namespace mt
