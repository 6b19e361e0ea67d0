// The CUDA backend plugin: probes for a driver and a device before registering (and declines
// with a sentence where there is none), owns one stream, the cuBLASLt GEMM state and a caching
// device allocator, and forwards each op to its launcher (kernels.h). Ops without a CUDA kernel
// yet throw, naming themselves.
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "allocator.h"
#include "cuda_ops.h"
#include "gemm.h"
#include "host_copy.h"
#include "kernels.h"

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/capture.h"
#include "mt/config.h"
#include "mt/env.h"
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

// One recorded sequence of the backend's work: a CUDA graph, replayed on the backend's stream,
// with the memory pool it was recorded on and the device-check slots of its launches.
class CudaWork final : public mt::CapturedWork {
 public:
  CudaWork(cudaGraphExec_t exec, cudaStream_t stream,
           std::shared_ptr<mt::cuda::DeviceAllocator::Pool> pool,
           std::shared_ptr<mt::cuda::DeviceChecks::Recorded> recorded,
           std::shared_ptr<mt::cuda::DeviceChecks> checks)
      : pool_(std::move(pool)),
        recorded_(std::move(recorded)),
        checks_(std::move(checks)),
        exec_(exec),
        stream_(stream) {}
  ~CudaWork() override { static_cast<void>(cudaGraphExecDestroy(exec_)); }
  CudaWork(const CudaWork&) = delete;
  CudaWork& operator=(const CudaWork&) = delete;
  void replay() override {
    const cudaError_t e = cudaGraphLaunch(exec_, stream_);
    if (e != cudaSuccess) {
      static_cast<void>(cudaGetLastError());
      throw mt::Error("cuda: replaying recorded work (cudaGraphLaunch) failed: " + cuda_message(e));
    }
    checks_->replayed(recorded_);
  }

 private:
  // The pool goes after the graph (members are destroyed in reverse order).
  std::shared_ptr<mt::cuda::DeviceAllocator::Pool> pool_;
  std::shared_ptr<mt::cuda::DeviceChecks::Recorded> recorded_;
  std::shared_ptr<mt::cuda::DeviceChecks> checks_;
  cudaGraphExec_t exec_;
  cudaStream_t stream_;
};

class CudaBackend final : public mt::cuda::CudaOps {
 public:
  CudaBackend(int device, mt::cuda::MatmulPrecision precision) : device_(device) {
    check(cudaSetDevice(device_), "cannot use device " + std::to_string(device_));
    cudaDeviceProp p{};
    check(cudaGetDeviceProperties(&p, device_), "cudaGetDeviceProperties");
    name_ = p.name;
    // What this process can hold: the device's free memory before anything of ours is on it
    // (the CUDA context and other processes already took their share of the total).
    size_t free_bytes = 0, total_bytes = 0;
    check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
    bytes_limit_ = free_bytes;
    // One non-blocking stream per backend: every kernel, copy and GEMM is ordered on it, which is
    // also what makes the allocator's immediate reuse of freed blocks safe.
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    try {
      copier_ = std::make_unique<mt::cuda::HostCopier>(stream_);
      init_ctx(stream_);
      // The GEMM workspace comes from the caching allocator once, for the backend's life.
      ctx_.gemm = std::make_shared<mt::cuda::Gemm>(
          stream_, precision,
          empty({static_cast<int64_t>(mt::cuda::Gemm::kWorkspaceBytes)}, mt::DType::u8));
    } catch (...) {
      // No destructor runs for a constructor that throws: give back what was made here, the
      // tensors in ctx_ while the allocator they return to still exists.
      teardown();
      throw;
    }
  }
  ~CudaBackend() override { teardown(); }
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
    const size_t bytes = mt::shape_bytes(shape, dtype);  // checked: throws on overflow
    return mt::Tensor(std::make_shared<mt::Storage>(alloc_.allocate(bytes), bytes, this), shape,
                      dtype);
  }
  void release(void* data, size_t bytes) override { alloc_.release(data, bytes); }
  void copy_from_host(mt::Tensor& dst, const void* src) override {
    not_recording("copy_from_host " + dst.str());
    // Returns once `src` is read (staged in pinned memory); the transfer is ordered on the
    // stream before every later kernel.
    copier_->to_device(dst.data(), src, dst.nbytes(), "copy_from_host " + dst.str());
  }
  // Both wait for the stream, then report what the kernels' input checks found.
  void copy_to_host(const mt::Tensor& src, void* dst) override {
    not_recording("copy_to_host " + src.str());
    copier_->to_host(dst, src.data(), src.nbytes(), "copy_to_host " + src.str());
    report_checks();
  }
  void synchronize() override {
    not_recording("synchronize");
    check(cudaStreamSynchronize(stream_), "synchronize");
    report_checks();
  }
  // mt::kWorkCapture: CUDA graphs of the backend's stream (mt/capture.h). MT_CUDA_GRAPHS=0
  // answers null, so callers run every op as it comes (to compare).
  // (and CudaOps' answers)
  void* extension(const char* name) override {
    if (void* e = CudaOps::extension(name)) return e;
    if (std::string(name) != mt::kWorkCapture) return nullptr;
    if (!env_switch("MT_CUDA_GRAPHS", true,
                    "decode steps run op by op (0) or are captured and replayed as CUDA graphs "
                    "(1)"))
      return nullptr;
    return static_cast<mt::WorkCapture*>(&capture_);
  }
  mt::MemoryStats memory_stats() const override {
    mt::MemoryStats s = alloc_.stats();
    s.bytes_limit = bytes_limit_;
    return s;
  }
  void reset_peak_memory() override { alloc_.reset_peak(); }
  void release_cached_memory() override { alloc_.release_cached(); }

 private:
  // The stream's work recorded as a CUDA graph (relaxed mode: the allocator may call cudaMalloc
  // while recording; anything that waits for the stream fails the recording, and the host
  // copies are refused before they could record a staging buffer's contents as a constant).
  class Capture final : public mt::WorkCapture {
   public:
    explicit Capture(CudaBackend& b) : b_(b) {}
    void begin() override {
      MT_CHECK(!b_.recording_, "cuda: a recording is already under way");
      b_.synchronize();  // earlier work's input checks reported before the slots change
      b_.ctx_.checks->begin_recording(
          b_.empty({static_cast<int64_t>(mt::cuda::DeviceChecks::kSlots * 8)}, mt::DType::u8));
      b_.alloc_.begin_pool();
      const cudaError_t e = cudaStreamBeginCapture(b_.stream_, cudaStreamCaptureModeRelaxed);
      if (e != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        static_cast<void>(b_.alloc_.end_pool());
        static_cast<void>(b_.ctx_.checks->end_recording());
        throw mt::Error("cuda: cannot record work (cudaStreamBeginCapture): " + cuda_message(e));
      }
      b_.recording_ = true;
    }
    std::unique_ptr<mt::CapturedWork> end() override {
      MT_CHECK(b_.recording_, "cuda: no recording is under way");
      b_.recording_ = false;
      cudaGraph_t g = nullptr;
      cudaError_t e = cudaStreamEndCapture(b_.stream_, &g);
      auto pool = b_.alloc_.end_pool();
      auto recorded = b_.ctx_.checks->end_recording();
      if (e != cudaSuccess || !g) {
        static_cast<void>(cudaGetLastError());
        if (g) static_cast<void>(cudaGraphDestroy(g));
        throw mt::Error("cuda: recording the work as a CUDA graph failed (cudaStreamEndCapture): " +
                        cuda_message(e));
      }
      cudaGraphExec_t exec = nullptr;
      e = cudaGraphInstantiate(&exec, g, 0);
      static_cast<void>(cudaGraphDestroy(g));
      if (e != cudaSuccess) {
        static_cast<void>(cudaGetLastError());
        throw mt::Error("cuda: instantiating the recorded CUDA graph failed: " + cuda_message(e));
      }
      return std::make_unique<CudaWork>(exec, b_.stream_, std::move(pool), std::move(recorded),
                                        b_.ctx_.checks);
    }
    void abandon() noexcept override {
      if (!b_.recording_) return;
      b_.recording_ = false;
      cudaGraph_t g = nullptr;
      static_cast<void>(cudaStreamEndCapture(b_.stream_, &g));
      if (g) static_cast<void>(cudaGraphDestroy(g));
      static_cast<void>(cudaGetLastError());
      static_cast<void>(b_.alloc_.end_pool());
      static_cast<void>(b_.ctx_.checks->end_recording());
    }

   private:
    CudaBackend& b_;
  };

  void not_recording(const std::string& what) const {
    if (recording_)
      throw mt::Error("cuda: " + what +
                      " cannot be recorded into a CUDA graph (it waits for the device or reads "
                      "host memory once); the caller runs this work without recording");
  }
  void teardown() {
    // Errors cannot be reported from here; the process is usually ending.
    capture_.abandon();
    if (stream_) static_cast<void>(cudaStreamSynchronize(stream_));
    ctx_ = {};        // the GEMM workspace and plans, before the allocator and the stream go
    copier_.reset();  // its events were recorded on the stream
    if (stream_) static_cast<void>(cudaStreamDestroy(stream_));
    stream_ = nullptr;
  }
  static void check(cudaError_t e, const std::string& what) {
    if (e != cudaSuccess) throw mt::Error("cuda: " + what + " failed: " + cuda_message(e));
  }
  int device_;
  std::string name_;
  size_t bytes_limit_ = 0;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<mt::cuda::HostCopier> copier_;  // pinned staging for host <-> device copies
  // ctx_ (in CudaOps) outlives these members: the destructor empties it first, so the GEMM
  // workspace goes back to the allocator while the allocator still exists.
  mt::cuda::DeviceAllocator alloc_;
  Capture capture_{*this};
  bool recording_ = false;
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

void add_attention(mt::Registry& r, const std::string& name,
                   const mt::cuda::AttentionLaunchers& l) {
  r.add_attention("cuda", name, [name, l](mt::Backend& b) -> std::unique_ptr<mt::AttentionKernel> {
    auto* cuda = dynamic_cast<CudaBackend*>(&b);
    if (!cuda)
      throw mt::Error("cuda " + name + " attention needs the cuda backend, got " + b.name());
    return std::make_unique<mt::cuda::CudaAttention>(name, l, *cuda);
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
    // One GPU per process: under mpirun or srun, the launcher's local rank modulo the GPUs
    // visible (as the nccl communicator chooses), so the ranks of a node use different GPUs.
    int device = mt::env_local_rank(), devices = 0;
    if (cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0) device %= devices;
    return std::make_unique<CudaBackend>(device, p == "highest" ? mt::cuda::MatmulPrecision::highest
                                                                : mt::cuda::MatmulPrecision::tf32);
  });
  add_attention(r, "dot_product", mt::cuda::kDotProduct);
  add_attention(r, "flash", mt::cuda::kFlash);
}

}  // namespace

MT_PLUGIN(mt::PluginKind::backend, "cuda", "0.1.0", register_cuda, probe)
