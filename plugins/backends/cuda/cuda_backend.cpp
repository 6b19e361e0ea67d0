// The CUDA backend plugin: probes for a driver and a device before registering (and declines
// with a sentence where there is none), owns one stream, the cuBLASLt GEMM state and a caching
// device allocator, and forwards each op to its launcher in kernels.cu. Ops without a CUDA kernel
// yet throw, naming themselves.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <string>
#include <utility>

#include "allocator.h"
#include "flash.h"
#include "gemm.h"
#include "host_copy.h"
#include "kernels.h"

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/config.h"
#include "mt/error.h"
#include "mt/plugin.h"

namespace {

using mt::Activation;
using mt::AdamWParams;
using mt::RopeSpec;
using mt::Tensor;

std::string cuda_message(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

class CudaBackend final : public mt::Backend {
 public:
  CudaBackend(int device, mt::cuda::MatmulPrecision precision) : device_(device) {
    check(cudaSetDevice(device_), "cannot use device " + std::to_string(device_));
    cudaDeviceProp p{};
    check(cudaGetDeviceProperties(&p, device_), "cudaGetDeviceProperties");
    name_ = p.name;
    // One non-blocking stream per backend: every kernel, copy and GEMM is ordered on it, which is
    // also what makes the allocator's immediate reuse of freed blocks safe.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    copier_ = std::make_unique<mt::cuda::HostCopier>(stream_);
    ctx_.stream = stream_;
    ctx_.scratch = [this](const mt::Shape& s, mt::DType d) { return empty(s, d); };
    // The GEMM workspace comes from the caching allocator once, for the backend's life.
    ctx_.gemm = std::make_shared<mt::cuda::Gemm>(
        stream_, precision,
        empty({static_cast<int64_t>(mt::cuda::Gemm::kWorkspaceBytes)}, mt::DType::u8));
  }
  ~CudaBackend() override {
    // Errors cannot be reported from a destructor; the process is usually ending.
    static_cast<void>(cudaStreamSynchronize(stream_));
    copier_.reset();  // its events were recorded on the stream
    if (stream_) static_cast<void>(cudaStreamDestroy(stream_));
  }
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda"; }
  std::string describe() const override {
    return "cuda: device " + std::to_string(device_) + " (" + name_ +
           "); GEMM cuBLASLt (f32 accumulation; f32 matmuls " +
           (ctx_.gemm->precision() == mt::cuda::MatmulPrecision::tf32 ? "on TF32 tensor cores"
                                                                      : "in full f32") +
           "); attention dot_product, flash";
  }
  // Dense peaks from the data sheets of the GPUs this plugin is tuned for (H100/H200 SXM: bf16
  // 989 TFLOP/s; f32 matmuls 494 TFLOP/s on TF32 tensor cores with matmul_precision=high or
  // default, else 67 TFLOP/s on the FP32 units); 0 (MFU not reported) for any other device.
  double peak_flops(mt::DType dtype) const override {
    const bool hopper =
        name_.find("H100") != std::string::npos || name_.find("H200") != std::string::npos;
    if (!hopper) return 0.0;
    if (dtype == mt::DType::bf16) return 989e12;
    return ctx_.gemm->precision() == mt::cuda::MatmulPrecision::tf32 ? 494e12 : 67e12;
  }
  mt::Tensor empty(const mt::Shape& shape, mt::DType dtype) override {
    const size_t bytes = static_cast<size_t>(mt::shape_numel(shape)) * mt::dtype_size(dtype);
    return mt::Tensor(std::make_shared<mt::Storage>(alloc_.allocate(bytes), bytes, this), shape,
                      dtype);
  }
  void release(void* data, size_t bytes) override { alloc_.release(data, bytes); }
  void copy_from_host(mt::Tensor& dst, const void* src) override {
    // Returns once `src` is read (staged in pinned memory); the transfer is ordered on the
    // stream before every later kernel.
    copier_->to_device(dst.data(), src, dst.nbytes(), "copy_from_host " + dst.str());
  }
  void copy_to_host(const mt::Tensor& src, void* dst) override {
    copier_->to_host(dst, src.data(), src.nbytes(), "copy_to_host " + src.str());
  }
  void synchronize() override { check(cudaStreamSynchronize(stream_), "synchronize"); }
  mt::MemoryStats memory_stats() const override { return alloc_.stats(); }
  void reset_peak_memory() override { alloc_.reset_peak(); }

  void fill(Tensor& x, float value) override { mt::cuda::fill(ctx_, x, value); }
  void cast(const Tensor& src, Tensor& dst) override { mt::cuda::cast(ctx_, src, dst); }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    mt::cuda::add(ctx_, a, b, out);
  }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override {
    mt::cuda::mul(ctx_, a, b, out);
  }
  void scale(const Tensor& x, float s, Tensor& out) override { mt::cuda::scale(ctx_, x, s, out); }
  void axpy(float alpha, const Tensor& x, Tensor& y) override { mt::cuda::axpy(ctx_, alpha, x, y); }
  double sum(const Tensor& x) override { return mt::cuda::sum(ctx_, x, false); }
  double sum_squares(const Tensor& x) override { return mt::cuda::sum(ctx_, x, true); }
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
              float beta) override {
    mt::cuda::matmul(ctx_, a, b, c, trans_a, trans_b, alpha, beta);
  }
  void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) override {
    mt::cuda::embedding_forward(ctx_, table, ids, out);
  }
  void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    mt::cuda::embedding_backward(ctx_, dout, ids, dtable);
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out,
                       Tensor& rstd) override {
    mt::cuda::rmsnorm_forward(ctx_, x, w, eps, plus_one, out, rstd);
  }
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        bool plus_one, Tensor& dx, Tensor& dw) override {
    mt::cuda::rmsnorm_backward(ctx_, dout, x, w, rstd, plus_one, dx, dw);
  }
  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out,
                         Tensor& mean, Tensor& rstd) override {
    mt::cuda::layernorm_forward(ctx_, x, w, b, eps, out, mean, rstd);
  }
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) override {
    mt::cuda::layernorm_backward(ctx_, dout, x, w, mean, rstd, dx, dw, db);
  }
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                    Tensor& out) override {
    mt::cuda::rope_forward(ctx_, x, positions, spec, out);
  }
  void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                     Tensor& dx) override {
    mt::cuda::rope_backward(ctx_, dout, positions, spec, dx);
  }
  void activation_forward(Activation act, const Tensor& x, Tensor& out) override {
    mt::cuda::activation_forward(ctx_, act, x, out);
  }
  void activation_backward(Activation act, const Tensor& dout, const Tensor& x,
                           Tensor& dx) override {
    mt::cuda::activation_backward(ctx_, act, dout, x, dx);
  }
  void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) override {
    mt::cuda::gated_forward(ctx_, act, gate, up, out);
  }
  void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up,
                      Tensor& dgate, Tensor& dup) override {
    mt::cuda::gated_backward(ctx_, act, dout, gate, up, dgate, dup);
  }
  void softcap_forward(const Tensor& x, float cap, Tensor& out) override {
    mt::cuda::softcap_forward(ctx_, x, cap, out);
  }
  void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) override {
    mt::cuda::softcap_backward(ctx_, dout, out, cap, dx);
  }
  void softmax_forward(const Tensor& x, Tensor& out) override {
    mt::cuda::softmax_forward(ctx_, x, out);
  }
  void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) override {
    mt::cuda::softmax_backward(ctx_, dout, out, dx);
  }
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss,
                             Tensor& loss, Tensor& lse) override {
    mt::cuda::cross_entropy_forward(ctx_, logits, targets, z_loss, loss, lse);
  }
  void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                              const Tensor& lse, float z_loss, Tensor& dlogits) override {
    mt::cuda::cross_entropy_backward(ctx_, dloss, logits, targets, lse, z_loss, dlogits);
  }
  void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize,
                          Tensor& weights, Tensor& indices, Tensor& probs) override {
    mt::cuda::topk_route_forward(ctx_, logits, k, sigmoid, normalize, weights, indices, probs);
  }
  void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices,
                           const Tensor& probs, bool sigmoid, bool normalize,
                           Tensor& dlogits) override {
    mt::cuda::topk_route_backward(ctx_, dweights, weights, indices, probs, sigmoid, normalize,
                                  dlogits);
  }
  void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) override {
    mt::cuda::gather_rows(ctx_, x, idx, out);
  }
  void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                        Tensor& out) override {
    mt::cuda::scatter_add_rows(ctx_, src, idx, w, out);
  }
  void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                      Tensor& out) override {
    mt::cuda::grouped_matmul(ctx_, x, w, offsets, trans_w, out);
  }
  void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                  bool trans_w, Tensor& dw) override {
    mt::cuda::grouped_matmul_weight_grad(ctx_, x, dout, offsets, trans_w, dw);
  }
  void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                    const AdamWParams& p) override {
    mt::cuda::adamw_update(ctx_, param, grad, m, v, p);
  }

 private:
  static void check(cudaError_t e, const std::string& what) {
    if (e != cudaSuccess) throw mt::Error("cuda: " + what + " failed: " + cuda_message(e));
  }
  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<mt::cuda::HostCopier> copier_;  // pinned staging for host <-> device copies
  // Declared after the handles it does not use, before ctx_ which captures `this`.
  mt::cuda::DeviceAllocator alloc_;
  mt::cuda::Ctx ctx_;

 public:
  const mt::cuda::Ctx& ctx() const { return ctx_; }
};

// An attention kernel's three launchers: dot_product's (kernels.cu, the reference, scores
// materialised per query row) or flash's (flash.cu: tensor cores for bf16 with head_dim 64 or
// 128, one warp per row otherwise).
struct AttentionLaunchers {
  decltype(&mt::cuda::attention_forward) forward;
  decltype(&mt::cuda::attention_backward) backward;
  decltype(&mt::cuda::attention_decode) decode;
};
constexpr AttentionLaunchers kDotProduct{mt::cuda::attention_forward, mt::cuda::attention_backward,
                                         mt::cuda::attention_decode};
constexpr AttentionLaunchers kFlash{mt::cuda::flash_forward, mt::cuda::flash_backward,
                                    mt::cuda::flash_decode};

class CudaAttention final : public mt::AttentionKernel {
 public:
  CudaAttention(std::string name, const AttentionLaunchers& l, CudaBackend& b)
      : name_(std::move(name)), l_(l), backend_(b) {}
  std::string name() const override { return name_; }
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_segment,
               const Tensor& kv_segment, const mt::AttentionSpec& spec, Tensor& out,
               Tensor& lse) override {
    l_.forward(backend_.ctx(), q, k, v, q_segment, kv_segment, spec, out, lse);
  }
  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                const Tensor& lse, const mt::AttentionSpec& spec, Tensor& dq, Tensor& dk,
                Tensor& dv) override {
    l_.backward(backend_.ctx(), dout, q, k, v, q_segment, kv_segment, out, lse, spec, dq, dk, dv);
  }
  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
              const mt::AttentionSpec& spec, Tensor& out) override {
    l_.decode(backend_.ctx(), q, k_cache, v_cache, lengths, spec, out);
  }

 private:
  std::string name_;
  AttentionLaunchers l_;
  CudaBackend& backend_;
};

// Runs before registration: declines with a sentence on a machine without a driver or device.
const char* probe() {
  // The runtime reaches the driver through libcuda.so.1; name it when it is not there at all.
  if (!dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL))
    return "libcuda.so.1 (the NVIDIA driver library) was not found: no NVIDIA driver is "
           "installed on this machine; use backend=cpu";
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice || n == 0) {
    return e == cudaErrorInsufficientDriver
               ? "the NVIDIA driver is missing or older than this CUDA runtime needs "
                 "(cudaGetDeviceCount: cudaErrorInsufficientDriver)"
               : "no CUDA device is visible (cudaGetDeviceCount found none)";
  }
  if (e != cudaSuccess) return "the CUDA runtime could not start (cudaGetDeviceCount failed)";
  return nullptr;
}

void add_attention(mt::Registry& r, const std::string& name, const AttentionLaunchers& l) {
  r.add_attention("cuda", name, [name, l](mt::Backend& b) -> std::unique_ptr<mt::AttentionKernel> {
    auto* cuda = dynamic_cast<CudaBackend*>(&b);
    if (!cuda)
      throw mt::Error("cuda " + name + " attention needs the cuda backend, got " + b.name());
    return std::make_unique<CudaAttention>(name, l, *cuda);
  });
}

void register_cuda(mt::Registry& r) {
  r.add_backend("cuda", [](const mt::Config& cfg) -> std::unique_ptr<mt::Backend> {
    // matmul_precision (MaxText's key): highest = full f32 matmuls; high and default = TF32.
    // Absent from hand-made configs (tests): highest.
    const std::string p =
        cfg.has("matmul_precision") ? cfg.get_string("matmul_precision") : "highest";
    if (p != "highest" && p != "high" && p != "default")
      cfg.reject("matmul_precision", "is not one of the choices: default, high, highest.");
    return std::make_unique<CudaBackend>(
        0, p == "highest" ? mt::cuda::MatmulPrecision::highest : mt::cuda::MatmulPrecision::tf32);
  });
  add_attention(r, "dot_product", kDotProduct);
  add_attention(r, "flash", kFlash);
}

}  // namespace

MT_PLUGIN(mt::PluginKind::backend, "cuda", "0.1.0", register_cuda, probe)
