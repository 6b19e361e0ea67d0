// activation: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void activation_forward(Activation act, const Tensor& x, Tensor& out) {
  fail("cpu: activation_forward is not implemented yet");
}

void activation_backward(Activation act, const Tensor& dout, const Tensor& x, Tensor& dx) {
  fail("cpu: activation_backward is not implemented yet");
}

void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) {
  fail("cpu: gated_forward is not implemented yet");
}

void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup) {
  fail("cpu: gated_backward is not implemented yet");
}

void softcap_forward(const Tensor& x, float cap, Tensor& out) {
  fail("cpu: softcap_forward is not implemented yet");
}

void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) {
  fail("cpu: softcap_backward is not implemented yet");
}

}  // namespace mt::cpu
