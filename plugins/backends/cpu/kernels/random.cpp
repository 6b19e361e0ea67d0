// fill_random: parameter initialisation, every element from mt/random_fill.h's generator.
//
// Tasks own fixed chunks of kChunk elements (a multiple of 4, so no Philox block is split), and
// every element is a function of (key, index) alone: the result is the same bits for any thread
// count, and the same as the core's host composition and the CUDA kernel. A chunk is made in
// three vectorisable passes (in place for the normal in f32, else over an f32 stack buffer): the
// first attempt's four draws per block, then the truncated normal's rare redraws (4.55% of
// elements) gathered into a list and redrawn together, then the scale (and bf16's rounding to
// nearest even). The file is built with -fno-math-errno: sqrt that may set errno does not
// vectorise.
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"
#include "mt/random_fill.h"

namespace mt::cpu {
namespace {

namespace rf = random_fill;

constexpr int64_t kChunk = 4096;  // elements per task and per buffer (16 KiB)

// z[4k + j] = the standard draw j of block (first_group + k, attempt 0), k < groups.
MT_CLONES void draw_blocks(uint64_t key, uint64_t first_group, int64_t groups, float* z) {
  for (int64_t k = 0; k < groups; ++k) {
    float v[4];
    rf::normal4(key, first_group + static_cast<uint64_t>(k), 0, v);
    z[4 * k] = v[0];
    z[4 * k + 1] = v[1];
    z[4 * k + 2] = v[2];
    z[4 * k + 3] = v[3];
  }
}

// For each listed element (index[k] relative to `first`), its draw at `attempt`.
MT_CLONES void redraw(uint64_t key, uint64_t first, const int32_t* index, int64_t m,
                      uint32_t attempt, float* out) {
  for (int64_t k = 0; k < m; ++k)
    out[k] = rf::draw_at(key, first + static_cast<uint64_t>(index[k]), attempt);
}

MT_CLONES void scale_n(float* z, float s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) z[i] *= s;
}

// Replaces every rejected draw of z[0, n) (elements first.. of the tensor) by its first accepted
// later attempt, as rf::standard_draw does one element at a time. The list is kept without
// branches (a rejection is random, so a branch on it would mispredict).
void redraw_rejected(uint64_t key, uint64_t first, float* z, int64_t n) {
  int32_t index[kChunk];
  float fresh[kChunk];
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    index[m] = static_cast<int32_t>(i);
    m += rf::rejected(z[i]) ? 1 : 0;
  }
  for (uint32_t attempt = 1; m > 0; ++attempt) {
    if (attempt == rf::kMaxAttempts) {
      for (int64_t k = 0; k < m; ++k) z[index[k]] = 0.f;
      return;
    }
    redraw(key, first, index, m, attempt, fresh);
    int64_t left = 0;
    for (int64_t k = 0; k < m; ++k) {
      const bool again = rf::rejected(fresh[k]);
      z[index[k]] = fresh[k];  // a rejected one is overwritten at a later attempt
      index[left] = index[k];
      left += again ? 1 : 0;
    }
    m = left;
  }
}

}  // namespace

void fill_random(Tensor& out, const RandomFill& spec) {
  const bool truncated = spec.distribution == RandomFill::Distribution::truncated_normal;
  MT_CHECK(is_fb(out.dtype()), "cpu fill_random: out " + out.str() + " (want f32 or bf16)");
  MT_CHECK((truncated || spec.distribution == RandomFill::Distribution::normal) &&
               std::isfinite(spec.stddev) && spec.stddev >= 0.f,
           "cpu fill_random: distribution " + std::to_string(int(spec.distribution)) + ", stddev " +
               std::to_string(spec.stddev) + " (want normal or truncated_normal, stddev >= 0)");
  const int64_t n = out.numel();
  const float scale = rf::value_scale(truncated, spec.stddev);
  const bool bf16 = out.dtype() == DType::bf16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  tbb::parallel_for(int64_t(0), chunks, [&](int64_t c) {
    const int64_t b = c * kChunk, len = std::min(kChunk, n - b);
    // The normal in f32 is made in place (but for a ragged last block); the rest goes through
    // a buffer (the truncated normal's list pass is faster there) on the heap: 16 KiB on the
    // stack overflowed a main thread of `ulimit -s 64` (SIGSEGV).
    const bool in_place = !bf16 && !truncated && len % 4 == 0;
    std::vector<float> buf(in_place ? 0 : static_cast<size_t>(kChunk));
    float* z = in_place ? out.ptr<float>() + b : buf.data();
    draw_blocks(spec.key, static_cast<uint64_t>(b / 4), (len + 3) / 4, z);
    if (truncated) redraw_rejected(spec.key, static_cast<uint64_t>(b), z, len);
    scale_n(z, scale, len);
    if (bf16)
      f32_to_bf16_n(z, out.ptr<uint16_t>() + b, len);
    else if (!in_place)
      std::memcpy(out.ptr<float>() + b, z, static_cast<size_t>(len) * sizeof(float));
  });
}

}  // namespace mt::cpu
