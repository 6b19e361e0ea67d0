#include "mesh.h"

#include <string>
#include <vector>

#include "model_info.h"
#include "mt/config.h"
#include "mt/error.h"

namespace mt {

namespace {

struct Axis {
  const char* key;
  int64_t value;
};

// "key=value ..." of the axes not 1, for messages.
std::string shown_axes(const std::vector<Axis>& axes) {
  std::string shown;
  for (const Axis& a : axes)
    if (a.value != 1)
      shown.append(shown.empty() ? "" : " ")
          .append(a.key)
          .append("=")
          .append(std::to_string(a.value));
  return shown;
}

// MaxText's eight axes as configured (ici_data_parallelism defaults to -1, the others to 1).
std::vector<Axis> mesh_axes(const Config& cfg) {
  std::vector<Axis> axes;
  for (const char* k : {"ici_data_parallelism", "ici_fsdp_parallelism", "ici_tensor_parallelism",
                        "ici_expert_parallelism", "dcn_data_parallelism", "dcn_fsdp_parallelism",
                        "dcn_tensor_parallelism", "dcn_expert_parallelism"})
    axes.push_back({k, cfg.has(k) ? cfg.get_int(k) : (k[4] == 'd' && k[0] == 'i' ? -1 : 1)});
  // Sizes whose product passes what a run can have are refused here, before any product is
  // taken: 2^32 x 2^32 wrapped to 0 devices (a division by zero), and 7 x 7905747460161236407 to
  // exactly 1, which trained one rank with a 7x batch.
  int64_t devices = 1;
  for (const Axis& a : axes) {
    if (a.value <= 1) continue;
    if (__builtin_mul_overflow(devices, a.value, &devices) || devices > kMaxMeshDevices)
      throw UsageError("The mesh (" + shown_axes(axes) + ") has more than " +
                       std::to_string(kMaxMeshDevices) +
                       " devices, more than any run can have: the product of the "
                       "ici_*_parallelism and dcn_*_parallelism axes is the number of ranks.");
  }
  return axes;
}

}  // namespace

int64_t mesh_devices_set(const Config& cfg) {
  int64_t n = 1;
  for (const Axis& a : mesh_axes(cfg))
    if (a.value > 1) n *= a.value;
  return n;
}

Mesh resolve_mesh(const Config& cfg, int ranks) {
  std::vector<Axis> axes = mesh_axes(cfg);
  const char* fill = nullptr;
  int64_t known = 1;
  const std::string shown = shown_axes(axes);
  for (auto& a : axes) {
    if (a.value == -1) {
      if (fill)
        throw UsageError(std::string("The mesh has more than one axis set to -1 (") + fill +
                         " and " + a.key + "); set all but one of them to a size.");
      fill = a.key;
    } else if (a.value < 1) {
      cfg.reject(a.key, "must be a positive size or -1 (what is left of the ranks).");
    } else {
      known *= a.value;
    }
  }
  const std::string where =
      ranks == 1 ? "1 rank runs (start more with mpirun -np N)"
                 : std::to_string(ranks) + " ranks run (mpirun -np " + std::to_string(ranks) + ")";
  if (fill) {
    if (ranks % known != 0)
      throw UsageError("The mesh (" + shown + ") does not divide the ranks: its fixed axes make " +
                       std::to_string(known) + " devices, which " + where +
                       " is not a multiple of, so " + fill + "=-1 has no size.");
    for (auto& a : axes)
      if (a.value == -1) a.value = ranks / known;
  } else if (known != ranks) {
    throw UsageError("The mesh (" + (shown.empty() ? std::string("every axis 1") : shown) +
                     ") has " + std::to_string(known) + " device" + (known == 1 ? "" : "s") +
                     " but " + where +
                     "; the product of the ici_*_parallelism and "
                     "dcn_*_parallelism axes must equal the number of ranks.");
  }
  Mesh m;
  m.data = axes[0].value * axes[4].value;
  m.fsdp = axes[1].value * axes[5].value;
  m.tensor = axes[2].value * axes[6].value;
  m.expert = axes[3].value * axes[7].value;
  if (m.expert > 1) {
    const std::string ep =
        "Expert parallelism (ici_expert_parallelism x dcn_expert_parallelism = " +
        std::to_string(m.expert) + ")";
    if (cfg.get_bool("shard_optimizer_over_data"))
      throw UsageError(ep +
                       " with shard_optimizer_over_data is not implemented yet: combine it with "
                       "the data and fsdp axes (FSDP divides the moments too).");
    // With the tensor axis, the experts are divided among the expert x tensor ranks.
    const int64_t experts = cfg.get_int("num_experts");
    const int64_t parts = m.expert_group_ranks();
    if (experts > 1 && experts % parts != 0 && experts % m.expert == 0)
      throw UsageError(ep + " with the tensor axis (" + std::to_string(m.tensor) +
                       " ranks) divides the experts of the mixture-of-experts layers among " +
                       std::to_string(parts) + " ranks, but " + model_label(cfg) + " has " +
                       std::to_string(experts) + " experts (num_experts), which " +
                       std::to_string(parts) +
                       " does not divide. Choose expert and tensor axes whose product divides "
                       "num_experts.");
    if (experts <= 1 || experts % m.expert != 0)
      throw UsageError(ep +
                       " divides the experts of the mixture-of-experts layers among its "
                       "ranks, but " +
                       model_label(cfg) + " has " +
                       (experts <= 1
                            ? std::string("none (num_experts ") + std::to_string(experts) + ")"
                            : std::to_string(experts) + " experts (num_experts), which " +
                                  std::to_string(m.expert) + " does not divide") +
                       ". Choose an expert axis dividing num_experts, or use "
                       "ici_data_parallelism for a dense model.");
  }
  if (m.tensor > 1 && cfg.get_bool("shard_optimizer_over_data"))
    throw UsageError(
        "shard_optimizer_over_data with tensor parallelism is not implemented yet: set it to "
        "false, or divide the state with FSDP (ici_fsdp_parallelism) instead of the tensor "
        "axis.");
  return m;
}

}  // namespace mt
