// The CUDA backend's GEMMs through cuBLASLt: one Gemm per backend owns the cuBLASLt handle, a
// workspace from the backend's caching allocator and a cache of plans (descriptors plus the
// algorithm the heuristic chose), one per problem, so a steady-state step makes no heuristic
// query. mt::cuda::matmul (kernels.h) checks the operands and calls Gemm::run.
#pragma once

#ifndef MT_CUDA_EMULATION  // tests/support/cublaslt_emulation.h stands in for cuBLASLt
#include <cublasLt.h>
#include <cuda_runtime.h>
#endif

#include <compare>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "mt/tensor.h"

namespace mt::cuda {

// How float32 matmuls run (config key matmul_precision): full f32 (CUBLAS_COMPUTE_32F) or on TF32
// tensor cores (CUBLAS_COMPUTE_32F_FAST_TF32: inputs rounded to 10 mantissa bits, f32
// accumulation). bf16 matmuls always accumulate in f32 either way.
enum class MatmulPrecision : uint8_t { highest, tf32 };

// One GEMM in cuBLASLt's column-major terms: D = alpha op(A) op(B) + beta C for `batch` strided
// matrices, with C and D the same buffer. Leading dimensions are those of each matrix as stored
// (before op); batch strides are in elements, and a stride of 0 shares one matrix across the
// batch.
struct GemmArgs {
  const void* a;
  const void* b;
  void* c;
  cudaDataType_t ab_type, c_type;  // A and B share one type
  bool trans_a, trans_b;
  int64_t m, n, k;  // op(A) is m x k, op(B) k x n, C m x n
  int64_t lda, ldb, ldc;
  int64_t stride_a, stride_b, stride_c;
  int64_t batch;
  float alpha, beta;  // beta = 0: C is not read (it may hold anything, NaN included)
};

class Gemm {
 public:
  static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

  // workspace: kWorkspaceBytes of device memory (256-byte aligned), used on `stream` only.
  Gemm(cudaStream_t stream, MatmulPrecision precision, Tensor workspace);
  ~Gemm();
  Gemm(const Gemm&) = delete;
  Gemm& operator=(const Gemm&) = delete;

  MatmulPrecision precision() const { return precision_; }
  // Enqueues the GEMM on the stream; throws mt::Error naming `op` and `shapes` when cuBLASLt
  // refuses it or its heuristic finds no algorithm.
  void run(const GemmArgs& g, const std::string& op, const std::function<std::string()>& shapes);

 private:
  // Everything a plan depends on: sizes, transposes, leading dimensions, batch and strides,
  // types, compute type and the operands' alignments (an algorithm chosen for 256-byte aligned
  // pointers may not run on a view at an odd offset). A fused epilogue (bias, gelu) would be one
  // more field here and one more attribute on the plan's descriptor.
  struct Key {
    int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
    int64_t align_a, align_b, align_c;  // bytes, at most 256
    cudaDataType_t ab_type, c_type;
    cublasComputeType_t compute;
    bool trans_a, trans_b;
    auto operator<=>(const Key&) const = default;
  };
  struct Plan;
  const Plan& plan(const Key& key, const GemmArgs& g, const std::string& op,
                   const std::function<std::string()>& shapes);

  cudaStream_t stream_;
  MatmulPrecision precision_;
  Tensor workspace_;
  cublasLtHandle_t handle_ = nullptr;
  std::mutex mu_;  // guards plans_ (plans are immutable once made)
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

}  // namespace mt::cuda
