// embedding: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  fail("cpu: embedding_forward is not implemented yet");
}

void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  fail("cpu: embedding_backward is not implemented yet");
}

}  // namespace mt::cpu
