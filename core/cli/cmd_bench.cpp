// mt bench: throughput benchmarks, JSON on stdout.
//   mt bench train [--model=NAME] [key=value ...]   (default: configuration M, llama-bench-m)
//     one JSON object: tokens/s, model TFLOP/s and MFU of a short synthetic training run.
//   mt bench decode [--model=NAME] [steps=N] [depth=N] [dtypes=float32,bfloat16]
//   [parts=batch8,prefill,batch1]
//                                                   prefill and decode throughput (M and ~1B);
//     parts= runs only those (the others print null), e.g. parts=batch1 for a quick decode;
//     depth= the prompt's tokens before the timed steps (128; llama-bench's -d); the line's
//     decode_depth is the cache rows the first timed step reads (the prompt and 2 warm-up steps).
//   mt bench gemm [--model=NAME] [shapes=MxKxN,...] [key=value ...]
//     one JSON line per product c[M, N] = a[M, K] @ b[K, N] through Backend::matmul: median ms
//     and TFLOP/s. Default shapes: a transformer's projections (attention, MLP up and down, LM
//     head) for tokens=8192 of llama2-7b and llama-bench-1b, or for tokens=256 of llama-bench-m
//     on the CPU backend; --model=NAME takes one model's. dtype= (default bfloat16) is the type
//     of a, b and c; products accumulate in f32. trans_a=/trans_b=true store a as [K, M] / b as
//     [N, K] (the backward's products).
//   mt bench attention [shapes=BxTxHxD,...] [attention=flash|dot_product] [key=value ...]
//     one JSON line per case: forward and forward+backward of the AttentionKernel, median ms and
//     TFLOP/s. Default cases: flash at B=1 and 2, T=4096, H=32, D=128 and both kernels at
//     T=1024 (dot_product's [T, T] scores make it the small-T reference), or T=512, H=8, D=64 on
//     the CPU backend; attention= runs every case with that kernel. kv_heads= (default H, fewer
//     is GQA), causal= (default true), dtype= (default bfloat16).
//   mt bench moe [--model=NAME] [tokens=N] [backward=true|false] [key=value ...]
//     one JSON line: a mixture-of-experts layer (blocks::moe on a Graph: router, top-k routing,
//     sort by expert, gather, one grouped matmul per projection, weighted scatter-add, auxiliary
//     losses) forward and forward+backward, median ms and the GFLOP/s of its grouped matmuls
//     (2 x tokens x top_k x 3 x d_model x hidden forward, three times that with the backward),
//     against the same FLOPs as dense GEMMs on the same backend (the three projections of
//     tokens x top_k rows through one expert's matrices with Backend::matmul, and their six
//     backward products), and the ratio; also the three grouped matmuls alone (no routing).
//     The cases are timed interleaved (each timed repeat runs each of them once in turn);
//     profile=true then times one more call of the layer per op (stderr).
//     Default: mixtral-8x7b's layer (d_model 4096, experts 14336 wide, 8 experts, top 2) at
//     tokens=256 on the CPU backend (float32) or 8192 elsewhere (bfloat16).
//   Shared by gemm, attention and moe: backend= (default cpu), warmup= (calls before timing),
//   iters= (calls per timed repeat, between two synchronize()), repeats= (timed repeats; the
//   median is reported). FLOPs: 2MKN per product; attention forward 4 B T S H D (QK^T and PV)
//   and forward+backward three times that (DESIGN.md's model FLOPs: the backward's recomputed
//   scores are not counted), halved when causal.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <thread>
#include <vector>

#include "cli.h"
#include "communicator.h"
#include "decoder.h"
#include "json.h"
#include "memory_plan.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/blocks.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "profiling_backend.h"
#include "trainer.h"

namespace mt::cli {

namespace {

// Takes the bench's own `key=value` arguments (keys configs/base.yml does not have) out of the
// overrides before the config sees them; the last one wins, as for config keys.
std::optional<std::string> take_key(std::vector<std::string>& overrides, const std::string& key) {
  std::optional<std::string> value;
  const std::string prefix = key + "=";
  for (auto it = overrides.begin(); it != overrides.end();) {
    if (it->rfind(prefix, 0) == 0) {
      value = it->substr(prefix.size());
      it = overrides.erase(it);
    } else {
      ++it;
    }
  }
  return value;
}

bool has_key(const std::vector<std::string>& overrides, const std::string& key) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return o.rfind(key + "=", 0) == 0; });
}

// The whole of `text` as an integer, or nothing.
std::optional<int64_t> to_int(const std::string& text) {
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return v;
}

int64_t parse_count(const std::string& key, const std::string& text, int64_t min) {
  const auto v = to_int(text);
  if (!v || *v < min)
    throw UsageError(fmt::format("{}={} must be an integer of at least {}.", key, text, min));
  return *v;
}

bool parse_flag(const std::string& key, const std::string& text) {
  if (text == "true") return true;
  if (text == "false") return false;
  throw UsageError(key + "=" + text + " must be true or false.");
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t end; (end = s.find(sep, start)) != std::string::npos; start = end + 1)
    parts.push_back(s.substr(start, end - start));
  parts.push_back(s.substr(start));
  return parts;
}

// A row's model: the named model, and the --config file layered over it (its keys may be a whole
// other model: before, `--config=my.yml` rows were labelled llama-bench-m and llama-bench-1b,
// two rows of the file's one model).
std::string bench_label(const Config& cfg, const Args& args) {
  return args.config_file.empty() ? model_label(cfg)
                                  : model_label(cfg) + " + --config=" + args.config_file;
}

int bench_train(Args args) {
  if (args.model.empty()) args.model = "llama-bench-m";
  // Benchmark defaults, before the user's overrides so those still win.
  const std::string out = (std::filesystem::temp_directory_path() / "mt-bench").string();
  std::vector<std::string> defaults = {"steps=6",
                                       "dataset_type=synthetic",
                                       "eval_interval=-1",
                                       "enable_checkpointing=false",
                                       "base_output_directory=" + out,
                                       "run_name=train"};
  args.overrides.insert(args.overrides.begin(), defaults.begin(), defaults.end());
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  if (cfg.get_int("steps") <= kUntimedSteps)
    throw UsageError(fmt::format(
        "mt bench train needs steps={} or more (now {}): its medians leave out the first {} "
        "steps, which warm up the allocator and caches.",
        kUntimedSteps + 1, cfg.get_int("steps"), kUntimedSteps));
  std::fprintf(stderr, "mt bench train: %s, %ld steps (medians exclude the first %ld)...\n",
               bench_label(cfg, args).c_str(), static_cast<long>(cfg.get_int("steps")),
               static_cast<long>(kUntimedSteps));
  // Under mpirun, one rank of a data-parallel job: tokens/s counts every rank's tokens.
  std::unique_ptr<Communicator> comm = make_communicator(cfg, pm);
  const TrainSummary s = train_on_ranks(cfg, pm, /*quiet=*/true, *comm, "mt bench");
  if (comm->rank() != 0) return 0;
  std::printf(
      "{\"bench\": \"train\", \"model\": \"%s\", \"backend\": \"%s\", \"ranks\": %d, "
      "\"num_threads\": %ld, \"batch\": %ld, \"seq\": %ld, \"steps\": %ld, \"dtype\": \"%s\", "
      "\"attention\": \"%s\", "
      "\"remat_policy\": \"%s\", \"tokens_per_sec\": %.2f, \"model_tflops_per_sec\": %.5f, "
      "\"mfu\": %.5f, \"step_time_ms\": %.1f, \"communication_ms\": %.2f, "
      "\"communication_share\": %.4f, \"communication_bytes\": %.0f, \"final_loss\": %.4f}\n",
      bench_label(cfg, args).c_str(), cfg.get_string("backend").c_str(), comm->size(),
      static_cast<long>(cfg.get_int("num_threads")),
      static_cast<long>(cfg.get_int("per_device_batch_size")),
      static_cast<long>(cfg.get_int("max_target_length")), static_cast<long>(s.steps),
      cfg.get_string("dtype").c_str(), cfg.get_string("attention").c_str(),
      cfg.get_string("remat_policy").c_str(), s.tokens_per_sec, s.tflops_per_device, s.mfu,
      s.step_time_ms, s.communication_ms,
      s.step_time_ms > 0 ? s.communication_ms / s.step_time_ms : 0.0, s.communication_bytes,
      s.final_loss);
  return 0;
}

// Which parts `mt bench decode` runs (parts=; all by default).
struct DecodeParts {
  bool batch8 = true, prefill = true, batch1 = true;
};

// One model and dtype: prefill of 512-token prompts, decode at batch 1 and 8 after prompts of
// `depth` tokens (random weights: throughput does not depend on their values).
std::string bench_decode_one(Args args, const std::string& model, const std::string& dtype,
                             int64_t steps, int64_t depth, DecodeParts parts) {
  args.model = model;
  // Room for the prefill's 512 tokens, and for the prompt, the two warm-up steps and the timed
  // ones.
  const int64_t length = std::max<int64_t>(1024, depth + steps + 2);
  args.overrides.insert(args.overrides.begin(), {"dtype=" + dtype, "weight_dtype=" + dtype,
                                                 "max_target_length=" + std::to_string(length)});
  Config cfg = resolve_config(args);
  // The row is labelled with its dtype: a dtype or weight_dtype the user's other layers set
  // (the command line, --config, M_ variables) would run another configuration under it.
  for (const char* k : {"dtype", "weight_dtype"})
    if (cfg.get_string(k) != dtype)
      cfg.reject(k, "is set to " + cfg.get_string(k) + ", but mt bench decode sets dtype and " +
                        "weight_dtype for each of its runs from dtypes= (here " + dtype +
                        "): its row would be labelled with another configuration than it ran. "
                        "Choose them with dtypes=float32,bfloat16 (or one of them) instead.");
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  ModelRunner r(cfg, pm);
  r.init_parameters(static_cast<uint64_t>(cfg.get_int("init_weights_seed")));
  r.apply_quantization(cfg);  // as mt decode stores them
  const ModelDims d = r.model().dims();
  std::mt19937_64 rng(5);
  auto prompt = [&](int64_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(d.vocab_size));
    return p;
  };
  using Clock = std::chrono::steady_clock;
  auto secs = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  // Prefill: the median of three 512-token prompts (after one warm-up): one timed prompt moved
  // by half between runs on a shared machine. Run after batch 8's decode, on the weights as mt
  // decode lays them out for a single prompt (transposed where its decode pays for it).
  auto measure_prefill = [&] {
    Decoder dec(r, 1, length);
    dec.prefill(0, prompt(512), /*last_only=*/true);
    std::vector<double> tps;
    for (int rep = 0; rep < 3; ++rep) {
      dec.reset();
      const auto t0 = Clock::now();
      dec.prefill(0, prompt(512), /*last_only=*/true);
      tps.push_back(512 / secs(t0));
    }
    std::sort(tps.begin(), tps.end());
    return tps[1];
  };
  // Bytes of weights: all of them, and what a batch-1 decode step reads: a routed expert
  // stack's active share (ParamSpec::active, k of E experts), one row of an embedding table
  // that is only looked up (the token embedding, and GPT's learned position table; a tied
  // embedding is also the LM head, read whole), everything else whole.
  size_t weight_bytes = 0;
  double step_bytes = 0;
  for (auto& p : r.params()) {
    const auto n = static_cast<double>(p.value.nbytes());
    weight_bytes += p.value.nbytes();
    if (p.spec.matmul)
      step_bytes += n * static_cast<double>(p.spec.active);
    else if ((p.name == "embedding" || p.name == "position_embedding") && p.value.ndim() == 2)
      step_bytes += n / static_cast<double>(p.value.dim(0));
    else
      step_bytes += n;
  }
  const size_t elt = dtype_size(r.compute_dtype());
  // What each layer's cache holds per token (its CacheSpec: k and v, or a latent), and the
  // bytes a step reads at a given length (a windowed layer reads its window at most).
  // (quantize_kvcache: a byte a value and an f32 scale per head or per token.)
  const std::vector<CacheSpec> specs = r.cache_specs();
  const KvCacheQuant& kq = r.kv_cache_quant();
  auto entry_bytes = [&](const Shape& e) {
    if (!kq.on) return static_cast<double>(shape_numel(e) * static_cast<int64_t>(elt));
    return static_cast<double>(shape_numel(e) + 4 * (kq.per_head && e.size() >= 2 ? e[0] : 1));
  };
  double cache_bytes_per_token = 0;
  for (const CacheSpec& c : specs)
    for (const Shape& e : c.entries) cache_bytes_per_token += entry_bytes(e);
  auto cache_bytes_read = [&](int64_t length) {
    double bytes = 0;
    for (const CacheSpec& c : specs) {
      const int64_t rows = c.window > 0 ? std::min(length, c.window) : length;
      for (const Shape& e : c.entries) bytes += static_cast<double>(rows) * entry_bytes(e);
    }
    return bytes;
  };
  // Whether decode steps replay a recording (CUDA graphs; Decoder::step_recording), per batch.
  std::string recording[2] = {"not run", "not run"};
  int64_t depth_read = 0;  // cache rows before the first timed step (sequence 0's)
  auto decode = [&](int64_t batch, double* bytes_per_s) {
    Decoder dec(r, batch, length);
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) dec.prefill(b, prompt(depth), /*last_only=*/true);
    std::vector<bool> active(static_cast<size_t>(batch), true);
    // Warm-up: the first step runs as it comes, the second is recorded where the backend can.
    dec.step(next, active);
    dec.step(next, active);
    const std::string& rec = dec.step_recording();
    if (!rec.empty() && rec != "recorded" &&
        rec.find("backend runs each op as it comes") == std::string::npos)
      std::fprintf(stderr, "mt bench decode: batch %lld: %s\n", static_cast<long long>(batch),
                   rec.c_str());
    recording[batch == 1 ? 0 : 1] = rec == "recorded" ? "recorded" : "each op";
    depth_read = dec.length(0);
    const auto t0 = Clock::now();
    double kv_bytes = 0;
    for (int64_t s = 0; s < steps; ++s) {
      kv_bytes += cache_bytes_read(dec.length(0));
      dec.step(next, active);
    }
    const double t = secs(t0);
    if (bytes_per_s) *bytes_per_s = (step_bytes * static_cast<double>(steps) + kv_bytes) / t;
    return static_cast<double>(batch * steps) / t;
  };
  // As mt decode stores the weights: [K, N] for 8 sequences (and the prefill above) unless
  // transposing pays for them too, the projections transposed for one
  // (ModelRunner::rows_layout_pays, transpose_projections).
  // q/k/v and gate/up as one product each where they are rows (ModelRunner::fuse_projections).
  if (r.rows_layout_pays(8)) r.transpose_projections();
  r.fuse_projections();
  // profile=true: each part's time per op (the profiler reset before it).
  auto profiled = [&](const char* part, auto&& run) {
    if (r.profiler()) const_cast<ProfilingBackend*>(r.profiler())->reset();
    const double v = run();
    if (r.profiler())
      std::fprintf(stderr, "mt bench decode: %s %s, %s, time per op:\n%s", model.c_str(),
                   dtype.c_str(), part, r.profiler()->report().c_str());
    return v;
  };
  // A part left out of parts= prints null.
  auto figure = [](bool ran, std::string text) { return ran ? text : std::string("null"); };
  const double b8 = parts.batch8 ? profiled("batch 8", [&] { return decode(8, nullptr); }) : 0;
  if (r.rows_layout_pays(1)) {
    r.transpose_projections();
    r.fuse_projections();
  }
  const double prefill_tps =
      parts.prefill ? profiled("prefill of 512 tokens (4 prompts)", measure_prefill) : 0;
  double bw = 0;
  const double b1 = parts.batch1 ? profiled("batch 1", [&] { return decode(1, &bw); }) : 0;
  return fmt::format(
      "{{\"model\": \"{}\", \"dtype\": \"{}\", \"quantization\": \"{}\", \"weight_bytes\": {}, "
      "\"prefill_512_tokens_per_sec\": {}, \"decode_batch1_tokens_per_sec\": {}, "
      "\"decode_batch1_bytes_per_sec\": {}, \"decode_batch8_tokens_per_sec\": {}, "
      "\"decode_depth\": {}, \"kv_cache\": \"{}\", \"kv_cache_bytes_per_token\": {:.0f}, "
      "\"decode_weight_bytes_per_token\": {:.4g}, \"decode_steps\": \"batch 1 {}, batch 8 {}\"}}",
      bench_label(cfg, args), dtype, cfg.get_string("quantization"), weight_bytes,
      figure(parts.prefill, fmt::format("{:.1f}", prefill_tps)),
      figure(parts.batch1, fmt::format("{:.2f}", b1)),
      figure(parts.batch1, fmt::format("{:.4g}", bw)),
      figure(parts.batch8, fmt::format("{:.2f}", b8)),
      figure(parts.batch1 || parts.batch8, std::to_string(depth_read)),
      kq.on ? (kq.per_head ? "int8 (dkv)" : "int8 (heads_and_dkv)") : dtype, cache_bytes_per_token,
      step_bytes, recording[0], recording[1]);
}

// STREAM-like triad a = b + s * c over arrays far larger than the caches, on all cores: the
// memory bandwidth that batch-1 decode is measured against (bytes counted: 3 per element x 4).
double triad_bytes_per_sec() {
  const size_t n = size_t{1} << 25;  // 128 MiB per array
  std::vector<float> a(n), b(n, 1.f), c(n, 2.f);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  auto run = [&] {
    std::vector<std::thread> ts;
    // A thread the system refuses: the started ones are joined before the error goes on to
    // main's message (a joinable thread destroyed is std::terminate).
    try {
      for (unsigned t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
          for (size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.f * c[i];
        });
    } catch (...) {
      for (auto& t : ts) t.join();
      throw;
    }
    for (auto& t : ts) t.join();
  };
  run();  // first touch
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 3.0 * 4.0 * static_cast<double>(n) / s);
  }
  return best;
}

int bench_decode(const Args& args) {
  std::vector<std::string> models = {"llama-bench-m", "llama-bench-1b"};
  if (!args.model.empty()) models = {args.model};
  // A --config file is one model (over llama-bench-m when none is named), not one per default.
  else if (!args.config_file.empty())
    models = {"llama-bench-m"};
  Args rest = args;
  rest.model.clear();
  const int64_t steps = parse_count("steps", take_key(rest.overrides, "steps").value_or("16"), 1);
  // The prompt's length before the timed steps (llama-bench's -d): the attention reads that
  // much KV cache a step.
  const int64_t depth = parse_count("depth", take_key(rest.overrides, "depth").value_or("128"), 1);
  // The bench's own key: which of float32,bfloat16 to run (comma-separated).
  std::vector<std::string> dtypes = {"float32", "bfloat16"};
  if (const auto v = take_key(rest.overrides, "dtypes")) {
    dtypes = split(*v, ',');
    for (const auto& d : dtypes)
      if (d != "float32" && d != "bfloat16")
        throw UsageError("mt bench decode: dtypes=" + *v + " names '" + d +
                         "'; it takes float32, bfloat16 or both, comma-separated.");
  }
  DecodeParts parts;
  if (const auto v = take_key(rest.overrides, "parts")) {
    parts = DecodeParts{false, false, false};
    for (const auto& part : split(*v, ','))
      if (part == "batch8")
        parts.batch8 = true;
      else if (part == "prefill")
        parts.prefill = true;
      else if (part == "batch1")
        parts.batch1 = true;
      else
        throw UsageError("mt bench decode: parts=" + *v + " names '" + part +
                         "'; it takes batch8, prefill and batch1, comma-separated.");
  }
  const double triad = triad_bytes_per_sec();
  double peak = 0;
  {
    Args first_model = rest;  // the words may hold the family's keys: resolved with its model
    first_model.model = models.front();
    Config cfg = resolve_config(first_model);
    PluginManager pm;
    peak = pm.make_backend(cfg.get_string("backend"), cfg)->peak_flops(DType::f32);
  }
  std::string out = fmt::format(
      "{{\"bench\": \"decode\", \"memory_bandwidth_triad_bytes_per_sec\": {:.4g}, "
      "\"peak_flops_f32\": {:.4g}, \"results\": [",
      triad, peak);
  bool first = true;
  for (const auto& m : models)
    for (const auto& dt : dtypes) {
      std::fprintf(stderr, "mt bench decode: %s %s...\n", m.c_str(), dt.c_str());
      out += std::string(first ? "" : ", ") + bench_decode_one(rest, m, dt, steps, depth, parts);
      first = false;
    }
  std::printf("%s]}\n", out.c_str());
  return 0;
}

// ---- gemm and attention: one kernel at a time -------------------------------------------------

using Clock = std::chrono::steady_clock;

// "8192x4096x4096,1024x768x768" -> one vector of positive sizes per shape, each of `form`'s rank.
std::vector<std::vector<int64_t>> parse_shapes(const std::string& text, const std::string& form) {
  const size_t rank = split(form, 'x').size();
  std::vector<std::vector<int64_t>> shapes;
  for (const auto& item : split(text, ',')) {
    const auto dims = split(item, 'x');
    std::vector<int64_t> shape;
    for (const auto& d : dims) {
      const auto v = to_int(d);
      if (!v || *v <= 0) break;
      shape.push_back(*v);
    }
    if (dims.size() != rank || shape.size() != rank)
      throw UsageError("shapes=" + text + " must be a comma-separated list of " + form +
                       " with positive sizes; '" + item + "' is not.");
    shapes.push_back(shape);
  }
  return shapes;
}

// warmup= calls first, then repeats= timed runs of iters= calls each between two synchronize().
struct Timing {
  int64_t warmup = 0, iters = 0, repeats = 0;
};

// The timing keys, taken out before the config sees them: their defaults depend on the backend.
std::vector<std::string> take_timing_keys(std::vector<std::string>& overrides) {
  std::vector<std::string> keys;
  for (const char* k : {"warmup", "iters", "repeats"})
    if (auto v = take_key(overrides, k)) keys.push_back(std::string(k) + "=" + *v);
  return keys;
}

// A GPU gets more calls: its clocks ramp up and one call is short against the timer.
Timing take_timing(std::vector<std::string>& overrides, bool cpu) {
  Timing t;
  t.warmup = parse_count("warmup", take_key(overrides, "warmup").value_or(cpu ? "1" : "5"), 0);
  t.iters = parse_count("iters", take_key(overrides, "iters").value_or(cpu ? "2" : "10"), 1);
  t.repeats = parse_count("repeats", take_key(overrides, "repeats").value_or(cpu ? "3" : "5"), 1);
  return t;
}

// Median milliseconds per call over the timed repeats.
double median_ms(Backend& be, const Timing& t, const std::function<void()>& call) {
  for (int64_t i = 0; i < t.warmup; ++i) call();
  be.synchronize();
  std::vector<double> ms;
  for (int64_t r = 0; r < t.repeats; ++r) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < t.iters; ++i) call();
    be.synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() /
                 static_cast<double>(t.iters));
  }
  std::sort(ms.begin(), ms.end());
  const size_t n = ms.size();
  return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

// Uniform values in [-bound, bound) made on the host from a fixed seed (splitmix64) and copied
// in: kernels are not measured on zeros, which some hardware multiplies faster.
Tensor random_tensor(Backend& be, const Shape& shape, DType dt, uint64_t seed, float bound) {
  Tensor t = be.empty(shape, dt);
  uint64_t state = seed * 0x9E3779B97F4A7C15ull;
  auto next = [&] {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return bound * (static_cast<float>(z >> 40) * 0x1p-23f - 1.f);
  };
  const size_t n = static_cast<size_t>(t.numel());
  if (dt == DType::bf16) {
    std::vector<uint16_t> h(n);
    for (auto& x : h) x = f32_to_bf16(next());
    be.copy_from_host(t, h.data());
  } else {
    std::vector<float> h(n);
    for (auto& x : h) x = next();
    be.copy_from_host(t, h.data());
  }
  return t;
}

// The config of a kernel bench: the user's config keys over the bench's defaults.
Config kernel_config(Args& args) {
  args.overrides.insert(args.overrides.begin(), "dtype=bfloat16");
  Config cfg = resolve_config(args);
  refuse_quantization(cfg,
                      "mt bench " + (args.positional.empty() ? std::string() : args.positional[0]),
                      "times its kernels on float weights");
  return cfg;
}

DType compute_dtype(const Config& cfg) {
  DType dt = DType::f32;
  if (!parse_dtype(cfg.get_string("dtype"), dt) || !(dt == DType::f32 || dt == DType::bf16))
    cfg.reject("dtype", "must be float32 or bfloat16.");
  return dt;
}

std::unique_ptr<PluginManager> plugin_manager(const Config& cfg) {
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  return std::make_unique<PluginManager>(dirs);
}

// A case that failed at work (a kernel's mt::Error): one sentence on stderr and a JSON line
// with the error, so a table built from the output shows it; the other cases still run.
void report_failure(const std::string& bench, const std::string& name, const std::string& fields,
                    const std::string& what) {
  std::fprintf(stderr, "mt bench %s: %s failed: %s\n", bench.c_str(), name.c_str(), what.c_str());
  std::printf("{\"bench\": \"%s\", \"name\": %s, %s, \"error\": %s}\n", bench.c_str(),
              json::quote(name).c_str(), fields.c_str(), json::quote(what).c_str());
  std::fflush(stdout);
}

struct GemmCase {
  std::string name;
  int64_t m, k, n;
};

// One model's projections for `tokens` rows: attention (q and output; k/v when grouped), the
// MLP's up (also gate) and down, and the LM head.
std::vector<GemmCase> model_gemms(Args args, const std::string& model, int64_t tokens) {
  args.model = model;
  const Config c = resolve_config(args);
  const int64_t d = c.get_int("base_emb_dim"), f = c.get_int("base_mlp_dim");
  const int64_t q = c.get_int("base_num_query_heads") * c.get_int("head_dim");
  const int64_t kv = c.get_int("base_num_kv_heads") * c.get_int("head_dim");
  std::vector<GemmCase> cases = {{model + ".attn", tokens, d, q}};
  if (q != d) cases.push_back({model + ".attn_out", tokens, q, d});
  if (kv != q) cases.push_back({model + ".attn_kv", tokens, d, kv});
  cases.push_back({model + ".mlp_up", tokens, d, f});
  cases.push_back({model + ".mlp_down", tokens, f, d});
  cases.push_back({model + ".lm_head", tokens, d, c.get_int("vocab_size")});
  return cases;
}

// A kernel case that needs more bytes than the backend may hold fails before it allocates (the
// kernel's OOM killer ended such a run with no output).
void refuse_past_memory(Backend& be, double need, const std::string& backend) {
  const auto limit = static_cast<double>(be.memory_stats().bytes_limit);
  if (limit > 0 && need > limit)
    throw Error(
        fmt::format("does not fit: it needs about {} of the {} the {} backend may hold; "
                    "nothing was allocated",
                    human_bytes(need), human_bytes(limit), backend));
}

int bench_gemm(Args args) {
  auto& ov = args.overrides;
  const auto shapes = take_key(ov, "shapes");
  const auto tokens = take_key(ov, "tokens");
  const bool ta = parse_flag("trans_a", take_key(ov, "trans_a").value_or("false"));
  const bool tb = parse_flag("trans_b", take_key(ov, "trans_b").value_or("false"));
  std::vector<std::string> timing_keys = take_timing_keys(ov);
  const std::string model = args.model;
  args.model.clear();
  const Config cfg = kernel_config(args);
  const std::string backend = cfg.get_string("backend");
  const bool cpu = backend == "cpu";
  const Timing timing = take_timing(timing_keys, cpu);
  const DType dt = compute_dtype(cfg);

  std::vector<GemmCase> cases;
  if (shapes) {
    for (const auto& s : parse_shapes(*shapes, "MxKxN"))
      cases.push_back({fmt::format("{}x{}x{}", s[0], s[1], s[2]), s[0], s[1], s[2]});
  } else {
    const int64_t t = parse_count("tokens", tokens.value_or(cpu ? "256" : "8192"), 1);
    std::vector<std::string> models = {"llama2-7b", "llama-bench-1b"};
    if (cpu) models = {"llama-bench-m"};
    if (!model.empty()) models = {model};
    for (const auto& m : models)
      for (auto& c : model_gemms(args, m, t)) cases.push_back(std::move(c));
  }

  auto pm = plugin_manager(cfg);
  std::unique_ptr<Backend> be = pm->make_backend(backend, cfg);
  const double peak = be->peak_flops(dt);
  std::fprintf(stderr, "mt bench gemm: %s; %zu shape(s), %s, median of %ld x %ld calls\n",
               be->describe().c_str(), cases.size(), dtype_name(dt),
               static_cast<long>(timing.repeats), static_cast<long>(timing.iters));
  int failed = 0;
  for (const auto& c : cases) {
    const std::string fields = fmt::format(
        "\"backend\": \"{}\", \"M\": {}, \"K\": {}, \"N\": {}, \"trans_a\": {}, \"trans_b\": {}, "
        "\"dtype\": \"{}\"",
        backend, c.m, c.k, c.n, ta, tb, dtype_name(dt));
    try {
      // The three operands (and on the CPU, f32 working copies of bf16 ones) must fit in what
      // the backend may hold: a shape past it was killed by the kernel's OOM killer mid-fill.
      const double elems = static_cast<double>(c.m) * static_cast<double>(c.k) +
                           static_cast<double>(c.k) * static_cast<double>(c.n) +
                           static_cast<double>(c.m) * static_cast<double>(c.n);
      const double need =
          elems * static_cast<double>(dtype_size(dt)) + (cpu && dt == DType::bf16 ? 4 * elems : 0);
      refuse_past_memory(*be, need, backend);
      // c[M, N] = a[M, K] @ b[K, N], a stored [K, M] when trans_a, b stored [N, K] when trans_b.
      Tensor a = random_tensor(*be, ta ? Shape{c.k, c.m} : Shape{c.m, c.k}, dt, 1, 1.f);
      Tensor b = random_tensor(*be, tb ? Shape{c.n, c.k} : Shape{c.k, c.n}, dt, 2, 1.f);
      Tensor out = be->empty({c.m, c.n}, dt);
      const double ms = median_ms(*be, timing, [&] { be->matmul(a, b, out, ta, tb); });
      const double tflops = 2.0 * static_cast<double>(c.m) * static_cast<double>(c.k) *
                            static_cast<double>(c.n) / (ms * 1e-3) / 1e12;
      std::printf("%s\n", fmt::format("{{\"bench\": \"gemm\", \"name\": {}, {}, \"median_ms\": "
                                      "{:.4f}, \"tflops\": {:.4g}, \"peak_tflops\": {:.4g}}}",
                                      json::quote(c.name), fields, ms, tflops, peak / 1e12)
                              .c_str());
      std::fflush(stdout);
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      ++failed;
      report_failure("gemm", c.name, fields, e.what());
    }
  }
  return failed ? 1 : 0;
}

struct AttentionCase {
  std::string kernel;
  int64_t b, t, h, kv, d;
};

int bench_attention(Args args) {
  auto& ov = args.overrides;
  const auto shapes = take_key(ov, "shapes");
  const auto kv_heads = take_key(ov, "kv_heads");
  const bool causal = parse_flag("causal", take_key(ov, "causal").value_or("true"));
  std::vector<std::string> timing_keys = take_timing_keys(ov);
  const bool kernel_given = has_key(ov, "attention");
  if (!args.model.empty())
    throw UsageError("mt bench attention takes its shapes as shapes=BxTxHxD[,...], not --model=" +
                     args.model + ".");
  const Config cfg = kernel_config(args);
  const std::string backend = cfg.get_string("backend");
  const bool cpu = backend == "cpu";
  const Timing timing = take_timing(timing_keys, cpu);
  const DType dt = compute_dtype(cfg);

  std::vector<AttentionCase> cases;
  auto add = [&](const std::string& kernel, int64_t b, int64_t t, int64_t h, int64_t d) {
    const int64_t kv = kv_heads ? parse_count("kv_heads", *kv_heads, 1) : h;
    if (h % kv != 0)
      throw UsageError(fmt::format("kv_heads={} must divide the {} query heads.", kv, h));
    AttentionCase c{kernel_given ? cfg.get_string("attention") : kernel, b, t, h, kv, d};
    for (const auto& o : cases)
      if (o.kernel == c.kernel && o.b == b && o.t == t && o.h == h && o.d == d) return;
    cases.push_back(c);
  };
  if (shapes) {
    for (const auto& s : parse_shapes(*shapes, "BxTxHxD"))
      add(cfg.get_string("attention"), s[0], s[1], s[2], s[3]);
  } else if (cpu) {
    add("flash", 1, 512, 8, 64);
    add("dot_product", 1, 512, 8, 64);
  } else {
    add("flash", 1, 1024, 32, 128);
    add("dot_product", 1, 1024, 32, 128);
    add("flash", 1, 4096, 32, 128);
    add("flash", 2, 4096, 32, 128);
  }

  auto pm = plugin_manager(cfg);
  std::unique_ptr<Backend> be = pm->make_backend(backend, cfg);
  // A kernel the user named must exist (a usage error); a default one that the backend does not
  // offer yet fails its cases only.
  if (kernel_given) pm->make_attention(backend, cfg.get_string("attention"), *be);
  const double peak = be->peak_flops(dt);
  std::fprintf(stderr, "mt bench attention: %s; %zu case(s), %s, median of %ld x %ld calls\n",
               be->describe().c_str(), cases.size(), dtype_name(dt),
               static_cast<long>(timing.repeats), static_cast<long>(timing.iters));
  int failed = 0;
  for (const auto& c : cases) {
    const std::string name = fmt::format("{}.{}x{}x{}x{}", c.kernel, c.b, c.t, c.h, c.d);
    const std::string fields = fmt::format(
        "\"attention\": \"{}\", \"backend\": \"{}\", \"B\": {}, \"T\": {}, \"S\": {}, \"H\": {}, "
        "\"kv_heads\": {}, \"D\": {}, \"causal\": {}, \"dtype\": \"{}\"",
        c.kernel, backend, c.b, c.t, c.t, c.h, c.kv, c.d, causal, dtype_name(dt));
    try {
      std::unique_ptr<AttentionKernel> att = pm->make_attention(backend, c.kernel, *be);
      if (!att)
        throw Error("attention=" + c.kernel + " is registered by the " + backend +
                    " backend but not implemented there yet");
      const Shape qs{c.b, c.t, c.h, c.d}, kvs{c.b, c.t, c.kv, c.d};
      // What it holds (as bench gemm checks): q, out, dout, dq and k, v, dk, dv, f32 working
      // copies of them on the CPU in bf16, and dot_product's scores and their gradient.
      const double q_elems = static_cast<double>(c.b * c.t) * static_cast<double>(c.h * c.d),
                   kv_elems = static_cast<double>(c.b * c.t) * static_cast<double>(c.kv * c.d);
      const double tensors = 4 * (q_elems + kv_elems);
      const double scores = c.kernel == "dot_product"
                                ? 2.0 * static_cast<double>(c.b * c.h) * static_cast<double>(c.t) *
                                      static_cast<double>(c.t) * 4
                                : 0;
      const double need = tensors * static_cast<double>(dtype_size(dt)) +
                          (cpu && dt == DType::bf16 ? 4 * tensors : 0) + scores;
      refuse_past_memory(*be, need, backend);
      const float unit = std::sqrt(3.f);  // uniform with variance 1
      Tensor q = random_tensor(*be, qs, dt, 11, unit), k = random_tensor(*be, kvs, dt, 12, unit),
             v = random_tensor(*be, kvs, dt, 13, unit), dout = random_tensor(*be, qs, dt, 14, unit);
      Tensor out = be->empty(qs, dt), lse = be->empty({c.b, c.h, c.t}, DType::f32);
      Tensor dq = be->zeros(qs, dt), dk = be->zeros(kvs, dt), dv = be->zeros(kvs, dt);
      AttentionSpec spec;
      spec.causal = causal;
      auto forward = [&] { att->forward(q, k, v, {}, {}, spec, out, lse); };
      const double fwd_ms = median_ms(*be, timing, forward);
      const double fwd_bwd_ms = median_ms(*be, timing, [&] {
        forward();
        att->backward(dout, q, k, v, {}, {}, out, lse, spec, dq, dk, dv);
      });
      const double fwd_flop = 4.0 * static_cast<double>(c.b * c.t) * static_cast<double>(c.t) *
                              static_cast<double>(c.h * c.d) * (causal ? 0.5 : 1.0);
      std::printf("%s\n",
                  fmt::format("{{\"bench\": \"attention\", \"name\": {}, {}, \"fwd_ms\": "
                              "{:.4f}, \"fwd_tflops\": {:.4g}, \"fwd_bwd_ms\": {:.4f}, "
                              "\"fwd_bwd_tflops\": {:.4g}, \"peak_tflops\": {:.4g}}}",
                              json::quote(name), fields, fwd_ms, fwd_flop / (fwd_ms * 1e-3) / 1e12,
                              fwd_bwd_ms, 3 * fwd_flop / (fwd_bwd_ms * 1e-3) / 1e12, peak / 1e12)
                      .c_str());
      std::fflush(stdout);
    } catch (const Error& e) {
      ++failed;
      report_failure("attention", name, fields, e.what());
    }
  }
  return failed ? 1 : 0;
}

// ---- moe: one mixture-of-experts layer against dense GEMMs of the same FLOPs -----------------

// Median milliseconds per call of each of `calls`, timed interleaved (each timed repeat runs
// every call in turn), so a load that drifts on a shared machine weighs on all of them alike.
std::vector<double> interleaved_median_ms(Backend& be, const Timing& t,
                                          const std::vector<std::function<void()>>& calls) {
  for (const auto& call : calls)
    for (int64_t i = 0; i < t.warmup; ++i) call();
  be.synchronize();
  std::vector<std::vector<double>> ms(calls.size());
  for (int64_t r = 0; r < t.repeats; ++r)
    for (size_t c = 0; c < calls.size(); ++c) {
      const auto t0 = Clock::now();
      for (int64_t i = 0; i < t.iters; ++i) calls[c]();
      be.synchronize();
      ms[c].push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count() /
                      static_cast<double>(t.iters));
    }
  std::vector<double> medians;
  for (auto& v : ms) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    medians.push_back(n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]));
  }
  return medians;
}

int bench_moe(Args args) {
  auto& ov = args.overrides;
  const auto tokens_text = take_key(ov, "tokens");
  const bool with_backward = parse_flag("backward", take_key(ov, "backward").value_or("true"));
  std::vector<std::string> timing_keys = take_timing_keys(ov);
  const bool dtype_given = has_key(ov, "dtype");
  // The layer's shape from the model's config (its other keys are not used).
  Args model_args = args;
  if (model_args.model.empty()) model_args.model = "mixtral-8x7b";
  const std::string model = model_args.model;
  const Config mc = resolve_config(model_args);
  args.model.clear();
  Config cfg = resolve_config(args);
  refuse_quantization(cfg, "mt bench moe", "times the MoE layer on float weights");
  const std::string backend = cfg.get_string("backend");
  const bool cpu = backend == "cpu";
  if (!cpu && !dtype_given) {  // bfloat16 on a device; the CPU keeps float32, as training does
    args.overrides.insert(args.overrides.begin(), "dtype=bfloat16");
    cfg = resolve_config(args);
  }
  // One call is long on the CPU (seconds): one call per timed repeat unless told.
  timing_keys.insert(timing_keys.begin(), std::string("iters=") + (cpu ? "1" : "10"));
  const Timing timing = take_timing(timing_keys, cpu);
  const DType dt = compute_dtype(cfg);

  blocks::MoeSpec s;
  s.d_model = mc.get_int("base_emb_dim");
  const int64_t moe_dim = mc.get_int("base_moe_mlp_dim");
  s.hidden = moe_dim > 0 ? moe_dim : mc.get_int("base_mlp_dim");
  s.num_experts = mc.get_int("num_experts");
  s.top_k = mc.get_int("num_experts_per_tok");
  s.normalize_topk = mc.get_bool("norm_topk_prob");
  s.act = Activation::silu;
  s.gated = true;
  s.load_balance_weight = static_cast<float>(mc.get_float("load_balance_loss_weight"));
  if (s.num_experts < 2)
    throw UsageError("mt bench moe needs a model with num_experts > 1; --model=" + model + " has " +
                     std::to_string(s.num_experts) + ".");
  // It times blocks::moe; DeepSeek's layer (a sigmoid or grouped router, shared experts) is
  // the family's own, and its figures would be labelled with a model they do not time.
  if (const std::string block = mc.get_string("decoder_block"); block.rfind("deepseek", 0) == 0)
    throw UsageError(
        "mt bench moe times the mixture-of-experts block Mixtral and Qwen3-MoE use "
        "(blocks::moe: softmax top-k router); --model=" +
        model + " (decoder_block=" + block +
        ") routes with its family's own layer, which it does not time. Time "
        "that model's training with mt bench train.");
  const int64_t n = parse_count("tokens", tokens_text.value_or(cpu ? "256" : "8192"), 1);
  const int64_t d = s.d_model, h = s.hidden, E = s.num_experts, k = s.top_k, m = n * k;

  auto pm = plugin_manager(cfg);
  std::unique_ptr<Backend> be = pm->make_backend(backend, cfg);
  std::fprintf(stderr,
               "mt bench moe: %s; %s layer (d_model %ld, %ld experts of %ld, top %ld), %ld "
               "tokens, %s, median of %ld x %ld calls\n",
               be->describe().c_str(), model.c_str(), static_cast<long>(d), static_cast<long>(E),
               static_cast<long>(h), static_cast<long>(k), static_cast<long>(n), dtype_name(dt),
               static_cast<long>(timing.repeats), static_cast<long>(timing.iters));
  const std::string fields = fmt::format(
      "\"backend\": \"{}\", \"model\": \"{}\", \"d_model\": {}, \"hidden\": {}, "
      "\"experts\": {}, \"top_k\": {}, \"tokens\": {}, \"dtype\": \"{}\"",
      backend, model, d, h, E, k, n, dtype_name(dt));
  try {
    // Values: x with unit variance, weights as a trained layer's scale (1/sqrt(fan-in)), a router
    // whose random logits spread the tokens over the experts about evenly.
    const float unit = std::sqrt(3.f);
    Tensor x = random_tensor(*be, {n, d}, dt, 21, unit);
    Tensor dy = random_tensor(*be, {n, d}, dt, 22, unit);
    Tensor router = random_tensor(*be, {d, E}, dt, 23, unit / std::sqrt(static_cast<float>(d)));
    Tensor w_gate = random_tensor(*be, {E, d, h}, dt, 24, unit / std::sqrt(static_cast<float>(d)));
    Tensor w_up = random_tensor(*be, {E, d, h}, dt, 25, unit / std::sqrt(static_cast<float>(d)));
    Tensor w_down = random_tensor(*be, {E, h, d}, dt, 26, unit / std::sqrt(static_cast<float>(h)));
    // Gradient buffers (f32, as the trainer's), accumulated into across the timed calls.
    Tensor gx = be->zeros({n, d}, DType::f32), grouter = be->zeros({d, E}, DType::f32);
    Tensor gw_gate, gw_up, gw_down;
    if (with_backward) {
      gw_gate = be->zeros({E, d, h}, DType::f32);
      gw_up = be->zeros({E, d, h}, DType::f32);
      gw_down = be->zeros({E, h, d}, DType::f32);
      Graph::track(x, gx);
      Graph::track(router, grouter);
      Graph::track(w_gate, gw_gate);
      Graph::track(w_up, gw_up);
      Graph::track(w_down, gw_down);
    }
    static const std::vector<std::string> names = {"router", "w_gate", "w_up", "w_down"};
    const Params p(names, {router, w_gate, w_up, w_down});

    // The layer, as a decoder layer runs it (on `active`: the backend, or its profiler).
    Backend* active = be.get();
    float load_min = 0, load_max = 0;
    auto moe_forward = [&] {
      Graph g(*active, /*record=*/false);
      LayerOutput o = blocks::moe(g, p, s, x);
      for (const auto& a : o.aux) {
        if (a.name == "moe_load_min") be->copy_to_host(a.value, &load_min);
        if (a.name == "moe_load_max") be->copy_to_host(a.value, &load_max);
      }
    };
    auto moe_forward_backward = [&] {
      Graph g(*active);
      LayerOutput o = blocks::moe(g, p, s, x);
      // The output with a seed gradient and the load-balancing loss (the router's backward).
      g.backward({{o.x, dy}, {o.aux.at(0).value, Tensor()}});
    };
    // The three grouped matmuls alone, on the routing of one forward.
    Tensor xs, hs;
    Graph::ExpertOrder order;
    {
      Graph g(*be, false);
      const Graph::Routing r =
          g.route(g.matmul(x, router), static_cast<int>(k), false, s.normalize_topk);
      order = g.sort_by_expert(r.indices, E);
      xs = g.gather_rows(x, order.tokens);
      hs = be->empty({m, h}, dt);
      be->fill(hs, 0.5f);
    }
    auto grouped_forward = [&] {
      Graph g(*be, false);
      g.grouped_matmul(xs, w_gate, order.offsets);
      g.grouped_matmul(xs, w_up, order.offsets);
      g.grouped_matmul(hs, w_down, order.offsets);
    };
    // The dense GEMMs of the same FLOPs: m = tokens x top_k rows through expert 0's matrices.
    const Tensor wg0 = w_gate.slice0(0, 1).view({d, h}), wu0 = w_up.slice0(0, 1).view({d, h});
    const Tensor wd0 = w_down.slice0(0, 1).view({h, d});
    Tensor xd = random_tensor(*be, {m, d}, dt, 27, unit), dh_d = be->empty({m, h}, dt);
    Tensor hg = be->empty({m, h}, dt), hu = be->empty({m, h}, dt), yd = be->empty({m, d}, dt);
    Tensor dyd = random_tensor(*be, {m, d}, dt, 28, unit), dxd = be->empty({m, d}, dt);
    Tensor dwg = be->empty({d, h}, dt), dwu = be->empty({d, h}, dt), dwd = be->empty({h, d}, dt);
    auto dense_forward = [&] {
      be->matmul(xd, wg0, hg, false, false);
      be->matmul(xd, wu0, hu, false, false);
      be->matmul(hg, wd0, yd, false, false);
    };
    auto dense_forward_backward = [&] {
      dense_forward();
      be->matmul(dyd, wd0, dh_d, false, true);            // d(h) = dy @ w_down^T
      be->matmul(hg, dyd, dwd, true, false);              // dw_down = h^T dy
      be->matmul(dh_d, wg0, dxd, false, true);            // dx = dg @ w_gate^T
      be->matmul(dh_d, wu0, dxd, false, true, 1.f, 1.f);  //    + du @ w_up^T
      be->matmul(xd, dh_d, dwg, true, false);             // dw_gate = x^T dg
      be->matmul(xd, dh_d, dwu, true, false);             // dw_up = x^T du
    };
    const double flop =
        2.0 * static_cast<double>(m) * 3.0 * static_cast<double>(d) * static_cast<double>(h);
    auto gflops = [](double f, double ms) { return f / (ms * 1e-3) / 1e9; };
    const auto fwd =
        interleaved_median_ms(*be, timing, {moe_forward, grouped_forward, dense_forward});
    const double moe_fwd = fwd[0], grouped_fwd = fwd[1], dense_fwd = fwd[2];
    std::string out = fmt::format(
        "{{\"bench\": \"moe\", {}, \"grouped_gflop_fwd\": {:.4g}, \"load_min\": {:.4f}, "
        "\"load_max\": {:.4f}, \"moe_fwd_ms\": {:.4g}, \"moe_fwd_gflops\": {:.4g}, "
        "\"grouped_matmuls_fwd_ms\": {:.4g}, \"grouped_matmuls_fwd_gflops\": {:.4g}, "
        "\"dense_fwd_ms\": {:.4g}, \"dense_fwd_gflops\": {:.4g}, "
        "\"ratio_fwd_moe_over_dense\": {:.3f}",
        fields, flop / 1e9, load_min, load_max, moe_fwd, gflops(flop, moe_fwd), grouped_fwd,
        gflops(flop, grouped_fwd), dense_fwd, gflops(flop, dense_fwd), dense_fwd / moe_fwd);
    if (with_backward) {
      const auto fb =
          interleaved_median_ms(*be, timing, {moe_forward_backward, dense_forward_backward});
      const double moe_fb = fb[0], dense_fb = fb[1];
      out += fmt::format(
          ", \"moe_fwd_bwd_ms\": {:.4g}, \"moe_fwd_bwd_gflops\": {:.4g}, "
          "\"dense_fwd_bwd_ms\": {:.4g}, \"dense_fwd_bwd_gflops\": {:.4g}, "
          "\"ratio_fwd_bwd_moe_over_dense\": {:.3f}",
          moe_fb, gflops(3 * flop, moe_fb), dense_fb, gflops(3 * flop, dense_fb),
          dense_fb / moe_fb);
    }
    std::printf("%s, \"peak_gflops\": %.4g}\n", out.c_str(), be->peak_flops(dt) / 1e9);
    std::fflush(stdout);
    if (cfg.get_bool("profile")) {  // where one more call of the layer spends its time
      ProfilingBackend prof(*be);
      active = &prof;
      with_backward ? moe_forward_backward() : moe_forward();
      active = be.get();
      std::fprintf(stderr, "mt bench moe: one %s of the layer, time per op:\n%s",
                   with_backward ? "forward+backward" : "forward", prof.report().c_str());
    }
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    report_failure("moe", model, fields, e.what());
    return 1;
  }
  return 0;
}

}  // namespace

int cmd_bench(const Args& args) {
  const std::string what = args.positional.empty() ? "" : args.positional[0];
  if (what == "train") return bench_train(args);
  if (what == "decode") return bench_decode(args);
  if (what == "gemm") return bench_gemm(args);
  if (what == "attention") return bench_attention(args);
  if (what == "moe") return bench_moe(args);
  throw UsageError(
      "mt bench needs what to measure: `mt bench train` (training throughput of "
      "configuration M or --model=NAME), `mt bench decode` (prefill and decode "
      "throughput), `mt bench gemm` (matmul TFLOP/s at transformer shapes), "
      "`mt bench attention` (attention forward and backward TFLOP/s) or `mt bench moe` (a "
      "mixture-of-experts layer's grouped matmuls against dense GEMMs)" +
      std::string(what.empty() ? "" : "; '" + what + "' is not one of them") + ".");
}

}  // namespace mt::cli
