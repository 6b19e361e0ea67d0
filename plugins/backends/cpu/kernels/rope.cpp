// rope: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec, Tensor& out) {
  fail("cpu: rope_forward is not implemented yet");
}

void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec, Tensor& dx) {
  fail("cpu: rope_backward is not implemented yet");
}

}  // namespace mt::cpu
