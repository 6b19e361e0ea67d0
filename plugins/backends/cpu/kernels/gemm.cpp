// gemm: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void gemm_setup(int num_threads) {}

std::string gemm_describe() { return "OpenBLAS (placeholder)"; }

double cpu_peak_flops(DType dtype, int num_threads) { return 1e11 * num_threads; }

void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) {
  fail("cpu: matmul is not implemented yet");
}

}  // namespace mt::cpu
