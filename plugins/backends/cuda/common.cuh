// The helpers shared by the CUDA backend's kernel sources (one .cu per op family): launch
// shapes, flat maps and vectorised elementwise ops, block reductions, index checks and the
// host read-back of small index tensors. Every definition is internal to the source that
// includes it.
//
// Storage is f32 or bf16 per operand, arithmetic always f32: operands are read through In/Out
// views that branch on the dtype (the branch is uniform across a launch, so it costs little and
// keeps one kernel per op instead of one per dtype mix). Every reduction has a fixed shape — a
// fixed grid, a fixed per-block tree, fixed row blocks — and no float atomics, so results are
// bitwise reproducible run to run. The formulas and their operation order follow the CPU backend
// (plugins/backends/cpu/kernels) so the two agree to rounding.
#pragma once

#ifndef MT_CUDA_EMULATION
#include <cuda_bf16.h>
#endif

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "device_io.cuh"
#include "kernels.h"
#include "mt/error.h"

namespace mt::cuda {
namespace {

constexpr int kThreads = 256;  // threads per block everywhere (block reductions assume it)
constexpr int64_t kMaxGrid = 1 << 20;

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxGrid));
}

// ---- flat maps: f(i) for i in [0, n) ------------------------------------------------------
template <class F>
__global__ void map_kernel(int64_t n, F f) {
  MT_KERNEL_PROLOGUE();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride)
    f(i);
}

template <class F, class S>
void launch_map(const Ctx& c, int64_t n, const F& f, const std::string& op, S&& shapes) {
  if (n <= 0) return;
  auto* kernel = &map_kernel<F>;  // (a function, as MT_LAUNCH takes)
  MT_LAUNCH(kernel, grid_for(n), kThreads, 0, c)(n, f);
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
  MT_KERNEL_PROLOGUE();
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
  MT_LAUNCH(kernel, grid_for((n + 7) / 8), kThreads, 0, c)(n, e, vec);
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

// ---- tensor shapes as matrices: the last dimension and the rows before it -----------------
int64_t last_dim(const Tensor& t) {
  return t.ndim() == 0 ? 1 : t.dim(-1);
}
int64_t lead_rows(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) n *= t.shape()[i];
  return n;
}

}  // namespace
}  // namespace mt::cuda
