// AttentionKernel: scaled dot-product attention, forward, backward and decode over a KV cache.
//
// Chosen by config `attention=dot_product|flash` (MaxText's names). Each backend ships both:
// dot_product materialises the [T, S] score matrix per head and is the readable reference;
// flash tiles over keys with an online softmax, keeps only a logsumexp per query row, and
// recomputes scores in the backward.
#pragma once

#include <cstdint>
#include <string>

#include "mt/export.h"
#include "mt/tensor.h"

namespace mt {

// Query i (0-based within the call) sits at absolute position i + query_offset; key j at
// position j. Key j is visible to query i when all of these hold:
//   causal:   j <= i + query_offset
//   window:   window == 0 or (i + query_offset) - j < window
//   segments: q_segment[b, i] == kv_segment[b, j] (when segment ids are given)
// A query row that sees no key at all produces zeros (and lse = -inf).
struct AttentionSpec {
  bool causal = true;
  int64_t window = 0;        // sliding window size in tokens; 0 = unlimited
  float softcap = 0.f;       // logits = softcap * tanh(logits / softcap); 0 = off
  float scale = 0.f;         // multiplies q.k; 0 = 1 / sqrt(head_dim)
  int64_t query_offset = 0;  // absolute position of the first query
};

class MT_API AttentionKernel {
 public:
  virtual ~AttentionKernel();
  virtual std::string name() const = 0;

  // q [B, T, Hq, D], k and v [B, S, Hkv, D] with Hq % Hkv == 0 (GQA; Hkv = 1 is MQA).
  // q_segment [B, T] i32 and kv_segment [B, S] i32, or both undefined.
  // out [B, T, Hq, D]; lse [B, Hq, T] f32 (natural-log logsumexp of each query's scaled,
  // capped, masked scores), saved for the backward.
  virtual void forward(const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& q_segment, const Tensor& kv_segment,
                       const AttentionSpec& spec, Tensor& out, Tensor& lse) = 0;

  // Accumulates (+=) into dq [B, T, Hq, D], dk and dv [B, S, Hkv, D].
  virtual void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                        const Tensor& lse, const AttentionSpec& spec, Tensor& dq, Tensor& dk,
                        Tensor& dv) = 0;

  // Decode: T new queries per sequence attend to a KV cache that already holds them.
  // q [B, T, Hq, D]; k_cache, v_cache [B, Smax, Hkv, D]; lengths [B] i32: the number of valid
  // cache rows of sequence b, the T new ones included, so query i of sequence b sits at position
  // lengths[b] - T + i. spec.query_offset is ignored. out [B, T, Hq, D].
  virtual void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& lengths, const AttentionSpec& spec, Tensor& out) = 0;
};

}  // namespace mt
