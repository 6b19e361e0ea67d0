// optimizer: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  fail("cpu: adamw_update is not implemented yet");
}

}  // namespace mt::cpu
