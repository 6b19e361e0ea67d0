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

}  // namespace mt
