// Registration of the CPU backend plugin: the backend "cpu" and its attention kernels.

#include "cpu_backend.h"
#include "kernels/kernels.h"
#include "mt/attention.h"
#include "mt/config.h"
#include "mt/plugin.h"

namespace {

void register_cpu(mt::Registry& r) {
  // OpenBLAS now, not when the first backend is made: its loading sets OPENBLAS_CORETYPE, and
  // setenv must not run beside another thread's getenv (MPI's, once a communicator exists).
  mt::cpu::load_blas();
  r.add_backend(MT_CPU_BACKEND_NAME, [](const mt::Config& cfg) -> std::unique_ptr<mt::Backend> {
    const int n = mt::cpu_threads(cfg);
    mt::cpu::gemm_setup(n);
    return std::make_unique<mt::cpu::CpuBackend>(n);
  });
  r.add_attention(MT_CPU_BACKEND_NAME, "dot_product",
                  [](mt::Backend& b) { return mt::cpu::make_dot_product_attention(b); });
  r.add_attention(MT_CPU_BACKEND_NAME, "flash",
                  [](mt::Backend& b) { return mt::cpu::make_flash_attention(b); });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::backend, MT_CPU_BACKEND_NAME, "0.1.0", register_cpu, nullptr)
