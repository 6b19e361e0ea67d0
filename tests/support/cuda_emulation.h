// Runs CUDA kernels written for mt's CUDA backend as host C++, so their logic (indexing, masks,
// tiling, warp shuffles, mma fragment layouts) is tested on machines without a GPU. Include this
// before the kernel header; it defines MT_CUDA_EMULATION, the CUDA keywords the kernels use, a
// bfloat16 type with CUDA's conversions, threadIdx/blockIdx, __syncthreads, __shfl_xor_sync,
// mma.sync m16n8k16 (bf16 in, f32 accumulate) and ldmatrix from the fragment layouts of the PTX
// ISA, and cp.async with its groups (each copy landing as late as the hardware may land it).
//
// emu::launch runs each block of a grid in turn, its threads as fibers: __syncthreads is a
// barrier of the block, a shuffle or an mma a barrier of the warp around an exchange. Only what
// mt's kernels use is here: blocks of up to 32 x kMaxWarps threads, one-dimensional, and warp-
// uniform shuffles and mma calls (as the hardware requires anyway). Arithmetic is IEEE f32 like
// the device's, but the order of an mma's sums is not the hardware's: compare with tolerances.
#pragma once

// Fibers switch with _setjmp/_longjmp between their own stacks, which glibc's fortified longjmp
// refuses: this header must come first in its file.
#undef _FORTIFY_SOURCE

#define MT_CUDA_EMULATION 1

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "mt/dtype.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(n)
// One block runs at a time, so a function's static is its block's shared memory.
#define __shared__ static
#define MT_DYNAMIC_SHARED(name) unsigned char* name = emu::dynamic_shared()
// A fault the device would raise (a misaligned or out-of-range shared-memory access): the test
// stops here rather than reading something the hardware never would.
#define MT_EMU_REQUIRE(cond, what)                        \
  do {                                                    \
    if (!(cond)) {                                        \
      std::fprintf(stderr, "cuda_emulation: %s\n", what); \
      std::abort();                                       \
    }                                                     \
  } while (0)
#define MT_KERNEL_PROLOGUE() emu::kernel_prologue()
#define MT_LAUNCH(kernel, grid, block, shared, stream) \
  emu::Launcher(emu::as_dim3(grid), block, shared, [&](auto... args_) { kernel(args_...); })

struct dim3 {  // as CUDA's: a constructor (dim3 g(a, b) is not an aggregate's before clang 16)
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  return {x, y, z, w};
}

// bfloat16 as CUDA's __nv_bfloat16: 16 bits, round to nearest even.
struct __nv_bfloat16 {
  uint16_t bits;
};
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return {mt::f32_to_bf16(f)};
}
// The device's correctly rounded arithmetic: the host's IEEE operations (this file's users are
// built without FMA contraction across these calls).
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __fdiv_rn(float a, float b) {
  return a / b;
}
inline float __fsqrt_rn(float a) {
  return std::sqrt(a);
}

// Device-side math the kernels call unqualified.
using std::isinf;
using std::isnan;
inline int64_t min(int64_t a, int64_t b) {
  return a < b ? a : b;
}
inline int64_t max(int64_t a, int64_t b) {
  return a < b ? b : a;
}

// The runtime calls the backend's host code makes, on host memory.
enum cudaError_t : int { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
using cudaStream_t = void*;
enum cudaMemcpyKind {
  cudaMemcpyHostToHost,
  cudaMemcpyHostToDevice,
  cudaMemcpyDeviceToHost,
  cudaMemcpyDeviceToDevice
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaDeviceAttr { cudaDevAttrComputeCapabilityMajor, cudaDevAttrMaxSharedMemoryPerBlockOptin };
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t n, cudaMemcpyKind,
                                   cudaStream_t) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) {
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t) {
  if (n) std::memset(p, value, n);
  return cudaSuccess;
}
// One block runs at a time, its threads in turn: a plain read-modify-write is atomic here.
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  const unsigned long long old = *p;
  if (v < old) *p = v;
  return old;
}
inline cudaError_t cudaGetLastError() {
  return cudaSuccess;
}
inline const char* cudaGetErrorName(cudaError_t) {
  return "cudaErrorEmulated";
}
inline const char* cudaGetErrorString(cudaError_t) {
  return "an emulated CUDA call failed";
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int);
// More dynamic shared memory than the device allows a block is refused, as CUDA does.
template <class K>
cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  int most = 0;
  cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0);
  return bytes > most ? cudaErrorInvalidValue : cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
// A Hopper part: the kernels take their sm_80+ paths, with an H100's 227 KiB of shared memory
// per block, or the bytes MT_EMULATED_SMEM_PER_BLOCK says (101376: an sm_86/89/120 part's).
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  if (attr == cudaDevAttrMaxSharedMemoryPerBlockOptin) {
    const char* e = std::getenv("MT_EMULATED_SMEM_PER_BLOCK");
    *v = e && std::atoi(e) > 0 ? std::atoi(e) : 232448;
    return cudaSuccess;
  }
  *v = 9;
  return cudaSuccess;
}
enum cublasStatus_t : int {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_NOT_SUPPORTED = 15
};
inline const char* cublasLtGetStatusName(cublasStatus_t s) {
  return s == CUBLAS_STATUS_SUCCESS         ? "CUBLAS_STATUS_SUCCESS"
         : s == CUBLAS_STATUS_INVALID_VALUE ? "CUBLAS_STATUS_INVALID_VALUE"
         : s == CUBLAS_STATUS_NOT_SUPPORTED ? "CUBLAS_STATUS_NOT_SUPPORTED"
                                            : "CUBLAS_STATUS_EMULATED";
}
inline const char* cublasLtGetStatusString(cublasStatus_t) {
  return "emulated";
}

inline float __bfloat162float(__nv_bfloat16 b) {
  return mt::bf16_to_f32(b.bits);
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) {
  return b.bits;
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t __float_as_uint(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

namespace emu {

constexpr int kMaxWarps = 8;
constexpr size_t kStack = size_t{64} << 10;  // bytes of stack per emulated thread

// A block's threads are fibers run in turn by one host thread: a thread runs until it waits at a
// barrier or returns; when every live thread waits, the barriers whose participants (the live
// threads of a warp, or of the block) have all arrived open. A fiber starts on its own stack
// through makecontext/setcontext and then switches with _setjmp/_longjmp, which make no system
// call (swapcontext saves the signal mask each time): millions of switches take seconds.
struct Block {
  enum Wait : uint8_t { none, warp_barrier, block_barrier };
  struct Fiber {
    ucontext_t ctx;  // the first entry
    jmp_buf jb;      // where it waits
    bool started = false;
    Wait wait = none;
    bool done = false;
    bool prologue = false;  // has run MT_KERNEL_PROLOGUE()
  };
  Block(int threads, size_t shared, std::vector<char>& stacks)
      : threads(threads), fibers(static_cast<size_t>(threads)), smem(shared + 16) {
    stacks.resize(kStack * static_cast<size_t>(threads));
    stack_base = stacks.data();
  }
  int threads;
  std::vector<Fiber> fibers;
  char* stack_base;
  jmp_buf scheduler;
  int current = 0;
  std::vector<unsigned char> smem;
  // What the lanes of each warp exchange in a shuffle or an mma.
  float shfl[kMaxWarps][32];
  struct Frag {
    uint32_t a[4], b[2];
    float c[4];
  } frag[kMaxWarps][32];
  // The row addresses the lanes of each warp give an ldmatrix.
  const unsigned char* rows[kMaxWarps][32];
  // Each thread's cp.async copies not yet complete, and how many groups it has committed.
  struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes, src_bytes, group;
  };
  std::vector<std::vector<AsyncCopy>> pending =
      std::vector<std::vector<AsyncCopy>>(static_cast<size_t>(threads));
  std::vector<int> committed = std::vector<int>(static_cast<size_t>(threads), 0);
  bool in_shared(const void* p, size_t n) const {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= smem.data() && c + n <= smem.data() + smem.size();
  }
};

struct ThreadState {
  Block* block = nullptr;
  dim3 thread, blk, grid_dim, block_dim;
  const std::function<void()>* kernel = nullptr;
  int64_t mma_warp_calls = 0;  // mma.sync executed, per warp (tests check a path took them)
  int64_t launches = 0;        // kernels launched (tests check how many a call takes)
};
inline ThreadState state;  // one block runs at a time, on the calling thread

inline unsigned char* dynamic_shared() {
  // 16-byte aligned, as the device's.
  auto p = reinterpret_cast<uintptr_t>(state.block->smem.data());
  return reinterpret_cast<unsigned char*>((p + 15) & ~uintptr_t{15});
}
inline int lane() {
  return static_cast<int>(state.thread.x) & 31;
}
inline int warp() {
  return static_cast<int>(state.thread.x) >> 5;
}
inline void wait(Block::Wait w) {
  Block& b = *state.block;
  auto& f = b.fibers[static_cast<size_t>(b.current)];
  f.wait = w;
  if (!_setjmp(f.jb)) _longjmp(b.scheduler, 1);
}
inline void warp_sync() {
  wait(Block::warp_barrier);
}

// MT_KERNEL_PROLOGUE (device_io.cuh), the first statement of every mt kernel: on the device,
// under programmatic dependent launch, the wait for the kernel before. The emulator runs kernels
// one after another, so it only marks the thread, and faults a kernel that returns, or makes a
// 16-byte load or store, without it: such a kernel would race its predecessor under
// MT_CUDA_PDL=1, which no emulated result could show.
inline void kernel_prologue() {
  state.block->fibers[static_cast<size_t>(state.block->current)].prologue = true;
}
inline void require_prologue() {
  MT_EMU_REQUIRE(
      !state.block || state.block->fibers[static_cast<size_t>(state.block->current)].prologue,
      "a kernel touched memory before MT_KERNEL_PROLOGUE() (device_io.cuh), or has "
      "none: under MT_CUDA_PDL=1 it would race the kernel before it");
}

[[noreturn]] inline void fiber_main() {
  (*state.kernel)();
  require_prologue();
  Block& b = *state.block;
  b.fibers[static_cast<size_t>(b.current)].done = true;
  _longjmp(b.scheduler, 1);
}

// Out of line: getcontext returns twice, which must not touch the caller's loop variables.
[[gnu::noinline]] inline void make_fiber(Block& block, int t) {
  auto& f = block.fibers[static_cast<size_t>(t)];
  getcontext(&f.ctx);
  f.ctx.uc_stack.ss_sp = block.stack_base + kStack * static_cast<size_t>(t);
  f.ctx.uc_stack.ss_size = kStack;
  f.ctx.uc_link = nullptr;  // fiber_main never returns
  makecontext(&f.ctx, fiber_main, 0);
}

// Runs fiber t until it waits or ends. Out of line for the same reason as make_fiber.
[[gnu::noinline]] inline void resume(Block& block, int t) {
  auto& f = block.fibers[static_cast<size_t>(t)];
  block.current = t;
  state.thread = {static_cast<unsigned>(t), 0, 0};
  if (_setjmp(block.scheduler)) return;
  if (!f.started) {
    f.started = true;
    setcontext(&f.ctx);
  }
  _longjmp(f.jb, 1);
}

// Runs `kernel` (a callable with the kernel's arguments bound) over `grid` blocks of `threads`
// threads with `shared` bytes of dynamic shared memory. A warp may return early only as a whole,
// as mt's kernels do; a barrier that can never open (a kernel bug) aborts the test.
inline void launch(dim3 grid, int threads, size_t shared, const std::function<void()>& kernel) {
  ++state.launches;
  std::vector<char> stacks;
  state.kernel = &kernel;
  state.grid_dim = grid;
  state.block_dim = {static_cast<unsigned>(threads), 1, 1};
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      Block block(threads, shared, stacks);
      state.block = &block;
      state.blk = {bx, by, 0};
      for (int t = 0; t < threads; ++t) make_fiber(block, t);
      for (;;) {
        bool live = false;
        for (int t = 0; t < threads; ++t) {
          auto& f = block.fibers[static_cast<size_t>(t)];
          if (f.done || f.wait != Block::none) continue;
          resume(block, t);
        }
        // Every live thread now waits. Open the barriers whose participants all arrived.
        bool opened = false, all_block = true;
        for (int t = 0; t < threads; ++t) {
          const auto& f = block.fibers[static_cast<size_t>(t)];
          if (f.done) continue;
          live = true;
          all_block = all_block && f.wait == Block::block_barrier;
        }
        if (!live) break;
        if (all_block) {
          for (auto& f : block.fibers) f.wait = Block::none;
          continue;
        }
        for (int w = 0; w * 32 < threads; ++w) {
          bool all = true, any = false;
          for (int t = 32 * w; t < std::min(threads, 32 * w + 32); ++t) {
            const auto& f = block.fibers[static_cast<size_t>(t)];
            if (f.done) continue;
            any = true;
            all = all && f.wait == Block::warp_barrier;
          }
          if (!any || !all) continue;
          for (int t = 32 * w; t < std::min(threads, 32 * w + 32); ++t)
            block.fibers[static_cast<size_t>(t)].wait = Block::none;
          opened = true;
        }
        if (!opened) {
          std::fprintf(stderr,
                       "cuda_emulation: deadlock: threads wait at barriers that cannot open\n");
          std::abort();
        }
      }
      state.block = nullptr;
    }
}

inline dim3 as_dim3(dim3 d) {
  return d;
}
inline dim3 as_dim3(unsigned x) {
  return {x, 1, 1};
}
inline dim3 as_dim3(int x) {
  return {static_cast<unsigned>(x), 1, 1};
}

// MT_LAUNCH's object: called with the kernel's arguments, runs the grid.
template <class K>
struct Launcher {
  Launcher(dim3 grid, int threads, size_t shared, K kernel)
      : grid(grid), threads(threads), shared(shared), kernel(kernel) {}
  template <class... A>
  void operator()(A... args) const {
    launch(grid, threads, shared, [&] { kernel(args...); });
  }
  dim3 grid;
  int threads;
  size_t shared;
  K kernel;
};

}  // namespace emu

#define threadIdx (emu::state.thread)
#define blockIdx (emu::state.blk)
#define gridDim (emu::state.grid_dim)
#define blockDim (emu::state.block_dim)

inline void __syncthreads() {
  emu::wait(emu::Block::block_barrier);
}

inline float __shfl_xor_sync(unsigned /*mask*/, float v, int offset) {
  auto& b = *emu::state.block;
  const int w = emu::warp(), l = emu::lane();
  b.shfl[w][l] = v;
  emu::warp_sync();
  const float r = b.shfl[w][l ^ offset];
  emu::warp_sync();
  return r;
}

inline int __any_sync(unsigned /*mask*/, int predicate) {
  auto& b = *emu::state.block;
  const int w = emu::warp(), l = emu::lane();
  b.shfl[w][l] = predicate ? 1.f : 0.f;
  emu::warp_sync();
  int any = 0;
  for (int i = 0; i < 32; ++i) any |= b.shfl[w][i] != 0.f;
  emu::warp_sync();
  return any;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: c += A (16x16) B (16x8) with, for lane
// = 4 gid + tq, A's registers {A[gid][2tq..], A[gid+8][2tq..], A[gid][2tq+8..],
// A[gid+8][2tq+8..]}, B's {B[2tq..2tq+1][gid], B[2tq+8..2tq+9][gid]} (lower index in the low
// half) and C's {C[gid][2tq], C[gid][2tq+1], C[gid+8][2tq], C[gid+8][2tq+1]}.
inline void emulated_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  auto& blk = *emu::state.block;
  const int w = emu::warp(), l = emu::lane();
  auto& mine = blk.frag[w][l];
  std::memcpy(mine.a, a, sizeof(mine.a));
  mine.b[0] = b0;
  mine.b[1] = b1;
  for (int i = 0; i < 4; ++i) mine.c[i] = c[i];
  emu::warp_sync();
  // The warp's first lane multiplies for all 32 (the others wait at the next barrier).
  if (l == 0) {
    ++emu::state.mma_warp_calls;
    auto half = [](uint32_t r, int hi) {
      return __bfloat162float({static_cast<uint16_t>(hi ? r >> 16 : r & 0xffffu)});
    };
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; ++L) {
      const int gid = L >> 2, tq = L & 3;
      const auto& f = blk.frag[w][L];
      for (int e = 0; e < 2; ++e) {
        A[gid][2 * tq + e] = half(f.a[0], e);
        A[gid + 8][2 * tq + e] = half(f.a[1], e);
        A[gid][2 * tq + 8 + e] = half(f.a[2], e);
        A[gid + 8][2 * tq + 8 + e] = half(f.a[3], e);
        B[2 * tq + e][gid] = half(f.b[0], e);
        B[2 * tq + 8 + e][gid] = half(f.b[1], e);
      }
    }
    for (int L = 0; L < 32; ++L) {
      const int gid = L >> 2, tq = L & 3;
      auto& f = blk.frag[w][L];
      for (int i = 0; i < 4; ++i) {
        const int row = gid + 8 * (i >> 1), col = 2 * tq + (i & 1);
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
        f.c[i] += sum;
      }
    }
  }
  emu::warp_sync();
  for (int i = 0; i < 4; ++i) c[i] = mine.c[i];
  emu::warp_sync();  // every lane has its result before any lane's next mma reuses the slots
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8m..8m+7 give the 16-byte rows 0..7
// of 8x8 matrix m; lane 4 gid + tq receives, of each matrix M, register m = {M[gid][2tq],
// M[gid][2tq+1]}, or with .trans {M[2tq][gid], M[2tq+1][gid]} (lower element in the low half).
inline void emulated_ldmatrix_x4(uint32_t (&r)[4], const void* row, bool trans) {
  auto& blk = *emu::state.block;
  const int w = emu::warp(), l = emu::lane();
  MT_EMU_REQUIRE(reinterpret_cast<uintptr_t>(row) % 16 == 0, "ldmatrix row not 16-byte aligned");
  MT_EMU_REQUIRE(blk.in_shared(row, 16), "ldmatrix row outside shared memory");
  blk.rows[w][l] = static_cast<const unsigned char*>(row);
  emu::warp_sync();
  const int gid = l >> 2, tq = l & 3;
  for (int m = 0; m < 4; ++m) {
    uint16_t e[2];
    for (int h = 0; h < 2; ++h) {
      const unsigned char* src = trans ? blk.rows[w][8 * m + 2 * tq + h] + 2 * gid
                                       : blk.rows[w][8 * m + gid] + 2 * (2 * tq + h);
      std::memcpy(&e[h], src, 2);
    }
    r[m] = static_cast<uint32_t>(e[0]) | (static_cast<uint32_t>(e[1]) << 16);
  }
  emu::warp_sync();  // every lane has read before any lane's next ldmatrix reuses the slots
}

// cp.async (global -> shared, `bytes` of which the first `src_bytes` are read and the rest
// zero-filled), commit_group and wait_group N. The destination holds NaN from the issue (what is
// there while the copy is in flight is undefined on the device) until the thread waits for the
// copy's group (the latest the hardware may deliver it): a kernel that reads a buffer before
// waiting, or refills one that another warp still reads, computes with NaN.
inline void emulated_cp_async(void* dst, const void* src, int bytes, int src_bytes) {
  auto& blk = *emu::state.block;
  const auto t = static_cast<size_t>(emu::state.thread.x);
  MT_EMU_REQUIRE(reinterpret_cast<uintptr_t>(dst) % static_cast<uintptr_t>(bytes) == 0 &&
                     reinterpret_cast<uintptr_t>(src) % static_cast<uintptr_t>(bytes) == 0,
                 "cp.async address not aligned to its size");
  MT_EMU_REQUIRE(blk.in_shared(dst, static_cast<size_t>(bytes)),
                 "cp.async destination outside shared memory");
  std::memset(dst, 0xff, static_cast<size_t>(bytes));  // NaN as f32 and as bf16
  blk.pending[t].push_back({static_cast<unsigned char*>(dst),
                            static_cast<const unsigned char*>(src), bytes, src_bytes,
                            blk.committed[t]});
}
inline void emulated_cp_async_commit() {
  ++emu::state.block->committed[static_cast<size_t>(emu::state.thread.x)];
}
inline void emulated_cp_async_wait(int n) {
  auto& blk = *emu::state.block;
  const auto t = static_cast<size_t>(emu::state.thread.x);
  auto& mine = blk.pending[t];
  const int done_below = blk.committed[t] - n;  // groups older than the newest n complete
  std::vector<emu::Block::AsyncCopy> rest;
  for (const auto& c : mine) {
    if (c.group >= done_below) {
      rest.push_back(c);
      continue;
    }
    if (c.src_bytes > 0) std::memcpy(c.dst, c.src, static_cast<size_t>(c.src_bytes));
    std::memset(c.dst + c.src_bytes, 0, static_cast<size_t>(c.bytes - c.src_bytes));
  }
  mine.swap(rest);
}
