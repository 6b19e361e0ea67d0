// AMX bf16 GEMM (see gemm_amx.h).
//
// Layout. A tile is 16 rows x 64 bytes. The micro-kernel accumulates a 32 x 32 block of c in four
// f32 tiles (0-3) from two A tiles (4, 5: 16 rows x 32 k) and two B tiles (6, 7: 16 k-pairs x 16
// columns x 2, the "VNNI" pairing tdpbf16ps expects). Both operands are packed into exactly those
// tiles (zero-padded to whole tiles), which also absorbs every transpose: b once per GEMM, a per
// block of 128 rows by the task using it.
// Loops: a task owns a block of 128 rows of c (its packed a, 128 x K bf16, stays in L2) and a
// range of 32-column panels. Per panel, K goes in chunks of 256: the panel's chunk of packed b
// (16 KiB) is reused from L1 by the block's four row groups, whose f32 sums (16 KiB) also stay in
// L1, so only a streams from L2 (tile loads, not the tile multiplies, limit an unblocked loop).
// On AMX, a is packed up front too and a task's panels are a block of them whose packed b fits
// half an L2; tasks go block by block, so b comes from L2, not L3, for all row blocks but the
// first (in a standalone loop on a Xeon with AMX, 2026-11-30: 22 TSC cycles a tile multiply with
// the block in L2, 30 with b from L3; 15 is the multiplies' own rate).
// Few rows (m <= 256: an MoE expert's share of a batch, a short prompt) make one row block of all
// of them, and b is not packed up front: each task packs the chunks of 16 of its panels at a
// time, reading each row of a [k, n] b across the 16 panels (1 KiB runs; an [n, k] b's rows
// prefetched a chunk ahead), and multiplies them at once (their sums, up to 16 x 256 x 32 f32,
// in L2). Packing up front wrote all of b and read it back for one use, panel by panel, a cache
// line a row; at Mixtral's expert shape (128 rows of 4096 x 14336) the packing was a third of
// the time, and an expert with 144 rows made a second block of 16 rows that read all of b again.
// On the 2-core Zen 5 EPYC of 2026-11-30 that product went from 282 to 325-351 GFLOP/s (144
// rows: 270 to 305-323), and `mt bench moe` (Mixtral-8x7b's layer, 512 tokens, bf16) from 241
// to 285-314 GFLOP/s in its grouped matmuls (dense: 420).
//
// Without AMX, CPUs with AVX512_BF16 (AMD Zen 4 and later, Intel Cooper Lake) run the same
// loops and the same packed b with a vdpbf16ps micro-kernel: a 32 x 32 block in four passes of
// 8 rows x 32 columns (16 accumulators), each k pair of a row broadcast against the panel's two
// 16-column pair vectors; a is packed in pass order instead of tiles (each pass's 8 rows x 32 k a
// step contiguous), and each call prefetches its share of the next b chunk. On the 2-core AMD
// EPYC (Zen 4) of 2026-11-27 vdpbf16ps zmm issued one a cycle (6 cycles latency): 117 GMAC/s a
// core against 58.6 for f32 FMAs. A one-thread copy of these loops (128 rows, K = 2048,
// N = 5632) ran at 80% of that with the tile order and no prefetch, 82% in pass order, 97% with
// both; with b already in cache, pass order alone reached 99%.
//
// Determinism: each c element is one accumulation in a fixed k order.
#include "kernels/gemm_amx.h"

#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/x86_simd.h"
#include "mt/env.h"
#include "mt/q8.h"

namespace mt::cpu {
namespace {

constexpr int64_t kTileK = 32;               // bf16 per tile row (64 bytes)
constexpr int64_t kBlock = 32;               // rows and columns of c per micro-kernel call
constexpr int64_t kRowBlock = 128;           // rows of c per task (packed a: 128 x K)
constexpr int64_t kTileElems = 16 * kTileK;  // bf16 elements in one packed tile (1 KiB)
constexpr int64_t kStepsPerChunk = 8;        // k steps (of 32) per pass over a row group
constexpr int64_t kInTaskRows = 256;         // rows of c up to which tasks pack their own b
constexpr int64_t kPanelGroup = 16;          // panels a task packs at once when it packs b
// [[maybe_unused]] below: the AMX kernels that read these are not compiled under MT_EMULATE_X86.
// Rows of x gemv_rows_amx takes (one B tile wide).
[[maybe_unused]] constexpr int64_t kFewRowsAmx = 16;
// Bytes ahead of each weight row gemv_rows_amx prefetches (8 steps of 64 bytes).
[[maybe_unused]] constexpr int64_t kAmxRowsAhead = 512;
// The same for the int8 kernels (gemv_q8_amx, gemv_q8_blocks16_streams): on a 2-core Xeon with AMX
// (gemm_bench's BM_MatVecQ8Stream K=2048 N=5632, medians of 3) 128-256 bytes read fastest, 512
// ~5-10% slower, 2048-4096 ~15-25%.
[[maybe_unused]] constexpr int64_t kQ8TilesAhead = 256;
// Bytes ahead of each stream dot_q8_blocks16 prefetches (as gemm.cpp's int8 vector kernels).
[[maybe_unused]] constexpr int64_t kQ8Prefetch16 = 2048;

// A core's L2 in bytes (1 MiB where the system does not say).
int64_t l2_bytes() {
  static const int64_t kBytes = [] {
    const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return v >= (64 << 10) ? int64_t{v} : int64_t{1} << 20;
  }();
  return kBytes;
}

// Linux keeps the AMX tile data state off until a process asks (arch_prctl, kernel >= 5.16).
bool request_amx() {
#if defined(MT_EMULATE_X86)
  return false;  // SIMDe has no AMX
#else
  if (!mt_cpu_has_amx()) return false;
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#endif
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

#define MT_AMX MT_TARGET("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl")

#if !defined(MT_EMULATE_X86)
// Sets up this thread's tiles: all eight are 16 rows x 64 bytes.
MT_AMX void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  // GCC 12 does not see ldtilecfg read the struct and drops the stores above without this.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

MT_AMX void release_tiles() {
  _tile_release();
}

// Best-case FLOP/s of one core: four independent tile accumulations on operands held in tiles.
MT_AMX double measure_amx_peak() {
  configure_tiles();
  alignas(64) uint16_t ones[kTileElems];
  for (auto& x : ones) x = 0x3f80;  // bf16 1.0
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  _tile_loadd(6, ones, 64);
  _tile_loadd(7, ones, 64);
  constexpr long kIters = 20000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long i = 0; i < kIters; ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 4.0 * kIters * 16 * 16 * kTileK * 2 / s);
  }
  _tile_release();
  return best;
}

// acc (a 32 x 32 f32 block) += pa . pb over `steps` k steps (acc is zeroed first when `first`).
// pa: the row group's 2 A tiles per k step; pb: the panel's 2 B tiles per k step.
MT_AMX void micro_kernel(const uint16_t* pa, const uint16_t* pb, int64_t steps, bool first,
                         float* acc) {
  constexpr int64_t kStride = kBlock * 4;  // bytes per row of acc
  if (first) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, acc, kStride);
    _tile_loadd(1, acc + 16, kStride);
    _tile_loadd(2, acc + 16 * kBlock, kStride);
    _tile_loadd(3, acc + 16 * kBlock + 16, kStride);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* a = pa + s * 2 * kTileElems;
    const uint16_t* b = pb + s * 2 * kTileElems;
    _tile_loadd(4, a, 64);
    _tile_loadd(5, a + kTileElems, 64);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, kStride);
  _tile_stored(1, acc + 16, kStride);
  _tile_stored(2, acc + 16 * kBlock, kStride);
  _tile_stored(3, acc + 16 * kBlock + 16, kStride);
}
#else  // never called: request_amx() says no AMX under emulation
void configure_tiles() {}
void release_tiles() {}
double measure_amx_peak() {
  return 0;
}
void micro_kernel(const uint16_t*, const uint16_t*, int64_t, bool, float*) {
  std::abort();
}
#endif

#define MT_BF16DOT MT_TARGET("avx512f,avx512bw,avx512vl,avx512bf16")

// micro_kernel's contract on vdpbf16ps: acc (32 x 32 f32) += pa . pb over `steps` k steps of 32.
// pb: the same packed B tiles ([2 tiles][16 k pairs][16 cols][2] per step). pa: the row group's
// A in pass order (pack_a with `passes`): [4 passes of 8 rows][kb steps][8 rows][32 k], `s0`
// the first step. Each pass of 8 rows x 32 columns (16 accumulators) broadcasts a row's k pair
// against the panel's two 16-column pair vectors, its 8 x 32 A bf16 a step contiguous (the tile
// order put a pass's steps 2 KiB apart, the B chunk's stride, and the two fought over L1 sets).
// `pf`, when not null: the next B chunk's share this call prefetches into L1, `pf_lines` cache
// lines per step of each pass (B otherwise arrives from memory on first use, stalling the pass).
MT_BF16DOT void dot_micro_kernel(const uint16_t* pa, int64_t kb, int64_t s0, const uint16_t* pb,
                                 int64_t steps, bool first, float* acc, const char* pf,
                                 int64_t pf_lines) {
  for (int64_t r0 = 0; r0 < kBlock; r0 += 8) {
    __m512 c[8][2];
    for (int r = 0; r < 8; ++r)
      for (int h = 0; h < 2; ++h)
        c[r][h] = first ? _mm512_setzero_ps() : _mm512_load_ps(acc + (r0 + r) * kBlock + 16 * h);
    const uint16_t* pass = pa + (r0 / 8) * kb * 8 * kTileK;
    for (int64_t st = 0; st < steps; ++st) {
      const uint16_t* a = pass + (s0 + st) * 8 * kTileK;
      const uint16_t* b = pb + st * 2 * kTileElems;
      if (pf) {
        const char* line = pf + ((r0 / 8) * steps + st) * pf_lines * 64;
        for (int64_t l = 0; l < pf_lines; ++l) _mm_prefetch(line + l * 64, _MM_HINT_T0);
      }
      for (int64_t pr = 0; pr < kTileK / 2; ++pr) {
        const __m512bh b0 = MT_AS_BF16X32(_mm512_loadu_si512(b + pr * 32));
        const __m512bh b1 = MT_AS_BF16X32(_mm512_loadu_si512(b + kTileElems + pr * 32));
        for (int r = 0; r < 8; ++r) {
          uint32_t pair;
          std::memcpy(&pair, a + r * kTileK + 2 * pr, sizeof pair);
          const __m512bh av = MT_AS_BF16X32(_mm512_set1_epi32(static_cast<int>(pair)));
          c[r][0] = _mm512_dpbf16_ps(c[r][0], av, b0);
          c[r][1] = _mm512_dpbf16_ps(c[r][1], av, b1);
        }
      }
    }
    for (int r = 0; r < 8; ++r)
      for (int h = 0; h < 2; ++h) _mm512_store_ps(acc + (r0 + r) * kBlock + 16 * h, c[r][h]);
  }
}

// Best-case FLOP/s of one core on vdpbf16ps: 12 independent chains, every hardware thread
// running at once (the all-core clock, as the f32 peak is measured), the best thread's best run.
MT_BF16DOT double dot_loop(long iters) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
  const __m512bh x = MT_AS_BF16X32(_mm512_set1_epi32(0x3f803f80));
  const __m512bh y = MT_AS_BF16X32(_mm512_set1_epi32(0x3f7f3f7f));
  for (long n = 0; n < iters; ++n)
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  for (int i = 1; i < 12; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  alignas(64) float out[16];
  _mm512_store_ps(out, acc[0]);
  return out[0];
}

double measure_dot_peak() {
#if defined(MT_EMULATE_X86)
  return 2e11;  // emulated instructions have no rate of their own: a nominal figure
#endif
  constexpr long kIters = 200000;
  auto one_core = [] {
    double best = 0, sink = 0;
    for (int rep = 0; rep < 8; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      sink += dot_loop(kIters);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * 32 * 12 * static_cast<double>(kIters) / s);
    }
    if (sink == 12345.678) best += 1;  // keeps the loop from being optimised away
    return best;
  };
  return best_on_every_thread(one_core);
}

// Sixteen f32 values rounded to bf16 as mt::f32_to_bf16 rounds them (to nearest even; a NaN
// keeps its sign and top payload bits and is made quiet), the bits in the low 16 of each lane.
MT_AMX inline __m512i bf16_bits(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i high = _mm512_maskz_srli_epi32(0xffff, u, 16);
  const __m512i odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_maskz_srli_epi32(
      0xffff, _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
}

// c block [rows, cols] (<= 32 x 32) of a bf16 c = alpha * acc, rounded as above: the bits
// write_block and a conversion of its f32 block would give.
MT_AMX void write_block16(const float* acc, float alpha, uint16_t* c, int64_t ldc, int64_t rows,
                          int64_t cols) {
  const __m512 va = _mm512_set1_ps(alpha);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t left = cols - 16 * h;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
      const __m512i bits = bf16_bits(_mm512_mul_ps(va, _mm512_load_ps(acc + i * kBlock + 16 * h)));
      _mm256_mask_storeu_epi16(c + i * ldc + 16 * h, m, _mm512_maskz_cvtepi32_epi16(0xffff, bits));
    }
  }
}

// c block [rows, cols] (<= 32 x 32) = alpha * acc + beta * c.
MT_AMX void write_block(const float* acc, float alpha, float beta, float* c, int64_t ldc,
                        int64_t rows, int64_t cols) {
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t left = cols - 16 * h;
      if (left <= 0) break;
      const __mmask16 m = left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
      float* dst = c + i * ldc + 16 * h;
      __m512 r = _mm512_mul_ps(va, _mm512_load_ps(acc + i * kBlock + 16 * h));
      if (beta != 0.f) r = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, dst), r);
      _mm512_mask_storeu_ps(dst, m, r);
    }
  }
}

// Packs rows [m0, m0 + block_rows) of op(a) (zero past m and k) into micro-kernel order, per
// group of 32 rows: tiles ([k step][tile of 16 rows][16][32], what the AMX tile loads read) or,
// with `passes`, passes ([pass of 8 rows][k step][8][32], dot_micro_kernel's order). Either way
// 8 consecutive rows of a step are 64 bytes apart.
void pack_a(bool ta, bool passes, const uint16_t* a, int64_t lda, int64_t m, int64_t k, int64_t m0,
            int64_t kb, int64_t block_rows, uint16_t* out) {
  const int64_t groups = block_rows / kBlock;
  std::memset(out, 0, size_t(groups * kb * 2 * kTileElems) * 2);
  auto at = [&](int64_t i, int64_t s) {  // packed row i (of the block), k step s
    const int64_t g = i / kBlock, r = i % kBlock;
    if (passes) return out + ((g * 4 + r / 8) * kb + s) * 8 * kTileK + (r % 8) * kTileK;
    return out + ((g * kb + s) * 2 + r / 16) * kTileElems + (r % 16) * kTileK;
  };
  const int64_t rows = std::min(block_rows, m - m0);
  if (!ta) {
    for (int64_t i = 0; i < rows; ++i) {
      const uint16_t* src = a + (m0 + i) * lda;
      for (int64_t s = 0; s < kb; ++s) {
        const int64_t len = std::min(kTileK, k - s * kTileK);
        std::memcpy(at(i, s), src + s * kTileK, size_t(len) * 2);
      }
    }
  } else {
    // a is [k, m]: walk it by rows (contiguous) and scatter into the packed rows, 8 at a time
    // (64 bytes apart in both orders).
    for (int64_t p = 0; p < k; ++p) {
      const uint16_t* src = a + p * lda + m0;
      const int64_t s = p / kTileK, col = p % kTileK;
      for (int64_t i0 = 0; i0 < rows; i0 += 8) {
        uint16_t* dst = at(i0, s) + col;
        const int64_t len = std::min<int64_t>(8, rows - i0);
        for (int64_t r = 0; r < len; ++r) dst[r * kTileK] = src[i0 + r];
      }
    }
  }
}

// r[i] word j -> r[j] word i: 32-bit interleaves, then 64-bit, then two rounds of 128-bit lanes.
MT_AMX inline void transpose_16x16_epi32(__m512i* r) {
  __m512i a[16], b[16];
  for (int i = 0; i < 8; ++i) {
    a[2 * i] = _mm512_maskz_unpacklo_epi32(0xffff, r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm512_maskz_unpackhi_epi32(0xffff, r[2 * i], r[2 * i + 1]);
  }
  // b[4 m + e], 128-bit lane L: word 4 L + e of rows 4 m .. 4 m + 3.
  for (int m = 0; m < 4; ++m) {
    b[4 * m] = _mm512_maskz_unpacklo_epi64(0xff, a[4 * m], a[4 * m + 2]);
    b[4 * m + 1] = _mm512_maskz_unpackhi_epi64(0xff, a[4 * m], a[4 * m + 2]);
    b[4 * m + 2] = _mm512_maskz_unpacklo_epi64(0xff, a[4 * m + 1], a[4 * m + 3]);
    b[4 * m + 3] = _mm512_maskz_unpackhi_epi64(0xff, a[4 * m + 1], a[4 * m + 3]);
  }
  // r[4 L + e] = lane L of b[e], b[4 + e], b[8 + e], b[12 + e].
  for (int e = 0; e < 4; ++e) {
    const __m512i u0 = _mm512_maskz_shuffle_i32x4(0xffff, b[e], b[4 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i u1 = _mm512_maskz_shuffle_i32x4(0xffff, b[e], b[4 + e], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i u2 =
        _mm512_maskz_shuffle_i32x4(0xffff, b[8 + e], b[12 + e], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i u3 =
        _mm512_maskz_shuffle_i32x4(0xffff, b[8 + e], b[12 + e], _MM_SHUFFLE(3, 2, 3, 2));
    r[e] = _mm512_maskz_shuffle_i32x4(0xffff, u0, u2, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + e] = _mm512_maskz_shuffle_i32x4(0xffff, u0, u2, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + e] = _mm512_maskz_shuffle_i32x4(0xffff, u1, u3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + e] = _mm512_maskz_shuffle_i32x4(0xffff, u1, u3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// The 32 weights of an int8 block (mt/q8.h: 32 int8 values, one f16 scale) as 32 bf16: each
// product value * scale rounded to bf16 as mt::f32_to_bf16 rounds (to nearest even; a NaN, from
// a NaN scale, stays a quiet NaN), so exactly the bits of dequantize-then-round.
MT_AMX inline __m512i q8_block_bf16(const int8_t* values, float scale) {
  const __m256i v8 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values));
  const __m512 s = _mm512_set1_ps(scale);
  __m512i half[2];  // bf16 bits in the low 16 of each 32-bit lane
  for (int h = 0; h < 2; ++h) {
    const __m128i v = h ? _mm256_extracti128_si256(v8, 1) : _mm256_castsi256_si128(v8);
    half[h] = bf16_bits(
        _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_cvtepi8_epi32(0xffff, v)), s));
  }
  // Word i of the result: the low word of lane i of half[0] (i < 16), else of half[1].
  alignas(64) static constexpr uint16_t kLow[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                                    22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
                                                    44, 46, 48, 50, 52, 54, 56, 58, 60, 62};
  return _mm512_permutex2var_epi16(half[0], _mm512_load_si512(kLow), half[1]);
}

// Packs k steps [s_begin, s_end) of the column panels [q_begin, q_end) of a [k, n] b (zero past n
// and k), panel q at out + (q - q_begin) stride, as pack_b_panel lays one out. A packed row is 16
// columns of rows p and p + 1 interleaved, i.e. the two rows widened to 32 bits with the second
// shifted into the upper half. Masked loads zero-fill. Each row of b is read across all the
// panels at once: panel by panel, rows ldb apart took one cache line each, on a page of their own
// for wide b, and the loads waited on memory (a third of a 128-row GEMM's time at Mixtral's
// shapes, where the 16-panel runs of 1 KiB stream).
MT_AMX void pack_b_rows(const uint16_t* b, int64_t ldb, int64_t n, int64_t k, int64_t q_begin,
                        int64_t q_end, int64_t s_begin, int64_t s_end, uint16_t* out,
                        int64_t stride) {
  for (int64_t s = s_begin; s < s_end; ++s) {
    for (int64_t pr = 0; pr < 16; ++pr) {
      const int64_t p = s * kTileK + 2 * pr;
      for (int64_t q = q_begin; q < q_end; ++q) {
        const int64_t n0 = q * kBlock, cols = std::min(kBlock, n - n0);
        for (int64_t t = 0; t < 2; ++t) {
          const int64_t left = cols - 16 * t;
          const __mmask16 m = left >= 16 ? __mmask16(0xffff)
                              : left > 0 ? __mmask16((1u << left) - 1u)
                                         : 0;
          const __mmask16 m0 = p < k ? m : 0, m1 = p + 1 < k ? m : 0;
          const uint16_t* r0 = m0 ? b + p * ldb + n0 + 16 * t : b;
          const uint16_t* r1 = m1 ? b + (p + 1) * ldb + n0 + 16 * t : b;
          const __m512i lo = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_maskz_loadu_epi16(m0, r0));
          const __m512i hi = _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_maskz_loadu_epi16(m1, r1));
          uint16_t* dst = out + (q - q_begin) * stride + ((s - s_begin) * 2 + t) * kTileElems;
          _mm512_storeu_si512(dst + pr * 32,
                              _mm512_or_si512(lo, _mm512_maskz_slli_epi32(0xffff, hi, 16)));
        }
      }
    }
  }
}

// Packs k steps [s_begin, s_end) of columns [32 q, 32 q + 32) of op(b) (zero past n and k):
// [k step][tile of 16 columns][16 k-pairs][16 columns][2], step s_begin first. With `q8` (and
// tb): b is int8 rows [n, q8_rb] (mt/q8.h; k a multiple of 32, so a k step is one block),
// dequantized and rounded to bf16 as they are loaded. pf_steps > 0: a bf16 [n, k] b's rows are
// prefetched that many steps ahead (packing a chunk at a time, the next chunk's; a panel's 32
// rows read 512 bytes each a chunk, too short for the hardware's prefetchers).
MT_AMX void pack_b_panel(bool tb, const uint16_t* b, int64_t ldb, const int8_t* q8, int64_t q8_rb,
                         int64_t n, int64_t k, int64_t q, int64_t s_begin, int64_t s_end,
                         int64_t pf_steps, uint16_t* out) {
  if (!tb) return pack_b_rows(b, ldb, n, k, q, q + 1, s_begin, s_end, out, 0);
  const int64_t n0 = q * kBlock, cols = std::min(kBlock, n - n0);
  // b is [n, k]: column j of op(b) is row j of b, whose k pairs are 32-bit words in a row. A
  // tile's 16 rows x 16 pairs is one 16 x 16 transpose of 32-bit words: the 16 rows' step
  // loaded (masked past k, zero past n), transposed in registers, stored as the tile's 16 pair
  // rows. (A scalar scatter of each bf16 cost 12% of a 512-row prefill GEMM against the [N, K]
  // weights decode keeps; the [K, N] path's packing 5%.)
  for (int64_t s = s_begin; s < s_end; ++s) {
    const int64_t left = k - s * kTileK;
    const __mmask32 km = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u);
    for (int64_t t = 0; t < 2; ++t) {
      __m512i r[16];
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t j = 16 * t + c;
        if (j >= cols) {
          r[c] = _mm512_setzero_si512();
        } else if (q8) {
          const int8_t* row = q8 + (n0 + j) * q8_rb;
          r[c] = q8_block_bf16(row + s * kTileK, q8_scale(row, k, s));
        } else {
          r[c] = _mm512_maskz_loadu_epi16(km, b + (n0 + j) * ldb + s * kTileK);
          if (pf_steps > 0 && (s + pf_steps) * kTileK < k)
            _mm_prefetch(
                reinterpret_cast<const char*>(b + (n0 + j) * ldb + (s + pf_steps) * kTileK),
                _MM_HINT_T0);
        }
      }
      transpose_16x16_epi32(r);
      uint16_t* dst = out + ((s - s_begin) * 2 + t) * kTileElems;
      for (int64_t pr = 0; pr < 16; ++pr) _mm512_storeu_si512(dst + pr * 32, r[pr]);
    }
  }
}

}  // namespace

bool amx_bf16_usable() {
  // Asked once per process; immutable afterwards. MT_CPU_AMX=0 keeps bf16 GEMMs on the f32 path
  // (for comparisons, or a machine where AMX misbehaves).
  static const bool kUsable = [] {
    if (!env_switch("MT_CPU_AMX", true,
                    "bf16 GEMMs stay off AMX tiles (0) or use them where the CPU has them (1)"))
      return false;
    return request_amx();
  }();
  return kUsable;
}

double amx_core_peak_flops() {
  static const double kPeak = amx_bf16_usable() ? measure_amx_peak() : 0.0;  // measured once
  return kPeak;
}

double best_on_every_thread(const std::function<double()>& one_core) {
  const unsigned n = std::clamp(std::thread::hardware_concurrency(), 1u, 256u);
  std::vector<double> best(n, 0.0);
  std::vector<std::thread> threads;
  // A thread the system refuses (ulimit -u, memory) leaves the measurement to those started
  // (throwing here would destroy joinable threads: std::terminate).
  try {
    for (unsigned i = 1; i < n; ++i) threads.emplace_back([&, i] { best[i] = one_core(); });
  } catch (const std::exception&) {
  }
  best[0] = one_core();
  for (auto& t : threads) t.join();
  return *std::max_element(best.begin(), best.end());
}

int bf16dot_choice() {
  return env_flag("MT_CPU_BF16DOT",
                  "bf16 GEMMs keep the f32 path (0) or take AVX512_BF16 dot products on any CPU "
                  "that has them (1)",
                  "dot products on AMD CPUs only");
}

bool dot_bf16_usable() {
  // Asked once per process; immutable afterwards. MT_CPU_BF16DOT=0 keeps bf16 GEMMs on the f32
  // path (for comparisons).
  static const bool kUsable = [] {
    if (bf16dot_choice() == 0) return false;
    return !amx_bf16_usable() && mt_cpu_supports("avx512f") && mt_cpu_supports("avx512bw") &&
           mt_cpu_supports("avx512vl") && mt_cpu_supports("avx512bf16");
  }();
  return kUsable;
}

double dot_core_peak_flops() {
  static const double kPeak = dot_bf16_usable() ? measure_dot_peak() : 0.0;  // measured once
  return kPeak;
}

namespace {
void gemm_bf16_packed(bool amx, Backend& be, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                      const int8_t* q8, int64_t q8_rb, float beta, float* c, uint16_t* c16,
                      int64_t ldc);
}  // namespace

void gemm_bf16(Backend& be, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               uint16_t* c16, int64_t ldc) {
  gemm_bf16_packed(amx_bf16_usable(), be, ta, tb, m, n, k, alpha, a, lda, b, ldb, nullptr, 0, beta,
                   c, c16, ldc);
}

void gemm_bf16_q8(Backend& be, int64_t m, int64_t n, int64_t k, const uint16_t* x, int64_t ldx,
                  const int8_t* w, int64_t rb, float* y, uint16_t* y16, int64_t ldy) {
  gemm_bf16_packed(amx_bf16_usable(), be, false, true, m, n, k, 1.f, x, ldx, nullptr, 0, w, rb, 0.f,
                   y, y16, ldy);
}

namespace {
// The loops of both: amx picks the tile micro-kernel (and the tile state), else vdpbf16ps.
void gemm_bf16_packed(bool amx, Backend& be, bool ta, bool tb, int64_t m, int64_t n, int64_t k,
                      float alpha, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb,
                      const int8_t* q8, int64_t q8_rb, float beta, float* c, uint16_t* c16,
                      int64_t ldc) {
  const int64_t kb = (k + kTileK - 1) / kTileK;
  const int64_t panels = (n + kBlock - 1) / kBlock;
  const int64_t panel_elems = kb * 2 * kTileElems;
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  // b packed once, up front, for all the row blocks of kRowBlock rows to share; or, with few rows
  // (an MoE expert's), all in one row block whose tasks pack kPanelGroup panels' chunk at a time
  // just before they multiply them: b then crosses memory once, where packing it up front wrote
  // and read it again.
  const bool pack_in_task = m <= kInTaskRows;
  const int64_t block_rows = pack_in_task ? (m + kBlock - 1) / kBlock * kBlock : kRowBlock;
  const int64_t row_blocks = (m + block_rows - 1) / block_rows;
  const int64_t block_elems = (block_rows / kBlock) * kb * 2 * kTileElems;
  // Tasks: a row block and a range of panels. On AMX with b packed up front, the ranges are
  // blocks of panels that fit half a core's L2 together, and the tasks go block by block: a
  // core's tasks then read a block of b from L2 for each row block after the first (as a whole,
  // 72 panels of K = 768 are 3.4 MiB, and b came from L3 for every row block: tile loads from L3
  // kept the tile multiplies at half their rate, from L2 at two thirds, on a Xeon with AMX of
  // 2026-11-30). Else (and where there are too few tasks for the threads) the panels are cut
  // evenly. (The vdpbf16ps kernel, measured on AMD CPUs only, keeps its whole-row tasks.)
  const bool blocked = amx && !pack_in_task;
  int64_t per_split = panels;
  if (blocked) per_split = std::clamp<int64_t>(l2_bytes() / 2 / (panel_elems * 2), 1, panels);
  int64_t splits = (panels + per_split - 1) / per_split;
  if (splits * row_blocks < 2 * threads) {
    splits = std::clamp<int64_t>((2 * threads + row_blocks - 1) / row_blocks, 1, panels);
    per_split = (panels + splits - 1) / splits;
    splits = (panels + per_split - 1) / per_split;
  }
  // Panels multiplied together (a task's packed chunks), and a chunk's elements; no larger than
  // the problem needs (a small model's scratch stays what it was).
  const int64_t group_panels = pack_in_task ? std::min(kPanelGroup, per_split) : 1;
  const int64_t chunk_elems = std::min(kStepsPerChunk, kb) * 2 * kTileElems;
  // Scratch: packed b (or a group's chunks per thread), then packed a: one block per thread of
  // the arena where tasks pack their own, else (blocked) all of a, packed up front (a row block
  // is read by the tasks of every block of panels); f32 sums of a row block for a group of panels
  // per thread.
  const int64_t b_elems =
      pack_in_task ? threads * group_panels * chunk_elems : panels * panel_elems;
  const int64_t a_blocks = blocked ? row_blocks : threads;
  Tensor scratch = be.empty({b_elems + a_blocks * block_elems}, DType::bf16);
  const int64_t acc_elems = group_panels * block_rows * kBlock;
  Tensor acc_scratch = be.empty({threads * acc_elems}, DType::f32);
  uint16_t* pb = scratch.ptr<uint16_t>();
  uint16_t* pa_all = pb + b_elems;

  if (!pack_in_task)
    tbb::parallel_for(int64_t{0}, panels, [&](int64_t q) {
      pack_b_panel(tb, b, ldb, q8, q8_rb, n, k, q, 0, kb, 0, pb + q * panel_elems);
    });
  if (blocked)
    tbb::parallel_for(int64_t{0}, row_blocks, [&](int64_t rb) {
      pack_a(ta, false, a, lda, m, k, rb * block_rows, kb, block_rows, pa_all + rb * block_elems);
    });

  // Task t: panel range t / row_blocks, row block t % row_blocks (a range's tasks consecutive).
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, row_blocks * splits, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        if (amx) configure_tiles();
        const int slot = std::max(0, tbb::this_task_arena::current_thread_index()) % threads;
        uint16_t* chunks = pb + slot * group_panels * chunk_elems;  // pack_in_task's
        float* acc = acc_scratch.ptr<float>() + slot * acc_elems;   // [panel][row][column]
        for (int64_t t = r.begin(); t < r.end(); ++t) {
          const int64_t rb = t % row_blocks, q0 = (t / row_blocks) * per_split;
          const int64_t q1 = std::min(panels, q0 + per_split);
          const int64_t m0 = rb * block_rows;
          uint16_t* pa = pa_all + (blocked ? rb : slot) * block_elems;
          if (!blocked) pack_a(ta, !amx, a, lda, m, k, m0, kb, block_rows, pa);
          const int64_t groups = std::min(block_rows, m - m0 + kBlock - 1) / kBlock;
          for (int64_t qg = q0; qg < q1; qg += group_panels) {
            const int64_t qn = std::min(group_panels, q1 - qg);
            // K in chunks of kStepsPerChunk steps: a panel's chunk of b (16 KiB) stays in L1
            // for the block's row groups, whose partial sums (16 KiB) stay there too.
            for (int64_t s0 = 0; s0 < kb; s0 += kStepsPerChunk) {
              const int64_t steps = std::min(kStepsPerChunk, kb - s0);
              if (pack_in_task) {
                if (tb)
                  for (int64_t j = 0; j < qn; ++j)
                    pack_b_panel(tb, b, ldb, q8, q8_rb, n, k, qg + j, s0, s0 + steps,
                                 kStepsPerChunk, chunks + j * chunk_elems);
                else
                  pack_b_rows(b, ldb, n, k, qg, qg + qn, s0, s0 + steps, chunks, chunk_elems);
              }
              for (int64_t j = 0; j < qn; ++j) {
                const int64_t q = qg + j;
                const uint16_t* gb = pack_in_task ? chunks + j * chunk_elems
                                                  : pb + q * panel_elems + s0 * 2 * kTileElems;
                // The next chunk (this panel's, else the next panel's first: they are
                // adjacent), prefetched by the groups in equal shares while they multiply this
                // one (chunks packed in the task come from the packing, in cache).
                const uint16_t* next = gb + steps * 2 * kTileElems;
                const bool more = !pack_in_task && (q + 1 < q1 || s0 + steps < kb);
                const int64_t pf_lines =
                    (steps * 2 * kTileElems * 2 / 64 + 4 * steps * groups - 1) /
                    (4 * steps * groups);
                for (int64_t g = 0; g < groups; ++g) {
                  float* gacc = acc + (j * block_rows + g * kBlock) * kBlock;
                  if (amx) {
                    micro_kernel(pa + (g * kb + s0) * 2 * kTileElems, gb, steps, s0 == 0, gacc);
                  } else {
                    const char* pf =
                        more ? reinterpret_cast<const char*>(next) + g * 4 * steps * pf_lines * 64
                             : nullptr;
                    dot_micro_kernel(pa + g * kb * 2 * kTileElems, kb, s0, gb, steps, s0 == 0, gacc,
                                     pf, pf_lines);
                  }
                }
              }
            }
            for (int64_t j = 0; j < qn; ++j) {
              const int64_t n0 = (qg + j) * kBlock;
              for (int64_t g = 0; g < groups; ++g) {
                const float* gacc = acc + (j * block_rows + g * kBlock) * kBlock;
                const int64_t i0 = m0 + g * kBlock;
                const int64_t rows = std::min(kBlock, m - i0), cols = std::min(kBlock, n - n0);
                if (c16)
                  write_block16(gacc, alpha, c16 + i0 * ldc + n0, ldc, rows, cols);
                else
                  write_block(gacc, alpha, beta, c + i0 * ldc + n0, ldc, rows, cols);
              }
            }
          }
        }
        // Hands the tile state back, so context switches of this thread stay cheap.
        if (amx) release_tiles();
      },
      tbb::simple_partitioner());
}

// One row of x against L weight rows (gemv_rows_bf16dot's streams): each row's sum as the one-row
// loop below makes it.
template <int L>
MT_BF16DOT void row_dots_bf16dot(const uint16_t* x, const uint16_t* const* rows, int64_t k,
                                 float* sums) {
  const int64_t k128 = k / 128 * 128;
  __m512 a[L][4];
#pragma GCC unroll 4
  for (int s = 0; s < L; ++s)
    for (int u = 0; u < 4; ++u) a[s][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k128; p += 128) {
#pragma GCC unroll 4
    for (int s = 0; s < L; ++s)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u)
        a[s][u] = _mm512_dpbf16_ps(a[s][u], MT_AS_BF16X32(_mm512_loadu_si512(x + p + 32 * u)),
                                   MT_AS_BF16X32(_mm512_loadu_si512(rows[s] + p + 32 * u)));
  }
  for (int64_t p = k128, u = 0; p < k; p += 32, ++u) {
    const int64_t left = k - p;
    const __mmask32 m = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u);
    const __m512bh xv = MT_AS_BF16X32(_mm512_maskz_loadu_epi16(m, x + p));
    for (int s = 0; s < L; ++s)
      a[s][u] =
          _mm512_dpbf16_ps(a[s][u], xv, MT_AS_BF16X32(_mm512_maskz_loadu_epi16(m, rows[s] + p)));
  }
  for (int s = 0; s < L; ++s) {
    alignas(64) float lanes[16];
    _mm512_store_ps(
        lanes, _mm512_add_ps(_mm512_add_ps(a[s][0], a[s][1]), _mm512_add_ps(a[s][2], a[s][3])));
    float t = 0.f;
    for (int l = 0; l < 16; ++l) t += lanes[l];
    sums[s] = t;
  }
}

// a[0..3] gain x . row over [0, k128) in steps of 128 (a[u] the step's u-th 32 elements); with
// Prefetch, each step also prefetches the row's four lines kMatvecPrefetchBytes bytes ahead into
// L2 (gemm.cpp's matvec_prefetch()).
template <bool Prefetch>
MT_BF16DOT void dot_steps_bf16dot(const uint16_t* x, const uint16_t* row, int64_t k128, __m512* a) {
  for (int64_t p = 0; p < k128; p += 128) {
    if constexpr (Prefetch) {
      const char* ahead = reinterpret_cast<const char*>(row + p) + kMatvecPrefetchBytes;
#pragma GCC unroll 4
      for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    }
#pragma GCC unroll 4
    for (int u = 0; u < 4; ++u)
      a[u] = _mm512_dpbf16_ps(a[u], MT_AS_BF16X32(_mm512_loadu_si512(x + p + 32 * u)),
                              MT_AS_BF16X32(_mm512_loadu_si512(row + p + 32 * u)));
  }
}

}  // namespace

MT_BF16DOT void gemv_rows_bf16dot(int64_t rows_m, const uint16_t* x, int64_t ldx, const uint16_t* w,
                                  int64_t k, int64_t ldw, int64_t j0, int64_t j1, float alpha,
                                  float beta, float* y, int64_t ldy, bool streams, bool prefetch) {
  if (streams && rows_m == 1) {
    constexpr int S = 4;
    const int64_t h = (j1 - j0 + S - 1) / S;
    for (int64_t i = 0; i < h; ++i) {
      int64_t js[S] = {};
      const int live = stream_rows(j0, j1, h, i, S, js);
      const uint16_t* rows[S] = {};
      for (int s = 0; s < live; ++s) rows[s] = w + js[s] * ldw;
      float sums[S];
      with_count<4>(live, [&](auto n) { row_dots_bf16dot<n()>(x, rows, k, sums); });
      for (int s = 0; s < live; ++s) {
        float& out = y[js[s]];
        out = beta == 0.f ? alpha * sums[s] : alpha * sums[s] + beta * out;
      }
    }
    return;
  }
  const int64_t k128 = k / 128 * 128;
  prefetch = prefetch && rows_m <= 2;
  for (int64_t j = j0; j < j1; ++j) {
    const uint16_t* row = w + j * ldw;
    for (int64_t r = 0; r < rows_m; ++r) {
      const uint16_t* xr = x + r * ldx;
      __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
      // The first row of x brings the weight row in (a second finds it in L1).
      if (prefetch && r == 0)
        dot_steps_bf16dot<true>(xr, row, k128, a);
      else
        dot_steps_bf16dot<false>(xr, row, k128, a);
      for (int64_t p = k128, u = 0; p < k; p += 32, ++u) {
        const int64_t left = k - p;
        const __mmask32 m = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u);
        a[u] = _mm512_dpbf16_ps(a[u], MT_AS_BF16X32(_mm512_maskz_loadu_epi16(m, xr + p)),
                                MT_AS_BF16X32(_mm512_maskz_loadu_epi16(m, row + p)));
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
      float s = 0.f;
      for (int l = 0; l < 16; ++l) s += lanes[l];
      float& out = y[r * ldy + j];
      out = beta == 0.f ? alpha * s : alpha * s + beta * out;
    }
  }
}

int64_t amx_packed_x_elems(int64_t rows_m, int64_t k) {
  return (k + kTileK - 1) / kTileK * kTileK * rows_m;
}

void pack_x_amx(int64_t rows_m, const uint16_t* x, int64_t ldx, int64_t k, uint16_t* out) {
  // Step s, pair row p, column r: x[r][s * 32 + 2p], x[r][s * 32 + 2p + 1] (zero past k).
  const int64_t steps = (k + kTileK - 1) / kTileK;
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t p = 0; p < kTileK / 2; ++p)
      for (int64_t r = 0; r < rows_m; ++r)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t at = s * kTileK + 2 * p + h;
          out[((s * (kTileK / 2) + p) * rows_m + r) * 2 + h] = at < k ? x[r * ldx + at] : 0;
        }
}

#if !defined(MT_EMULATE_X86)
namespace {
// Tiles for gemv_rows_amx: 0 the sums (`rows` weight rows x rows_m f32), 1 the weight rows'
// step (rows x 32 bf16), 2 x's step (16 k pairs x rows_m x 2 bf16).
MT_AMX void configure_rows_tiles(int64_t rows, int64_t rows_m) {
  TileConfig cfg;
  cfg.rows[0] = cfg.rows[1] = static_cast<uint8_t>(rows);
  cfg.colsb[0] = cfg.colsb[2] = static_cast<uint16_t>(4 * rows_m);
  cfg.colsb[1] = 64;
  cfg.rows[2] = 16;
  asm volatile("" : : "r"(&cfg) : "memory");  // as in configure_tiles
  _tile_loadconfig(&cfg);
}

// Rows [j, j + rows) of W (rows <= 16; the tiles configured for that many) against packed x
// over the whole of K, into y. With full steps only the weights come straight from their rows;
// a last partial step is copied beside zeros first (a tile load reads 64 bytes a row, past a
// row's end, possibly past the matrix's).
MT_AMX void rows_group_amx(int64_t rows_m, const uint16_t* xp, const uint16_t* w, int64_t k,
                           int64_t ldw, int64_t j, int64_t rows, float alpha, float beta, float* y,
                           int64_t ldy) {
  const int64_t full = k / kTileK, stride = ldw * 2;
  const char* base = reinterpret_cast<const char*>(w + j * ldw);
  const int64_t x_step = kTileK * rows_m;  // bf16 of packed x a step
  _tile_zero(0);
  for (int64_t s = 0; s < full; ++s) {
    const char* a = base + s * 64;
    for (int64_t r = 0; r < rows; ++r) _mm_prefetch(a + r * stride + kAmxRowsAhead, _MM_HINT_T0);
    _tile_loadd(2, xp + s * x_step, 4 * rows_m);
    _tile_loadd(1, a, stride);
    _tile_dpbf16ps(0, 1, 2);
  }
  if (full * kTileK < k) {
    alignas(64) uint16_t last[16 * kTileK] = {};
    const int64_t left = k - full * kTileK;
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(last + r * kTileK, w + (j + r) * ldw + full * kTileK, size_t(left) * 2);
    // GCC 12 sees neither tile loads read nor tile stores write a local array (as ldtilecfg's
    // struct in configure_tiles): without these it drops the copy and reads sums unwritten.
    asm volatile("" : : "r"(last) : "memory");
    _tile_loadd(2, xp + full * x_step, 4 * rows_m);
    _tile_loadd(1, last, 64);
    _tile_dpbf16ps(0, 1, 2);
  }
  alignas(64) float sums[16 * kFewRowsAmx];
  _tile_stored(0, sums, 4 * rows_m);
  asm volatile("" : : "r"(sums) : "memory");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < rows_m; ++i) {
      float& out = y[i * ldy + j + r];
      const float v = sums[r * rows_m + i];
      out = beta == 0.f ? alpha * v : alpha * v + beta * out;
    }
}
}  // namespace

MT_AMX void gemv_rows_amx(int64_t rows_m, const uint16_t* xp, const uint16_t* w, int64_t k,
                          int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                          int64_t ldy) {
  const int64_t whole = j0 + (j1 - j0) / 16 * 16;
  if (whole > j0) {
    configure_rows_tiles(16, rows_m);
    for (int64_t j = j0; j < whole; j += 16)
      rows_group_amx(rows_m, xp, w, k, ldw, j, 16, alpha, beta, y, ldy);
  }
  if (whole < j1) {
    configure_rows_tiles(j1 - whole, rows_m);
    rows_group_amx(rows_m, xp, w, k, ldw, whole, j1 - whole, alpha, beta, y, ldy);
  }
  release_tiles();
}
#else
void gemv_rows_amx(int64_t, const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, int64_t,
                   float, float, float*, int64_t) {
  std::abort();  // never called: request_amx() says no AMX under emulation
}
#endif

bool amx_int8_usable() {
  static const bool kUsable = amx_bf16_usable() && mt_cpu_has_amx_int8();
  return kUsable;
}

int64_t amx_q8_cols(int64_t rows) {
  int64_t c = 1;
  while (c < rows) c *= 2;
  return c;
}

int64_t amx_q8_packed_bytes(int64_t cols, int64_t k) {
  return (k / kQ8Block + 1) / 2 * 2 * kQ8Block * 2 * cols;
}

// Zeros first, then each block's 4-byte groups of each row copied to where the layout puts them
// (the zero columns and the other block's half stay zero): a few thousand copies. Writing every
// byte of the tiles through the layout's divisions took 30-250 us a call at K = 768-5632 and 8
// rows, as long as the K = 768 product itself.
void pack_xq_amx(int64_t rows, int64_t cols, const int8_t* const* xq, int64_t k, int8_t* xp,
                 float* sx) {
  const int64_t blocks = k / kQ8Block, width = 2 * cols;
  std::memset(xp, 0, static_cast<size_t>(amx_q8_packed_bytes(cols, k)));
  std::memset(sx, 0, static_cast<size_t>((blocks + 1) / 2 * 16) * sizeof(float));
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t half = b % 2;  // block b is the pair's first (0) or second (1)
    int8_t* tile = xp + b / 2 * 16 * 4 * width;
    float* scales = sx + b / 2 * 16;
    for (int64_t col = 0; col < rows; ++col) {
      const int8_t* values = xq[col] + b * kQ8Block;
      for (int64_t g = 0; g < 8; ++g)  // tile row half * 8 + g, column half * cols + col
        std::memcpy(tile + ((half * 8 + g) * width + half * cols + col) * 4, values + g * 4, 4);
      for (int64_t e = half * cols + col; e < 16; e += width)
        std::memcpy(scales + e, xq[col] + k + b * 4, 4);
    }
  }
}

#if !defined(MT_EMULATE_X86)
#define MT_AMX_INT8 \
  MT_TARGET("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")

namespace {
// Tiles for gemv_q8_amx, two sets (pairs of blocks in flight): 0 and 3 a pair's sums (`rows`
// weight rows x 2 cols int32), 1 and 4 the weight rows' pair of blocks (rows x 64 int8), 2 and 5
// x's pair (16 groups of 4 k x 2 cols x 4 int8, pack_xq_amx).
MT_AMX_INT8 void configure_q8_tiles(int64_t rows, int64_t cols) {
  TileConfig cfg;
  for (int set = 0; set < 2; ++set) {
    cfg.rows[3 * set] = cfg.rows[3 * set + 1] = static_cast<uint8_t>(rows);
    cfg.colsb[3 * set] = cfg.colsb[3 * set + 2] = static_cast<uint16_t>(8 * cols);
    cfg.colsb[3 * set + 1] = 64;
    cfg.rows[3 * set + 2] = 16;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // as in configure_tiles
  _tile_loadconfig(&cfg);
}

// Rows [j, j + rows) of W (rows <= 16, the tiles configured for that many) against packed x. A
// pair's tile sums are stored as [rows][2][Cols] int32 (block 2 p's columns, then 2 p + 1's),
// i.e. 2 Cols vectors of 16: element e of vector v is weight row (16 v + e) / (2 Cols), block
// parity (16 v + e) % (2 Cols) / Cols, column (16 v + e) % Cols. They accumulate into slot p % 8
// (t_(b % 16) of both blocks b). The scales: the 16 weight rows' f16 scales of the pair (one
// gather of 4 bytes a row), spread by a permutation, times sx's 16 floats.
template <int Cols>
MT_AMX_INT8 void q8_group_amx(int64_t nx, const int8_t* xp, const float* sx, const int8_t* w,
                              int64_t rb, int64_t k, int64_t j, int64_t rows, float* y, int64_t ldy,
                              const int64_t* y_rows) {
  constexpr int kVecs = 2 * Cols;
  const int64_t blocks = k / kQ8Block, full = blocks / 2, pairs = (blocks + 1) / 2;
  const int8_t* base = w + j * rb;
  const __mmask16 live = rows >= 16 ? __mmask16(0xffff) : __mmask16((1u << rows) - 1u);
  // Weight row n's scales at n * rb + k: the offsets of the 16 rows (those past `rows` masked).
  const __m512i row_at = _mm512_maskz_mullo_epi32(
      0xffff, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(static_cast<int>(rb)));
  // Vector v's (parity, weight row) per element: an index into [even 16, odd 16].
  alignas(64) static constexpr auto kSpread = [] {
    std::array<int32_t, 16 * kVecs> at{};
    for (int i = 0; i < 16 * kVecs; ++i) at[i] = i % kVecs / Cols * 16 + i / kVecs;
    return at;
  }();
  // The accumulators of pairs p % 8: slot p % 8 holds t_(b % 16) of blocks b = 2 p, 2 p + 1.
  alignas(64) float acc[8][16 * kVecs] = {};
  alignas(64) int32_t sums[2][16 * kVecs];
  if (rows < 16) std::memset(sums, 0, sizeof sums);  // the rows past `rows` are never stored
  // An odd last block: its 16 rows' 32 values beside 32 zeros (a tile load reads 64 bytes a row,
  // past the row's values, possibly past the matrix).
  alignas(64) int8_t last[16 * 64];
  if (full < pairs) {
    std::memset(last, 0, sizeof last);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(last + r * 64, base + r * rb + full * 2 * kQ8Block, kQ8Block);
    asm volatile("" : : "r"(last) : "memory");  // as in rows_group_amx
  }
  for (int64_t r = 0; r < rows; ++r) _mm_prefetch(base + r * rb + k, _MM_HINT_T0);
  // Pair p's tile sums (stored at s) into slot p % 8.
  auto accumulate = [&](int64_t p, const int32_t* s) MT_AMX_INT8 {
    // Blocks 2 p and 2 p + 1's scales: one gather of 4 bytes a row (an odd last block from
    // the 2 bytes before its scale: the 2 after it may be past the matrix).
    const bool pair = p < full;
    const __m512i g = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, row_at,
                                                  base + k + 4 * p - (pair ? 0 : 2), 1);
    const __m512 hi = _mm512_maskz_cvtph_ps(
        0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, _mm512_maskz_srli_epi32(0xffff, g, 16)));
    const __m512 even =
        pair ? _mm512_maskz_cvtph_ps(0xffff, _mm512_maskz_cvtepi32_epi16(0xffff, g)) : hi;
    const __m512 odd = pair ? hi : _mm512_setzero_ps();
    const __m512 sxp = _mm512_loadu_ps(sx + p * 16);
    float* slot = acc[p % 8];
    for (int v = 0; v < kVecs; ++v) {
      const __m512i at = _mm512_load_si512(kSpread.data() + 16 * v);
      const __m512 sc = _mm512_mul_ps(_mm512_permutex2var_ps(even, at, odd), sxp);
      const __m512 prod = _mm512_maskz_cvtepi32_ps(0xffff, _mm512_load_si512(s + 16 * v));
      _mm512_store_ps(slot + 16 * v, _mm512_fmadd_ps(sc, prod, _mm512_load_ps(slot + 16 * v)));
    }
  };
  const int64_t stride_x = 16 * 8 * Cols;  // packed x bytes a pair
  int64_t p = 0;
  for (; p + 2 <= full; p += 2) {
    const char* a = reinterpret_cast<const char*>(base + p * 2 * kQ8Block);
    for (int64_t r = 0; r < rows; ++r) {
      _mm_prefetch(a + r * rb + kQ8TilesAhead, _MM_HINT_T0);
      _mm_prefetch(a + r * rb + kQ8TilesAhead + 64, _MM_HINT_T0);
    }
    if (p % 16 == 0 && 2 * p + 64 < blocks)
      for (int64_t r = 0; r < rows; ++r)
        _mm_prefetch(base + r * rb + k + (2 * p + 64) * 2, _MM_HINT_T0);
    _tile_zero(0);
    _tile_zero(3);
    _tile_loadd(1, a, rb);
    _tile_loadd(2, xp + p * stride_x, 8 * Cols);
    _tile_loadd(4, a + 64, rb);
    _tile_loadd(5, xp + (p + 1) * stride_x, 8 * Cols);
    _tile_dpbssd(0, 1, 2);
    _tile_dpbssd(3, 4, 5);
    _tile_stored(0, sums[0], 8 * Cols);
    _tile_stored(3, sums[1], 8 * Cols);
    asm volatile("" : : "r"(sums) : "memory");  // as in rows_group_amx
    accumulate(p, sums[0]);
    accumulate(p + 1, sums[1]);
  }
  for (; p < pairs; ++p) {  // one pair left, or the odd last block
    _tile_zero(0);
    if (p < full)
      _tile_loadd(1, base + p * 2 * kQ8Block, rb);
    else
      _tile_loadd(1, last, 64);
    _tile_loadd(2, xp + p * stride_x, 8 * Cols);
    _tile_dpbssd(0, 1, 2);
    _tile_stored(0, sums[0], 8 * Cols);
    asm volatile("" : : "r"(sums) : "memory");
    accumulate(p, sums[0]);
  }
  // t_l is slot l / 2 at parity l % 2, so slots s and s + 4 hold u_(2 s) and u_(2 s + 1) side by
  // side: ((u0 + u4) + (u2 + u6)) + ((u1 + u5) + (u3 + u7)) is, per (row, parity, column),
  // ((U0 + U2) + (U1 + U3)) with U_s = slot s + slot s + 4, then the two parities added.
  alignas(64) float w_sum[16 * kVecs];
  for (int v = 0; v < kVecs; ++v) {
    __m512 u[4];
    for (int s4 = 0; s4 < 4; ++s4)
      u[s4] = _mm512_add_ps(_mm512_load_ps(acc[s4] + 16 * v), _mm512_load_ps(acc[s4 + 4] + 16 * v));
    _mm512_store_ps(w_sum + 16 * v,
                    _mm512_add_ps(_mm512_add_ps(u[0], u[2]), _mm512_add_ps(u[1], u[3])));
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < nx; ++i)
      y[y_rows[i] * ldy + j + r] = w_sum[r * kVecs + i] + w_sum[r * kVecs + Cols + i];
}
}  // namespace

// One quantized row of x against S weight rows, each read in order (the vector kernels' streams),
// to gemv_q8_amx's bits on AVX-512 VNNI: one row on tiles, 16 weight rows at a time, read ~0.8x
// as fast (16 rows interleaved 64 bytes at a time, as was a vector kernel reading them so). Per
// group of 16 blocks and weight row, vpdpbusd's lanes of its 8 pairs (|w| and x * sign(w)),
// reduced to the 16 block sums (exact in int32, in any order), then t = fma(scale_w * scale_x,
// sum, t) with block b in lane b % 16, and the lanes as gemv_q8_amx sums them.
template <int S>
MT_AMX_INT8 void dot_q8_blocks16(const int8_t* xq, const int8_t* const* rows, int64_t k,
                                 float* out) {
  const int64_t blocks = k / kQ8Block;
  // After the reduction lane 4 q + e holds block 4 e + q of the group: back to block order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512 t[S];
  for (int s = 0; s < S; ++s) t[s] = _mm512_setzero_ps();
  for (int64_t g = 0; g < blocks; g += 16) {
    const int64_t nb = std::min<int64_t>(16, blocks - g), np = (nb + 1) / 2;
    const __mmask16 bm = nb == 16 ? __mmask16(0xffff) : __mmask16((1u << nb) - 1u);
    const __m512 sx = _mm512_maskz_loadu_ps(bm, xq + k + g * 4);
    __mmask64 pm[8];  // the bytes of pair p that are blocks of the row
    __m512i xv[8];
    for (int p = 0; p < 8; ++p) {
      const int64_t left = (nb - 2 * p) * kQ8Block;
      pm[p] = left >= 64 ? ~__mmask64{0} : left > 0 ? __mmask64{0xffffffff} : __mmask64{0};
      xv[p] = _mm512_maskz_loadu_epi8(pm[p], xq + g * kQ8Block + p * 64);
    }
    for (int s = 0; s < S; ++s) {
      const int8_t* at = rows[s] + g * kQ8Block;
      _mm_prefetch(at + kQ8Prefetch16, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 64, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 128, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 192, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 256, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 320, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 384, _MM_HINT_T0);
      _mm_prefetch(at + kQ8Prefetch16 + 448, _MM_HINT_T0);
      __m512i lanes[8];
      for (int p = 0; p < 8; ++p) {
        if (p >= np) {
          lanes[p] = _mm512_setzero_si512();
          continue;
        }
        const __m512i wv = nb == 16 ? _mm512_loadu_si512(at + p * 64)
                                    : _mm512_maskz_loadu_epi8(pm[p], at + p * 64);
        const __m512i aw = _mm512_maskz_abs_epi8(~__mmask64{0}, wv);
        const __m512i sxv =
            _mm512_mask_sub_epi8(xv[p], _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv[p]);
        lanes[p] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sxv);
      }
      // Pairs 2 i and 2 i + 1: quads (2i even, 2i odd, 2i+1 even, 2i+1 odd), 4 partial lanes each.
      __m512i v[4];
      for (int i = 0; i < 4; ++i)
        v[i] = _mm512_add_epi32(
            _mm512_maskz_shuffle_i32x4(0xffff, lanes[2 * i], lanes[2 * i + 1], 0x88),
            _mm512_maskz_shuffle_i32x4(0xffff, lanes[2 * i], lanes[2 * i + 1], 0xdd));
      __m512i h[2];  // per quad: (a0 + a2, a1 + a3, b0 + b2, b1 + b3) of v[2 i], v[2 i + 1]
      for (int i = 0; i < 2; ++i)
        h[i] = _mm512_add_epi32(_mm512_maskz_unpacklo_epi64(0xff, v[2 * i], v[2 * i + 1]),
                                _mm512_maskz_unpackhi_epi64(0xff, v[2 * i], v[2 * i + 1]));
      const __m512 a = _mm512_castsi512_ps(h[0]), b = _mm512_castsi512_ps(h[1]);
      const __m512i sums = _mm512_add_epi32(
          _mm512_castps_si512(_mm512_maskz_shuffle_ps(0xffff, a, b, _MM_SHUFFLE(2, 0, 2, 0))),
          _mm512_castps_si512(_mm512_maskz_shuffle_ps(0xffff, a, b, _MM_SHUFFLE(3, 1, 3, 1))));
      const __m512 sw =
          _mm512_maskz_cvtph_ps(0xffff, _mm256_maskz_loadu_epi16(bm, rows[s] + k + g * 2));
      t[s] = _mm512_fmadd_ps(
          _mm512_mul_ps(sw, sx),
          _mm512_maskz_cvtepi32_ps(0xffff, _mm512_maskz_permutexvar_epi32(0xffff, order, sums)),
          t[s]);
    }
  }
  for (int s = 0; s < S; ++s) {
    // u_i = t_i + t_(i + 8), q_i = u_i + u_(i + 4), then (q0 + q2) + (q1 + q3).
    const __m256 u = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, t[s], 0),
                                   _mm512_maskz_extractf32x8_ps(0xff, t[s], 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    const __m128 r = _mm_add_ps(q, _mm_movehl_ps(q, q));  // (q0 + q2, q1 + q3)
    out[s] = _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
  }
}

MT_AMX_INT8 void gemv_q8_blocks16_streams(const int8_t* xq, const int8_t* w, int64_t rb, int64_t k,
                                          int64_t j0, int64_t j1, float* y) {
  q8_stream_rows<4>(w, rb, j0, j1, y, [&](auto n, const int8_t* const* rows, float* sums) {
    dot_q8_blocks16<n()>(xq, rows, k, sums);
  });
}

MT_AMX_INT8 void gemv_q8_amx(int64_t rows, int64_t cols, const int8_t* xp, const float* sx,
                             const int8_t* w, int64_t rb, int64_t k, int64_t j0, int64_t j1,
                             float* y, int64_t ldy, const int64_t* y_rows) {
  auto group = [&](int64_t j, int64_t n) {
    switch (cols) {
      case 1:
        return q8_group_amx<1>(rows, xp, sx, w, rb, k, j, n, y, ldy, y_rows);
      case 2:
        return q8_group_amx<2>(rows, xp, sx, w, rb, k, j, n, y, ldy, y_rows);
      case 4:
        return q8_group_amx<4>(rows, xp, sx, w, rb, k, j, n, y, ldy, y_rows);
      default:
        return q8_group_amx<8>(rows, xp, sx, w, rb, k, j, n, y, ldy, y_rows);
    }
  };
  const int64_t whole = j0 + (j1 - j0) / 16 * 16;
  if (whole > j0) {
    configure_q8_tiles(16, cols);
    for (int64_t j = j0; j < whole; j += 16) group(j, 16);
  }
  if (whole < j1) {
    configure_q8_tiles(j1 - whole, cols);
    group(whole, j1 - whole);
  }
  release_tiles();
}
#undef MT_AMX_INT8
#else
void gemv_q8_amx(int64_t, int64_t, const int8_t*, const float*, const int8_t*, int64_t, int64_t,
                 int64_t, int64_t, float*, int64_t, const int64_t*) {
  std::abort();  // never called: request_amx() says no AMX under emulation
}
void gemv_q8_blocks16_streams(const int8_t*, const int8_t*, int64_t, int64_t, int64_t, int64_t,
                              float*) {
  std::abort();
}
#endif

}  // namespace mt::cpu
