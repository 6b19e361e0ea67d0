// Attention kernels of the CPU backend: flash vs dot_product, forward + backward, causal,
// B = 1, H = 12, D = 64, T in {512, 2048, 4096}.
//
// Time is wall-clock; the CPU column is the process's CPU time over all threads
// (MeasureProcessCPUTime), which stays meaningful when other jobs share the cores. Counters:
// peak_extra_MiB is the backend allocator's peak during the timed loop minus what the inputs,
// outputs and gradients already hold: the kernel's own scratch (dot_product: a T x S score block
// per thread; flash: tiles per thread and a [B, H, T] row statistic). GFLOP/s counts the work of an
// exact causal kernel: forward 2 GEMMs (QK^T, PV), backward 5 (QK^T again, dO V^T, dV, dK, dQ),
// each 2 T^2 D H / 2 flops.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "config_impl.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "plugin_manager.h"

namespace {

struct Env {
  mt::PluginManager pm;
  std::unique_ptr<mt::Backend> backend;
  Env() : backend(pm.make_backend("cpu", mt::config_from_pairs({{"num_threads", "0"}}))) {}
};

Env& env() {
  static Env e;
  return e;
}

mt::Tensor tensor(mt::Backend& b, const mt::Shape& shape, std::mt19937_64& rng, float stddev) {
  mt::Tensor t = b.empty(shape, mt::DType::f32);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  std::normal_distribution<float> d(0.f, stddev);
  for (auto& x : v) x = stddev == 0.f ? 0.f : d(rng);
  b.copy_from_host(t, v.data());
  return t;
}

void BM_Attention(benchmark::State& state, const std::string& kernel) {
  const int64_t B = 1, H = 12, D = 64, T = state.range(0);
  Env& e = env();
  mt::Backend& b = *e.backend;
  auto att = e.pm.make_attention("cpu", kernel, b);
  std::mt19937_64 rng(1234);
  const mt::Shape shape{B, T, H, D};
  mt::Tensor q = tensor(b, shape, rng, 1.f), k = tensor(b, shape, rng, 1.f),
             v = tensor(b, shape, rng, 1.f), dout = tensor(b, shape, rng, 1.f);
  mt::Tensor out = b.empty(shape, mt::DType::f32), lse = b.empty({B, H, T}, mt::DType::f32);
  mt::Tensor dq = tensor(b, shape, rng, 0.f), dk = tensor(b, shape, rng, 0.f),
             dv = tensor(b, shape, rng, 0.f);
  mt::AttentionSpec spec;
  spec.causal = true;

  b.synchronize();
  const size_t base = b.memory_stats().bytes_in_use;
  b.reset_peak_memory();
  for (auto _ : state) {
    att->forward(q, k, v, {}, {}, spec, out, lse);
    att->backward(dout, q, k, v, {}, {}, out, lse, spec, dq, dk, dv);
    b.synchronize();
    benchmark::DoNotOptimize(dq.data());
  }
  const size_t peak = b.memory_stats().peak_bytes_in_use;
  const double flops = 7.0 * 2.0 * double(T) * double(T) * double(D) * double(H) / 2.0 * double(B);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["peak_extra_MiB"] =
      static_cast<double>(peak > base ? peak - base : 0) / (1024.0 * 1024.0);
  state.counters["T"] = static_cast<double>(T);
  state.SetLabel(kernel);
}

BENCHMARK_CAPTURE(BM_Attention, flash, std::string("flash"))
    ->Arg(512)
    ->Arg(2048)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();
BENCHMARK_CAPTURE(BM_Attention, dot_product, std::string("dot_product"))
    ->Arg(512)
    ->Arg(2048)
    ->Arg(4096)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();

// Forward only (a prefill's attention): flash, causal, B = 1, H = 12, D = 64 or 128, T = 512
// (mt bench decode's prompt) or 2048. GFLOP/s counts QK^T and PV of an exact causal kernel.
void BM_Forward(benchmark::State& state) {
  const int64_t B = 1, H = 12, T = state.range(0), D = state.range(1);
  Env& e = env();
  mt::Backend& b = *e.backend;
  auto att = e.pm.make_attention("cpu", "flash", b);
  std::mt19937_64 rng(4321);
  const mt::Shape shape{B, T, H, D};
  mt::Tensor q = tensor(b, shape, rng, 1.f), k = tensor(b, shape, rng, 1.f),
             v = tensor(b, shape, rng, 1.f);
  mt::Tensor out = b.empty(shape, mt::DType::f32), lse = b.empty({B, H, T}, mt::DType::f32);
  mt::AttentionSpec spec;
  spec.causal = true;
  for (auto _ : state) {
    att->forward(q, k, v, {}, {}, spec, out, lse);
    b.synchronize();
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 2.0 * 2.0 * double(T) * double(T) * double(D) * double(H) / 2.0 * double(B);
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Forward)
    ->Args({512, 64})
    ->Args({512, 128})
    ->Args({2048, 64})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();

// Decode: one new token per sequence against a KV cache of `length` rows, B sequences, Hq = 12,
// Hkv kv heads (4: GQA), D = 64, the cache f32 or (bf16:1) bf16. Memory-bound: bytes/s counts the
// cache rows read.
void BM_Decode(benchmark::State& state, const std::string& kernel) {
  const int64_t B = state.range(2), Hq = 12, Hkv = state.range(3), D = 64, length = state.range(0);
  const bool bf16 = state.range(1) != 0;
  Env& e = env();
  mt::Backend& b = *e.backend;
  auto att = e.pm.make_attention("cpu", kernel, b);
  std::mt19937_64 rng(99);
  mt::Tensor q = tensor(b, {B, 1, Hq, D}, rng, 1.f);
  mt::Tensor kc = tensor(b, {B, length, Hkv, D}, rng, 1.f),
             vc = tensor(b, {B, length, Hkv, D}, rng, 1.f);
  if (bf16) {
    mt::Tensor k16 = b.empty(kc.shape(), mt::DType::bf16),
               v16 = b.empty(vc.shape(), mt::DType::bf16);
    b.cast(kc, k16);
    b.cast(vc, v16);
    kc = k16;
    vc = v16;
  }
  mt::Tensor lengths = b.empty({B}, mt::DType::i32);
  const std::vector<int32_t> len(B, static_cast<int32_t>(length));
  b.copy_from_host(lengths, len.data());
  mt::Tensor out = b.empty({B, 1, Hq, D}, mt::DType::f32);
  mt::AttentionSpec spec;
  for (auto _ : state) {
    att->decode(q, kc, vc, lengths, spec, out);
    b.synchronize();
    benchmark::DoNotOptimize(out.data());
  }
  state.SetBytesProcessed(state.iterations() * 2 * B * length * Hkv * D * (bf16 ? 2 : 4));
  state.SetLabel(kernel);
}

BENCHMARK_CAPTURE(BM_Decode, flash, std::string("flash"))
    ->ArgNames({"length", "bf16", "B", "Hkv"})
    ->Args({2048, 0, 8, 4})
    ->Args({2048, 1, 8, 4})
    ->Args({160, 0, 1, 12})  // llama-bench-m's batch-1 decode step (mt bench decode)
    ->Args({160, 1, 1, 12})
    ->Args({4096, 1, 1, 12})  // the same model after a 4096-token prompt (depth=4096)
    ->Args({4096, 1, 8, 12})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();
BENCHMARK_CAPTURE(BM_Decode, dot_product, std::string("dot_product"))
    ->ArgNames({"length", "bf16", "B", "Hkv"})
    ->Args({2048, 0, 8, 4})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->MeasureProcessCPUTime();

}  // namespace

BENCHMARK_MAIN();
