// gemm: matmul for f32 and bf16 tensors, the GEMM path's start-up and its FLOP/s peak.
//
// Paths (measured on the 2-core AVX-512 Xeon this project targets; numbers in the report that
// came with this file):
// - f32: OpenBLAS's SGEMM with its SkylakeX kernels, called single-threaded from oneTBB tasks that
//   tile each GEMM (and the batch) over the backend's threads. oneDNN's f32 GEMMs measured slower
//   than OpenBLAS's SkylakeX kernels here, and would bring an OpenMP pool beside oneTBB.
// - OpenBLAS is not linked: the plugin dlopen()s libopenblas.so.0 in gemm_setup. OpenBLAS reads
//   OPENBLAS_CORETYPE in its library constructor, so loading it ourselves is the only way to pick
//   its kernels before it initialises (Debian's DYNAMIC_ARCH build mistakes some AVX-512 Xeons for
//   Prescott, 5x slower). A coretype the environment already sets is respected.
// - OpenBLAS runs with one thread; oneTBB owns every core. Each GEMM is cut into as many tiles as
//   there are threads (along M or N) unless the batch already gives every thread work, so OpenBLAS
//   threads and oneTBB workers never compete, and a matmul called from inside a parallel kernel
//   (the MoE grouped matmul) nests without oversubscription.
// - bf16 x bf16: AMX tiles where the CPU and kernel allow them (gemm_amx.cpp), several times the
//   f32 rate; else AVX512_BF16's vdpbf16ps on the same packed tiles where the CPU has it (on the
//   2-core AMD EPYC, Zen 4, of 2026-11-26: 380-400 GFLOP/s against the SGEMM's 190 at llama-bench-m
//   shapes, 320-340 for the weight gradients; on the Xeon this file was first measured on the
//   instruction ran at half the FMA rate instead: MT_CPU_BF16DOT=0 turns it off). Any other bf16
//   operand is widened to f32 in a scratch tensor from the backend's caching allocator and takes
//   the SGEMM.
// - M = 1 (decode) is memory-bound: own AVX-512 and AVX2 matrix-vector kernels read f32 or bf16
//   weights directly (bf16 widened in registers: half the bytes, f32 products). On AVX2 one row
//   of x reads three weight rows of its range at once (two rows of x two; int8 rows four):
//   several sequential streams per core, where one left memory idle (gemv_row_streams_avx2).
//
// Determinism: the tiling depends only on the shapes and the arena's thread count, and each output
// element is produced by one single-threaded call, so results are bitwise reproducible.
#include <cblas.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <sys/resource.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels/gemm_amx.h"
#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "kernels/x86_simd.h"
#include "mt/env.h"
#include "mt/error.h"
#include "mt/q8.h"

namespace mt::cpu {
namespace {

// ---- the CPU's instruction sets -------------------------------------------------------------

struct Isa {
  bool avx2_fma = false;  // with F16C
  bool avx512 = false;  // F + BW + DQ + VL: what OpenBLAS's SkylakeX kernels and ours use
  bool avx512_bf16 = false;
  bool amx_bf16 = false;
  bool avx512_vnni = false;  // int8 dot products (vpdpbusd) at 256 bits (with VL)

  static Isa detect() {
    __builtin_cpu_init();
    Isa isa;
    isa.avx2_fma = mt_cpu_supports("avx2") && mt_cpu_supports("fma") && mt_cpu_has_f16c();
    isa.avx512 = mt_cpu_supports("avx512f") && mt_cpu_supports("avx512bw") &&
                 mt_cpu_supports("avx512dq") && mt_cpu_supports("avx512vl");
    isa.avx512_bf16 = isa.avx512 && mt_cpu_supports("avx512bf16");
    isa.amx_bf16 = mt_cpu_has_amx();
    isa.avx512_vnni = isa.avx512 && mt_cpu_supports("avx512vnni");
    return isa;
  }

  std::string str() const {
    if (avx512) {
      std::string s = "AVX-512";
      if (avx512_bf16) s += ", AVX512_BF16";
      if (amx_bf16) s += ", AMX-BF16";
      return s;
    }
    return avx2_fma ? "AVX2+FMA" : "no AVX2";
  }
};

const Isa& isa() {
  static const Isa kIsa = Isa::detect();  // immutable after the first call
  return kIsa;
}

// ---- OpenBLAS, loaded at run time -----------------------------------------------------------

// Only OpenBLAS's header is used at build time (for the types); its functions come from dlsym.
using SgemmFn = decltype(&cblas_sgemm);
using SetThreadsFn = void (*)(int);
using GetStringFn = char* (*)();

struct OpenBlas {
  SgemmFn sgemm = nullptr;  // null: OpenBLAS is unavailable and the portable GEMM runs
  std::string version;      // "OpenBLAS 0.3.21"
  std::string corename;     // kernels OpenBLAS runs, as it reports them: "SkylakeX"
  std::string coretype_origin;
  std::string error;  // why it could not be loaded
};

// The environment variable `name` set to `value` for the lifetime of this object, unless the
// environment already sets it; restored (unset) afterwards so the user's environment is unchanged.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (value && !std::getenv(name)) set_ = setenv(name, value, 0) == 0;
  }
  ~ScopedEnv() {
    if (set_) unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  bool set() const { return set_; }

 private:
  const char* name_;
  bool set_ = false;
};

OpenBlas load_openblas() {
  OpenBlas ob;
  // MT_CPU_BLAS=portable: leave OpenBLAS alone (to rule it out when a result looks wrong, and so
  // the tests can cover the portable path on machines that have OpenBLAS).
  if (const char* env = std::getenv("MT_CPU_BLAS"); env && std::string(env) == "portable") {
    ob.error = "MT_CPU_BLAS=portable";
    return ob;
  }
  // Under an address-space limit (ulimit -v, prlimit --as) OpenBLAS's buffer allocation retries
  // a failed mapping forever: mt spun at full CPU and ignored SIGTERM's stop (its step never
  // ended). The portable kernels allocate nothing of their own, so a run that does not fit fails
  // with a message instead.
  if (rlimit as{}; getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    ob.error = fmt::format(
        "an address-space limit of {} MiB is set (ulimit -v), under which OpenBLAS spins "
        "forever when it cannot map its buffers; unset it for OpenBLAS",
        static_cast<unsigned long long>(as.rlim_cur >> 20));
    return ob;
  }
  // libopenblas.so.0 is what Debian's alternatives point at (pthread, openmp or serial variant).
  const char* kNames[] = {"libopenblas.so.0", "libopenblas.so"};
  // Already in the process (linked by someone else): its kernels are chosen and cannot change.
  void* handle = nullptr;
  for (const char* name : kNames)
    if ((handle = dlopen(name, RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD))) break;
  const char* user_coretype = std::getenv("OPENBLAS_CORETYPE");
  // Kernel family for this CPU when OpenBLAS's own detection is not trusted: SkylakeX needs
  // AVX-512 F/BW/DQ/VL, Haswell AVX2+FMA. Only set before OpenBLAS's constructor runs. The
  // hardware's own answer, not isa()'s: OpenBLAS runs natively under MT_EMULATE_X86 too.
  __builtin_cpu_init();
  const bool hw_avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  const bool hw_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* ours = hw_avx512 ? "SkylakeX" : hw_avx2 ? "Haswell" : nullptr;
  if (!handle) {
    // setenv is not thread-safe against concurrent getenv; this runs once, from the plugin's
    // registration (load_blas), which mt run and mt bench trigger before their communicator
    // starts MPI's threads, and before any kernel thread exists.
    ScopedEnv coretype("OPENBLAS_CORETYPE", ours);
    // Its thread pool would only idle: oneTBB owns the cores (see the header comment).
    ScopedEnv threads("OPENBLAS_NUM_THREADS", "1");
    std::string errors;
    for (const char* name : kNames) {
      handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle) break;
      const char* e = dlerror();
      errors += fmt::format("{}{}", errors.empty() ? "" : "; ", e ? e : name);
    }
    if (!handle) {
      ob.error = errors;
      return ob;
    }
    if (user_coretype)
      ob.coretype_origin = fmt::format("OPENBLAS_CORETYPE={} from the environment", user_coretype);
    else if (coretype.set())
      ob.coretype_origin = "coretype set by mt";
    else
      ob.coretype_origin = "OpenBLAS's own detection";
  } else {
    ob.coretype_origin = "OpenBLAS was already loaded; its own choice";
  }
  // The handle is never closed: OpenBLAS stays loaded for the life of the process.
  ob.sgemm = reinterpret_cast<SgemmFn>(dlsym(handle, "cblas_sgemm"));
  if (!ob.sgemm) {
    ob.error = "libopenblas has no cblas_sgemm";
    return ob;
  }
  if (auto set_threads = reinterpret_cast<SetThreadsFn>(dlsym(handle, "openblas_set_num_threads")))
    set_threads(1);
  if (auto config = reinterpret_cast<GetStringFn>(dlsym(handle, "openblas_get_config"))) {
    // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ..." -> the first two words
    std::string s = config();
    size_t sp = s.find(' ');
    if (sp != std::string::npos) sp = s.find(' ', sp + 1);
    ob.version = s.substr(0, sp);
  } else {
    ob.version = "OpenBLAS";
  }
  if (auto core = reinterpret_cast<GetStringFn>(dlsym(handle, "openblas_get_corename")))
    ob.corename = core();
  // An environment may hold OpenBLAS narrower than the CPU (seen: OPENBLAS_CORETYPE=Haswell
  // inherited on a Zen 5 EPYC, half SkylakeX's f32 GEMM rate). The user's word stands; the
  // start-up line says what it costs.
  std::string core_lower = ob.corename;
  for (char& ch : core_lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  const bool core_avx512 =
      core_lower == "skylakex" || core_lower == "cooperlake" || core_lower == "sapphirerapids";
  if (user_coretype && hw_avx512 && !ob.corename.empty() && !core_avx512)
    ob.coretype_origin +=
        "; this CPU has AVX-512: unset it for SkylakeX's kernels (on a Zen 5 "
        "EPYC twice Haswell's f32 GEMM rate)";
  return ob;
}

// The library binding: loaded once per process and immutable afterwards (a function-local static
// is the one piece of process state here, because the shared library itself is process state).
const OpenBlas& openblas() {
  static const OpenBlas kOpenBlas = load_openblas();
  return kOpenBlas;
}

// ---- FMA peak -------------------------------------------------------------------------------

// Independent FMA chains hide the FMA latency (4-5 cycles x 2 ports: 8-10 in flight needed), and
// every chain and both constants must stay in registers: 16 chains of the 32 zmm registers, 12 of
// the 16 ymm ones (16 there spill, and measured 58.6 against 102.6 GFLOP/s on an AVX2 EPYC core:
// a peak 1.75x too low, so MFU above 100%). Spelled out per width because intrinsics cannot be
// inlined into a function of another target.
constexpr int kChains512 = 16, kChains256 = 12;

MT_TARGET("avx512f") double fma_loop_avx512(long iters) {
  __m512 acc[kChains512];
  for (int i = 0; i < kChains512; ++i) acc[i] = _mm512_set1_ps(1.f + 0.01f * float(i));
  const __m512 m = _mm512_set1_ps(0.999f), add = _mm512_set1_ps(1e-3f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains512; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, add);
  }
  for (int i = 1; i < kChains512; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  float out[16];
  _mm512_storeu_ps(out, acc[0]);
  return out[0];
}

MT_TARGET("avx2,fma") double fma_loop_avx2(long iters) {
  __m256 acc[kChains256];
  for (int i = 0; i < kChains256; ++i) acc[i] = _mm256_set1_ps(1.f + 0.01f * float(i));
  const __m256 m = _mm256_set1_ps(0.999f), add = _mm256_set1_ps(1e-3f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains256; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, add);
  }
  for (int i = 1; i < kChains256; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  float out[8];
  _mm256_storeu_ps(out, acc[0]);
  return out[0];
}

// f32 FMA FLOP/s of one core, measured with every hardware thread running the same loop at once
// (so at the clock all cores sustain together, not one core's turbo): each thread's best of 8
// ~3 ms runs of independent FMA chains at the widest vector width this CPU has, and the best of
// the threads (one thread slowed by other work on its core does not lower it). A computed cores
// x GHz x flops/cycle would need the sustained AVX-512 clock, which a VM does not report.
// Measured once: one ~15 ms run on one core read 177-207 GFLOP/s across runs on a 2-core AVX2
// machine (MFU 0.80 where the share was 0.70).
double measure_core_peak() {
#if defined(MT_EMULATE_X86)
  return 1e11;  // emulated instructions have no rate of their own: a nominal figure
#endif
  const int lanes = isa().avx512 ? 16 : isa().avx2_fma ? 8 : 0;
  if (lanes == 0) return 4e9;  // SSE2 only: ~1 mul+add of 4 lanes per cycle at ~1 GHz, a guess
  const int chains = lanes == 16 ? kChains512 : kChains256;
  const long iters = lanes == 16 ? 400000 : 1000000;
  auto one_core = [&] {
    double best = 0, sink = 0;
    for (int rep = 0; rep < 8; ++rep) {  // the first runs also raise the clock to its AVX level
      const auto t0 = std::chrono::steady_clock::now();
      sink += lanes == 16 ? fma_loop_avx512(iters) : fma_loop_avx2(iters);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      best = std::max(best, 2.0 * lanes * chains * static_cast<double>(iters) / s);
    }
    if (sink == 12345.678) best += 1;  // keeps the loops from being optimised away
    return best;
  };
  return best_on_every_thread(one_core);
}

double core_peak() {
  static const double kPeak = measure_core_peak();  // measured once, immutable afterwards
  return kPeak;
}

// ---- bf16 <-> f32 (bf16_to_f32_n / f32_to_bf16_n from simd.h) ---------------------------

constexpr int64_t kConvertChunk = 1 << 15;

// f32 copy of a float tensor: the tensor itself when it is f32, else a scratch tensor from the
// backend's caching allocator (no system allocation in a steady-state step).
Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::f32) return t;
  Tensor out = t.backend()->empty(t.shape(), DType::f32);
  const auto* src = t.ptr<const uint16_t>();
  float* dst = out.ptr<float>();
  const int64_t n = t.numel();
  tbb::parallel_for(int64_t{0}, (n + kConvertChunk - 1) / kConvertChunk, [&](int64_t i) {
    const int64_t b = i * kConvertChunk;
    bf16_to_f32_n(src + b, dst + b, std::min(kConvertChunk, n - b));
  });
  return out;
}

void store_bf16(const Tensor& src_f32, Tensor& dst) {
  const float* src = src_f32.ptr<const float>();
  auto* out = dst.ptr<uint16_t>();
  const int64_t n = dst.numel();
  tbb::parallel_for(int64_t{0}, (n + kConvertChunk - 1) / kConvertChunk, [&](int64_t i) {
    const int64_t b = i * kConvertChunk;
    f32_to_bf16_n(src + b, out + b, std::min(kConvertChunk, n - b));
  });
}

// ---- one single-threaded GEMM tile ----------------------------------------------------------

// c = alpha * op(a) op(b) + beta * c, row-major, m x n x k all >= 1.
struct Tile {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
  const float* a;
  int64_t lda;
  const float* b;
  int64_t ldb;
  float* c;
  int64_t ldc;
};

// Used only without OpenBLAS (not found, or MT_CPU_BLAS=portable): correct, slow.
void portable_gemm(const Tile& t) {
  for (int64_t i = 0; i < t.m; ++i) {
    float* crow = t.c + i * t.ldc;
    for (int64_t j = 0; j < t.n; ++j) crow[j] = t.beta == 0.f ? 0.f : t.beta * crow[j];
    auto A = [&](int64_t p) { return t.ta ? t.a[p * t.lda + i] : t.a[i * t.lda + p]; };
    if (t.tb) {
      for (int64_t j = 0; j < t.n; ++j) {
        const float* brow = t.b + j * t.ldb;
        float s = 0.f;
        for (int64_t p = 0; p < t.k; ++p) s += A(p) * brow[p];
        crow[j] += t.alpha * s;
      }
    } else {
      for (int64_t p = 0; p < t.k; ++p) {
        const float av = t.alpha * A(p);
        const float* brow = t.b + p * t.ldb;
        for (int64_t j = 0; j < t.n; ++j) crow[j] += av * brow[j];
      }
    }
  }
}

void run_tile(const Tile& t) {
  if (SgemmFn sgemm = openblas().sgemm) {
    sgemm(CblasRowMajor, t.ta ? CblasTrans : CblasNoTrans, t.tb ? CblasTrans : CblasNoTrans,
          blasint(t.m), blasint(t.n), blasint(t.k), t.alpha, t.a, blasint(t.lda), t.b,
          blasint(t.ldb), t.beta, t.c, blasint(t.ldc));
  } else {
    portable_gemm(t);
  }
}

// ---- matrix-vector kernels (M = 1) ----------------------------------------------------------

// y[j] = alpha * sum_p x[p] * W(p, j) + beta * y[j] for j in [j0, j1), W f32 or bf16 (uint16_t).
// "rows" layout: W is [N, K] (trans_b), each output a dot product of x with row j.
// "cols" layout: W is [K, N], outputs a sum of scaled rows of W.

// Outputs per task in the "cols" layout, at most: a row segment of W is then 4 KiB, one page,
// which the hardware prefetcher follows, and the partial sums (<= 8 KiB) stay in L1.
constexpr int64_t kColsChunk = 2048;
template <class W>
constexpr int64_t cols_chunk() {
  return 4096 / int64_t(sizeof(W));
}

template <class W>
inline float load_scalar(const W* p) {
  if constexpr (std::is_same_v<W, float>)
    return *p;
  else
    return std::bit_cast<float>(uint32_t(*p) << 16);
}

inline float combine(float acc, float alpha, float beta, float old) {
  return beta == 0.f ? alpha * acc : alpha * acc + beta * old;
}

template <class W>
void gemv_rows_portable(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                        int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                        int64_t ldy) {
  for (int64_t j = j0; j < j1; ++j) {
    const W* row = w + j * ldw;
    for (int64_t r = 0; r < rows_m; ++r) {
      const float* xr = x + r * ldx;
      float s = 0.f;
      for (int64_t p = 0; p < k; ++p) s += xr[p] * load_scalar(row + p);
      y[r * ldy + j] = combine(s, alpha, beta, y[r * ldy + j]);
    }
  }
}

// The "cols" kernels take M rows of x (x + r ldx) and of y (y + r ldy), M <= kFewRows, against
// the same W: each weight segment is read from memory once for all of them (batched decode),
// and every output is summed in the same order as with M = 1, so a row's result does not depend
// on the rows beside it. (kFewRows: kernels.h.)

template <class W>
void gemv_cols_portable(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                        int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                        int64_t ldy) {
  std::vector<float> acc_buf(static_cast<size_t>(rows_m * (j1 - j0)), 0.f);
  const int64_t n = j1 - j0;
  for (int64_t p = 0; p < k; ++p) {
    const W* row = w + p * ldw + j0;
    for (int64_t j = 0; j < n; ++j) {
      const float wv = load_scalar(row + j);
      for (int64_t r = 0; r < rows_m; ++r) acc_buf[size_t(r * n + j)] += x[r * ldx + p] * wv;
    }
  }
  for (int64_t r = 0; r < rows_m; ++r)
    for (int64_t j = 0; j < n; ++j)
      y[r * ldy + j0 + j] = combine(acc_buf[size_t(r * n + j)], alpha, beta, y[r * ldy + j0 + j]);
}

#define MT_AVX512 MT_TARGET("avx512f,avx512bw,avx512dq,avx512vl")

// Sixteen f32 (masked) from W: bf16 is widened in registers by a 16-bit shift.
template <class W>
MT_AVX512 inline __m512 load16(const W* p, __mmask16 m) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm512_maskz_loadu_ps(m, p);
  } else {
    // maskz forms: the unmasked intrinsics start from _mm512_undefined, which GCC 12 reports as
    // an uninitialised read.
    const __m256i h = _mm256_maskz_loadu_epi16(m, p);
    return _mm512_castsi512_ps(
        _mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16));
  }
}

// Horizontal sum in a fixed order (not _mm512_reduce_add_ps: see load16).
MT_AVX512 inline float hsum(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, v, 0),
                                 _mm512_maskz_extractf32x8_ps(0xff, v, 1));
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

MT_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
}

// The "rows" kernels: dot products of M rows of x (x + r ldx) with rows [j0, j1) of W [N, K].
// With one or two rows of x, one weight row at a time: a task's rows are contiguous, so it reads
// one sequential stream, which the hardware prefetchers follow at the memory's full rate
// (several rows interleaved read at about half of it on the Zen 4 this was measured on). The
// rows of x pass over each weight vector four at a time (AVX2: two, its 16 registers), so it is
// widened once per group. Every output is summed in one order whatever M and the blocking:
// four accumulators over alternating vectors, then (a0 + a1) + (a2 + a3), then the lanes in a
// fixed order. With one or two rows of x, where matvec_prefetch() says so, each step also
// prefetches the lines kMatvecPrefetchBytes bytes ahead into L2 (not L1: see matvec_prefetch()).

// Row i's four accumulators acc[i][0..3] (loaded first, stored after) gain the steps of 64 terms
// [p0, p1) (p1 <= k / 64 * 64) and, with `tail`, one more step with masked loads for the last
// k % 64 terms (a vector past k adds zeros): the same operations in the same order however a
// row's steps are split among calls. (Four arrays of X in registers, not one of X x 4, and the
// loops over i unrolled: otherwise GCC 12 keeps them in memory, storing each at every step.)
template <class W, int X, bool Prefetch = false>
MT_AVX512 void dot_steps_avx512(const float* const* xs, const W* row, int64_t k, int64_t p0,
                                int64_t p1, bool tail, __m512 (*acc)[4]) {
  __m512 a0[X], a1[X], a2[X], a3[X];
  const float* x[X];
#pragma GCC unroll 8
  for (int i = 0; i < X; ++i) {
    a0[i] = acc[i][0];
    a1[i] = acc[i][1];
    a2[i] = acc[i][2];
    a3[i] = acc[i][3];
    x[i] = xs[i];
  }
  for (int64_t p = p0; p < p1; p += 64) {
    if constexpr (Prefetch) {  // a step's 64 weights are sizeof(W) lines of 64 bytes
      const char* ahead = reinterpret_cast<const char*>(row + p) + kMatvecPrefetchBytes;
#pragma GCC unroll 4
      for (size_t l = 0; l < sizeof(W); ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T1);
    }
    const __m512 w0 = load16(row + p, 0xffff), w1 = load16(row + p + 16, 0xffff);
    const __m512 w2 = load16(row + p + 32, 0xffff), w3 = load16(row + p + 48, 0xffff);
#pragma GCC unroll 8
    for (int i = 0; i < X; ++i) {
      a0[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + p), w0, a0[i]);
      a1[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + p + 16), w1, a1[i]);
      a2[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + p + 32), w2, a2[i]);
      a3[i] = _mm512_fmadd_ps(_mm512_loadu_ps(x[i] + p + 48), w3, a3[i]);
    }
  }
  if (tail) {
    const int64_t p = k / 64 * 64;
    auto mask = [&](int64_t q) { return q < k ? tail_mask(k - q) : __mmask16(0); };
    const __mmask16 m0 = mask(p), m1 = mask(p + 16), m2 = mask(p + 32), m3 = mask(p + 48);
    const __m512 w0 = load16(row + p, m0), w1 = load16(row + p + 16, m1);
    const __m512 w2 = load16(row + p + 32, m2), w3 = load16(row + p + 48, m3);
#pragma GCC unroll 8
    for (int i = 0; i < X; ++i) {
      a0[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, x[i] + p), w0, a0[i]);
      a1[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, x[i] + p + 16), w1, a1[i]);
      a2[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m2, x[i] + p + 32), w2, a2[i]);
      a3[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m3, x[i] + p + 48), w3, a3[i]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < X; ++i) {
    acc[i][0] = a0[i];
    acc[i][1] = a1[i];
    acc[i][2] = a2[i];
    acc[i][3] = a3[i];
  }
}

// Weight rows in groups of kRowsGroup; with more than two rows of x, K in blocks of x that fit
// in L1 beside the group's partial sums (each row of x would otherwise come from L2 for every
// weight row: 8 rows of 2048 are 64 KiB), which wait in `acc` between blocks. With one or two
// rows of x a block is the whole of K, so each weight row is still read in one pass.
constexpr int64_t kRowsGroup = 8;
inline int64_t rows_k_block(int64_t rows_m, int64_t k, int64_t step) {
  const int64_t whole = k / step * step;
  return rows_m <= 2 ? whole : std::max(step, int64_t{4096} / rows_m / step * step);
}

template <class W>
MT_AVX512 void gemv_rows_avx512(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                                int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta,
                                float* y, int64_t ldy, bool prefetch) {
  prefetch = prefetch && rows_m <= 2;  // more rows of x: bound by arithmetic, K in blocks
  const int64_t k64 = k / 64 * 64, kb = rows_k_block(rows_m, k, 64);
  const bool tail = k64 < k;
  alignas(64) __m512 acc[kRowsGroup * kFewRows][4];
  for (int64_t jb = j0; jb < j1; jb += kRowsGroup) {
    const int64_t je = std::min(j1, jb + kRowsGroup);
    for (int64_t e = 0; e < (je - jb) * rows_m; ++e)
      for (int u = 0; u < 4; ++u) acc[e][u] = _mm512_setzero_ps();
    for (int64_t p0 = 0;; p0 += kb) {
      const int64_t p1 = std::min(k64, p0 + kb);
      const bool last = p1 == k64;
      for (int64_t j = jb; j < je; ++j)
        for (int64_t r = 0; r < rows_m; r += 4) {
          const float* xs[4];
          const int64_t nx = std::min<int64_t>(4, rows_m - r);
          for (int64_t i = 0; i < nx; ++i) xs[i] = x + (r + i) * ldx;
          __m512(*a)[4] = acc + (j - jb) * rows_m + r;
          const W* row = w + j * ldw;
          const bool t = last && tail;
          switch (nx) {
            case 4:
              dot_steps_avx512<W, 4>(xs, row, k, p0, p1, t, a);
              break;
            case 3:
              dot_steps_avx512<W, 3>(xs, row, k, p0, p1, t, a);
              break;
            case 2:
              if (prefetch)
                dot_steps_avx512<W, 2, true>(xs, row, k, p0, p1, t, a);
              else
                dot_steps_avx512<W, 2>(xs, row, k, p0, p1, t, a);
              break;
            default:
              if (prefetch)
                dot_steps_avx512<W, 1, true>(xs, row, k, p0, p1, t, a);
              else
                dot_steps_avx512<W, 1>(xs, row, k, p0, p1, t, a);
              break;
          }
        }
      if (last) break;
    }
    for (int64_t j = jb; j < je; ++j)
      for (int64_t r = 0; r < rows_m; ++r) {
        const __m512* a = acc[(j - jb) * rows_m + r];
        const float s = hsum(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
        y[r * ldy + j] = combine(s, alpha, beta, y[r * ldy + j]);
      }
  }
}

// X rows of x against L weight rows side by side (gemv_row_streams_avx512's streams, as
// gemv_row_streams_avx2's on AVX2). Each (row of x, weight row) sum is gemv_rows_avx512's to the
// bit at one or two rows of x: dot_steps_avx512's four accumulators over the whole of K in steps
// of 64, the masked tail step, the same horizontal sum.
template <class W, int L, int X>
MT_AVX512 void row_dots_avx512(const float* const* xs, const W* const* rows, int64_t k,
                               float (*sums)[X]) {
  const int64_t k64 = k / 64 * 64;
  __m512 a[L][X][4];
#pragma GCC unroll 4
  for (int s = 0; s < L; ++s)
    for (int i = 0; i < X; ++i)
      for (int u = 0; u < 4; ++u) a[s][i][u] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k64; p += 64) {
#pragma GCC unroll 4
    for (int s = 0; s < L; ++s) {
      const __m512 w0 = load16(rows[s] + p, 0xffff), w1 = load16(rows[s] + p + 16, 0xffff);
      const __m512 w2 = load16(rows[s] + p + 32, 0xffff), w3 = load16(rows[s] + p + 48, 0xffff);
#pragma GCC unroll 2
      for (int i = 0; i < X; ++i) {
        a[s][i][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i] + p), w0, a[s][i][0]);
        a[s][i][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i] + p + 16), w1, a[s][i][1]);
        a[s][i][2] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i] + p + 32), w2, a[s][i][2]);
        a[s][i][3] = _mm512_fmadd_ps(_mm512_loadu_ps(xs[i] + p + 48), w3, a[s][i][3]);
      }
    }
  }
  if (k64 < k) {
    auto mask = [&](int64_t q) { return q < k ? tail_mask(k - q) : __mmask16(0); };
    const __mmask16 m0 = mask(k64), m1 = mask(k64 + 16), m2 = mask(k64 + 32), m3 = mask(k64 + 48);
    for (int s = 0; s < L; ++s) {
      const W* row = rows[s] + k64;
      const __m512 w0 = load16(row, m0), w1 = load16(row + 16, m1);
      const __m512 w2 = load16(row + 32, m2), w3 = load16(row + 48, m3);
      for (int i = 0; i < X; ++i) {
        const float* x = xs[i] + k64;
        a[s][i][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m0, x), w0, a[s][i][0]);
        a[s][i][1] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m1, x + 16), w1, a[s][i][1]);
        a[s][i][2] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m2, x + 32), w2, a[s][i][2]);
        a[s][i][3] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m3, x + 48), w3, a[s][i][3]);
      }
    }
  }
  for (int s = 0; s < L; ++s)
    for (int i = 0; i < X; ++i)
      sums[s][i] = hsum(_mm512_add_ps(_mm512_add_ps(a[s][i][0], a[s][i][1]),
                                      _mm512_add_ps(a[s][i][2], a[s][i][3])));
}

// One or two rows of x (X) against weight rows [j0, j1) as S sequential streams at once (rows j,
// j + h, ...; h = ceil((j1 - j0) / S)): 4 for one row (16 accumulators of AVX-512's 32
// registers), 3 for two (24). gemv_row_streams_avx2's reading, for the AVX-512 set; taken only
// with MT_CPU_MATVEC_STREAMS=1: slower than one stream on the AVX-512 machine it was measured on
// (see matvec_streams()).
template <class W, int X>
MT_AVX512 void gemv_row_streams_avx512(const float* x, int64_t ldx, const W* w, int64_t k,
                                       int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta,
                                       float* y, int64_t ldy) {
  constexpr int S = X == 1 ? 4 : 3;
  const float* xs[X];
  for (int i = 0; i < X; ++i) xs[i] = x + i * ldx;
  const int64_t h = (j1 - j0 + S - 1) / S;
  for (int64_t r = 0; r < h; ++r) {
    int64_t js[S] = {};
    const int live = stream_rows(j0, j1, h, r, S, js);
    const W* rows[4] = {};
    for (int s = 0; s < live; ++s) rows[s] = w + js[s] * ldw;
    float sums[4][X];
    with_count<4>(live, [&](auto n) { row_dots_avx512<W, n(), X>(xs, rows, k, sums); });
    for (int s = 0; s < live; ++s)
      for (int i = 0; i < X; ++i)
        y[i * ldy + js[s]] = combine(sums[s][i], alpha, beta, y[i * ldy + js[s]]);
  }
}

template <class W>
MT_AVX512 void gemv_cols_avx512(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                                int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta,
                                float* y, int64_t ldy) {
  alignas(64) float acc[kFewRows * kColsChunk];
  const int64_t n = j1 - j0, nv = (n + 15) / 16, lda = nv * 16;
  for (int64_t i = 0; i < rows_m * lda; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  // Four rows of W per pass over the partial sums: four weight streams per load/store of acc,
  // widened once for the M rows of x.
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {
    const W* r0 = w + p * ldw + j0;
    const W* r1 = r0 + ldw;
    const W* r2 = r1 + ldw;
    const W* r3 = r2 + ldw;
    for (int64_t v = 0; v < nv; ++v) {
      const __mmask16 m = tail_mask(n - 16 * v);
      const __m512 w0 = load16(r0 + 16 * v, m), w1 = load16(r1 + 16 * v, m);
      const __m512 w2 = load16(r2 + 16 * v, m), w3 = load16(r3 + 16 * v, m);
      for (int64_t r = 0; r < rows_m; ++r) {
        const float* xr = x + r * ldx + p;
        float* a = acc + r * lda + 16 * v;
        __m512 s = _mm512_load_ps(a);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w0, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w1, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[2]), w2, s);
        s = _mm512_fmadd_ps(_mm512_set1_ps(xr[3]), w3, s);
        _mm512_store_ps(a, s);
      }
    }
  }
  for (; p < k; ++p) {
    const W* r0 = w + p * ldw + j0;
    for (int64_t v = 0; v < nv; ++v) {
      const __m512 w0 = load16(r0 + 16 * v, tail_mask(n - 16 * v));
      for (int64_t r = 0; r < rows_m; ++r) {
        float* a = acc + r * lda + 16 * v;
        _mm512_store_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + p]), w0, _mm512_load_ps(a)));
      }
    }
  }
  const __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
  for (int64_t r = 0; r < rows_m; ++r)
    for (int64_t v = 0; v < nv; ++v) {
      const __mmask16 m = tail_mask(n - 16 * v);
      float* out = y + r * ldy + j0 + 16 * v;
      __m512 o = _mm512_mul_ps(va, _mm512_load_ps(acc + r * lda + 16 * v));
      if (beta != 0.f) o = _mm512_fmadd_ps(vb, _mm512_maskz_loadu_ps(m, out), o);
      _mm512_mask_storeu_ps(out, m, o);
    }
}

// F16C with them (every AVX2 CPU has it): int8 rows' f16 scales (mt/q8.h).
#define MT_AVX2 MT_TARGET("avx2,fma,f16c")

// Eight f32 from W (bf16 widened in registers by a 16-bit shift).
template <class W>
MT_AVX2 inline __m256 load8(const W* p) {
  if constexpr (std::is_same_v<W, float>) {
    return _mm256_loadu_ps(p);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// Horizontal sum in a fixed order.
MT_AVX2 inline float hsum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_shuffle_ps(d, d, 1)));
}

// AVX2 + FMA (x86-64-v3 CPUs without AVX-512): the AVX-512 kernels' loops at 8 lanes (the
// rows kernels' four accumulators over alternating 8-lane vectors), the last k % 8 terms added
// in scalar after the vector sum.
template <class W, int X>
MT_AVX2 void dot_steps_avx2(const float* const* xs, const W* row, int64_t p0, int64_t p1,
                            __m256 (*acc)[4]) {
  __m256 a0[X], a1[X], a2[X], a3[X];
  const float* x[X];
#pragma GCC unroll 4
  for (int i = 0; i < X; ++i) {
    a0[i] = acc[i][0];
    a1[i] = acc[i][1];
    a2[i] = acc[i][2];
    a3[i] = acc[i][3];
    x[i] = xs[i];
  }
  for (int64_t p = p0; p < p1; p += 32) {
    const __m256 w0 = load8(row + p), w1 = load8(row + p + 8);
    const __m256 w2 = load8(row + p + 16), w3 = load8(row + p + 24);
#pragma GCC unroll 4
    for (int i = 0; i < X; ++i) {
      a0[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + p), w0, a0[i]);
      a1[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + p + 8), w1, a1[i]);
      a2[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + p + 16), w2, a2[i]);
      a3[i] = _mm256_fmadd_ps(_mm256_loadu_ps(x[i] + p + 24), w3, a3[i]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < X; ++i) {
    acc[i][0] = a0[i];
    acc[i][1] = a1[i];
    acc[i][2] = a2[i];
    acc[i][3] = a3[i];
  }
}

// The AVX-512 driver's blocking at 8 lanes, rows of x two at a time (16 registers); the last
// k % 32 terms go vector by vector into the accumulator their position gives (k % 8 in scalar
// after the vector sum).
template <class W>
MT_AVX2 void gemv_rows_avx2(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                            int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                            int64_t ldy) {
  const int64_t k32 = k / 32 * 32, k8 = k / 8 * 8, kb = rows_k_block(rows_m, k, 32);
  alignas(32) __m256 acc[kRowsGroup * kFewRows][4];
  for (int64_t jb = j0; jb < j1; jb += kRowsGroup) {
    const int64_t je = std::min(j1, jb + kRowsGroup);
    for (int64_t e = 0; e < (je - jb) * rows_m; ++e)
      for (int u = 0; u < 4; ++u) acc[e][u] = _mm256_setzero_ps();
    for (int64_t p0 = 0;; p0 += kb) {
      const int64_t p1 = std::min(k32, p0 + kb);
      for (int64_t j = jb; j < je; ++j)
        for (int64_t r = 0; r < rows_m; r += 2) {
          const float* xs[2] = {x + r * ldx, x + (r + 1) * ldx};
          __m256(*a)[4] = acc + (j - jb) * rows_m + r;
          if (r + 1 < rows_m)
            dot_steps_avx2<W, 2>(xs, w + j * ldw, p0, p1, a);
          else
            dot_steps_avx2<W, 1>(xs, w + j * ldw, p0, p1, a);
        }
      if (p1 == k32) break;
    }
    for (int64_t j = jb; j < je; ++j) {
      const W* row = w + j * ldw;
      for (int64_t r = 0; r < rows_m; ++r) {
        __m256* a = acc[(j - jb) * rows_m + r];
        const float* xr = x + r * ldx;
        for (int64_t p = k32, u = 0; p < k8; p += 8, ++u)
          a[u] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + p), load8(row + p), a[u]);
        float t = 0.f;
        for (int64_t p = k8; p < k; ++p) t += xr[p] * load_scalar(row + p);
        const float s =
            hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + t;
        y[r * ldy + j] = combine(s, alpha, beta, y[r * ldy + j]);
      }
    }
  }
}

// X rows of x against L weight rows side by side (gemv_row_streams_avx2's streams). One core
// following a single stream leaves memory idle between the misses its loads wait for: on a
// 2-core AVX2 EPYC, one stream of bf16 rows per core read 15-16 GB/s, three 19-21 (f32 19-20 ->
// 21), above what a plain read of one stream reached. Each (row of x, weight row) sum is the
// one-stream kernel's to the bit (dot_steps_avx2 over K / 32 * 32 into four accumulators, the
// next K % 32 terms 8 at a time into the first of them, the last K % 8 in scalar, the same
// horizontal sum).
template <class W, int L, int X>
MT_AVX2 void row_dots_avx2(const float* const* xs, const W* const* rows, int64_t k,
                           float (*sums)[X]) {
  const int64_t k32 = k / 32 * 32, k8 = k / 8 * 8;
  __m256 a[L][X][4];
#pragma GCC unroll 4
  for (int s = 0; s < L; ++s)
    for (int i = 0; i < X; ++i)
      for (int u = 0; u < 4; ++u) a[s][i][u] = _mm256_setzero_ps();
  for (int64_t p = 0; p < k32; p += 32) {
#pragma GCC unroll 4
    for (int s = 0; s < L; ++s) {
      const __m256 w0 = load8(rows[s] + p), w1 = load8(rows[s] + p + 8);
      const __m256 w2 = load8(rows[s] + p + 16), w3 = load8(rows[s] + p + 24);
#pragma GCC unroll 2
      for (int i = 0; i < X; ++i) {
        a[s][i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + p), w0, a[s][i][0]);
        a[s][i][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + p + 8), w1, a[s][i][1]);
        a[s][i][2] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + p + 16), w2, a[s][i][2]);
        a[s][i][3] = _mm256_fmadd_ps(_mm256_loadu_ps(xs[i] + p + 24), w3, a[s][i][3]);
      }
    }
  }
  for (int s = 0; s < L; ++s)
    for (int i = 0; i < X; ++i) {
      const float* x = xs[i];
      __m256* acc = a[s][i];
      for (int64_t p = k32, u = 0; p < k8; p += 8, ++u)
        acc[u] = _mm256_fmadd_ps(_mm256_loadu_ps(x + p), load8(rows[s] + p), acc[u]);
      float t = 0.f;
      for (int64_t p = k8; p < k; ++p) t += x[p] * load_scalar(rows[s] + p);
      sums[s][i] =
          hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + t;
    }
}

constexpr int kRowStreams = 3;  // 12 accumulators: what AVX2's 16 registers hold beside x's

// One or two rows of x (X) against weight rows [j0, j1) as S sequential streams at once (rows
// j, j + h, ...; h = ceil((j1 - j0) / S)): 3 for one row, 2 for two
// (16 accumulators, a few spilled: gemm_bench's BM_MatVecStream at M = 2, 2048 x 5632, f32
// weights 15.7-15.9 -> 18.0-18.4 GB/s, bf16 14.2-14.9 -> 13.8-18.7).
template <class W, int X>
MT_AVX2 void gemv_row_streams_avx2(const float* x, int64_t ldx, const W* w, int64_t k, int64_t ldw,
                                   int64_t j0, int64_t j1, float alpha, float beta, float* y,
                                   int64_t ldy) {
  constexpr int S = X == 1 ? kRowStreams : 2;
  const float* xs[X];
  for (int i = 0; i < X; ++i) xs[i] = x + i * ldx;
  const int64_t h = (j1 - j0 + S - 1) / S;
  for (int64_t r = 0; r < h; ++r) {
    int64_t js[S] = {};
    const int live = stream_rows(j0, j1, h, r, S, js);
    const W* rows[S] = {};
    for (int s = 0; s < live; ++s) rows[s] = w + js[s] * ldw;
    float sums[S][X];
    if (live == 3)
      row_dots_avx2<W, std::min(S, 3), X>(xs, rows, k, sums);
    else if (live == 2)
      row_dots_avx2<W, 2, X>(xs, rows, k, sums);
    else
      row_dots_avx2<W, 1, X>(xs, rows, k, sums);
    for (int s = 0; s < live; ++s)
      for (int i = 0; i < X; ++i)
        y[i * ldy + js[s]] = combine(sums[s][i], alpha, beta, y[i * ldy + js[s]]);
  }
}

template <class W>
MT_AVX2 void gemv_cols_avx2(int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
                            int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y,
                            int64_t ldy) {
  alignas(32) float acc[kFewRows * kColsChunk];
  const int64_t n = j1 - j0, n8 = n / 8 * 8, lda = (n + 7) / 8 * 8;
  for (int64_t i = 0; i < rows_m * lda; ++i) acc[i] = 0.f;
  // Four rows of W per pass over the partial sums: four weight streams per load/store of acc,
  // widened once for the M rows of x; the last n % 8 columns in scalar.
  int64_t p = 0;
  for (; p + 4 <= k; p += 4) {
    const W* r0 = w + p * ldw + j0;
    const W* r1 = r0 + ldw;
    const W* r2 = r1 + ldw;
    const W* r3 = r2 + ldw;
    for (int64_t v = 0; v < n8; v += 8) {
      const __m256 w0 = load8(r0 + v), w1 = load8(r1 + v), w2 = load8(r2 + v), w3 = load8(r3 + v);
      for (int64_t r = 0; r < rows_m; ++r) {
        const float* xr = x + r * ldx + p;
        float* a = acc + r * lda + v;
        __m256 s = _mm256_load_ps(a);
        s = _mm256_fmadd_ps(_mm256_set1_ps(xr[0]), w0, s);
        s = _mm256_fmadd_ps(_mm256_set1_ps(xr[1]), w1, s);
        s = _mm256_fmadd_ps(_mm256_set1_ps(xr[2]), w2, s);
        s = _mm256_fmadd_ps(_mm256_set1_ps(xr[3]), w3, s);
        _mm256_store_ps(a, s);
      }
    }
    for (int64_t j = n8; j < n; ++j)
      for (int64_t r = 0; r < rows_m; ++r) {
        const float* xr = x + r * ldx + p;
        acc[r * lda + j] += xr[0] * load_scalar(r0 + j) + xr[1] * load_scalar(r1 + j) +
                            xr[2] * load_scalar(r2 + j) + xr[3] * load_scalar(r3 + j);
      }
  }
  for (; p < k; ++p) {
    const W* r0 = w + p * ldw + j0;
    for (int64_t v = 0; v < n8; v += 8) {
      const __m256 w0 = load8(r0 + v);
      for (int64_t r = 0; r < rows_m; ++r) {
        float* a = acc + r * lda + v;
        _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(x[r * ldx + p]), w0, _mm256_load_ps(a)));
      }
    }
    for (int64_t j = n8; j < n; ++j)
      for (int64_t r = 0; r < rows_m; ++r) acc[r * lda + j] += x[r * ldx + p] * load_scalar(r0 + j);
  }
  for (int64_t r = 0; r < rows_m; ++r)
    for (int64_t j = 0; j < n; ++j)
      y[r * ldy + j0 + j] = combine(acc[r * lda + j], alpha, beta, y[r * ldy + j0 + j]);
}

// The matrix-vector kernel set: the widest the CPU has, or MT_CPU_MATVEC=portable|avx2|avx512
// (to compare them, and for the tests); an unknown value or a set the CPU lacks is refused.
enum class MatvecSet { portable, avx2, avx512 };

MatvecSet matvec_set() {
  static const MatvecSet kSet = [] {
    const MatvecSet best = isa().avx512     ? MatvecSet::avx512
                           : isa().avx2_fma ? MatvecSet::avx2
                                            : MatvecSet::portable;
    const char* env = std::getenv("MT_CPU_MATVEC");
    if (!env || !*env) return best;
    const std::string v = env;
    if (v == "portable") return MatvecSet::portable;
    if (v == "avx2" && isa().avx2_fma) return MatvecSet::avx2;
    if (v == "avx512" && isa().avx512) return MatvecSet::avx512;
    fail("MT_CPU_MATVEC=" + v + ": " +
         (v == "avx2" || v == "avx512"
              ? "this CPU lacks that instruction set (it has " + isa().str() + ")"
              : std::string("unknown kernel set")) +
         "; use portable, avx2 or avx512, or unset it for the widest the CPU has.");
  }();
  return kSet;
}

// Whether the one-stream "rows" kernels (gemv_rows_avx512 and the vdpbf16ps rows kernel, one or
// two rows of x) prefetch their weights kMatvecPrefetchBytes bytes ahead into L2 (prefetcht1). On
// by default on AMD CPUs, whose AVX-512 "rows" kernels read one stream a core (matvec_streams()):
// on a 2-core Zen 4 EPYC (2026-12-02, 20 interleaved rounds of 11 products of 2048 x 5632 over
// two threads, each against a loop that only loads the same bytes) one stream read 0.82-0.90 of
// the loop's rate without it and 0.98-1.00 with it, in f32 and in bf16 on vdpbf16ps (in minutes
// the loop read 44 GB/s, f32: 35-36.5 -> 42-45 GB/s); mt bench decode batch 1, five interleaved
// pairs: llama-bench-1b f32 1.08x, bf16 1.10x, llama-bench-m f32 1.02x, bf16 1.26x tokens/s.
// Into L1 (prefetcht0) it read less than none (1 and 2 KiB ahead: 0.72-0.75 of the loop
// against 0.80 without, prefetcht1 0.94), as sessions 13-14 found for the widening kernels. Not
// measured on Intel, where the several-streams kernels are the default. The AVX2 set's kernels
// (several streams) do not prefetch: on a 2-core Zen 3 EPYC (2026-12-02, the same loop in AVX2,
// 8 rounds) three FMA streams a core read 1.19x the one-stream load loop and 0.98x with a
// prefetcht1 1 KiB ahead; one stream 0.92x, 0.91x with it. MT_CPU_MATVEC_PREFETCH=0|1 forces
// either way.
bool matvec_prefetch() {
  static const bool kOn = [] {
    const int v = env_flag("MT_CPU_MATVEC_PREFETCH",
                           "the one-stream matrix-vector kernels read their weights without a "
                           "software prefetch (0) or prefetch them into L2 (1)",
                           "1 on AMD CPUs, else 0");
    return v < 0 ? mt_cpu_is_amd() : v == 1;
  }();
  return kOn;
}

// Whether one or two rows of x read their weight rows as several sequential streams per core
// (gemv_row_streams_avx2 / _avx512, and the vdpbf16ps rows kernel) instead of one: on by default
// for the AVX2 set (measured on a 2-core AVX2 EPYC, Zen 3: one stream per core left memory idle
// between misses) and on Intel CPUs, off for AMD's with AVX-512: on a 2-core Zen 5 EPYC
// (2026-11-29, mt bench decode batch 1, six interleaved pairs) several streams gave 0.88-0.93x
// one stream's tokens/s in f32 and bf16 (the vdpbf16ps rows kernel) and 0.98-1.00x in int8, one
// AVX-512 core's stream already reading at the triad's rate; on a 2-core Xeon with AMX and
// AVX-512 (2026-11-30, three interleaved pairs) one stream a core read 14-18 GB/s of a 22-31
// GB/s triad and several 20-25 (llama-bench-1b batch 1: bf16 8.4-9.0 -> 13.7-14.1 tokens/s, f32
// 5.7-6.8 -> 6.9-9.1; llama-bench-m bf16 62-69 -> 89-104, f32 35-41 -> 53-56).
// MT_CPU_MATVEC_STREAMS=0|1 forces either way.
bool matvec_streams() {
  static const bool kOn = [] {
    // Read with it, so that a bad MT_CPU_MATVEC_PREFETCH is refused on every CPU, also where the
    // kernels that run never prefetch (several streams: the AVX2 set, Intel's AVX-512).
    matvec_prefetch();
    const char* env = std::getenv("MT_CPU_MATVEC_STREAMS");
    if (!env || !*env) return matvec_set() == MatvecSet::avx2 || !mt_cpu_is_amd();
    const std::string v = env;
    if (v == "0" || v == "1") return v == "1";
    fail("MT_CPU_MATVEC_STREAMS=" + v + ": want 0 (one weight stream per core) or 1 (several)");
  }();
  return kOn;
}

const char* matvec_set_name() {
  switch (matvec_set()) {
    case MatvecSet::avx512:
      return "mt AVX-512 kernels";
    case MatvecSet::avx2:
      return "mt AVX2 kernels";
    default:
      return "mt portable kernels";
  }
}

// M rows of x and y (M <= kFewRows) against W: the "cols" kernels take them all at once; the
// "rows" kernels pass them over each weight row while it is in L1 (one read from memory).
template <class W>
void gemv(bool rows, int64_t rows_m, const float* x, int64_t ldx, const W* w, int64_t k,
          int64_t ldw, int64_t j0, int64_t j1, float alpha, float beta, float* y, int64_t ldy) {
  const MatvecSet set = matvec_set();
  if (!rows) {
    if (set == MatvecSet::avx512)
      gemv_cols_avx512(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
    else if (set == MatvecSet::avx2)
      gemv_cols_avx2(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
    else
      gemv_cols_portable(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
    return;
  }
  const bool streams = rows_m <= 2 && matvec_streams();
  if (set == MatvecSet::avx512 && streams && rows_m == 1)
    gemv_row_streams_avx512<W, 1>(x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
  else if (set == MatvecSet::avx512 && streams)
    gemv_row_streams_avx512<W, 2>(x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
  else if (set == MatvecSet::avx512)
    gemv_rows_avx512(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy, matvec_prefetch());
  else if (set == MatvecSet::avx2 && streams && rows_m == 1)
    gemv_row_streams_avx2<W, 1>(x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
  else if (set == MatvecSet::avx2 && streams)
    gemv_row_streams_avx2<W, 2>(x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
  else if (set == MatvecSet::avx2)
    gemv_rows_avx2(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
  else
    gemv_rows_portable(rows_m, x, ldx, w, k, ldw, j0, j1, alpha, beta, y, ldy);
}

// ---- drivers --------------------------------------------------------------------------------

struct Problem {
  int64_t batch, m, n, k;
  bool ta, tb;
  float alpha, beta;
  int64_t stride_a, stride_b, stride_c;  // elements between batch items; stride_b 0 = shared b
};

// Tasks 0..tasks-1, each one body(t) call: in the calling thread when `serial`, else one oneTBB
// task each (simple_partitioner: no task is split or merged).
template <class Body>
void run_tasks(int64_t tasks, bool serial, const Body& body) {
  if (serial) {
    for (int64_t t = 0; t < tasks; ++t) body(t);
    return;
  }
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, tasks, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t t = r.begin(); t < r.end(); ++t) body(t);
      },
      tbb::simple_partitioner());
}

// The few-row products' tasks: (batch item, chunk of outputs), each for all m rows, `gemv(bi,
// j0, j1)` computing outputs [j0, j1) of batch item bi. Chunks: for dot products ("rows", b
// [n, k]) enough rows that a task streams >= ~64 KiB of weights, and for one shared weight
// matrix (a decode step's projections) one contiguous range per thread, a single sequential
// stream; for the "cols" kernel at most `cols_most` outputs, in a number of chunks that is a
// multiple of the threads (the 2-core decode case has only 3 to 6 chunks of that size).
int64_t output_chunk(const Problem& p, int64_t cols_most) {
  const bool rows = p.tb;
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  int64_t chunk = std::max<int64_t>(16, (int64_t{16384} / std::max<int64_t>(p.k, 1) + 3) / 4 * 4);
  if (rows && p.batch == 1) chunk = std::max(chunk, (p.n + threads - 1) / threads);
  if (!rows) {
    const int64_t rounds = (p.n + cols_most * threads - 1) / (cols_most * threads);
    chunk = std::min(cols_most, ((p.n + threads * rounds - 1) / (threads * rounds) + 15) / 16 * 16);
  }
  return chunk;
}

template <class Gemv>
void over_output_chunks(const Problem& p, int64_t cols_most, const Gemv& gemv) {
  const int64_t chunk = output_chunk(p, cols_most);
  const int64_t chunks = (p.n + chunk - 1) / chunk;
  auto body = [&](int64_t t) {
    const int64_t bi = t / chunks, j0 = (t % chunks) * chunk;
    gemv(bi, j0, std::min(p.n, j0 + chunk));
  };
  const int64_t tasks = p.batch * chunks;
  run_tasks(tasks, tasks == 1, body);
}

// x's rows padded as matvec pads them (the "rows" kernels, more than two rows, K * 4 bytes
// near a multiple of 4 KiB): the padded stride, or 0 where matvec keeps x as it is.
int64_t padded_ldx(bool rows, int64_t m, int64_t k) {
  return rows && m > 2 && (k * int64_t{sizeof(float)}) % 4096 < 256 ? k + 16 : 0;
}

// Every output of c [batch, m, n], m <= kFewRows (a untransposed).
template <class W>
void matvec(const Problem& p, const float* a, const W* b, float* c) {
  const bool rows = p.tb;  // trans_b: b is [n, k]
  // The "rows" kernels read all the rows of x at the same offsets: at a stride of a multiple of
  // 4 KiB (K = 1024, 2048, 4096, ...) those fall in one L1 set and evict each other (batch 8
  // ran at a third of the speed), so more than two rows are copied to a padded stride.
  std::vector<float> padded;
  int64_t ldx = p.k, stride_x = p.stride_a;
  if (padded_ldx(rows, p.m, p.k)) {
    ldx = padded_ldx(rows, p.m, p.k);
    stride_x = p.m * ldx;
    padded.resize(static_cast<size_t>(p.batch * stride_x));
    for (int64_t bi = 0; bi < p.batch; ++bi)
      for (int64_t r = 0; r < p.m; ++r)
        std::copy_n(a + bi * p.stride_a + r * p.k, p.k, padded.data() + bi * stride_x + r * ldx);
    a = padded.data();
  }
  over_output_chunks(p, cols_chunk<W>(), [&](int64_t bi, int64_t j0, int64_t j1) {
    gemv(rows, p.m, a + bi * stride_x, ldx, b + bi * p.stride_b, p.k, rows ? p.k : p.n, j0, j1,
         p.alpha, p.beta, c + bi * p.stride_c, p.n);
  });
}

// bf16 rows of a against bf16 weights [n, k] (trans_b) on vdpbf16ps, in matvec's "rows" tasks.
void matvec_bf16dot(const Problem& p, const uint16_t* a, const uint16_t* b, float* c) {
  over_output_chunks(p, 0, [&](int64_t bi, int64_t j0, int64_t j1) {
    gemv_rows_bf16dot(p.m, a + bi * p.stride_a, p.k, b + bi * p.stride_b, p.k, p.k, j0, j1, p.alpha,
                      p.beta, c + bi * p.stride_c, p.n, matvec_streams(), matvec_prefetch());
  });
}

// bf16 rows of a against bf16 weights [n, k] (trans_b) on AMX tiles, in matvec's "rows" tasks;
// each batch item's rows packed once for all its tasks.
void matvec_amx(const Problem& p, const uint16_t* a, const uint16_t* b, float* c) {
  static_assert(kFewRows <= 16, "gemv_rows_amx takes at most 16 rows of x (one B tile)");
  const int64_t elems = amx_packed_x_elems(p.m, p.k);
  std::vector<uint16_t> packed(static_cast<size_t>(p.batch * elems));
  for (int64_t bi = 0; bi < p.batch; ++bi)
    pack_x_amx(p.m, a + bi * p.stride_a, p.k, p.k, packed.data() + bi * elems);
  over_output_chunks(p, 0, [&](int64_t bi, int64_t j0, int64_t j1) {
    gemv_rows_amx(p.m, packed.data() + bi * elems, b + bi * p.stride_b, p.k, p.k, j0, j1, p.alpha,
                  p.beta, c + bi * p.stride_c, p.n);
  });
}

// c = alpha op(a) op(b) + beta c over the batch, as single-threaded tiles run by oneTBB.
void gemm_f32(const Problem& p, const float* a, const float* b, float* c) {
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  const double flops = 2.0 * double(p.batch) * double(p.m) * double(p.n) * double(p.k);
  // Split each matrix into `threads` tiles unless the batch alone balances the threads (a whole
  // number of rounds, or enough items that a partial round costs little), and never for GEMMs so
  // small that a task costs more than it saves.
  int64_t parts = 1;
  const bool batch_balances = p.batch % threads == 0 || p.batch >= 4 * threads;
  if (threads > 1 && !batch_balances && flops >= 4e6) parts = threads;
  // Tiles along the longer of M and N; N tiles are multiples of 16 columns (64-byte rows of c).
  const bool split_m = p.m >= p.n;
  const int64_t align = split_m ? 1 : 16;
  const int64_t extent = split_m ? p.m : p.n;
  int64_t step = ((extent + parts - 1) / parts + align - 1) / align * align;
  step = std::max<int64_t>(step, 1);
  parts = (extent + step - 1) / step;
  const int64_t lda = p.ta ? p.m : p.k, ldb = p.tb ? p.k : p.n;
  auto body = [&](int64_t t) {
    const int64_t bi = t / parts, lo = (t % parts) * step, hi = std::min(extent, lo + step);
    Tile tile{p.ta,   p.tb,
              p.m,    p.n,
              p.k,    p.alpha,
              p.beta, a + bi * p.stride_a,
              lda,    b + bi * p.stride_b,
              ldb,    c + bi * p.stride_c,
              p.n};
    if (split_m) {
      tile.m = hi - lo;
      tile.a += p.ta ? lo : lo * lda;
      tile.c += lo * p.n;
    } else {
      tile.n = hi - lo;
      tile.b += p.tb ? lo * ldb : lo;
      tile.c += lo;
    }
    run_tile(tile);
  };
  const int64_t tasks = p.batch * parts;
  run_tasks(tasks, tasks == 1 || threads == 1, body);
}

// c = beta * c (K = 0: the product is empty). beta = 0 writes zeros even over NaN.
void scale_only(float beta, float* c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) c[i] = beta == 0.f ? 0.f : beta * c[i];
}

Shape leading(const Tensor& t) {
  return Shape(t.shape().begin(), t.shape().end() - 2);
}

std::string describe_call(const Tensor& a, const Tensor& b, const Tensor& c, bool ta, bool tb) {
  return fmt::format("cpu matmul(a={}, b={}, c={}, trans_a={}, trans_b={})", a.str(), b.str(),
                     c.str(), ta, tb);
}

}  // namespace

// bf16 x bf16 GEMMs on AVX512_BF16's dot products: where the CPU has them (and no AMX) and they
// outrun f32 FMAs, which is AMD's (twice on the Zen 4 EPYC of 2026-11-26; AMD has the
// instruction from Zen 4 on) and not Intel's (half on the Xeon this file was first measured
// on, where the SGEMM stays). Decided by the CPU, not by the start-up measurement: the path
// changes the bits of bf16 results, and a timing taken under load must not (two runs of one
// config on one machine gave different losses when it did). MT_CPU_BF16DOT=1 takes the path
// on any CPU that has the instruction, =0 on none.
namespace {
bool dot_gemm_pays() {
  static const bool kPays = [] {
    if (!dot_bf16_usable()) return false;
    if (bf16dot_choice() == 1) return true;
    return mt_cpu_is_amd();
  }();
  return kPays;
}
// The bf16 dot-product "rows" kernel for few rows (decode): where the GEMMs take the dot products
// (the same rule, so one CPU gives one set of bits), with the AVX-512 matrix-vector set;
// MT_CPU_MATVEC_BF16DOT=0 keeps the widening kernels.
bool matvec_bf16dot_on() {
  static const bool kOn = [] {
    if (!env_switch("MT_CPU_MATVEC_BF16DOT", true,
                    "decode's bf16 products keep the widening kernels (0) or take the bf16 "
                    "dot-product rows kernel where the GEMMs take dot products (1)"))
      return false;
    return dot_gemm_pays() && matvec_set() == MatvecSet::avx512;
  }();
  return kOn;
}
// The AMX rows kernel for few bf16 rows against [n, k] bf16 weights (decode's transposed
// projections): where AMX is usable, with the AVX-512 matrix-vector set (one CPU, one set of
// bits). The widening kernels streamed a batch of 8 bf16 rows at a quarter to half of the
// memory's rate on a 2-core Xeon with AMX, converting each weight vector twice for eight rows;
// tiles multiply 16 weight rows by all the rows of x at once. MT_CPU_MATVEC_AMX=0 keeps the
// widening kernels.
bool matvec_amx_on() {
  static const bool kOn = [] {
    if (!env_switch("MT_CPU_MATVEC_AMX", true,
                    "decode's bf16 and int8 products keep the vector kernels (0) or take the AMX "
                    "rows kernels where the CPU has AMX (1)"))
      return false;
    return amx_bf16_usable() && matvec_set() == MatvecSet::avx512;
  }();
  return kOn;
}
// Decode's int8 products on AMX-INT8 tiles (gemv_q8_amx), with the bf16 rows kernel above. On a
// 2-core Xeon with AMX the 512-bit VNNI kernel was arithmetic-bound from two rows of x on (x's
// sign flip, the lanes' conversion and FMA per row and pair of blocks): int8 batch-8 decode of
// llama-bench-1b ran at 0.6x bf16's on tiles.
bool matvec_q8_amx_on() {
  return matvec_amx_on() && amx_int8_usable();
}
// bf16 x bf16 products on mt's packed GEMM (gemm_bf16: AMX tiles or vdpbf16ps).
bool packed_bf16_gemm_on() {
  return amx_bf16_usable() || dot_gemm_pays();
}
}  // namespace

void load_blas() {
  (void)openblas();
}

void gemm_setup(int num_threads) {
  // Loads OpenBLAS (choosing its kernels) and measures the FMA peak now, at start-up, so neither
  // happens inside a timed step. OpenBLAS itself always runs one thread per call (see the top).
  (void)num_threads;
  (void)openblas();
  (void)core_peak();
  (void)amx_core_peak_flops();
  (void)dot_core_peak_flops();
}

bool few_rows_bf16dot() {
  return matvec_bf16dot_on() || matvec_amx_on();
}

std::string gemm_describe() {
  const OpenBlas& ob = openblas();
  const std::string bf16 =
      amx_bf16_usable() ? "bf16 x bf16 on AMX tiles (mt), other bf16 widened to f32"
      : dot_gemm_pays() ? "bf16 x bf16 on AVX512_BF16 dot products (mt), other bf16 widened to f32"
                        : "bf16 widened to f32";
  const std::string matvec =
      std::string(matvec_set_name()) +
      (matvec_bf16dot_on() ? " (bf16 x bf16 weight rows on AVX512_BF16 dot products)"
       : matvec_q8_amx_on()
           ? " (bf16 x bf16 weight rows on AMX tiles, int8 x int8 weight rows on AMX-INT8 tiles)"
       : matvec_amx_on() ? " (bf16 x bf16 weight rows on AMX tiles)"
                         : "") +
      (matvec_set() != MatvecSet::portable && matvec_streams() ? ", several weight streams a core"
       : matvec_set() == MatvecSet::avx512 && matvec_prefetch()
           ? ", one weight stream a core prefetched into L2"
           : "");
  if (!ob.sgemm)
    return fmt::format("portable mt GEMM, slow (OpenBLAS not usable: {}); {}; M=1: {}; CPU: {}",
                       ob.error, bf16, matvec, isa().str());
  return fmt::format(
      "{} {} kernels ({}), one OpenBLAS thread per oneTBB tile; {}; M=1: {}; CPU: {}", ob.version,
      ob.corename.empty() ? "?" : ob.corename, ob.coretype_origin, bf16, matvec, isa().str());
}

void sgemm_serial(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc) {
  run_tile(Tile{trans_a, trans_b, m, n, k, alpha, beta, a, lda, b, ldb, c, ldc});
}

bool sgemm_fast() {
  return openblas().sgemm != nullptr;
}

double cpu_peak_flops(DType dtype, int num_threads) {
  // Measured single-core rates times the thread count. bf16 matmuls with both operands in bf16 run
  // on AMX tiles where the CPU has them (measured tile rate), else on AVX512_BF16's dot products
  // where those measured faster than f32 FMAs (their rate); otherwise bf16 operands are widened
  // and run on the same f32 FMA units, so their peak is the f32 peak.
  const double per_core = dtype != DType::bf16 ? core_peak()
                          : amx_bf16_usable()  ? std::max(amx_core_peak_flops(), core_peak())
                          : dot_gemm_pays()    ? std::max(dot_core_peak_flops(), core_peak())
                                               : core_peak();
  return per_core * std::max(1, num_threads);
}

void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
            float beta) {
  auto fb = [](const Tensor& t) {
    return t.defined() && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  if (!fb(a) || !fb(b) || !fb(c) || a.ndim() < 2 || b.ndim() < 2 || c.ndim() < 2)
    fail(describe_call(a, b, c, trans_a, trans_b) +
         ": operands must be f32 or bf16 tensors of at least 2 dimensions");
  const int64_t m = trans_a ? a.dim(-1) : a.dim(-2);
  const int64_t k = trans_a ? a.dim(-2) : a.dim(-1);
  const int64_t kb = trans_b ? b.dim(-1) : b.dim(-2);
  const int64_t n = trans_b ? b.dim(-2) : b.dim(-1);
  const Shape lead = leading(a);
  const bool shared_b = b.ndim() == 2;
  if (k != kb || c.dim(-2) != m || c.dim(-1) != n || leading(c) != lead ||
      (!shared_b && leading(b) != lead))
    fail(describe_call(a, b, c, trans_a, trans_b) +
         ": shapes do not agree (a [..., M, K], b [..., K, N] or 2-D, c [..., M, N])");
  if (std::max({m, n, k}) > INT_MAX)
    fail(describe_call(a, b, c, trans_a, trans_b) + ": a dimension exceeds 2^31 - 1");

  Problem p{shape_numel(lead),    m,    n, k, trans_a, trans_b, alpha, beta, m * k,
            shared_b ? 0 : k * n, m * n};
  if (p.batch == 0 || m == 0 || n == 0) return;
  // A batch against one shared b with a untransposed is one tall GEMM: rows of a and c are
  // contiguous across the batch.
  if (shared_b && !trans_a && p.batch > 1) {
    p.m *= p.batch;
    p.batch = 1;
    if (p.m > INT_MAX) fail(describe_call(a, b, c, trans_a, trans_b) + ": a has too many rows");
  }

  // A few rows against shared weights (batched decode): the matrix-vector kernels read the
  // weights once for all of them, less traffic than widening (or tile-packing) bf16 weights for
  // a handful of rows or a GEMM's packing, and each row's result is what it alone would get.
  // With b shared and a untransposed the batch is already folded into M.
  const bool few = p.m == 1 || (shared_b && !trans_a && p.m <= kFewRows);
  // Few bf16 rows against [n, k] bf16 weights: the kernels that read both as they are.
  const bool bf16_rows = few && p.tb && a.dtype() == DType::bf16 && b.dtype() == DType::bf16;

  const bool packed_bf16 = k > 0 && !few && a.dtype() == DType::bf16 && b.dtype() == DType::bf16 &&
                           packed_bf16_gemm_on();
  if (packed_bf16 && c.dtype() == DType::bf16 && beta == 0.f) {
    // bf16 c written by the GEMM itself, rounded as store_bf16 would round the f32 results.
    for (int64_t bi = 0; bi < p.batch; ++bi)
      gemm_bf16(*c.backend(), p.ta, p.tb, p.m, p.n, p.k, alpha,
                a.ptr<const uint16_t>() + bi * p.stride_a, p.ta ? p.m : p.k,
                b.ptr<const uint16_t>() + bi * p.stride_b, p.tb ? p.k : p.n, 0.f, nullptr,
                c.ptr<uint16_t>() + bi * p.stride_c, p.n);
    return;
  }
  // bf16 c: computed in an f32 scratch (holding c's old values when beta needs them).
  Tensor c32 = c.dtype() == DType::f32 || beta != 0.f ? as_f32(c)
                                                      : c.backend()->empty(c.shape(), DType::f32);
  if (k == 0) {
    scale_only(beta, c32.ptr<float>(), c32.numel());
  } else if (bf16_rows && matvec_bf16dot_on()) {
    // bf16 rows against [n, k] bf16 weights (decode's transposed projections): vdpbf16ps reads
    // both as they are, with no widening of either.
    matvec_bf16dot(p, a.ptr<const uint16_t>(), b.ptr<const uint16_t>(), c32.ptr<float>());
  } else if (bf16_rows && matvec_amx_on()) {
    // The same on AMX tiles, which load the weight rows as they are.
    matvec_amx(p, a.ptr<const uint16_t>(), b.ptr<const uint16_t>(), c32.ptr<float>());
  } else if (few) {
    const Tensor a32 = as_f32(a);  // a few rows per batch item: cheap to widen
    if (b.dtype() == DType::bf16)
      matvec(p, a32.ptr<const float>(), b.ptr<const uint16_t>(), c32.ptr<float>());
    else
      matvec(p, a32.ptr<const float>(), b.ptr<const float>(), c32.ptr<float>());
  } else if (packed_bf16) {
    for (int64_t bi = 0; bi < p.batch; ++bi)
      gemm_bf16(*c.backend(), p.ta, p.tb, p.m, p.n, p.k, alpha,
                a.ptr<const uint16_t>() + bi * p.stride_a, p.ta ? p.m : p.k,
                b.ptr<const uint16_t>() + bi * p.stride_b, p.tb ? p.k : p.n, beta,
                c32.ptr<float>() + bi * p.stride_c, nullptr, p.n);
  } else {
    const Tensor a32 = as_f32(a), b32 = as_f32(b);
    gemm_f32(p, a32.ptr<const float>(), b32.ptr<const float>(), c32.ptr<float>());
  }
  if (c.dtype() != DType::f32) store_bf16(c32, c);
}

void grouped_matvec(const Tensor& x, const Tensor& w, const std::vector<int32_t>& off,
                    const std::vector<int64_t>& experts, bool trans_w, Tensor& out) {
  const int64_t m_all = x.dim(0), k = x.dim(1), n = out.dim(1);
  const bool wbf = w.dtype() == DType::bf16;
  Tensor out32 = out.dtype() == DType::f32 ? out : out.backend()->empty(out.shape(), DType::f32);
  // The kernels matmul picks for one expert's few rows (bit for bit its products): bf16 dot
  // products, AMX tiles (each expert's rows packed once for all its tasks), or x widened to f32
  // (and padded as matvec pads it: a layout, not arithmetic).
  const bool bf16_rows = trans_w && x.dtype() == DType::bf16 && wbf;
  const bool dot = bf16_rows && matvec_bf16dot_on();
  const bool amx = bf16_rows && !dot && matvec_amx_on();
  Tensor x32;
  std::vector<float> padded;
  std::vector<uint16_t> packed;  // amx: each expert's rows packed at packed_at[e]
  std::vector<int64_t> packed_at;
  const float* xf = nullptr;
  int64_t ldx = k, most = 0;
  for (const int64_t e : experts) most = std::max<int64_t>(most, off[e + 1] - off[e]);
  if (amx) {
    packed_at.assign(off.size(), 0);
    int64_t total = 0;
    for (const int64_t e : experts) {
      packed_at[static_cast<size_t>(e)] = total;
      total += amx_packed_x_elems(off[e + 1] - off[e], k);
    }
    packed.resize(static_cast<size_t>(total));
    for (const int64_t e : experts)
      pack_x_amx(off[e + 1] - off[e], x.ptr<const uint16_t>() + off[e] * k, k, k,
                 packed.data() + packed_at[static_cast<size_t>(e)]);
  } else if (!dot) {
    x32 = as_f32(x);
    xf = x32.ptr<const float>();
    if (const int64_t ld = padded_ldx(trans_w, most, k)) {
      ldx = ld;
      padded.assign(static_cast<size_t>(m_all * ldx), 0.f);
      for (int64_t r = 0; r < m_all; ++r) std::copy_n(xf + r * k, k, padded.data() + r * ldx);
      xf = padded.data();
    }
  }
  struct Task {
    int64_t e, j0, j1;
  };
  std::vector<Task> tasks;
  for (const int64_t e : experts) {
    const int64_t rows = off[e + 1] - off[e];
    const Problem p{1, rows, n, k, false, trans_w, 1.f, 0.f, 0, 0, 0};
    const int64_t chunk =
        output_chunk(p, dot || amx ? 0 : (wbf ? cols_chunk<uint16_t>() : cols_chunk<float>()));
    for (int64_t j = 0; j < n; j += chunk) tasks.push_back({e, j, std::min(n, j + chunk)});
  }
  const int64_t ldw = trans_w ? k : n;
  run_tasks(static_cast<int64_t>(tasks.size()), tasks.size() == 1, [&](int64_t i) {
    const Task& t = tasks[static_cast<size_t>(i)];
    const int64_t r0 = off[t.e], rows = off[t.e + 1] - r0;
    float* y = out32.ptr<float>() + r0 * n;
    if (dot)
      gemv_rows_bf16dot(rows, x.ptr<const uint16_t>() + r0 * k, k,
                        w.ptr<const uint16_t>() + t.e * n * k, k, k, t.j0, t.j1, 1.f, 0.f, y, n,
                        matvec_streams(), matvec_prefetch());
    else if (amx)
      gemv_rows_amx(rows, packed.data() + packed_at[static_cast<size_t>(t.e)],
                    w.ptr<const uint16_t>() + t.e * n * k, k, k, t.j0, t.j1, 1.f, 0.f, y, n);
    else if (wbf)
      gemv(trans_w, rows, xf + r0 * ldx, ldx, w.ptr<const uint16_t>() + t.e * n * k, k, ldw, t.j0,
           t.j1, 1.f, 0.f, y, n);
    else
      gemv(trans_w, rows, xf + r0 * ldx, ldx, w.ptr<const float>() + t.e * n * k, k, ldw, t.j0,
           t.j1, 1.f, 0.f, y, n);
  });
  if (out.dtype() != DType::f32) store_bf16(out32, out);
}

// ---- int8 weights (mt/q8.h) -------------------------------------------------------------------

namespace {

// Decode's int8 products (M <= kFewRows rows of x): each row of x is quantized as the weights
// are, in blocks of 32 (q8_0 activations, as llama.cpp's q8_0 x q8_0 dot products and MaxText's
// int8, which quantizes both operands), except that its scale stays f32 (a row of x is made and
// read once: its scale's bytes cost nothing; the weights' are f16, mt/q8.h) and its values round
// half to even (the vector conversion's rounding). Its rows are q8x_row_bytes(k) long. A block's 32
// products are then summed exactly in int32, four consecutive ones to each of 8 lanes
// (AVX512-VNNI's vpdpbusd, or AVX2's maddubs + madd, on |w| and x * sign(w): the same lanes, the
// same integers), and each block's lanes enter one of two f32 accumulators (even and odd blocks) as
// fma(scale_w * scale_x, float(lanes), acc); then (acc0 + acc1) and the lanes in hsum8's order.
// Every kernel set (portable, AVX2, AVX-512; several rows on AVX-512 VNNI two blocks a zmm)
// computes those operations in that order, so they give the same bits, and a row's outputs do
// not depend on the rows beside it. Where AMX-INT8 is usable (with matvec_amx_on) the products
// take gemm_amx.cpp's contract instead (gemv_q8_amx on tiles for 2-8 rows, gemv_q8_blocks16_streams
// for one): each block's 32 products one exact sum, 16 accumulators by block index mod 16, then
// their sum in a fixed order; other bits than the vector sets' (as bf16's AMX rows), the same
// for one row and for eight. A row of x with a
// NaN or an infinity is not quantized: its outputs are f32 dot products with the widened
// weights (dot_q8_f32), so the NaN or infinity comes through.
//
// The weights are one sequential stream per task (rows [j0, j1), contiguous), prefetched
// kQ8Prefetch bytes ahead (past a row's end: the next row). With a few cycles of integer
// arithmetic per 64-byte line, one core's demand misses and the hardware prefetchers alone left
// the memory's latency exposed: on the Zen 4 here (two threads, gemm_bench's BM_MatVecQ8Stream
// K=2048 N=5632, 1 row, ten pairs interleaved with and without) 26-34 GB/s without it, 32-44
// with it (ahead in nine pairs, level in one). The f32 and bf16 "rows" kernels do without: in
// the same A/B bf16 widened on AVX2 read 26-31 GB/s with a prefetch against 30-49 without
// (without ahead in nine pairs, 1% behind in one), on AVX-512 29-41 against 31-46 (without
// ahead in all ten), and f32 decode of llama-bench-1b was no faster with one.
constexpr int64_t kQ8Prefetch = 2048;
constexpr int64_t kQ8BlockBytes = kQ8Block + 2;  // a weight block and its f16 scale

// A quantized row of x: its k values, then k / 32 f32 scales.
int64_t q8x_row_bytes(int64_t k) {
  return k + k / kQ8Block * 4;
}

// Block b's scale of a weight row (f16, mt/q8.h) by F16C: the bits of mt::q8_scale.
MT_AVX2 inline float q8_scale_f16c(const int8_t* row, int64_t k, int64_t b) {
  uint16_t h;
  std::memcpy(&h, row + k + b * 2, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

// x's row [k] -> out [q8x_row_bytes(k)] by the rule above; false (out unwritten) when the row
// holds a NaN or an infinity.
bool quantize_x_q8(const float* x, int64_t k, int8_t* out) {
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* v = x + b * kQ8Block;
    float amax = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i) {
      if (!std::isfinite(v[i])) return false;
      amax = std::max(amax, std::fabs(v[i]));
    }
    const float scale = amax / 127.f;
    const float inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i)
      out[b * kQ8Block + i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    std::memcpy(out + k + b * 4, &scale, 4);
  }
  return true;
}

MT_AVX2 inline float hmax8(__m256 v) {
  __m128 q = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  q = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(q, _mm_shuffle_ps(q, q, 1)));
}

MT_AVX2 bool quantize_x_q8_avx2(const float* x, int64_t k, int8_t* out) {
  const __m256 sign = _mm256_set1_ps(-0.f), inf = _mm256_set1_ps(INFINITY);
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float* v = x + b * kQ8Block;
    __m256 xs[4], m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int u = 0; u < 4; ++u) {
      xs[u] = _mm256_loadu_ps(v + 8 * u);
      const __m256 a = _mm256_andnot_ps(sign, xs[u]);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // NaN or infinity
      m = _mm256_max_ps(m, a);
    }
    if (!_mm256_testz_ps(bad, bad)) return false;
    const float amax = hmax8(m);
    const float scale = amax / 127.f;
    const __m256 inv = _mm256_set1_ps(scale > 0.f ? 1.f / scale : 0.f);
    // Round half to even (MXCSR's default), then int32 -> int8 (|q| <= 127: no saturation).
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(xs[0], inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(xs[1], inv));
    const __m256i q2 = _mm256_cvtps_epi32(_mm256_mul_ps(xs[2], inv));
    const __m256i q3 = _mm256_cvtps_epi32(_mm256_mul_ps(xs[3], inv));
    // packs work within 128-bit lanes: the permute puts the 32 bytes back in order.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kQ8Block),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    std::memcpy(out + k + b * 4, &scale, 4);
  }
  return true;
}

// One block's 8 int32 lanes of x . w (portable): lane l sums products 4 l .. 4 l + 3.
inline void q8_block_lanes(const int8_t* w, const int8_t* x, int32_t* lanes) {
  for (int l = 0; l < 8; ++l) {
    int32_t s = 0;
    for (int i = 4 * l; i < 4 * l + 4; ++i) s += int32_t(w[i]) * int32_t(x[i]);
    lanes[l] = s;
  }
}

// hsum8's order on eight floats.
inline float hsum8_portable(const float* v) {
  const float q[4] = {v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]};
  return (q[0] + q[2]) + (q[1] + q[3]);
}

float dot_q8q8_portable(const int8_t* xq, const int8_t* row, int64_t k) {
  float acc[2][8] = {};
  int32_t lanes[8];
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    const float sw = q8_scale(row, k, b);
    float sx;
    std::memcpy(&sx, xq + k + b * 4, 4);
    const float s = sw * sx;
    q8_block_lanes(row + b * kQ8Block, xq + b * kQ8Block, lanes);
    for (int l = 0; l < 8; ++l) acc[b & 1][l] = std::fma(s, float(lanes[l]), acc[b & 1][l]);
  }
  float v[8];
  for (int l = 0; l < 8; ++l) v[l] = acc[0][l] + acc[1][l];
  return hsum8_portable(v);
}

// A row of x that could not be quantized (NaN or infinity): f32 products with the widened
// weights, so that they reach the outputs.
float dot_q8_f32(const float* x, const int8_t* row, int64_t k) {
  float t = 0.f;
  for (int64_t b = 0; b < k / kQ8Block; ++b) {
    float p = 0.f;
    for (int64_t i = 0; i < kQ8Block; ++i)
      p += x[b * kQ8Block + i] * static_cast<float>(row[b * kQ8Block + i]);
    t += q8_scale(row, k, b) * p;
  }
  return t;
}

#define MT_AVX2_VNNI MT_TARGET("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")

// A block's 8 lanes from |w| and x * sign(w): AVX2's maddubs (pairs, at most 2 * 128 * 127 in
// int16) then madd with ones (pairs of pairs), or one AVX512-VNNI vpdpbusd: the same sums.
MT_AVX2 inline __m256i q8_lanes_avx2(__m256i aw, __m256i sx) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), _mm256_set1_epi16(1));
}
MT_AVX2_VNNI inline __m256i q8_lanes_vnni(__m256i aw, __m256i sx) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), aw, sx);
}

// X quantized rows of x against S q8 rows, into out[s * X + i]: per block and weight row |w|
// once, then per row of x its values times sign(w), the lanes, and the fma into the block
// parity's accumulator. Decode's few rows take X up to 4 against one weight row; one row of x
// takes S = 4 weight rows side by side (four sequential streams, as the f32 and bf16 one-row
// kernels read them: gemv_row_streams_avx2). Each (row of x, weight row) sum is the same
// operations in the same order whatever X and S. Written once for both targets by macros (a
// function without the target cannot hold their intrinsics, a lambda does not take its
// caller's, and the AVX2 one must not be compiled with AVX-512).
#define MT_Q8_BLOCK(LANES, B, T)                                                              \
  {                                                                                           \
    _Pragma("GCC unroll 4") for (int s = 0; s < S; ++s) {                                     \
      const __m256i w =                                                                       \
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[s] + (B)*kQ8Block));       \
      const __m256i aw = _mm256_sign_epi8(w, w);                                              \
      const float sw = q8_scale_f16c(rows[s], k, (B));                                        \
      _Pragma("GCC unroll 4") for (int i = 0; i < X; ++i) {                                   \
        const __m256i xv =                                                                    \
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq[i] + (B)*kQ8Block));       \
        float sx;                                                                             \
        std::memcpy(&sx, xq[i] + k + (B)*4, 4);                                               \
        T[s][i] =                                                                             \
            _mm256_fmadd_ps(_mm256_set1_ps(sw * sx),                                          \
                            _mm256_cvtepi32_ps(LANES(aw, _mm256_sign_epi8(xv, w))), T[s][i]); \
      }                                                                                       \
    }                                                                                         \
  }

#define MT_DEFINE_DOT_Q8(NAME, TARGET, LANES)                                                   \
  template <int X, int S>                                                                       \
  TARGET void NAME(const int8_t* const* xq, const int8_t* const* rows, int64_t k, float* out) { \
    __m256 t0[S][X], t1[S][X];                                                                  \
    _Pragma("GCC unroll 4") for (int s = 0; s < S; ++s)                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < X; ++i) t0[s][i] = t1[s][i] =               \
            _mm256_setzero_ps();                                                                \
    const int64_t blocks = k / kQ8Block;                                                        \
    int64_t b = 0;                                                                              \
    for (; b + 2 <= blocks; b += 2) {                                                           \
      /* Each stream's lines ahead: a block and its scale are 34 bytes, two blocks 68. */       \
      _Pragma("GCC unroll 4") for (int s = 0; s < S; ++s) {                                     \
        const char* ahead = reinterpret_cast<const char*>(rows[s]) + kQ8Prefetch;               \
        _mm_prefetch(ahead + b * kQ8BlockBytes, _MM_HINT_T0);                                   \
        _mm_prefetch(ahead + b * kQ8BlockBytes + 64, _MM_HINT_T0);                              \
      }                                                                                         \
      MT_Q8_BLOCK(LANES, b, t0)                                                                 \
      MT_Q8_BLOCK(LANES, b + 1, t1)                                                             \
    }                                                                                           \
    if (b < blocks) MT_Q8_BLOCK(LANES, b, t0)                                                   \
    _Pragma("GCC unroll 4") for (int s = 0; s < S; ++s)                                         \
        _Pragma("GCC unroll 4") for (int i = 0; i < X; ++i) out[s * X + i] =                    \
            hsum8(_mm256_add_ps(t0[s][i], t1[s][i]));                                           \
  }

MT_DEFINE_DOT_Q8(dot_q8_avx2, MT_AVX2, q8_lanes_avx2)
MT_DEFINE_DOT_Q8(dot_q8_vnni, MT_AVX2_VNNI, q8_lanes_vnni)
#undef MT_DEFINE_DOT_Q8
#undef MT_Q8_BLOCK

#define MT_VNNI512 MT_TARGET("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

// X quantized rows of x against one q8 row, two blocks an instruction on AVX-512 VNNI (decode's
// few rows; one row of x keeps the 4-stream kernel above): a zmm holds block b's 8 lanes below
// and block b + 1's above, so the low half is the even blocks' accumulator and the high half
// the odd ones', as in MT_Q8_BLOCK. x * sign(w) as x negated where w < 0 (AVX-512 has no vpsignb;
// where w is 0 its product is 0 either way, |x| <= 127); the scales sw * sx as a vector product
// of the weight's pair of scales and x's (`sx`: per row of x, per pair of blocks, sx_b eight
// times then sx_b+1, from q8_x_scale_pairs), rounded as the scalar product is. All X rows at
// once: the weight row is read once. Each sum is dot_q8_vnni's to the bit (an odd last block
// adds into the low half only).
template <int X>
MT_VNNI512 void dot_q8_rows_vnni512(const int8_t* const* xq, const float* const* sx,
                                    const int8_t* row, int64_t k, float* out) {
  __m512 t[X];
#pragma GCC unroll 8
  for (int i = 0; i < X; ++i) t[i] = _mm512_setzero_ps();
  const int64_t blocks = k / kQ8Block;
  auto step = [&](int64_t b, bool pair) MT_VNNI512 {
    // Two blocks, or the last one with zeros above (load_pair: the emulated build's intrinsics).
    auto load_pair = [&](const int8_t* p) MT_VNNI512 {
      return pair ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(__mmask32(0xffff), p);
    };
    const __m512i w = load_pair(row + b * kQ8Block);
    const __m512i aw = _mm512_abs_epi8(w);
    const __mmask64 neg = _mm512_movepi8_mask(w);
    // The pair's two f16 scales in one conversion (an odd last block's alone: the 2 bytes
    // after its scale are past the row), block b's in the low 8 lanes, b + 1's in the high.
    int32_t hs = 0;
    std::memcpy(&hs, row + k + b * 2, pair ? 4 : 2);
    // maskz forms: the unmasked intrinsics start from _mm512_undefined (see load16).
    const __m512 swv = _mm512_maskz_permutexvar_ps(
        0xffff, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
        _mm512_maskz_broadcast_f32x4(0xffff, _mm_cvtph_ps(_mm_cvtsi32_si128(hs))));
#pragma GCC unroll 8
    for (int i = 0; i < X; ++i) {
      const __m512i xv = load_pair(xq[i] + b * kQ8Block);
      const __m512i sxv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
      const __m512 scale = _mm512_mul_ps(swv, _mm512_load_ps(sx[i] + b / 2 * 16));
      const __m512 lanes =
          _mm512_maskz_cvtepi32_ps(0xffff, _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sxv));
      const __m512 sum = _mm512_fmadd_ps(scale, lanes, t[i]);
      t[i] = pair ? sum : _mm512_mask_blend_ps(__mmask16(0x00ff), t[i], sum);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(row) + kQ8Prefetch + b * kQ8Block, _MM_HINT_T0);
    step(b, true);
  }
  if (b < blocks) step(b, false);
#pragma GCC unroll 8
  for (int i = 0; i < X; ++i)
    out[i] = hsum8(_mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, t[i], 0),
                                 _mm512_maskz_extractf32x8_ps(0xff, t[i], 1)));
}

// A quantized row of x's scales for dot_q8_rows_vnni512: per pair of blocks 16 floats, sx_b
// eight times then sx_b+1 (0 past the last block), into out (64-byte aligned).
void q8_x_scale_pairs(const int8_t* xq, int64_t k, float* out) {
  const int64_t blocks = k / kQ8Block;
  for (int64_t b = 0; b < (blocks + 1) / 2 * 2; ++b) {
    float v = 0.f;
    if (b < blocks) std::memcpy(&v, xq + k + b * 4, 4);
    std::fill_n(out + b / 2 * 16 + (b % 2) * 8, 8, v);
  }
}

enum class Q8Kernels { portable, avx2, vnni };

Q8Kernels q8_kernels() {
  switch (matvec_set()) {
    case MatvecSet::avx512:
      return isa().avx512_vnni ? Q8Kernels::vnni : Q8Kernels::avx2;
    case MatvecSet::avx2:
      return Q8Kernels::avx2;
    default:
      return Q8Kernels::portable;
  }
}

template <int X, int S>
void dot_q8(Q8Kernels set, const int8_t* const* xq, const int8_t* const* rows, int64_t k,
            float* out) {
  if (set == Q8Kernels::vnni)
    dot_q8_vnni<X, S>(xq, rows, k, out);
  else
    dot_q8_avx2<X, S>(xq, rows, k, out);
}

// Whether more than one quantized row of x takes dot_q8_rows_vnni512 (AVX-512 VNNI; the
// MT_CPU_Q8_WIDE=0 switch keeps the 256-bit kernel, for comparisons).
bool q8_wide_rows() {
  static const bool kOn = env_switch("MT_CPU_Q8_WIDE", true,
                                     "decode's int8 products of several rows keep the 256-bit "
                                     "kernel (0) or take the 512-bit one on AVX-512 VNNI (1)");
  return kOn;
}

constexpr int kQ8Streams = 4;

// One quantized row of x against rows [j0, j1) of w, kQ8Streams streams at once (rows j, j + h,
// ...: h = ceil((j1 - j0) / kQ8Streams)).
void gemv_q8_streams(Q8Kernels set, const int8_t* xq, const int8_t* w, int64_t rb, int64_t k,
                     int64_t j0, int64_t j1, float* y) {
  q8_stream_rows<kQ8Streams>(w, rb, j0, j1, y, [&](auto n, const int8_t* const* rows, float* sums) {
    dot_q8<1, n()>(set, &xq, rows, k, sums);
  });
}

// y [m, n] rows [j0, j1) = x [m, k] against q8 rows of w (row stride rb): xq holds x's rows
// quantized (stride rx), ok[r] whether row r is; x32 the f32 rows for those that are not.
void gemv_q8(int64_t m, const int8_t* xq, int64_t rx, const bool* ok, const float* x32,
             const int8_t* w, int64_t rb, int64_t k, int64_t j0, int64_t j1, float* y,
             int64_t ldy) {
  if (matvec_q8_amx_on()) {
    // AMX-INT8 (gemv_q8_amx): x's quantized rows packed as one B tile a pair of blocks, for
    // any count (one row too: the same bits alone as in a batch).
    static_assert(kFewRows <= 8, "gemv_q8_amx takes at most 8 rows of x (two blocks a tile)");
    int64_t idx[kFewRows], nq = 0;
    const int8_t* xs[kFewRows] = {};
    for (int64_t r = 0; r < m; ++r)
      if (ok[r]) {
        xs[nq] = xq + r * rx;
        idx[nq++] = r;
      }
    if (nq == 1) {
      gemv_q8_blocks16_streams(xs[0], w, rb, k, j0, j1, y + idx[0] * ldy);
    } else if (nq > 1) {
      const int64_t cols = amx_q8_cols(nq);
      std::vector<int8_t> xp(static_cast<size_t>(amx_q8_packed_bytes(cols, k)));
      std::vector<float> sx(static_cast<size_t>((k / kQ8Block + 1) / 2 * 16));
      pack_xq_amx(nq, cols, xs, k, xp.data(), sx.data());
      gemv_q8_amx(nq, cols, xp.data(), sx.data(), w, rb, k, j0, j1, y, ldy, idx);
    }
    for (int64_t r = 0; r < m; ++r)
      if (!ok[r])
        for (int64_t j = j0; j < j1; ++j) y[r * ldy + j] = dot_q8_f32(x32 + r * k, w + j * rb, k);
    return;
  }
  const Q8Kernels set = q8_kernels();
  if (m == 1 && ok[0] && set != Q8Kernels::portable && matvec_streams()) {
    gemv_q8_streams(set, xq, w, rb, k, j0, j1, y);
    return;
  }
  // The quantized rows, in groups of up to 4 that share each weight block's loads (all of them
  // at once on AVX-512 VNNI).
  int64_t idx[kFewRows], nq = 0;
  for (int64_t r = 0; r < m; ++r)
    if (ok[r]) idx[nq++] = r;
  const bool wide = set == Q8Kernels::vnni && nq > 1 && q8_wide_rows();
  // wide: the rows' blocks and their scale pairs (q8_x_scale_pairs), once for the task's rows.
  const int8_t* wide_x[kFewRows] = {};
  const float* wide_sx[kFewRows] = {};
  std::vector<float> scales;
  if (wide) {
    const int64_t pair_floats = (k / kQ8Block + 1) / 2 * 16;
    scales.resize(static_cast<size_t>(nq * pair_floats + 16));
    float* base = scales.data() + (16 - reinterpret_cast<uintptr_t>(scales.data()) % 64 / 4) % 16;
    for (int64_t i = 0; i < nq; ++i) {
      wide_x[i] = xq + idx[i] * rx;
      wide_sx[i] = base + i * pair_floats;
      q8_x_scale_pairs(wide_x[i], k, base + i * pair_floats);
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    const int8_t* row = w + j * rb;
    if (wide) {
      float s[kFewRows] = {};
      with_count<8>(nq, [&](auto c) { dot_q8_rows_vnni512<c()>(wide_x, wide_sx, row, k, s); });
      for (int64_t i = 0; i < nq; ++i) y[idx[i] * ldy + j] = s[i];
    }
    for (int64_t g = 0; !wide && g < nq; g += 4) {
      const int64_t nx = std::min<int64_t>(4, nq - g);
      const int8_t* xs[4] = {};
      float s[4] = {};
      for (int64_t i = 0; i < nx; ++i) xs[i] = xq + idx[g + i] * rx;
      if (set == Q8Kernels::portable) {
        for (int64_t i = 0; i < nx; ++i) s[i] = dot_q8q8_portable(xs[i], row, k);
      } else {
        with_count<4>(nx, [&](auto c) { dot_q8<c(), 1>(set, xs, &row, k, s); });
      }
      for (int64_t i = 0; i < nx; ++i) y[idx[g + i] * ldy + j] = s[i];
    }
    for (int64_t r = 0; r < m; ++r)
      if (!ok[r]) y[r * ldy + j] = dot_q8_f32(x32 + r * k, row, k);
  }
}

}  // namespace

void matmul_q8(const Tensor& x, const Tensor& w, Tensor& y) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() >= 1 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  const int64_t k = fb(x) ? x.dim(-1) : 0;
  if (!(fb(x) && fb(y) && w.defined() && w.dtype() == DType::i8 && w.ndim() == 2 &&
        k % kQ8Block == 0 && w.dim(1) == q8_row_bytes(k) && y.dim(-1) == w.dim(0) &&
        x.numel() / std::max<int64_t>(k, 1) * w.dim(0) == y.numel()))
    fail("matmul_q8: x " + (x.defined() ? x.str() : std::string("none")) + ", w " +
         (w.defined() ? w.str() : std::string("none")) + ", y " +
         (y.defined() ? y.str() : std::string("none")) +
         " (want x [..., K] with K a multiple of 32, w i8 [N, K + K / 16], y [..., N])");
  const int64_t n = w.dim(0), m = k ? x.numel() / k : 0, rb = w.dim(1);
  if (m == 0 || n == 0) return;
  const auto* q = w.ptr<const int8_t>();
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  if (m > kFewRows) {
    // A prefill: a GEMM against the dequantized rows, in bf16 when x is (rounded once more, as
    // a bf16 model's weights are). Where the bf16 x bf16 GEMM runs (AMX or AVX512_BF16 dot
    // products) it dequantizes the blocks as it packs them; else the rows are dequantized once
    // per call into a tensor for the f32 GEMM.
    const bool bf = x.dtype() == DType::bf16;
    if (bf && packed_bf16_gemm_on()) {
      const bool f32 = y.dtype() == DType::f32;
      gemm_bf16_q8(*y.backend(), m, n, k, x.ptr<const uint16_t>(), k, q, rb,
                   f32 ? y.ptr<float>() : nullptr, f32 ? nullptr : y.ptr<uint16_t>(), n);
      return;
    }
    // f32 either way: the f32 GEMM would widen bf16 weights anyway. With bf16 x each product is
    // rounded to bf16 as it is made (then widened back, exactly), the values a bf16 GEMM gets.
    Tensor wf = w.backend()->empty({n, k}, DType::f32);
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, n, 16),
                      [&](const tbb::blocked_range<int64_t>& rs) {
                        std::vector<uint16_t> rounded(bf ? static_cast<size_t>(k) : 0);
                        for (int64_t r = rs.begin(); r < rs.end(); ++r) {
                          float* out = wf.ptr<float>() + r * k;
                          dequantize_q8_row(q + r * rb, k, out);
                          if (bf) {
                            f32_to_bf16_n(out, rounded.data(), k);
                            bf16_to_f32_n(rounded.data(), out, k);
                          }
                        }
                      });
    Tensor y2 = y.view({m, n});
    matmul(x.view({m, k}), wf, y2, false, true, 1.f, 0.f);
    return;
  }
  const Tensor x32 = as_f32(x);
  Tensor y32 = y.dtype() == DType::f32 ? y : y.backend()->empty(y.shape(), DType::f32);
  // x's rows quantized once for every task (decode: m * k values against n * k weights).
  const int64_t rx = q8x_row_bytes(k);
  std::vector<int8_t> xq(static_cast<size_t>(m * rx));
  bool ok[kFewRows];
  const bool avx2 = q8_kernels() != Q8Kernels::portable;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x32.ptr<const float>() + r * k;
    int8_t* out = xq.data() + r * rx;
    ok[r] = avx2 ? quantize_x_q8_avx2(xr, k, out) : quantize_x_q8(xr, k, out);
  }
  // One contiguous range of rows per thread: one sequential stream, as the "rows" kernels.
  const int64_t chunk = std::max<int64_t>(16, (n + threads - 1) / threads);
  const int64_t chunks = (n + chunk - 1) / chunk;
  tbb::parallel_for(
      tbb::blocked_range<int64_t>(0, chunks, 1),
      [&](const tbb::blocked_range<int64_t>& r) {
        for (int64_t c = r.begin(); c < r.end(); ++c)
          gemv_q8(m, xq.data(), rx, ok, x32.ptr<const float>(), q, rb, k, c * chunk,
                  std::min(n, (c + 1) * chunk), y32.ptr<float>(), n);
      },
      tbb::simple_partitioner());
  if (y.dtype() != DType::f32) store_bf16(y32, y);
}

void grouped_matmul_q8(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts,
                       Tensor& y) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() == 2 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  int64_t m = 0;
  bool few = true, ok = fb(x) && fb(y) && w.defined() && w.dtype() == DType::i8 && w.ndim() == 3 &&
                        counts.size() == static_cast<size_t>(w.dim(0));
  for (const int64_t c : counts) {
    ok = ok && c >= 0;
    few = few && c <= kFewRows;
    m += c;
  }
  const int64_t k = ok ? x.dim(1) : 0;
  if (!(ok && k % kQ8Block == 0 && w.dim(2) == q8_row_bytes(k) && m == x.dim(0) && y.dim(0) == m &&
        y.dim(1) == w.dim(1)))
    fail("grouped_matmul_q8: x " + (x.defined() ? x.str() : std::string("none")) + ", w " +
         (w.defined() ? w.str() : std::string("none")) + ", y " +
         (y.defined() ? y.str() : std::string("none")) + " and " + std::to_string(counts.size()) +
         " counts (want x [M, K] with K a multiple of 32, w i8 [E, N, K + K / 16], y [M, N] and E "
         "counts of rows, at least 0, summing to M)");
  const int64_t n = w.dim(1), rb = w.dim(2);
  if (m == 0 || n == 0) return;
  const auto* q = w.ptr<const int8_t>();
  if (!few) {  // a prefill: each expert's GEMM splits itself
    int64_t r = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      if (counts[e] == 0) continue;
      const auto ei = static_cast<int64_t>(e);
      Tensor ye = y.slice0(r, r + counts[e]);
      matmul_q8(x.slice0(r, r + counts[e]), w.slice0(ei, ei + 1).view({n, rb}), ye);
      r += counts[e];
    }
    return;
  }
  // Decode: matmul_q8's few-row products (each row of x quantized once, its outputs what
  // matmul_q8 alone gives it), every expert's ranges of weight rows in one fork: the threads
  // stream the experts' weights one after another instead of joining after each expert.
  const Tensor x32 = as_f32(x);
  Tensor y32 = y.dtype() == DType::f32 ? y : y.backend()->empty(y.shape(), DType::f32);
  const int64_t rx = q8x_row_bytes(k);
  std::vector<int8_t> xq(static_cast<size_t>(m * rx));
  const auto good = std::make_unique<bool[]>(static_cast<size_t>(m));
  const bool avx2 = q8_kernels() != Q8Kernels::portable;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x32.ptr<const float>() + r * k;
    int8_t* out = xq.data() + r * rx;
    good[r] = avx2 ? quantize_x_q8_avx2(xr, k, out) : quantize_x_q8(xr, k, out);
  }
  const int64_t threads = std::max(1, tbb::this_task_arena::max_concurrency());
  const int64_t chunk = std::max<int64_t>(16, (n + threads - 1) / threads);
  struct Task {
    int64_t e, r0, rows, j0, j1;
  };
  std::vector<Task> tasks;
  int64_t r0 = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] > 0)
      for (int64_t j = 0; j < n; j += chunk)
        tasks.push_back({static_cast<int64_t>(e), r0, counts[e], j, std::min(n, j + chunk)});
    r0 += counts[e];
  }
  auto body = [&](const Task& t) {
    gemv_q8(t.rows, xq.data() + t.r0 * rx, rx, good.get() + t.r0, x32.ptr<const float>() + t.r0 * k,
            q + t.e * n * rb, rb, k, t.j0, t.j1, y32.ptr<float>() + t.r0 * n, n);
  };
  tbb::parallel_for(
      tbb::blocked_range<size_t>(0, tasks.size(), 1),
      [&](const tbb::blocked_range<size_t>& r) {
        for (size_t i = r.begin(); i < r.end(); ++i) body(tasks[i]);
      },
      tbb::simple_partitioner());
  if (y.dtype() != DType::f32) store_bf16(y32, y);
}

}  // namespace mt::cpu
