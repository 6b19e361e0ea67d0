// The device mesh from MaxText's keys: ici_{data,fsdp,tensor}_parallelism within a node and
// their dcn_ twins across nodes; -1 on one axis = whatever the others leave of the ranks. Their
// product must be the number of ranks. Only data parallelism is implemented so far.
#pragma once

#include <cstdint>

namespace mt {

class Config;

struct Mesh {
  int64_t data = 1, fsdp = 1, tensor = 1;  // ici x dcn of each axis
};

// Throws UsageError (one sentence naming the keys) when the axes do not multiply to `ranks`,
// more than one axis is -1, or an axis other than data is above 1. A pure function of the
// config and the rank count, so every rank of a job decides the same.
Mesh resolve_mesh(const Config& cfg, int ranks);

// The devices the mesh's sizes name (the product of the axes set above 1; -1, the rest of the
// ranks, counts 1): what mt plan plans for without a job to count the ranks.
int64_t mesh_devices_set(const Config& cfg);

}  // namespace mt
