// Rotary position embedding for the CUDA backend: one kernel for the forward and (with the
// angle negated, accumulating) the backward, over frequency tables kept in Ctx::rope.
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "common.cuh"

namespace mt::cuda {

// ---- rope -----------------------------------------------------------------------------------
namespace {

constexpr int64_t kMaxRotaryDim = 8192;  // rope: R floats of shared memory per block

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
  MT_KERNEL_PROLOGUE();
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
            static_cast<size_t>(R) * sizeof(float), c)
  (in(x), positions.ptr<const int32_t>(), table.dev.ptr<const float>(), H, D, R, spec.interleaved,
   static_cast<float>(table.mscale), inverse, vec, out(o));
  launched(op, shapes);
}

}  // namespace

void rope_forward(const Ctx& c, const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                  Tensor& o) {
  rope_apply(c, "rope_forward", x, positions, spec, o, false);
}

void rope_backward(const Ctx& c, const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                   Tensor& dx) {
  rope_apply(c, "rope_backward", dout, positions, spec, dx, true);
}

}  // namespace mt::cuda
