// mt bench: throughput benchmarks, JSON on stdout.
//   mt bench train [--model=NAME] [key=value ...]   (default: configuration M, llama-bench-m)
//     one JSON object: tokens/s, model TFLOP/s and MFU of a short synthetic training run.
//   mt bench decode [--model=NAME] [steps=N]        prefill and decode throughput (M and ~1B).
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
//   Shared by gemm and attention: backend= (default cpu), warmup= (calls before timing),
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
#include "decoder.h"
#include "json.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "plugin_manager.h"
#include "trainer.h"

namespace mt::cli {

namespace {

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
               cfg.get_string("model_name").c_str(), static_cast<long>(cfg.get_int("steps")),
               static_cast<long>(kUntimedSteps));
  const TrainSummary s = train(cfg, pm, /*quiet=*/true);
  std::printf(
      "{\"bench\": \"train\", \"model\": \"%s\", \"backend\": \"%s\", \"num_threads\": %ld, "
      "\"batch\": %ld, \"seq\": %ld, \"steps\": %ld, \"dtype\": \"%s\", \"attention\": \"%s\", "
      "\"remat_policy\": \"%s\", \"tokens_per_sec\": %.2f, \"model_tflops_per_sec\": %.5f, "
      "\"mfu\": %.5f, \"step_time_ms\": %.1f, \"final_loss\": %.4f}\n",
      cfg.get_string("model_name").c_str(), cfg.get_string("backend").c_str(),
      static_cast<long>(cfg.get_int("num_threads")),
      static_cast<long>(cfg.get_int("per_device_batch_size")),
      static_cast<long>(cfg.get_int("max_target_length")), static_cast<long>(s.steps),
      cfg.get_string("dtype").c_str(), cfg.get_string("attention").c_str(),
      cfg.get_string("remat_policy").c_str(), s.tokens_per_sec, s.tflops_per_device, s.mfu,
      s.step_time_ms, s.final_loss);
  return 0;
}

// One model and dtype: prefill of a 512-token prompt, decode at batch 1 and 8 (random weights:
// throughput does not depend on their values).
std::string bench_decode_one(Args args, const std::string& model, const std::string& dtype,
                             int64_t steps) {
  args.model = model;
  args.overrides.insert(args.overrides.begin(),
                        {"dtype=" + dtype, "weight_dtype=" + dtype, "max_target_length=1024"});
  Config cfg = resolve_config(args);
  std::vector<std::filesystem::path> dirs;
  for (const auto& d : cfg.get_string_list("plugin_dirs")) dirs.emplace_back(d);
  PluginManager pm(dirs);
  ModelRunner r(cfg, pm);
  r.init_parameters(1);
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
  // Prefill: one 512-token prompt (after one warm-up).
  double prefill_tps = 0;
  {
    Decoder dec(r, 1, 1024);
    dec.prefill(0, prompt(512));
    dec.reset();
    const auto t0 = Clock::now();
    dec.prefill(0, prompt(512));
    prefill_tps = 512 / secs(t0);
  }
  size_t weight_bytes = 0;
  for (auto& p : r.params()) weight_bytes += p.value.nbytes();
  const size_t elt = dtype_size(r.compute_dtype());
  auto decode = [&](int64_t batch, double* bytes_per_s) {
    Decoder dec(r, batch, 1024);
    std::vector<int32_t> next(static_cast<size_t>(batch));
    for (int64_t b = 0; b < batch; ++b) dec.prefill(b, prompt(128));
    std::vector<bool> active(static_cast<size_t>(batch), true);
    dec.step(next, active);  // warm-up
    const auto t0 = Clock::now();
    double kv_bytes = 0;
    for (int64_t s = 0; s < steps; ++s) {
      kv_bytes += 2.0 * static_cast<double>(d.num_layers * dec.length(0) * d.num_kv_heads *
                                            d.head_dim * static_cast<int64_t>(elt));
      dec.step(next, active);
    }
    const double t = secs(t0);
    if (bytes_per_s) *bytes_per_s = (static_cast<double>(weight_bytes) * steps + kv_bytes) / t;
    return static_cast<double>(batch * steps) / t;
  };
  double bw = 0;
  if (r.profiler()) const_cast<ProfilingBackend*>(r.profiler())->reset();
  const double b1 = decode(1, &bw);
  if (r.profiler())
    std::fprintf(stderr, "mt bench decode: %s %s, batch 1, time per op:\n%s", model.c_str(),
                 dtype.c_str(), r.profiler()->report().c_str());
  const double b8 = decode(8, nullptr);
  return fmt::format(
      "{{\"model\": \"{}\", \"dtype\": \"{}\", \"weight_bytes\": {}, "
      "\"prefill_512_tokens_per_sec\": {:.1f}, \"decode_batch1_tokens_per_sec\": {:.2f}, "
      "\"decode_batch1_bytes_per_sec\": {:.4g}, \"decode_batch8_tokens_per_sec\": {:.2f}}}",
      model, dtype, weight_bytes, prefill_tps, b1, bw, b8);
}

// STREAM-like triad a = b + s * c over arrays far larger than the caches, on all cores: the
// memory bandwidth that batch-1 decode is measured against (bytes counted: 3 per element x 4).
double triad_bytes_per_sec() {
  const size_t n = size_t{1} << 25;  // 128 MiB per array
  std::vector<float> a(n), b(n, 1.f), c(n, 2.f);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  auto run = [&] {
    std::vector<std::thread> ts;
    for (unsigned t = 0; t < threads; ++t)
      ts.emplace_back([&, t] {
        const size_t lo = n * t / threads, hi = n * (t + 1) / threads;
        for (size_t i = lo; i < hi; ++i) a[i] = b[i] + 3.f * c[i];
      });
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
  Args rest = args;
  rest.model.clear();
  int64_t steps = 16;
  for (auto it = rest.overrides.begin(); it != rest.overrides.end();) {
    if (it->rfind("steps=", 0) == 0) {
      steps = std::stoll(it->substr(6));
      it = rest.overrides.erase(it);
    } else {
      ++it;
    }
  }
  const double triad = triad_bytes_per_sec();
  double peak = 0;
  {
    Config cfg = resolve_config(rest);
    PluginManager pm;
    peak = pm.make_backend(cfg.get_string("backend"), cfg)->peak_flops(DType::f32);
  }
  std::string out = fmt::format(
      "{{\"bench\": \"decode\", \"memory_bandwidth_triad_bytes_per_sec\": {:.4g}, "
      "\"peak_flops_f32\": {:.4g}, \"results\": [",
      triad, peak);
  bool first = true;
  for (const auto& m : models)
    for (const char* dt : {"float32", "bfloat16"}) {
      std::fprintf(stderr, "mt bench decode: %s %s...\n", m.c_str(), dt);
      out += std::string(first ? "" : ", ") + bench_decode_one(rest, m, dt, steps);
      first = false;
    }
  std::printf("%s]}\n", out.c_str());
  return 0;
}

// ---- gemm and attention: one kernel at a time -------------------------------------------------

using Clock = std::chrono::steady_clock;

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
  return resolve_config(args);
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

}  // namespace

int cmd_bench(const Args& args) {
  const std::string what = args.positional.empty() ? "" : args.positional[0];
  if (what == "train") return bench_train(args);
  if (what == "decode") return bench_decode(args);
  if (what == "gemm") return bench_gemm(args);
  if (what == "attention") return bench_attention(args);
  throw UsageError(
      "mt bench needs what to measure: `mt bench train` (training throughput of "
      "configuration M or --model=NAME), `mt bench decode` (prefill and decode "
      "throughput), `mt bench gemm` (matmul TFLOP/s at transformer shapes) or "
      "`mt bench attention` (attention forward and backward TFLOP/s)" +
      std::string(what.empty() ? "" : "; '" + what + "' is not one of them") + ".");
}

}  // namespace mt::cli
