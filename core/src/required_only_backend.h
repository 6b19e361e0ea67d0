// RequiredOnlyBackend: a backend as one built out of tree against an older op list would be.
// It forwards the required ops of mt/ops.def (and memory) to another backend and lacks every
// composed op, so the core's compositions (core/src/op_fallbacks.cpp) run on it. Tests compare
// those compositions with the backends' own kernels; benchmarks time them.
#pragma once

#include <cstdint>
#include <string>

#include "mt/backend.h"

namespace mt {

// Counts its host reads.
class RequiredOnlyBackend final : public Backend {
 public:
  explicit RequiredOnlyBackend(Backend& inner) : b_(inner) {}
  int64_t host_reads = 0;
  std::string name() const override { return "required_only"; }
  std::string describe() const override { return b_.name() + " without its composed ops"; }
  double peak_flops(DType d) const override { return b_.peak_flops(d); }
  Tensor empty(const Shape& s, DType d) override { return b_.empty(s, d); }
  void release(void* p, size_t n) override { b_.release(p, n); }
  void copy_from_host(Tensor& dst, const void* src) override { b_.copy_from_host(dst, src); }
  void copy_to_host(const Tensor& src, void* dst) override {
    ++host_reads;
    b_.copy_to_host(src, dst);
  }
  void synchronize() override { b_.synchronize(); }
  MemoryStats memory_stats() const override { return b_.memory_stats(); }
  void reset_peak_memory() override { b_.reset_peak_memory(); }
  void release_cached_memory() override { b_.release_cached_memory(); }
#define MT_OP_required(ret, name, params, args) \
  ret name params override {                    \
    return b_.name args;                        \
  }
#define MT_OP_composed(ret, name, params, args)
#define MT_OP(kind, ret, name, params, args) MT_OP_##kind(ret, name, params, args)
#include "mt/ops.def"
#undef MT_OP
#undef MT_OP_composed
#undef MT_OP_required

 private:
  Backend& b_;
};

}  // namespace mt
