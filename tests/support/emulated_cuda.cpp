// Compiles the cuda plugin's .cu sources (the op families' kernels, attention.cu, flash.cu and
// gemm.cu) as host C++ in this one translation unit (cuda_emulation.h must come first; gemm.cu's
// cuBLASLt calls reach cublaslt_emulation.h) and wraps their launchers in a Backend with host
// memory.
#include "cuda_emulation.h"
// (a line apart: clang-format keeps the emulation headers first)
#include "cublaslt_emulation.h"
// The plugin's sources, as they are.
#include "adamw.cu"
#include "attention.cu"
#include "common.cu"
#include "elementwise.cu"
#include "flash.cu"
#include "gemm.cu"
#include "moe.cu"
#include "norm.cu"
#include "rope.cu"
#include "rows.cu"
#include "softmax.cu"

#include "cuda_ops.h"
#include "emulated_cuda.h"
#include "mt/error.h"
#include "test_support.h"

namespace mt::cuda {

namespace {

class EmulatedCuda final : public CudaOps {
 public:
  EmulatedCuda() {
    // Tensors held in ctx_ (the rope tables) are the CPU backend's: it must be made first, so
    // that it outlives this backend when both are function-local statics of a test.
    mem();
    init_ctx(nullptr);
    ctx_.gemm = std::make_shared<Gemm>(
        nullptr, MatmulPrecision::highest,
        mem().empty({static_cast<int64_t>(Gemm::kWorkspaceBytes)}, DType::u8));
  }
  ~EmulatedCuda() override { ctx_ = {}; }  // the cached tensors go back while mem() exists
  EmulatedCuda(const EmulatedCuda&) = delete;
  EmulatedCuda& operator=(const EmulatedCuda&) = delete;
  std::string name() const override { return "cuda"; }
  std::string describe() const override { return "cuda kernels emulated on the CPU"; }
  double peak_flops(DType) const override { return 0.0; }
  Tensor empty(const Shape& shape, DType dtype) override { return mem().empty(shape, dtype); }
  void release(void*, size_t) override {}  // tensors are the CPU backend's
  void copy_from_host(Tensor& dst, const void* src) override { mem().copy_from_host(dst, src); }
  void copy_to_host(const Tensor& src, void* dst) override {
    mem().copy_to_host(src, dst);
    report_checks();
  }
  void synchronize() override { report_checks(); }
  MemoryStats memory_stats() const override { return test::cpu().memory_stats(); }
  void reset_peak_memory() override { mem().reset_peak_memory(); }
  void release_cached_memory() override { mem().release_cached_memory(); }

 private:
  static Backend& mem() { return test::cpu(); }
};

}  // namespace
}  // namespace mt::cuda

namespace mt::test {

std::unique_ptr<Backend> emulated_cuda() {
  return std::make_unique<cuda::EmulatedCuda>();
}

int64_t emulated_mma_calls() {
  return emu::state.mma_warp_calls;
}

int64_t emulated_gemm_calls() {
  return emu_lt::matmul_calls;
}

int64_t emulated_kernel_launches() {
  return emu::state.launches;
}

std::unique_ptr<AttentionKernel> emulated_cuda_attention(const std::string& name, Backend& b) {
  auto* ops = dynamic_cast<cuda::CudaOps*>(&b);
  MT_CHECK(ops != nullptr, "emulated_cuda_attention needs an emulated_cuda() backend");
  MT_CHECK(name == "dot_product" || name == "flash", "no emulated cuda attention " + name);
  return std::make_unique<cuda::CudaAttention>(
      name, name == "flash" ? cuda::kFlash : cuda::kDotProduct, *ops);
}

}  // namespace mt::test
