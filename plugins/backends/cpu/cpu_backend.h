// The CPU backend: host memory from a caching allocator, kernels on oneTBB, GEMMs on OpenBLAS.
#pragma once

#include <oneapi/tbb/task_arena.h>

#include <memory>
#include <string>

#include "allocator.h"
#include "mt/attention.h"
#include "mt/backend.h"

namespace mt::cpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads);
  ~CpuBackend() override;

  int num_threads() const { return num_threads_; }
  // Runs f on this backend's threads (kernels called outside the arena would use all cores).
  template <class F>
  void run(F&& f) {
    arena_.execute(std::forward<F>(f));
  }

  std::string name() const override { return "cpu"; }
  std::string describe() const override;
  double peak_flops(DType dtype) const override;

  Tensor empty(const Shape& shape, DType dtype) override;
  void release(void* data, size_t bytes) override;
  void copy_from_host(Tensor& dst, const void* src) override;
  void copy_to_host(const Tensor& src, void* dst) override;
  MemoryStats memory_stats() const override;
  void reset_peak_memory() override;

  void fill(Tensor& x, float value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale(const Tensor& x, float s, Tensor& out) override;
  void axpy(float alpha, const Tensor& x, Tensor& y) override;
  double sum(const Tensor& x) override;
  double sum_squares(const Tensor& x) override;
  void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                    bool accumulate) override;
  void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
              float beta) override;
  void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) override;
  void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) override;
  void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out,
                       Tensor& rstd) override;
  void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                        bool plus_one, Tensor& dx, Tensor& dw) override;
  void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out,
                         Tensor& mean, Tensor& rstd) override;
  void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean,
                          const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) override;
  void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                    Tensor& out) override;
  void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                     Tensor& dx) override;
  void activation_forward(Activation act, const Tensor& x, Tensor& out) override;
  void activation_backward(Activation act, const Tensor& dout, const Tensor& x,
                           Tensor& dx) override;
  void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) override;
  void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up,
                      Tensor& dgate, Tensor& dup) override;
  void softcap_forward(const Tensor& x, float cap, Tensor& out) override;
  void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) override;
  void softmax_forward(const Tensor& x, Tensor& out) override;
  void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) override;
  void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss,
                             Tensor& loss, Tensor& lse) override;
  void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                              const Tensor& lse, float z_loss, Tensor& dlogits) override;
  void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize,
                          Tensor& weights, Tensor& indices, Tensor& probs) override;
  void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices,
                           const Tensor& probs, bool sigmoid, bool normalize,
                           Tensor& dlogits) override;
  void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) override;
  void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                        Tensor& out) override;
  void scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) override;
  void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                      Tensor& out) override;
  void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                  bool trans_w, Tensor& dw) override;
  void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                    const AdamWParams& p) override;

 private:
  int num_threads_;
  tbb::task_arena arena_;
  CachingAllocator alloc_;
};

// attention/*.cpp
std::unique_ptr<AttentionKernel> make_dot_product_attention(Backend& b);
std::unique_ptr<AttentionKernel> make_flash_attention(Backend& b);

}  // namespace mt::cpu
