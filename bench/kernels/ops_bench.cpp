// Memory-bound kernels of the CPU backend (rmsnorm, rope, swiglu, fused cross-entropy) against a
// memcpy of the same number of bytes in this same binary.
//
// Bytes counted per call are the bytes a kernel must move at minimum: each operand read once,
// each output written once (a gradient that is accumulated into is read and written). The
// memcpy baselines move the same total (half read, half written): `Memcpy/threads` copies with
// the backend's threads (Backend::cast between tensors of the same dtype is a parallel memcpy in
// the backend's arena), `Memcpy/1thread` is one std::memcpy. Each kernel also reports
// memcpy_GiBps (a threaded copy of its own byte count, timed in this process) and pct_memcpy.
//
// Run: build/bench/ops_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "bench_backend.h"
#include "config_impl.h"
#include "mt/backend.h"
#include "mt/dtype.h"
#include "plugin_manager.h"

namespace {

mt::Backend& backend() {
  return mt::bench::cpu_backend();
}

// A tensor of standard-normal values (converted to dt).
mt::Tensor randn(const mt::Shape& shape, mt::DType dt, float stddev = 1.f, uint64_t seed = 1) {
  mt::Backend& b = backend();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, stddev);
  std::vector<float> v(static_cast<size_t>(mt::shape_numel(shape)));
  for (auto& x : v) x = d(rng);
  mt::Tensor f = b.empty(shape, mt::DType::f32);
  b.copy_from_host(f, v.data());
  if (dt == mt::DType::f32) return f;
  mt::Tensor t = b.empty(shape, dt);
  b.cast(f, t);
  return t;
}

mt::DType dtype_arg(int64_t a) {
  return a ? mt::DType::bf16 : mt::DType::f32;
}
int64_t esize(mt::DType dt) {
  return static_cast<int64_t>(mt::dtype_size(dt));
}

// GiB/s (2^30 bytes, the unit of bytes_per_second) of a memcpy moving `bytes` in total
// (bytes / 2 copied) on the backend's threads, measured once per size: the median of 5 rounds,
// each timing as many copies as fit in ~50 ms (the machine may be shared, so one copy is noise).
double memcpy_gibps(int64_t bytes) {
  static std::map<int64_t, double> cache;
  auto it = cache.find(bytes);
  if (it != cache.end()) return it->second;
  const int64_t n = std::max<int64_t>(1, bytes / 2 / 4);
  mt::Tensor src = randn({n}, mt::DType::f32), dst = backend().zeros({n}, mt::DType::f32);
  backend().cast(src, dst);
  std::vector<double> gibps;
  for (int round = 0; round < 5; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    int copies = 0;
    std::chrono::duration<double> dt{};
    do {
      backend().cast(src, dst);
      ++copies;
      dt = std::chrono::steady_clock::now() - t0;
    } while (dt.count() < 0.05);
    gibps.push_back(double(n) * 8 * copies / dt.count() / double(1 << 30));
  }
  std::nth_element(gibps.begin(), gibps.begin() + 2, gibps.end());
  return cache[bytes] = gibps[2];
}

// Counters: bytes_per_second (the kernel, GiB/s), memcpy_GiBps (the same bytes copied with the
// same threads) and pct_memcpy (kernel bandwidth as a percentage of that copy's).
void set_bytes(benchmark::State& state, int64_t bytes_per_call) {
  state.SetBytesProcessed(state.iterations() * bytes_per_call);
  state.counters["MB_per_call"] = double(bytes_per_call) / 1e6;
  const double mc = memcpy_gibps(bytes_per_call);
  state.counters["memcpy_GiBps"] = mc;
  state.counters["pct_memcpy"] =
      benchmark::Counter(double(bytes_per_call) * 100.0 / (mc * double(1 << 30)),
                         benchmark::Counter::kIsIterationInvariantRate);
}

// ---- baselines: copy bytes/2 (bytes/2 read + bytes/2 written) ---------------------------------
void Memcpy_threads(benchmark::State& state) {
  const int64_t half = state.range(0) / 2 / 4;
  mt::Tensor src = randn({half}, mt::DType::f32), dst = backend().empty({half}, mt::DType::f32);
  for (auto _ : state) {
    backend().cast(src, dst);
    benchmark::ClobberMemory();
  }
  set_bytes(state, half * 4 * 2);
}

void Memcpy_1thread(benchmark::State& state) {
  const size_t half = static_cast<size_t>(state.range(0) / 2);
  std::vector<char> src(half, 1), dst(half);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), half);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_bytes(state, static_cast<int64_t>(half) * 2);
}

// ---- rmsnorm: x [N, D] -----------------------------------------------------------------------
void RmsNormForward(benchmark::State& state) {
  const int64_t N = state.range(0), D = state.range(1);
  const mt::DType dt = dtype_arg(state.range(2));
  mt::Tensor x = randn({N, D}, dt), w = randn({D}, dt), out = backend().empty({N, D}, dt);
  mt::Tensor rstd = backend().empty({N}, mt::DType::f32);
  for (auto _ : state) backend().rmsnorm_forward(x, w, 1e-6f, false, out, rstd);
  set_bytes(state, 2 * N * D * esize(dt) + N * 4);  // x read, out written, rstd
}

void RmsNormBackward(benchmark::State& state) {
  const int64_t N = state.range(0), D = state.range(1);
  const mt::DType dt = dtype_arg(state.range(2));
  mt::Tensor x = randn({N, D}, dt), w = randn({D}, dt), dout = randn({N, D}, dt, 1.f, 2);
  mt::Tensor out = backend().empty({N, D}, dt), rstd = backend().empty({N}, mt::DType::f32);
  backend().rmsnorm_forward(x, w, 1e-6f, false, out, rstd);
  mt::Tensor dx = backend().zeros({N, D}, dt), dw = backend().zeros({D}, dt);
  for (auto _ : state) backend().rmsnorm_backward(dout, x, w, rstd, false, dx, dw);
  set_bytes(state, 4 * N * D * esize(dt) + N * 4);  // dout, x read; dx read + written
}

// ---- rope: x [1, T, H, Dh] -------------------------------------------------------------------
void RopeForward(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), Dh = state.range(2);
  const mt::DType dt = dtype_arg(state.range(3));
  mt::Tensor x = randn({1, T, H, Dh}, dt), out = backend().empty({1, T, H, Dh}, dt);
  std::vector<int32_t> p(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) p[t] = static_cast<int32_t>(t);
  mt::Tensor pos = backend().empty({1, T}, mt::DType::i32);
  backend().copy_from_host(pos, p.data());
  mt::RopeSpec spec;
  spec.type = mt::RopeSpec::Type::llama3;
  spec.theta = 500000.f;
  spec.factor = 8.f;
  for (auto _ : state) backend().rope_forward(x, pos, spec, out);
  set_bytes(state, 2 * T * H * Dh * esize(dt));
}

void RopeBackward(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), Dh = state.range(2);
  const mt::DType dt = dtype_arg(state.range(3));
  mt::Tensor dout = randn({1, T, H, Dh}, dt), dx = backend().zeros({1, T, H, Dh}, dt);
  std::vector<int32_t> p(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) p[t] = static_cast<int32_t>(t);
  mt::Tensor pos = backend().empty({1, T}, mt::DType::i32);
  backend().copy_from_host(pos, p.data());
  mt::RopeSpec spec;
  for (auto _ : state) backend().rope_backward(dout, pos, spec, dx);
  set_bytes(state, 3 * T * H * Dh * esize(dt));  // dout read; dx read + written
}

// ---- swiglu: gate, up [N, F] -----------------------------------------------------------------
void SwigluForward(benchmark::State& state) {
  const int64_t N = state.range(0), F = state.range(1);
  const mt::DType dt = dtype_arg(state.range(2));
  mt::Tensor g = randn({N, F}, dt), u = randn({N, F}, dt, 1.f, 2),
             out = backend().empty({N, F}, dt);
  for (auto _ : state) backend().gated_forward(mt::Activation::silu, g, u, out);
  set_bytes(state, 3 * N * F * esize(dt));
}

void SwigluBackward(benchmark::State& state) {
  const int64_t N = state.range(0), F = state.range(1);
  const mt::DType dt = dtype_arg(state.range(2));
  mt::Tensor g = randn({N, F}, dt), u = randn({N, F}, dt, 1.f, 2), d = randn({N, F}, dt, 1.f, 3);
  mt::Tensor dg = backend().zeros({N, F}, dt), du = backend().zeros({N, F}, dt);
  for (auto _ : state) backend().gated_backward(mt::Activation::silu, d, g, u, dg, du);
  set_bytes(state, 7 * N * F * esize(dt));  // dout, gate, up read; dgate, dup read + written
}

// ---- fused cross-entropy: logits [N, V], forward + backward ----------------------------------
void CrossEntropyFwdBwd(benchmark::State& state) {
  const int64_t N = state.range(0), V = state.range(1);
  const mt::DType dt = dtype_arg(state.range(2));
  mt::Backend& b = backend();
  mt::Tensor logits = randn({N, V}, dt, 2.f);
  std::vector<int32_t> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[i] = static_cast<int32_t>((i * 7919) % V);
  mt::Tensor targets = b.empty({N}, mt::DType::i32);
  b.copy_from_host(targets, t.data());
  mt::Tensor loss = b.empty({N}, mt::DType::f32), lse = b.empty({N}, mt::DType::f32);
  mt::Tensor dloss = randn({N}, mt::DType::f32), dlogits = b.zeros({N, V}, dt);
  for (auto _ : state) {
    b.cross_entropy_forward(logits, targets, 1e-4f, loss, lse);
    b.cross_entropy_backward(dloss, logits, targets, lse, 1e-4f, dlogits);
  }
  // forward reads logits; backward reads logits and reads + writes dlogits
  set_bytes(state, 4 * N * V * esize(dt));
}

// Bytes per call of each kernel above at the benchmarked shapes, for the matching memcpy.
constexpr int64_t kTok = 2048, kD = 768, kF = 2048, kH = 12, kDh = 64, kCeN = 512, kV = 32000;

}  // namespace

BENCHMARK(RmsNormForward)->Args({kTok, kD, 0})->Args({kTok, kD, 1})->UseRealTime();
BENCHMARK(RmsNormBackward)->Args({kTok, kD, 0})->Args({kTok, kD, 1})->UseRealTime();
BENCHMARK(RopeForward)->Args({kTok, kH, kDh, 0})->Args({kTok, kH, kDh, 1})->UseRealTime();
BENCHMARK(RopeBackward)->Args({kTok, kH, kDh, 0})->Args({kTok, kH, kDh, 1})->UseRealTime();
BENCHMARK(SwigluForward)->Args({kTok, kF, 0})->Args({kTok, kF, 1})->UseRealTime();
BENCHMARK(SwigluBackward)->Args({kTok, kF, 0})->Args({kTok, kF, 1})->UseRealTime();
BENCHMARK(CrossEntropyFwdBwd)->Args({kCeN, kV, 0})->Args({kCeN, kV, 1})->UseRealTime();
// Same byte counts as the f32 cases above (2 x, 3 x, 4 x, 7 x the tensor sizes).
BENCHMARK(Memcpy_threads)
    ->Arg(2 * kTok * kD * 4)
    ->Arg(4 * kTok * kD * 4)
    ->Arg(3 * kTok * kF * 4)
    ->Arg(7 * kTok * kF * 4)
    ->Arg(4 * kCeN * kV * 4)
    ->UseRealTime();
BENCHMARK(Memcpy_1thread)
    ->Arg(2 * kTok * kD * 4)
    ->Arg(3 * kTok * kF * 4)
    ->Arg(4 * kCeN * kV * 4)
    ->UseRealTime();

BENCHMARK_MAIN();
