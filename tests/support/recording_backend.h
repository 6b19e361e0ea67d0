// RecordingBackend: a backend that records its work as the CUDA backend's CUDA graphs do
// (mt/capture.h), on any other backend: between begin() and end() each op is kept, not run, and
// a replay runs the kept ops again in order on the same tensors. What cannot be recorded is
// refused as the CUDA backend refuses it (host copies, synchronisation, ops whose result comes
// back to the host). Tests run the decoder's recorded steps on the CPU with it, so the
// decoder's use of a recording (inputs refilled in place, outputs read after the replay) is
// checked where there is no GPU.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/capture.h"
#include "mt/error.h"

namespace mt::test {

class RecordingBackend final : public Backend, public WorkCapture {
 public:
  explicit RecordingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

  Backend& inner() { return *inner_; }
  int64_t recordings = 0, replays = 0;  // counted for the tests
  size_t recorded_ops = 0;              // in the last recording

  std::string name() const override { return inner_->name(); }
  std::string describe() const override { return inner_->describe() + ", recording"; }
  double peak_flops(DType d) const override { return inner_->peak_flops(d); }
  Tensor empty(const Shape& s, DType d) override { return inner_->empty(s, d); }
  void release(void* p, size_t n) override { inner_->release(p, n); }
  void copy_from_host(Tensor& dst, const void* src) override {
    refuse("copy_from_host");
    inner_->copy_from_host(dst, src);
  }
  void copy_to_host(const Tensor& src, void* dst) override {
    refuse("copy_to_host");
    inner_->copy_to_host(src, dst);
  }
  void synchronize() override {
    refuse("synchronize");
    inner_->synchronize();
  }
  MemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void reset_peak_memory() override { inner_->reset_peak_memory(); }
  void release_cached_memory() override { inner_->release_cached_memory(); }
  bool supports(Op op) const override { return inner_->supports(op); }
  void* extension(const char* n) override {
    if (std::string(n) == kWorkCapture) return static_cast<WorkCapture*>(this);
    return inner_->extension(n);
  }

#define MT_OP(kind, ret, name, params, args)                               \
  ret name params override {                                               \
    if (!recording_) return inner_->name args;                             \
    if (std::string(#name) == "sum_squares_each") refuse(#name);           \
    return record<ret>(#name, [=, this]() mutable { inner_->name args; }); \
  }
#include "mt/ops.def"
#undef MT_OP

  // Runs f now, or keeps it when recording (the attention kernels' calls, below).
  void run_or_record(std::function<void()> f) {
    if (recording_)
      ops_.push_back(std::move(f));
    else
      f();
  }

  void begin() override {
    if (recording_) throw Error("recording backend: a recording is already under way");
    recording_ = true;
    ops_.clear();
  }
  std::unique_ptr<CapturedWork> end() override {
    if (!recording_) throw Error("recording backend: no recording is under way");
    recording_ = false;
    ++recordings;
    recorded_ops = ops_.size();
    return std::make_unique<Work>(*this, std::move(ops_));
  }
  void abandon() noexcept override {
    recording_ = false;
    ops_.clear();
  }

 private:
  class Work final : public CapturedWork {
   public:
    Work(RecordingBackend& b, std::vector<std::function<void()>> ops)
        : b_(b), ops_(std::move(ops)) {}
    void replay() override {
      ++b_.replays;
      for (auto& op : ops_) op();
    }

   private:
    RecordingBackend& b_;
    std::vector<std::function<void()>> ops_;
  };

  template <class R, class F>
  R record(const char* name, F f) {
    if constexpr (std::is_void_v<R>) {
      ops_.push_back(std::move(f));
    } else {
      refuse(name);
      return R{};
    }
  }
  void refuse(const std::string& what) const {
    if (recording_)
      throw Error("recording backend: " + what +
                  " cannot be recorded (it waits for the device or reads host memory)");
  }

  std::unique_ptr<Backend> inner_;
  bool recording_ = false;
  std::vector<std::function<void()>> ops_;
};

// An attention kernel whose calls go through a RecordingBackend's recording.
class RecordingAttention final : public AttentionKernel {
 public:
  RecordingAttention(std::unique_ptr<AttentionKernel> inner, RecordingBackend& b)
      : inner_(std::move(inner)), b_(b) {}
  std::string name() const override { return inner_->name(); }
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_segment,
               const Tensor& kv_segment, const AttentionSpec& spec, Tensor& out,
               Tensor& lse) override {
    b_.run_or_record(
        [=, this]() mutable { inner_->forward(q, k, v, q_segment, kv_segment, spec, out, lse); });
  }
  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                const Tensor& lse, const AttentionSpec& spec, Tensor& dq, Tensor& dk,
                Tensor& dv) override {
    b_.run_or_record([=, this]() mutable {
      inner_->backward(dout, q, k, v, q_segment, kv_segment, out, lse, spec, dq, dk, dv);
    });
  }
  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
              const AttentionSpec& spec, Tensor& out) override {
    b_.run_or_record(
        [=, this]() mutable { inner_->decode(q, k_cache, v_cache, lengths, spec, out); });
  }

 private:
  std::unique_ptr<AttentionKernel> inner_;
  RecordingBackend& b_;
};

}  // namespace mt::test
