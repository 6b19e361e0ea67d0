#include "profiling_backend.h"

#include <fmt/format.h>

#include <algorithm>
#include <vector>

namespace mt {

std::string ProfilingBackend::report() const {
  double total = 0;
  std::vector<std::pair<std::string, OpTime>> v(times_.begin(), times_.end());
  for (const auto& [k, t] : v) total += t.seconds;
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.seconds > b.second.seconds; });
  std::string r;
  for (const auto& [k, t] : v)
    r += fmt::format("  {:<28} {:6.1f}%  {:9.1f} ms  {:7} calls\n", k,
                     total > 0 ? 100 * t.seconds / total : 0.0, t.seconds * 1e3, t.calls);
  return r;
}

namespace {
class ProfilingAttention final : public AttentionKernel {
 public:
  ProfilingAttention(ProfilingBackend& b, AttentionKernel& k) : b_(b), k_(k) {}
  std::string name() const override { return k_.name(); }
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& qs,
               const Tensor& ks, const AttentionSpec& spec, Tensor& out, Tensor& lse) override {
    ProfilingBackend::Timer t(b_, "attention_forward");
    k_.forward(q, k, v, qs, ks, spec, out, lse);
  }
  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& qs, const Tensor& ks, const Tensor& out, const Tensor& lse,
                const AttentionSpec& spec, Tensor& dq, Tensor& dk, Tensor& dv) override {
    ProfilingBackend::Timer t(b_, "attention_backward");
    k_.backward(dout, q, k, v, qs, ks, out, lse, spec, dq, dk, dv);
  }
  void decode(const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& len,
              const AttentionSpec& spec, Tensor& out) override {
    ProfilingBackend::Timer t(b_, "attention_decode");
    k_.decode(q, kc, vc, len, spec, out);
  }

 private:
  ProfilingBackend& b_;
  AttentionKernel& k_;
};
}  // namespace

std::unique_ptr<AttentionKernel> ProfilingBackend::wrap(AttentionKernel& k) {
  return std::make_unique<ProfilingAttention>(*this, k);
}

void ProfilingBackend::fill(Tensor& x, float value) {
  Timer t(*this, "fill");
  inner_.fill(x, value);
}

void ProfilingBackend::cast(const Tensor& src, Tensor& dst) {
  Timer t(*this, "cast");
  inner_.cast(src, dst);
}

void ProfilingBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  Timer t(*this, "add");
  inner_.add(a, b, out);
}

void ProfilingBackend::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  Timer t(*this, "mul");
  inner_.mul(a, b, out);
}

void ProfilingBackend::scale(const Tensor& x, float s, Tensor& out) {
  Timer t(*this, "scale");
  inner_.scale(x, s, out);
}

void ProfilingBackend::axpy(float alpha, const Tensor& x, Tensor& y) {
  Timer t(*this, "axpy");
  inner_.axpy(alpha, x, y);
}

double ProfilingBackend::sum(const Tensor& x) {
  Timer t(*this, "sum");
  return inner_.sum(x);
}

double ProfilingBackend::sum_squares(const Tensor& x) {
  Timer t(*this, "sum_squares");
  return inner_.sum_squares(x);
}

void ProfilingBackend::sum_squares_each(const std::vector<const Tensor*>& xs,
                                        std::vector<double>& sums) {
  Timer t(*this, "sum_squares");
  inner_.sum_squares_each(xs, sums);
}

void ProfilingBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a,
                              bool trans_b, float alpha, float beta) {
  Timer t(*this, "matmul");
  inner_.matmul(a, b, c, trans_a, trans_b, alpha, beta);
}

void ProfilingBackend::embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  Timer t(*this, "embedding_forward");
  inner_.embedding_forward(table, ids, out);
}

void ProfilingBackend::embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  Timer t(*this, "embedding_backward");
  inner_.embedding_backward(dout, ids, dtable);
}

void ProfilingBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one,
                                       Tensor& out, Tensor& rstd) {
  Timer t(*this, "rmsnorm_forward");
  inner_.rmsnorm_forward(x, w, eps, plus_one, out, rstd);
}

void ProfilingBackend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w,
                                        const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) {
  Timer t(*this, "rmsnorm_backward");
  inner_.rmsnorm_backward(dout, x, w, rstd, plus_one, dx, dw);
}

void ProfilingBackend::layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b,
                                         float eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  Timer t(*this, "layernorm_forward");
  inner_.layernorm_forward(x, w, b, eps, out, mean, rstd);
}

void ProfilingBackend::layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w,
                                          const Tensor& mean, const Tensor& rstd, Tensor& dx,
                                          Tensor& dw, Tensor& db) {
  Timer t(*this, "layernorm_backward");
  inner_.layernorm_backward(dout, x, w, mean, rstd, dx, dw, db);
}

void ProfilingBackend::rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                                    Tensor& out) {
  Timer t(*this, "rope_forward");
  inner_.rope_forward(x, positions, spec, out);
}

void ProfilingBackend::rope_backward(const Tensor& dout, const Tensor& positions,
                                     const RopeSpec& spec, Tensor& dx) {
  Timer t(*this, "rope_backward");
  inner_.rope_backward(dout, positions, spec, dx);
}

void ProfilingBackend::activation_forward(Activation act, const Tensor& x, Tensor& out) {
  Timer t(*this, "activation_forward");
  inner_.activation_forward(act, x, out);
}

void ProfilingBackend::activation_backward(Activation act, const Tensor& dout, const Tensor& x,
                                           Tensor& dx) {
  Timer t(*this, "activation_backward");
  inner_.activation_backward(act, dout, x, dx);
}

void ProfilingBackend::gated_forward(Activation act, const Tensor& gate, const Tensor& up,
                                     Tensor& out) {
  Timer t(*this, "gated_forward");
  inner_.gated_forward(act, gate, up, out);
}

void ProfilingBackend::gated_backward(Activation act, const Tensor& dout, const Tensor& gate,
                                      const Tensor& up, Tensor& dgate, Tensor& dup) {
  Timer t(*this, "gated_backward");
  inner_.gated_backward(act, dout, gate, up, dgate, dup);
}

void ProfilingBackend::softcap_forward(const Tensor& x, float cap, Tensor& out) {
  Timer t(*this, "softcap_forward");
  inner_.softcap_forward(x, cap, out);
}

void ProfilingBackend::softcap_backward(const Tensor& dout, const Tensor& out, float cap,
                                        Tensor& dx) {
  Timer t(*this, "softcap_backward");
  inner_.softcap_backward(dout, out, cap, dx);
}

void ProfilingBackend::softmax_forward(const Tensor& x, Tensor& out) {
  Timer t(*this, "softmax_forward");
  inner_.softmax_forward(x, out);
}

void ProfilingBackend::softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  Timer t(*this, "softmax_backward");
  inner_.softmax_backward(dout, out, dx);
}

void ProfilingBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets,
                                             float z_loss, Tensor& loss, Tensor& lse) {
  Timer t(*this, "cross_entropy_forward");
  inner_.cross_entropy_forward(logits, targets, z_loss, loss, lse);
}

void ProfilingBackend::cross_entropy_backward(const Tensor& dloss, const Tensor& logits,
                                              const Tensor& targets, const Tensor& lse,
                                              float z_loss, Tensor& dlogits) {
  Timer t(*this, "cross_entropy_backward");
  inner_.cross_entropy_backward(dloss, logits, targets, lse, z_loss, dlogits);
}

void ProfilingBackend::topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize,
                                          Tensor& weights, Tensor& indices, Tensor& probs) {
  Timer t(*this, "topk_route_forward");
  inner_.topk_route_forward(logits, k, sigmoid, normalize, weights, indices, probs);
}

void ProfilingBackend::topk_route_backward(const Tensor& dweights, const Tensor& weights,
                                           const Tensor& indices, const Tensor& probs, bool sigmoid,
                                           bool normalize, Tensor& dlogits) {
  Timer t(*this, "topk_route_backward");
  inner_.topk_route_backward(dweights, weights, indices, probs, sigmoid, normalize, dlogits);
}

void ProfilingBackend::copy_columns(const Tensor& src, int64_t src_col, Tensor& dst,
                                    int64_t dst_col, int64_t width, bool accumulate) {
  Timer t(*this, "copy_columns");
  inner_.copy_columns(src, src_col, dst, dst_col, width, accumulate);
}

void ProfilingBackend::gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) {
  Timer t(*this, "gather_rows");
  inner_.gather_rows(x, idx, out);
}

void ProfilingBackend::scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                                        Tensor& out) {
  Timer t(*this, "scatter_add_rows");
  inner_.scatter_add_rows(src, idx, w, out);
}
void ProfilingBackend::scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  Timer t(*this, "scatter_rows");
  inner_.scatter_rows(src, idx, out);
}

void ProfilingBackend::grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets,
                                      bool trans_w, Tensor& out) {
  Timer t(*this, "grouped_matmul");
  inner_.grouped_matmul(x, w, offsets, trans_w, out);
}

void ProfilingBackend::grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout,
                                                  const Tensor& offsets, bool trans_w, Tensor& dw) {
  Timer t(*this, "grouped_matmul_weight_grad");
  inner_.grouped_matmul_weight_grad(x, dout, offsets, trans_w, dw);
}

void ProfilingBackend::adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                                    const AdamWParams& p) {
  Timer t(*this, "adamw_update");
  inner_.adamw_update(param, grad, m, v, p);
}

}  // namespace mt
