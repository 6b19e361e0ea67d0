// MetaBackend: a backend that computes nothing and allocates nothing, but counts every byte the
// real one would hold. `mt plan` (and the check before `mt run` / `mt decode`) runs the model's
// real code on it: the core's step, the family's layers, the graph's saved activations and
// remat, so the predicted peak is the one the caching allocators would reach, not a formula
// that drifts from the code (MaxText's ahead-of-time compile plays this part for XLA).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"

namespace mt {

// A device the plan is made for: its memory and peak FLOP/s (0 = unknown).
struct DeviceProfile {
  std::string name;      // "h100-80gb", "cpu-24gb", or the backend's own description
  size_t bytes = 0;      // what one process can hold on it
  double peak_bf16 = 0;  // dense FLOP/s of bf16 matmuls
  double peak_f32 = 0;   // of f32 matmuls
  // How allocations are rounded: mt's caching allocators keep size classes (multiples of
  // `small_granule` up to `small_limit`, then four classes per power of two up to 64 MiB, then
  // multiples of 2 MiB).
  size_t small_granule = 64, small_limit = 4096;
  // The backend computes in f32 working copies of bf16 operands for the length of a call (the
  // CPU's GEMM and attention kernels).
  bool f32_working_copies = false;
  bool is_host = false;  // the device's memory is the host's (the CPU backend)
  // The CPU backend's threads: its flash attention takes a scratch block per thread for each
  // call (0: none, a device's kernels keep theirs in shared memory).
  int host_threads = 0;
  // Bandwidth of one device's links, bytes/s per direction, for the plan's collectives: to the
  // devices of its node (NVLink; the `ici_` axes) and across nodes (the network; `dcn_`). 0: not
  // known (the CPU).
  double ici_bytes_per_s = 0, dcn_bytes_per_s = 0;
};

// plan_device's named devices (h100-80gb, h200, a100-40gb, a100-80gb) and cpu-<N>gb; nullopt
// for a name it does not know. `tf32`: f32 matmuls on TF32 tensor cores (matmul_precision
// high/default), for the GPUs' f32 peak.
std::optional<DeviceProfile> named_device(const std::string& name, bool tf32);
// "h100-80gb, h200, a100-40gb, a100-80gb, cpu-<N>gb"
std::string named_devices();

// The size an allocator of `p`'s rounding reserves for a request of `bytes`.
size_t planned_block_size(const DeviceProfile& p, size_t bytes);

// Every op of mt/ops.def, doing nothing (and returning 0). Composed ops are overridden too, so
// no composition's temporaries are counted: the plan assumes the backend's own kernels.
class MetaOps : public Backend {
 public:
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
#define MT_OP(kind, ret, name, params, args) \
  ret name params override {                 \
    return ret();                            \
  }
#include "mt/ops.def"
#undef MT_OP
#pragma GCC diagnostic pop
  bool supports(Op) const override {
    return true;
  }
};

class MetaBackend final : public MetaOps {
 public:
  explicit MetaBackend(DeviceProfile device) : device_(std::move(device)) {}

  const DeviceProfile& device() const { return device_; }

  std::string name() const override { return "meta"; }
  std::string describe() const override { return "meta (plan for " + device_.name + ")"; }
  double peak_flops(DType d) const override {
    return d == DType::bf16 ? device_.peak_bf16 : device_.peak_f32;
  }
  // A tensor with no memory behind it (a fixed, never-dereferenced address): only its size is
  // counted.
  Tensor empty(const Shape& shape, DType dtype) override;
  void release(void* data, size_t bytes) override;
  void copy_from_host(Tensor&, const void*) override {}
  // Zeros: code that reads values back (a loss, a routing decision) sees a valid, if
  // degenerate, input.
  void copy_to_host(const Tensor& src, void* dst) override;
  MemoryStats memory_stats() const override;
  void reset_peak_memory() override { stats_.peak_bytes_in_use = stats_.bytes_in_use; }

  // With DeviceProfile::f32_working_copies, the f32 scratch the CPU's GEMM holds during a call
  // with bf16 operands; matmul_q8 also the temporaries of the GPU's int8 products.
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b,
              float alpha = 1.f, float beta = 0.f) override;
  void matmul_q8(const Tensor& x, const Tensor& w, Tensor& y) override;
  // As each backend's: one matmul_q8 per expert, except the CPU's decode (every expert at most 8
  // rows), which widens all of x and makes all of y in f32 for the one call.
  void grouped_matmul_q8(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts,
                         Tensor& y) override;

 private:
  DeviceProfile device_;
  MemoryStats stats_;
};

// An attention kernel that computes nothing: its outputs are allocated by the graph as usual.
// With `f32_copies` (the CPU backend's kernels, which compute in f32) it also holds, for the
// length of each call, the f32 working copies of its bf16 operands those kernels make: in
// decode, the whole KV cache once per step.
class MetaAttention final : public AttentionKernel {
 public:
  MetaAttention(std::string name, Backend& backend, bool f32_copies, int host_threads = 0)
      : name_(std::move(name)),
        be_(backend),
        f32_copies_(f32_copies),
        host_threads_(host_threads) {}
  std::string name() const override { return name_; }
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&, const Tensor&,
               const AttentionSpec&, Tensor& out, Tensor&) override;
  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor&, const Tensor&, const Tensor& out, const Tensor& lse,
                const AttentionSpec&, Tensor& dq, Tensor& dk, Tensor& dv) override;
  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor&,
              const AttentionSpec&, Tensor& out) override;

 private:
  // f32 copies of the non-f32 tensors, alive until the result is dropped.
  std::vector<Tensor> copies(std::initializer_list<const Tensor*> ts);
  // The CPU flash kernels' scratch: `floats` per thread, for the call (undefined elsewhere).
  Tensor thread_scratch(int64_t floats);

  std::string name_;
  Backend& be_;
  bool f32_copies_;
  int host_threads_;
};

}  // namespace mt
