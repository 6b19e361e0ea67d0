// communicator=nccl: NCCL collectives between the GPUs of an mpirun job, for the cuda backend.
//
// Bootstrap: MPI (one process per GPU under mpirun or srun); rank 0 makes NCCL's unique id and
// broadcasts it over MPI_COMM_WORLD, then every rank joins the NCCL communicator on the GPU the
// cuda backend also picks (the launcher's local rank modulo the GPUs visible). The cuda
// backend's tensors are summed in place on the device, every tensor of a bucket in one NCCL
// group on this communicator's own stream, after the backend is synchronised: no host round
// trip. Host buffers (losses, counts, the sharded optimizer's flat buffers) go through a device
// scratch buffer, so every collective of the job is NCCL's; barrier and abort are MPI's.
//
// Sums: NCCL's ring or tree order, not rank order, so N ranks agree with one rank within f32
// rounding rather than to the bit as with communicator=mpi; every rank receives the same
// reduced bits (the reduce-scatter's owner result is what the all-gather copies). bf16 tensors
// are summed by NCCL in bf16 (rounded at every hop); the default path's f32 host sum is
// communicator=mpi's.
//
// split() makes a group's communicator (ncclCommSplit beside MPI_Comm_split), so tensor and
// expert parallelism and HSDP, whose groups are sub-communicators, run over NCCL too (their
// activations' sums through the host buffers' path).
//
// Status: built and loaded here; gpu_nccl_test (world size 1: every collective, a split group,
// a training run) passed on an H100 (bench/gpu/NOTES.md, 2026-11-27). Multi-GPU numerics are
// those of the MPI tests until a machine with several GPUs runs them.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/backend.h"
#include "mt/comm.h"
#include "mt/config.h"
#include "mt/dtype.h"
#include "mt/env.h"
#include "mt/error.h"
#include "mt/plugin.h"
#include "mt/tensor.h"

namespace {

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  throw mt::Error(std::string("nccl communicator: ") + what +
                  " failed: " + std::string(msg, static_cast<size_t>(len)));
}
void check_cuda(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  throw mt::Error(std::string("nccl communicator: ") + what + " failed: " + cudaGetErrorName(e) +
                  ": " + cudaGetErrorString(e));
}
void check_nccl(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return;
  throw mt::Error(std::string("nccl communicator: ") + what + " failed: " + ncclGetErrorString(r) +
                  " (NCCL_DEBUG=INFO in the environment makes NCCL say more)");
}

// The launcher's local rank (the GPU this process drives): OpenMPI's, else Slurm's, else 0.
int local_rank() {
  return mt::env_local_rank();
}

class NcclCommunicator final : public mt::Communicator {
 public:
  NcclCommunicator() {
    int initialised = 0;
    MPI_Initialized(&initialised);
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized)
      throw mt::Error(
          "nccl communicator: MPI was already finalized in this process (by the communicator that "
          "started it, when it was destroyed), and MPI cannot start twice in one process: make "
          "one communicator per process and keep it for the run.");
    if (!initialised) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided),
                "MPI_Init_thread");
      owns_mpi_ = true;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
    MPI_Comm_size(MPI_COMM_WORLD, &size_);
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (devices == 0) throw mt::Error("nccl communicator: no CUDA device is visible.");
    check_cuda(cudaSetDevice(local_rank() % devices), "cudaSetDevice");
    ncclUniqueId id{};
    if (rank_ == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
    check_mpi(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD), "MPI_Bcast (NCCL id)");
    check_nccl(ncclCommInitRank(&comm_, size_, id, rank_), "ncclCommInitRank");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  // A group of `parent`'s ranks (split): its own MPI and NCCL communicators and stream.
  NcclCommunicator(MPI_Comm mpi, ncclComm_t comm) : mpi_(mpi), comm_(comm) {
    MPI_Comm_rank(mpi_, &rank_);
    MPI_Comm_size(mpi_, &size_);
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  }
  ~NcclCommunicator() override {
    if (scratch_) cudaFree(scratch_);
    if (stream_) cudaStreamDestroy(stream_);
    // Not while an exception unwinds: both would wait for ranks that may never come (the
    // caller aborts the job instead).
    if (std::uncaught_exceptions() == 0) {
      if (comm_) ncclCommDestroy(comm_);
      if (mpi_ != MPI_COMM_WORLD) MPI_Comm_free(&mpi_);
      if (owns_mpi_) MPI_Finalize();
    }
  }

  // ncclCommSplit (NCCL 2.18+) orders a group's ranks by key, then by the parent's rank, as
  // MPI_Comm_split does, so both communicators agree on every rank's number.
  std::unique_ptr<mt::Communicator> split(int color, int key) override {
    MPI_Comm sub = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(mpi_, color, key, &sub), "MPI_Comm_split");
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    ncclComm_t nccl = nullptr;
    check_nccl(ncclCommSplit(comm_, color, key, &nccl, nullptr), "ncclCommSplit");
    return std::unique_ptr<mt::Communicator>(new NcclCommunicator(sub, nccl));
  }

  std::string name() const override { return "nccl"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  void all_reduce_sum(float* data, size_t n) override {
    on_device(data, n * sizeof(float), [&](void* d) {
      check_nccl(ncclAllReduce(d, d, n, ncclFloat32, ncclSum, comm_, stream_), "ncclAllReduce");
    });
  }
  void all_reduce_sum(double* data, size_t n) override {
    on_device(data, n * sizeof(double), [&](void* d) {
      check_nccl(ncclAllReduce(d, d, n, ncclFloat64, ncclSum, comm_, stream_), "ncclAllReduce");
    });
  }
  void broadcast(void* data, size_t bytes, int root) override {
    on_device(data, bytes, [&](void* d) {
      check_nccl(ncclBroadcast(d, d, bytes, ncclUint8, root, comm_, stream_), "ncclBroadcast");
    });
  }
  void barrier() override { check_mpi(MPI_Barrier(mpi_), "MPI_Barrier"); }

  // The parts of shard_range differ by one element where the ranks do not divide n, and NCCL's
  // reduce-scatter and all-gather take equal parts: the sum is a whole all-reduce (every part
  // summed, this rank's among them), the gather goes through equal padded slots.
  void reduce_scatter_sum(float* data, size_t n) override { all_reduce_sum(data, n); }
  void all_gather(float* data, size_t n) override {
    if (n == 0) return;
    const auto N = static_cast<size_t>(size_);
    size_t slot = 0;
    for (int r = 0; r < size_; ++r) {
      const auto [lo, hi] = mt::shard_range(n, r, size_);
      slot = std::max(slot, hi - lo);
    }
    std::vector<float> padded(slot * N, 0.f);
    const auto [mlo, mhi] = mt::shard_range(n, rank_, size_);
    std::copy(data + mlo, data + mhi, padded.begin() + static_cast<std::ptrdiff_t>(rank_ * slot));
    on_device(padded.data(), padded.size() * sizeof(float), [&](void* d) {
      float* base = static_cast<float*>(d);
      check_nccl(ncclAllGather(base + rank_ * slot, base, slot, ncclFloat32, comm_, stream_),
                 "ncclAllGather");
    });
    for (int r = 0; r < size_; ++r) {
      const auto [lo, hi] = mt::shard_range(n, r, size_);
      std::copy_n(padded.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(r) * slot),
                  hi - lo, data + lo);
    }
  }

  // NCCL has no all-to-all of its own: one group of sends and receives, as its documentation
  // builds it, through the device scratch (the sends' rows, then the receives').
  void all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                  const std::vector<size_t>& recv_rows, size_t row) override {
    const auto N = static_cast<size_t>(size_);
    if (send_rows.size() != N || recv_rows.size() != N)
      throw mt::Error("nccl communicator: all_to_all takes one count per rank (" +
                      std::to_string(N) + ")");
    size_t sent = 0, got = 0;
    for (size_t r = 0; r < N; ++r) {
      sent += send_rows[r] * row;
      got += recv_rows[r] * row;
    }
    const size_t bytes = (sent + got) * sizeof(float);
    if (bytes == 0) return;
    reserve(bytes);
    auto* base = static_cast<float*>(scratch_);
    if (sent)
      check_cuda(cudaMemcpyAsync(base, send, sent * sizeof(float), cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync");
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    size_t s_at = 0, r_at = sent;
    for (size_t r = 0; r < N; ++r) {
      const int peer = static_cast<int>(r);
      if (send_rows[r])
        check_nccl(ncclSend(base + s_at, send_rows[r] * row, ncclFloat32, peer, comm_, stream_),
                   "ncclSend");
      if (recv_rows[r])
        check_nccl(ncclRecv(base + r_at, recv_rows[r] * row, ncclFloat32, peer, comm_, stream_),
                   "ncclRecv");
      s_at += send_rows[r] * row;
      r_at += recv_rows[r] * row;
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    if (got)
      check_cuda(
          cudaMemcpyAsync(recv, base + sent, got * sizeof(float), cudaMemcpyDeviceToHost, stream_),
          "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  void all_reduce_sum(mt::Backend& backend, const std::vector<mt::Tensor*>& tensors) override {
    if (backend.name() != "cuda") {  // host tensors: the default path through our host sums
      Communicator::all_reduce_sum(backend, tensors);
      return;
    }
    backend.synchronize();  // the gradients are written on the backend's stream
    check_nccl(ncclGroupStart(), "ncclGroupStart");
    for (mt::Tensor* t : tensors) {
      if (t->dtype() != mt::DType::f32 && t->dtype() != mt::DType::bf16)
        throw mt::Error("nccl communicator: all_reduce_sum takes f32 or bf16 tensors, got " +
                        t->str());
      const auto n = static_cast<size_t>(t->numel());
      if (n == 0) continue;
      check_nccl(ncclAllReduce(t->data(), t->data(), n,
                               t->dtype() == mt::DType::f32 ? ncclFloat32 : ncclBfloat16, ncclSum,
                               comm_, stream_),
                 "ncclAllReduce");
    }
    check_nccl(ncclGroupEnd(), "ncclGroupEnd");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    if (comm_) ncclCommAbort(comm_);
    MPI_Abort(MPI_COMM_WORLD, code);
    std::_Exit(code);
  }

 private:
  // The device scratch, at least `bytes` long.
  void reserve(size_t bytes) {
    if (bytes <= scratch_bytes_) return;
    if (scratch_) check_cuda(cudaFree(scratch_), "cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
    check_cuda(cudaMalloc(&scratch_, bytes), "cudaMalloc (collective scratch)");
    scratch_bytes_ = bytes;
  }
  // Host bytes through the device scratch: copied in, `op` on the device copy, copied back.
  template <class Op>
  void on_device(void* host, size_t bytes, Op op) {
    if (bytes == 0) return;
    reserve(bytes);
    check_cuda(cudaMemcpyAsync(scratch_, host, bytes, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync");
    op(scratch_);
    check_cuda(cudaMemcpyAsync(host, scratch_, bytes, cudaMemcpyDeviceToHost, stream_),
               "cudaMemcpyAsync");
    check_cuda(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  MPI_Comm mpi_ = MPI_COMM_WORLD;  // the same ranks, for barrier
  int rank_ = 0, size_ = 1;
  bool owns_mpi_ = false;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  size_t scratch_bytes_ = 0;
};

// Declines (the loader says why) where no GPU can run NCCL.
const char* probe() {
  if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL))
    return "libcuda.so.1 (the NVIDIA driver library) was not found: NCCL needs an NVIDIA GPU; "
           "use communicator=mpi";
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0)
    return "no CUDA device is visible: NCCL needs one; use communicator=mpi";
  return nullptr;
}

void register_all(mt::Registry& r) {
  r.add_communicator("nccl", [](const mt::Config&) -> std::unique_ptr<mt::Communicator> {
    return std::make_unique<NcclCommunicator>();
  });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::comm, "nccl", "0.1.0", register_all, probe)
