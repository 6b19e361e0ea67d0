// Shape and dtype checks shared by the CPU attention kernels (dot_product.cpp, flash.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "mt/attention.h"
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

// The whole argument check of each AttentionKernel entry point (shapes, dtypes, the spec, and
// for decode the lengths), so every kernel refuses the same inputs with the same sentences.
Dims check_forward(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_seg, const Tensor& kv_seg, const AttentionSpec& spec,
                   const Tensor& out, const Tensor& lse);
Dims check_backward(const std::string& op, const Tensor& dout, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& q_seg, const Tensor& kv_seg, const Tensor& out,
                    const Tensor& lse, const AttentionSpec& spec, const Tensor& dq,
                    const Tensor& dk, const Tensor& dv);
Dims check_decode(const std::string& op, const Tensor& q, const Tensor& k_cache,
                  const Tensor& v_cache, const Tensor& lengths, const AttentionSpec& spec,
                  const Tensor& out);

}  // namespace mt::cpu::attention
