// The checked arguments of one attention call, shared by the CUDA dot_product and flash kernels.
#pragma once

#include <cstdint>
#include <string>

#include "mt/attention.h"
#include "mt/tensor.h"

namespace mt::cuda {

struct Ctx;  // kernels.h

struct AttnArgs {
  int64_t T, S, Hq, Hkv, D;
  bool causal;
  int64_t window;
  float cap, scale;
  int64_t offset;  // position of query 0 (forward); decode uses lengths[b] - T
};

// Checks q [B, T, Hq, D], k and v [B, S, Hkv, D] (f32 or bf16, Hq % Hkv == 0), out (q's shape),
// the segment ids ([B, T] and [B, S] i32, both or neither) and the spec, throwing mt::Error that
// names `op` and the shapes; returns the sizes and the spec with the default scale resolved.
AttnArgs attention_args(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& q_seg, const Tensor& kv_seg, const AttentionSpec& spec,
                        const Tensor& o);
// lse must be f32 [B, Hq, T].
void check_attention_lse(const std::string& op, const Tensor& lse, int64_t B, const AttnArgs& a);
// The backward's operands: dout and dq of q's shape, dk and dv of k's, lse f32 [B, Hq, T].
void check_attention_grads(const std::string& op, const Tensor& dout, const Tensor& q,
                           const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& dq,
                           const Tensor& dk, const Tensor& dv);
// "dout [..], q [..], ...": the backward's operands, for error messages (built only for one).
std::string attention_grad_shapes(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv);
// Decode: lengths i32 [B]. Whether each is in [T, Smax] the decode kernel checks on the device
// (a bad length reads nothing: the row attends to no key) and records in the returned slot.
unsigned long long* check_decode_lengths(const Ctx& c, const std::string& op, const Tensor& lengths,
                                         int64_t B, const AttnArgs& a);

}  // namespace mt::cuda
