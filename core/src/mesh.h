// The device mesh from MaxText's keys: ici_{data,fsdp,tensor,expert}_parallelism within a node
// and their dcn_ twins across nodes; -1 on one axis = whatever the others leave of the ranks.
// Their product must be the number of ranks. From the innermost: tensor, expert, fsdp, data;
// rank r is tensor rank r % tensor of batch group r / tensor, and expert rank
// (r / tensor) % expert.
#pragma once

#include <cstdint>

namespace mt {

class Config;

struct Mesh {
  int64_t data = 1, fsdp = 1, tensor = 1, expert = 1;  // ici x dcn of each axis
  // The ranks the global batch is split among: the data, fsdp and expert axes (as MaxText
  // shards the batch over them; the expert axis divides the experts of the MoE layers and
  // is data parallelism for the rest).
  int64_t batch_ranks() const { return data * fsdp * expert; }
  // The ranks among which the experts are divided: the expert axis's, and with it the tensor
  // axis's (each tensor rank of a batch holds its own experts); 1 without an expert axis.
  int64_t expert_group_ranks() const { return expert > 1 ? expert * tensor : 1; }
};

// The most devices a mesh may name (the ranks are an int).
inline constexpr int64_t kMaxMeshDevices = 2147483647;

// Throws UsageError (one sentence naming the keys) when the axes do not multiply to `ranks`,
// more than one axis is -1, tensor parallelism or the expert axis meets
// shard_optimizer_over_data (not implemented together yet), or the expert axis divides a model
// without num_experts divisible by it (with the tensor axis: by the product of the two). A pure
// function of the config and the rank count, so every rank of a job decides the same.
Mesh resolve_mesh(const Config& cfg, int ranks);

// The devices the mesh's sizes name (the product of the axes set above 1; -1, the rest of the
// ranks, counts 1): what mt plan plans for without a job to count the ranks. At most
// kMaxMeshDevices (more is refused).
int64_t mesh_devices_set(const Config& cfg);

}  // namespace mt
