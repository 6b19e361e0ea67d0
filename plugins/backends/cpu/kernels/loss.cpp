// loss: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void softmax_forward(const Tensor& x, Tensor& out) {
  fail("cpu: softmax_forward is not implemented yet");
}

void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  fail("cpu: softmax_backward is not implemented yet");
}

void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss, Tensor& loss, Tensor& lse) {
  fail("cpu: cross_entropy_forward is not implemented yet");
}

void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets, const Tensor& lse, float z_loss, Tensor& dlogits) {
  fail("cpu: cross_entropy_backward is not implemented yet");
}

}  // namespace mt::cpu
