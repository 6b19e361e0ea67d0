// Registration of the CPU backend plugin: the backend "cpu" and its attention kernels.
#include <sched.h>

#include <thread>

#include "cpu_backend.h"
#include "kernels/kernels.h"
#include "mt/attention.h"
#include "mt/config.h"
#include "mt/plugin.h"

namespace {

int threads_from(const mt::Config& cfg) {
  int n = cfg.has("num_threads") ? static_cast<int>(cfg.get_int("num_threads")) : 0;
  if (n <= 0) {
    // The cores this process may run on: mpirun binds each rank to its own, taskset and
    // cpusets restrict them too (hardware_concurrency counts the machine's).
    cpu_set_t set;
    CPU_ZERO(&set);
    n = sched_getaffinity(0, sizeof set, &set) == 0
            ? CPU_COUNT(&set)
            : static_cast<int>(std::thread::hardware_concurrency());
  }
  return n > 0 ? n : 1;
}

void register_cpu(mt::Registry& r) {
  r.add_backend("cpu", [](const mt::Config& cfg) -> std::unique_ptr<mt::Backend> {
    const int n = threads_from(cfg);
    mt::cpu::gemm_setup(n);
    return std::make_unique<mt::cpu::CpuBackend>(n);
  });
  r.add_attention("cpu", "dot_product",
                  [](mt::Backend& b) { return mt::cpu::make_dot_product_attention(b); });
  r.add_attention("cpu", "flash", [](mt::Backend& b) { return mt::cpu::make_flash_attention(b); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::backend, "cpu", "0.1.0", register_cpu, nullptr)
