// The CUDA backend's flash attention (attention=flash): tiled, online softmax, no [T, S] matrix,
// scores recomputed in the backward from the saved logsumexp. Shapes and semantics are those of
// mt::AttentionKernel (sdk/include/mt/attention.h).
//
// Two implementations behind each entry point, chosen per call:
// - tensor cores: q, k, v (and dout) bf16, head_dim 64 or 128, 16-byte aligned rows. 64-query x
//   64-key tiles, four warps of mma.sync m16n8k16 (bf16 in, f32 accumulate); P and dS are rounded
//   to bf16 before their products, as FlashAttention-2 does.
// - SIMT: everything else (f32 storage, other head sizes up to 256, decode): one warp per query
//   row (forward, dq) or key row (dk, dv), f32 throughout.
// Both backward passes are deterministic: dq and dk/dv are computed by separate kernels that each
// own their output rows, with no atomics.
#pragma once

#include "kernels.h"

namespace mt::cuda {

void flash_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& q_segment, const Tensor& kv_segment, const AttentionSpec& spec,
                   Tensor& out, Tensor& lse);
void flash_backward(const Ctx& c, const Tensor& dout, const Tensor& q, const Tensor& k,
                    const Tensor& v, const Tensor& q_segment, const Tensor& kv_segment,
                    const Tensor& out, const Tensor& lse, const AttentionSpec& spec, Tensor& dq,
                    Tensor& dk, Tensor& dv);
void flash_decode(const Ctx& c, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& lengths, const AttentionSpec& spec, Tensor& out);

}  // namespace mt::cuda
