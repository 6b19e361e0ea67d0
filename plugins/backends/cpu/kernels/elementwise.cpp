// elementwise: placeholder kernels (not implemented yet).
#include "kernels/kernels.h"
#include "mt/error.h"

namespace mt::cpu {

void fill(Tensor& x, float value) {
  fail("cpu: fill is not implemented yet");
}

void cast(const Tensor& src, Tensor& dst) {
  fail("cpu: cast is not implemented yet");
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  fail("cpu: add is not implemented yet");
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  fail("cpu: mul is not implemented yet");
}

void scale(const Tensor& x, float s, Tensor& out) {
  fail("cpu: scale is not implemented yet");
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  fail("cpu: axpy is not implemented yet");
}

double sum(const Tensor& x) {
  fail("cpu: sum is not implemented yet");
}

double sum_squares(const Tensor& x) {
  fail("cpu: sum_squares is not implemented yet");
}

}  // namespace mt::cpu
