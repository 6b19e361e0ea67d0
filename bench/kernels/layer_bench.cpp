// One Llama decoder layer (d=768, 12 heads, ffn 2048, T=512, B=4) forward + backward through the
// core's graph and the CPU backend, with every op timed: reports the share of time spent outside
// GEMMs (issue target: under 25%) and the layer's model TFLOP/s.
#include <benchmark/benchmark.h>

#include <cstdio>

#include "config_loader.h"
#include "model_runner.h"
#include "mt/data.h"
#include "plugin_manager.h"

namespace {

void BM_LlamaLayer(benchmark::State& state) {
  mt::PluginManager pm;
  mt::ConfigRequest req;
  req.configs_dir = mt::PluginManager::core_library_dir().parent_path() / "share" / "mt" / "configs";
  req.model = "llama-bench-m";
  // One layer; a tiny vocabulary so the embedding and LM head cost nothing.
  req.overrides = {"base_num_decoder_layers=1", "vocab_size=64", "profile=true",
                   std::string("remat_policy=") + (state.range(0) ? "full" : "none")};
  mt::ModelRunner r(mt::load_config(req), pm);
  r.init_parameters(1);
  r.enable_gradients();
  mt::HostBatch hb;
  hb.batch = 4;
  hb.seq = 512;
  for (int i = 0; i < 4 * 512; ++i) {
    hb.inputs.push_back(i % 64);
    hb.targets.push_back((i + 1) % 64);
  }
  mt::DeviceBatch db = r.upload(hb);
  auto step = [&] {
    mt::Graph g(r.backend());
    mt::Tensor loss = r.loss(g, db, 0.f);
    g.backward(loss);
  };
  step();  // warm-up
  auto* prof = const_cast<mt::ProfilingBackend*>(r.profiler());
  prof->reset();
  for (auto _ : state) step();
  double gemm = 0, total = 0;
  for (const auto& [op, t] : prof->times()) {
    total += t.seconds;
    if (op == "matmul") gemm += t.seconds;
  }
  // Layer FLOPs per token: 6 x layer matmul params + causal attention 6 x heads x hd x T.
  const double d = 768, f = 2048, T = 512;
  const double flops = 4 * 512 * (6 * (4 * d * d + 3 * d * f) + 6 * 12 * 64 * T);
  state.counters["outside_gemm_pct"] = 100 * (total - gemm) / total;
  state.counters["layer_TFLOPs"] =
      benchmark::Counter(flops * 1e-12, benchmark::Counter::kIsIterationInvariantRate);
  std::fprintf(stderr, "%s", prof->report().c_str());
}
BENCHMARK(BM_LlamaLayer)->Arg(0)->Arg(1)->ArgName("remat_full")->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(2.0);

}  // namespace

BENCHMARK_MAIN();
