// The CUDA backend plugin. This first version is the plugin boundary only: it links the CUDA
// runtime and driver, probes for a device before registering, and reports clearly why it cannot
// run. Its kernels arrive with the CUDA issue; until then every op says so.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <string>

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

[[noreturn]] void unsupported(const char* op) {
  throw mt::Error(std::string("cuda: the op '") + op +
                  "' is not implemented yet in the CUDA backend; use backend=cpu.");
}

class CudaBackend final : public mt::Backend {
 public:
  explicit CudaBackend(int device) : device_(device) {
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess)
      throw mt::Error("cuda: cannot use device " + std::to_string(device_) + ": " + cuda_message(e));
    cudaDeviceProp p{};
    cudaGetDeviceProperties(&p, device_);
    name_ = p.name;
  }
  std::string name() const override { return "cuda"; }
  std::string describe() const override {
    return "cuda: device " + std::to_string(device_) + " (" + name_ + "); kernels not implemented yet";
  }
  double peak_flops(mt::DType) const override { return 0.0; }
  mt::Tensor empty(const mt::Shape& shape, mt::DType dtype) override {
    const size_t bytes = static_cast<size_t>(mt::shape_numel(shape)) * mt::dtype_size(dtype);
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess)
      throw mt::Error("cuda: allocating " + std::to_string(bytes) + " bytes for " +
                      mt::shape_str(shape) + " failed: " + cuda_message(e));
    return mt::Tensor(std::make_shared<mt::Storage>(p, bytes, this), shape, dtype);
  }
  void release(void* data, size_t) override { cudaFree(data); }
  void copy_from_host(mt::Tensor& dst, const void* src) override {
    check(cudaMemcpy(dst.data(), src, dst.nbytes(), cudaMemcpyHostToDevice), "copy_from_host");
  }
  void copy_to_host(const mt::Tensor& src, void* dst) override {
    check(cudaMemcpy(dst, src.data(), src.nbytes(), cudaMemcpyDeviceToHost), "copy_to_host");
  }
  void synchronize() override { check(cudaDeviceSynchronize(), "synchronize"); }
  mt::MemoryStats memory_stats() const override { return {}; }
  void reset_peak_memory() override {}

  void fill(Tensor& x, float value) override {
    unsupported("fill");
  }
  void cast(const Tensor& src, Tensor& dst) override {
    unsupported("cast");
  }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override {
    unsupported("add");
  }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override {
    unsupported("mul");
  }
  void scale(const Tensor& x, float s, Tensor& out) override {
    unsupported("scale");
  }
  void axpy(float alpha, const Tensor& x, Tensor& y) override {
    unsupported("axpy");
  }
  double sum(const Tensor& x) override {
    unsupported("sum");
  }
  double sum_squares(const Tensor& x) override {
    unsupported("sum_squares");
  }
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) override {
    unsupported("matmul");
  }
  void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) override {
    unsupported("embedding_forward");
  }
  void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    unsupported("embedding_backward");
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out, Tensor& rstd) override {
    unsupported("rmsnorm_forward");
  }
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) override {
    unsupported("rmsnorm_backward");
  }
  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out, Tensor& mean, Tensor& rstd) override {
    unsupported("layernorm_forward");
  }
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) override {
    unsupported("layernorm_backward");
  }
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec, Tensor& out) override {
    unsupported("rope_forward");
  }
  void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec, Tensor& dx) override {
    unsupported("rope_backward");
  }
  void activation_forward(Activation act, const Tensor& x, Tensor& out) override {
    unsupported("activation_forward");
  }
  void activation_backward(Activation act, const Tensor& dout, const Tensor& x, Tensor& dx) override {
    unsupported("activation_backward");
  }
  void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) override {
    unsupported("gated_forward");
  }
  void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup) override {
    unsupported("gated_backward");
  }
  void softcap_forward(const Tensor& x, float cap, Tensor& out) override {
    unsupported("softcap_forward");
  }
  void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) override {
    unsupported("softcap_backward");
  }
  void softmax_forward(const Tensor& x, Tensor& out) override {
    unsupported("softmax_forward");
  }
  void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) override {
    unsupported("softmax_backward");
  }
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss, Tensor& loss, Tensor& lse) override {
    unsupported("cross_entropy_forward");
  }
  void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets, const Tensor& lse, float z_loss, Tensor& dlogits) override {
    unsupported("cross_entropy_backward");
  }
  void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize, Tensor& weights, Tensor& indices, Tensor& probs) override {
    unsupported("topk_route_forward");
  }
  void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices, const Tensor& probs, bool sigmoid, bool normalize, Tensor& dlogits) override {
    unsupported("topk_route_backward");
  }
  void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) override {
    unsupported("gather_rows");
  }
  void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, Tensor& out) override {
    unsupported("scatter_add_rows");
  }
  void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w, Tensor& out) override {
    unsupported("grouped_matmul");
  }
  void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets, bool trans_w, Tensor& dw) override {
    unsupported("grouped_matmul_weight_grad");
  }
  void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) override {
    unsupported("adamw_update");
  }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw mt::Error(std::string("cuda: ") + what + " failed: " + cuda_message(e));
  }
  int device_;
  std::string name_;
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

void register_cuda(mt::Registry& r) {
  r.add_backend("cuda", [](const mt::Config&) -> std::unique_ptr<mt::Backend> {
    return std::make_unique<CudaBackend>(0);
  });
}

}  // namespace

MT_PLUGIN(mt::PluginKind::backend, "cuda", "0.1.0", register_cuda, probe)
