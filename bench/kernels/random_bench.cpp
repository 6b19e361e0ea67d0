// fill_random (parameter initialisation) on the CPU backend: bytes of parameters written per
// second, f32 and bf16, normal and truncated normal, against the core's host composition (what a
// backend without the kernel runs) and against the generator it replaced (std::mt19937_64 with
// std::normal_distribution, one thread, as ModelRunner::init_parameters did). BM_InitParameters
// times ModelRunner::init_parameters on llama-bench-1b (1.1B parameters), and the loop it
// replaced on the same model.
//
// Run: build/bench/random_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
// (MT_BENCH_THREADS=1 for one thread.)
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <random>
#include <vector>

#include "bench_backend.h"
#include "config_impl.h"
#include "config_loader.h"
#include "fnv1a.h"
#include "model_runner.h"
#include "mt/backend.h"
#include "mt/ops.h"
#include "plugin_manager.h"
#include "required_only_backend.h"

namespace {

mt::Backend& backend() {
  return mt::bench::cpu_backend();
}

constexpr int64_t kElements = int64_t{1} << 25;  // 32 Mi parameters: 128 MiB in f32

// Args: {bf16, truncated}
void fill(benchmark::State& state, mt::Backend& b) {
  const mt::DType dt = state.range(0) ? mt::DType::bf16 : mt::DType::f32;
  mt::RandomFill spec;
  spec.key = 0x5eed;
  spec.distribution = state.range(1) ? mt::RandomFill::Distribution::truncated_normal
                                     : mt::RandomFill::Distribution::normal;
  spec.stddev = 0.02f;
  mt::Tensor t = b.empty({kElements}, dt);
  for (auto _ : state) {
    b.fill_random(t, spec);
    b.synchronize();
    ++spec.key;
  }
  state.SetBytesProcessed(state.iterations() * kElements * int64_t(mt::dtype_size(dt)));
  state.SetItemsProcessed(state.iterations() * kElements);
}

void BM_FillRandom(benchmark::State& state) {
  fill(state, backend());
}
BENCHMARK(BM_FillRandom)
    ->ArgNames({"bf16", "truncated"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_FillRandomHostComposed(benchmark::State& state) {
  mt::RequiredOnlyBackend b(backend());
  fill(state, b);
}
BENCHMARK(BM_FillRandomHostComposed)
    ->ArgNames({"bf16", "truncated"})
    ->Args({0, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// The generator init_parameters used before fill_random: truncated normal in f32 on one thread,
// then the copy to the backend (here a memcpy).
void BM_Mt19937TruncatedNormal(benchmark::State& state) {
  mt::Tensor t = backend().empty({kElements}, mt::DType::f32);
  std::vector<float> host(static_cast<size_t>(kElements));
  uint64_t seed = 0x5eed;
  for (auto _ : state) {
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> normal(0.f, 1.f);
    const float s = 0.02f / 0.87962566f;
    for (auto& v : host) {
      float z;
      do z = normal(rng);
      while (std::fabs(z) > 2.f);
      v = z * s;
    }
    backend().copy_from_host(t, host.data());
  }
  state.SetBytesProcessed(state.iterations() * kElements * 4);
  state.SetItemsProcessed(state.iterations() * kElements);
}
BENCHMARK(BM_Mt19937TruncatedNormal)->Unit(benchmark::kMillisecond)->UseRealTime();

// llama-bench-1b's parameters in weight_dtype f32 (arg 0) or bf16 (arg 1).
std::unique_ptr<mt::ModelRunner> llama_1b(bool bf16) {
  static mt::PluginManager pm;
  mt::ConfigRequest req;
  req.configs_dir =
      mt::PluginManager::core_library_dir().parent_path() / "share" / "mt" / "configs";
  req.model = "llama-bench-1b";
  if (bf16) req.overrides = {"weight_dtype=bfloat16", "dtype=bfloat16"};
  return std::make_unique<mt::ModelRunner>(mt::load_config(req), pm);
}

int64_t param_bytes(mt::ModelRunner& r) {
  int64_t b = 0;
  for (const mt::Param& p : r.params()) b += static_cast<int64_t>(p.value.nbytes());
  return b;
}

void BM_InitParameters(benchmark::State& state) {
  auto r = llama_1b(state.range(0) != 0);
  uint64_t seed = 1;
  for (auto _ : state) {
    r->init_parameters(seed++);
    r->backend().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * param_bytes(*r));
  state.counters["params"] = static_cast<double>(param_bytes(*r)) /
                             static_cast<double>(mt::dtype_size(r->params()[0].value.dtype()));
}
BENCHMARK(BM_InitParameters)
    ->ArgName("bf16")
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kSecond)
    ->UseRealTime()
    ->Iterations(2);

// ModelRunner::init_parameters before fill_random: a host vector per parameter from
// std::mt19937_64 seeded by seed ^ fnv1a(name), copied to the backend in f32 and cast.
void init_parameters_mt19937(mt::ModelRunner& r, uint64_t seed) {
  mt::Backend& b = r.backend();
  for (auto& p : r.params()) {
    std::vector<float> host(static_cast<size_t>(mt::shape_numel(p.spec.shape)));
    std::mt19937_64 rng(seed ^ mt::fnv1a(p.name));
    std::normal_distribution<float> normal(0.f, 1.f);
    switch (p.spec.init) {
      case mt::Init::zeros:
        std::fill(host.begin(), host.end(), 0.f);
        break;
      case mt::Init::ones:
        std::fill(host.begin(), host.end(), 1.f);
        break;
      case mt::Init::normal:
        for (auto& v : host) v = normal(rng) * p.spec.stddev;
        break;
      case mt::Init::truncated_normal: {
        const float s = p.spec.stddev / 0.87962566f;
        for (auto& v : host) {
          float z;
          do z = normal(rng);
          while (std::fabs(z) > 2.f);
          v = z * s;
        }
        break;
      }
    }
    mt::Tensor f = b.empty(p.spec.shape, mt::DType::f32);
    b.copy_from_host(f, host.data());
    b.cast(f, p.value);
  }
}
void BM_InitParametersMt19937(benchmark::State& state) {
  auto r = llama_1b(state.range(0) != 0);
  uint64_t seed = 1;
  for (auto _ : state) {
    init_parameters_mt19937(*r, seed++);
    r->backend().synchronize();
  }
  state.SetBytesProcessed(state.iterations() * param_bytes(*r));
}
BENCHMARK(BM_InitParametersMt19937)
    ->ArgName("bf16")
    ->Arg(0)
    ->Unit(benchmark::kSecond)
    ->UseRealTime()
    ->Iterations(1);

}  // namespace

BENCHMARK_MAIN();
