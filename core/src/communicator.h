// Choosing a run's communicator (mt/comm.h): `communicator=auto` is `mpi` when the process was
// started by OpenMPI's mpirun (OMPI_COMM_WORLD_SIZE is set), else `local` (one rank, no MPI
// needed at run time).
#pragma once

#include <memory>

#include "mt/comm.h"

namespace mt {

class Config;
class PluginManager;

std::unique_ptr<Communicator> make_local_communicator();
std::unique_ptr<Communicator> make_communicator(const Config& cfg, PluginManager& plugins);

// What the launcher says before any communicator exists: the world size (0 when not started
// by mpirun) and this process's rank (0 then).
int launcher_world_size();
int launcher_rank();

}  // namespace mt
