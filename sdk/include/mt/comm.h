// Communicator: the collectives between the ranks of one job, a plugin kind of its own
// (`communicator=`): `local` (one rank, in the core), `mpi` (plugins/comm/mpi, OpenMPI on host
// memory), later `nccl` on a device backend's streams. The core and the model plugins never call
// MPI or NCCL themselves; they call this.
//
// Every collective is called by every rank in the same order with the same sizes. Sums are
// deterministic: each element is added in rank order, ((x_0 + x_1) + x_2) + ..., whatever the
// timing, and every rank ends with the same bits.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/export.h"

namespace mt {

class Backend;
class Config;
class Tensor;

class MT_API Communicator {
 public:
  virtual ~Communicator();
  virtual std::string name() const = 0;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Host memory, in place, on every rank.
  virtual void all_reduce_sum(float* data, size_t n) = 0;
  virtual void all_reduce_sum(double* data, size_t n) = 0;
  // `root`'s bytes to every rank (each rank passes a buffer of the same size).
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;

  // Tensors of `backend` (f32 or bf16 storage), summed over the ranks in place, as one bucket.
  // The default copies through the host (one f32 buffer for all of them) and calls the host
  // all_reduce_sum: exact for the CPU backend, whose tensors are host memory, and a round trip
  // for a device backend until a device communicator (NCCL) overrides it.
  virtual void all_reduce_sum(Backend& backend, const std::vector<Tensor*>& tensors);

  // Sharded state (ZeRO, FSDP) on host memory, in place. A buffer of n elements is split among
  // the ranks in rank order, rank r owning [n r / N, n (r + 1) / N) (shard_range below).
  // reduce_scatter_sum leaves in this rank's part of `data` the rank-ordered sum of every rank's
  // values there (the same bits all_reduce_sum gives; the rest of `data` is unspecified);
  // all_gather copies each rank's part of `data` to every other rank. The defaults are for one
  // rank (nothing to do) and throw mt::Error for more.
  virtual void reduce_scatter_sum(float* data, size_t n);
  virtual void all_gather(float* data, size_t n);

  // Rows of `row` floats in host memory, from every rank to every rank (MPI_Alltoallv):
  // send_rows[r] rows to rank r, taken from `send` one rank's rows after another (rank order),
  // and recv_rows[r] rows from rank r into `recv`, in rank order. recv_rows[r] must equal rank
  // r's send_rows[this rank]; both vectors have size() entries. Expert parallelism's dispatch:
  // each token goes only to the ranks of its experts. The default serves one rank (a copy) and
  // throws mt::Error for more.
  virtual void all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                          const std::vector<size_t>& recv_rows, size_t row);

  // The ranks that pass the same `color`, as a communicator of their own, ranked by `key`
  // (then by this rank): the groups of a mesh axis (tensor parallelism's ranks, data
  // parallelism's across them). Every rank calls it. The default serves one rank and throws
  // mt::Error for more.
  virtual std::unique_ptr<Communicator> split(int color, int key);

  // The bytes this rank has received from the others in its collectives so far (what a ring
  // moves through one rank's link, per direction), for the metrics and for checking the memory
  // plan's traffic; 0 where the communicator does not count them.
  virtual double bytes_received() const { return 0; }

  // Whether the collectives may be called from a thread other than the one that made the
  // communicator, one thread at a time (MPI_THREAD_SERIALIZED): what overlapping data
  // parallelism's gradient sums with the backward needs. false: only the making thread calls.
  virtual bool serialized_threads() const { return false; }

  // Ends the whole job with `code` from this rank (a rank that failed calls it, so no other
  // rank waits forever in a collective). Never returns.
  [[noreturn]] virtual void abort(int code) = 0;
};

// The part [first, second) of an n-element buffer that `rank` of `ranks` owns in
// reduce_scatter_sum and all_gather.
inline std::pair<size_t, size_t> shard_range(size_t n, int rank, int ranks) {
  const auto r = static_cast<size_t>(rank), N = static_cast<size_t>(ranks);
  // n r / N without overflow for any n a buffer can have.
  auto at = [&](size_t k) { return n / N * k + n % N * k / N; };
  return {at(r), at(r + 1)};
}

using CommunicatorFactory = std::function<std::unique_ptr<Communicator>(const Config&)>;

}  // namespace mt
