// Rows by index and columns for the CUDA backend: embedding (forward and backward),
// gather_rows, scatter_rows, scatter_add_rows and copy_columns.
#include <climits>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "mt/q8.h"

namespace mt::cuda {

// ---- rows by index: embedding, gather_rows, scatter_rows, scatter-adds --------------------
namespace {

// Row copies, i over [M, D] with M = id's length. Gather: out[m] = row id[m] of a table (the
// embedding lookup, gather_rows; the table's rows read by `Row`). Scatter: out[id[m]] = x[m]. An
// index outside [0, n) is recorded in `bad` once per row (at d = 0) and read nothing with; the
// call's outputs are then undefined (the error comes at the next synchronisation), though a
// gather writes 0 there and a scatter nothing.

// Element i of [M, D]: its row m and column d, and the row id[m] names (-1 outside [0, n): then
// recorded in `bad` once per row, at d = 0).
__device__ inline int64_t indexed_row(int64_t i, int64_t D, const int32_t* id, int64_t n,
                                      unsigned long long* bad, int64_t& d) {
  const int64_t m = i / D, r = id[m];
  d = i - m * D;
  if (r >= 0 && r < n) return r;
  if (d == 0) record_bad(bad, m, r);
  return -1;
}
// Element (r, d) of a table of D-wide rows.
struct DenseRow {
  In x;
  int64_t D;
  __device__ float operator()(int64_t r, int64_t d) const { return x[r * D + d]; }
};
// Block b's f16 scale of an int8 row of K values (mt/q8.h), exactly as mt::f16_to_f32 (the
// quantizer makes finite scales only; a subnormal one is mant x 2^-24).
__device__ __forceinline__ float q8_scale_at(const int8_t* row, int64_t K, int64_t b) {
  const uint32_t h = *reinterpret_cast<const uint16_t*>(row + K + 2 * b);  // 2-byte aligned
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  const float mag = exp != 0 ? __uint_as_float(((exp + 112) << 23) | (mant << 13))
                             : __fmul_rn(static_cast<float>(mant), 0x1p-24f);
  return (h & 0x8000u) ? -mag : mag;
}
// Element (r, d) of a table of int8 rows (mt/q8.h): q[r, d] x the scale of its block of 32
// (stored after the row's D values), as the CPU's dequantize_q8_row.
struct Q8Row {
  const int8_t* q;
  int64_t D, rb;
  __device__ float operator()(int64_t r, int64_t d) const {
    const int8_t* row = q + r * rb;
    return __fmul_rn(static_cast<float>(row[d]), q8_scale_at(row, D, d / kQ8Block));
  }
};
template <class Row>
struct GatherF {
  Row row;
  const int32_t* id;
  int64_t D, n;
  Out o;
  unsigned long long* bad;
  __device__ void operator()(int64_t i) const {
    int64_t d = 0;
    const int64_t r = indexed_row(i, D, id, n, bad, d);
    o.set(i, r < 0 ? 0.f : row(r, d));
  }
};
struct ScatterF {
  In x;
  const int32_t* id;
  int64_t D, n;
  Out o;
  unsigned long long* bad;
  __device__ void operator()(int64_t i) const {
    int64_t d = 0;
    const int64_t r = indexed_row(i, D, id, n, bad, d);
    if (r >= 0) o.set(r * D + d, x[i]);
  }
};
// Scatter-add by runs of equal destination rows: blockIdx.x = run k (one distinct destination),
// one thread per feature, adding the run's source rows in increasing source order, so the sum's
// order depends on the indices alone (no atomics). Serves embedding_backward (w = 1) and
// scatter_add_rows.
// src [M, D], w [M] (has_w), order [M] source rows sorted by destination (stable),
// start [runs + 1], run_id [runs] destination rows, out [N, D]
__global__ void scatter_runs_kernel(In src, In w, bool has_w, const int32_t* order,
                                    const int32_t* start, const int32_t* run_id, int64_t D, Out o) {
  MT_KERNEL_PROLOGUE();
  const int64_t d = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  const int64_t k = blockIdx.x;
  const int64_t dst = static_cast<int64_t>(run_id[k]) * D + d;
  float acc = 0.f;  // the run's sum first, added once (as the CPU's)
  for (int32_t i = start[k]; i < start[k + 1]; ++i) {
    const int64_t m = order[i];
    acc += (has_w ? w[m] : 1.f) * src[m * D + d];
  }
  o.set(dst, o.get(dst) + acc);
}

// The same sums without host help, for up to kDeviceScatterRows source rows (decode's KV-cache
// writes): block m acts only if source row m is the first with its destination (it scans
// id[0, m)), and then adds, feature by feature, every source row with that destination in
// increasing order: the runs' order, so both kernels give the same bits. O(M^2) index reads,
// hence the bound. An index outside [0, N) is recorded in `bad` and its row skipped.
constexpr int64_t kDeviceScatterRows = 1024;
__global__ void scatter_first_kernel(In src, In w, bool has_w, const int32_t* id, int64_t M,
                                     int64_t N, int64_t D, Out o, unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  __shared__ int first;
  const int64_t m = blockIdx.x;
  const int64_t r = id[m];
  if (r < 0 || r >= N) {  // uniform across the block
    if (threadIdx.x == 0) record_bad(bad, m, r);
    return;
  }
  if (threadIdx.x == 0) first = 1;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < m; j += kThreads)
    if (id[j] == r) first = 0;  // every writer writes 0
  __syncthreads();
  if (!first) return;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    float acc = 0.f;
    for (int64_t j = m; j < M; ++j)
      if (id[j] == r) acc += (has_w ? w[j] : 1.f) * src[j * D + d];
    o.set(r * D + d, o.get(r * D + d) + acc);
  }
}

// out[id[m]] += w[m] src[m] for m in [0, M): builds the runs on the host (a stable counting sort
// of source rows by destination), uploads them and launches scatter_runs_kernel.
template <class S>
void scatter_add_runs(const Ctx& c, const char* op, const Tensor& src,
                      const std::vector<int32_t>& id, int64_t N, const Tensor& w, int64_t D,
                      Tensor& o, S&& shapes) {
  const int64_t M = static_cast<int64_t>(id.size());
  MT_CHECK(M < INT_MAX, std::string("cuda ") + op + ": too many rows: " + shapes());
  if (M == 0 || D == 0) return;
  std::vector<int64_t> count(static_cast<size_t>(N) + 1, 0);
  for (int32_t v : id) ++count[static_cast<size_t>(v) + 1];
  for (int64_t v = 0; v < N; ++v) count[v + 1] += count[v];
  std::vector<int32_t> host(static_cast<size_t>(M));  // then start, then run_id
  for (int64_t m = 0; m < M; ++m)
    host[static_cast<size_t>(count[id[m]]++)] = static_cast<int32_t>(m);
  std::vector<int32_t> start, run_id;
  for (int64_t i = 0; i < M; ++i) {
    if (i == 0 || id[host[i]] != id[host[i - 1]]) {
      start.push_back(static_cast<int32_t>(i));
      run_id.push_back(id[host[i]]);
    }
  }
  start.push_back(static_cast<int32_t>(M));
  const int64_t runs = static_cast<int64_t>(run_id.size());
  host.insert(host.end(), start.begin(), start.end());
  host.insert(host.end(), run_id.begin(), run_id.end());
  Tensor dev = c.scratch({static_cast<int64_t>(host.size())}, DType::i32);
  // From pageable memory: returns once `host` is staged, so it may die after this call.
  check(cudaMemcpyAsync(dev.data(), host.data(), host.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice, c.stream),
        op, "uploading the row index", shapes());
  const int32_t* d_order = dev.ptr<const int32_t>();
  const dim3 grid(static_cast<unsigned>(runs),
                  static_cast<unsigned>((D + kThreads - 1) / kThreads));
  const In wv = w.defined() ? in(w) : In{nullptr, false};
  MT_LAUNCH(scatter_runs_kernel, grid, kThreads, 0, c)
  (in(src), wv, w.defined(), d_order, d_order + M, d_order + M + runs + 1, D, out(o));
  launched(op, shapes);
}

// out[idx[m]] += w[m] src[m] (embedding_backward, scatter_add_rows): up to kDeviceScatterRows
// rows on the device alone (checked there too), more through host-built runs (one read-back of
// idx, checked on the host).
template <class S>
void scatter_add(const Ctx& c, const char* op, BadIndex bad_index, const Tensor& src,
                 const Tensor& idx, int64_t N, const Tensor& w, int64_t D, Tensor& o, S&& shapes) {
  const int64_t M = idx.numel();
  MT_CHECK(M < INT_MAX, std::string("cuda ") + op + ": too many rows: " + shapes());
  if (M == 0 || D == 0) return;
  if (M > kDeviceScatterRows) {
    const std::vector<int32_t> id = host_ints(c, idx, op);
    check_indices(op, id, N, bad_index);
    scatter_add_runs(c, op, src, id, N, w, D, o, shapes);
    return;
  }
  const std::string name = op;
  unsigned long long* bad = c.checks->slot(
      [name, N, bad_index](int64_t m, int64_t id) { return bad_index(name, m, id, N); });
  const In wv = w.defined() ? in(w) : In{nullptr, false};
  MT_LAUNCH(scatter_first_kernel, static_cast<unsigned>(M), kThreads, 0, c)
  (in(src), wv, w.defined(), idx.ptr<const int32_t>(), M, N, D, out(o), bad);
  launched(op, shapes);
}

}  // namespace

// ---- embedding ------------------------------------------------------------------------------

void embedding_forward(const Ctx& c, const Tensor& table, const Tensor& ids, Tensor& o) {
  auto shapes = [&] { return "table " + str(table) + ", ids " + str(ids) + ", out " + str(o); };
  MT_CHECK(table.defined() && table.ndim() == 2 && is_fb(table) && is_fb(o) && ids.defined() &&
               ids.dtype() == DType::i32 && o.numel() == ids.numel() * table.dim(1),
           "cuda embedding_forward: " + shapes());
  const int64_t V = table.dim(0), D = table.dim(1);
  unsigned long long* bad = c.checks->slot(
      [V](int64_t n, int64_t id) { return bad_token_id("embedding_forward", n, id, V); });
  launch_map(c, o.numel(),
             GatherF<DenseRow>{{in(table), D}, ids.ptr<const int32_t>(), D, V, out(o), bad},
             "embedding_forward", shapes);
}

void embedding_q8_forward(const Ctx& c, const Tensor& table, const Tensor& ids, Tensor& o) {
  auto shapes = [&] { return "table " + str(table) + ", ids " + str(ids) + ", out " + str(o); };
  const int64_t rb = table.defined() && table.ndim() == 2 ? table.dim(1) : 0, D = q8_row_values(rb);
  MT_CHECK(table.dtype() == DType::i8 && D > 0 && q8_row_bytes(D) == rb && is_fb(o) &&
               ids.defined() && ids.dtype() == DType::i32 && o.numel() == ids.numel() * D,
           "cuda embedding_q8_forward: " + shapes() +
               " (want table i8 [V, D + D / 16] with D a multiple of 32, ids [N] i32, out [N, D])");
  const int64_t V = table.dim(0);
  unsigned long long* bad = c.checks->slot(
      [V](int64_t n, int64_t id) { return bad_token_id("embedding_q8_forward", n, id, V); });
  launch_map(c, o.numel(),
             GatherF<Q8Row>{
                 {table.ptr<const int8_t>(), D, rb}, ids.ptr<const int32_t>(), D, V, out(o), bad},
             "embedding_q8_forward", shapes);
}

void embedding_backward(const Ctx& c, const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  auto shapes = [&] {
    return "dout " + str(dout) + ", ids " + str(ids) + ", dtable " + str(dtable);
  };
  MT_CHECK(dtable.defined() && dtable.ndim() == 2 && is_fb(dtable) && is_fb(dout) &&
               ids.defined() && ids.dtype() == DType::i32 &&
               dout.numel() == ids.numel() * dtable.dim(1),
           "cuda embedding_backward: " + shapes());
  const int64_t V = dtable.dim(0), D = dtable.dim(1), N = ids.numel();
  MT_CHECK(N < INT_MAX, "cuda embedding_backward: too many tokens: " + shapes());
  scatter_add(c, "embedding_backward", bad_token_id, dout, ids, V, Tensor(), D, dtable, shapes);
}

// ---- MoE row movement -----------------------------------------------------------------------

void gather_rows(const Ctx& c, const Tensor& x, const Tensor& idx, Tensor& o) {
  auto shapes = [&] { return "x " + str(x) + ", idx " + str(idx) + ", out " + str(o); };
  MT_CHECK(is_fb(x) && is_fb(o) && idx.defined() && idx.dtype() == DType::i32 &&
               last_dim(o) == last_dim(x) && lead_rows(o) == idx.numel(),
           "cuda gather_rows: " + shapes() + " (want x [N, D], idx [M] i32, out [M, D])");
  const int64_t D = last_dim(x), N = lead_rows(x);
  unsigned long long* bad =
      c.checks->slot([N](int64_t m, int64_t id) { return bad_row_index("gather_rows", m, id, N); });
  launch_map(c, o.numel(),
             GatherF<DenseRow>{{in(x), D}, idx.ptr<const int32_t>(), D, N, out(o), bad},
             "gather_rows", shapes);
}

void scatter_rows(const Ctx& c, const Tensor& src, const Tensor& idx, Tensor& o) {
  auto shapes = [&] { return "src " + str(src) + ", idx " + str(idx) + ", out " + str(o); };
  MT_CHECK(is_fb(src) && is_fb(o) && idx.defined() && idx.dtype() == DType::i32 &&
               last_dim(src) == last_dim(o) && lead_rows(src) == idx.numel(),
           "cuda scatter_rows: " + shapes() + " (want src [M, D], idx [M] i32, out [N, D])");
  const int64_t D = last_dim(o), N = lead_rows(o);
  unsigned long long* bad = c.checks->slot(
      [N](int64_t m, int64_t id) { return bad_row_index("scatter_rows", m, id, N); });
  launch_map(c, src.numel(), ScatterF{in(src), idx.ptr<const int32_t>(), D, N, out(o), bad},
             "scatter_rows", shapes);
}

namespace {
constexpr int kScatterPairs = 4;  // (src, out) pairs one launch writes
// scatter_rows over several pairs with one id, i over the pairs' [M, D_t] back to back: element
// i of pair t (start[t] <= i < start[t + 1]) is ScatterF's element i - start[t]. An index
// outside [0, n) is recorded once per row, by pair 0, and nothing is written with it.
struct ScatterEachF {
  const int32_t* id;
  int64_t n;
  int pairs;
  int64_t start[kScatterPairs + 1];
  int64_t D[kScatterPairs];
  In x[kScatterPairs];
  Out o[kScatterPairs];
  unsigned long long* bad;
  __device__ void operator()(int64_t i) const {
    int t = 0;
    while (t + 1 < pairs && i >= start[t + 1]) ++t;
    const int64_t e = i - start[t], m = e / D[t], d = e - m * D[t], r = id[m];
    if (r < 0 || r >= n) {
      if (t == 0 && d == 0) record_bad(bad, m, r);
      return;
    }
    o[t].set(r * D[t] + d, x[t][e]);
  }
};
}  // namespace

void scatter_rows_each(const Ctx& c, const std::vector<Tensor>& srcs, const Tensor& idx,
                       std::vector<Tensor>& outs) {
  // One launch where every pair has rows (the bad-index check needs one n), else the core's
  // composition: one scatter_rows a pair.
  bool joint = c.joint_copies && srcs.size() == outs.size() && !srcs.empty() &&
               srcs.size() <= size_t{kScatterPairs};
  for (size_t t = 0; joint && t < srcs.size(); ++t)
    joint = is_fb(srcs[t]) && is_fb(outs[t]) && last_dim(outs[t]) > 0 &&
            lead_rows(outs[t]) == lead_rows(outs[0]);
  if (!joint) {
    c.self->Backend::scatter_rows_each(srcs, idx, outs);
    return;
  }
  auto shapes = [&] {
    std::string list;
    for (size_t t = 0; t < srcs.size(); ++t)
      list += (t ? ", src " : "src ") + str(srcs[t]) + " -> out " + str(outs[t]);
    return list + ", idx " + str(idx);
  };
  const int64_t M = idx.defined() ? idx.numel() : -1;
  bool ok = idx.defined() && idx.dtype() == DType::i32;
  for (size_t t = 0; t < srcs.size(); ++t)
    ok = ok && last_dim(srcs[t]) == last_dim(outs[t]) && lead_rows(srcs[t]) == M;
  MT_CHECK(ok, "cuda scatter_rows_each: " + shapes() +
                   " (want each src [M, D_i] and out [N, D_i], idx [M] i32)");
  const int64_t N = lead_rows(outs[0]);
  ScatterEachF f{idx.ptr<const int32_t>(),
                 N,
                 static_cast<int>(srcs.size()),
                 {},
                 {},
                 {},
                 {},
                 c.checks->slot([N](int64_t m, int64_t id) {
                   return bad_row_index("scatter_rows", m, id, N);
                 })};
  for (size_t t = 0; t < srcs.size(); ++t) {
    f.D[t] = last_dim(outs[t]);
    f.x[t] = in(srcs[t]);
    f.o[t] = out(outs[t]);
    f.start[t + 1] = f.start[t] + srcs[t].numel();
  }
  launch_map(c, f.start[srcs.size()], f, "scatter_rows_each", shapes);
}

void scatter_add_rows(const Ctx& c, const Tensor& src, const Tensor& idx, const Tensor& w,
                      Tensor& o) {
  auto shapes = [&] {
    return "src " + str(src) + ", idx " + str(idx) + ", w " + str(w) + ", out " + str(o);
  };
  MT_CHECK(is_fb(src) && is_fb(o) && idx.defined() && idx.dtype() == DType::i32 &&
               last_dim(src) == last_dim(o) && lead_rows(src) == idx.numel() &&
               (!w.defined() || (is_fb(w) && w.numel() == idx.numel())),
           "cuda scatter_add_rows: " + shapes() +
               " (want src [M, D], idx [M] i32, w [M] or none, out [N, D])");
  scatter_add(c, "scatter_add_rows", bad_row_index, src, idx, lead_rows(o), w, last_dim(o), o,
              shapes);
}

// ---- the int8 KV cache ----------------------------------------------------------------------

namespace {
constexpr int kQ8Warps = 4;  // warps per block of q8_scatter_kernel

// A warp per (source row m, group j) of W values: its scale (max |x| / 127, the lanes' maxima
// combined by shuffles: a maximum, so the bits of one thread's loop) and its W int8 values into
// row id[m] of q and s, by quantize_q8_group's rule (round half away from zero). The lanes take
// every 32nd value, so a warp's loads and stores coalesce (one thread a group took a whole row
// alone: 2 x 2,048 dependent loads a decode step's cache write at Hkv D = 2,048).
__global__ void __launch_bounds__(kQ8Warps * 32)
    q8_scatter_kernel(In x, const int32_t* id, int64_t M, int64_t C, int64_t G, int64_t W,
                      int64_t n, int8_t* q, float* s, unsigned long long* bad) {
  MT_KERNEL_PROLOGUE();
  const int lane = threadIdx.x & 31;
  const int64_t wi = static_cast<int64_t>(blockIdx.x) * kQ8Warps + (threadIdx.x >> 5);
  if (wi >= M * G) return;  // whole warps return together
  const int64_t m = wi / G, j = wi - m * G, r = id[m];
  if (r < 0 || r >= n) {
    if (j == 0 && lane == 0) record_bad(bad, m, r);
    return;
  }
  const int64_t src = m * C + j * W, dst = r * C + j * W;
  float amax = 0.f;
  bool nan = false;  // a NaN: a NaN scale (fmaxf passes over it), as mt/q8.h's
  for (int64_t t = lane; t < W; t += 32) {
    amax = fmaxf(amax, fabsf(x[src + t]));
    nan |= isnan(x[src + t]);
  }
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float scale = __any_sync(0xffffffffu, nan) ? NAN : amax / 127.f;
  const float inv = scale > 0.f ? 1.f / scale : 0.f;
  for (int64_t t = lane; t < W; t += 32)
    q[dst + t] = static_cast<int8_t>(roundf(fminf(127.f, fmaxf(-127.f, x[src + t] * inv))));
  if (lane == 0) s[r * G + j] = scale;
}
// out[r, c] = q[r, c] x s[r, c / W]: block (row r, columns 256 y ..): 32-bit column arithmetic
// (a 64-bit division per element, as a flat index needs, cost more than the bytes).
constexpr int kQ8Cols = 256;
__global__ void __launch_bounds__(kQ8Cols)
    q8_dequant_kernel(const int8_t* q, const float* s, int64_t C, int G, int W, Out o) {
  MT_KERNEL_PROLOGUE();
  const int c = static_cast<int>(blockIdx.y) * kQ8Cols + static_cast<int>(threadIdx.x);
  if (c >= C) return;
  const int64_t r = blockIdx.x, i = r * C + c;
  o.set(i, static_cast<float>(q[i]) * s[r * G + c / W]);
}
// Rows and column blocks of a [N, C] launch (grid.y holds at most 65535 blocks).
dim3 q8_grid(const std::string& op, int64_t N, int64_t C) {
  const int64_t cols = (C + kQ8Cols - 1) / kQ8Cols;
  MT_CHECK(N <= INT_MAX && cols <= 65535,
           "cuda " + op + ": " + std::to_string(N) + " rows of " + std::to_string(C) +
               " columns are more than one launch takes (2^31 - 1 rows, 16,776,960 columns)");
  return dim3(static_cast<unsigned>(N), static_cast<unsigned>(cols));
}

// C / G for rows q [N, C] i8 and scales [N, G] f32.
int64_t q8_group(const char* op, const Tensor& q, const Tensor& s) {
  MT_CHECK(q.defined() && s.defined() && q.dtype() == DType::i8 && s.dtype() == DType::f32 &&
               q.ndim() >= 1 && s.ndim() >= 1 && last_dim(s) > 0 &&
               last_dim(q) % last_dim(s) == 0 && lead_rows(q) == lead_rows(s),
           std::string("cuda ") + op + ": rows " + str(q) + ", scales " + str(s) +
               " (want i8 [N, G * W] and f32 [N, G])");
  return last_dim(q) / last_dim(s);
}
}  // namespace

void scatter_rows_q8(const Ctx& c, const Tensor& src, const Tensor& idx, Tensor& q, Tensor& s) {
  auto shapes = [&] {
    return "src " + str(src) + ", idx " + str(idx) + ", rows " + str(q) + ", scales " + str(s);
  };
  const int64_t W = q8_group("scatter_rows_q8", q, s);
  MT_CHECK(is_fb(src) && idx.defined() && idx.dtype() == DType::i32 &&
               last_dim(src) == last_dim(q) && lead_rows(src) == idx.numel(),
           "cuda scatter_rows_q8: " + shapes() + " (want src [M, C], idx [M] i32)");
  const int64_t N = lead_rows(q), G = last_dim(s);
  unsigned long long* bad = c.checks->slot(
      [N](int64_t m, int64_t id) { return bad_row_index("scatter_rows_q8", m, id, N); });
  const int64_t M = idx.numel(), warps = M * G;
  if (warps == 0) return;
  MT_LAUNCH(q8_scatter_kernel, static_cast<unsigned>((warps + kQ8Warps - 1) / kQ8Warps),
            kQ8Warps * 32, 0, c)
  (in(src), idx.ptr<const int32_t>(), M, last_dim(q), G, W, N, q.ptr<int8_t>(), s.ptr<float>(),
   bad);
  launched("scatter_rows_q8", shapes);
}

void dequantize_rows_q8(const Ctx& c, const Tensor& q, const Tensor& s, Tensor& o) {
  auto shapes = [&] { return "rows " + str(q) + ", scales " + str(s) + ", out " + str(o); };
  const int64_t W = q8_group("dequantize_rows_q8", q, s);
  MT_CHECK(is_fb(o) && o.numel() == q.numel(),
           "cuda dequantize_rows_q8: " + shapes() + " (want out f32 or bf16, as many elements)");
  const int64_t N = lead_rows(q), C = last_dim(q);
  if (N == 0 || C == 0) return;
  MT_LAUNCH(q8_dequant_kernel, q8_grid("dequantize_rows_q8", N, C), kQ8Cols, 0, c)
  (q.ptr<const int8_t>(), s.ptr<const float>(), C, static_cast<int>(last_dim(s)),
   static_cast<int>(W), out(o));
  launched("dequantize_rows_q8", shapes);
}

// ---- columns: split and concat on the last dimension -----------------------------------------

namespace {
// dst[r, dc + j] (+)= src[r, sc + j], i over [N, width]: one thread per element, consecutive
// threads on consecutive columns of a row, so loads and stores coalesce.
struct ColumnsF {
  In s;
  int64_t ds, sc;
  Out o;
  int64_t dd, dc, width;
  bool acc;
  __device__ void operator()(int64_t i) const {
    const int64_t r = i / width, j = i - r * width;
    const float v = s[r * ds + sc + j];
    const int64_t at = r * dd + dc + j;
    o.set(at, acc ? __fadd_rn(o.get(at), v) : v);
  }
};
}  // namespace

void copy_columns(const Ctx& c, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                  int64_t width, bool accumulate) {
  auto shapes = [&] {
    return "columns [" + std::to_string(src_col) + ", " + std::to_string(src_col + width) +
           ") of src " + str(src) + " to columns [" + std::to_string(dst_col) + ", " +
           std::to_string(dst_col + width) + ") of dst " + str(dst);
  };
  MT_CHECK(is_fb(src) && is_fb(dst) && src.ndim() >= 1 && dst.ndim() >= 1,
           "cuda copy_columns: " + shapes() + " (want f32 or bf16 matrices [N, Ds] and [N, Dd])");
  const int64_t ds = last_dim(src), dd = last_dim(dst), N = lead_rows(src);
  MT_CHECK(N == lead_rows(dst) && width >= 0 && src_col >= 0 && dst_col >= 0 &&
               src_col + width <= ds && dst_col + width <= dd,
           "cuda copy_columns: " + shapes() + " (want the same rows and columns inside both)");
  launch_map(c, N * width, ColumnsF{in(src), ds, src_col, out(dst), dd, dst_col, width, accumulate},
             "copy_columns", shapes);
}

namespace {
constexpr int kSplitPieces = 8;  // pieces one launch writes
// pieces[p][r, j - start[p]] = src[r, j] for start[p] <= j < start[p + 1], i over [N, D]: one
// thread per element of src, so the loads coalesce, and the stores within each piece.
struct SplitF {
  In s;
  int64_t d;
  int n;
  int64_t start[kSplitPieces + 1];
  Out o[kSplitPieces];
  __device__ void operator()(int64_t i) const {
    const int64_t r = i / d, j = i - r * d;
    int p = 0;
    while (p + 1 < n && j >= start[p + 1]) ++p;
    o[p].set(r * (start[p + 1] - start[p]) + j - start[p], s[i]);
  }
};
}  // namespace

void split_columns(const Ctx& c, const Tensor& src, std::vector<Tensor>& pieces) {
  if (!c.joint_copies || pieces.size() > static_cast<size_t>(kSplitPieces)) {
    c.self->Backend::split_columns(src, pieces);  // the core's: one copy_columns a piece
    return;
  }
  auto shapes = [&] {
    std::string list;
    for (const Tensor& p : pieces) list += (list.empty() ? "" : ", ") + str(p);
    return "src " + str(src) + " into pieces [" + list + "]";
  };
  int64_t total = 0;
  bool ok = is_fb(src) && src.ndim() >= 1;
  for (const Tensor& p : pieces) {
    ok = ok && is_fb(p) && p.ndim() >= 1 && lead_rows(p) == lead_rows(src);
    if (ok) total += last_dim(p);
  }
  MT_CHECK(ok && total == last_dim(src),
           "cuda split_columns: " + shapes() +
               " (want f32 or bf16 src [N, D] and pieces [N, w_i], the widths summing to D)");
  SplitF f{in(src), last_dim(src), static_cast<int>(pieces.size()), {}, {}};
  for (size_t p = 0; p < pieces.size(); ++p) {
    f.start[p + 1] = f.start[p] + last_dim(pieces[p]);
    f.o[p] = out(pieces[p]);
  }
  launch_map(c, src.numel(), f, "split_columns", shapes);
}
}  // namespace mt::cuda

// ---- int8 weights (mt/q8.h) ---------------------------------------------------------------------
namespace mt::cuda {
namespace {
// Row r of the matrix [N, K] that q8 rows hold: q x the block's scale (f32 products, as the
// CPU's dequantization), stored as f32 or rounded to bf16; block (r, columns 256 y ..).
__global__ void __launch_bounds__(kQ8Cols)
    q8_weight_kernel(const int8_t* q, int64_t k, int64_t rb, Out o) {
  MT_KERNEL_PROLOGUE();
  const int j = static_cast<int>(blockIdx.y) * kQ8Cols + static_cast<int>(threadIdx.x);
  if (j >= k) return;
  const int64_t r = blockIdx.x;
  const int8_t* row = q + r * rb;
  o.set(r * k + j, __fmul_rn(static_cast<float>(row[j]), q8_scale_at(row, k, j / kQ8Block)));
}
// f(std::integral_constant<int, R>) for the smallest R of 1, 2, 4 and 8 that holds m rows (the
// GEMV kernels' row counts).
template <class F>
void with_row_slots(int64_t m, const F& f) {
  if (m == 1)
    f(std::integral_constant<int, 1>{});
  else if (m == 2)
    f(std::integral_constant<int, 2>{});
  else if (m <= 4)
    f(std::integral_constant<int, 4>{});
  else
    f(std::integral_constant<int, 8>{});
}
// The GEMV kernels' end: each lane's partial sums of weight rows n0 + r (r < NR) and rows m of x
// (m < rows) added over the warp by shuffles (a fixed order), times alpha, stored by lane 0 at
// y[m, n0 + r] where n0 + r < N.
template <int NR, int MR>
__device__ __forceinline__ void store_warp_sums(const float (&acc)[NR][MR], int rows, int lane,
                                                int64_t n0, int64_t N, float alpha, Out y) {
#pragma unroll
  for (int r = 0; r < NR; ++r) {
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      if (m >= rows) break;
      float v = acc[r][m];
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && n0 + r < N) y.set(m * N + n0 + r, v * alpha);
    }
  }
}
// Decode's matrix-vector products on int8 rows: y[m, n] = sum_k x[m, k] q[n, k] scale[n, k / 32]
// for the `rows` (at most MR: 1, 2, 4 or 8) rows of x (f32, or bf16 when XBf16). A warp per NR
// weight rows (W warps a block): each lane takes 16 consecutive int8 values of each (one 16-byte
// load when rows are 16-byte aligned, Vec16; else eight 2-byte loads), every 512th from its own,
// so the warp reads its rows once, coalesced, and the matching 16 values of each row of x in
// 16-byte loads (x, a few KB read by every warp, comes through the L1 cache: NR > 1 shares each
// load among NR weight rows, since at 8 rows of x the L1 cache's bandwidth bounds the kernel). A
// lane sums its 16 products, times their block's scale, into f32; the warp's partial sums are
// combined by shuffles. Reads 1 byte a weight against bf16's 2. NR = 4 pays for an f32 x only
// (H100, llama-bench-1b batch-8 decode: f32 2,333 against 1,569 tokens/s with NR = 1; bf16
// 2,440 against 2,932, where the fewer warps cost more than the L1 traffic saved).
template <int MR, bool XBf16>
struct GemvShape {
  static constexpr int NR = MR >= 4 && !XBf16 ? 4 : 1;  // weight rows a warp
  static constexpr int W = NR == 4 ? 4 : 8;             // warps a block
};
template <int MR, bool Vec16, bool XBf16>
__global__ void __launch_bounds__((GemvShape<MR, XBf16>::W * 32))
    q8_gemv_kernel(const void* xp, int rows, const int8_t* q, int64_t N, int64_t K, int64_t rb,
                   Out y) {
  MT_KERNEL_PROLOGUE();
  constexpr int NR = GemvShape<MR, XBf16>::NR, W = GemvShape<MR, XBf16>::W;
  const int lane = threadIdx.x & 31;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * W + (threadIdx.x >> 5)) * NR;
  if (n0 >= N) return;  // whole warps return together
  const int8_t* row[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) row[r] = q + (n0 + r < N ? n0 + r : n0) * rb;  // past N: reread n0
  float acc[NR][MR] = {};
  [[maybe_unused]] constexpr int kUnroll =
      NR == 1 ? 4 : 2;  // loads in flight a lane: 4 x NR 16-byte chunks
#pragma unroll kUnroll
  for (int64_t k0 = lane * 16; k0 < K; k0 += 512) {
    uint32_t raw[NR][4];
    float scale[NR];
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      if constexpr (Vec16) {
        const uint4 v = *reinterpret_cast<const uint4*>(row[r] + k0);
        raw[r][0] = v.x, raw[r][1] = v.y, raw[r][2] = v.z, raw[r][3] = v.w;
      } else {  // rows of K + K / 16 bytes are 2-byte aligned only (K = 32, 96, ...)
        const auto* h = reinterpret_cast<const uint16_t*>(row[r] + k0);
#pragma unroll
        for (int t = 0; t < 4; ++t)
          raw[r][t] = static_cast<uint32_t>(h[2 * t]) | (static_cast<uint32_t>(h[2 * t + 1]) << 16);
      }
      scale[r] = q8_scale_at(row[r], K, k0 / kQ8Block);
    }
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      if (m >= rows) break;  // the same for every lane
      float xv[16];
      if constexpr (XBf16) {
        const uint4* xs =
            reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(xp) + m * K + k0);
        const uint4 lo = xs[0], hi = xs[1];
        const uint32_t w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          xv[2 * t] = __uint_as_float(w[t] << 16);
          xv[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
        }
      } else {
        const uint4* xs =
            reinterpret_cast<const uint4*>(static_cast<const float*>(xp) + m * K + k0);
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const uint4 f = xs[t];
          xv[4 * t] = __uint_as_float(f.x), xv[4 * t + 1] = __uint_as_float(f.y);
          xv[4 * t + 2] = __uint_as_float(f.z), xv[4 * t + 3] = __uint_as_float(f.w);
        }
      }
#pragma unroll
      for (int r = 0; r < NR; ++r) {
        float part = 0.f;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
          const auto w8 = static_cast<int8_t>(raw[r][t / 4] >> (8 * (t % 4)));
          part = fmaf(static_cast<float>(w8), xv[t], part);
        }
        acc[r][m] = fmaf(part, scale[r], acc[r][m]);
      }
    }
  }
  store_warp_sums<NR, MR>(acc, rows, lane, n0, N, 1.f, y);
}
}  // namespace

// Up to 8 rows of x (decode's batches): q8_gemv_kernel on the int8 rows in place. More:
// the rows dequantized into a device temporary in x's dtype (bf16 x: the weights rounded to bf16,
// as the CPU's int8 products do), then a cuBLASLt matmul against it (5 bytes moved per weight
// against bf16's 2, which a prefill's product amortises).
void matmul_q8(const Ctx& c, const Tensor& x, const Tensor& w, Tensor& y) {
  auto shapes = [&] { return "x " + str(x) + ", w " + str(w) + ", y " + str(y); };
  const int64_t k = is_fb(x) && x.ndim() >= 1 ? last_dim(x) : 0;
  MT_CHECK(is_fb(x) && is_fb(y) && x.ndim() >= 1 && y.ndim() >= 1 && w.defined() &&
               w.dtype() == DType::i8 && w.ndim() == 2 && k % kQ8Block == 0 &&
               w.dim(1) == q8_row_bytes(k) && last_dim(y) == w.dim(0) &&
               x.numel() / std::max<int64_t>(k, 1) * w.dim(0) == y.numel(),
           "cuda matmul_q8: " + shapes() +
               " (want x [..., K] with K a multiple of 32, w i8 [N, K + K / 16], y [..., N])");
  const int64_t n = w.dim(0), m = k ? x.numel() / k : 0;
  if (m == 0 || n == 0) return;
  const auto* wp = w.ptr<const int8_t>();
  const auto addr = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
  if (m <= 8 && !c.q8_dequant_always && addr(x.data()) % 16 == 0 && addr(wp) % 2 == 0) {
    // decode: the int8 rows read once, in place
    const int64_t rb = w.dim(1);
    const bool vec = rb % 16 == 0 && addr(wp) % 16 == 0, xbf = x.dtype() == DType::bf16;
    const auto run = [&](auto kernel, auto rows, auto x_bf16) {
      using G = GemvShape<decltype(rows)::value, decltype(x_bf16)::value>;
      const int64_t per_block = static_cast<int64_t>(G::W) * G::NR;
      const auto grid = static_cast<unsigned>((n + per_block - 1) / per_block);
      MT_LAUNCH(kernel, grid, G::W * 32, 0, c)
      (x.data(), static_cast<int>(m), wp, n, k, rb, out(y));
    };
    const auto with_x = [&](auto rows, auto v16) {
      constexpr int R = decltype(rows)::value;
      constexpr bool V = decltype(v16)::value;
      xbf ? run(q8_gemv_kernel<R, V, true>, rows, std::true_type{})
          : run(q8_gemv_kernel<R, V, false>, rows, std::false_type{});
    };
    const auto with_vec = [&](auto rows) {
      vec ? with_x(rows, std::true_type{}) : with_x(rows, std::false_type{});
    };
    with_row_slots(m, with_vec);
    launched("matmul_q8", shapes);
    return;
  }
  Tensor wf = c.scratch({n, k}, x.dtype());
  MT_LAUNCH(q8_weight_kernel, q8_grid("matmul_q8", n, k), kQ8Cols, 0, c)
  (wp, k, w.dim(1), out(wf));
  launched("matmul_q8", shapes);
  Tensor y2 = y.view({m, n});
  matmul(c, x.view({m, k}), wf, y2, false, true, 1.f, 0.f);
}

namespace {
// Decode's matrix-vector products on bf16 or f32 rows, the same shape of work as matmul_q8's:
// y[m, n] = alpha sum_k x[m, k] w[n, k] for the `rows` (at most MR: 1, 2, 4 or 8) rows of x, w
// [N, K] the projections' rows layout (ModelRunner::transpose_projections), x and w of one dtype
// (Bf16: bf16, else f32), f32 products and sums. A warp per NR weight rows, W warps a block; a
// lane takes 8 consecutive values of each row (one 16-byte load of bf16, two of f32), every
// 256th from its own, and issues U such chunks of every row before it uses any (the loads a
// lane keeps in flight: what streaming a matrix at the memory's speed needs), then multiplies
// them by the matching values of each row of x (read through the L1 cache by every warp; NR = 2
// at 4 and 8 rows of x halves that traffic). Each output is a fixed-order sum (a lane's chunks
// in k order, then the warp's 32 partial sums by shuffles), the same whichever other rows of x
// the call holds.
template <int MR>
struct RowsGemvShape {
  static constexpr int NR = MR >= 4 ? 2 : 1;  // weight rows a warp
  static constexpr int W = 8;                 // warps a block
  // Chunks of each row in flight a lane: at one row of x, 8 (a 2,048-wide bf16 row whole),
  // where llama-bench-1b's 2,048 to 6,144 weight rows give 16 to 47 warps an H200's SM.
  static constexpr int U = MR == 1 ? 8 : NR == 1 ? 4 : 2;
};
template <int MR, bool Bf16>
__global__ void __launch_bounds__(RowsGemvShape<MR>::W * 32)
    rows_gemv_kernel(const void* xp, int rows, const void* wp, int64_t N, int64_t K, float alpha,
                     Out y) {
  MT_KERNEL_PROLOGUE();
  using G = RowsGemvShape<MR>;
  constexpr int NR = G::NR, U = G::U;
  const int lane = threadIdx.x & 31;
  const int64_t n0 = (static_cast<int64_t>(blockIdx.x) * G::W + (threadIdx.x >> 5)) * NR;
  if (n0 >= N) return;  // whole warps return together
  const In x{xp, Bf16};
  In row[NR];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    const int64_t n = n0 + r < N ? n0 + r : n0;  // past N: n0's
    row[r] = {static_cast<const unsigned char*>(wp) + n * K * (Bf16 ? 2 : 4), Bf16};
  }
  float acc[NR][MR] = {};
  for (int64_t base = lane * 8; base < K; base += 256 * U) {
    // Every load unconditional (no branch for the compiler to sink one below): chunks past K
    // read the row's first and x's first and add nothing.
    float wv[U][NR][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t k0 = base + 256 * u < K ? base + 256 * u : 0;
#pragma unroll
      for (int r = 0; r < NR; ++r) load8(wv[u][r], row[r], k0, true);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const bool used = base + 256 * u < K;
      const int64_t k0 = used ? base + 256 * u : 0;
#pragma unroll
      for (int m = 0; m < MR; ++m) {
        if (m > 0 && m >= rows) break;  // the same for every lane; rows >= 1
        float xv[8];
        load8(xv, x, m * K + k0, true);
#pragma unroll
        for (int r = 0; r < NR; ++r) {
          float part = 0.f;
#pragma unroll
          for (int t = 0; t < 8; ++t) part = fmaf(wv[u][r][t], xv[t], part);
          if (used) acc[r][m] += part;
        }
      }
    }
  }
  store_warp_sums<NR, MR>(acc, rows, lane, n0, N, alpha, y);
}
}  // namespace

bool matmul_rows_gemv(const Ctx& c, const Tensor& x, const Tensor& w, Tensor& y, bool trans_x,
                      bool trans_w, float alpha, float beta) {
  // x's rows against w's rows: x [..., rows, K] as it lies, w [N, K] (one weight, read
  // transposed), y overwritten, one dtype for x and w, 16-byte chunks of both.
  if (!c.rows_gemv || trans_x || !trans_w || beta != 0.f || w.ndim() != 2 ||
      x.dtype() != w.dtype() || !aligned16({x.data(), w.data()}))
    return false;
  const int64_t k = x.dim(-1), n = w.dim(0);
  const int64_t rows = k > 0 ? x.numel() / k : 0;
  if (rows < 1 || rows > 8 || k % 8 != 0) return false;
  const auto run = [&](auto mr) {
    constexpr int MR = decltype(mr)::value;
    using G = RowsGemvShape<MR>;
    const int64_t per_block = static_cast<int64_t>(G::W) * G::NR;
    const auto grid = static_cast<unsigned>((n + per_block - 1) / per_block);
    const auto launch = [&](auto kernel) {
      MT_LAUNCH(kernel, grid, G::W * 32, 0, c)
      (x.data(), static_cast<int>(rows), w.data(), n, k, alpha, out(y));
    };
    x.dtype() == DType::bf16 ? launch(rows_gemv_kernel<MR, true>)
                             : launch(rows_gemv_kernel<MR, false>);
  };
  with_row_slots(rows, run);
  launched("matmul", [&] { return "x " + str(x) + ", w " + str(w) + "^T, y " + str(y); });
  return true;
}

// One matmul_q8 per expert with rows, on its slices of x and y (the launches the core made
// before this op existed; no device read of the counts: they come on the host).
void grouped_matmul_q8(const Ctx& c, const Tensor& x, const Tensor& w,
                       const std::vector<int64_t>& counts, Tensor& y) {
  int64_t rows = 0;
  bool ok = is_fb(x) && is_fb(y) && x.ndim() == 2 && y.ndim() == 2 && w.defined() &&
            w.dtype() == DType::i8 && w.ndim() == 3 && counts.size() == size_t(w.dim(0));
  for (const int64_t n : counts) {
    ok = ok && n >= 0;
    rows += n;
  }
  MT_CHECK(ok && rows == x.dim(0) && y.dim(0) == rows && y.dim(1) == w.dim(1),
           "cuda grouped_matmul_q8: x " + str(x) + ", w " + str(w) + ", y " + str(y) + " and " +
               std::to_string(counts.size()) +
               " counts (want x [M, K], w i8 [E, N, K + K / 16], y [M, N] and E counts of rows "
               "summing to M)");
  const int64_t n = w.dim(1), rb = w.dim(2);
  int64_t r = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    const auto ei = static_cast<int64_t>(e);
    Tensor ye = y.slice0(r, r + counts[e]);
    matmul_q8(c, x.slice0(r, r + counts[e]), w.slice0(ei, ei + 1).view({n, rb}), ye);
    r += counts[e];
  }
}

}  // namespace mt::cuda
