// The device code of flash attention (flash.cu holds the launchers): the SIMT and tensor-core
// kernels and their helpers. MT_DYNAMIC_SHARED (device_io.cuh), the mma, ldmatrix and cp.async
// below have stand-ins under tests/support/cuda_emulation.h, which compiles the plugin's kernels as
// host C++ for cuda_emulated_ops_test: the tile indexing, masks and online softmax are checked on
// any machine, the hardware's arithmetic only on a GPU (gpu_ops_test).
//
// Notation: q [B, T, Hq, D], k and v [B, S, Hkv, D], group = Hq / Hkv (query head h reads kv head
// h / group), lse and delta [B, Hq, T]. Query i sits at position offset + i (decode:
// lengths[b] - T + i); the mask is AttentionSpec's: causal, window, segment ids. Scores are
// x = cap(scale q.k) with cap(s) = softcap tanh(s / softcap) when a soft-cap is set.
//
// Backward (both implementations): with P = exp(x - lse) and delta_i = sum_e dO_ie O_ie,
// dS = P (dO.V - delta) cap'(x), dq = scale dS K, dk = scale dS^T Q, dv = P^T dO.
#pragma once

#ifndef MT_CUDA_EMULATION
#include <cuda_bf16.h>
#endif

#include <cmath>
#include <cstdint>

#include "attention_args.h"
#include "device_io.cuh"

namespace mt::cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kWarps = 4;    // warps per block of every flash kernel
constexpr int kLaneMax = 8;  // SIMT: features per lane, so head_dim <= 32 * kLaneMax
constexpr int kTile = 64;    // tensor cores: query and key rows per tile (16 per warp)

// What every kernel needs besides its operands.
struct Flash {
  AttnArgs a;
  int64_t B;
  int64_t group;
  const int32_t* q_seg;    // [B, T] or null
  const int32_t* kv_seg;   // [B, S] or null
  const int32_t* lengths;  // decode: [B] valid cache rows, or null
};

__device__ __forceinline__ bool visible(const AttnArgs& a, int64_t p, int64_t j) {
  return !(a.causal && j > p) && !(a.window > 0 && p - j >= a.window);
}
__device__ __forceinline__ float cap_score(const AttnArgs& a, float dot) {
  const float s = a.scale * dot;
  return a.cap > 0.f ? a.cap * tanhf(s / a.cap) : s;
}
// d cap(s) / ds, from the capped score x.
__device__ __forceinline__ float cap_grad(const AttnArgs& a, float x) {
  if (a.cap <= 0.f) return 1.f;
  const float t = x / a.cap;
  return 1.f - t * t;
}
// Butterfly sum: every lane ends with the same bits (each step adds the same two values).
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// Keys [lo, hi) that position p may see before segment ids.
__device__ __forceinline__ void key_range(const AttnArgs& a, int64_t p, int64_t len, int64_t& lo,
                                          int64_t& hi) {
  lo = a.window > 0 && p - a.window + 1 > 0 ? p - a.window + 1 : 0;
  hi = a.causal && p + 1 < len ? p + 1 : len;
}

// ---- SIMT kernels: one warp per row, lane l holds features l, l + 32, ... -------------------

// A row's D features, lane-strided, into registers (zeros past D).
__device__ __forceinline__ void load_lanes(float (&r)[kLaneMax], In x, int64_t base, int64_t D) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    r[t] = e < D ? x[base + e] : 0.f;
  }
}
__device__ __forceinline__ float lanes_dot(const float (&r)[kLaneMax], In x, int64_t base,
                                           int64_t D) {
  const int lane = threadIdx.x & 31;
  float d = 0.f;
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    if (e < D) d += r[t] * x[base + e];
  }
  return warp_sum(d);
}

// The same with both rows in registers (zeros past D on both sides).
__device__ __forceinline__ float lanes_dot(const float (&x)[kLaneMax], const float (&y)[kLaneMax]) {
  float d = 0.f;
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) d += x[t] * y[t];
  return warp_sum(d);
}

// Forward: one warp per query row r = (b Hq + h) T + i, keys in order with an online softmax.
// out [B, T, Hq, D]; lse [B, Hq, T].
__global__ void __launch_bounds__(kWarps * 32)
    simt_fwd_kernel(In q, In k, In v, Flash f, Out o, float* lse) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= f.B * a.Hq * a.T) return;  // whole warps return together
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq, g = h / f.group;
  int64_t lo, hi;
  key_range(a, a.offset + i, a.S, lo, hi);
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  float qv[kLaneMax], acc[kLaneMax] = {};
  load_lanes(qv, q, qo, a.D);
  const int32_t qs = f.q_seg ? f.q_seg[b * a.T + i] : 0;
  float m = -INFINITY, l = 0.f;
  for (int64_t j = lo; j < hi; ++j) {
    if (f.q_seg && f.kv_seg[b * a.S + j] != qs) continue;
    const int64_t ko = ((b * a.S + j) * a.Hkv + g) * a.D;
    const float x = cap_score(a, lanes_dot(qv, k, ko, a.D));
    if (x == -INFINITY) continue;  // weight 0 (exp(-inf - -inf) would be NaN before a finite x)
    const float mn = fmaxf(m, x);
    const float corr = expf(m - mn), pj = expf(x - mn);
    l = l * corr + pj;
#pragma unroll
    for (int t = 0; t < kLaneMax; ++t) {
      const int64_t e = lane + 32 * t;
      if (e < a.D) acc[t] = acc[t] * corr + pj * v[ko + e];
    }
    m = mn;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    if (e < a.D) o.set(qo + e, acc[t] * inv);
  }
  // l NaN: a NaN or +inf score (the output is NaN too); -inf is a row without a visible key.
  if (lane == 0) lse[r] = isnan(l) ? NAN : l > 0.f ? m + logf(l) : -INFINITY;
}

// ---- decode -------------------------------------------------------------------------------
// Over a KV cache of S rows of which lengths[b] are valid; query row i of T sits at position
// lengths[b] - T + i. Block (b Hkv + g, chunk s of kDecodeKeys cache rows) serves every query
// row of kv head g's group (heads g group .. g group + group - 1, each with its T rows) from one
// read of the chunk's keys and values, in passes of up to kDecodeRows rows:
//   scores, a thread per key (16-byte loads of its key row; the rows' queries in shared memory);
//   each row's softmax over the chunk, a warp per row;
//   P V, a thread per feature (each value row read whole by the block, coalesced).
// Each row's unnormalised state (m, l, acc[D]) goes to partial [rows, splits, D + 2] (rows
// (b Hq + h) T + i, splits = gridDim.y) for combine_kernel.
constexpr int kDecodeKeys = kWarps * 32;  // cache rows per block: one per thread
constexpr int kDecodeRows = 8;            // query rows per pass over the chunk, at most
constexpr int kDecodeBatch = 32;          // value rows loaded together in P V (divides
                                          // kDecodeKeys)
static_assert(kDecodeKeys % kDecodeBatch == 0);

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// vec: D % 8 == 0 and k, v 16-byte aligned (then every row start is).
// A length outside [T, S] is recorded in `bad`; its rows then see no key.
// R: query rows per pass (a power of two up to kDecodeRows, at least the group's rows when they
// fit): multi-head attention decoding one token has one row, and its pass then computes one dot
// product per key instead of kDecodeRows.
template <int R>
__global__ void __launch_bounds__(kWarps * 32)
    decode_kernel(In q, In k, In v, Flash f, bool vec, float* partial, unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  __shared__ float qs[R][32 * kLaneMax];
  __shared__ float ps[R][kDecodeKeys];
  __shared__ float ms[R], ls[R];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int64_t bg = blockIdx.x, b = bg / a.Hkv, g = bg % a.Hkv;
  const int64_t s = blockIdx.y, splits = gridDim.y, j0 = s * kDecodeKeys, j = j0 + t;
  const int64_t len = f.lengths[b], rows = f.group * a.T;
  const bool len_ok = len >= a.T && len <= a.S;
  if (!len_ok && t == 0 && g == 0 && s == 0) record_bad(bad, b, len);
  // Keys of this chunk inside the valid cache (none when the chunk starts past it).
  const int64_t nk = !len_ok ? 0 : len - j0 < kDecodeKeys ? (len > j0 ? len - j0 : 0) : kDecodeKeys;
  const int64_t D = a.D, D8 = D / 8 * 8;
  for (int64_t r0 = 0; r0 < rows; r0 += R) {
    const int nr = static_cast<int>(rows - r0 < R ? rows - r0 : R);
    __syncthreads();  // the previous pass is done with qs, ps, ms, ls
    // Group row r0 + rr is head g group + (r0 + rr) / T, token (r0 + rr) % T; rows past nr are
    // zeros, so the fixed-size loops below compute nothing undefined for them.
    for (int64_t idx = t; idx < R * D; idx += kWarps * 32) {
      const int rr = static_cast<int>(idx / D);
      const int64_t e = idx % D, gr = r0 + rr;
      qs[rr][e] = rr < nr ? q[((b * a.T + gr % a.T) * a.Hq + g * f.group + gr / a.T) * D + e] : 0.f;
    }
    __syncthreads();
    float dot[R] = {};
    if (t < nk) {
      const int64_t ko = ((b * a.S + j) * a.Hkv + g) * D;
      for (int64_t e = 0; e < D8; e += 8) {
        float kv[8];
        load8(kv, k, ko + e, vec);
#pragma unroll
        for (int u = 0; u < 8; ++u) {
#pragma unroll
          for (int rr = 0; rr < R; ++rr) dot[rr] += qs[rr][e + u] * kv[u];
        }
      }
      for (int64_t e = D8; e < D; ++e) {
        const float kv = k[ko + e];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) dot[rr] += qs[rr][e] * kv;
      }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      const int64_t p = len - a.T + (r0 + rr) % a.T;
      ps[rr][t] = rr < nr && t < nk && visible(a, p, j) ? cap_score(a, dot[rr]) : -INFINITY;
    }
    __syncthreads();
    for (int rr = warp; rr < nr; rr += kWarps) {
      float mx = -INFINITY;
      bool bad = false;  // a NaN or +inf score, which fmaxf passes over (NaN)
      for (int c = lane; c < kDecodeKeys; c += 32) {
        mx = fmaxf(mx, ps[rr][c]);
        bad |= !(ps[rr][c] < INFINITY);
      }
      mx = warp_max(mx);
      bad = __any_sync(0xffffffffu, bad);
      float sum = 0.f;
      for (int c = lane; c < kDecodeKeys; c += 32) {
        const float e = mx == -INFINITY || bad ? 0.f : expf(ps[rr][c] - mx);  // no key: all 0
        ps[rr][c] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      // A NaN sum marks the split: combine_kernel makes the row NaN (before: an all-NaN chunk
      // read as one without a visible key, and the row came out finite).
      if (lane == 0) ms[rr] = mx, ls[rr] = bad ? NAN : sum;
    }
    // Rows past nr: weights 0, so their accumulators stay 0.
    for (int rr = nr + warp; rr < R; rr += kWarps)
      for (int c = lane; c < kDecodeKeys; c += 32) ps[rr][c] = 0.f;
    __syncthreads();
    for (int64_t e = t; e < D; e += kWarps * 32) {
      float acc[R] = {};
      // kDecodeBatch value rows loaded before any is used (their loads in flight together),
      // then summed in key order as one at a time would. The chunk's last batch too: a row past
      // nk loads row nk - 1 (valid data) with weight 0 (ps is 0 past nk), no tail of dependent
      // single loads (up to 15 before, on the chunk that decides the kernel's time).
      for (int64_t c = 0; c < nk; c += kDecodeBatch) {
        float vv[kDecodeBatch];
#pragma unroll
        for (int u = 0; u < kDecodeBatch; ++u) {
          const int64_t cu = c + u < nk ? c + u : nk - 1;
          vv[u] = v[((b * a.S + j0 + cu) * a.Hkv + g) * D + e];
        }
#pragma unroll
        for (int u = 0; u < kDecodeBatch; ++u) {
#pragma unroll
          for (int rr = 0; rr < R; ++rr) acc[rr] += ps[rr][c + u] * vv[u];
        }
      }
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (rr >= nr) break;
        const int64_t gr = r0 + rr, row = (b * a.Hq + g * f.group + gr / a.T) * a.T + gr % a.T;
        float* dst = partial + (row * splits + s) * (D + 2);
        dst[2 + e] = acc[rr];
        if (e == 0) dst[0] = ms[rr], dst[1] = ls[rr];
      }
    }
  }
}

// Split keys, second pass: out row r from its `splits` partial states (decode_kernel), in
// split order: m = max m_s, out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s.
__global__ void __launch_bounds__(kWarps * 32)
    combine_kernel(const float* partial, int64_t splits, Flash f, Out o) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= f.B * a.Hq * a.T) return;
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq;
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  const float* src = partial + r * splits * (a.D + 2);
  // Unrolled: the splits' loads in flight together rather than one round trip each (the kernel
  // took 13 us for 16 rows of 9 splits on an H100).
  // A split whose sum is NaN saw a NaN or +inf score: the row's softmax is NaN.
  bool bad = false;
  for (int64_t s = 0; s < splits; ++s) bad |= isnan(src[s * (a.D + 2) + 1]);
  if (bad) {
#pragma unroll
    for (int t = 0; t < kLaneMax; ++t) {
      const int64_t e = lane + 32 * t;
      if (e < a.D) o.set(qo + e, NAN);
    }
    return;  // the whole warp (bad is the same in every lane)
  }
  float m = -INFINITY;
#pragma unroll 8
  for (int64_t s = 0; s < splits; ++s) m = fmaxf(m, src[s * (a.D + 2)]);
  float l = 0.f, acc[kLaneMax] = {};
  const int64_t seen = m > -INFINITY ? splits : 0;
#pragma unroll 4
  for (int64_t s = 0; s < seen; ++s) {
    const float* ps = src + s * (a.D + 2);
    // A split that saw no key (past the length; a recorded step has the splits of the whole
    // cache) has weight 0: its sums are not read (6.4 -> 4.1 us a layer of llama-bench-1b's
    // batch-1 decode on an H200, 2 of 8 splits seeing keys).
    if (ps[0] == -INFINITY) continue;
    const float w = expf(ps[0] - m);
    l += w * ps[1];
#pragma unroll
    for (int t = 0; t < kLaneMax; ++t) {
      const int64_t e = lane + 32 * t;
      if (e < a.D) acc[t] += w * ps[2 + e];
    }
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    if (e < a.D) o.set(qo + e, acc[t] * inv);
  }
}

// delta [B, Hq, T]: sum_e dO_ie O_ie, one warp per query row.
__global__ void __launch_bounds__(kWarps * 32) delta_kernel(In dout, In o, Flash f, float* delta) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= f.B * a.Hq * a.T) return;
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq;
  const int64_t base = ((b * a.T + i) * a.Hq + h) * a.D;
  float d = 0.f;
  for (int64_t e = lane; e < a.D; e += 32) d += dout[base + e] * o[base + e];
  d = warp_sum(d);
  if (lane == 0) delta[r] = d;
}

// dq: one warp per query row, keys in order. dq [B, T, Hq, D] +=.
__global__ void __launch_bounds__(kWarps * 32)
    simt_dq_kernel(In q, In k, In v, In dout, Flash f, const float* lse, const float* delta,
                   Out dq) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (r >= f.B * a.Hq * a.T) return;
  const float ls = lse[r];
  if (ls == -INFINITY) return;  // the row saw no key: no gradient flows through it
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq, g = h / f.group;
  const int64_t p = a.offset + i;
  int64_t lo, hi;
  key_range(a, p, a.S, lo, hi);
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  float qv[kLaneMax], dov[kLaneMax], kv[kLaneMax], acc[kLaneMax] = {};
  load_lanes(qv, q, qo, a.D);
  load_lanes(dov, dout, qo, a.D);
  const float dl = delta[r];
  const int32_t qs = f.q_seg ? f.q_seg[b * a.T + i] : 0;
  for (int64_t j = lo; j < hi; ++j) {
    if (f.q_seg && f.kv_seg[b * a.S + j] != qs) continue;
    const int64_t ko = ((b * a.S + j) * a.Hkv + g) * a.D;
    load_lanes(kv, k, ko, a.D);
    const float x = cap_score(a, lanes_dot(qv, kv));
    const float pj = expf(x - ls);
    const float ds = pj * (lanes_dot(dov, v, ko, a.D) - dl) * cap_grad(a, x);
#pragma unroll
    for (int t = 0; t < kLaneMax; ++t) acc[t] += ds * kv[t];
  }
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    if (e < a.D) dq.add(qo + e, a.scale * acc[t]);
  }
}

// dk, dv: one warp per key row kr = (b S + j) Hkv + g; the group's query heads in order, each
// head's queries in order. dk, dv [B, S, Hkv, D] +=.
__global__ void __launch_bounds__(kWarps * 32)
    simt_dkv_kernel(In q, In k, In v, In dout, Flash f, const float* lse, const float* delta,
                    Out dk, Out dv) {
  MT_KERNEL_PROLOGUE();
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31;
  const int64_t kr = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (kr >= f.B * a.S * a.Hkv) return;
  const int64_t g = kr % a.Hkv, bj = kr / a.Hkv, j = bj % a.S, b = bj / a.S;
  const int64_t ko = kr * a.D;
  float kv[kLaneMax], vv[kLaneMax], qv[kLaneMax], ak[kLaneMax] = {}, av[kLaneMax] = {};
  load_lanes(kv, k, ko, a.D);
  load_lanes(vv, v, ko, a.D);
  // Queries that may see key j: causal wants offset + i >= j, the window offset + i - j < window.
  const int64_t ilo = a.causal && j - a.offset > 0 ? j - a.offset : 0;
  const int64_t ihi = a.window > 0 && j - a.offset + a.window < a.T ? j - a.offset + a.window : a.T;
  const int32_t ks = f.kv_seg ? f.kv_seg[b * a.S + j] : 0;
  for (int64_t h = g * f.group; h < (g + 1) * f.group; ++h) {
    for (int64_t i = ilo; i < ihi; ++i) {
      if (f.q_seg && f.q_seg[b * a.T + i] != ks) continue;
      const int64_t r = (b * a.Hq + h) * a.T + i;
      const float ls = lse[r];
      if (ls == -INFINITY) continue;
      const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
      load_lanes(qv, q, qo, a.D);
      const float x = cap_score(a, lanes_dot(qv, kv));
      const float pj = expf(x - ls);
      float dov[kLaneMax];
      load_lanes(dov, dout, qo, a.D);
      const float ds = pj * (lanes_dot(dov, vv) - delta[r]) * cap_grad(a, x);
#pragma unroll
      for (int t = 0; t < kLaneMax; ++t) {
        av[t] += pj * dov[t];
        ak[t] += ds * qv[t];
      }
    }
  }
#pragma unroll
  for (int t = 0; t < kLaneMax; ++t) {
    const int64_t e = lane + 32 * t;
    if (e < a.D) {
      dk.add(ko + e, a.scale * ak[t]);
      dv.add(ko + e, av[t]);
    }
  }
}

// ---- tensor-core kernels ------------------------------------------------------------------
// mma.sync.m16n8k16 fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with
// gid = lane / 4 and tq = lane % 4:
//   A 16x16 (row-major): reg 0 = A[gid][2tq..2tq+1], reg 1 = A[gid+8][2tq..], reg 2 =
//     A[gid][2tq+8..], reg 3 = A[gid+8][2tq+8..] (two bf16 per register, lower index low).
//   B 16x8: reg 0 = B[2tq..2tq+1][gid], reg 1 = B[2tq+8..2tq+9][gid].
//   C 16x8 f32: c0, c1 = C[gid][2tq..2tq+1], c2, c3 = C[gid+8][2tq..2tq+1].
// So the C fragments of two adjacent n-tiles are the A fragment of one k-step, which is how P and
// dS feed the next product without leaving registers. Every register of an A or B fragment is one
// 8x8 submatrix as ldmatrix delivers it (plain for A and for B = tile^T, .trans for B = tile), so
// one ldmatrix.x4 loads an A fragment or the B fragments of two n-tiles. Shared tiles are
// [rows][D + 8] bf16: the 16-byte pad puts the eight rows of each 8x8 load in distinct banks.
//
// Tiles move global -> shared with cp.async, double-buffered: the next key (or query) tile is in
// flight while the current one is multiplied. A block has W warps of 16 rows each (4 unless
// MT_CUDA_FLASH_WARPS=8 for the forward and dq, MT_CUDA_FLASH_DKV_WARPS=8 for dk/dv); the tile it
// owns (query rows forward and dq, key rows dk/dv) has 16 W rows, the tiles it streams kTile = 64.
// Per warp and streamed tile: no product at all when no row of the warp sees a key of the tile,
// and no per-element mask when every row sees every key (most tiles of a long causal sequence).
// Scores are kept in log2 units (Scores) so that each softmax weight is one subtraction and one
// ex2; the kernels are compiled with and without a soft-cap, so that the common case carries no
// tanh in its code. What bounds these kernels is the instructions issued per mma.sync (Nsight
// Compute on an H200, 2026-11-26, forward at B=2 T=4096 H=32 D=128 causal: 12.2 per mma, 0.9
// issued a cycle, 3.35 ms before; 6.1 per mma, 1.3 a cycle, 1.16 ms after the log2 scores, the
// soft-cap instances, the 32-bit masks and copy_tile's fixed addresses). Two warps a scheduler
// (the registers allow no more) leave little to hide latency with: see docs/ARCHITECTURE.md.

constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ uint32_t pack_bf16(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(lo)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(hi)) << 16);
}
__device__ __forceinline__ uint32_t pack_f32(float lo, float hi) {
  return pack_bf16(__float2bfloat16_rn(lo), __float2bfloat16_rn(hi));
}
#if !defined(MT_CUDA_EMULATION)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
#endif
// c += a b
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
#if defined(MT_CUDA_EMULATION)
  emulated_mma(c, a, b0, b1);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the host only picks these kernels on compute capability 8.0 and up
#endif
}
// ldmatrix.x4: this lane gives the address of row lane % 8 of submatrix lane / 8 (16 bytes).
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const bf16* row) {
#if defined(MT_CUDA_EMULATION)
  emulated_ldmatrix_x4(r, row, Trans);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row)));
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0u;
  __trap();
#endif
}
// cp.async of Bytes (16, or 4 for lse and delta); with !valid nothing is read and the bytes are
// zero-filled. 16-byte copies skip L1 (.cg: each tile is read once per block); 4-byte ones can't.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src, bool valid) {
  static_assert(Bytes == 4 || Bytes == 16, "cp.async copies 4 or 16 bytes here");
#if defined(MT_CUDA_EMULATION)
  emulated_cp_async(dst, src, Bytes, valid ? Bytes : 0);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (Bytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
#else
  (void)dst, (void)src, (void)valid;
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(MT_CUDA_EMULATION)
  emulated_cp_async_commit();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
// Waits until at most N of this thread's newest committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(MT_CUDA_EMULATION)
  emulated_cp_async_wait(N);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// A fragment: rows row0..row0+15, columns col0..col0+15 of a shared tile with row pitch P.
template <int P>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* tile, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4<false>(a,
                 tile + (row0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * P + col0 + 8 * (lane >> 4));
}
// B fragments of n-tiles n0 and n0 + 8 of B = tile^T (B[kk][n] = tile[n][k0 + kk]: K in Q K^T):
// b[0], b[1] for n0, b[2], b[3] for n0 + 8.
template <int P>
__device__ __forceinline__ void load_bt2(uint32_t (&b)[4], const bf16* tile, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4<false>(b, tile + (n0 + (lane & 7) + 8 * (lane >> 4)) * P + k0 + 8 * ((lane >> 3) & 1));
}
// B fragments of n-tiles n0 and n0 + 8 of B = tile (B[kk][n] = tile[k0 + kk][n]: V in P V).
template <int P>
__device__ __forceinline__ void load_b2(uint32_t (&b)[4], const bf16* tile, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4<true>(b, tile + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * P + n0 + 8 * (lane >> 4));
}
// The A fragment of one 16-wide k-step from the C fragments of n-tiles 2s and 2s + 1.
__device__ __forceinline__ void a_from_c(uint32_t (&a)[4], const float (&c0)[4],
                                         const float (&c1)[4]) {
  a[0] = pack_f32(c0[0], c0[1]);
  a[1] = pack_f32(c0[2], c0[3]);
  a[2] = pack_f32(c1[0], c1[1]);
  a[3] = pack_f32(c1[2], c1[3]);
}
// The A fragments of rows row0..row0+15 of a shared [rows][D + 8] tile, one per k-step.
template <int D>
__device__ __forceinline__ void load_rows(uint32_t (&a)[D / 16][4], const bf16* tile, int row0) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a<D + 8>(a[kk], tile, row0, kk * 16);
}
// s [16 x 8 NT] += A [16 x D] @ tile^T (tile [8 NT][D + 8]: K in Q K^T), one k-step's A fragment
// at a time: from registers (a_regs) or from rows row0.. of a shared tile.
template <int D, int NT = 8>
__device__ __forceinline__ void mma_abt(float (&s)[NT][4], const uint32_t (&a_regs)[D / 16][4],
                                        const bf16* tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t b[4];
      load_bt2<D + 8>(b, tile, nt * 8, kk * 16);
      mma(s[nt], a_regs[kk], b[0], b[1]);
      mma(s[nt + 1], a_regs[kk], b[2], b[3]);
    }
  }
}
template <int D, int NT = 8>
__device__ __forceinline__ void mma_abt(float (&s)[NT][4], const bf16* a_tile, int row0,
                                        const bf16* tile) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t a[4];
    load_a<D + 8>(a, a_tile, row0, kk * 16);
#pragma unroll
    for (int nt = 0; nt < NT; nt += 2) {
      uint32_t b[4];
      load_bt2<D + 8>(b, tile, nt * 8, kk * 16);
      mma(s[nt], a, b[0], b[1]);
      mma(s[nt + 1], a, b[2], b[3]);
    }
  }
}
// acc [16 x D] += C [16 x 8 NT] @ tile (tile [8 NT][D + 8]: V in P V), C as the f32 C fragments
// of a previous product, rounded to bf16.
template <int D, int NT = 8>
__device__ __forceinline__ void mma_cb(float (&acc)[D / 8][4], const float (&c)[NT][4],
                                       const bf16* tile) {
#pragma unroll
  for (int kk = 0; kk < NT / 2; ++kk) {
    uint32_t a[4];
    a_from_c(a, c[2 * kk], c[2 * kk + 1]);
#pragma unroll
    for (int nt = 0; nt < D / 8; nt += 2) {
      uint32_t b[4];
      load_b2<D + 8>(b, tile, kk * 16, nt * 8);
      mma(acc[nt], a, b[0], b[1]);
      mma(acc[nt + 1], a, b[2], b[3]);
    }
  }
}
// Starts copying rows [0, Rows) of a shared [Rows][D + 8] tile from global rows `stride` elements
// apart, 16 bytes per cp.async over the block's Threads threads; rows n and beyond are zeros.
// Thread t copies chunk t % (D / 8) of rows t / (D / 8) + i Threads / (D / 8): the same chunk of
// every row it copies, so its addresses are one base and a constant step (a few instructions a
// copy: this runs for every streamed tile).
template <int D, int Rows, int Threads>
__device__ __forceinline__ void copy_tile(bf16* dst, const bf16* src, int64_t stride, int64_t n) {
  constexpr int kChunks = D / 8, kStep = Threads / kChunks;
  static_assert(Threads % kChunks == 0 && Rows % kStep == 0, "copy_tile's threads and rows");
  const int t = static_cast<int>(threadIdx.x);
  const int r0 = t / kChunks, c = (t % kChunks) * 8;
  const int rows = n < Rows ? static_cast<int>(n) : Rows;
  const bf16* s = src + r0 * stride + c;
  bf16* d = dst + r0 * (D + 8) + c;
  const int64_t step = kStep * stride;
  if (rows == Rows) {  // every tile but the last of a sequence: no row test
#pragma unroll
    for (int i = 0; i < Rows / kStep; ++i)
      cp_async<16>(d + i * kStep * (D + 8), s + i * step, true);
    return;
  }
#pragma unroll
  for (int i = 0; i < Rows / kStep; ++i) {
    const bool ok = r0 + i * kStep < rows;
    cp_async<16>(d + i * kStep * (D + 8), ok ? s + i * step : src, ok);
  }
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// How the query rows [i0, i0 + ni) meet the keys [j0, j0 + nj) (a warp's 16 rows against a
// streamed tile, or a streamed query tile against a warp's 16 key rows): `none` when no pair is
// visible under causal and window, whatever the segment ids; `all` when every pair is, there are
// no segment ids and both ranges lie inside the sequences, so no element needs a mask.
struct Overlap {
  bool none, all;
};
__device__ __forceinline__ Overlap overlap(const Flash& f, int64_t i0, int64_t ni, int64_t j0,
                                           int64_t nj) {
  const AttnArgs& a = f.a;
  const int64_t p0 = a.offset + i0, p1 = a.offset + i0 + ni - 1, j1 = j0 + nj - 1;
  Overlap r;
  r.none = (a.causal && j0 > p1) || (a.window > 0 && p0 - j1 >= a.window);
  r.all = !f.q_seg && i0 + ni <= a.T && j1 < a.S && (!a.causal || j1 <= p0) &&
          (a.window <= 0 || p1 - j0 < a.window);
  return r;
}

// The rows of a query tile this thread holds in C fragments: gid and gid + 8 of its warp's 16.
struct QueryRows {
  int64_t i[2], pos[2];
  bool valid[2];
  int32_t seg[2];
  __device__ QueryRows(const Flash& f, int64_t b, int64_t q0) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = 0; r < 2; ++r) {
      i[r] = q0 + warp * 16 + (lane >> 2) + 8 * r;
      valid[r] = i[r] < f.a.T;
      pos[r] = f.a.offset + i[r];
      seg[r] = f.q_seg && valid[r] ? f.q_seg[b * f.a.T + i[r]] : 0;
    }
  }
};
// Keys [lo, hi) any query of tile [q0, q0 + rows) may see, lo rounded down to a key tile.
__device__ __forceinline__ void tile_key_range(const AttnArgs& a, int64_t q0, int64_t rows,
                                               int64_t& lo, int64_t& hi) {
  const int64_t last = (q0 + rows < a.T ? q0 + rows : a.T) - 1;
  hi = a.causal && a.offset + last + 1 < a.S ? a.offset + last + 1 : a.S;
  lo = a.window > 0 && a.offset + q0 - a.window + 1 > 0 ? a.offset + q0 - a.window + 1 : 0;
  lo = lo / kTile * kTile;
}
// 2^x on the special-function unit, denormal results flushed to zero (softmax weights below
// 2^-126 of the row's largest count for nothing next to it); 2^-inf = 0.
__device__ __forceinline__ float fast_exp2(float x) {
#if defined(MT_CUDA_EMULATION)
  return exp2f(x);
#elif defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// The tensor-core kernels keep scores in log2 units, y = x log2(e) for the capped score x, so
// that each softmax weight is one FMA (or subtraction) and one ex2. Without a soft-cap (Cap =
// false, the kernels' common instance: no tanh in their code at all) y = dot scale log2(e); with
// one, y = cap log2(e) tanh(dot scale / cap), and d x / d s = 1 - (y / (cap log2(e)))^2.
struct Scores {
  float mul;    // dot -> y without a cap; dot -> tanh's argument with one
  float cap2;   // cap log2(e)
  float icap2;  // 1 / (cap log2(e))
  __device__ explicit Scores(const AttnArgs& a)
      : mul(a.cap > 0.f ? a.scale / a.cap : a.scale * kLog2e),
        cap2(a.cap * kLog2e),
        icap2(a.cap > 0.f ? 1.f / (a.cap * kLog2e) : 0.f) {}
  template <bool Cap>
  __device__ __forceinline__ float of(float dot) const {
    if constexpr (Cap)
      return cap2 * tanhf(dot * mul);
    else
      return dot * mul;
  }
  template <bool Cap>
  __device__ __forceinline__ float grad(float y) const {
    if constexpr (Cap) {
      const float t = y * icap2;
      return 1.f - t * t;
    } else {
      return 1.f;
    }
  }
};

// Clamps x - base into [0, n]: an index range of the 64-bit sequence as columns of one tile.
__device__ __forceinline__ int tile_cols(int64_t x, int64_t base, int n) {
  const int64_t c = x - base;
  return c < 0 ? 0 : c > n ? n : static_cast<int>(c);
}
// A warp's 16 x 64 tile of dots (C fragments: element e of n-tile nt is key k0 + 8 nt + 2 tq +
// (e & 1) of query row e >> 1) into scores in log2 units, -inf where masked. Masked = false for
// the tiles every row of the warp sees whole (Overlap::all): no per-element test at all; else
// each row's visible keys under causal, window and the sequence ends are one range of columns
// (32-bit compares per element), and segment ids, when given, are compared per element.
template <bool Cap, bool Masked>
__device__ __forceinline__ void tile_scores(float (&s)[8][4], const Flash& f, const Scores& sc,
                                            const QueryRows& qr, int64_t b, int64_t k0) {
  const AttnArgs& a = f.a;
  const int tq = threadIdx.x & 3;
  int lo[2] = {0, 0}, hi[2] = {kTile, kTile};
  if constexpr (Masked) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      int64_t kl, kh;
      key_range(a, qr.pos[r], a.S, kl, kh);
      lo[r] = tile_cols(kl, k0, kTile);
      hi[r] = qr.valid[r] ? tile_cols(kh, k0, kTile) : 0;
    }
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float y = sc.of<Cap>(s[nt][e]);
      if constexpr (Masked) {
        const int r = e >> 1, col = nt * 8 + 2 * tq + (e & 1);
        bool vis = col >= lo[r] && col < hi[r];
        if (f.q_seg) vis = vis && f.kv_seg[b * a.S + k0 + col] == qr.seg[r];
        s[nt][e] = vis ? y : -INFINITY;
      } else {
        s[nt][e] = y;
      }
    }
  }
}

// The key and value tiles a forward or dq block streams: two buffers each of kTile rows in shared
// memory (ks, vs), filled from the rows of one kv head (k + base, v + base, rows stride apart).
template <int D, int W>
struct KvStream {
  static constexpr int P = D + 8;
  bf16* ks;
  bf16* vs;
  const bf16* k;
  const bf16* v;
  int64_t base, stride, S;
  // Starts copying the tiles at key k0 into buffer buf, as one cp.async group.
  __device__ void copy(int64_t k0, int buf) const {
    const int64_t off = base + k0 * stride;
    copy_tile<D, kTile, W * 32>(ks + buf * kTile * P, k + off, stride, S - k0);
    copy_tile<D, kTile, W * 32>(vs + buf * kTile * P, v + off, stride, S - k0);
    cp_async_commit();
  }
  // Starts the tiles after k0 (if below hi) into the other buffer, then waits until the tiles at
  // k0 (buffer buf) have landed for every thread of the block.
  __device__ void next(int64_t k0, int64_t hi, int buf) const {
    if (k0 + kTile < hi) {
      copy(k0 + kTile, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
  }
  __device__ const bf16* key(int buf) const { return ks + buf * kTile * P; }
  __device__ const bf16* value(int buf) const { return vs + buf * kTile * P; }
};

// Forward: block (query tile, b Hq + h), the query tiles in reverse so that under a causal mask
// the longest rows start first; warp w owns query rows 16w..16w+15 of the tile. The online
// softmax runs in log2 units (Scores): running max m and per-thread partial row sums l (the
// quad's four summed once at the end), rescaled by 2^(m_old - m_new) per tile.
template <int D, int W, bool Cap>
__global__ void __launch_bounds__(W * 32)
    tc_fwd_kernel(const bf16* q, const bf16* k, const bf16* v, Flash f, Out o, float* lse) {
  MT_KERNEL_PROLOGUE();
  constexpr int P = D + 8, QT = 16 * W;
  MT_DYNAMIC_SHARED(smem);
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* ks = qs + QT * P;         // two buffers of kTile rows
  bf16* vs = ks + 2 * kTile * P;  // likewise
  const AttnArgs& a = f.a;
  const int warp = threadIdx.x >> 5, tq = threadIdx.x & 3;
  const int64_t bh = blockIdx.y, b = bh / a.Hq, h = bh % a.Hq, g = h / f.group;
  const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * QT;
  int64_t lo, hi;
  tile_key_range(a, q0, QT, lo, hi);
  const KvStream<D, W> kv{ks, vs, k, v, (b * a.S * a.Hkv + g) * D, a.Hkv * D, a.S};
  copy_tile<D, QT, W * 32>(qs, q + ((b * a.T + q0) * a.Hq + h) * D, a.Hq * D, a.T - q0);
  cp_async_commit();
  if (lo < hi) {
    kv.copy(lo, 0);
    cp_async_wait<1>();  // the query tile
  } else {
    cp_async_wait<0>();
  }
  const QueryRows qr(f, b, q0);
  __syncthreads();
  uint32_t qa[D / 16][4];
  load_rows<D>(qa, qs, warp * 16);

  const Scores sc(a);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float acc[D / 8][4] = {};
  int buf = 0;
  for (int64_t k0 = lo; k0 < hi; k0 += kTile, buf ^= 1) {
    kv.next(k0, hi, buf);  // the next key tile in flight while this one is used
    const Overlap ov = overlap(f, q0 + warp * 16, 16, k0, kTile);
    if (!ov.none) {
      float s[8][4] = {};
      mma_abt<D>(s, qa, kv.key(buf));
      if (ov.all)
        tile_scores<Cap, false>(s, f, sc, qr, b, k0);
      else
        tile_scores<Cap, true>(s, f, sc, qr, b, k0);
      float mx[2] = {m[0], m[1]};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
      }
      float corr[2], base[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mx[r] = quad_max(mx[r]);
        base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // nothing visible yet: no NaN from -inf + inf
        corr[r] = fast_exp2(m[r] - base[r]);
        m[r] = mx[r];
        l[r] *= corr[r];
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[nt][e] = fast_exp2(s[nt][e] - base[e >> 1]);
          l[e >> 1] += s[nt][e];
        }
      }
      // Rescale only when some row's max moved (corr < 1): the max settles after the first
      // tiles, and skipping a multiplication by exactly 1 changes no bit.
      if (__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) {
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[nt][e] *= corr[e >> 1];
        }
      }
      mma_cb<D>(acc, s, kv.value(buf));
    }
    __syncthreads();  // every warp is done with this buffer before it is refilled
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      if (qr.valid[r])
        o.set(((b * a.T + qr.i[r]) * a.Hq + h) * D + nt * 8 + 2 * tq + (e & 1),
              acc[nt][e] * inv[r]);
    }
  }
  if (tq == 0) {
    constexpr float kLn2 = 0.6931471805599453f;
    for (int r = 0; r < 2; ++r)
      if (qr.valid[r])
        lse[bh * a.T + qr.i[r]] = isnan(l[r])  ? NAN
                                  : l[r] > 0.f ? m[r] * kLn2 + logf(l[r])
                                               : -INFINITY;
  }
}

// dq: block (query tile, b Hq + h), as the forward; dS = P (dP - delta) cap' with dP = dO V^T,
// then dq += scale dS K.
template <int D, int W, bool Cap>
__global__ void __launch_bounds__(W * 32)
    tc_dq_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, Flash f,
                 const float* lse, const float* delta, Out dq) {
  MT_KERNEL_PROLOGUE();
  constexpr int P = D + 8, QT = 16 * W;
  MT_DYNAMIC_SHARED(smem);
  bf16* qs = reinterpret_cast<bf16*>(smem);
  bf16* dos = qs + QT * P;
  bf16* ks = dos + QT * P;        // two buffers of kTile rows
  bf16* vs = ks + 2 * kTile * P;  // likewise
  const AttnArgs& a = f.a;
  const int warp = threadIdx.x >> 5, tq = threadIdx.x & 3;
  const int64_t bh = blockIdx.y, b = bh / a.Hq, h = bh % a.Hq, g = h / f.group;
  const int64_t q0 = static_cast<int64_t>(gridDim.x - 1 - blockIdx.x) * QT;
  int64_t lo, hi;
  tile_key_range(a, q0, QT, lo, hi);
  const int64_t q_off = ((b * a.T + q0) * a.Hq + h) * D;
  const KvStream<D, W> kv{ks, vs, k, v, (b * a.S * a.Hkv + g) * D, a.Hkv * D, a.S};
  copy_tile<D, QT, W * 32>(qs, q + q_off, a.Hq * D, a.T - q0);
  copy_tile<D, QT, W * 32>(dos, dout + q_off, a.Hq * D, a.T - q0);
  cp_async_commit();
  if (lo < hi) {
    kv.copy(lo, 0);
    cp_async_wait<1>();  // the query and dO tiles
  } else {
    cp_async_wait<0>();
  }
  const QueryRows qr(f, b, q0);
  // -lse log2(e) and delta per row. A row that saw no key (lse = -inf) or lies past the
  // sequence gets -inf: all its weights 2^(y - inf) are 0, so no gradient flows through it.
  float nls[2], dl[2];
  for (int r = 0; r < 2; ++r) {
    const float ls = qr.valid[r] ? lse[bh * a.T + qr.i[r]] : -INFINITY;
    nls[r] = ls == -INFINITY ? -INFINITY : -ls * kLog2e;
    dl[r] = qr.valid[r] ? delta[bh * a.T + qr.i[r]] : 0.f;
  }
  const Scores sc(a);
  __syncthreads();
  uint32_t qa[D / 16][4];
  load_rows<D>(qa, qs, warp * 16);

  float acc[D / 8][4] = {};
  int buf = 0;
  for (int64_t k0 = lo; k0 < hi; k0 += kTile, buf ^= 1) {
    kv.next(k0, hi, buf);
    const Overlap ov = overlap(f, q0 + warp * 16, 16, k0, kTile);
    if (!ov.none) {
      const bf16* kt = kv.key(buf);
      float s[8][4] = {}, dp[8][4] = {};
      mma_abt<D>(s, qa, kt);                          // S = Q K^T
      mma_abt<D>(dp, dos, warp * 16, kv.value(buf));  // dP = dO V^T
      if (ov.all)
        tile_scores<Cap, false>(s, f, sc, qr, b, k0);
      else
        tile_scores<Cap, true>(s, f, sc, qr, b, k0);
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const float y = s[nt][e], p = fast_exp2(y + nls[r]);
          const float ds = p * (dp[nt][e] - dl[r]);
          // With a cap, a masked y = -inf has no finite derivative: its weight p = 0 decides.
          s[nt][e] = Cap ? (p > 0.f ? ds * sc.grad<Cap>(y) : 0.f) : ds;
        }
      }
      mma_cb<D>(acc, s, kt);  // dq += dS K
    }
    __syncthreads();
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      if (qr.valid[r])
        dq.add(((b * a.T + qr.i[r]) * a.Hq + h) * D + nt * 8 + 2 * tq + (e & 1),
               a.scale * acc[nt][e]);
    }
  }
}

// dk/dv's elementwise step on a warp's S^T and dP^T (rows: its 16 keys kj, columns: the 8 NT
// queries from q0, whose lse and delta are lst and dlt): st becomes P^T, dpt dS^T. All: every
// pair is visible (see Overlap), no mask. Scores in log2 units as the forward's (Scores).
template <bool Cap, bool All, int NT>
__device__ __forceinline__ void dkv_scores(const Flash& f, const Scores& sc, float (&st)[NT][4],
                                           float (&dpt)[NT][4], const float* lst, const float* dlt,
                                           int64_t q0, int64_t b, const int64_t (&kj)[2],
                                           const int32_t (&kseg)[2]) {
  const AttnArgs& a = f.a;
  const int tq = threadIdx.x & 3;
  // The queries i that key row r may see, as columns [lo, hi) of this slice: causal wants
  // offset + i >= kj, the window offset + i - kj < window, and i < T.
  int lo[2] = {0, 0}, hi[2] = {8 * NT, 8 * NT};
  if constexpr (!All) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t il = a.causal ? kj[r] - a.offset : 0;
      int64_t ih = a.window > 0 ? kj[r] - a.offset + a.window : a.T;
      ih = ih < a.T ? ih : a.T;
      lo[r] = tile_cols(il, q0, 8 * NT);
      hi[r] = kj[r] < a.S ? tile_cols(ih, q0, 8 * NT) : 0;
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1, il = nt * 8 + 2 * tq + (e & 1);
      const float ls = lst[il];  // finite wherever every pair is visible
      bool vis = true;
      if constexpr (!All) {
        vis = il >= lo[r] && il < hi[r] && ls != -INFINITY;
        if (f.q_seg) vis = vis && f.q_seg[b * a.T + q0 + il] == kseg[r];
      }
      const float y = sc.of<Cap>(st[nt][e]);
      const float pe = vis ? fast_exp2(fmaf(ls, -kLog2e, y)) : 0.f;
      dpt[nt][e] = vis ? pe * (dpt[nt][e] - dlt[il]) * sc.grad<Cap>(y) : 0.f;
      st[nt][e] = pe;
    }
  }
}

// dk, dv: block (key tile, b Hkv + g); warp w owns key rows 16w..16w+15 of the 16 W. The block
// streams, for each query head of the group, the 64-row query tiles that may see these keys
// (with their lse and delta): S^T = K Q^T, dP^T = V dO^T, dv += P^T dO, dk += scale dS^T Q.
// Parts: a warp takes a streamed tile in that many slices of 64 / Parts queries. The dk and dv
// accumulators hold 2 D / 8 registers a lane and S^T and dP^T 2 x 64 / (8 Parts) more; at
// head_dim 128 whole tiles need more than the 255 registers a thread has (ptxas spills), two
// slices of 32 do not, at the price of loading the warp's K and V fragments once per slice. The
// mma.sync sequence into each accumulator is the same either way, so the results are the same
// bits; a slice no key of the warp may see is skipped, and one it sees whole is not masked.
template <int D, int W, int Parts, bool Cap>
__global__ void __launch_bounds__(W * 32)
    tc_dkv_kernel(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, Flash f,
                  const float* lse, const float* delta, Out dk, Out dv) {
  MT_KERNEL_PROLOGUE();
  constexpr int P = D + 8, KT = 16 * W;
  MT_DYNAMIC_SHARED(smem);
  bf16* ks = reinterpret_cast<bf16*>(smem);
  bf16* vs = ks + KT * P;
  bf16* qs = vs + KT * P;                                       // two buffers of kTile rows
  bf16* dos = qs + 2 * kTile * P;                               // likewise
  float* ls_s = reinterpret_cast<float*>(dos + 2 * kTile * P);  // [2][kTile]
  float* dl_s = ls_s + 2 * kTile;                               // [2][kTile]
  const AttnArgs& a = f.a;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tq = lane & 3;
  const int64_t bg = blockIdx.y, b = bg / a.Hkv, g = bg % a.Hkv;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * KT;
  const int64_t kv_off = ((b * a.S + k0) * a.Hkv + g) * D;
  copy_tile<D, KT, W * 32>(ks, k + kv_off, a.Hkv * D, a.S - k0);
  copy_tile<D, KT, W * 32>(vs, v + kv_off, a.Hkv * D, a.S - k0);
  cp_async_commit();
  int64_t kj[2];  // the key rows this thread holds: gid and gid + 8 of its warp's 16
  int32_t kseg[2];
  for (int r = 0; r < 2; ++r) {
    kj[r] = k0 + warp * 16 + gid + 8 * r;
    kseg[r] = f.kv_seg && kj[r] < a.S ? f.kv_seg[b * a.S + kj[r]] : 0;
  }
  // Queries that may see a key of this tile (see simt_dkv_kernel), lo rounded down to a tile.
  const int64_t last = (k0 + KT < a.S ? k0 + KT : a.S) - 1;
  int64_t lo = a.causal && k0 - a.offset > 0 ? k0 - a.offset : 0;
  lo = lo / kTile * kTile;
  const int64_t hi =
      a.window > 0 && last - a.offset + a.window < a.T ? last - a.offset + a.window : a.T;
  // The streamed query tiles in order: for each query head of the group, the 64-row tiles in
  // [lo, hi); (ih, iq0) is the next one to copy, into buffer ib.
  int64_t ih = g * f.group, iq0 = lo;
  int ib = 0;
  const auto issue = [&]() {
    const int64_t q_off = ((b * a.T + iq0) * a.Hq + ih) * D, r0 = (b * a.Hq + ih) * a.T + iq0;
    copy_tile<D, kTile, W * 32>(qs + ib * kTile * P, q + q_off, a.Hq * D, a.T - iq0);
    copy_tile<D, kTile, W * 32>(dos + ib * kTile * P, dout + q_off, a.Hq * D, a.T - iq0);
    if (threadIdx.x < kTile) {
      const bool ok = iq0 + threadIdx.x < a.T;
      cp_async<4>(ls_s + ib * kTile + threadIdx.x, ok ? lse + r0 + threadIdx.x : lse, ok);
      cp_async<4>(dl_s + ib * kTile + threadIdx.x, ok ? delta + r0 + threadIdx.x : delta, ok);
    }
    cp_async_commit();
    ib ^= 1;
    iq0 += kTile;
    if (iq0 >= hi) iq0 = lo, ++ih;
  };
  const int tiles = hi > lo ? static_cast<int>((hi - lo + kTile - 1) / kTile) : 0;
  const int steps = static_cast<int>(f.group) * tiles;
  if (steps > 0) issue();

  const Scores sc(a);
  float ak[D / 8][4] = {}, av[D / 8][4] = {};
  int64_t q0 = lo;
  for (int step = 0; step < steps; ++step) {
    if (step + 1 < steps) {  // the next query tile into the other buffer, in flight meanwhile
      issue();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int bi = step & 1;
    const bf16* qt = qs + bi * kTile * P;
    const bf16* dot = dos + bi * kTile * P;
    const float* lst = ls_s + bi * kTile;
    const float* dlt = dl_s + bi * kTile;
#pragma unroll
    for (int part = 0; part < Parts; ++part) {
      constexpr int NQ = kTile / Parts, NT = NQ / 8;
      const Overlap ov = overlap(f, q0 + part * NQ, NQ, k0 + warp * 16, 16);
      if (ov.none) continue;
      const bf16* qp = qt + part * NQ * P;
      const bf16* dop = dot + part * NQ * P;
      float st[NT][4] = {}, dpt[NT][4] = {};
      mma_abt<D, NT>(st, ks, warp * 16, qp);    // S^T = K Q^T
      mma_abt<D, NT>(dpt, vs, warp * 16, dop);  // dP^T = V dO^T
      if (ov.all)
        dkv_scores<Cap, true>(f, sc, st, dpt, lst + part * NQ, dlt + part * NQ, q0 + part * NQ, b,
                              kj, kseg);
      else
        dkv_scores<Cap, false>(f, sc, st, dpt, lst + part * NQ, dlt + part * NQ, q0 + part * NQ, b,
                               kj, kseg);
      mma_cb<D, NT>(av, st, dop);  // dv += P^T dO
      mma_cb<D, NT>(ak, dpt, qp);  // dk += dS^T Q
    }
    __syncthreads();
    q0 = q0 + kTile < hi ? q0 + kTile : lo;
  }
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = e >> 1;
      if (kj[r] >= a.S) continue;
      const int64_t idx = ((b * a.S + kj[r]) * a.Hkv + g) * D + nt * 8 + 2 * tq + (e & 1);
      dk.add(idx, a.scale * ak[nt][e]);
      dv.add(idx, av[nt][e]);
    }
  }
}

}  // namespace
}  // namespace mt::cuda
