// Device-side operand views shared by the CUDA backend's kernels: storage is f32 or bf16 per
// operand and arithmetic is always f32, so each kernel reads and writes through In/Out views that
// branch on the dtype (uniform across a launch: it costs little and keeps one kernel per op
// instead of one per dtype mix).
#pragma once

#ifndef MT_CUDA_EMULATION  // tests/support/cuda_emulation.h provides the types
#include <cuda_bf16.h>
#endif

#include <cstdint>
#include <initializer_list>
#include <string>

#include "mt/tensor.h"

// A kernel launch, written MT_LAUNCH(kernel, grid, block, shared, ctx)(args...) with ctx a Ctx
// (kernels.h): on the device, on ctx.stream, through cudaLaunchKernelEx with programmatic
// dependent launch where ctx.pdl is set (below); the emulator's launcher under
// tests/support/cuda_emulation.h. `kernel` is a function (a template's instance named whole).
#ifndef MT_LAUNCH
#include <cuda_runtime.h>

#include <utility>

namespace mt::cuda {
template <class... P>
struct KernelLaunch {
  void (*kernel)(P...);
  dim3 grid, block;
  size_t shared;
  cudaStream_t stream;
  bool pdl;
  // Launch errors are read by the caller's launched() (cudaGetLastError).
  template <class... A>
  void operator()(A&&... args) const {
    if (!pdl) {
      kernel<<<grid, block, shared, stream>>>(std::forward<A>(args)...);
      return;
    }
    cudaLaunchAttribute attr[1] = {};
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = shared;
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    static_cast<void>(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
  }
};
template <class... P, class C>
KernelLaunch<P...> kernel_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared,
                                 const C& ctx) {
  return {kernel, grid, block, shared, ctx.stream, ctx.pdl};
}
}  // namespace mt::cuda
#define MT_LAUNCH(kernel, grid, block, shared, ctx) \
  ::mt::cuda::kernel_launch(kernel, dim3(grid), dim3(block), static_cast<size_t>(shared), ctx)
#endif
// The first statement of every kernel: under programmatic dependent launch (Ctx::pdl) a kernel's
// blocks may start while the kernel before it in the stream still runs, so each waits here for
// that kernel to finish and its writes to be visible (griddepcontrol.wait) before touching
// memory, then lets the next kernel's blocks start (griddepcontrol.launch_dependents), to wait
// in turn. Both do nothing for a kernel launched without it, and before Hopper.
// (tests/support/cuda_emulation.h defines its own, which marks the thread, and faults a kernel
// that loads, stores or returns without it.)
#ifdef MT_KERNEL_PROLOGUE
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MT_KERNEL_PROLOGUE()                         \
  asm volatile("griddepcontrol.wait;" ::: "memory"); \
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
#else
#define MT_KERNEL_PROLOGUE() static_cast<void>(0)
#endif
// The dynamic shared memory of a block (extern __shared__ on the device; the emulator's block
// memory under tests/support/cuda_emulation.h).
#ifndef MT_DYNAMIC_SHARED
#define MT_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]
#endif

namespace mt::cuda {

struct In {
  const void* p;
  bool bf;
  __device__ float operator[](int64_t i) const {
    return bf ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
  }
};
struct Out {
  void* p;
  bool bf;
  __device__ float get(int64_t i) const {
    return bf ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
              : static_cast<const float*>(p)[i];
  }
  // Round to nearest even, as mt::f32_to_bf16.
  __device__ void set(int64_t i, float v) const {
    if (bf)
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
    else
      static_cast<float*>(p)[i] = v;
  }
  __device__ void add(int64_t i, float v) const { set(i, get(i) + v); }
  // The same memory read as an input (an accumulated output's old values).
  __device__ In in() const { return {p, bf}; }
};

// 16 bytes at p, which must be 16-byte aligned (the device faults otherwise; so does the
// emulator).
__device__ __forceinline__ uint4 ld16(const void* p) {
#ifdef MT_CUDA_EMULATION
  MT_EMU_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0, "16-byte load not 16-byte aligned");
  emu::require_prologue();
#endif
  return *static_cast<const uint4*>(p);
}
__device__ __forceinline__ void st16(void* p, uint4 v) {
#ifdef MT_CUDA_EMULATION
  MT_EMU_REQUIRE(reinterpret_cast<uintptr_t>(p) % 16 == 0, "16-byte store not 16-byte aligned");
  emu::require_prologue();
#endif
  *static_cast<uint4*>(p) = v;
}

// x[base .. base + 8) as f32; vec: 16-byte loads (bf16: one, f32: two), which the caller may
// ask for only where x.p + base is 16-byte aligned.
__device__ __forceinline__ void load8(float (&r)[8], In x, int64_t base, bool vec) {
  if (vec && x.bf) {
    const uint4 u = ld16(static_cast<const __nv_bfloat16*>(x.p) + base);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      r[2 * t] = __uint_as_float(w[t] << 16);
      r[2 * t + 1] = __uint_as_float(w[t] & 0xffff0000u);
    }
  } else if (vec) {
    const float* p = static_cast<const float*>(x.p) + base;
    const uint4 u0 = ld16(p), u1 = ld16(p + 4);
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int t = 0; t < 8; ++t) r[t] = __uint_as_float(w[t]);
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) r[t] = x[base + t];
  }
}
// o[base .. base + 8) = r, rounded as Out::set; vec as for load8.
__device__ __forceinline__ void store8(Out o, int64_t base, const float (&r)[8], bool vec) {
  if (vec && o.bf) {
    uint32_t w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t)
      w[t] = static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(r[2 * t]))) |
             (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(r[2 * t + 1]))) << 16);
    st16(static_cast<__nv_bfloat16*>(o.p) + base, make_uint4(w[0], w[1], w[2], w[3]));
  } else if (vec) {
    float* p = static_cast<float*>(o.p) + base;
    st16(p, make_uint4(__float_as_uint(r[0]), __float_as_uint(r[1]), __float_as_uint(r[2]),
                       __float_as_uint(r[3])));
    st16(p + 4, make_uint4(__float_as_uint(r[4]), __float_as_uint(r[5]), __float_as_uint(r[6]),
                           __float_as_uint(r[7])));
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) o.set(base + t, r[t]);
  }
}

// x[base .. base + 8) as load8 does where all 8 lie below n and vec allows, else element by
// element with 0 past n (a chunk of 8 at the end of n elements).
__device__ __forceinline__ void load8_upto(float (&r)[8], In x, int64_t base, int64_t n, bool vec) {
  if (vec && base + 8 <= n) {
    load8(r, x, base, true);
    return;
  }
#pragma unroll
  for (int t = 0; t < 8; ++t) r[t] = base + t < n ? x[base + t] : 0.f;
}
// o[base .. min(base + 8, n)) = r, as store8 where all 8 lie below n and vec allows.
__device__ __forceinline__ void store8_upto(Out o, int64_t base, const float (&r)[8], int64_t n,
                                            bool vec) {
  if (vec && base + 8 <= n) {
    store8(o, base, r, true);
    return;
  }
  for (int t = 0; t < 8 && base + t < n; ++t) o.set(base + t, r[t]);
}

// Records a bad input in a DeviceChecks slot (kernels.h): the lowest position wins, with its
// value (positions below 2^32, values as int32).
__device__ __forceinline__ void record_bad(unsigned long long* slot, int64_t position,
                                           int64_t value) {
  const auto pos =
      static_cast<unsigned long long>(position < 0xfffffffell ? position : 0xfffffffell);
  atomicMin(slot, (pos << 32) | static_cast<uint32_t>(static_cast<int32_t>(value)));
}

inline bool is_fb(const Tensor& t) {
  return t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
}
inline In in(const Tensor& t) {
  return {t.data(), t.dtype() == DType::bf16};
}
inline Out out(const Tensor& t) {
  return {t.data(), t.dtype() == DType::bf16};
}
// Whether every pointer is 16-byte aligned (load8/store8's 16-byte accesses allowed).
inline bool aligned16(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}
inline std::string str(const Tensor& t) {
  return t.defined() ? t.str() : std::string("undefined");
}

}  // namespace mt::cuda
