// HeldPeakBackend: passes everything to another backend and keeps the most bytes that one's
// allocator held at once (in use and cached), read at each allocation: what a caching
// allocator's process keeps in memory, which peak_bytes_in_use alone does not show.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <utility>

#include "mt/backend.h"

namespace mt::test {

class HeldPeakBackend final : public Backend {
 public:
  explicit HeldPeakBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  Backend& inner() { return *inner_; }
  size_t peak_held = 0;

  std::string name() const override { return inner_->name(); }
  std::string describe() const override { return inner_->describe(); }
  double peak_flops(DType d) const override { return inner_->peak_flops(d); }
  Tensor empty(const Shape& s, DType d) override {
    Tensor t = inner_->empty(s, d);
    const MemoryStats m = inner_->memory_stats();
    peak_held = std::max(peak_held, m.bytes_in_use + m.bytes_cached);
    return t;
  }
  void release(void* p, size_t n) override { inner_->release(p, n); }
  void copy_from_host(Tensor& dst, const void* src) override { inner_->copy_from_host(dst, src); }
  void copy_to_host(const Tensor& src, void* dst) override { inner_->copy_to_host(src, dst); }
  void synchronize() override { inner_->synchronize(); }
  MemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void reset_peak_memory() override { inner_->reset_peak_memory(); }
  void release_cached_memory() override { inner_->release_cached_memory(); }
  bool supports(Op op) const override { return inner_->supports(op); }
  void* extension(const char* n) override { return inner_->extension(n); }
#define MT_OP(kind, ret, name, params, args) \
  ret name params override {                 \
    return inner_->name args;                \
  }
#include "mt/ops.def"
#undef MT_OP

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace mt::test
