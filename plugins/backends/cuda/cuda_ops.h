// The CUDA backend's op set as mt::Backend methods that forward to the launchers of kernels.h,
// gemm.h and flash.h over a Ctx that the subclass sets up (stream, GEMM state, scratch memory):
// CudaBackend (cuda_backend.cpp) adds device memory; the emulated backend of
// tests/support/emulated_cuda.cpp adds host memory and runs the same launchers on the CPU.
#pragma once

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

  void fill(Tensor& x, float value) override { cuda::fill(ctx_, x, value); }
  void cast(const Tensor& src, Tensor& dst) override { cuda::cast(ctx_, src, dst); }
  void add(const Tensor& a, const Tensor& b, Tensor& out) override { cuda::add(ctx_, a, b, out); }
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override { cuda::mul(ctx_, a, b, out); }
  void scale(const Tensor& x, float s, Tensor& out) override { cuda::scale(ctx_, x, s, out); }
  void axpy(float alpha, const Tensor& x, Tensor& y) override { cuda::axpy(ctx_, alpha, x, y); }
  double sum(const Tensor& x) override { return cuda::sum(ctx_, x, false); }
  double sum_squares(const Tensor& x) override { return cuda::sum(ctx_, x, true); }
  void sum_squares_each(const std::vector<const Tensor*>& xs, std::vector<double>& s) override {
    cuda::sums(ctx_, xs, true, s);
  }
  void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                    bool accumulate) override {
    cuda::copy_columns(ctx_, src, src_col, dst, dst_col, width, accumulate);
  }
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
              float beta) override {
    cuda::matmul(ctx_, a, b, c, trans_a, trans_b, alpha, beta);
  }
  void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) override {
    cuda::embedding_forward(ctx_, table, ids, out);
  }
  void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    cuda::embedding_backward(ctx_, dout, ids, dtable);
  }
  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out,
                       Tensor& rstd) override {
    cuda::rmsnorm_forward(ctx_, x, w, eps, plus_one, out, rstd);
  }
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        bool plus_one, Tensor& dx, Tensor& dw) override {
    cuda::rmsnorm_backward(ctx_, dout, x, w, rstd, plus_one, dx, dw);
  }
  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out,
                         Tensor& mean, Tensor& rstd) override {
    cuda::layernorm_forward(ctx_, x, w, b, eps, out, mean, rstd);
  }
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) override {
    cuda::layernorm_backward(ctx_, dout, x, w, mean, rstd, dx, dw, db);
  }
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                    Tensor& out) override {
    cuda::rope_forward(ctx_, x, positions, spec, out);
  }
  void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                     Tensor& dx) override {
    cuda::rope_backward(ctx_, dout, positions, spec, dx);
  }
  void activation_forward(Activation act, const Tensor& x, Tensor& out) override {
    cuda::activation_forward(ctx_, act, x, out);
  }
  void activation_backward(Activation act, const Tensor& dout, const Tensor& x,
                           Tensor& dx) override {
    cuda::activation_backward(ctx_, act, dout, x, dx);
  }
  void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) override {
    cuda::gated_forward(ctx_, act, gate, up, out);
  }
  void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up,
                      Tensor& dgate, Tensor& dup) override {
    cuda::gated_backward(ctx_, act, dout, gate, up, dgate, dup);
  }
  void softcap_forward(const Tensor& x, float cap, Tensor& out) override {
    cuda::softcap_forward(ctx_, x, cap, out);
  }
  void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) override {
    cuda::softcap_backward(ctx_, dout, out, cap, dx);
  }
  void softmax_forward(const Tensor& x, Tensor& out) override {
    cuda::softmax_forward(ctx_, x, out);
  }
  void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) override {
    cuda::softmax_backward(ctx_, dout, out, dx);
  }
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss,
                             Tensor& loss, Tensor& lse) override {
    cuda::cross_entropy_forward(ctx_, logits, targets, z_loss, loss, lse);
  }
  void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                              const Tensor& lse, float z_loss, Tensor& dlogits) override {
    cuda::cross_entropy_backward(ctx_, dloss, logits, targets, lse, z_loss, dlogits);
  }
  void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize,
                          Tensor& weights, Tensor& indices, Tensor& probs) override {
    cuda::topk_route_forward(ctx_, logits, k, sigmoid, normalize, weights, indices, probs);
  }
  void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices,
                           const Tensor& probs, bool sigmoid, bool normalize,
                           Tensor& dlogits) override {
    cuda::topk_route_backward(ctx_, dweights, weights, indices, probs, sigmoid, normalize, dlogits);
  }
  void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) override {
    cuda::gather_rows(ctx_, x, idx, out);
  }
  void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                        Tensor& out) override {
    cuda::scatter_add_rows(ctx_, src, idx, w, out);
  }
  void scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) override {
    cuda::scatter_rows(ctx_, src, idx, out);
  }
  void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                      Tensor& out) override {
    cuda::grouped_matmul(ctx_, x, w, offsets, trans_w, out);
  }
  void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                  bool trans_w, Tensor& dw) override {
    cuda::grouped_matmul_weight_grad(ctx_, x, dout, offsets, trans_w, dw);
  }
  void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                    const AdamWParams& p) override {
    cuda::adamw_update(ctx_, param, grad, m, v, p);
  }

 protected:
  // The Ctx both backends built on these ops start from: their stream, temporaries from their
  // own empty(), the rope tables and the input-check slots. Called from the subclass's
  // constructor (empty() is then the subclass's).
  void init_ctx(cudaStream_t stream) {
    if (const char* e = std::getenv("MT_CUDA_FLASH_DKV_PARTS"); e && *e) {
      const std::string v = e;
      MT_CHECK(v == "1" || v == "2",
               "MT_CUDA_FLASH_DKV_PARTS=" + v +
                   ": flash attention's dk/dv kernel takes each streamed query tile in 1 or 2 "
                   "slices; set 1 or 2, or unset it for the default (1 at head_dim 64, 2 at 128)");
      ctx_.flash_dkv_parts = v == "1" ? 1 : 2;
    }
    ctx_.stream = stream;
    ctx_.scratch = [this](const Shape& s, DType d) { return empty(s, d); };
    ctx_.rope = std::make_shared<RopeTables>();
    ctx_.checks = std::make_shared<DeviceChecks>(
        empty({static_cast<int64_t>(DeviceChecks::kSlots * 8)}, DType::u8), stream);
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&ctx_.sm_major, cudaDevAttrComputeCapabilityMajor, dev) !=
            cudaSuccess)
      ctx_.sm_major = 0;  // unknown: the SIMT kernels, which run anywhere
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
