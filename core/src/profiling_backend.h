// ProfilingBackend: wraps a backend and times every op (synchronising after each, so device
// backends are timed correctly). Used by `mt run profile=true` and the benchmarks to say where a
// step's time goes (GEMMs, attention, optimizer, the rest).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/ops.h"

namespace mt {

struct OpTime {
  int64_t calls = 0;
  double seconds = 0;
};

class ProfilingBackend final : public Backend {
 public:
  explicit ProfilingBackend(Backend& inner) : inner_(inner) {}

  const std::map<std::string, OpTime>& times() const { return times_; }
  void reset() { times_.clear(); }
  void add(const std::string& op, double seconds) {
    auto& t = times_[op];
    ++t.calls;
    t.seconds += seconds;
  }
  // "matmul 61.2% (1234 calls), attention 20.1%, ..." sorted by time.
  std::string report() const;

  // Wraps an attention kernel so its calls are timed under "attention_forward" etc.
  std::unique_ptr<AttentionKernel> wrap(AttentionKernel& k);

  std::string name() const override { return inner_.name(); }
  std::string describe() const override { return inner_.describe(); }
  double peak_flops(DType d) const override { return inner_.peak_flops(d); }
  Tensor empty(const Shape& s, DType d) override { return inner_.empty(s, d); }
  void release(void* p, size_t n) override { inner_.release(p, n); }
  void copy_from_host(Tensor& dst, const void* src) override { inner_.copy_from_host(dst, src); }
  void copy_to_host(const Tensor& src, void* dst) override { inner_.copy_to_host(src, dst); }
  void synchronize() override { inner_.synchronize(); }
  MemoryStats memory_stats() const override { return inner_.memory_stats(); }
  void reset_peak_memory() override { inner_.reset_peak_memory(); }
  void release_cached_memory() override { inner_.release_cached_memory(); }
  void* extension(const char* n) override { return inner_.extension(n); }

  bool supports(Op op) const override { return inner_.supports(op); }

  // Every op of mt/ops.def: timed under its name, then the inner backend's (its kernel or the
  // core's composition, as the inner backend has it).
#define MT_OP(kind, ret, name, params, args) \
  ret name params override {                 \
    Timer t(*this, #name);                   \
    return inner_.name args;                 \
  }
#include "mt/ops.def"
#undef MT_OP

  struct Timer {
    Timer(ProfilingBackend& b, const char* op)
        : b_(b), op_(op), t0_(std::chrono::steady_clock::now()) {}
    ~Timer() {
      b_.inner_.synchronize();
      b_.add(op_, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count());
    }
    ProfilingBackend& b_;
    const char* op_;
    std::chrono::steady_clock::time_point t0_;
  };

 private:
  Backend& inner_;
  std::map<std::string, OpTime> times_;
};

}  // namespace mt
