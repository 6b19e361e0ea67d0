// The CUDA backend's kernels and launchers on host memory, under cuda_emulation.h: a "device"
// for gpu_ops_test on machines without a GPU (the cuda_emulated_ops_test executable).
#pragma once

#include <memory>
#include <string>

#include "mt/attention.h"
#include "mt/backend.h"

namespace mt::test {

// A Backend whose ops are the cuda plugin's launchers (plugins/backends/cuda/cuda_ops.h), its
// memory the CPU backend's; GEMMs go through gemm.cu to tests/support/cublaslt_emulation.h.
std::unique_ptr<Backend> emulated_cuda();
// How many warp-wide mma.sync the emulated kernels have executed so far (tensor-core paths).
int64_t emulated_mma_calls();
// How many cublasLtMatmul calls (emulated) the backend's matmuls have made so far.
int64_t emulated_gemm_calls();
// How many kernels the emulated backend has launched so far (cuBLASLt's emulated GEMMs aside).
int64_t emulated_kernel_launches();
// "dot_product" or "flash" of the cuda plugin on an emulated_cuda() backend.
std::unique_ptr<AttentionKernel> emulated_cuda_attention(const std::string& name, Backend& b);

}  // namespace mt::test
