// Mixture-of-experts ops for the CUDA backend: top-k routing (forward and backward) and the
// grouped matmul (one GEMM per expert with tokens) with its weight gradient.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common.cuh"

namespace mt::cuda {

// ---- top-k routing --------------------------------------------------------------------------
namespace {
// Routing: one thread per token row; E (experts) is small, and the serial loop is the CPU's own
// (moe.cpp), so selection, ties (lower index wins, NaN last) and rounding match it exactly.
// logits [N, E] -> probs [N, E], weights [N, k] (also the sorted keys while selecting),
// indices [N, k]
__global__ void topk_fwd_kernel(In logits, int64_t N, int64_t E, int k, bool sigmoid,
                                bool normalize, float* weights, int32_t* indices, float* probs) {
  MT_KERNEL_PROLOGUE();
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  float* s = probs + n * E;
  for (int64_t e = 0; e < E; ++e) s[e] = logits[n * E + e];
  if (sigmoid) {
    for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + expf(-s[e]));
  } else {
    float mx = -INFINITY;
    for (int64_t e = 0; e < E; ++e) mx = fmaxf(mx, s[e]);
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = expf(s[e] - mx);
      sum += s[e];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t e = 0; e < E; ++e) s[e] *= inv;
  }
  float* key = weights + n * k;
  int32_t* top = indices + n * k;
  int count = 0;
  for (int64_t e = 0; e < E; ++e) {
    const float v = isnan(s[e]) ? -INFINITY : s[e];
    int pos;
    if (count < k) {
      pos = count++;
    } else if (v > key[k - 1]) {
      pos = k - 1;
    } else {
      continue;
    }
    while (pos > 0 && v > key[pos - 1]) {
      key[pos] = key[pos - 1];
      top[pos] = top[pos - 1];
      --pos;
    }
    key[pos] = v;
    top[pos] = static_cast<int32_t>(e);
  }
  float total = 0.f;
  for (int j = 0; j < k; ++j) {
    key[j] = s[top[j]];
    total += key[j];
  }
  if (normalize)
    for (int j = 0; j < k; ++j) key[j] /= total;
}

// dlogits [N, E] += d(weights)/d(logits)^T dweights, per row (the CPU's formulas). A row with an
// index outside [0, E) is recorded in `bad` and left untouched.
__global__ void topk_bwd_kernel(In dweights, In probs, const int32_t* indices, int64_t N, int64_t E,
                                int k, bool sigmoid, bool normalize, Out dlogits,
                                unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const int64_t ps = n * E, ds0 = n * k;
  const int32_t* idx = indices + n * k;
  for (int j = 0; j < k; ++j)
    if (idx[j] < 0 || idx[j] >= E) {
      record_bad(bad, ds0 + j, idx[j]);
      return;
    }
  // With normalize, w_j = s_j / S: ds_j = (dw_j - sum_l dw_l w_l) / S.
  float total = 1.f, dot = 0.f;
  if (normalize) {
    total = 0.f;
    for (int j = 0; j < k; ++j) total += probs[ps + idx[j]];
    for (int j = 0; j < k; ++j) dot += dweights[ds0 + j] * probs[ps + idx[j]];
    dot /= total;
  }
  auto ds = [&](int j) {
    return normalize ? (dweights[ds0 + j] - dot) / total : dweights[ds0 + j];
  };
  if (sigmoid) {
    for (int j = 0; j < k; ++j) {
      const float p = probs[ps + idx[j]];
      dlogits.add(ps + idx[j], ds(j) * p * (1.f - p));
    }
  } else {
    float c = 0.f;
    for (int j = 0; j < k; ++j) c += ds(j) * probs[ps + idx[j]];
    for (int64_t e = 0; e < E; ++e) {
      float g = -probs[ps + e] * c;
      for (int j = 0; j < k; ++j)
        if (idx[j] == e) g += probs[ps + e] * ds(j);
      dlogits.add(ps + e, g);
    }
  }
}

}  // namespace

void topk_route_forward(const Ctx& c, const Tensor& logits, int k, bool sigmoid, bool normalize,
                        Tensor& weights, Tensor& indices, Tensor& probs) {
  auto shapes = [&] {
    return "logits " + str(logits) + ", k " + std::to_string(k) + ", weights " + str(weights) +
           ", indices " + str(indices) + ", probs " + str(probs);
  };
  MT_CHECK(is_fb(logits) && weights.defined() && weights.dtype() == DType::f32 &&
               indices.defined() && indices.dtype() == DType::i32 && probs.defined() &&
               probs.dtype() == DType::f32,
           "cuda topk_route_forward: " + shapes() + " (weights and probs f32, indices i32)");
  const int64_t E = last_dim(logits), N = lead_rows(logits);
  MT_CHECK(k >= 1 && k <= E && weights.numel() == N * k && last_dim(weights) == k &&
               indices.numel() == N * k && last_dim(indices) == k && probs.numel() == N * E &&
               last_dim(probs) == E,
           "cuda topk_route_forward: " + shapes() + " (want k in [1, E], weights/indices [N, k], " +
               "probs [N, E])");
  if (N == 0) return;
  MT_LAUNCH(topk_fwd_kernel, grid_for(N), kThreads, 0, c)
  (in(logits), N, E, k, sigmoid, normalize, weights.ptr<float>(), indices.ptr<int32_t>(),
   probs.ptr<float>());
  launched("topk_route_forward", shapes);
}

void topk_route_backward(const Ctx& c, const Tensor& dweights, const Tensor& weights,
                         const Tensor& indices, const Tensor& probs, bool sigmoid, bool normalize,
                         Tensor& dlogits) {
  auto shapes = [&] {
    return "dweights " + str(dweights) + ", weights " + str(weights) + ", indices " + str(indices) +
           ", probs " + str(probs) + ", dlogits " + str(dlogits);
  };
  MT_CHECK(is_fb(dweights) && is_fb(weights) && is_fb(probs) && is_fb(dlogits) &&
               indices.defined() && indices.dtype() == DType::i32,
           "cuda topk_route_backward: " + shapes());
  const int64_t E = last_dim(probs), N = lead_rows(probs), k = last_dim(indices);
  MT_CHECK(indices.numel() == N * k && dweights.numel() == N * k && weights.numel() == N * k &&
               dlogits.numel() == N * E && last_dim(dlogits) == E && k >= 1 && k <= E,
           "cuda topk_route_backward: " + shapes() +
               " (want dweights/weights/indices [N, k], dlogits [N, E])");
  if (N == 0) return;
  // The indices are checked on the device (reading them back was a synchronisation per MoE
  // layer's backward).
  unsigned long long* bad = c.checks->slot(
      [E](int64_t m, int64_t id) { return bad_row_index("topk_route_backward", m, id, E); });
  MT_LAUNCH(topk_bwd_kernel, grid_for(N), kThreads, 0, c)
  (in(dweights), in(probs), indices.ptr<const int32_t>(), N, E, static_cast<int>(k), sigmoid,
   normalize, out(dlogits), bad);
  launched("topk_route_backward", shapes);
}

// ---- grouped matmul -------------------------------------------------------------------------
namespace {

std::vector<int32_t> read_offsets(const Ctx& c, const Tensor& offsets, int64_t experts,
                                  int64_t rows, const char* op) {
  MT_CHECK(offsets.defined() && offsets.dtype() == DType::i32 && offsets.numel() == experts + 1,
           std::string("cuda ") + op + ": offsets " + str(offsets) +
               " must be i32 with E + 1 = " + std::to_string(experts + 1) + " entries");
  const std::vector<int32_t> off = host_ints(c, offsets, op);
  bool ok = off[0] == 0 && off[experts] == rows;
  for (int64_t e = 0; e < experts; ++e) ok = ok && off[e + 1] >= off[e];
  if (!ok)
    fail(std::string("cuda ") + op + ": offsets must start at 0, not decrease and end at the " +
         "number of rows " + std::to_string(rows) + " (" + str(offsets) + ")");
  return off;
}
}  // namespace

// One GEMM (gemm.cu) per expert with tokens, as the CPU backend does.
void grouped_matmul(const Ctx& c, const Tensor& x, const Tensor& w, const Tensor& offsets,
                    bool trans_w, Tensor& o) {
  constexpr const char* op = "grouped_matmul";
  MT_CHECK(is_fb(x) && is_fb(w) && is_fb(o) && w.ndim() == 3,
           std::string("cuda ") + op + ": x " + str(x) + ", w " + str(w) + ", out " + str(o) +
               " (w must be [E, K, N], or [E, N, K] if trans_w)");
  const int64_t E = w.dim(0);
  const int64_t K = trans_w ? w.dim(2) : w.dim(1), N = trans_w ? w.dim(1) : w.dim(2);
  const int64_t M = lead_rows(x);
  MT_CHECK(last_dim(x) == K && last_dim(o) == N && lead_rows(o) == M,
           std::string("cuda ") + op + ": x " + str(x) + " and w " + str(w) +
               " need x [M, K] and out [M, N], got out " + str(o));
  const std::vector<int32_t> off = read_offsets(c, offsets, E, M, op);
  const Tensor x2 = x.view({M, K});
  const Tensor o2 = o.view({M, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], r1 = off[e + 1];
    if (r0 == r1) continue;
    Tensor oe = o2.slice0(r0, r1);
    matmul(c, x2.slice0(r0, r1), w.slice0(e, e + 1).view({w.dim(1), w.dim(2)}), oe, false, trans_w,
           1.f, 0.f);
  }
}

void grouped_matmul_weight_grad(const Ctx& c, const Tensor& x, const Tensor& dout,
                                const Tensor& offsets, bool trans_w, Tensor& dw) {
  constexpr const char* op = "grouped_matmul_weight_grad";
  MT_CHECK(is_fb(x) && is_fb(dout) && is_fb(dw) && dw.ndim() == 3,
           std::string("cuda ") + op + ": x " + str(x) + ", dout " + str(dout) + ", dw " + str(dw) +
               " (dw must be [E, K, N], or [E, N, K] if trans_w)");
  const int64_t E = dw.dim(0);
  const int64_t K = trans_w ? dw.dim(2) : dw.dim(1), N = trans_w ? dw.dim(1) : dw.dim(2);
  const int64_t M = lead_rows(x);
  MT_CHECK(last_dim(x) == K && last_dim(dout) == N && lead_rows(dout) == M,
           std::string("cuda ") + op + ": dw " + str(dw) + " needs x [M, K] and dout [M, N], got " +
               str(x) + " and " + str(dout));
  const std::vector<int32_t> off = read_offsets(c, offsets, E, M, op);
  const Tensor x2 = x.view({M, K});
  const Tensor d2 = dout.view({M, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[e], r1 = off[e + 1];
    if (r0 == r1) continue;  // an expert without tokens gets no gradient
    Tensor dwe = dw.slice0(e, e + 1).view({dw.dim(1), dw.dim(2)});
    // Accumulate (beta = 1): dw[e] += x_e^T dout_e, or dout_e^T x_e if trans_w.
    if (trans_w)
      matmul(c, d2.slice0(r0, r1), x2.slice0(r0, r1), dwe, true, false, 1.f, 1.f);
    else
      matmul(c, x2.slice0(r0, r1), d2.slice0(r0, r1), dwe, true, false, 1.f, 1.f);
  }
}

}  // namespace mt::cuda
