// The CUDA backend's op set as mt::Backend methods that forward to the launchers of kernels.h,
// gemm.h and flash.h over a Ctx that the subclass sets up (stream, GEMM state, scratch memory):
// CudaBackend (cuda_backend.cpp) adds device memory; the emulated backend of
// tests/support/emulated_cuda.cpp adds host memory and runs the same launchers on the CPU.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "flash.h"
#include "kernels.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/error.h"

namespace mt::cuda {

class CudaOps : public Backend {
 public:
  const Ctx& ctx() const { return ctx_; }

  // Every op of mt/ops.def, forwarded to the launcher of its name (kernels.h, gemm.h).
  bool supports(Op) const override { return true; }
  // "mt.matvec_rows_layout", "mt.matvec_rows_bf16dot": decode stores the projections as
  // [N, K] rows for up to 8 sequences (ModelRunner::rows_layout_pays), the layout of PyTorch's
  // nn.Linear, which lets each block's q/k/v and gate/up weights be one tensor
  // (ModelRunner::fuse_projections). Apart, cuBLASLt reads the rows 0-4% slower than [K, N] at
  // 1 and 8 rows (H200, llama-bench-1b bf16); fused, decode is 10-18% faster at 1 row and 0-6%
  // at 8.
  // MT_TRANSPOSE_PROJECTIONS=0 keeps [K, N] (to compare).
  void* extension(const char* name) override {
    const std::string n(name);
    return n == "mt.matvec_rows_layout" || n == "mt.matvec_rows_bf16dot" ? this : nullptr;
  }
#define MT_OP(kind, ret, name, params, args)    \
  ret name params override {                    \
    return cuda::name(ctx_, MT_CUDA_ARGS args); \
  }
#define MT_CUDA_ARGS(...) __VA_ARGS__
#include "mt/ops.def"
#undef MT_CUDA_ARGS
#undef MT_OP

 protected:
  // The Ctx both backends built on these ops start from: their stream, temporaries from their
  // own empty(), the rope tables and the input-check slots. Called from the subclass's
  // constructor (empty() is then the subclass's).
  void init_ctx(cudaStream_t stream) {
    // Kernel choices for measuring one against the other; each gives the same bits.
    ctx_.flash_dkv_parts = env_choice("MT_CUDA_FLASH_DKV_PARTS", "1", "2",
                                      "flash attention's dk/dv kernel takes each streamed query "
                                      "tile in 1 or 2 slices",
                                      "1 at head_dim 64, 2 at 128");
    ctx_.flash_warps = env_choice("MT_CUDA_FLASH_WARPS", "4", "8",
                                  "flash attention's tensor-core forward and dq kernels run 4 or "
                                  "8 warps a block (16 query rows each)",
                                  "4");
    ctx_.flash_dkv_warps = env_choice("MT_CUDA_FLASH_DKV_WARPS", "4", "8",
                                      "flash attention's tensor-core dk/dv kernel runs 4 or 8 "
                                      "warps a block (16 key rows each)",
                                      "4");
    ctx_.q8_dequant_always = !env_switch("MT_CUDA_Q8_GEMV", true,
                                         "matmul_q8 takes decode's up to 8 rows of x straight "
                                         "from the int8 rows (1) or dequantizes the weights for "
                                         "cuBLASLt (0)");
    ctx_.rows_gemv = env_switch("MT_CUDA_ROWS_GEMV", false,
                                "matmul takes decode's products of up to 8 rows against [N, K] "
                                "weight rows with cuBLASLt (0) or rows_gemv_kernel (1)");
    ctx_.joint_copies = env_switch("MT_CUDA_JOINT_COPIES", false,
                                   "a split's pieces and a step's k and v cache rows are "
                                   "written with one launch a tensor (0) or one for all (1)");
    ctx_.stream = stream;
    ctx_.self = this;
    ctx_.scratch = [this](const Shape& s, DType d) { return empty(s, d); };
    ctx_.rope = std::make_shared<RopeTables>();
    ctx_.checks = std::make_shared<DeviceChecks>(
        empty({static_cast<int64_t>(DeviceChecks::kSlots * 8)}, DType::u8), stream);
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&ctx_.sm_major, cudaDevAttrComputeCapabilityMajor, dev) !=
            cudaSuccess)
      ctx_.sm_major = 0;  // unknown: the SIMT kernels, which run anywhere
    int smem = 0;
    if (cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) == cudaSuccess)
      ctx_.smem_per_block = static_cast<size_t>(std::max(smem, 0));
    // (griddepcontrol, which MT_KERNEL_PROLOGUE uses, came with sm_90.)
    ctx_.pdl =
        env_switch("MT_CUDA_PDL", false,
                   "kernels launch one after another (0) or with programmatic dependent "
                   "launch, each kernel's blocks starting while the one before finishes (1)") &&
        ctx_.sm_major >= 9;
  }
  // The environment variable `name`: unset or empty gives 0 (the default, which `deflt` names
  // for the message), `a` or `b` their number, anything else an error saying what it chooses.
  static int env_choice(const char* name, const char* a, const char* b, const char* what,
                        const char* deflt) {
    const char* e = std::getenv(name);
    if (!e || !*e) return 0;
    const std::string v = e;
    MT_CHECK(v == a || v == b, std::string(name) + "=" + v + ": " + what + "; set " + a + " or " +
                                   b + ", or unset it for the default (" + deflt + ")");
    return std::stoi(v);
  }
  // A switch: `name` unset or empty gives deflt, 0 or 1 off or on, anything else an error.
  static bool env_switch(const char* name, bool deflt, const char* what) {
    const char* e = std::getenv(name);
    if (!e || !*e) return deflt;
    return env_choice(name, "0", "1", what, deflt ? "1" : "0") == 1;
  }
  // Throws the first bad input the kernels recorded since the last report (DeviceChecks); the
  // subclass calls it once its synchronize() or copy_to_host() has waited for the stream.
  void report_checks() { ctx_.checks->report(); }

  Ctx ctx_;
};

// An attention kernel's three launchers: dot_product's (attention.cu, the reference, scores
// materialised per query row) or flash's (flash.cu: tensor cores for bf16 with head_dim 64 or
// 128, one warp per row otherwise).
struct AttentionLaunchers {
  decltype(&attention_forward) forward;
  decltype(&attention_backward) backward;
  decltype(&attention_decode) decode;
};
inline constexpr AttentionLaunchers kDotProduct{attention_forward, attention_backward,
                                                attention_decode};
inline constexpr AttentionLaunchers kFlash{flash_forward, flash_backward, flash_decode};

class CudaAttention final : public AttentionKernel {
 public:
  CudaAttention(std::string name, const AttentionLaunchers& l, CudaOps& b)
      : name_(std::move(name)), l_(l), backend_(b) {}
  std::string name() const override { return name_; }
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_segment,
               const Tensor& kv_segment, const AttentionSpec& spec, Tensor& out,
               Tensor& lse) override {
    l_.forward(backend_.ctx(), q, k, v, q_segment, kv_segment, spec, out, lse);
  }
  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                const Tensor& lse, const AttentionSpec& spec, Tensor& dq, Tensor& dk,
                Tensor& dv) override {
    l_.backward(backend_.ctx(), dout, q, k, v, q_segment, kv_segment, out, lse, spec, dq, dk, dv);
  }
  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
              const AttentionSpec& spec, Tensor& out) override {
    l_.decode(backend_.ctx(), q, k_cache, v_cache, lengths, spec, out);
  }

 private:
  std::string name_;
  AttentionLaunchers l_;
  CudaOps& backend_;
};

}  // namespace mt::cuda
