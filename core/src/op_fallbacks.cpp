// The core's compositions of the op set's `composed` ops (mt/ops.def): what a backend that lacks
// one of them runs. Each is built from required ops only (or goes through the host), so it runs
// on any backend; the backends shipped with mt override them all with kernels of their own, and
// tests/unit/backend_ops_test.cpp runs every composition against those kernels.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "mt/backend.h"
#include "mt/error.h"
#include "mt/ops.h"
#include "mt/q8.h"
#include "mt/random_fill.h"

namespace mt {
namespace {

std::string str(const Tensor& t) {
  return t.defined() ? t.str() : std::string("none");
}

int64_t lead_rows(const Tensor& t) {
  int64_t r = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) r *= t.shape()[static_cast<size_t>(i)];
  return r;
}

// A float temporary of x's element count (f32: compositions keep intermediate values unrounded).
Tensor temp_like(Backend& b, const Tensor& x) {
  return b.empty({x.numel()}, DType::f32);
}
Tensor flat(const Tensor& x) {
  return x.view({x.numel()});
}

void check_same_count(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  std::string shapes;
  bool ok = true;
  for (const Tensor* t : ts) {
    ok = ok && t->defined() && first.defined() && t->numel() == first.numel();
    shapes += (shapes.empty() ? "" : ", ") + str(*t);
  }
  MT_CHECK(ok, std::string(op) + ": " + shapes + " (want tensors of one element count)");
}

// The offsets of a grouped matmul on the host, checked: [E + 1] i32, 0, non-decreasing, M.
std::vector<int32_t> host_offsets(Backend& b, const Tensor& offsets, int64_t experts, int64_t rows,
                                  const char* op) {
  MT_CHECK(offsets.defined() && offsets.dtype() == DType::i32 && offsets.numel() == experts + 1,
           std::string(op) + ": offsets " + str(offsets) +
               " must be i32 with E + 1 = " + std::to_string(experts + 1) + " entries");
  std::vector<int32_t> off(static_cast<size_t>(experts + 1));
  b.copy_to_host(offsets, off.data());
  bool ok = off[0] == 0 && off.back() == rows;
  for (size_t e = 0; ok && e + 1 < off.size(); ++e) ok = off[e] <= off[e + 1];
  MT_CHECK(ok, std::string(op) +
                   ": offsets must start at 0, not decrease and end at the row count " +
                   std::to_string(rows));
  return off;
}

}  // namespace

bool Backend::supports(Op op) const {
  return op_info(op).required;
}

void Backend::sum_squares_each(const std::vector<const Tensor*>& xs, std::vector<double>& sums) {
  sums.resize(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) sums[i] = sum_squares(*xs[i]);
}

void Backend::embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  MT_CHECK(table.defined() && table.ndim() == 2 && ids.defined() && out.defined() &&
               out.numel() == ids.numel() * table.dim(1),
           "embedding_forward: table " + str(table) + ", ids " + str(ids) + ", out " + str(out) +
               " (want table [V, D], ids [N], out [N, D])");
  const int64_t D = table.dim(1), N = ids.numel();
  Tensor rows = out.view({N, D});
  gather_rows(table, ids.view({N}), rows);
}

void Backend::embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  MT_CHECK(dtable.defined() && dtable.ndim() == 2 && ids.defined() && dout.defined() &&
               dout.numel() == ids.numel() * dtable.dim(1),
           "embedding_backward: dout " + str(dout) + ", ids " + str(ids) + ", dtable " +
               str(dtable) + " (want dout [N, D], ids [N], dtable [V, D])");
  const int64_t D = dtable.dim(1), N = ids.numel();
  scatter_add_rows(dout.view({N, D}), ids.view({N}), Tensor(), dtable);
}

void Backend::embedding_q8_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t rb = table.defined() && table.ndim() == 2 ? table.dim(1) : 0;
  const int64_t D = q8_row_values(rb), N = ids.defined() ? ids.numel() : 0;
  MT_CHECK(table.defined() && table.dtype() == DType::i8 && table.ndim() == 2 && D > 0 &&
               q8_row_bytes(D) == rb && ids.defined() && ids.dtype() == DType::i32 &&
               out.defined() && (out.dtype() == DType::f32 || out.dtype() == DType::bf16) &&
               out.numel() == N * D,
           "embedding_q8_forward: table " + str(table) + ", ids " + str(ids) + ", out " + str(out) +
               " (want table i8 [V, D + D / 16] with D a multiple of 32, ids [N] i32, " +
               "out [N, D] f32 or bf16)");
  if (N == 0) return;
  // The fall-back path: each looked-up row through the host.
  std::vector<int32_t> id(static_cast<size_t>(N));
  copy_to_host(ids, id.data());
  const int64_t V = table.dim(0);
  std::vector<int8_t> row(static_cast<size_t>(rb));
  std::vector<float> f(static_cast<size_t>(N * D));
  for (int64_t n = 0; n < N; ++n) {
    const int64_t v = id[static_cast<size_t>(n)];
    MT_CHECK(v >= 0 && v < V, "embedding_q8_forward: token id " + std::to_string(v) +
                                  " at position " + std::to_string(n) +
                                  " is outside the vocabulary [0, " + std::to_string(V) + ")");
    copy_to_host(table.slice0(v, v + 1), row.data());
    dequantize_q8_row(row.data(), D, f.data() + n * D);
  }
  Tensor o = out.view({N, D});
  if (out.dtype() == DType::f32) {
    copy_from_host(o, f.data());
  } else {
    Tensor tmp = empty({N, D}, DType::f32);
    copy_from_host(tmp, f.data());
    cast(tmp, o);
  }
}

void Backend::gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) {
  check_same_count("gated_forward", {&gate, &up, &out});
  Tensor a = temp_like(*this, gate);
  activation_forward(act, flat(gate), a);
  Tensor o = flat(out);
  mul(a, flat(up), o);
}

void Backend::gated_backward(Activation act, const Tensor& dout, const Tensor& gate,
                             const Tensor& up, Tensor& dgate, Tensor& dup) {
  check_same_count("gated_backward", {&dout, &gate, &up, &dgate, &dup});
  // dgate += act'(gate) * (dout * up);  dup += dout * act(gate)
  Tensor t = temp_like(*this, gate);
  mul(flat(dout), flat(up), t);
  Tensor dg = flat(dgate);
  activation_backward(act, t, flat(gate), dg);
  Tensor a = temp_like(*this, gate);
  activation_forward(act, flat(gate), a);
  mul(flat(dout), a, t);
  Tensor du = flat(dup);
  axpy(1.f, t, du);
}

void Backend::softcap_forward(const Tensor& x, float cap, Tensor& out) {
  check_same_count("softcap_forward", {&x, &out});
  MT_CHECK(cap > 0.f, "softcap_forward: cap " + std::to_string(cap) + " must be > 0");
  Tensor t = temp_like(*this, x);
  scale(flat(x), 1.f / cap, t);
  Tensor th = temp_like(*this, x);
  activation_forward(Activation::tanh, t, th);
  Tensor o = flat(out);
  scale(th, cap, o);
}

void Backend::softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) {
  check_same_count("softcap_backward", {&dout, &out, &dx});
  MT_CHECK(cap > 0.f, "softcap_backward: cap " + std::to_string(cap) + " must be > 0");
  // dx += dout * (1 - t^2) with t = out / cap
  Tensor t = temp_like(*this, out);
  scale(flat(out), 1.f / cap, t);
  Tensor one_minus = temp_like(*this, out);
  fill(one_minus, 1.f);
  Tensor t2 = temp_like(*this, out);
  mul(t, t, t2);
  axpy(-1.f, t2, one_minus);
  mul(flat(dout), one_minus, t);
  Tensor d = flat(dx);
  axpy(1.f, t, d);
}

void Backend::grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                             Tensor& out) {
  MT_CHECK(x.defined() && w.defined() && out.defined() && w.ndim() == 3 && x.ndim() >= 1 &&
               out.ndim() >= 1,
           "grouped_matmul: x " + str(x) + ", w " + str(w) + ", out " + str(out) +
               " (want x [M, K], w [E, K, N] ([E, N, K] if trans_w), out [M, N])");
  const int64_t E = w.dim(0), K = trans_w ? w.dim(2) : w.dim(1), N = trans_w ? w.dim(1) : w.dim(2);
  const int64_t M = lead_rows(x);
  MT_CHECK(x.dim(-1) == K && out.dim(-1) == N && lead_rows(out) == M,
           "grouped_matmul: x " + x.str() + " and w " + w.str() +
               " (trans_w = " + (trans_w ? "true" : "false") + ") need x [M, " + std::to_string(K) +
               "] and out [M, " + std::to_string(N) + "], got out " + out.str());
  const std::vector<int32_t> off = host_offsets(*this, offsets, E, M, "grouped_matmul");
  const Tensor x2 = x.view({M, K});
  const Tensor out2 = out.view({M, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[static_cast<size_t>(e)], r1 = off[static_cast<size_t>(e) + 1];
    if (r0 == r1) continue;
    Tensor out_e = out2.slice0(r0, r1);
    matmul(x2.slice0(r0, r1), w.slice0(e, e + 1).view({w.dim(1), w.dim(2)}), out_e, false, trans_w,
           1.f, 0.f);
  }
}

void Backend::grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                         bool trans_w, Tensor& dw) {
  MT_CHECK(x.defined() && dout.defined() && dw.defined() && dw.ndim() == 3 && x.ndim() >= 1 &&
               dout.ndim() >= 1,
           "grouped_matmul_weight_grad: x " + str(x) + ", dout " + str(dout) + ", dw " + str(dw) +
               " (want x [M, K], dout [M, N], dw [E, K, N] ([E, N, K] if trans_w))");
  const int64_t E = dw.dim(0), K = trans_w ? dw.dim(2) : dw.dim(1),
                N = trans_w ? dw.dim(1) : dw.dim(2);
  const int64_t M = lead_rows(x);
  MT_CHECK(x.dim(-1) == K && dout.dim(-1) == N && lead_rows(dout) == M,
           "grouped_matmul_weight_grad: dw " + dw.str() + " (trans_w = " +
               (trans_w ? "true" : "false") + ") needs x [M, " + std::to_string(K) +
               "] and dout [M, " + std::to_string(N) + "], got " + x.str() + " and " + dout.str());
  const std::vector<int32_t> off = host_offsets(*this, offsets, E, M, "grouped_matmul_weight_grad");
  const Tensor x2 = x.view({M, K});
  const Tensor d2 = dout.view({M, N});
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = off[static_cast<size_t>(e)], r1 = off[static_cast<size_t>(e) + 1];
    if (r0 == r1) continue;  // an expert without rows gets no gradient
    Tensor dw_e = dw.slice0(e, e + 1).view({dw.dim(1), dw.dim(2)});
    if (trans_w)
      matmul(d2.slice0(r0, r1), x2.slice0(r0, r1), dw_e, true, false, 1.f, 1.f);
    else
      matmul(x2.slice0(r0, r1), d2.slice0(r0, r1), dw_e, true, false, 1.f, 1.f);
  }
}

void Backend::scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  MT_CHECK(src.defined() && out.defined() && idx.defined() && src.ndim() >= 1 && out.ndim() >= 1 &&
               src.dim(-1) == out.dim(-1) && src.numel() == idx.numel() * src.dim(-1),
           "scatter_rows: src " + src.str() + ", idx " + (idx.defined() ? idx.str() : "none") +
               ", out " + (out.defined() ? out.str() : "none") +
               " (want src [M, D], idx [M] i32, out [N, D])");
  const int64_t D = out.dim(-1), M = idx.numel();
  Tensor rows = out.view({D ? out.numel() / D : 0, D});
  Tensor old = empty({M, D}, out.dtype());
  gather_rows(rows, idx, old);
  Tensor minus = empty({M}, DType::f32);
  fill(minus, -1.f);
  scatter_add_rows(old, idx, minus, rows);
  scatter_add_rows(src.view({M, D}), idx, Tensor(), rows);
}

void Backend::scatter_rows_each(const std::vector<Tensor>& srcs, const Tensor& idx,
                                std::vector<Tensor>& outs) {
  MT_CHECK(srcs.size() == outs.size(), "scatter_rows_each: " + std::to_string(srcs.size()) +
                                           " sources for " + std::to_string(outs.size()) +
                                           " outputs (want one output each)");
  for (size_t i = 0; i < srcs.size(); ++i) scatter_rows(srcs[i], idx, outs[i]);
}

namespace {

// The int8 KV cache's shapes: rows [N, C] i8 with scales [N, G] (C a multiple of G); returns
// C / G, the values per scale.
int64_t q8_rows_group(const char* op, const Tensor& q, const Tensor& scales) {
  MT_CHECK(q.defined() && scales.defined() && q.dtype() == DType::i8 &&
               scales.dtype() == DType::f32 && q.ndim() >= 1 && scales.ndim() >= 1 &&
               scales.dim(-1) > 0 && q.dim(-1) % scales.dim(-1) == 0 &&
               q.numel() / std::max<int64_t>(q.dim(-1), 1) == scales.numel() / scales.dim(-1),
           std::string(op) + ": rows " + (q.defined() ? q.str() : std::string("none")) +
               " and scales " + (scales.defined() ? scales.str() : std::string("none")) +
               " (want i8 [N, G * W] and f32 [N, G])");
  return q.dim(-1) / scales.dim(-1);
}

}  // namespace

void Backend::scatter_rows_q8(const Tensor& src, const Tensor& idx, Tensor& out, Tensor& scales) {
  const int64_t w = q8_rows_group("scatter_rows_q8", out, scales);
  const int64_t c = out.dim(-1), g = scales.dim(-1);
  const int64_t n = out.numel() / std::max<int64_t>(c, 1), m = idx.defined() ? idx.numel() : 0;
  MT_CHECK(idx.defined() && idx.dtype() == DType::i32 &&
               (src.dtype() == DType::f32 || src.dtype() == DType::bf16) && src.numel() == m * c,
           "scatter_rows_q8: src " + src.str() + ", idx " + (idx.defined() ? idx.str() : "none") +
               " for rows " + out.str() + " (want src [M, " + std::to_string(c) +
               "] f32 or bf16, idx [M] i32)");
  // Through the host: the whole cache and its scales read, the rows replaced, written back.
  std::vector<float> x(static_cast<size_t>(m * c));
  Tensor xf = src;
  if (src.dtype() != DType::f32) {
    xf = empty(src.shape(), DType::f32);
    cast(src, xf);
  }
  if (m) copy_to_host(xf, x.data());
  std::vector<int32_t> rows(static_cast<size_t>(m));
  if (m) copy_to_host(idx, rows.data());
  std::vector<int8_t> q(static_cast<size_t>(n * c));
  std::vector<float> s(static_cast<size_t>(n * g));
  if (n) {
    copy_to_host(out, q.data());
    copy_to_host(scales, s.data());
  }
  for (int64_t i = 0; i < m; ++i) {
    const int32_t r = rows[static_cast<size_t>(i)];
    MT_CHECK(r >= 0 && r < n, "scatter_rows_q8: idx[" + std::to_string(i) + "] = " +
                                  std::to_string(r) + " is outside [0, " + std::to_string(n) + ")");
    for (int64_t j = 0; j < g; ++j)
      s[static_cast<size_t>(r * g + j)] =
          quantize_q8_group(x.data() + i * c + j * w, w, q.data() + r * c + j * w);
  }
  if (n) {
    copy_from_host(out, q.data());
    copy_from_host(scales, s.data());
  }
}

void Backend::dequantize_rows_q8(const Tensor& q, const Tensor& scales, Tensor& out) {
  const int64_t w = q8_rows_group("dequantize_rows_q8", q, scales);
  MT_CHECK(out.defined() && (out.dtype() == DType::f32 || out.dtype() == DType::bf16) &&
               out.numel() == q.numel(),
           "dequantize_rows_q8: out " + (out.defined() ? out.str() : std::string("none")) +
               " for rows " + q.str() + " (want f32 or bf16 with as many elements)");
  std::vector<int8_t> h(static_cast<size_t>(q.numel()));
  std::vector<float> s(static_cast<size_t>(scales.numel())), f(h.size());
  if (h.empty()) return;
  copy_to_host(q, h.data());
  copy_to_host(scales, s.data());
  for (size_t i = 0; i < f.size(); ++i)
    f[i] = static_cast<float>(h[i]) * s[i / static_cast<size_t>(w)];
  if (out.dtype() == DType::f32) {
    copy_from_host(out, f.data());
  } else {
    Tensor tmp = empty(out.shape(), DType::f32);
    copy_from_host(tmp, f.data());
    cast(tmp, out);
  }
}

void Backend::matmul_q8(const Tensor& x, const Tensor& w, Tensor& y) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() >= 1 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  const int64_t k = fb(x) ? x.dim(-1) : 0;
  MT_CHECK(fb(x) && fb(y) && w.defined() && w.dtype() == DType::i8 && w.ndim() == 2 &&
               k % kQ8Block == 0 && w.dim(1) == q8_row_bytes(k) && y.dim(-1) == w.dim(0) &&
               x.numel() / std::max<int64_t>(k, 1) * w.dim(0) == y.numel(),
           "matmul_q8: x " + (x.defined() ? x.str() : std::string("none")) + ", w " +
               (w.defined() ? w.str() : std::string("none")) + ", y " +
               (y.defined() ? y.str() : std::string("none")) +
               " (want x [..., K] with K a multiple of 32, w i8 [N, K + K / 16], y [..., N])");
  // The fall-back path: the rows dequantized through the host, then an ordinary matmul.
  const int64_t n = w.dim(0);
  std::vector<int8_t> q(static_cast<size_t>(w.numel()));
  copy_to_host(w, q.data());
  std::vector<float> f(static_cast<size_t>(n * k));
  for (int64_t r = 0; r < n; ++r)
    dequantize_q8_row(q.data() + r * q8_row_bytes(k), k, f.data() + r * k);
  Tensor wf = empty({n, k}, DType::f32);
  copy_from_host(wf, f.data());
  const int64_t m = k ? x.numel() / k : 0;
  Tensor y2 = y.view({m, n});
  matmul(x.view({m, k}), wf, y2, false, true);
}

void Backend::grouped_matmul_q8(const Tensor& x, const Tensor& w,
                                const std::vector<int64_t>& counts, Tensor& out) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() == 2 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  int64_t rows = 0;
  bool ok = fb(x) && fb(out) && w.defined() && w.dtype() == DType::i8 && w.ndim() == 3 &&
            counts.size() == static_cast<size_t>(w.dim(0));
  for (const int64_t c : counts) {
    ok = ok && c >= 0;
    rows += c;
  }
  ok = ok && rows == x.dim(0) && out.dim(0) == rows && out.dim(1) == w.dim(1);
  MT_CHECK(ok, "grouped_matmul_q8: x " + str(x) + ", w " + str(w) + ", out " + str(out) + " and " +
                   std::to_string(counts.size()) +
                   " counts (want x [M, K], w i8 [E, N, K + K / 16], out [M, N] and E counts "
                   "of rows, at least 0, summing to M)");
  const int64_t n = w.dim(1), rb = w.dim(2);
  int64_t r = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    const int64_t c = counts[e];
    if (c == 0) continue;
    const auto ei = static_cast<int64_t>(e);
    Tensor ye = out.slice0(r, r + c);
    matmul_q8(x.slice0(r, r + c), w.slice0(ei, ei + 1).view({n, rb}), ye);
    r += c;
  }
}

void Backend::copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                           int64_t width, bool accumulate) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() >= 1 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  MT_CHECK(fb(src) && fb(dst), "copy_columns: src " +
                                   (src.defined() ? src.str() : std::string("none")) + ", dst " +
                                   (dst.defined() ? dst.str() : std::string("none")) +
                                   " (want f32 or bf16 matrices src [N, Ds] and dst [N, Dd])");
  auto rows = [](const Tensor& t) {
    int64_t r = 1;
    for (int i = 0; i + 1 < t.ndim(); ++i) r *= t.shape()[static_cast<size_t>(i)];
    return r;
  };
  const int64_t ds = src.dim(-1), dd = dst.dim(-1), n = rows(src);
  MT_CHECK(n == rows(dst) && width >= 0 && src_col >= 0 && dst_col >= 0 && src_col + width <= ds &&
               dst_col + width <= dd,
           "copy_columns: columns [" + std::to_string(src_col) + ", " +
               std::to_string(src_col + width) + ") of src " + src.str() + " to columns [" +
               std::to_string(dst_col) + ", " + std::to_string(dst_col + width) + ") of dst " +
               dst.str() + " (want the same rows and columns inside both)");
  if (width == 0 || n == 0) return;
  // The ops-fall-back path of an out-of-tree backend: both matrices through the host, in f32.
  auto to_f32 = [this](const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::f32) {
      copy_to_host(t, v.data());
    } else {
      std::vector<uint16_t> b(v.size());
      copy_to_host(t, b.data());
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(b[i]);
    }
    return v;
  };
  const std::vector<float> s = to_f32(src);
  std::vector<float> d = to_f32(dst);
  for (int64_t r = 0; r < n; ++r) {
    const float* from = s.data() + r * ds + src_col;
    float* to = d.data() + r * dd + dst_col;
    for (int64_t c = 0; c < width; ++c) to[c] = accumulate ? to[c] + from[c] : from[c];
  }
  if (dst.dtype() == DType::f32) {
    copy_from_host(dst, d.data());
  } else {
    std::vector<uint16_t> b(d.size());
    for (size_t i = 0; i < d.size(); ++i) b[i] = f32_to_bf16(d[i]);
    copy_from_host(dst, b.data());
  }
}

void Backend::split_columns(const Tensor& src, std::vector<Tensor>& pieces) {
  std::string list;
  int64_t total = 0;
  bool ok = src.defined() && src.ndim() >= 1;
  for (const Tensor& p : pieces) {
    list += (list.empty() ? "" : ", ") + str(p);
    ok = ok && p.defined() && p.ndim() >= 1 && lead_rows(p) == lead_rows(src);
    if (ok) total += p.dim(-1);
  }
  MT_CHECK(ok && total == src.dim(-1),
           "split_columns: src " + str(src) + " into pieces [" + list +
               "] (want src [N, D] and pieces [N, w_i] of its rows, the widths summing to D)");
  int64_t col = 0;
  for (Tensor& p : pieces) {
    copy_columns(src, col, p, 0, p.dim(-1), /*accumulate=*/false);
    col += p.dim(-1);
  }
}

void Backend::fill_random(Tensor& out, const RandomFill& spec) {
  const bool truncated = spec.distribution == RandomFill::Distribution::truncated_normal;
  MT_CHECK(out.defined() && (out.dtype() == DType::f32 || out.dtype() == DType::bf16),
           "fill_random: out " + str(out) + " (want f32 or bf16)");
  MT_CHECK((truncated || spec.distribution == RandomFill::Distribution::normal) &&
               std::isfinite(spec.stddev) && spec.stddev >= 0.f,
           "fill_random: distribution " + std::to_string(int(spec.distribution)) + ", stddev " +
               std::to_string(spec.stddev) + " (want normal or truncated_normal, stddev >= 0)");
  // Made on the host, element by element from mt/random_fill.h's reference, and copied.
  const int64_t n = out.numel();
  const float scale = random_fill::value_scale(truncated, spec.stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t g = 0; g * 4 < n; ++g) {
    float z[4];
    random_fill::normal4(spec.key, static_cast<uint64_t>(g), 0, z);
    for (int64_t j = 0; j < 4 && g * 4 + j < n; ++j) {
      const auto i = static_cast<uint64_t>(g * 4 + j);
      v[i] = random_fill::standard_draw(spec.key, i, truncated, z[j]) * scale;
    }
  }
  if (out.dtype() == DType::f32) {
    copy_from_host(out, v.data());
  } else {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = f32_to_bf16(v[i]);
    copy_from_host(out, b.data());
  }
}

}  // namespace mt
