// bf16 x bf16 -> f32 GEMM on AMX tiles (Sapphire Rapids and later), used by gemm.cpp when the CPU
// has AMX-BF16 and the kernel grants this process the tile state. Products of two bf16 values are
// exact in f32 and the tiles accumulate in f32, so this is the f32 arithmetic the op set asks for
// on bf16-stored operands, at several times the f32 FMA rate.
#pragma once

#include <cstdint>
#include <functional>
#include <type_traits>

#include "mt/backend.h"

namespace mt::cpu {

// True when AMX-BF16 is usable by this process (checked and requested once; MT_CPU_AMX=0 in the
// environment says no).
bool amx_bf16_usable();
// Measured tile-multiply FLOP/s of one core (0 without AMX), for the bf16 peak.
double amx_core_peak_flops();

// AVX512_BF16's vdpbf16ps, for CPUs without AMX (AMD Zen 4, Intel Cooper Lake): exact bf16
// products, f32 sums, at about twice the f32 FMA rate on Zen 4. Usable when the CPU has it, AMX
// is not usable and MT_CPU_BF16DOT is not 0 (checked once).
bool dot_bf16_usable();
// MT_CPU_BF16DOT: -1 unset (AMD CPUs take the dot products for bf16 GEMMs, others the f32 path),
// 0 never, 1 on any CPU that has the instruction; any other value is refused.
int bf16dot_choice();
// The largest of `one_core`'s results with it running on every hardware thread at once: a
// core's peak at the clock all cores sustain together (the f32 FMA peak and the dot product's).
double best_on_every_thread(const std::function<double()>& one_core);
// Measured vdpbf16ps FLOP/s of one core at the all-core clock (0 when not usable).
double dot_core_peak_flops();

// c = alpha * op(a) op(b) + beta * c for one row-major matrix: a [m, k] ([k, m] if ta), b [k, n]
// ([n, k] if tb), bf16 (raw bits), on AMX tiles where usable, else on vdpbf16ps (callers check
// that one is). c f32 in `c`, or, with c null and beta 0, bf16 in `c16`: each f32 result
// rounded as mt::f32_to_bf16 rounds it, the bits of the f32 c and a conversion. Leading
// dimension ldc; m, n, k >= 1. Runs on the current oneTBB arena; scratch comes from `be`'s
// caching allocator.
void gemm_bf16(Backend& be, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
               const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float beta, float* c,
               uint16_t* c16, int64_t ldc);

// y [m, n] (leading dimension ldy; f32 in y, or bf16 in y16 when y is null, rounded as above) =
// x [m, k] (bf16, ldx) . W^T for int8 weights W as mt/q8.h stores them (rows [n, rb], k a
// multiple of 32): the bf16 GEMM above, W's blocks dequantized and rounded to bf16 as they are
// packed, so the same bits as multiplying by the rounded dequantized weights, without them.
void gemm_bf16_q8(Backend& be, int64_t m, int64_t n, int64_t k, const uint16_t* x, int64_t ldx,
                  const int8_t* w, int64_t rb, float* y, uint16_t* y16, int64_t ldy);

// How far ahead (bytes) the one-stream matrix-vector kernels prefetch a weight row into L2 where
// gemm.cpp's matvec_prefetch() says so (gemm.cpp's f32 and widened-bf16 rows kernels, and
// gemv_rows_bf16dot below): tuned on a 2-core Zen 4 with 2048 x 5632 weights.
constexpr int64_t kMatvecPrefetchBytes = 1024;

// The i-th step of reading rows [j0, j1) as `streams` sequential streams of h rows each (h =
// ceil((j1 - j0) / streams)): rows j0 + s h + i that exist, into js; their count.
inline int stream_rows(int64_t j0, int64_t j1, int64_t h, int64_t i, int streams, int64_t* js) {
  int live = 0;
  for (int s = 0; s < streams; ++s)
    if (const int64_t j = j0 + s * h + i; j < j1) js[live++] = j;
  return live;
}

// f(std::integral_constant<int, n>) for n in [1, Most] (a kernel templated on its row count;
// n above Most runs as Most, below 1 as 1).
template <int Most, class F>
void with_count(int64_t n, const F& f) {
  if constexpr (Most > 1) {
    if (n >= Most) return f(std::integral_constant<int, Most>{});
    return with_count<Most - 1>(n, f);
  } else {
    return f(std::integral_constant<int, 1>{});
  }
}

// Rows [j0, j1) of int8 weight rows w (stride rb) against one row of x as `Streams` sequential
// streams (stream_rows): dot(count, rows, sums) for each step's live rows (count a
// std::integral_constant, as with_count gives it), sums[s] into y[row].
template <int Streams, class Dot>
void q8_stream_rows(const int8_t* w, int64_t rb, int64_t j0, int64_t j1, float* y, const Dot& dot) {
  const int64_t h = (j1 - j0 + Streams - 1) / Streams;
  for (int64_t i = 0; i < h; ++i) {
    int64_t js[Streams];
    const int live = stream_rows(j0, j1, h, i, Streams, js);
    const int8_t* rows[Streams] = {};
    for (int s = 0; s < live; ++s) rows[s] = w + js[s] * rb;
    float sums[Streams];
    with_count<Streams>(live, [&](auto n) { dot(n, rows, sums); });
    for (int s = 0; s < live; ++s) y[js[s]] = sums[s];
  }
}

// Dot products of rows_m rows of bf16 x (x + r ldx) with rows [j0, j1) of bf16 W [N, K] (w + j
// ldw) on vdpbf16ps, one weight row at a time (one sequential stream per task, as the f32
// "rows" kernels): y[r ldy + j] = alpha dot + beta y (beta 0: y not read). Each output sums in
// one order whatever rows_m: four accumulators over consecutive 32-element steps, masked tail,
// then (a0 + a1) + (a2 + a3) and the lanes. Callers check dot_bf16_usable(). With `streams`
// and one row of x, four weight rows far apart at once (four sequential streams per task, as
// gemm.cpp's matvec_streams()), each row's sum in the same order. Without `streams`, with
// `prefetch` and one or two rows of x, each step prefetches the row's lines kMatvecPrefetchBytes
// ahead into L2 (gemm.cpp's matvec_prefetch()).
void gemv_rows_bf16dot(int64_t rows_m, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k,
                       int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                       int64_t ldy, bool streams, bool prefetch);

// Few rows of bf16 x against bf16 weight rows [N, K] on AMX tiles (decode's transposed
// projections, a batch of up to 8 sequences): 16 weight rows at a time are one A tile loaded
// straight from the rows (no packing of the weights: 16 sequential streams a task), against x
// packed once per product as one B tile a step of 32 k. Each output is one tile accumulation over
// K in steps of 32 (the last zero-padded), in the order the hardware gives each tile element,
// which depends neither on rows_m nor on the weight row's place in the tile: a row of x gets the
// same bits alone as in a batch.
// x's packing: rows_m (1..16) rows of x [rows_m, k] (ldx) -> out, amx_packed_x_elems() bf16:
// step s, k pair p, row r at ((s * 16 + p) * rows_m + r) * 2.
int64_t amx_packed_x_elems(int64_t rows_m, int64_t k);
void pack_x_amx(int64_t rows_m, const uint16_t* x, int64_t ldx, int64_t k, uint16_t* out);
// y[r ldy + j] = alpha dot(x_r, w_j) + beta y (beta 0: y not read) for j in [j0, j1), xp as
// pack_x_amx packed it. Callers check amx_bf16_usable(); uses and releases this thread's tiles.
void gemv_rows_amx(int64_t rows_m, const uint16_t* xp, const uint16_t* w, int64_t k, int64_t ldw,
                   int64_t j0, int64_t j1, float alpha, float beta, float* y, int64_t ldy);

// True when AMX-INT8 is usable too: amx_bf16_usable() and the CPU has AMX-INT8 (checked once).
bool amx_int8_usable();

// Decode's int8 products on AMX-INT8 tiles: up to 8 quantized rows of x (gemm.cpp's q8x rows: K
// int8 values, then K / 32 f32 scales) against int8 weight rows (mt/q8.h: [N, rb]). Per block b
// of 32 and output, the block's 32 products summed exactly in int32 (vpdpbssd's arithmetic: an A
// tile is 16 weight rows x two blocks, loaded straight from the rows, against x's two blocks in
// separate columns of B), then t_(b % 16) = fma(scale_w * scale_x, float(sum), t_(b % 16)) over
// the blocks in order, all 16 from 0; the output is u_l = t_l + t_(l + 8) (l < 8), then
// ((u0 + u4) + (u2 + u6)) + ((u1 + u5) + (u3 + u7)). Each output is those operations whatever
// the other rows are, and gemv_q8_blocks16_streams computes them for one row: a row of x gets the
// same bits alone as in a batch.
//
// x's packing: `cols` (1, 2, 4 or 8) columns, the first `rows` of them x's quantized rows
// xq[0..rows) and the rest zero; per pair of blocks p (the last possibly one block beside zeros),
// a B tile of 16 rows (row r: 4 consecutive k of group r % 8 of block 2 p + r / 8) x 2 cols
// columns (block 2 p's cols, then 2 p + 1's: zero where the row is the other block's) x 4 bytes,
// at p * 128 * cols into xp (amx_q8_packed_bytes() in all), and 16 floats at p * 16 into sx
// (element e: column e % cols's scale of block 2 p + e % (2 cols) / cols, 0 for a zero column).
int64_t amx_q8_cols(int64_t rows);  // the least of 1, 2, 4, 8 that is >= rows (rows <= 8)
int64_t amx_q8_packed_bytes(int64_t cols, int64_t k);
void pack_xq_amx(int64_t rows, int64_t cols, const int8_t* const* xq, int64_t k, int8_t* xp,
                 float* sx);
// y[y_rows[i] * ldy + j] for i < rows and j in [j0, j1): column i of packed x against weight row
// j. Callers check amx_int8_usable(); uses and releases this thread's tiles.
void gemv_q8_amx(int64_t rows, int64_t cols, const int8_t* xp, const float* sx, const int8_t* w,
                 int64_t rb, int64_t k, int64_t j0, int64_t j1, float* y, int64_t ldy,
                 const int64_t* y_rows);
// One quantized row of x (xq) against weight rows [j0, j1) into y[j], gemv_q8_amx's bits on
// AVX-512 VNNI, four sequential weight streams (tiles read 16 rows interleaved: ~0.8x as fast
// for one row). Callers check amx_int8_usable().
void gemv_q8_blocks16_streams(const int8_t* xq, const int8_t* w, int64_t rb, int64_t k, int64_t j0,
                              int64_t j1, float* y);

}  // namespace mt::cpu
