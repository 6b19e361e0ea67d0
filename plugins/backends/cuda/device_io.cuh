// Device-side operand views shared by the CUDA backend's kernels: storage is f32 or bf16 per
// operand and arithmetic is always f32, so each kernel reads and writes through In/Out views that
// branch on the dtype (uniform across a launch: it costs little and keeps one kernel per op
// instead of one per dtype mix).
#pragma once

#ifndef MT_CUDA_EMULATION  // tests/support/cuda_emulation.h provides the types
#include <cuda_bf16.h>
#endif

#include <cstdint>
#include <string>

#include "mt/tensor.h"

// A kernel launch, written MT_LAUNCH(kernel, grid, block, shared, stream)(args...): the triple
// chevron on the device, the emulator's launcher under tests/support/cuda_emulation.h.
#ifndef MT_LAUNCH
#define MT_LAUNCH(kernel, grid, block, shared, stream) kernel<<<grid, block, shared, stream>>>
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
};

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
inline std::string str(const Tensor& t) {
  return t.defined() ? t.str() : std::string("undefined");
}

}  // namespace mt::cuda
