// Choosing a run's communicator (mt/comm.h): `communicator=auto` is `mpi` when the process was
// started by OpenMPI's mpirun (OMPI_COMM_WORLD_SIZE is set), else `local` (one rank, no MPI
// needed at run time).
#pragma once

#include <cstdint>
#include <memory>

#include "mt/comm.h"
#include "mt/tensor.h"

namespace mt {

class Config;
class PluginManager;

std::unique_ptr<Communicator> make_local_communicator();
// communicator=auto|local|mpi|nccl (auto: mpi under a launcher, else local). Before a plugin's
// communicator (MPI, whose threads read the environment) the configured backend's plugin is
// loaded and registered.
std::unique_ptr<Communicator> make_communicator(const Config& cfg, PluginManager& plugins);

// What the launcher says before any communicator exists: the world size (0 when not started
// by mpirun) and this process's rank (0 then).
int launcher_world_size();
int launcher_rank();

// Sharded state (ZeRO-1, FSDP) goes through f32 host buffers for the host collectives.
// Elements [b, e) of `t` flattened: a view sharing its storage.
Tensor flat_part(const Tensor& t, int64_t b, int64_t e);
// Elements [b, e) of `t` (f32 or bf16) to or from f32 host memory: bf16 widened / rounded to
// nearest even, exact for values that came from bf16.
void part_to_host(const Tensor& t, int64_t b, int64_t e, float* out);
void part_from_host(Tensor& t, int64_t b, int64_t e, const float* in);

}  // namespace mt
