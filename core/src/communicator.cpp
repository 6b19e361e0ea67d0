// The Communicator's defaults (mt/comm.h), the one-rank `local` communicator, and the choice of
// communicator for a run (`communicator=auto|local|mpi`).
#include "communicator.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <vector>

#include "mt/backend.h"
#include "mt/config.h"
#include "mt/dtype.h"
#include "mt/error.h"
#include "mt/tensor.h"
#include "plugin_manager.h"

namespace mt {

Communicator::~Communicator() = default;

void Communicator::all_reduce_sum(Backend& backend, const std::vector<Tensor*>& tensors) {
  if (size() == 1) return;
  size_t total = 0;
  for (const Tensor* t : tensors) {
    MT_CHECK(t->dtype() == DType::f32 || t->dtype() == DType::bf16,
             "all_reduce_sum takes f32 or bf16 tensors");
    total += static_cast<size_t>(t->numel());
  }
  // One bucket: a single collective for every tensor (latency once, not once per tensor).
  std::vector<float> host(total);
  std::vector<uint16_t> half;
  size_t off = 0;
  for (const Tensor* t : tensors) {
    const auto n = static_cast<size_t>(t->numel());
    if (t->dtype() == DType::f32) {
      backend.copy_to_host(*t, host.data() + off);
    } else {
      half.resize(n);
      backend.copy_to_host(*t, half.data());
      for (size_t i = 0; i < n; ++i) host[off + i] = bf16_to_f32(half[i]);
    }
    off += n;
  }
  all_reduce_sum(host.data(), host.size());
  off = 0;
  for (Tensor* t : tensors) {
    const auto n = static_cast<size_t>(t->numel());
    if (t->dtype() == DType::f32) {
      backend.copy_from_host(*t, host.data() + off);
    } else {
      half.resize(n);
      for (size_t i = 0; i < n; ++i) half[i] = f32_to_bf16(host[off + i]);
      backend.copy_from_host(*t, half.data());
    }
    off += n;
  }
}

void Communicator::reduce_scatter_sum(float*, size_t) {
  if (size() > 1)
    throw Error("The " + name() + " communicator has no reduce_scatter_sum (sharded state).");
}
void Communicator::all_gather(float*, size_t) {
  if (size() > 1) throw Error("The " + name() + " communicator has no all_gather (sharded state).");
}

void Communicator::all_to_all(const float* send, const std::vector<size_t>& send_rows, float* recv,
                              const std::vector<size_t>& recv_rows, size_t row) {
  if (size() > 1)
    throw Error("The " + name() + " communicator has no all_to_all (expert parallelism).");
  MT_CHECK(send_rows.size() == 1 && recv_rows.size() == 1 && send_rows[0] == recv_rows[0],
           "all_to_all: one rank sends itself what it receives");
  if (send_rows[0] && row) std::copy_n(send, send_rows[0] * row, recv);
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  if (size() > 1)
    throw UsageError("The " + name() +
                     " communicator cannot divide its ranks into groups, which tensor "
                     "parallelism needs; use communicator=mpi.");
  return make_local_communicator();
}

namespace {

class LocalCommunicator final : public Communicator {
 public:
  std::string name() const override { return "local"; }
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(float*, size_t) override {}
  void all_reduce_sum(double*, size_t) override {}
  void all_reduce_sum(Backend&, const std::vector<Tensor*>&) override {}
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
  void reduce_scatter_sum(float*, size_t) override {}
  void all_gather(float*, size_t) override {}
  [[noreturn]] void abort(int code) override {
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(code);
  }
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

namespace {
// The first of `names` set in the environment, as a number; 0 when none is.
int env_int(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const char* s = std::getenv(n); s && *s) return std::atoi(s);
  return 0;
}
// Started by Slurm's srun with PMIx (OpenMPI's direct launch): no OMPI_* variables, PMIX_RANK.
bool srun_with_pmix() {
  return std::getenv("PMIX_RANK") && std::getenv("SLURM_STEP_NUM_TASKS");
}
}  // namespace

int launcher_world_size() {
  if (const int n = env_int({"OMPI_COMM_WORLD_SIZE"})) return n;
  return srun_with_pmix() ? env_int({"SLURM_STEP_NUM_TASKS"}) : 0;
}

int launcher_rank() {
  if (std::getenv("OMPI_COMM_WORLD_SIZE")) return env_int({"OMPI_COMM_WORLD_RANK"});
  return srun_with_pmix() ? env_int({"PMIX_RANK"}) : 0;
}

std::unique_ptr<Communicator> make_communicator(const Config& cfg, PluginManager& plugins) {
  std::string name = cfg.has("communicator") ? cfg.get_string("communicator") : "auto";
  if (name == "auto") name = launcher_world_size() > 0 ? "mpi" : "local";
  if (name == "local") {
    if (launcher_world_size() > 1)
      cfg.reject("communicator",
                 "is local (one rank) but mpirun started " + std::to_string(launcher_world_size()) +
                     " ranks; use communicator=mpi (or auto) to train with all of them.");
    return make_local_communicator();
  }
  // The backend's plugin registers before MPI starts its threads: the CPU plugin's sets
  // OPENBLAS_CORETYPE as it loads OpenBLAS, and setenv must not race a getenv on another thread.
  plugins.require("backend", cfg.get_string("backend"));
  return plugins.make_communicator(name, cfg);
}

Tensor flat_part(const Tensor& t, int64_t b, int64_t e) {
  return t.view({t.numel()}).slice0(b, e);
}

void part_to_host(const Tensor& t, int64_t b, int64_t e, float* out) {
  if (b == e) return;
  const Tensor part = flat_part(t, b, e);
  if (t.dtype() == DType::f32) {
    t.backend()->copy_to_host(part, out);
    return;
  }
  MT_CHECK(t.dtype() == DType::bf16, "sharded state is f32 or bf16");
  std::vector<uint16_t> half(static_cast<size_t>(e - b));
  t.backend()->copy_to_host(part, half.data());
  for (size_t i = 0; i < half.size(); ++i) out[i] = bf16_to_f32(half[i]);
}
void part_from_host(Tensor& t, int64_t b, int64_t e, const float* in) {
  if (b == e) return;
  Tensor part = flat_part(t, b, e);
  if (t.dtype() == DType::f32) {
    t.backend()->copy_from_host(part, in);
    return;
  }
  MT_CHECK(t.dtype() == DType::bf16, "sharded state is f32 or bf16");
  std::vector<uint16_t> half(static_cast<size_t>(e - b));
  for (size_t i = 0; i < half.size(); ++i) half[i] = f32_to_bf16(in[i]);
  t.backend()->copy_from_host(part, half.data());
}

}  // namespace mt
