// moe: the kernels of a mixture-of-experts layer. Top-k routing over the router logits, gathering
// tokens into expert order and scattering expert outputs back, and the grouped (per-expert)
// matmul over rows sorted by expert.
#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"
#include "mt/q8.h"

namespace mt::cpu {
namespace {

// ---- argument checks --------------------------------------------------------------------------

void check_defined(const Tensor& t, const char* op, const char* name) {
  if (!t.defined()) fail(fmt::format("{}: {} is undefined", op, name));
}

void check_float(const Tensor& t, const char* op, const char* name) {
  check_defined(t, op, name);
  if (!is_fb(t.dtype())) fail(fmt::format("{}: {} must be f32 or bf16, got {}", op, name, t.str()));
}

void check_dtype(const Tensor& t, DType dt, const char* op, const char* name) {
  check_defined(t, op, name);
  if (t.dtype() != dt)
    fail(fmt::format("{}: {} must be {}, got {}", op, name, dtype_name(dt), t.str()));
}

// "[N, D]": D is the last dimension and N the product of the others.
int64_t last_dim(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.dim(-1);
}
int64_t lead_rows(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) n *= t.shape()[i];
  return n;
}

// ---- f32 / bf16 element access ----------------------------------------------------------------

// dst[0, n) = t[at, at + n) as f32.
void load(const Tensor& t, int64_t at, int64_t n, float* dst) {
  if (n <= 0) return;
  if (t.dtype() == DType::f32) {
    std::memcpy(dst, t.ptr<const float>() + at, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* s = t.ptr<const uint16_t>() + at;
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
}

// t[at, at + n) = src[0, n), rounded to bf16 where t is bf16.
void store(const Tensor& t, int64_t at, int64_t n, const float* src) {
  if (n <= 0) return;
  if (t.dtype() == DType::f32) {
    std::memcpy(t.ptr<float>() + at, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  uint16_t* d = t.ptr<uint16_t>() + at;
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(src[i]);
}

float load1(const Tensor& t, int64_t i) {
  return t.dtype() == DType::f32 ? t.ptr<const float>()[i]
                                 : bf16_to_f32(t.ptr<const uint16_t>()[i]);
}

// Reads offsets [E + 1] and checks they split [0, rows) into consecutive segments.
std::vector<int32_t> read_offsets(const Tensor& offsets, int64_t experts, int64_t rows,
                                  const char* op) {
  check_dtype(offsets, DType::i32, op, "offsets");
  if (offsets.numel() != experts + 1)
    fail(
        fmt::format("{}: offsets {} must have E + 1 = {} entries", op, offsets.str(), experts + 1));
  const int32_t* o = offsets.ptr<const int32_t>();
  std::vector<int32_t> off(o, o + experts + 1);
  if (off[0] != 0) fail(fmt::format("{}: offsets[0] must be 0, got {}", op, off[0]));
  for (int64_t e = 0; e < experts; ++e)
    if (off[e + 1] < off[e])
      fail(fmt::format("{}: offsets must not decrease, offsets[{}] = {} > offsets[{}] = {}", op, e,
                       off[e], e + 1, off[e + 1]));
  if (off[experts] != rows)
    fail(fmt::format("{}: offsets[E] = {} must equal the number of rows {}", op, off[experts],
                     rows));
  return off;
}

// Checks every index is in [0, n).
void check_indices(const Tensor& idx, int64_t n, const char* op, const char* what) {
  const int32_t* p = idx.ptr<const int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    if (p[i] < 0 || p[i] >= n)
      fail(fmt::format("{}: {}[{}] = {} is out of range [0, {})", op, what, i, p[i], n));
}

// Rows of small per-row kernels handed to one task.
constexpr int64_t kRowGrain = 16;
constexpr int64_t kColumnGrain = 256;      // scatter_rows: columns per task
constexpr int64_t kSerialElems = 1 << 16;  // scatter_rows: below this, one thread

}  // namespace

// ---- routing ----------------------------------------------------------------------------------

void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize, Tensor& weights,
                        Tensor& indices, Tensor& probs) {
  constexpr const char* op = "topk_route_forward";
  check_float(logits, op, "logits");
  check_dtype(weights, DType::f32, op, "weights");
  check_dtype(indices, DType::i32, op, "indices");
  check_dtype(probs, DType::f32, op, "probs");
  const int64_t E = last_dim(logits), N = lead_rows(logits);
  if (k < 1 || k > E)
    fail(fmt::format("{}: k = {} must be in [1, E] for logits {}", op, k, logits.str()));
  if (weights.numel() != N * k || last_dim(weights) != k || indices.numel() != N * k ||
      last_dim(indices) != k || probs.numel() != N * E || last_dim(probs) != E)
    fail(
        fmt::format("{}: logits {} with k = {} needs weights/indices [N, {}] and probs [N, {}], "
                    "got {}, {}, {}",
                    op, logits.str(), k, k, E, weights.str(), indices.str(), probs.str()));

  float* w_out = weights.ptr<float>();
  int32_t* i_out = indices.ptr<int32_t>();
  float* p_out = probs.ptr<float>();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kRowGrain), [&](const auto& r) {
    std::vector<float> key(static_cast<size_t>(k));
    std::vector<int32_t> top(static_cast<size_t>(k));
    for (int64_t n = r.begin(); n < r.end(); ++n) {
      float* s = p_out + n * E;
      load(logits, n * E, E, s);
      if (sigmoid) {
        for (int64_t e = 0; e < E; ++e) s[e] = 1.f / (1.f + std::exp(-s[e]));
      } else {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t e = 0; e < E; ++e) mx = std::max(mx, s[e]);
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) {
          s[e] = std::exp(s[e] - mx);
          sum += s[e];
        }
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t e = 0; e < E; ++e) s[e] *= inv;
      }
      // Insertion into a sorted list of the k best so far. The scan runs in increasing e and only a
      // strictly greater score moves ahead, so ties go to the lower index. NaN sorts last (a NaN
      // weight still reaches the loss, where the trainer notices it).
      int count = 0;
      for (int64_t e = 0; e < E; ++e) {
        const float v = std::isnan(s[e]) ? -std::numeric_limits<float>::infinity() : s[e];
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
      std::copy(top.begin(), top.end(), i_out + n * k);
      float* w = w_out + n * k;
      float total = 0.f;
      for (int j = 0; j < k; ++j) {
        w[j] = s[top[j]];
        total += w[j];
      }
      if (normalize)
        for (int j = 0; j < k; ++j) w[j] /= total;
    }
  });
}

void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices,
                         const Tensor& probs, bool sigmoid, bool normalize, Tensor& dlogits) {
  constexpr const char* op = "topk_route_backward";
  check_float(dweights, op, "dweights");
  check_float(weights, op, "weights");
  check_dtype(indices, DType::i32, op, "indices");
  check_float(probs, op, "probs");
  check_float(dlogits, op, "dlogits");
  const int64_t E = last_dim(probs), N = lead_rows(probs), k = last_dim(indices);
  if (indices.numel() != N * k || dweights.numel() != N * k || weights.numel() != N * k ||
      dlogits.numel() != N * E || last_dim(dlogits) != E || k < 1 || k > E)
    fail(fmt::format(
        "{}: probs {} needs dweights/weights/indices [N, k] and dlogits [N, {}], got "
        "{}, {}, {}, {}",
        op, probs.str(), E, dweights.str(), weights.str(), indices.str(), dlogits.str()));
  check_indices(indices, E, op, "indices");

  const int32_t* idx_all = indices.ptr<const int32_t>();
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kRowGrain), [&](const auto& r) {
    std::vector<float> s(static_cast<size_t>(E)), g(static_cast<size_t>(E));
    std::vector<float> ds(static_cast<size_t>(k));
    for (int64_t n = r.begin(); n < r.end(); ++n) {
      load(probs, n * E, E, s.data());
      load(dweights, n * k, k, ds.data());
      const int32_t* idx = idx_all + n * k;
      if (normalize) {
        // w_j = s_j / S with S = sum of the selected scores (recomputed from probs in the forward's
        // order, so it is the forward's S): ds_j = (dw_j - sum_l dw_l w_l) / S.
        float total = 0.f;
        for (int64_t j = 0; j < k; ++j) total += s[idx[j]];
        float dot = 0.f;
        for (int64_t j = 0; j < k; ++j) dot += ds[j] * s[idx[j]];
        dot /= total;
        for (int64_t j = 0; j < k; ++j) ds[j] = (ds[j] - dot) / total;
      }
      // The gradient reaches the scores of the selected experts only; the score function spreads
      // it: softmax to every logit of the row, sigmoid to the selected logits alone.
      std::fill(g.begin(), g.end(), 0.f);
      if (sigmoid) {
        for (int64_t j = 0; j < k; ++j) {
          const float p = s[idx[j]];
          g[idx[j]] += ds[j] * p * (1.f - p);
        }
      } else {
        float c = 0.f;
        for (int64_t j = 0; j < k; ++j) c += ds[j] * s[idx[j]];
        for (int64_t e = 0; e < E; ++e) g[e] = -s[e] * c;
        for (int64_t j = 0; j < k; ++j) g[idx[j]] += s[idx[j]] * ds[j];
      }
      if (dlogits.dtype() == DType::f32) {
        float* d = dlogits.ptr<float>() + n * E;
        for (int64_t e = 0; e < E; ++e) d[e] += g[e];
      } else {
        load(dlogits, n * E, E, s.data());
        for (int64_t e = 0; e < E; ++e) s[e] += g[e];
        store(dlogits, n * E, E, s.data());
      }
    }
  });
}

// ---- token movement ---------------------------------------------------------------------------

void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) {
  constexpr const char* op = "gather_rows";
  check_float(x, op, "x");
  check_dtype(idx, DType::i32, op, "idx");
  check_float(out, op, "out");
  const int64_t D = last_dim(x), N = lead_rows(x), M = idx.numel();
  if (last_dim(out) != D || lead_rows(out) != M)
    fail(fmt::format("{}: x {} and idx {} need out [{}, {}], got {}", op, x.str(), idx.str(), M, D,
                     out.str()));
  check_indices(idx, N, op, "idx");
  const int32_t* id = idx.ptr<const int32_t>();
  const bool same = x.dtype() == out.dtype();
  const size_t row_bytes = static_cast<size_t>(D) * dtype_size(x.dtype());
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, M, kRowGrain), [&](const auto& r) {
    std::vector<float> buf(same ? 0 : static_cast<size_t>(D));
    for (int64_t m = r.begin(); m < r.end(); ++m) {
      if (same) {
        if (row_bytes)
          std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(m) * row_bytes,
                      static_cast<const char*>(x.data()) + static_cast<size_t>(id[m]) * row_bytes,
                      row_bytes);
      } else {
        load(x, id[m] * D, D, buf.data());
        store(out, m * D, D, buf.data());
      }
    }
  });
}

namespace {
// The operands of a scatter of src [M, D] into out [N, D] by idx [M]: dtypes and shapes.
void check_scatter(const char* op, const Tensor& src, const Tensor& idx, const Tensor& out) {
  check_float(src, op, "src");
  check_dtype(idx, DType::i32, op, "idx");
  check_float(out, op, "out");
  if (last_dim(src) != last_dim(out) || lead_rows(src) != idx.numel())
    fail(fmt::format("{}: idx {} and out {} need src [{}, {}], got {}", op, idx.str(), out.str(),
                     idx.numel(), last_dim(out), src.str()));
}
}  // namespace

void scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  constexpr const char* op = "scatter_rows";
  check_scatter(op, src, idx, out);
  const int64_t D = last_dim(out), N = lead_rows(out), M = idx.numel();
  check_indices(idx, N, op, "idx");
  const int32_t* id = idx.ptr<const int32_t>();
  const bool same = src.dtype() == out.dtype();
  const size_t es = dtype_size(src.dtype());
  // Tasks own column ranges and take the rows in order, so a row named twice ends with its last
  // source and no two threads write one element.
  auto columns = [&](int64_t c0, int64_t c1) {
    const int64_t w = c1 - c0;
    std::vector<float> buf(same ? 0 : static_cast<size_t>(w));
    for (int64_t m = 0; m < M; ++m) {
      if (same) {
        std::memcpy(static_cast<char*>(out.data()) + static_cast<size_t>(id[m] * D + c0) * es,
                    static_cast<const char*>(src.data()) + static_cast<size_t>(m * D + c0) * es,
                    static_cast<size_t>(w) * es);
      } else {
        load(src, m * D + c0, w, buf.data());
        store(out, id[m] * D + c0, w, buf.data());
      }
    }
  };
  if (M * D <= kSerialElems) {
    if (D > 0) columns(0, D);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, D, kColumnGrain),
                    [&](const auto& r) { columns(r.begin(), r.end()); });
}

namespace {
// C / G for an int8 KV cache's rows q [N, C] i8 and scales [N, G] f32.
int64_t q8_group(const char* op, const Tensor& q, const Tensor& s) {
  if (!q.defined() || !s.defined() || q.dtype() != DType::i8 || s.dtype() != DType::f32 ||
      q.ndim() < 1 || s.ndim() < 1 || last_dim(s) <= 0 || last_dim(q) % last_dim(s) != 0 ||
      lead_rows(q) != lead_rows(s))
    fail(fmt::format("{}: rows {} and scales {} (want i8 [N, G * W] and f32 [N, G])", op,
                     q.defined() ? q.str() : "none", s.defined() ? s.str() : "none"));
  return last_dim(q) / last_dim(s);
}
}  // namespace

void scatter_rows_q8(const Tensor& src, const Tensor& idx, Tensor& q, Tensor& scales) {
  constexpr const char* op = "scatter_rows_q8";
  const int64_t W = q8_group(op, q, scales);
  check_float(src, op, "src");
  check_dtype(idx, DType::i32, op, "idx");
  const int64_t C = last_dim(q), G = last_dim(scales), N = lead_rows(q), M = idx.numel();
  if (last_dim(src) != C || lead_rows(src) != M)
    fail(fmt::format("{}: idx {} and rows {} need src [{}, {}], got {}", op, idx.str(), q.str(), M,
                     C, src.str()));
  check_indices(idx, N, op, "idx");
  const int32_t* id = idx.ptr<const int32_t>();
  int8_t* qp = q.ptr<int8_t>();
  float* sp = scales.ptr<float>();
  // Rows in order on one thread: a decode step writes a row per sequence, a prefill a few
  // hundred (well under a millisecond), and a row named twice (the sink row) must not be written
  // by two threads at once.
  std::vector<float> buf(static_cast<size_t>(C));
  for (int64_t m = 0; m < M; ++m) {
    load(src, m * C, C, buf.data());
    const int64_t r = id[m];
    for (int64_t j = 0; j < G; ++j)
      sp[r * G + j] = quantize_q8_group(buf.data() + j * W, W, qp + r * C + j * W);
  }
}

void dequantize_rows_q8(const Tensor& q, const Tensor& scales, Tensor& out) {
  constexpr const char* op = "dequantize_rows_q8";
  const int64_t W = q8_group(op, q, scales);
  check_float(out, op, "out");
  if (out.numel() != q.numel())
    fail(fmt::format("{}: out {} for rows {} (want as many elements)", op, out.str(), q.str()));
  const int64_t C = last_dim(q), N = lead_rows(q), G = C / W;
  const int8_t* qp = q.ptr<const int8_t>();
  const float* sp = scales.ptr<const float>();
  const bool f32 = out.dtype() == DType::f32;
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < G; ++j) {
        const int8_t* x = qp + r * C + j * W;
        const float scale = sp[r * G + j];
        if (f32) {
          float* o = out.ptr<float>() + r * C + j * W;
          for (int64_t t = 0; t < W; ++t) o[t] = static_cast<float>(x[t]) * scale;
        } else {
          uint16_t* o = out.ptr<uint16_t>() + r * C + j * W;
          for (int64_t t = 0; t < W; ++t) o[t] = f32_to_bf16(static_cast<float>(x[t]) * scale);
        }
      }
  };
  if (N * C <= kSerialElems) {
    rows(0, N);
    return;
  }
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kRowGrain),
                    [&](const auto& r) { rows(r.begin(), r.end()); });
}

void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, Tensor& out) {
  constexpr const char* op = "scatter_add_rows";
  check_scatter(op, src, idx, out);
  const int64_t D = last_dim(out), N = lead_rows(out), M = idx.numel();
  if (w.defined()) {
    check_float(w, op, "w");
    if (w.numel() != M)
      fail(fmt::format("{}: w {} must have one weight per row of src {}", op, w.str(), src.str()));
  }
  check_indices(idx, N, op, "idx");

  // Group the source rows by destination (a stable counting sort): every output row then sums its
  // contributions in increasing m on one thread, so the result is the serial loop's, whatever the
  // thread count, and threads never write the same row.
  // The index lists live in allocator scratch (no system allocation in a steady-state step).
  const int32_t* id = idx.ptr<const int32_t>();
  Backend& be = *out.backend();
  Tensor start_t = be.empty({N + 1}, DType::i64), next_t = be.empty({N}, DType::i64),
         order_t = be.empty({M}, DType::i64);
  int64_t* start = start_t.ptr<int64_t>();
  int64_t* next = next_t.ptr<int64_t>();
  int64_t* order = order_t.ptr<int64_t>();
  std::fill(start, start + N + 1, int64_t{0});
  for (int64_t m = 0; m < M; ++m) ++start[id[m] + 1];
  for (int64_t n = 0; n < N; ++n) start[n + 1] += start[n];
  for (int64_t n = 0; n < N; ++n) next[n] = start[n];
  for (int64_t m = 0; m < M; ++m) order[next[id[m]]++] = m;

  // Each output row's contributions are summed first, in increasing m, and the sum added to the
  // row once: a gradient accumulated over micro-batches is then the micro-batches' sums added,
  // as data parallelism's ranks add them (row by row onto the running value rounded otherwise).
  const bool fast = src.dtype() == DType::f32 && out.dtype() == DType::f32;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, 64), [&](const auto& r) {
    std::vector<float> sum(static_cast<size_t>(D)), acc, row;
    for (int64_t n = r.begin(); n < r.end(); ++n) {
      const int64_t b = start[n], e = start[n + 1];
      if (b == e) continue;
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t i = b; i < e; ++i) {
        const int64_t m = order[i];
        const float wm = w.defined() ? load1(w, m) : 1.f;
        const float* s = src.ptr<const float>() + m * D;
        if (!fast) {
          row.resize(static_cast<size_t>(D));
          load(src, m * D, D, row.data());
          s = row.data();
        }
        for (int64_t d = 0; d < D; ++d) sum[static_cast<size_t>(d)] += wm * s[d];
      }
      if (fast) {
        float* o = out.ptr<float>() + n * D;
        for (int64_t d = 0; d < D; ++d) o[d] += sum[static_cast<size_t>(d)];
      } else {  // bf16 storage: the row and the sum added in f32, rounded once
        acc.resize(static_cast<size_t>(D));
        load(out, n * D, D, acc.data());
        for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += sum[static_cast<size_t>(d)];
        store(out, n * D, D, acc.data());
      }
    }
  });
}

// ---- grouped matmul ---------------------------------------------------------------------------

// f32 (the CPU's training dtype) with OpenBLAS: one parallel loop over blocks of every expert's
// output, (expert, row tile, column tile), each block one single-threaded SGEMM. With few rows
// per expert (64 at Mixtral's shapes) the threads then share the whole problem: no fork and join
// per expert, no thread idling while another finishes its half of an expert, tiles taken as they
// come (a core that the machine's other load slows takes fewer). Experts without rows make no
// tasks. The tiling depends only on the shapes and constants below, never on the thread count or
// the schedule, and every output element is written by one call: results are bitwise
// reproducible.
// Otherwise (bf16 operands, no OpenBLAS) each expert's segment is one call of the backend's matmul
// on views: it owns those paths (AMX tiles, widening in allocator scratch) and splits each GEMM
// across the threads; experts run one after the other. A forward segment of a single row also
// takes matmul's matrix-vector kernel.

namespace {

// One task: rows [r0, r1) and columns [c0, c1) of expert e's output block.
struct GmmTask {
  int64_t e, r0, r1, c0, c1;
};

constexpr int64_t kGmmRowTile = 256;     // forward: rows of an expert's segment per task
constexpr int64_t kGmmColTile = 512;     // forward: output columns per task
constexpr int64_t kGradRowTile = 512;    // weight gradient: rows of dw[e] per task
constexpr int64_t kGradColTile = 512;    // weight gradient: columns of dw[e] per task
constexpr double kGmmSerialFlops = 4e6;  // below this, one thread does it all

// [0, n) cut into ceil(n / tile) near-equal pieces, each a multiple of `align` but the last.
std::vector<int64_t> cuts(int64_t n, int64_t tile, int64_t align) {
  const int64_t parts = std::max<int64_t>(1, (n + tile - 1) / tile);
  const int64_t step =
      std::max<int64_t>(align, ((n + parts - 1) / parts + align - 1) / align * align);
  std::vector<int64_t> b;
  for (int64_t at = 0; at < n; at += step) b.push_back(at);
  b.push_back(n);
  return b;
}

// Appends expert e's tasks: the blocks of a rows x cols output.
void add_tasks(std::vector<GmmTask>& tasks, int64_t e, int64_t rows, int64_t cols, int64_t row_tile,
               int64_t col_tile) {
  const std::vector<int64_t> rc = cuts(rows, row_tile, 1), cc = cuts(cols, col_tile, 16);
  for (size_t i = 0; i + 1 < rc.size(); ++i)
    for (size_t j = 0; j + 1 < cc.size(); ++j)
      tasks.push_back(GmmTask{e, rc[i], rc[i + 1], cc[j], cc[j + 1]});
}

template <class Body>
void run_tasks(const std::vector<GmmTask>& tasks, double flops, const Body& body) {
  if (tasks.size() <= 1 || flops < kGmmSerialFlops ||
      tbb::this_task_arena::max_concurrency() <= 1) {
    for (const GmmTask& t : tasks) body(t);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, tasks.size(), 1),
      [&](const tbb::blocked_range<size_t>& r) {
        for (size_t i = r.begin(); i < r.end(); ++i) body(tasks[i]);
      },
      tbb::simple_partitioner());
}

bool all_f32(const Tensor& a, const Tensor& b, const Tensor& c) {
  return a.dtype() == DType::f32 && b.dtype() == DType::f32 && c.dtype() == DType::f32 &&
         sgemm_fast();
}

}  // namespace

void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                    Tensor& out) {
  constexpr const char* op = "grouped_matmul";
  check_float(x, op, "x");
  check_float(w, op, "w");
  check_float(out, op, "out");
  check_defined(offsets, op, "offsets");
  if (w.ndim() != 3)
    fail(fmt::format("{}: w must be [E, K, N] ([E, N, K] if trans_w), got {}", op, w.str()));
  const int64_t E = w.dim(0);
  const int64_t K = trans_w ? w.dim(2) : w.dim(1), N = trans_w ? w.dim(1) : w.dim(2);
  const int64_t M = lead_rows(x);
  if (last_dim(x) != K || last_dim(out) != N || lead_rows(out) != M)
    fail(fmt::format("{}: x {} and w {} (trans_w = {}) need x [M, {}] and out [M, {}], got out {}",
                     op, x.str(), w.str(), trans_w, K, N, out.str()));
  const std::vector<int32_t> off = read_offsets(offsets, E, M, op);

  const Tensor x2 = x.view({M, K});
  const Tensor out2 = out.view({M, N});
  auto per_expert = [&](int64_t e) {
    const int64_t r0 = off[e], r1 = off[e + 1];
    Tensor out_e = out2.slice0(r0, r1);
    matmul(x2.slice0(r0, r1), w.slice0(e, e + 1).view({w.dim(1), w.dim(2)}), out_e, false, trans_w,
           1.f, 0.f);
  };
  // The experts whose rows satisfy `take`, one matmul each: at once where every one is a
  // few-row product (decode: matmul's matrix-vector kernels), every expert's output chunks as
  // the tasks of one fork (grouped_matvec: each expert's products what matmul gives it), so the
  // threads stream several experts' weights without joining after each; else one by one, each
  // GEMM splitting itself.
  auto each_expert = [&](auto take) {
    std::vector<int64_t> es;
    bool few = true;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t rows = off[e + 1] - off[e];
      if (rows == 0 || !take(rows)) continue;
      es.push_back(e);
      few = few && rows <= kFewRows;
    }
    if (few && es.size() > 1 && K > 0 && tbb::this_task_arena::max_concurrency() > 1) {
      Tensor o2 = out2;
      grouped_matvec(x2, w, off, es, trans_w, o2);
    } else {
      for (int64_t e : es) per_expert(e);
    }
  };
  if (!all_f32(x, w, out) || N == 0) {
    each_expert([](int64_t) { return true; });
    return;
  }
  if (K == 0) {
    std::fill(out.ptr<float>(), out.ptr<float>() + M * N, 0.f);
    return;
  }
  std::vector<GmmTask> tasks;
  double flops = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows < 2) continue;  // none, or one: the matrix-vector kernel below
    add_tasks(tasks, e, rows, N, kGmmRowTile, kGmmColTile);
    flops += 2.0 * double(rows) * double(N) * double(K);
  }
  const float* xp = x.ptr<const float>();
  const float* wp = w.ptr<const float>();
  float* op_ = out.ptr<float>();
  run_tasks(tasks, flops, [&](const GmmTask& t) {
    const int64_t r = off[t.e] + t.r0;
    const float* we = wp + t.e * K * N;
    // out[r.., c0..] = x[r.., :] op(w[e])[:, c0..]: w[e] is [K, N], or [N, K] if trans_w.
    sgemm_serial(false, trans_w, t.r1 - t.r0, t.c1 - t.c0, K, 1.f, xp + r * K, K,
                 trans_w ? we + t.c0 * K : we + t.c0, trans_w ? K : N, 0.f, op_ + r * N + t.c0, N);
  });
  each_expert([](int64_t rows) { return rows == 1; });
}

void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                bool trans_w, Tensor& dw) {
  constexpr const char* op = "grouped_matmul_weight_grad";
  check_float(x, op, "x");
  check_float(dout, op, "dout");
  check_float(dw, op, "dw");
  check_defined(offsets, op, "offsets");
  if (dw.ndim() != 3)
    fail(fmt::format("{}: dw must be [E, K, N] ([E, N, K] if trans_w), got {}", op, dw.str()));
  const int64_t E = dw.dim(0);
  const int64_t K = trans_w ? dw.dim(2) : dw.dim(1), N = trans_w ? dw.dim(1) : dw.dim(2);
  const int64_t M = lead_rows(x);
  if (last_dim(x) != K || last_dim(dout) != N || lead_rows(dout) != M)
    fail(fmt::format("{}: dw {} (trans_w = {}) needs x [M, {}] and dout [M, {}], got {} and {}", op,
                     dw.str(), trans_w, K, N, x.str(), dout.str()));
  const std::vector<int32_t> off = read_offsets(offsets, E, M, op);

  if (!all_f32(x, dout, dw)) {
    const Tensor x2 = x.view({M, K});
    const Tensor d2 = dout.view({M, N});
    for (int64_t e = 0; e < E; ++e) {
      const int64_t r0 = off[e], r1 = off[e + 1];
      if (r0 == r1) continue;  // an expert without tokens gets no gradient
      Tensor dw_e = dw.slice0(e, e + 1).view({dw.dim(1), dw.dim(2)});
      // Accumulate (beta = 1): dw[e] += x_e^T dout_e ([K, N]), or dout_e^T x_e ([N, K]) if
      // trans_w.
      if (trans_w)
        matmul(d2.slice0(r0, r1), x2.slice0(r0, r1), dw_e, true, false, 1.f, 1.f);
      else
        matmul(x2.slice0(r0, r1), d2.slice0(r0, r1), dw_e, true, false, 1.f, 1.f);
    }
    return;
  }
  // dw[e] ([R, C]) += a_e^T b_e with a_e [rows, R], b_e [rows, C]: a = x, b = dout ([K, N]), or
  // a = dout, b = x if trans_w ([N, K]). An expert without tokens gets no gradient.
  const int64_t R = trans_w ? N : K, C = trans_w ? K : N;
  if (R == 0 || C == 0) return;
  const float* ap = trans_w ? dout.ptr<const float>() : x.ptr<const float>();
  const float* bp = trans_w ? x.ptr<const float>() : dout.ptr<const float>();
  std::vector<GmmTask> tasks;
  double flops = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    add_tasks(tasks, e, R, C, kGradRowTile, kGradColTile);
    flops += 2.0 * double(rows) * double(R) * double(C);
  }
  float* dwp = dw.ptr<float>();
  run_tasks(tasks, flops, [&](const GmmTask& t) {
    const int64_t s = off[t.e], rows = off[t.e + 1] - s;
    sgemm_serial(true, false, t.r1 - t.r0, t.c1 - t.c0, rows, 1.f, ap + s * R + t.r0, R,
                 bp + s * C + t.c0, C, 1.f, dwp + t.e * R * C + t.r0 * C + t.c0, C);
  });
}

}  // namespace mt::cpu
