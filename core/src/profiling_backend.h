// ProfilingBackend: wraps a backend and times every op (synchronising after each, so device
// backends are timed correctly). Used by `mt run profile=true` and the benchmarks to say where a
// step's time goes (GEMMs, attention, optimizer, the rest).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "mt/attention.h"
#include "mt/backend.h"

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
  void* extension(const char* n) override { return inner_.extension(n); }

  void fill(Tensor& x, float value) override;
  void cast(const Tensor& src, Tensor& dst) override;
  void add(const Tensor& a, const Tensor& b, Tensor& out) override;
  void mul(const Tensor& a, const Tensor& b, Tensor& out) override;
  void scale(const Tensor& x, float s, Tensor& out) override;
  void axpy(float alpha, const Tensor& x, Tensor& y) override;
  double sum(const Tensor& x) override;
  double sum_squares(const Tensor& x) override;
  void sum_squares_each(const std::vector<const Tensor*>& xs, std::vector<double>& sums) override;
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
