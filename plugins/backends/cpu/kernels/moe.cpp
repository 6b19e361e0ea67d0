// moe: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize, Tensor& weights, Tensor& indices, Tensor& probs) {
  fail("cpu: topk_route_forward is not implemented yet");
}

void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices, const Tensor& probs, bool sigmoid, bool normalize, Tensor& dlogits) {
  fail("cpu: topk_route_backward is not implemented yet");
}

void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) {
  fail("cpu: gather_rows is not implemented yet");
}

void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, Tensor& out) {
  fail("cpu: scatter_add_rows is not implemented yet");
}

void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w, Tensor& out) {
  fail("cpu: grouped_matmul is not implemented yet");
}

void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets, bool trans_w, Tensor& dw) {
  fail("cpu: grouped_matmul_weight_grad is not implemented yet");
}

}  // namespace mt::cpu
