// dot_product attention: the readable reference kernel.
//
// Per (batch, head) it materialises the scaled, capped, masked score matrix [T, S], takes a row
// softmax and multiplies by V; the backward recomputes the same matrices. The score matrices live
// in one scratch block per worker thread, taken from the backend's allocator so that
// memory_stats() shows the O(T * S) cost that flash attention avoids.
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attention/checks.h"
#include "cpu_backend.h"
#include "mt/attention.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

using attention::Dims;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float scale_of(const AttentionSpec& spec, int64_t D) {
  return spec.scale != 0.f ? spec.scale : 1.f / std::sqrt(static_cast<float>(D));
}

// Rows of one head: element (row r, feature d) of head h sits at base + (r * H + h) * D + d.
struct HeadRows {
  const Tensor* t;
  int64_t first;   // element index of row 0
  int64_t stride;  // elements between rows
};

void load_rows(const HeadRows& src, int64_t n, int64_t D, float* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t at = src.first + r * src.stride;
    if (src.t->dtype() == DType::f32) {
      const float* p = src.t->ptr<float>() + at;
      std::copy(p, p + D, dst + r * D);
    } else {
      const uint16_t* p = src.t->ptr<uint16_t>() + at;
      for (int64_t d = 0; d < D; ++d) dst[r * D + d] = bf16_to_f32(p[d]);
    }
  }
}

// dst rows = src (accumulate = false) or dst rows += src (accumulate = true).
void store_rows(Tensor& t, int64_t first, int64_t stride, int64_t n, int64_t D, const float* src,
                bool accumulate) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t at = first + r * stride;
    if (t.dtype() == DType::f32) {
      float* p = t.ptr<float>() + at;
      for (int64_t d = 0; d < D; ++d) p[d] = accumulate ? p[d] + src[r * D + d] : src[r * D + d];
    } else {
      uint16_t* p = t.ptr<uint16_t>() + at;
      for (int64_t d = 0; d < D; ++d) {
        const float x = accumulate ? bf16_to_f32(p[d]) + src[r * D + d] : src[r * D + d];
        p[d] = f32_to_bf16(x);
      }
    }
  }
}

// Visibility of key j to query i (attention.h): positions are i + offset and j.
struct Mask {
  bool causal;
  int64_t window;
  int64_t offset;
  const int32_t* q_seg;   // [T] of this batch row, or null
  const int32_t* kv_seg;  // [S]
  bool visible(int64_t i, int64_t j) const {
    const int64_t p = i + offset;
    if (causal && j > p) return false;
    if (window > 0 && p - j >= window) return false;
    if (q_seg && q_seg[i] != kv_seg[j]) return false;
    return true;
  }
};

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Scores [T, S] = softcap(scale * Q K^T), masked entries -inf. Q [T, D], K [S, D].
void scores(const float* Q, const float* K, int64_t T, int64_t S, int64_t D, float scale, float cap,
            const Mask& mask, float* sc) {
  for (int64_t i = 0; i < T; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      float s = kNegInf;
      if (mask.visible(i, j)) {
        s = scale * dot(Q + i * D, K + j * D, D);
        if (cap > 0.f) s = cap * std::tanh(s / cap);
      }
      sc[i * S + j] = s;
    }
  }
}

// In place: sc [T, S] -> softmax rows P; lse [T] (or null). A row with no visible key becomes
// all zeros with lse -inf.
void softmax_rows(float* sc, int64_t T, int64_t S, float* lse) {
  for (int64_t i = 0; i < T; ++i) {
    float* row = sc + i * S;
    float m = kNegInf;
    for (int64_t j = 0; j < S; ++j) m = std::max(m, row[j]);
    if (m == kNegInf) {
      // Every visible score NaN (a NaN query: std::max passes over NaN): NaN, as the softmax
      // is, not the zeros of a row without a visible key.
      const bool nan = std::any_of(row, row + S, [](float x) { return std::isnan(x); });
      std::fill(row, row + S, nan ? std::numeric_limits<float>::quiet_NaN() : 0.f);
      if (lse) lse[i] = nan ? std::numeric_limits<float>::quiet_NaN() : kNegInf;
      continue;
    }
    float sum = 0.f;
    for (int64_t j = 0; j < S; ++j) {
      row[j] = std::exp(row[j] - m);
      sum += row[j];
    }
    for (int64_t j = 0; j < S; ++j) row[j] /= sum;
    if (lse) lse[i] = m + std::log(sum);
  }
}

// O [T, D] = P [T, S] V [S, D]
void matmul_pv(const float* P, const float* V, int64_t T, int64_t S, int64_t D, float* O) {
  std::fill(O, O + T * D, 0.f);
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < S; ++j) {
      const float p = P[i * S + j];
      if (p == 0.f) continue;
      for (int64_t d = 0; d < D; ++d) O[i * D + d] += p * V[j * D + d];
    }
}

class DotProductAttention final : public AttentionKernel {
 public:
  explicit DotProductAttention(CpuBackend& b) : backend_(b) {}
  std::string name() const override { return "dot_product"; }

  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_segment,
               const Tensor& kv_segment, const AttentionSpec& spec, Tensor& out,
               Tensor& lse) override {
    const std::string op = "dot_product attention forward";
    const Dims n = attention::check_forward(op, q, k, v, q_segment, kv_segment, spec, out, lse);
    if (q.numel() == 0) return;
    Tensor scratch = slots(n.T * n.S);
    backend_.run([&] {
      tbb::parallel_for(int64_t{0}, n.B * n.Hq, [&](int64_t bh) {
        const int64_t b = bh / n.Hq, h = bh % n.Hq, g = h / (n.Hq / n.Hkv);
        std::vector<float> Q(n.T * n.D), K(n.S * n.D), V(n.S * n.D), O(n.T * n.D);
        load_rows({&q, (b * n.T * n.Hq + h) * n.D, n.Hq * n.D}, n.T, n.D, Q.data());
        load_rows({&k, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, n.S, n.D, K.data());
        load_rows({&v, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, n.S, n.D, V.data());
        const Mask mask = mask_of(spec, spec.query_offset, q_segment, kv_segment, b, n);
        float* sc = slot(scratch, n.T * n.S);
        scores(Q.data(), K.data(), n.T, n.S, n.D, scale_of(spec, n.D), spec.softcap, mask, sc);
        softmax_rows(sc, n.T, n.S, lse.ptr<float>() + bh * n.T);
        matmul_pv(sc, V.data(), n.T, n.S, n.D, O.data());
        store_rows(out, (b * n.T * n.Hq + h) * n.D, n.Hq * n.D, n.T, n.D, O.data(), false);
      });
    });
  }

  void backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                const Tensor& q_segment, const Tensor& kv_segment, const Tensor& out,
                const Tensor& lse, const AttentionSpec& spec, Tensor& dq, Tensor& dk,
                Tensor& dv) override {
    const std::string op = "dot_product attention backward";
    const Dims n = attention::check_backward(op, dout, q, k, v, q_segment, kv_segment, out, lse,
                                             spec, dq, dk, dv);
    if (q.numel() == 0 || k.numel() == 0) return;
    const int64_t TS = n.T * n.S;
    Tensor scratch = slots(2 * TS);
    const float scale = scale_of(spec, n.D), cap = spec.softcap;
    const int64_t group = n.Hq / n.Hkv;
    backend_.run([&] {
      // One task per kv head: the q heads sharing it add into the same dk/dv rows, so they run
      // in sequence inside the task (race-free and in a fixed order).
      tbb::parallel_for(int64_t{0}, n.B * n.Hkv, [&](int64_t bg) {
        const int64_t b = bg / n.Hkv, g = bg % n.Hkv;
        std::vector<float> Q(n.T * n.D), K(n.S * n.D), V(n.S * n.D), dO(n.T * n.D), dQ(n.T * n.D),
            dK(n.S * n.D, 0.f), dV(n.S * n.D, 0.f), dp(n.S);
        load_rows({&k, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, n.S, n.D, K.data());
        load_rows({&v, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, n.S, n.D, V.data());
        const Mask mask = mask_of(spec, spec.query_offset, q_segment, kv_segment, b, n);
        float* sc = slot(scratch, 2 * TS);  // capped scores, later dS
        float* P = sc + TS;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const int64_t q_first = (b * n.T * n.Hq + h) * n.D;
          load_rows({&q, q_first, n.Hq * n.D}, n.T, n.D, Q.data());
          load_rows({&dout, q_first, n.Hq * n.D}, n.T, n.D, dO.data());
          scores(Q.data(), K.data(), n.T, n.S, n.D, scale, cap, mask, sc);
          std::copy(sc, sc + TS, P);
          softmax_rows(P, n.T, n.S, nullptr);
          std::fill(dQ.begin(), dQ.end(), 0.f);
          for (int64_t i = 0; i < n.T; ++i) {
            const float* p = P + i * n.S;
            float* ds = sc + i * n.S;
            // dP_ij = dO_i . V_j; through the softmax: dS_ij = P_ij (dP_ij - sum_j P_ij dP_ij).
            float rowdot = 0.f;
            for (int64_t j = 0; j < n.S; ++j) {
              dp[j] = p[j] != 0.f ? dot(dO.data() + i * n.D, V.data() + j * n.D, n.D) : 0.f;
              rowdot += p[j] * dp[j];
            }
            for (int64_t j = 0; j < n.S; ++j) {
              float g_s = p[j] * (dp[j] - rowdot);
              // Through the cap: d(c tanh(x / c))/dx = 1 - tanh^2 = 1 - (capped / c)^2.
              if (cap > 0.f && p[j] != 0.f) {
                const float t = ds[j] / cap;
                g_s *= 1.f - t * t;
              }
              ds[j] = g_s;
            }
            for (int64_t j = 0; j < n.S; ++j) {
              if (p[j] == 0.f && ds[j] == 0.f) continue;
              for (int64_t d = 0; d < n.D; ++d) {
                dQ[i * n.D + d] += scale * ds[j] * K[j * n.D + d];
                dK[j * n.D + d] += scale * ds[j] * Q[i * n.D + d];
                dV[j * n.D + d] += p[j] * dO[i * n.D + d];
              }
            }
          }
          store_rows(dq, q_first, n.Hq * n.D, n.T, n.D, dQ.data(), true);
        }
        const int64_t kv_first = (b * n.S * n.Hkv + g) * n.D;
        store_rows(dk, kv_first, n.Hkv * n.D, n.S, n.D, dK.data(), true);
        store_rows(dv, kv_first, n.Hkv * n.D, n.S, n.D, dV.data(), true);
      });
    });
  }

  void decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& lengths,
              const AttentionSpec& spec, Tensor& out) override {
    const std::string op = "dot_product attention decode";
    const Dims n = attention::check_decode(op, q, k_cache, v_cache, lengths, spec, out);
    const int32_t* len = lengths.ptr<int32_t>();
    if (q.numel() == 0) return;
    Tensor scratch = slots(n.T * n.S);
    backend_.run([&] {
      tbb::parallel_for(int64_t{0}, n.B * n.Hq, [&](int64_t bh) {
        const int64_t b = bh / n.Hq, h = bh % n.Hq, g = h / (n.Hq / n.Hkv);
        const int64_t L = len[b];  // keys [0, L) of this sequence
        std::vector<float> Q(n.T * n.D), K(L * n.D), V(L * n.D), O(n.T * n.D);
        load_rows({&q, (b * n.T * n.Hq + h) * n.D, n.Hq * n.D}, n.T, n.D, Q.data());
        load_rows({&k_cache, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, L, n.D, K.data());
        load_rows({&v_cache, (b * n.S * n.Hkv + g) * n.D, n.Hkv * n.D}, L, n.D, V.data());
        const Mask mask{spec.causal, spec.window, L - n.T, nullptr, nullptr};
        float* sc = slot(scratch, n.T * n.S);
        scores(Q.data(), K.data(), n.T, L, n.D, scale_of(spec, n.D), spec.softcap, mask, sc);
        softmax_rows(sc, n.T, L, nullptr);
        matmul_pv(sc, V.data(), n.T, L, n.D, O.data());
        store_rows(out, (b * n.T * n.Hq + h) * n.D, n.Hq * n.D, n.T, n.D, O.data(), false);
      });
    });
  }

 private:
  static Mask mask_of(const AttentionSpec& spec, int64_t offset, const Tensor& q_seg,
                      const Tensor& kv_seg, int64_t b, const Dims& n) {
    Mask m{spec.causal, spec.window, offset, nullptr, nullptr};
    if (q_seg.defined()) {
      m.q_seg = q_seg.ptr<int32_t>() + b * n.T;
      m.kv_seg = kv_seg.ptr<int32_t>() + b * n.S;
    }
    return m;
  }

  // One block of `per_slot` floats for each thread of the backend's arena.
  Tensor slots(int64_t per_slot) {
    return backend_.empty({std::max(backend_.num_threads(), 1), std::max<int64_t>(per_slot, 1)},
                          DType::f32);
  }
  // The block of the calling thread: arena thread indices are unique among running threads.
  float* slot(const Tensor& scratch, int64_t per_slot) const {
    const int idx = tbb::this_task_arena::current_thread_index();
    MT_CHECK(idx >= 0 && idx < scratch.dim(0), "dot_product attention: thread slot out of range");
    return scratch.ptr<float>() + idx * std::max<int64_t>(per_slot, 1);
  }

  CpuBackend& backend_;
};

}  // namespace

std::unique_ptr<AttentionKernel> make_dot_product_attention(Backend& b) {
  auto* cpu = dynamic_cast<CpuBackend*>(&b);
  MT_CHECK(cpu != nullptr, "dot_product attention (cpu) needs the cpu backend, got " + b.name());
  return std::make_unique<DotProductAttention>(*cpu);
}

}  // namespace mt::cpu
