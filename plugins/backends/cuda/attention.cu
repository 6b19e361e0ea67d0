// dot_product attention for the CUDA backend (the reference: each query row's scores
// materialised in scratch) and the attention argument checks it shares with flash.cu
// (attention_args.h).
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>

#include "attention_args.h"
#include "common.cuh"

// ---- dot_product attention ------------------------------------------------------------------
namespace mt::cuda {
namespace {

// One block per query row r = ((b Hq) + h) T + i. q [B, T, Hq, D]; k, v [B, S, Hkv, D];
// sc [B Hq T, S] scratch; out [B, T, Hq, D]; lse [B, Hq, T] (or null). Scores, softmax and P V
// follow the CPU reference (attention/dot_product.cpp): a row with no visible key is zeros with
// lse -inf. lengths (decode) limits keys to [0, lengths[b]) and sets the query offset.
// Decode (lengths): a length outside [T, S] is recorded in `bad` and its rows attend to nothing.
__global__ void attn_fwd_kernel(In q, In k, In v, const int32_t* q_seg, const int32_t* kv_seg,
                                const int32_t* lengths, AttnArgs a, float* sc, Out o, float* lse,
                                unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq;
  const int64_t g = h / (a.Hq / a.Hkv);
  int64_t L = lengths ? lengths[b] : a.S;
  if (lengths && (L < a.T || L > a.S)) {  // decode only; uniform across the block
    if (threadIdx.x == 0 && i == 0) record_bad(bad, b, L);
    L = 0;
  }
  const int64_t p = lengths ? L - a.T + i : a.offset + i;
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  float* row = sc + r * a.S;
  float m = -INFINITY, nans = 0.f;
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    bool vis = !(a.causal && j > p) && !(a.window > 0 && p - j >= a.window);
    if (q_seg && q_seg[b * a.T + i] != kv_seg[b * a.S + j]) vis = false;
    float s = -INFINITY;
    if (vis) {
      const int64_t ko = ((b * a.S + j) * a.Hkv + g) * a.D;
      float d = 0.f;
      for (int64_t e = 0; e < a.D; ++e) d += q[qo + e] * k[ko + e];
      s = a.scale * d;
      if (a.cap > 0.f) s = a.cap * tanhf(s / a.cap);
    }
    row[j] = s;
    m = fmaxf(m, s);
    nans += isnan(s) ? 1.f : 0.f;
  }
  m = block_max(m, sh);  // its barriers also publish row[]
  // fmaxf passes over NaN: a row whose visible scores are all NaN (a NaN query) would read as
  // one without a visible key. Its softmax is NaN: m = NaN makes every step below NaN.
  if (m == -INFINITY && block_sum(nans, sh) > 0.f) m = NAN;  // (m is uniform: every thread)
  if (m == -INFINITY) {
    for (int64_t e = threadIdx.x; e < a.D; e += kThreads) o.set(qo + e, 0.f);
    if (lse && threadIdx.x == 0) lse[r] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < L; j += kThreads) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  sum = block_sum(sum, sh);  // barriers publish the exponentials
  if (lse && threadIdx.x == 0) lse[r] = m + logf(sum);
  for (int64_t e = threadIdx.x; e < a.D; e += kThreads) {
    float acc = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      const float pj = row[j] / sum;
      if (pj == 0.f) continue;
      acc += pj * v[((b * a.S + j) * a.Hkv + g) * a.D + e];
    }
    o.set(qo + e, acc);
  }
}

// Backward, pass 1: one block per query row r (as the forward). Recomputes the capped scores and
// P by the forward's softmax, then dP_j = dO_i . V_j, dS_j = P_j (dP_j - sum_l P_l dP_l) (times
// 1 - (capped / cap)^2 under a soft-cap), and dq_i += scale sum_j dS_j K_j. Leaves P and dS in
// scratch for pass 2. sc, p, dp: [rows, S] scratch (sc ends up holding dS).
__global__ void attn_bwd_q_kernel(In q, In k, In v, In dout, const int32_t* q_seg,
                                  const int32_t* kv_seg, AttnArgs a, float* sc, float* pr,
                                  float* dp, Out dq) {
  MT_KERNEL_PROLOGUE();
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq;
  const int64_t g = h / (a.Hq / a.Hkv);
  const int64_t p = a.offset + i, S = a.S;
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  float* srow = sc + r * S;
  float* prow = pr + r * S;
  float* drow = dp + r * S;
  float m = -INFINITY, nans = 0.f;
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    bool vis = !(a.causal && j > p) && !(a.window > 0 && p - j >= a.window);
    if (q_seg && q_seg[b * a.T + i] != kv_seg[b * S + j]) vis = false;
    float s = -INFINITY;
    if (vis) {
      const int64_t ko = ((b * S + j) * a.Hkv + g) * a.D;
      float d = 0.f;
      for (int64_t e = 0; e < a.D; ++e) d += q[qo + e] * k[ko + e];
      s = a.scale * d;
      if (a.cap > 0.f) s = a.cap * tanhf(s / a.cap);
    }
    srow[j] = s;
    m = fmaxf(m, s);
    nans += isnan(s) ? 1.f : 0.f;
  }
  m = block_max(m, sh);
  if (m == -INFINITY && block_sum(nans, sh) > 0.f) m = NAN;  // all NaN: NaN gradients (as above)
  if (m == -INFINITY) {  // no visible key: P = 0, dS = 0, no gradient from this row
    for (int64_t j = threadIdx.x; j < S; j += kThreads) prow[j] = srow[j] = 0.f;
    return;
  }
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    const float e = expf(srow[j] - m);
    prow[j] = e;
    sum += e;
  }
  sum = block_sum(sum, sh);
  float rowdot = 0.f;
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    const float pj = prow[j] / sum;
    prow[j] = pj;
    float d = 0.f;
    if (pj != 0.f) {
      const int64_t vo = ((b * S + j) * a.Hkv + g) * a.D;
      for (int64_t e = 0; e < a.D; ++e) d += dout[qo + e] * v[vo + e];
    }
    drow[j] = d;
    rowdot += pj * d;
  }
  rowdot = block_sum(rowdot, sh);
  for (int64_t j = threadIdx.x; j < S; j += kThreads) {
    const float pj = prow[j];
    float gs = pj * (drow[j] - rowdot);
    if (a.cap > 0.f && pj != 0.f) {
      const float t = srow[j] / a.cap;
      gs *= 1.f - t * t;
    }
    srow[j] = gs;
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < a.D; e += kThreads) {
    float acc = 0.f;
    for (int64_t j = 0; j < S; ++j) {
      if (prow[j] == 0.f && srow[j] == 0.f) continue;
      acc += a.scale * srow[j] * k[((b * S + j) * a.Hkv + g) * a.D + e];
    }
    dq.add(qo + e, acc);
  }
}

// Backward, pass 2: one block per key row (b, j, g). dk_j += scale sum dS_ij Q_i and
// dv_j += sum P_ij dO_i over the group's query heads (ascending) and queries (ascending): the
// CPU's order, and no atomics.
__global__ void attn_bwd_kv_kernel(In q, In dout, AttnArgs a, const float* ds, const float* pr,
                                   Out dk, Out dv) {
  MT_KERNEL_PROLOGUE();
  const int64_t kr = blockIdx.x;  // (b S + j) Hkv + g
  const int64_t g = kr % a.Hkv, bj = kr / a.Hkv, j = bj % a.S, b = bj / a.S;
  const int64_t group = a.Hq / a.Hkv;
  for (int64_t e = threadIdx.x; e < a.D; e += kThreads) {
    float ak = 0.f, av = 0.f;
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      for (int64_t i = 0; i < a.T; ++i) {
        const int64_t r = (b * a.Hq + h) * a.T + i;
        const float pj = pr[r * a.S + j], dsj = ds[r * a.S + j];
        if (pj == 0.f && dsj == 0.f) continue;
        const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D + e;
        ak += a.scale * dsj * q[qo];
        av += pj * dout[qo];
      }
    }
    dk.add(kr * a.D + e, ak);
    dv.add(kr * a.D + e, av);
  }
}

}  // namespace

AttnArgs attention_args(const std::string& op, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& q_seg, const Tensor& kv_seg, const AttentionSpec& spec,
                        const Tensor& o) {
  // Built only for a message (MT_CHECK evaluates its message on failure alone).
  const auto shapes = [&] {
    return " (q " + str(q) + ", k " + str(k) + ", v " + str(v) + ", out " + str(o) + ")";
  };
  MT_CHECK(q.defined() && k.defined() && v.defined() && q.ndim() == 4 && k.ndim() == 4 &&
               k.shape() == v.shape() && q.dim(0) == k.dim(0) && q.dim(3) == k.dim(3) &&
               k.dim(2) > 0 && q.dim(2) % k.dim(2) == 0 && is_fb(q) && is_fb(k) && is_fb(v),
           op + ": want q [B, T, Hq, D], k and v [B, S, Hkv, D] f32 or bf16 with Hq % Hkv == 0" +
               shapes());
  MT_CHECK(is_fb(o) && o.shape() == q.shape(), op + ": out must have q's shape" + shapes());
  MT_CHECK(q_seg.defined() == kv_seg.defined(),
           op + ": give both q_segment and kv_segment or neither");
  if (q_seg.defined())
    MT_CHECK(q_seg.dtype() == DType::i32 && kv_seg.dtype() == DType::i32 &&
                 q_seg.shape() == (Shape{q.dim(0), q.dim(1)}) &&
                 kv_seg.shape() == (Shape{k.dim(0), k.dim(1)}),
             op + ": segment ids must be i32 [B, T] and [B, S], got " + q_seg.str() + " and " +
                 kv_seg.str() + shapes());
  MT_CHECK(spec.window >= 0 && spec.softcap >= 0.f,
           op + ": window and softcap must be >= 0" + shapes());
  AttnArgs a{};
  a.T = q.dim(1);
  a.S = k.dim(1);
  a.Hq = q.dim(2);
  a.Hkv = k.dim(2);
  a.D = q.dim(3);
  a.causal = spec.causal;
  a.window = spec.window;
  a.cap = spec.softcap;
  a.scale = spec.scale != 0.f ? spec.scale : 1.f / std::sqrt(static_cast<float>(a.D));
  a.offset = spec.query_offset;
  MT_CHECK(q.dim(0) * a.Hq * a.T <= INT_MAX, op + ": too many query rows" + shapes());
  return a;
}

void check_attention_lse(const std::string& op, const Tensor& lse, int64_t B, const AttnArgs& a) {
  MT_CHECK(lse.defined() && lse.dtype() == DType::f32 && lse.shape() == (Shape{B, a.Hq, a.T}),
           op + ": lse must be f32 [B, Hq, T], got " + str(lse));
}

std::string attention_grad_shapes(const Tensor& dout, const Tensor& q, const Tensor& k,
                                  const Tensor& v, const Tensor& dq, const Tensor& dk,
                                  const Tensor& dv) {
  return "dout " + str(dout) + ", q " + str(q) + ", k " + str(k) + ", v " + str(v) + ", dq " +
         str(dq) + ", dk " + str(dk) + ", dv " + str(dv);
}

void check_attention_grads(const std::string& op, const Tensor& dout, const Tensor& q,
                           const Tensor& k, const Tensor& v, const Tensor& lse, const Tensor& dq,
                           const Tensor& dk, const Tensor& dv) {
  const auto shapes = [&] { return attention_grad_shapes(dout, q, k, v, dq, dk, dv); };
  const int64_t B = q.dim(0);
  MT_CHECK(
      is_fb(dout) && dout.shape() == q.shape() && is_fb(dq) && dq.shape() == q.shape() &&
          is_fb(dk) && dk.shape() == k.shape() && is_fb(dv) && dv.shape() == v.shape() &&
          lse.defined() && lse.dtype() == DType::f32 &&
          lse.shape() == (Shape{B, q.dim(2), q.dim(1)}),
      op + ": want dout and dq of q's shape, dk and dv of k's, lse f32 [B, Hq, T]: " + shapes());
  MT_CHECK(B * k.dim(1) * k.dim(2) <= INT_MAX, op + ": too many key rows: " + shapes());
}

unsigned long long* check_decode_lengths(const Ctx& c, const std::string& op, const Tensor& lengths,
                                         int64_t B, const AttnArgs& a) {
  MT_CHECK(lengths.defined() && lengths.dtype() == DType::i32 && lengths.shape() == Shape{B},
           op + ": lengths must be i32 [" + std::to_string(B) + "]");
  const int64_t T = a.T, S = a.S;
  return c.checks->slot([op, T, S](int64_t b, int64_t len) {
    return op + ": lengths[" + std::to_string(b) + "] = " + std::to_string(len) +
           " must be in [T, Smax] = [" + std::to_string(T) + ", " + std::to_string(S) + "]";
  });
}

void attention_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& q_segment, const Tensor& kv_segment, const AttentionSpec& spec,
                       Tensor& o, Tensor& lse) {
  const std::string op = "dot_product attention forward";
  const AttnArgs a = attention_args(op, q, k, v, q_segment, kv_segment, spec, o);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  check_attention_lse(op, lse, B, a);
  if (rows == 0) return;
  Tensor sc = c.scratch({rows, std::max<int64_t>(a.S, 1)}, DType::f32);
  MT_LAUNCH(attn_fwd_kernel, static_cast<unsigned>(rows), kThreads, 0, c)
  (in(q), in(k), in(v), q_segment.defined() ? q_segment.ptr<const int32_t>() : nullptr,
   kv_segment.defined() ? kv_segment.ptr<const int32_t>() : nullptr, nullptr, a, sc.ptr<float>(),
   out(o), lse.ptr<float>(), nullptr);
  launched(op, [&] { return "q " + str(q) + ", k " + str(k) + ", v " + str(v); });
}

void attention_backward(const Ctx& c, const Tensor& dout, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& q_segment, const Tensor& kv_segment,
                        const Tensor& o, const Tensor& lse, const AttentionSpec& spec, Tensor& dq,
                        Tensor& dk, Tensor& dv) {
  const std::string op = "dot_product attention backward";
  const AttnArgs a = attention_args(op, q, k, v, q_segment, kv_segment, spec, o);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  check_attention_grads(op, dout, q, k, v, lse, dq, dk, dv);
  if (rows == 0 || a.S == 0) return;
  const auto shapes = [&] { return attention_grad_shapes(dout, q, k, v, dq, dk, dv); };
  Tensor scratch = c.scratch({3, rows, a.S}, DType::f32);
  float* sc = scratch.ptr<float>();
  float* pr = sc + rows * a.S;
  float* dp = pr + rows * a.S;
  const int32_t* qs = q_segment.defined() ? q_segment.ptr<const int32_t>() : nullptr;
  const int32_t* ks = kv_segment.defined() ? kv_segment.ptr<const int32_t>() : nullptr;
  MT_LAUNCH(attn_bwd_q_kernel, static_cast<unsigned>(rows), kThreads, 0, c)
  (in(q), in(k), in(v), in(dout), qs, ks, a, sc, pr, dp, out(dq));
  launched(op, shapes);
  MT_LAUNCH(attn_bwd_kv_kernel, static_cast<unsigned>(B * a.S * a.Hkv), kThreads, 0, c)
  (in(q), in(dout), a, sc, pr, out(dk), out(dv));
  launched(op, shapes);
}

void attention_decode(const Ctx& c, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& lengths, const AttentionSpec& spec, Tensor& o) {
  const std::string op = "dot_product attention decode";
  const AttnArgs a = attention_args(op, q, k_cache, v_cache, Tensor(), Tensor(), spec, o);
  const int64_t B = q.dim(0), rows = B * a.Hq * a.T;
  unsigned long long* bad = check_decode_lengths(c, op, lengths, B, a);
  if (rows == 0) return;
  Tensor sc = c.scratch({rows, std::max<int64_t>(a.S, 1)}, DType::f32);
  MT_LAUNCH(attn_fwd_kernel, static_cast<unsigned>(rows), kThreads, 0, c)
  (in(q), in(k_cache), in(v_cache), nullptr, nullptr, lengths.ptr<const int32_t>(), a,
   sc.ptr<float>(), out(o), nullptr, bad);
  launched(op, [&] { return "q " + str(q) + ", k_cache " + str(k_cache); });
}

}  // namespace mt::cuda
