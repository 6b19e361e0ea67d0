// Kernels of the CUDA backend: elementwise ops, reductions, embedding, rmsnorm, rope,
// activations, softmax, cross-entropy and AdamW (the matmul is in gemm.cu).
//
// Storage is f32 or bf16 per operand, arithmetic always f32: operands are read through In/Out
// views that branch on the dtype (the branch is uniform across a launch, so it costs little and
// keeps one kernel per op instead of one per dtype mix). Every reduction has a fixed shape — a
// fixed grid, a fixed per-block tree, fixed row blocks — and no float atomics, so results are
// bitwise reproducible run to run. The formulas and their operation order follow the CPU backend
// (plugins/backends/cpu/kernels) so the two agree to rounding.
#ifndef MT_CUDA_EMULATION
#include <cuda_bf16.h>
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string>
#include <vector>

#include "attention_args.h"
#include "device_io.cuh"
#include "kernels.h"
#include "mt/error.h"

namespace mt::cuda {

void check(cudaError_t e, const std::string& op, const std::string& what,
           const std::string& shapes) {
  if (e == cudaSuccess) return;
  static_cast<void>(cudaGetLastError());  // clear a non-sticky error so the next op can run
  throw Error("cuda " + op + ": " + what + " failed: " + cudaGetErrorName(e) + ": " +
              cudaGetErrorString(e) + (shapes.empty() ? "" : " (" + shapes + ")"));
}

void check(cublasStatus_t s, const std::string& op, const std::string& what,
           const std::string& shapes) {
  if (s == CUBLAS_STATUS_SUCCESS) return;
  throw Error("cuda " + op + ": " + what + " failed: " + cublasLtGetStatusName(s) + ": " +
              cublasLtGetStatusString(s) + (shapes.empty() ? "" : " (" + shapes + ")"));
}

namespace {

constexpr int64_t kMaxRotaryDim = 8192;  // rope: R floats of shared memory per block
constexpr int kThreads = 256;    // threads per block everywhere (block reductions assume it)
constexpr int kSumBlocks = 512;  // fixed grid of the two-pass sum: fixes its order
constexpr int64_t kMaxGrid = 1 << 20;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxGrid));
}

// ---- flat maps: f(i) for i in [0, n) ------------------------------------------------------
template <class F>
__global__ void map_kernel(int64_t n, F f) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    f(i);
}

template <class F, class S>
void launch_map(const Ctx& c, int64_t n, const F& f, const std::string& op, S&& shapes) {
  if (n <= 0) return;
  MT_LAUNCH(map_kernel, grid_for(n), kThreads, 0, c.stream)(n, f);
  launched(op, shapes);
}

// ---- vectorised elementwise ops --------------------------------------------------------------
// An op over I inputs and O outputs of n elements each, 8 consecutive elements per thread and
// step. Where every operand is 16-byte aligned, each goes through 16-byte loads and stores (bf16:
// one, f32: two), so a thread keeps I x 16 or 32 bytes in flight: with one 2- or 4-byte load per
// thread, as a plain map does, a Hopper's HBM sees too few requests to reach its bandwidth.
// Unaligned views and the tail go element by element. m(x, y) maps one element's inputs x[I] to
// its outputs y[O]; outputs marked in `acc` are added to (y = old + m's value, rounded once, as
// Out::add).
template <int I, int O, class Math>
struct Ew {
  In in[I];
  Out out[O];
  bool acc[O];
  Math m;
};

template <int I, int O, class Math>
__global__ void ew_kernel(int64_t n, Ew<I, O, Math> e, bool vec) {
  const int64_t chunks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t base = c * 8;
    float x[I][8], y[O][8];
#pragma unroll
    for (int i = 0; i < I; ++i) load8_upto(x[i], e.in[i], base, n, vec);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      float xi[I], yo[O];
#pragma unroll
      for (int i = 0; i < I; ++i) xi[i] = x[i][t];
      e.m(xi, yo);
#pragma unroll
      for (int o = 0; o < O; ++o) y[o][t] = yo[o];
    }
#pragma unroll
    for (int o = 0; o < O; ++o) {
      if (e.acc[o]) {
        float old[8];
        load8_upto(old, e.out[o].in(), base, n, vec);
#pragma unroll
        for (int t = 0; t < 8; ++t) y[o][t] = __fadd_rn(old[t], y[o][t]);
      }
      store8_upto(e.out[o], base, y[o], n, vec);
    }
  }
}

template <int I, int O, class Math, class S>
void launch_ew(const Ctx& c, int64_t n, const Ew<I, O, Math>& e, const std::string& op,
               S&& shapes) {
  if (n <= 0) return;
  bool vec = true;
  for (const In& x : e.in) vec = vec && aligned16({x.p});
  for (const Out& y : e.out) vec = vec && aligned16({y.p});
  auto* kernel = &ew_kernel<I, O, Math>;  // (template arguments would split the macro's)
  MT_LAUNCH(kernel, grid_for((n + 7) / 8), kThreads, 0, c.stream)(n, e, vec);
  launched(op, shapes);
}

// ---- block reductions: a fixed tree over kThreads lanes ------------------------------------
template <class T, bool kMax>
__device__ T block_reduce(T v, T* sh) {
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const T o = sh[threadIdx.x + s];
      sh[threadIdx.x] = kMax ? (o > sh[threadIdx.x] ? o : sh[threadIdx.x]) : sh[threadIdx.x] + o;
    }
    __syncthreads();
  }
  const T r = sh[0];
  __syncthreads();  // sh may be reused by the caller's next reduction
  return r;
}
__device__ float block_sum(float v, float* sh) {
  return block_reduce<float, false>(v, sh);
}
__device__ float block_max(float v, float* sh) {
  return block_reduce<float, true>(v, sh);
}

// What a bad index is called in messages: a token id (embedding) at position n outside the
// vocabulary [0, V), or a row index idx[m] outside [0, N) (gather, scatter, routing).
using BadIndex = std::string (*)(const std::string& op, int64_t at, int64_t id, int64_t n);
std::string bad_token_id(const std::string& op, int64_t n, int64_t id, int64_t V) {
  return "cuda " + op + ": token id " + std::to_string(id) + " at position " + std::to_string(n) +
         " is outside the vocabulary [0, " + std::to_string(V) + ")";
}
std::string bad_row_index(const std::string& op, int64_t m, int64_t id, int64_t N) {
  return "cuda " + op + ": idx[" + std::to_string(m) + "] = " + std::to_string(id) +
         " is outside [0, " + std::to_string(N) + ")";
}

// Throws for the first index of id outside [0, n).
void check_indices(const std::string& op, const std::vector<int32_t>& id, int64_t n,
                   BadIndex bad_index) {
  for (size_t m = 0; m < id.size(); ++m)
    if (id[m] < 0 || id[m] >= n) throw Error(bad_index(op, static_cast<int64_t>(m), id[m], n));
}

// Host copy of a small i32 tensor (ids, targets) for validation and index building.
std::vector<int32_t> host_ints(const Ctx& c, const Tensor& t, const std::string& op) {
  std::vector<int32_t> h(static_cast<size_t>(t.numel()));
  if (h.empty()) return h;
  check(cudaMemcpyAsync(h.data(), t.data(), t.nbytes(), cudaMemcpyDeviceToHost, c.stream), op,
        "copying indices to the host", t.str());
  check(cudaStreamSynchronize(c.stream), op, "stream synchronize", t.str());
  return h;
}

}  // namespace

DeviceChecks::DeviceChecks(Tensor words, cudaStream_t stream)
    : words_(std::move(words)), stream_(stream) {
  MT_CHECK(words_.defined() && words_.nbytes() >= kSlots * sizeof(unsigned long long),
           "cuda device checks: the slots need " + std::to_string(kSlots * 8) + " bytes");
  check(cudaMemsetAsync(words_.data(), 0xff, kSlots * sizeof(unsigned long long), stream_),
        "device checks", "clearing the slots");
}

unsigned long long* DeviceChecks::slot(Message message) {
  if (pending_.size() == kSlots) {
    check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
    report();
  }
  pending_.push_back(std::move(message));
  return static_cast<unsigned long long*>(words_.data()) + (pending_.size() - 1);
}

void DeviceChecks::report() {
  if (pending_.empty()) return;
  const size_t n = pending_.size();
  std::vector<unsigned long long> got(n);
  std::vector<Message> messages;
  messages.swap(pending_);
  check(cudaMemcpyAsync(got.data(), words_.data(), n * sizeof(unsigned long long),
                        cudaMemcpyDeviceToHost, stream_),
        "device checks", "reading the slots");
  check(cudaStreamSynchronize(stream_), "device checks", "stream synchronize");
  check(cudaMemsetAsync(words_.data(), 0xff, n * sizeof(unsigned long long), stream_),
        "device checks", "clearing the slots");
  for (size_t i = 0; i < n; ++i) {
    if (got[i] == kClear) continue;
    const auto position = static_cast<int64_t>(got[i] >> 32);
    const auto value = static_cast<int64_t>(static_cast<int32_t>(got[i] & 0xffffffffull));
    throw Error(messages[i](position, value) +
                " (found on the device, reported at the first synchronisation after the call)");
  }
}

namespace {

// ---- elementwise functors -------------------------------------------------------------------
struct FillF32 {
  float* p;
  float v;
  __device__ void operator()(int64_t i) const { p[i] = v; }
};
struct FillBf16 {
  __nv_bfloat16* p;
  float v;
  __device__ void operator()(int64_t i) const { p[i] = __float2bfloat16_rn(v); }
};
struct FillI32 {
  int32_t* p;
  int32_t v;
  __device__ void operator()(int64_t i) const { p[i] = v; }
};
// The math of the elementwise ops (Ew above): inputs x, outputs y.
struct CopyM {
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = x[0]; }
};
struct AddM {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[0] + x[1]; }
};
struct MulM {
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const { y[0] = x[0] * x[1]; }
};
struct ScaleM {
  float s;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const { y[0] = x[0] * s; }
};
// y += alpha x with the product rounded first, as the CPU does (no fused multiply-add).
struct AxpyM {
  float alpha;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = __fmul_rn(alpha, x[0]);
  }
};

void check_same(const char* op, const Tensor& a, const Tensor& b) {
  MT_CHECK(is_fb(a) && is_fb(b) && a.numel() == b.numel(),
           std::string("cuda ") + op + ": operands " + str(a) + " and " + str(b) +
               " must have the same element count and be f32 or bf16");
}

// ---- two-pass deterministic sum ------------------------------------------------------------
// x [n] -> partial [kSumBlocks] (double): each block's threads stride the array in a fixed
// pattern (the grid is fixed), then a fixed tree adds the block's lanes.
// A thread takes chunks of 8 consecutive elements, through one 16-byte load (bf16; two for
// f32) when x is 16-byte aligned (vec), else element by element in the same order: the sum
// depends on n alone. (One 2- or 4-byte load per thread in flight would leave a Hopper's HBM
// mostly idle on the gradient norm's pass over every parameter.)
__global__ void sum_partial_kernel(In x, int64_t n, bool squares, bool vec, double* partial) {
  __shared__ double sh[kThreads];
  double acc = 0;
  const int64_t chunks = (n + 7) / 8;
  const int64_t stride = static_cast<int64_t>(kSumBlocks) * kThreads;
  for (int64_t c = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; c < chunks;
       c += stride) {
    float v[8];
    load8_upto(v, x, c * 8, n, vec);
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const double d = v[t];
      acc += squares ? d * d : d;
    }
  }
  const double s = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// partial [kSumBlocks] -> *result, one block
__global__ void sum_final_kernel(const double* partial, double* result) {
  __shared__ double sh[kThreads];
  double acc = 0;
  for (int i = threadIdx.x; i < kSumBlocks; i += kThreads) acc += partial[i];
  const double s = block_reduce<double, false>(acc, sh);
  if (threadIdx.x == 0) *result = s;
}

// ---- activations (formulas as plugins/backends/cpu/kernels/activation.cpp) -----------------
constexpr float kGeluK = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

__device__ float sigmoid(float x) {
  return 1.f / (1.f + expf(-x));
}
__device__ float act_fwd(Activation act, float v) {
  switch (act) {
    case Activation::silu:
      return v * sigmoid(v);
    case Activation::gelu_tanh:
      // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation for negative x.
      return v * sigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
    case Activation::gelu_exact:
      return 0.5f * v * erfcf(-v * kInvSqrt2);
    case Activation::relu:
      return v > 0.f ? v : 0.f;
  }
  return 0.f;
}
// a = act(v), d = act'(v)
__device__ void act_both(Activation act, float v, float& a, float& d) {
  switch (act) {
    case Activation::silu: {
      const float s = sigmoid(v);
      a = v * s;
      d = s * (1.f + v * (1.f - s));
      return;
    }
    case Activation::gelu_tanh: {
      const float s = sigmoid(2.f * kGeluK * (v + kGeluC * v * v * v));
      a = v * s;
      d = s + v * 2.f * s * (1.f - s) * kGeluK * (1.f + 3.f * kGeluC * v * v);
      return;
    }
    case Activation::gelu_exact: {
      const float cdf = 0.5f * erfcf(-v * kInvSqrt2);
      a = v * cdf;
      d = cdf + v * kInvSqrt2Pi * expf(-0.5f * v * v);
      return;
    }
    case Activation::relu:
      a = v > 0.f ? v : 0.f;
      d = v > 0.f ? 1.f : 0.f;
      return;
  }
}

struct ActFwdM {
  Activation act;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = act_fwd(act, x[0]);
  }
};
// x: dout, input; y: dx (accumulated)
struct ActBwdM {
  Activation act;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    float a = 0.f, d = 0.f;  // act_both sets both for every Activation
    act_both(act, x[1], a, d);
    y[0] = x[0] * d;
  }
};
// x: gate, up
struct GatedFwdM {
  Activation act;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    y[0] = act_fwd(act, x[0]) * x[1];
  }
};
// x: dout, gate, up; y: dgate, dup (accumulated)
struct GatedBwdM {
  Activation act;
  __device__ void operator()(const float (&x)[3], float (&y)[2]) const {
    float a = 0.f, d = 0.f;  // act_both sets both for every Activation
    act_both(act, x[1], a, d);
    y[0] = x[0] * x[2] * d;
    y[1] = x[0] * a;
  }
};
struct SoftcapFwdM {
  float cap, inv;
  __device__ void operator()(const float (&x)[1], float (&y)[1]) const {
    y[0] = cap * tanhf(x[0] * inv);
  }
};
// d/dx cap tanh(x / cap) = 1 - (out / cap)^2. x: dout, out; y: dx (accumulated)
struct SoftcapBwdM {
  float inv;
  __device__ void operator()(const float (&x)[2], float (&y)[1]) const {
    const float t = x[1] * inv;
    y[0] = x[0] * (1.f - t * t);
  }
};

void check_ew(const char* op, std::initializer_list<const Tensor*> ts) {
  const Tensor& first = **ts.begin();
  bool ok = true;
  std::string desc;
  for (const Tensor* t : ts) {
    ok = ok && is_fb(*t) && t->numel() == first.numel();
    desc += (desc.empty() ? "" : ", ") + str(*t);
  }
  MT_CHECK(ok, std::string("cuda ") + op + ": operands " + desc +
                   " must be f32 or bf16 with the same element count");
}

// ---- rows by index: embedding, gather_rows, scatter_rows, scatter-adds --------------------
// Row copies, i over [M, D] with M = id's length. Gather: out[m] = x[id[m]] (the embedding lookup
// with x as the table). Scatter: out[id[m]] = x[m]. An index outside [0, n) is recorded in `bad`
// once per row (at d = 0) and read nothing with; the call's outputs are then undefined (the error
// comes at the next synchronisation), though a gather writes 0 there and a scatter nothing.
template <bool Gather>
struct RowCopyF {
  In x;
  const int32_t* id;
  int64_t D, n;
  Out o;
  unsigned long long* bad;
  __device__ void operator()(int64_t i) const {
    const int64_t m = i / D, d = i - m * D, r = id[m];
    if (r < 0 || r >= n) {
      if (d == 0) record_bad(bad, m, r);
      if constexpr (Gather) o.set(i, 0.f);
      return;
    }
    if constexpr (Gather)
      o.set(i, x[r * D + d]);
    else
      o.set(r * D + d, x[i]);
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
  const int64_t d = blockIdx.y * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  const int64_t k = blockIdx.x;
  const int64_t dst = static_cast<int64_t>(run_id[k]) * D + d;
  float acc = o.get(dst);
  for (int32_t i = start[k]; i < start[k + 1]; ++i) {
    const int64_t m = order[i];
    acc += (has_w ? w[m] : 1.f) * src[m * D + d];
  }
  o.set(dst, acc);
}

// The same sums without host help, for up to kDeviceScatterRows source rows (decode's KV-cache
// writes): block m acts only if source row m is the first with its destination (it scans
// id[0, m)), and then adds, feature by feature, every source row with that destination in
// increasing order: the runs' order, so both kernels give the same bits. O(M^2) index reads,
// hence the bound. An index outside [0, N) is recorded in `bad` and its row skipped.
constexpr int64_t kDeviceScatterRows = 1024;
__global__ void scatter_first_kernel(In src, In w, bool has_w, const int32_t* id, int64_t M,
                                     int64_t N, int64_t D, Out o, unsigned long long* bad) {
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
    float acc = o.get(r * D + d);
    for (int64_t j = m; j < M; ++j)
      if (id[j] == r) acc += (has_w ? w[j] : 1.f) * src[j * D + d];
    o.set(r * D + d, acc);
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
  MT_LAUNCH(scatter_runs_kernel, grid, kThreads, 0, c.stream)
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
  MT_LAUNCH(scatter_first_kernel, static_cast<unsigned>(M), kThreads, 0, c.stream)
  (in(src), wv, w.defined(), idx.ptr<const int32_t>(), M, N, D, out(o), bad);
  launched(op, shapes);
}

// ---- rmsnorm --------------------------------------------------------------------------------
// One block per row. x [N, D], w [D], out [N, D], rstd [N]
// vec (D % 8 == 0, every operand 16-byte aligned): a thread takes 8 consecutive features at a
// time through 16-byte accesses (see Ew) instead of one.
__global__ void rms_fwd_kernel(In x, In w, bool plus_one, float eps, int64_t D, bool vec, Out o,
                               float* rstd) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  float ss = 0;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float v[8];
      load8(v, x, base + d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) ss += v[t] * v[t];
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const float v = x[base + d];
      ss += v * v;
    }
  }
  ss = block_sum(ss, sh);
  const float inv = 1.f / sqrtf(ss / float(D) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = inv;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float v[8], wv[8], r[8];
      load8(v, x, base + d, true);
      load8(wv, w, d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) r[t] = v[t] * inv * (plus_one ? 1.f + wv[t] : wv[t]);
      store8(o, base + d, r, true);
    }
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float wv = plus_one ? 1.f + w[d] : w[d];
    o.set(base + d, x[base + d] * inv * wv);
  }
}
// dx [N, D] += inv * g * w - x * inv^3 * sum(g w x) / D, one block per row
// vec as for rms_fwd_kernel.
__global__ void rms_bwd_dx_kernel(In g, In x, In w, bool plus_one, const float* rstd, int64_t D,
                                  bool vec, Out dx) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  const float inv = rstd[blockIdx.x];
  float s = 0;
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float gv[8], xv[8], wv[8];
      load8(gv, g, base + d, true);
      load8(xv, x, base + d, true);
      load8(wv, w, d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) s += gv[t] * (plus_one ? 1.f + wv[t] : wv[t]) * xv[t];
    }
  } else {
    for (int64_t d = threadIdx.x; d < D; d += kThreads) {
      const float wv = plus_one ? 1.f + w[d] : w[d];
      s += g[base + d] * wv * x[base + d];
    }
  }
  s = block_sum(s, sh);
  const float c = inv * inv * inv * s / float(D);
  if (vec) {
    for (int64_t d = threadIdx.x * 8; d < D; d += kThreads * 8) {
      float gv[8], xv[8], wv[8], r[8];
      load8(gv, g, base + d, true);
      load8(xv, x, base + d, true);
      load8(wv, w, d, true);
      load8(r, dx.in(), base + d, true);
#pragma unroll
      for (int t = 0; t < 8; ++t)
        r[t] += inv * gv[t] * (plus_one ? 1.f + wv[t] : wv[t]) - c * xv[t];
      store8(dx, base + d, r, true);
    }
    return;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float wv = plus_one ? 1.f + w[d] : w[d];
    dx.add(base + d, inv * g[base + d] * wv - c * x[base + d]);
  }
}
// partial [nblocks, D]: block b of `brows` rows sums g x rstd over its rows in row order.
// grid (ceil(D / kThreads), nblocks)
// vec (D % 8 == 0, g and x 16-byte aligned): a thread owns 8 consecutive columns, read through
// 16-byte loads; grid (ceil(D / (8 kThreads)), nblocks). Each column's sum keeps its row order.
__global__ void rms_bwd_dw_partial_kernel(In g, In x, const float* rstd, int64_t N, int64_t D,
                                          int64_t brows, bool vec, float* partial) {
  const int64_t n0 = blockIdx.y * brows, n1 = min(N, n0 + brows);
  if (vec) {
    const int64_t d0 = (blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x) * 8;
    if (d0 >= D) return;
    float acc[8] = {};
    for (int64_t n = n0; n < n1; ++n) {
      float gv[8], xv[8];
      load8(gv, g, n * D + d0, true);
      load8(xv, x, n * D + d0, true);
      const float r = rstd[n];
#pragma unroll
      for (int u = 0; u < 8; ++u) acc[u] += gv[u] * xv[u] * r;
    }
    store8(Out{partial, false}, blockIdx.y * D + d0, acc, true);
    return;
  }
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  float acc = 0;
  for (int64_t n = n0; n < n1; ++n) acc += g[n * D + d] * x[n * D + d] * rstd[n];
  partial[blockIdx.y * D + d] = acc;
}
// dw [D] += partials in block order
__global__ void add_partials_kernel(const float* partial, int64_t nblocks, int64_t D, Out dw) {
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  float acc = dw.get(d);
  for (int64_t b = 0; b < nblocks; ++b) acc += partial[b * D + d];
  dw.set(d, acc);
}

// ---- layernorm (formulas as the CPU's norm.cpp) ---------------------------------------------
// One block per row. x [N, D], w [D], b [D] (has_b), out [N, D], mean [N], rstd [N]. Two passes
// (mean, then squared deviations): no cancellation.
__global__ void ln_fwd_kernel(In x, In w, In b, bool has_b, float eps, int64_t D, Out o,
                              float* mean, float* rstd) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  float s = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) s += x[base + d];
  const float m = block_sum(s, sh) / float(D);
  float q = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float dev = x[base + d] - m;
    q += dev * dev;
  }
  const float inv = 1.f / sqrtf(block_sum(q, sh) / float(D) + eps);
  if (threadIdx.x == 0) {
    mean[blockIdx.x] = m;
    rstd[blockIdx.x] = inv;
  }
  for (int64_t d = threadIdx.x; d < D; d += kThreads)
    o.set(base + d, (x[base + d] - m) * inv * w[d] + (has_b ? b[d] : 0.f));
}
// xhat = (x - m) inv; dx += inv (g w - s1 - xhat s2), s1 = mean(g w), s2 = inv mean(g w (x - m))
__global__ void ln_bwd_dx_kernel(In g, In x, In w, const float* mean, const float* rstd, int64_t D,
                                 Out dx) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * D;
  const float m = mean[blockIdx.x], inv = rstd[blockIdx.x];
  float gw = 0, gwx = 0;
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    gw += g[base + d] * w[d];
    gwx += g[base + d] * w[d] * (x[base + d] - m);
  }
  const float s1 = block_sum(gw, sh) / float(D);
  const float s2 = inv * block_sum(gwx, sh) / float(D);
  for (int64_t d = threadIdx.x; d < D; d += kThreads) {
    const float xhat = (x[base + d] - m) * inv;
    dx.add(base + d, inv * (g[base + d] * w[d] - s1 - xhat * s2));
  }
}
// pw, pb [nblocks, D]: row block b's sums of g xhat and of g, in row order.
// grid (ceil(D / kThreads), nblocks)
__global__ void ln_bwd_partial_kernel(In g, In x, const float* mean, const float* rstd, int64_t N,
                                      int64_t D, int64_t brows, float* pw, float* pb) {
  const int64_t d = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x;
  if (d >= D) return;
  const int64_t n0 = blockIdx.y * brows, n1 = min(N, n0 + brows);
  float aw = 0, ab = 0;
  for (int64_t n = n0; n < n1; ++n) {
    const float gv = g[n * D + d];
    aw += gv * ((x[n * D + d] - mean[n]) * rstd[n]);
    ab += gv;
  }
  pw[blockIdx.y * D + d] = aw;
  pb[blockIdx.y * D + d] = ab;
}

// ---- softmax and cross-entropy: one block per row -------------------------------------------
// x [N, C], out [N, C]
__global__ void softmax_fwd_kernel(In x, int64_t C, Out o) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * C;
  float m = -INFINITY;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) m = fmaxf(m, x[base + i]);
  m = block_max(m, sh);
  float s = 0;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) s += expf(x[base + i] - m);
  s = block_sum(s, sh);
  const float inv = 1.f / s;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) o.set(base + i, expf(x[base + i] - m) * inv);
}
// dx += y (g - sum(g y))
__global__ void softmax_bwd_kernel(In g, In y, int64_t C, Out dx) {
  __shared__ float sh[kThreads];
  const int64_t base = blockIdx.x * C;
  float s = 0;
  for (int64_t i = threadIdx.x; i < C; i += kThreads) s += g[base + i] * y[base + i];
  s = block_sum(s, sh);
  for (int64_t i = threadIdx.x; i < C; i += kThreads)
    dx.add(base + i, y[base + i] * (g[base + i] - s));
}
// logits [N, V], targets [N], loss [N], lse [N]. A target >= V is recorded in `bad` and its row
// left at loss 0 (the call's results are undefined once a check fails).
// One pass over the row: each thread keeps a running maximum m and the sum s of exp(v - m),
// rescaled when m grows; the block then takes the largest m and adds the rescaled sums. vec (V %
// 8 == 0, x 16-byte aligned): 8 logits per thread and step through 16-byte loads.
__global__ void ce_fwd_kernel(In x, const int32_t* tg, float z_loss, int64_t V, bool vec,
                              float* loss, float* lse, unsigned long long* bad) {
  __shared__ float sh[kThreads];
  const int64_t n = blockIdx.x, base = n * V;
  if (tg[n] >= V) {  // uniform across the block
    if (threadIdx.x == 0) {
      record_bad(bad, n, tg[n]);
      loss[n] = 0.f;
      lse[n] = 0.f;
    }
    return;
  }
  float m = -INFINITY, s = 0.f;
  const auto push = [&](float v) {
    if (v > m) {
      s = s * expf(m - v) + 1.f;  // exp(-inf) = 0 at the first finite value
      m = v;
    } else if (v > -INFINITY) {
      s += expf(v - m);
    }
  };
  if (vec) {
    for (int64_t i = threadIdx.x * 8; i < V; i += kThreads * 8) {
      float v[8];
      load8(v, x, base + i, true);
#pragma unroll
      for (int t = 0; t < 8; ++t) push(v[t]);
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) push(x[base + i]);
  }
  const float mx = block_max(m, sh);
  s = block_sum(m > -INFINITY ? s * expf(m - mx) : 0.f, sh);
  m = mx;
  if (threadIdx.x == 0) {
    const float l = m + logf(s);
    lse[n] = l;
    const int32_t t = tg[n];
    loss[n] = t < 0 ? 0.f : l - x[base + t] + z_loss * l * l;
  }
}
// dlogits [N, V] += dloss[n] * (softmax * (1 + 2 z lse) - onehot(target)), recomputed from lse
// vec as for ce_fwd_kernel, dx 16-byte aligned too.
__global__ void ce_bwd_kernel(In dloss, In x, const int32_t* tg, const float* lse, float z_loss,
                              int64_t V, bool vec, Out dx, unsigned long long* bad) {
  const int64_t n = blockIdx.x, base = n * V;
  const int32_t t = tg[n];
  if (t >= V && threadIdx.x == 0) record_bad(bad, n, t);
  if (t < 0 || t >= V) return;  // ignored (or bad) row: no gradient (uniform across the block)
  const float g = dloss[n], l = lse[n];
  const float coef = g * (1.f + 2.f * z_loss * l);
  if (vec) {
    for (int64_t i = threadIdx.x * 8; i < V; i += kThreads * 8) {
      float xv[8], r[8];
      load8(xv, x, base + i, true);
      load8(r, dx.in(), base + i, true);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        r[u] = r[u] + coef * expf(xv[u] - l);
        if (i + u == t) r[u] -= g;
      }
      store8(dx, base + i, r, true);
    }
    return;
  }
  for (int64_t i = threadIdx.x; i < V; i += kThreads) {
    float v = dx.get(base + i) + coef * expf(x[base + i] - l);
    if (i == t) v -= g;
    dx.set(base + i, v);
  }
}

// ---- rope -----------------------------------------------------------------------------------

// One block per (b, t) row. x, out [rows, H, D]; positions [rows]; inv_freq [R / 2].
// Forward: out = rotate(x, angle); inverse: out += rotate(x, -angle). The angle is formed and
// its sine and cosine taken in double: in f32 the product alone is off by ~1e-2 rad near 128k.
// Every head of the row shares the angles: their cosines and sines are taken once per row, into
// dynamic shared memory (R floats), not once per head (FP64 sincos is the costly part).
// vec (D % 8 == 0, R / 2 a multiple of 8 half-split or of 4 interleaved, x and o 16-byte
// aligned): a thread rotates 8 features (two halves' 8, or 4 adjacent pairs) per step through
// 16-byte accesses.
__global__ void rope_kernel(In x, const int32_t* positions, const float* inv_freq, int64_t H,
                            int64_t D, int64_t R, bool interleaved, float mscale, bool inverse,
                            bool vec, Out o) {
  MT_DYNAMIC_SHARED(smem);
  float* cos_s = reinterpret_cast<float*>(smem);
  float* sin_s = cos_s + R / 2;
  const int64_t row = blockIdx.x, half = R / 2;
  const int64_t base = row * H * D;
  const double p = positions[row];
  const float sscale = (inverse ? -1.f : 1.f) * mscale;
  for (int64_t i = threadIdx.x; i < half; i += kThreads) {
    double sn, cs;
    sincos(p * double(inv_freq[i]), &sn, &cs);
    cos_s[i] = mscale * static_cast<float>(cs);
    sin_s[i] = sscale * static_cast<float>(sn);
  }
  __syncthreads();
  // out = r, or out += r when inverse.
  const auto put8 = [&](int64_t at, float(&r)[8]) {
    if (inverse) {
      float old[8];
      load8(old, o.in(), at, true);
#pragma unroll
      for (int u = 0; u < 8; ++u) r[u] = old[u] + r[u];
    }
    store8(o, at, r, true);
  };
  if (vec && !interleaved) {
    const int64_t per_head = half / 8;
    for (int64_t j = threadIdx.x; j < H * per_head; j += kThreads) {
      const int64_t h = j / per_head, i0 = (j - h * per_head) * 8;
      const int64_t ia = base + h * D + i0, ib = ia + half;
      float a[8], b[8], ra[8], rb[8];
      load8(a, x, ia, true);
      load8(b, x, ib, true);
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const float c = cos_s[i0 + u], s = sin_s[i0 + u];
        ra[u] = a[u] * c - b[u] * s;
        rb[u] = b[u] * c + a[u] * s;
      }
      put8(ia, ra);
      put8(ib, rb);
    }
  } else if (vec) {
    const int64_t per_head = half / 4;
    for (int64_t j = threadIdx.x; j < H * per_head; j += kThreads) {
      const int64_t h = j / per_head, i0 = (j - h * per_head) * 4;
      const int64_t at = base + h * D + 2 * i0;
      float v[8], r[8];
      load8(v, x, at, true);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float c = cos_s[i0 + u], s = sin_s[i0 + u];
        r[2 * u] = v[2 * u] * c - v[2 * u + 1] * s;
        r[2 * u + 1] = v[2 * u + 1] * c + v[2 * u] * s;
      }
      put8(at, r);
    }
  }
  for (int64_t j = vec ? H * half : threadIdx.x; j < H * half; j += kThreads) {
    const int64_t h = j / half, i = j - h * half;
    const float c = cos_s[i], s = sin_s[i];
    const int64_t ia = base + h * D + (interleaved ? 2 * i : i);
    const int64_t ib = ia + (interleaved ? 1 : half);
    const float a = x[ia], b = x[ib];
    const float ra = a * c - b * s, rb = b * c + a * s;
    if (inverse) {
      o.add(ia, ra);
      o.add(ib, rb);
    } else {
      o.set(ia, ra);
      o.set(ib, rb);
    }
  }
  // Features past rotary_dim are not rotated (nor scaled): copied / passed through.
  const int64_t rest = D - R;
  for (int64_t j = threadIdx.x; j < H * rest; j += kThreads) {
    const int64_t h = j / rest, f = R + (j - h * rest);
    const int64_t idx = base + h * D + f;
    if (inverse)
      o.add(idx, x[idx]);
    else
      o.set(idx, x[idx]);
  }
}

// The rope table of (spec, R): from c.rope when it holds it, else computed, uploaded and kept.
// The entry's host vector is the copy's source, so it lives until the copy is done.
template <class S>
const RopeTables::Entry& rope_table(const Ctx& c, const RopeSpec& spec, int64_t R, const char* op,
                                    S&& shapes) {
  for (const auto& e : c.rope->entries)
    if (e.rotary_dim == R && e.spec == spec) return e;
  if (c.rope->entries.size() >= RopeTables::kMaxEntries) c.rope->entries.clear();
  RopeFrequencies t = rope_frequencies(spec, R);
  Tensor dev =
      c.scratch({std::max<int64_t>(static_cast<int64_t>(t.inv_freq.size()), 1)}, DType::f32);
  const auto& e = c.rope->entries.emplace_back(
      RopeTables::Entry{spec, R, std::move(t.inv_freq), t.mscale, std::move(dev)});
  if (!e.inv_freq.empty())
    check(cudaMemcpyAsync(e.dev.data(), e.inv_freq.data(), e.inv_freq.size() * sizeof(float),
                          cudaMemcpyHostToDevice, c.stream),
          op, "uploading inv_freq", shapes());
  return e;
}

void rope_apply(const Ctx& c, const char* op, const Tensor& x, const Tensor& positions,
                const RopeSpec& spec, Tensor& o, bool inverse) {
  auto shapes = [&] { return "x " + str(x) + ", positions " + str(positions) + ", out " + str(o); };
  MT_CHECK(
      x.defined() && x.ndim() == 4 && is_fb(x) && is_fb(o) && o.numel() == x.numel() &&
          positions.defined() && positions.dtype() == DType::i32 &&
          positions.numel() == x.dim(0) * x.dim(1),
      std::string("cuda ") + op + ": " + shapes() + " (want x [B, T, H, D], positions [B, T] i32)");
  const int64_t H = x.dim(2), D = x.dim(3), rows = x.dim(0) * x.dim(1);
  const int64_t R = spec.rotary_dim > 0 ? spec.rotary_dim : D;
  MT_CHECK(R % 2 == 0 && R <= D, std::string("cuda ") + op + ": rotary_dim " + std::to_string(R) +
                                     " must be even and at most head_dim " + std::to_string(D));
  // The row's cosines and sines live in shared memory (R floats, within the 48 KiB default).
  MT_CHECK(R <= kMaxRotaryDim, std::string("cuda ") + op + ": rotary_dim " + std::to_string(R) +
                                   " is larger than the " + std::to_string(kMaxRotaryDim) +
                                   " this kernel supports");
  if (rows == 0 || H == 0 || D == 0) return;
  const RopeTables::Entry& table = rope_table(c, spec, R, op, shapes);
  const bool vec =
      D % 8 == 0 && (R / 2) % (spec.interleaved ? 4 : 8) == 0 && aligned16({x.data(), o.data()});
  MT_LAUNCH(rope_kernel, static_cast<unsigned>(rows), kThreads,
            static_cast<size_t>(R) * sizeof(float), c.stream)
  (in(x), positions.ptr<const int32_t>(), table.dev.ptr<const float>(), H, D, R, spec.interleaved,
   static_cast<float>(table.mscale), inverse, vec, out(o));
  launched(op, shapes);
}

// ---- AdamW ----------------------------------------------------------------------------------
struct AdamWConsts {
  float b1, one_minus_b1, b2, one_minus_b2, eps, grad_scale;
  float step_size;     // lr / (1 - b1^step)
  float inv_sqrt_bc2;  // 1 / sqrt(1 - b2^step)
  float decay;         // lr * weight_decay
};
// The CPU's operation order with every step rounded (no contraction into FMAs), so both
// backends give the same bits.
// x: param, grad, m, v; y: param, m, v.
struct AdamWM {
  AdamWConsts c;
  __device__ void operator()(const float (&x)[4], float (&y)[3]) const {
    const float p = x[0];
    const float g = __fmul_rn(x[1], c.grad_scale);
    const float mi = __fadd_rn(__fmul_rn(c.b1, x[2]), __fmul_rn(c.one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(c.b2, x[3]), __fmul_rn(c.one_minus_b2, __fmul_rn(g, g)));
    const float update = __fdiv_rn(__fmul_rn(c.step_size, mi),
                                   __fadd_rn(__fmul_rn(__fsqrt_rn(vi), c.inv_sqrt_bc2), c.eps));
    y[0] = __fadd_rn(__fadd_rn(p, -update), -__fmul_rn(c.decay, p));
    y[1] = mi;
    y[2] = vi;
  }
};

}  // namespace

// ---- elementwise ------------------------------------------------------------------------------

void fill(const Ctx& c, Tensor& x, float value) {
  auto shapes = [&] { return str(x); };
  const int64_t n = x.numel();
  switch (x.dtype()) {
    case DType::f32:
      return launch_map(c, n, FillF32{x.ptr<float>(), value}, "fill", shapes);
    case DType::bf16:
      return launch_map(c, n, FillBf16{x.ptr<__nv_bfloat16>(), value}, "fill", shapes);
    case DType::i32:
      return launch_map(c, n, FillI32{x.ptr<int32_t>(), static_cast<int32_t>(value)}, "fill",
                        shapes);
    default:
      fail("cuda fill: unsupported tensor " + str(x));
  }
}

void cast(const Ctx& c, const Tensor& src, Tensor& dst) {
  auto shapes = [&] { return str(src) + " -> " + str(dst); };
  MT_CHECK(src.numel() == dst.numel(), "cuda cast: element counts differ: " + shapes());
  if (src.dtype() == dst.dtype()) {
    if (src.data() == dst.data() || src.nbytes() == 0) return;
    check(cudaMemcpyAsync(dst.data(), src.data(), src.nbytes(), cudaMemcpyDeviceToDevice, c.stream),
          "cast", "cudaMemcpyAsync", shapes());
    return;
  }
  MT_CHECK(is_fb(src) && is_fb(dst), "cuda cast: unsupported conversion " + shapes());
  launch_ew(c, src.numel(), Ew<1, 1, CopyM>{{in(src)}, {out(dst)}, {false}, {}}, "cast", shapes);
}

void add(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& o) {
  check_same("add", a, b);
  check_same("add", a, o);
  launch_ew(c, a.numel(), Ew<2, 1, AddM>{{in(a), in(b)}, {out(o)}, {false}, {}}, "add",
            [&] { return str(a) + " + " + str(b) + " -> " + str(o); });
}

void mul(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& o) {
  check_same("mul", a, b);
  check_same("mul", a, o);
  launch_ew(c, a.numel(), Ew<2, 1, MulM>{{in(a), in(b)}, {out(o)}, {false}, {}}, "mul",
            [&] { return str(a) + " * " + str(b) + " -> " + str(o); });
}

void scale(const Ctx& c, const Tensor& x, float s, Tensor& o) {
  check_same("scale", x, o);
  launch_ew(c, x.numel(), Ew<1, 1, ScaleM>{{in(x)}, {out(o)}, {false}, {s}}, "scale",
            [&] { return str(x) + " -> " + str(o); });
}

void axpy(const Ctx& c, float alpha, const Tensor& x, Tensor& y) {
  check_same("axpy", x, y);
  launch_ew(c, x.numel(), Ew<1, 1, AxpyM>{{in(x)}, {out(y)}, {true}, {alpha}}, "axpy",
            [&] { return str(x) + " -> " + str(y); });
}

namespace {
// The sum (of squares) of x into *dst on the device: kSumBlocks partials, then their sum in order.
void launch_sum(const Ctx& c, const Tensor& x, bool squares, double* partial, double* dst) {
  const char* op = squares ? "sum_squares" : "sum";
  MT_LAUNCH(sum_partial_kernel, kSumBlocks, kThreads, 0, c.stream)
  (in(x), x.numel(), squares, aligned16({x.data()}), partial);
  launched(op, [&] { return str(x); });
  MT_LAUNCH(sum_final_kernel, 1, kThreads, 0, c.stream)(partial, dst);
  launched(op, [&] { return str(x); });
}
}  // namespace

double sum(const Ctx& c, const Tensor& x, bool squares) {
  std::vector<double> r;
  sums(c, {&x}, squares, r);
  return r[0];
}

void sums(const Ctx& c, const std::vector<const Tensor*>& xs, bool squares,
          std::vector<double>& result) {
  const char* op = squares ? "sum_squares" : "sum";
  const auto n = static_cast<int64_t>(xs.size());
  result.assign(xs.size(), 0.0);
  if (n == 0) return;
  for (const Tensor* x : xs)
    MT_CHECK(x != nullptr && is_fb(*x),
             std::string("cuda ") + op + ": unsupported tensor " + (x ? str(*x) : "null"));
  // The partials of one tensor (reused by the next: the stream orders them) and the n results,
  // as doubles in one f32 scratch block; the results come back in one copy and one sync. An
  // empty tensor's partials are 0.
  Tensor buf = c.scratch({2 * (kSumBlocks + n)}, DType::f32);
  double* partial = static_cast<double*>(buf.data());
  double* dst = partial + kSumBlocks;
  for (int64_t i = 0; i < n; ++i)
    launch_sum(c, *xs[static_cast<size_t>(i)], squares, partial, dst + i);
  const std::string what = n == 1 ? str(*xs[0]) : std::to_string(n) + " tensors";
  check(cudaMemcpyAsync(result.data(), dst, static_cast<size_t>(n) * sizeof(double),
                        cudaMemcpyDeviceToHost, c.stream),
        op, "copying the result to the host", what);
  check(cudaStreamSynchronize(c.stream), op, "stream synchronize", what);
}

// ---- embedding ------------------------------------------------------------------------------

void embedding_forward(const Ctx& c, const Tensor& table, const Tensor& ids, Tensor& o) {
  auto shapes = [&] { return "table " + str(table) + ", ids " + str(ids) + ", out " + str(o); };
  MT_CHECK(table.defined() && table.ndim() == 2 && is_fb(table) && is_fb(o) && ids.defined() &&
               ids.dtype() == DType::i32 && o.numel() == ids.numel() * table.dim(1),
           "cuda embedding_forward: " + shapes());
  const int64_t V = table.dim(0), D = table.dim(1);
  unsigned long long* bad = c.checks->slot(
      [V](int64_t n, int64_t id) { return bad_token_id("embedding_forward", n, id, V); });
  launch_map(c, o.numel(), RowCopyF<true>{in(table), ids.ptr<const int32_t>(), D, V, out(o), bad},
             "embedding_forward", shapes);
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

namespace {
int64_t last_dim(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.dim(-1);
}
int64_t lead_rows(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) n *= t.shape()[i];
  return n;
}

}  // namespace

void gather_rows(const Ctx& c, const Tensor& x, const Tensor& idx, Tensor& o) {
  auto shapes = [&] { return "x " + str(x) + ", idx " + str(idx) + ", out " + str(o); };
  MT_CHECK(is_fb(x) && is_fb(o) && idx.defined() && idx.dtype() == DType::i32 &&
               last_dim(o) == last_dim(x) && lead_rows(o) == idx.numel(),
           "cuda gather_rows: " + shapes() + " (want x [N, D], idx [M] i32, out [M, D])");
  const int64_t D = last_dim(x), N = lead_rows(x);
  unsigned long long* bad =
      c.checks->slot([N](int64_t m, int64_t id) { return bad_row_index("gather_rows", m, id, N); });
  launch_map(c, o.numel(), RowCopyF<true>{in(x), idx.ptr<const int32_t>(), D, N, out(o), bad},
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
  launch_map(c, src.numel(), RowCopyF<false>{in(src), idx.ptr<const int32_t>(), D, N, out(o), bad},
             "scatter_rows", shapes);
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
// Routing: one thread per token row; E (experts) is small, and the serial loop is the CPU's own
// (moe.cpp), so selection, ties (lower index wins, NaN last) and rounding match it exactly.
// logits [N, E] -> probs [N, E], weights [N, k] (also the sorted keys while selecting),
// indices [N, k]
__global__ void topk_fwd_kernel(In logits, int64_t N, int64_t E, int k, bool sigmoid,
                                bool normalize, float* weights, int32_t* indices, float* probs) {
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

// dlogits [N, E] += d(weights)/d(logits)^T dweights, per row (the CPU's formulas).
__global__ void topk_bwd_kernel(In dweights, In probs, const int32_t* indices, int64_t N, int64_t E,
                                int k, bool sigmoid, bool normalize, Out dlogits) {
  const int64_t n = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  const int64_t ps = n * E, ds0 = n * k;
  const int32_t* idx = indices + n * k;
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
  MT_LAUNCH(topk_fwd_kernel, grid_for(N), kThreads, 0, c.stream)
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
  check_indices("topk_route_backward", host_ints(c, indices, "topk_route_backward"), E,
                bad_row_index);
  if (N == 0) return;
  MT_LAUNCH(topk_bwd_kernel, grid_for(N), kThreads, 0, c.stream)
  (in(dweights), in(probs), indices.ptr<const int32_t>(), N, E, static_cast<int>(k), sigmoid,
   normalize, out(dlogits));
  launched("topk_route_backward", shapes);
}

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

// ---- rmsnorm --------------------------------------------------------------------------------

void rmsnorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, float eps, bool plus_one,
                     Tensor& o, Tensor& rstd) {
  auto shapes = [&] {
    return "x " + str(x) + ", w " + str(w) + ", out " + str(o) + ", rstd " + str(rstd);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(o) && w.numel() == x.dim(-1) &&
               o.numel() == x.numel() && rstd.defined() && rstd.dtype() == DType::f32,
           "cuda rmsnorm_forward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(rstd.numel() == N, "cuda rmsnorm_forward: rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const bool vec = D % 8 == 0 && aligned16({x.data(), w.data(), o.data()});
  MT_LAUNCH(rms_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(x), in(w), plus_one, eps, D, vec, out(o), rstd.ptr<float>());
  launched("rmsnorm_forward", shapes);
}

void rmsnorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) {
  auto shapes = [&] {
    return "dout " + str(dout) + ", x " + str(x) + ", w " + str(w) + ", rstd " + str(rstd) +
           ", dx " + str(dx) + ", dw " + str(dw);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(dout) && is_fb(dx) && is_fb(dw) &&
               w.numel() == x.dim(-1) && dw.numel() == w.numel() && dout.numel() == x.numel() &&
               dx.numel() == x.numel() && rstd.defined() && rstd.dtype() == DType::f32,
           "cuda rmsnorm_backward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(rstd.numel() == N, "cuda rmsnorm_backward: rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const bool vec = D % 8 == 0 && aligned16({dout.data(), x.data(), w.data(), dx.data()});
  MT_LAUNCH(rms_bwd_dx_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(dout), in(x), in(w), plus_one, rstd.ptr<const float>(), D, vec, out(dx));
  launched("rmsnorm_backward", shapes);
  // dw: fixed row blocks (a function of N only, as on the CPU), each writing its own partial,
  // then the partials added in block order.
  const int64_t brows = std::max<int64_t>(32, (N + 255) / 256);
  const int64_t nblocks = (N + brows - 1) / brows;
  Tensor partial = c.scratch({nblocks, D}, DType::f32);
  const unsigned cols = static_cast<unsigned>((D + kThreads - 1) / kThreads);
  const bool vec_dw = D % 8 == 0 && aligned16({dout.data(), x.data()});
  const unsigned dw_cols = vec_dw ? static_cast<unsigned>((D / 8 + kThreads - 1) / kThreads) : cols;
  MT_LAUNCH(rms_bwd_dw_partial_kernel, dim3(dw_cols, static_cast<unsigned>(nblocks)), kThreads, 0,
            c.stream)
  (in(dout), in(x), rstd.ptr<const float>(), N, D, brows, vec_dw, partial.ptr<float>());
  launched("rmsnorm_backward", shapes);
  MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c.stream)
  (partial.ptr<const float>(), nblocks, D, out(dw));
  launched("rmsnorm_backward", shapes);
}

// ---- layernorm ------------------------------------------------------------------------------

void layernorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                       Tensor& o, Tensor& mean, Tensor& rstd) {
  auto shapes = [&] {
    return "x " + str(x) + ", w " + str(w) + ", b " + str(b) + ", out " + str(o) + ", mean " +
           str(mean) + ", rstd " + str(rstd);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(o) && w.numel() == x.dim(-1) &&
               o.numel() == x.numel() && (!b.defined() || (is_fb(b) && b.numel() == w.numel())),
           "cuda layernorm_forward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == N && rstd.defined() &&
               rstd.dtype() == DType::f32 && rstd.numel() == N,
           "cuda layernorm_forward: mean and rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  const In bias = b.defined() ? in(b) : In{nullptr, false};
  MT_LAUNCH(ln_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(x), in(w), bias, b.defined(), eps, D, out(o), mean.ptr<float>(), rstd.ptr<float>());
  launched("layernorm_forward", shapes);
}

void layernorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw,
                        Tensor& db) {
  auto shapes = [&] {
    return "dout " + str(dout) + ", x " + str(x) + ", w " + str(w) + ", dx " + str(dx) + ", dw " +
           str(dw) + ", db " + str(db);
  };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(w) && is_fb(dout) && is_fb(dx) && is_fb(dw) &&
               w.numel() == x.dim(-1) && dw.numel() == w.numel() && dout.numel() == x.numel() &&
               dx.numel() == x.numel() && (!db.defined() || (is_fb(db) && db.numel() == w.numel())),
           "cuda layernorm_backward: " + shapes());
  const int64_t D = x.dim(-1), N = D ? x.numel() / D : 0;
  MT_CHECK(mean.defined() && mean.dtype() == DType::f32 && mean.numel() == N && rstd.defined() &&
               rstd.dtype() == DType::f32 && rstd.numel() == N,
           "cuda layernorm_backward: mean and rstd must be f32 [N]: " + shapes());
  if (N == 0) return;
  MT_LAUNCH(ln_bwd_dx_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(dout), in(x), in(w), mean.ptr<const float>(), rstd.ptr<const float>(), D, out(dx));
  launched("layernorm_backward", shapes);
  // dw and db: fixed row blocks (a function of N only), partials added in block order.
  const int64_t brows = std::max<int64_t>(32, (N + 255) / 256);
  const int64_t nblocks = (N + brows - 1) / brows;
  Tensor partial = c.scratch({2, nblocks, D}, DType::f32);
  float* pw = partial.ptr<float>();
  float* pb = pw + nblocks * D;
  const unsigned cols = static_cast<unsigned>((D + kThreads - 1) / kThreads);
  MT_LAUNCH(ln_bwd_partial_kernel, dim3(cols, static_cast<unsigned>(nblocks)), kThreads, 0,
            c.stream)
  (in(dout), in(x), mean.ptr<const float>(), rstd.ptr<const float>(), N, D, brows, pw, pb);
  launched("layernorm_backward", shapes);
  MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c.stream)(pw, nblocks, D, out(dw));
  launched("layernorm_backward", shapes);
  if (db.defined()) {
    MT_LAUNCH(add_partials_kernel, cols, kThreads, 0, c.stream)(pb, nblocks, D, out(db));
    launched("layernorm_backward", shapes);
  }
}

// ---- rope -----------------------------------------------------------------------------------

void rope_forward(const Ctx& c, const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                  Tensor& o) {
  rope_apply(c, "rope_forward", x, positions, spec, o, false);
}

void rope_backward(const Ctx& c, const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                   Tensor& dx) {
  rope_apply(c, "rope_backward", dout, positions, spec, dx, true);
}

// ---- activations ----------------------------------------------------------------------------

void activation_forward(const Ctx& c, Activation act, const Tensor& x, Tensor& o) {
  check_ew("activation_forward", {&x, &o});
  launch_ew(c, x.numel(), Ew<1, 1, ActFwdM>{{in(x)}, {out(o)}, {false}, {act}},
            "activation_forward", [&] { return str(x) + " -> " + str(o); });
}

void activation_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& x,
                         Tensor& dx) {
  check_ew("activation_backward", {&dout, &x, &dx});
  launch_ew(c, x.numel(), Ew<2, 1, ActBwdM>{{in(dout), in(x)}, {out(dx)}, {true}, {act}},
            "activation_backward", [&] { return str(dout) + ", " + str(x) + " -> " + str(dx); });
}

void gated_forward(const Ctx& c, Activation act, const Tensor& gate, const Tensor& up, Tensor& o) {
  check_ew("gated_forward", {&gate, &up, &o});
  launch_ew(c, gate.numel(), Ew<2, 1, GatedFwdM>{{in(gate), in(up)}, {out(o)}, {false}, {act}},
            "gated_forward", [&] { return str(gate) + ", " + str(up) + " -> " + str(o); });
}

void gated_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& gate,
                    const Tensor& up, Tensor& dgate, Tensor& dup) {
  check_ew("gated_backward", {&dout, &gate, &up, &dgate, &dup});
  launch_ew(c, gate.numel(),
            Ew<3, 2, GatedBwdM>{
                {in(dout), in(gate), in(up)}, {out(dgate), out(dup)}, {true, true}, {act}},
            "gated_backward", [&] { return str(dout) + ", " + str(gate) + ", " + str(up); });
}

void softcap_forward(const Ctx& c, const Tensor& x, float cap, Tensor& o) {
  check_ew("softcap_forward", {&x, &o});
  MT_CHECK(cap > 0.f, "cuda softcap_forward: cap must be positive, got " + std::to_string(cap));
  launch_ew(c, x.numel(), Ew<1, 1, SoftcapFwdM>{{in(x)}, {out(o)}, {false}, {cap, 1.f / cap}},
            "softcap_forward", [&] { return str(x) + " -> " + str(o); });
}

void softcap_backward(const Ctx& c, const Tensor& dout, const Tensor& y, float cap, Tensor& dx) {
  check_ew("softcap_backward", {&dout, &y, &dx});
  MT_CHECK(cap > 0.f, "cuda softcap_backward: cap must be positive, got " + std::to_string(cap));
  launch_ew(c, y.numel(), Ew<2, 1, SoftcapBwdM>{{in(dout), in(y)}, {out(dx)}, {true}, {1.f / cap}},
            "softcap_backward", [&] { return str(dout) + ", " + str(y) + " -> " + str(dx); });
}

// ---- softmax and loss -----------------------------------------------------------------------

void softmax_forward(const Ctx& c, const Tensor& x, Tensor& o) {
  auto shapes = [&] { return "x " + str(x) + ", out " + str(o); };
  MT_CHECK(is_fb(x) && x.ndim() >= 1 && is_fb(o) && o.numel() == x.numel(),
           "cuda softmax_forward: " + shapes());
  const int64_t C = x.dim(-1), N = C ? x.numel() / C : 0;
  if (N == 0) return;
  MT_LAUNCH(softmax_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)(in(x), C, out(o));
  launched("softmax_forward", shapes);
}

void softmax_backward(const Ctx& c, const Tensor& dout, const Tensor& y, Tensor& dx) {
  auto shapes = [&] { return "dout " + str(dout) + ", out " + str(y) + ", dx " + str(dx); };
  MT_CHECK(is_fb(y) && y.ndim() >= 1 && is_fb(dout) && is_fb(dx) && dout.numel() == y.numel() &&
               dx.numel() == y.numel(),
           "cuda softmax_backward: " + shapes());
  const int64_t C = y.dim(-1), N = C ? y.numel() / C : 0;
  if (N == 0) return;
  MT_LAUNCH(softmax_bwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(dout), in(y), C, out(dx));
  launched("softmax_backward", shapes);
}

namespace {
// The targets' shape; their range the kernels check on the device, into the returned slot.
unsigned long long* check_targets(const Ctx& c, const char* op, const Tensor& targets, int64_t N,
                                  int64_t V) {
  MT_CHECK(targets.defined() && targets.dtype() == DType::i32 && targets.numel() == N,
           std::string("cuda ") + op + ": targets must be i32 with " + std::to_string(N) +
               " elements, got " + str(targets));
  const std::string name = op;
  return c.checks->slot([name, V](int64_t n, int64_t t) {
    return "cuda " + name + ": target id " + std::to_string(t) + " of row " + std::to_string(n) +
           " is outside the vocabulary [0, " + std::to_string(V) + ")";
  });
}
}  // namespace

void cross_entropy_forward(const Ctx& c, const Tensor& logits, const Tensor& targets, float z_loss,
                           Tensor& loss, Tensor& lse) {
  auto shapes = [&] {
    return "logits " + str(logits) + ", targets " + str(targets) + ", loss " + str(loss) +
           ", lse " + str(lse);
  };
  MT_CHECK(is_fb(logits) && logits.ndim() >= 1 && logits.dim(-1) > 0,
           "cuda cross_entropy_forward: " + shapes());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(loss.defined() && loss.dtype() == DType::f32 && loss.numel() == N && lse.defined() &&
               lse.dtype() == DType::f32 && lse.numel() == N,
           "cuda cross_entropy_forward: " + shapes() + " (loss and lse must be f32 [N])");
  unsigned long long* bad = check_targets(c, "cross_entropy_forward", targets, N, V);
  if (N == 0) return;
  const bool vec = V % 8 == 0 && aligned16({logits.data()});
  MT_LAUNCH(ce_fwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(logits), targets.ptr<const int32_t>(), z_loss, V, vec, loss.ptr<float>(), lse.ptr<float>(),
   bad);
  launched("cross_entropy_forward", shapes);
}

void cross_entropy_backward(const Ctx& c, const Tensor& dloss, const Tensor& logits,
                            const Tensor& targets, const Tensor& lse, float z_loss,
                            Tensor& dlogits) {
  auto shapes = [&] {
    return "dloss " + str(dloss) + ", logits " + str(logits) + ", targets " + str(targets) +
           ", lse " + str(lse) + ", dlogits " + str(dlogits);
  };
  MT_CHECK(is_fb(logits) && logits.ndim() >= 1 && logits.dim(-1) > 0 && is_fb(dlogits) &&
               dlogits.numel() == logits.numel(),
           "cuda cross_entropy_backward: " + shapes());
  const int64_t V = logits.dim(-1), N = logits.numel() / V;
  MT_CHECK(is_fb(dloss) && dloss.numel() == N && lse.defined() && lse.dtype() == DType::f32 &&
               lse.numel() == N,
           "cuda cross_entropy_backward: " + shapes() + " (dloss [N], lse f32 [N])");
  unsigned long long* bad = check_targets(c, "cross_entropy_backward", targets, N, V);
  if (N == 0) return;
  const bool vec = V % 8 == 0 && aligned16({logits.data(), dlogits.data()});
  MT_LAUNCH(ce_bwd_kernel, static_cast<unsigned>(N), kThreads, 0, c.stream)
  (in(dloss), in(logits), targets.ptr<const int32_t>(), lse.ptr<const float>(), z_loss, V, vec,
   out(dlogits), bad);
  launched("cross_entropy_backward", shapes);
}

// ---- optimizer ------------------------------------------------------------------------------

void adamw_update(const Ctx& c, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                  const AdamWParams& p) {
  auto shapes = [&] {
    return "param " + str(param) + ", grad " + str(grad) + ", m " + str(m) + ", v " + str(v);
  };
  MT_CHECK(is_fb(param) && is_fb(grad) && m.defined() && m.dtype() == DType::f32 && v.defined() &&
               v.dtype() == DType::f32,
           "cuda adamw_update: param and grad must be f32 or bf16 and m, v f32: " + shapes());
  const int64_t n = param.numel();
  MT_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
           "cuda adamw_update: element counts differ: " + shapes());
  MT_CHECK(p.step >= 1,
           "cuda adamw_update: step must be >= 1 (1-based), got " + std::to_string(p.step));
  // Bias corrections in double, folded into f32 constants exactly as the CPU backend does.
  const double step = static_cast<double>(p.step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(p.b1), step);
  const double bc2 = 1.0 - std::pow(static_cast<double>(p.b2), step);
  AdamWConsts k{};
  k.b1 = p.b1;
  k.one_minus_b1 = static_cast<float>(1.0 - p.b1);
  k.b2 = p.b2;
  k.one_minus_b2 = static_cast<float>(1.0 - p.b2);
  k.eps = p.eps;
  k.grad_scale = p.grad_scale;
  k.step_size = static_cast<float>(p.lr / bc1);
  k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  k.decay = static_cast<float>(static_cast<double>(p.lr) * p.weight_decay);
  launch_ew(c, n,
            Ew<4, 3, AdamWM>{{in(param), in(grad), in(m), in(v)},
                             {out(param), out(m), out(v)},
                             {false, false, false},
                             {k}},
            "adamw_update", shapes);
}

}  // namespace mt::cuda

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
  float m = -INFINITY;
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
  }
  m = block_max(m, sh);  // its barriers also publish row[]
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
  __shared__ float sh[kThreads];
  const int64_t r = blockIdx.x;
  const int64_t i = r % a.T, bh = r / a.T, h = bh % a.Hq, b = bh / a.Hq;
  const int64_t g = h / (a.Hq / a.Hkv);
  const int64_t p = a.offset + i, S = a.S;
  const int64_t qo = ((b * a.T + i) * a.Hq + h) * a.D;
  float* srow = sc + r * S;
  float* prow = pr + r * S;
  float* drow = dp + r * S;
  float m = -INFINITY;
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
  }
  m = block_max(m, sh);
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
  MT_LAUNCH(attn_fwd_kernel, static_cast<unsigned>(rows), kThreads, 0, c.stream)
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
  MT_LAUNCH(attn_bwd_q_kernel, static_cast<unsigned>(rows), kThreads, 0, c.stream)
  (in(q), in(k), in(v), in(dout), qs, ks, a, sc, pr, dp, out(dq));
  launched(op, shapes);
  MT_LAUNCH(attn_bwd_kv_kernel, static_cast<unsigned>(B * a.S * a.Hkv), kThreads, 0, c.stream)
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
  MT_LAUNCH(attn_fwd_kernel, static_cast<unsigned>(rows), kThreads, 0, c.stream)
  (in(q), in(k_cache), in(v_cache), nullptr, nullptr, lengths.ptr<const int32_t>(), a,
   sc.ptr<float>(), out(o), nullptr, bad);
  launched(op, [&] { return "q " + str(q) + ", k_cache " + str(k_cache); });
}

}  // namespace mt::cuda
