// GEMM benchmarks of the CPU backend, against ceilings measured in this same binary.
//
// - FmaPeak: f32 FMA FLOP/s of all threads (independent AVX-512 FMA chains; AVX2 without it).
// - Matmul: transformer shapes through Backend::matmul, forward (x @ W) and the two products a
//   backward does (dx = dy @ W^T, dW = x^T @ dy): f32, bf16 weights, all-bf16. Counters: GFLOP/s
//   and pct_peak (share of FmaPeak's measured f32 FMA peak; all-bf16 runs on AMX tiles where the
//   CPU has them, so it can exceed 100); best_* of the fastest call; cpu_pct_peak per CPU-second
//   used (for machines shared with other work).
// - ReadBandwidth / MatVec: batch-1 decode (M = 1) with f32 and bf16 weights, stored [K, N] or
//   [N, K]; GB/s of weight bytes and pct_bw, the share of the read bandwidth measured over the
//   same number of bytes with the same number of threads.
//
// Run: build/bench/gemm_bench --benchmark_format=json --benchmark_repetitions=5
//      --benchmark_report_aggregates_only=true   (medians of the counters)
#include <benchmark/benchmark.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <ctime>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "config_impl.h"
#include "mt/backend.h"
#include "mt/dtype.h"
#include "mt/q8.h"
#include "plugin_manager.h"

namespace {

// The backend under test, made once (the benchmark binary's only backend).
mt::Backend& backend() {
  static mt::PluginManager pm;
  static std::unique_ptr<mt::Backend> b =
      pm.make_backend("cpu", mt::config_from_pairs({{"num_threads", "0"}}));
  return *b;
}

int num_threads() {
  return std::max(1u, std::thread::hardware_concurrency());
}

// A fixed team of threads that runs one function on every thread at once (thread 0 is the
// caller), so the ceilings are measured without thread start-up in the timed region.
class Team {
 public:
  explicit Team(int n) : n_(n), start_(n), done_(n) {
    for (int t = 1; t < n; ++t) threads_.emplace_back([this, t] { loop(t); });
  }
  ~Team() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& th : threads_) th.join();
  }
  int size() const { return n_; }
  void run(const std::function<void(int)>& f) {
    job_ = &f;
    start_.arrive_and_wait();
    f(0);
    done_.arrive_and_wait();
  }

 private:
  void loop(int t) {
    for (;;) {
      start_.arrive_and_wait();
      if (stop_) return;
      (*job_)(t);
      done_.arrive_and_wait();
    }
  }
  int n_;
  std::barrier<> start_, done_;
  const std::function<void(int)>* job_ = nullptr;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

Team& team() {
  static Team t(num_threads());
  return t;
}

// ---- FMA peak ---------------------------------------------------------------------------------

__attribute__((target("avx512f"))) float fma_avx512(long iters) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(1.f + 0.01f * float(i));
  const __m512 m = _mm512_set1_ps(0.999f), add = _mm512_set1_ps(1e-3f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, add);
  }
  for (int i = 1; i < 16; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  float out[16];
  _mm512_storeu_ps(out, acc[0]);
  return out[0];
}

__attribute__((target("avx2,fma"))) float fma_avx2(long iters) {
  __m256 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm256_set1_ps(1.f + 0.01f * float(i));
  const __m256 m = _mm256_set1_ps(0.999f), add = _mm256_set1_ps(1e-3f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, add);
  }
  for (int i = 1; i < 16; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
  float out[8];
  _mm256_storeu_ps(out, acc[0]);
  return out[0];
}

bool has_avx512() {
  return __builtin_cpu_supports("avx512f");
}

// FLOP/s of one pass of `iters` FMA-chain iterations on every thread of the team.
double fma_pass(long iters) {
  std::atomic<float> sink{0};
  const bool wide = has_avx512();
  const auto t0 = std::chrono::steady_clock::now();
  team().run([&](int) { sink = sink + (wide ? fma_avx512(iters) : fma_avx2(iters)); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sink.load());
  return 2.0 * (wide ? 16 : 8) * 16 * double(iters) * team().size() / s;
}

// The peak the matmul counters are measured against: the best pass seen in this process (other
// processes sharing the cores only ever lower a pass, so the best is the machine's peak).
double measured_peak(double seen = 0) {
  static double best = 0;  // this binary's running maximum
  best = std::max(best, seen);
  // ~0.25 s of ~2 ms passes: enough for one to find both cores free on a shared machine.
  if (best == 0)
    for (int i = 0; i < 100; ++i) best = std::max(best, fma_pass(1000000));
  return best;
}

void BM_FmaPeak(benchmark::State& state) {
  double best = 0;
  for (auto _ : state) best = std::max(best, fma_pass(1000000));
  state.counters["GFLOP/s"] = best * 1e-9;
  state.counters["threads"] = team().size();
  measured_peak(best);
  state.SetLabel(backend().describe());
}
BENCHMARK(BM_FmaPeak)->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- matmul -----------------------------------------------------------------------------------

double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

mt::Tensor random_tensor(const mt::Shape& shape, mt::DType dt) {
  mt::Backend& be = backend();
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  mt::Tensor t = be.empty(shape, dt);
  const size_t n = size_t(t.numel());
  if (dt == mt::DType::f32) {
    std::vector<float> v(n);
    for (auto& x : v) x = u(rng);
    be.copy_from_host(t, v.data());
  } else {
    std::vector<uint16_t> v(n);
    for (auto& x : v) x = mt::f32_to_bf16(u(rng));
    be.copy_from_host(t, v.data());
  }
  return t;
}

// Args: M, N, K, trans_a, trans_b, bf16 (0: f32 a and b; 1: bf16 b; 2: bf16 a and b). a and b
// stored as op() requires; c is f32.
void BM_Matmul(benchmark::State& state) {
  const int64_t m = state.range(0), n = state.range(1), k = state.range(2);
  const bool ta = state.range(3), tb = state.range(4);
  const mt::DType db = state.range(5) >= 1 ? mt::DType::bf16 : mt::DType::f32;
  const mt::DType da = state.range(5) == 2 ? mt::DType::bf16 : mt::DType::f32;
  mt::Backend& be = backend();
  const double peak = measured_peak();
  mt::Tensor a = random_tensor(ta ? mt::Shape{k, m} : mt::Shape{m, k}, da);
  mt::Tensor b = random_tensor(tb ? mt::Shape{n, k} : mt::Shape{k, n}, db);
  mt::Tensor c = be.empty({m, n}, mt::DType::f32);
  be.matmul(a, b, c, ta, tb);  // warm-up: pages, caches, scratch buffers
  double seconds = 0, best = 1e30;
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    be.matmul(a, b, c, ta, tb);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    seconds += s;
    best = std::min(best, s);
  }
  const double flop = 2.0 * double(m) * double(n) * double(k);
  const double flops = flop * double(state.iterations());
  state.counters["GFLOP/s"] = flops / seconds * 1e-9;
  state.counters["pct_peak"] = 100.0 * flops / seconds / peak;
  state.counters["peak_GFLOP/s"] = peak * 1e-9;
  // The fastest single call: on a machine shared with other work, the closest to what the
  // kernel does with the cores to itself.
  state.counters["best_GFLOP/s"] = flop / best * 1e-9;
  state.counters["best_pct_peak"] = 100.0 * flop / best / peak;
  // FLOP per CPU-second of this process against one core's share of the peak: the kernel's
  // efficiency on the cores it actually got (time slices lost to other processes do not count,
  // waiting threads that spin do).
  // One core's peak: the larger of this binary's all-thread measurement per thread and the
  // backend's (a single-core measurement at start-up, which a busy machine disturbs less).
  const double cpu = process_cpu_seconds() - cpu0;
  const double core_peak = std::max(peak, be.peak_flops(mt::DType::f32)) / double(num_threads());
  state.counters["cpu_pct_peak"] = 100.0 * flops / cpu / core_peak;
}

// Forward x[T, d_in] @ W[d_in, d_out] and its backward products, for tokens T = 2048.
void transformer_shapes(benchmark::internal::Benchmark* bm) {
  const int64_t t = 2048;
  const int64_t shapes[][2] = {{768, 2304}, {768, 3072}, {3072, 768}};  // {d_in, d_out}
  for (const auto& s : shapes) {
    const int64_t din = s[0], dout = s[1];
    bm->Args({t, dout, din, 0, 0, 0});  // y = x @ W
    bm->Args({t, din, dout, 0, 1, 0});  // dx = dy @ W^T
    bm->Args({din, dout, t, 1, 0, 0});  // dW = x^T @ dy
  }
  for (const auto& s : shapes) bm->Args({t, s[1], s[0], 0, 0, 1});  // y = x @ W, W in bf16
  for (const auto& s : shapes) {  // everything in bf16 (AMX where the CPU has it)
    const int64_t din = s[0], dout = s[1];
    bm->Args({t, dout, din, 0, 0, 2});
    bm->Args({t, din, dout, 0, 1, 2});
    bm->Args({din, dout, t, 1, 0, 2});
  }
  // A 512-token prefill's projections (llama-bench-1b's MLP) in f32 and bf16, against [K, N]
  // weights and against the transposed [N, K] ones that mt decode keeps for its matrix-vector
  // kernels.
  for (const auto& s : {std::array<int64_t, 2>{2048, 5632}, {5632, 2048}})
    for (int64_t tb : {0, 1})
      for (int64_t h : {0, 2}) bm->Args({512, s[1], s[0], 0, tb, h});
  // GPT-2's tied LM head (vocab 50257, an odd N) at 512 tokens (bench/gpt2_vs_llmc.sh's batch 4
  // of 128) in f32: logits = x @ wte^T, dx = dlogits @ wte, dwte = dlogits^T @ x.
  bm->Args({512, 50257, 768, 0, 1, 0});
  bm->Args({512, 768, 50257, 0, 0, 0});
  bm->Args({50257, 768, 512, 1, 0, 0});
}
// One Mixtral-8x7b expert's gate/up projection (d_model 4096, hidden 14336) in bf16, at the 128
// rows an expert gets from 512 tokens routed top-2 over 8 experts, against the same product at
// 1024 rows (a dense layer of the same FLOPs): what the MoE's grouped matmul pays per expert for
// its few rows; 144 an expert just past one 128-row block, 256 the most rows whose GEMM packs b
// inside its tasks. Forward, the input gradient and the weight gradient.
void moe_expert_shapes(benchmark::internal::Benchmark* bm) {
  const int64_t d = 4096, h = 14336;
  for (int64_t rows : {128, 144, 256, 1024}) {
    bm->Args({rows, h, d, 0, 0, 2});  // y = x @ W
    bm->Args({rows, d, h, 0, 1, 2});  // dx = dy @ W^T
    bm->Args({d, h, rows, 1, 0, 2});  // dW = x^T @ dy
  }
}
BENCHMARK(BM_Matmul)
    ->ArgNames({"M", "N", "K", "ta", "tb", "bf16"})
    ->Apply(transformer_shapes)
    ->Apply(moe_expert_shapes)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// ---- matrix-vector (decode) -------------------------------------------------------------------

__attribute__((target("avx512f"))) float read_avx512(const float* p, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
  }
  float out[16];
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float s = out[0];
  for (; i < n; ++i) s += p[i];
  return s;
}

float read_portable(const float* p, int64_t n) {
  float s[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += p[i + j];
  for (; i < n; ++i) s[0] += p[i];
  return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

// Bytes/s of reading `bytes` (split over the team), the best of a few passes after a warm one.
// Bytes/s of reading `buf` (split over the team), `reps` times per thread inside one team run so
// the team's wake-up does not count.
double read_pass(const std::vector<float>& buf, int reps) {
  const int64_t n = int64_t(buf.size()), parts = team().size();
  std::atomic<float> sink{0};
  const bool wide = has_avx512();
  const auto t0 = std::chrono::steady_clock::now();
  team().run([&](int t) {
    const int64_t lo = n * t / parts, hi = n * (t + 1) / parts;
    float s = 0;
    for (int r = 0; r < reps; ++r)
      s += wide ? read_avx512(buf.data() + lo, hi - lo) : read_portable(buf.data() + lo, hi - lo);
    sink = sink + s;
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sink.load());
  return double(n) * sizeof(float) * reps / s;
}

int reps_for(size_t floats) {
  return int(std::max<size_t>(1, (size_t{64} << 20) / (floats * 4)));
}

double read_bandwidth(int64_t bytes) {
  std::vector<float> buf(size_t(bytes / 4), 1.f);
  const int reps = reps_for(buf.size());
  double best = 0;
  read_pass(buf, 1);
  for (int i = 0; i < 10; ++i) best = std::max(best, read_pass(buf, reps));
  return best;
}

// Args: bytes
void BM_ReadBandwidth(benchmark::State& state) {
  std::vector<float> buf(size_t(state.range(0) / 4), 1.f);
  const int reps = reps_for(buf.size());
  read_pass(buf, 1);
  double best = 0;
  for (auto _ : state) best = std::max(best, read_pass(buf, reps));
  state.counters["GB/s"] = best * 1e-9;
}
BENCHMARK(BM_ReadBandwidth)
    ->ArgName("bytes")
    ->Arg(768 * 3072 * 2)
    ->Arg(768 * 3072 * 4)
    ->Arg(2048 * 5632 * 2)
    ->Arg(2048 * 5632 * 4)
    ->Arg(int64_t{1} << 30)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// Args: K, N, trans_b (W stored [N, K]), bf16 weights (0/1; 2: bf16 x too, a bf16 model's
// decode), M rows of x (batched decode's few rows: 1 or up to 8). N = 256 keeps the weights in
// L2 (what the kernel computes, not what memory delivers).
void BM_MatVec(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1), m = state.range(4);
  const bool tb = state.range(2);
  const mt::DType dw = state.range(3) ? mt::DType::bf16 : mt::DType::f32;
  mt::Backend& be = backend();
  mt::Tensor x = random_tensor({m, k}, state.range(3) == 2 ? mt::DType::bf16 : mt::DType::f32);
  mt::Tensor w = random_tensor(tb ? mt::Shape{n, k} : mt::Shape{k, n}, dw);
  mt::Tensor y = be.empty({m, n}, mt::DType::f32);
  const double bytes = double(w.nbytes());
  const double bw = read_bandwidth(int64_t(bytes));
  be.matmul(x, w, y, false, tb);
  double seconds = 0, best = 1e30;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    be.matmul(x, w, y, false, tb);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    seconds += s;
    best = std::min(best, s);
  }
  state.counters["best_GB/s"] = bytes / best * 1e-9;
  const double rate = bytes * double(state.iterations()) / seconds;
  state.counters["GB/s"] = rate * 1e-9;
  state.counters["read_GB/s"] = bw * 1e-9;
  state.counters["pct_bw"] = 100.0 * rate / bw;
  state.counters["GFLOP/s"] = 2.0 * double(m * k * n) * double(state.iterations()) / seconds * 1e-9;
}
BENCHMARK(BM_MatVec)
    ->ArgNames({"K", "N", "tb", "bf16_w", "M"})
    ->ArgsProduct({{768}, {3072}, {0, 1}, {0, 1}, {1}})
    ->ArgsProduct({{2048}, {5632}, {0, 1}, {0, 1}, {1, 8}})
    ->ArgsProduct({{768, 2048}, {256}, {1}, {2}, {1, 2, 4, 8}})  // bf16 x and weights, in L2
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

// Times `call(i)` for i in [0, count) (products over distinct weights of `one` bytes each, after
// one untimed pass), synchronised, per iteration; reports GB/s of weights and us per call.
void stream_calls(benchmark::State& state, mt::Backend& be, int64_t count, int64_t one,
                  const std::function<void(int64_t)>& call) {
  for (int64_t i = 0; i < count; ++i) call(i);
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < count; ++i) call(i);
    be.synchronize();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state.SetIterationTime(s);
    seconds += s;
  }
  state.counters["GB/s"] =
      double(one) * double(count) * double(state.iterations()) / seconds * 1e-9;
  state.counters["us_per_call"] = seconds / double(count * state.iterations()) * 1e6;
}

// Decode's access pattern: one matrix-vector product after another over distinct weight
// matrices whose total (>= 512 MiB) no cache holds, so every call streams its weights from
// memory as a decode step does. Args: K, N, trans_b, bf16 weights (0: f32 weights; 1: bf16
// weights, f32 x; 2: bf16 weights and x, a bf16 model's decode: the dot-product rows kernel
// where the CPU has AVX512_BF16), M rows of x (decode of M prompts: mt decode transposes the
// projections for one or two). GB/s here against
// BM_MatVec's on one large matrix shows what each call's start and end cost.
void BM_MatVecStream(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1), m = state.range(4);
  const bool tb = state.range(2);
  const mt::DType dw = state.range(3) ? mt::DType::bf16 : mt::DType::f32;
  mt::Backend& be = backend();
  const int64_t one = k * n * static_cast<int64_t>(mt::dtype_size(dw));
  const int64_t count = std::max<int64_t>(2, (int64_t{512} << 20) / one);
  std::vector<mt::Tensor> ws;
  for (int64_t i = 0; i < count; ++i)
    ws.push_back(random_tensor(tb ? mt::Shape{n, k} : mt::Shape{k, n}, dw));
  mt::Tensor x = random_tensor({m, k}, state.range(3) == 2 ? mt::DType::bf16 : mt::DType::f32);
  mt::Tensor y = be.empty({m, n}, mt::DType::f32);
  stream_calls(state, be, count, one,
               [&](int64_t i) { be.matmul(x, ws[size_t(i)], y, false, tb); });
}
// As BM_MatVecStream, with `gap_us` of single-threaded work on the calling thread after each
// product (a decode step's norms, rope and attention between its projections): what waking the
// other threads for each product costs once they have gone idle.
void BM_MatVecStreamWithGaps(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1);
  const auto gap = std::chrono::microseconds(state.range(2));
  mt::Backend& be = backend();
  const int64_t one = k * n * 2;
  const int64_t count = std::max<int64_t>(2, (int64_t{512} << 20) / one);
  std::vector<mt::Tensor> ws;
  for (int64_t i = 0; i < count; ++i) ws.push_back(random_tensor({n, k}, mt::DType::bf16));
  mt::Tensor x = random_tensor({1, k}, mt::DType::f32);
  mt::Tensor y = be.empty({1, n}, mt::DType::f32);
  for (const auto& w : ws) be.matmul(x, w, y, false, true);
  double seconds = 0;
  for (auto _ : state) {
    double s = 0;
    for (const auto& w : ws) {
      const auto t0 = std::chrono::steady_clock::now();
      be.matmul(x, w, y, false, true);
      const auto t1 = std::chrono::steady_clock::now();
      s += std::chrono::duration<double>(t1 - t0).count();
      while (std::chrono::steady_clock::now() - t1 < gap) {
      }
    }
    state.SetIterationTime(s);
    seconds += s;
  }
  state.counters["GB/s"] =
      double(one) * double(count) * double(state.iterations()) / seconds * 1e-9;
  state.counters["us_per_call"] = seconds / double(count * state.iterations()) * 1e6;
}
BENCHMARK(BM_MatVecStreamWithGaps)
    ->ArgNames({"K", "N", "gap_us"})
    ->ArgsProduct({{768}, {768, 2048}, {0, 5, 20, 100}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// matmul_q8 (quantization=int8's decode) on int8 rows (mt/q8.h) streamed from memory as
// BM_MatVecStream's: M rows of x, GB/s of the int8 rows (values and scales) read.
void BM_MatVecQ8Stream(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1), m = state.range(2);
  mt::Backend& be = backend();
  const int64_t rb = mt::q8_row_bytes(k), one = n * rb;
  const int64_t count = std::max<int64_t>(2, (int64_t{512} << 20) / one);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> wf(static_cast<size_t>(k));
  std::vector<int8_t> q(static_cast<size_t>(one));
  for (int64_t j = 0; j < n; ++j) {
    for (float& v : wf) v = nd(rng);
    if (!mt::quantize_q8_row(wf.data(), k, q.data() + j * rb)) {
      state.SkipWithError("a row could not be quantized");
      return;
    }
  }
  std::vector<mt::Tensor> ws;
  for (int64_t i = 0; i < count; ++i) {
    ws.push_back(be.empty({n, rb}, mt::DType::i8));
    be.copy_from_host(ws.back(), q.data());
  }
  mt::Tensor x = random_tensor({m, k}, mt::DType::f32);
  mt::Tensor y = be.empty({m, n}, mt::DType::f32);
  stream_calls(state, be, count, one, [&](int64_t i) { be.matmul_q8(x, ws[size_t(i)], y); });
}
BENCHMARK(BM_MatVecQ8Stream)
    ->ArgNames({"K", "N", "M"})
    ->ArgsProduct({{768, 2048}, {768, 2048, 5632}, {1, 8}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Decode's int8 experts (quantization=int8, an MoE layer at batch 1): A experts of one row
// each, [A, N, q8_row_bytes(K)] int8 rows streamed from memory as BM_MatVecQ8Stream's, bf16 x
// and y (a bf16 model's), either one matmul_q8 per expert on its slices (grouped 0: what the
// core ran before grouped_matmul_q8) or one grouped_matmul_q8 (1: every expert's products in
// one fork). A = 4: Mixtral's top 2 with gate and up fused (2 E experts); K 512 N 640:
// mixtral-bench-100m's experts, K 4096 N 14336: mixtral-8x7b's.
void BM_GroupedQ8Stream(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1), a = state.range(2);
  const bool grouped = state.range(3);
  mt::Backend& be = backend();
  const int64_t rb = mt::q8_row_bytes(k), one = a * n * rb;
  const int64_t count = std::max<int64_t>(2, (int64_t{512} << 20) / one);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> wf(static_cast<size_t>(k));
  std::vector<int8_t> q(static_cast<size_t>(one));
  for (int64_t j = 0; j < a * n; ++j) {
    for (float& v : wf) v = nd(rng);
    if (!mt::quantize_q8_row(wf.data(), k, q.data() + j * rb)) {
      state.SkipWithError("a row could not be quantized");
      return;
    }
  }
  std::vector<mt::Tensor> ws;
  for (int64_t i = 0; i < count; ++i) {
    ws.push_back(be.empty({a, n, rb}, mt::DType::i8));
    be.copy_from_host(ws.back(), q.data());
  }
  mt::Tensor x = random_tensor({a, k}, mt::DType::bf16);
  mt::Tensor y = be.empty({a, n}, mt::DType::bf16);
  const std::vector<int64_t> counts(static_cast<size_t>(a), 1);
  stream_calls(state, be, count, one, [&](int64_t i) {
    const mt::Tensor& w = ws[size_t(i)];
    if (grouped) {
      be.grouped_matmul_q8(x, w, counts, y);
      return;
    }
    for (int64_t e = 0; e < a; ++e) {
      mt::Tensor ye = y.slice0(e, e + 1);
      be.matmul_q8(x.slice0(e, e + 1), w.slice0(e, e + 1).view({n, rb}), ye);
    }
  });
}
BENCHMARK(BM_GroupedQ8Stream)
    ->ArgNames({"K", "N", "A", "grouped"})
    ->ArgsProduct({{512}, {640}, {2, 4}, {0, 1}})
    ->ArgsProduct({{4096}, {14336}, {2, 4}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

// Decode's bf16 experts (an MoE layer at batch 1 in bfloat16): A experts of one bf16 row each
// against [A, N, K] bf16 weights (transposed, as the CPU keeps experts) streamed from memory as
// BM_MatVecStream's, in one grouped_matmul (dense 0), or (dense 1) the same bytes as one
// [A * N, K] matmul of one row: the rate the experts' products would stream at if their
// splitting into experts cost nothing. K 512 N 640: mixtral-bench-100m's experts (A = 4: top 2
// with gate and up fused; 2: the down projections' shape at K 640 N 512).
void BM_GroupedStream(benchmark::State& state) {
  const int64_t k = state.range(0), n = state.range(1), a = state.range(2);
  const bool dense = state.range(3);
  mt::Backend& be = backend();
  const int64_t one = a * n * k * 2;
  const int64_t count = std::max<int64_t>(2, (int64_t{512} << 20) / one);
  std::vector<mt::Tensor> ws;
  for (int64_t i = 0; i < count; ++i) ws.push_back(random_tensor({a, n, k}, mt::DType::bf16));
  std::vector<int32_t> off(static_cast<size_t>(a + 1));
  for (int64_t e = 0; e <= a; ++e) off[size_t(e)] = int32_t(e);
  mt::Tensor offsets = be.empty({a + 1}, mt::DType::i32);
  be.copy_from_host(offsets, off.data());
  mt::Tensor x = random_tensor({dense ? 1 : a, k}, mt::DType::bf16);
  mt::Tensor y = be.empty({dense ? 1 : a, dense ? a * n : n}, mt::DType::bf16);
  stream_calls(state, be, count, one, [&](int64_t i) {
    const mt::Tensor& w = ws[size_t(i)];
    if (dense)
      be.matmul(x, w.view({a * n, k}), y, false, true);
    else
      be.grouped_matmul(x, w, offsets, true, y);
  });
}
BENCHMARK(BM_GroupedStream)
    ->ArgNames({"K", "N", "A", "dense"})
    ->ArgsProduct({{512}, {640}, {4}, {0, 1}})
    ->ArgsProduct({{640}, {512}, {2}, {0, 1}})
    ->ArgsProduct({{4096}, {14336}, {2}, {0, 1}})
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

BENCHMARK(BM_MatVecStream)
    ->ArgNames({"K", "N", "tb", "bf16_w", "M"})
    ->ArgsProduct({{768}, {768, 2048}, {0, 1}, {0, 1}, {1}})
    ->ArgsProduct({{2048}, {768}, {0, 1}, {0, 1}, {1}})
    ->ArgsProduct({{2048}, {5632}, {0, 1}, {0, 1}, {1}})
    ->ArgsProduct({{2048}, {5632}, {1}, {0, 1}, {2}})  // two prompts on the "rows" kernels
    ->ArgsProduct({{768, 2048}, {768, 2048, 5632}, {1}, {2}, {1}})
    ->ArgsProduct(
        {{768, 2048}, {2048, 5632}, {1}, {2}, {2, 4, 8}})     // a bf16 model's batched decode
    ->ArgsProduct({{2048}, {2048, 32000}, {1}, {0, 1}, {1}})  // llama-bench-1b's q/k/v/o, LM head
    ->ArgsProduct({{5632}, {2048}, {1}, {0, 1}, {1}})         // and its down projection
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
