// norm: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out, Tensor& rstd) {
  fail("cpu: rmsnorm_forward is not implemented yet");
}

void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) {
  fail("cpu: rmsnorm_backward is not implemented yet");
}

void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  fail("cpu: layernorm_forward is not implemented yet");
}

void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  fail("cpu: layernorm_backward is not implemented yet");
}

}  // namespace mt::cpu
