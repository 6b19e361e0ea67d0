// The CPU backend: host memory from a caching allocator, kernels on oneTBB, GEMMs on OpenBLAS.
#pragma once

#include <oneapi/tbb/global_control.h>
#include <oneapi/tbb/task_arena.h>

#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "allocator.h"
#include "mt/attention.h"
#include "mt/backend.h"

// The test build with emulated intrinsics (kernels/x86_simd.h) is a backend of its own name, so
// it never stands in for the real one.
#if defined(MT_EMULATE_X86)
#define MT_CPU_BACKEND_NAME "cpu_x86emu"
#else
#define MT_CPU_BACKEND_NAME "cpu"
#endif

namespace mt::cpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads);
  ~CpuBackend() override;

  int num_threads() const { return num_threads_; }
  // Runs f on this backend's threads (kernels called outside the arena would use all cores).
  template <class F>
  void run(F&& f) {
    arena_.execute(std::forward<F>(f));
  }

  std::string name() const override { return MT_CPU_BACKEND_NAME; }
  std::string describe() const override;
  double peak_flops(DType dtype) const override;
  // "mt.matvec_rows_layout": non-null, as the matrix-vector kernels stream a weight stored
  // [N, K] (trans_b) at about the memory's rate and one stored [K, N] at 0.5-0.8 of it, so
  // inference stores projection weights transposed (ModelRunner::transpose_projections).
  // "mt.grouped_rows_layout": non-null, as grouped_matmul's experts of few rows take the same
  // kernels, so experts' weights are stored [E, N, K] too.
  void* extension(const char* name) override;

  Tensor empty(const Shape& shape, DType dtype) override;
  void release(void* data, size_t bytes) override;
  void copy_from_host(Tensor& dst, const void* src) override;
  void copy_to_host(const Tensor& src, void* dst) override;
  MemoryStats memory_stats() const override;
  void reset_peak_memory() override;
  void release_cached_memory() override;

  // Every op of mt/ops.def has a kernel here (kernels/*.cpp, forwarded in cpu_backend.cpp).
  bool supports(Op) const override { return true; }
#define MT_OP(kind, ret, name, params, args) ret name params override;
#include "mt/ops.def"
#undef MT_OP

 private:
  size_t host_memory_limit() const;  // read once

  int num_threads_;
  int cpus_;  // the CPUs this process may run on (its affinity mask)
  // oneTBB runs at most as many threads as the machine has CPUs unless told otherwise: a
  // backend asked for more raises that limit for its life (declared before the arena, so it
  // is in force when the arena starts its workers and outlives it).
  std::optional<tbb::global_control> workers_;
  tbb::task_arena arena_;
  mutable std::once_flag limit_once_;
  mutable size_t limit_ = 0;
  CachingAllocator alloc_;
};

// attention/*.cpp
std::unique_ptr<AttentionKernel> make_dot_product_attention(Backend& b);
std::unique_ptr<AttentionKernel> make_flash_attention(Backend& b);

}  // namespace mt::cpu
