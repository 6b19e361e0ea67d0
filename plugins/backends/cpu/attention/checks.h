// Shape and dtype checks shared by the CPU attention kernels (dot_product.cpp, flash.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "mt/tensor.h"

namespace mt::cpu::attention {

struct Dims {
  int64_t B, T, S, Hq, Hkv, D;
};

bool float_dtype(const Tensor& t);

// Shapes and dtypes of q [B, T, Hq, D], k and v [B, S, Hkv, D] and the optional segment ids;
// throws mt::Error naming the op and the shapes.
Dims check_inputs(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& q_seg, const Tensor& kv_seg);

// `t` has `shape` and is f32 (f32_only) or f32/bf16.
void check_same(const std::string& op, const char* what, const Tensor& t, const Shape& shape,
                bool f32_only);

}  // namespace mt::cpu::attention
