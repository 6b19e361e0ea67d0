#include "memory_plan.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <map>
#include <memory>
#include <set>

#include "config_impl.h"
#include "decoder.h"
#include "mesh.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/error.h"
#include "trainer.h"

namespace mt {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

bool tf32_matmuls(const Config& cfg) {
  const std::string p = cfg.has("matmul_precision") ? cfg.get_string("matmul_precision") : "";
  return p == "high" || p == "default";
}

// `base` with key=value words applied, typed as the keys' current values.
Config with_words(const Config& base, const std::vector<std::string>& words) {
  Config c = base;
  for (const auto& w : words) {
    const auto eq = w.find('=');
    const std::string key = w.substr(0, eq), value = w.substr(eq + 1);
    ConfigValue v = c.impl().at(key);
    v.s = value;
    if (v.type == ValueType::int_) std::from_chars(value.data(), value.data() + value.size(), v.i);
    if (v.type == ValueType::bool_) v.b = value == "true";
    v.origin = "command line (mt plan's suggestion)";
    c.impl().set(key, std::move(v));
  }
  return c;
}

std::unique_ptr<ModelRunner> meta_runner(const Config& cfg, PluginManager& plugins,
                                         const DeviceProfile& device, ParamSharding sharding = {},
                                         TensorSharding tensor = {}, ExpertSharding expert = {},
                                         bool int8_from_start = false) {
  auto backend = std::make_unique<MetaBackend>(device);
  auto attention = std::make_unique<MetaAttention>(cfg.get_string("attention"), *backend,
                                                   device.f32_working_copies, device.host_threads);
  return std::make_unique<ModelRunner>(cfg, plugins, std::move(backend), std::move(attention),
                                       sharding, tensor, expert, int8_from_start);
}

size_t in_use(ModelRunner& r) {
  return r.backend().memory_stats().bytes_in_use;
}

// The mesh the config sets, as the plan sees it: an axis of -1 counts 1 (the plan knows only
// the sizes set).
Mesh planned_mesh(const Config& cfg) {
  return resolve_mesh(cfg, static_cast<int>(mesh_devices_set(cfg)));
}

// One training step exactly as train() runs it (trainer.h's pieces), on a MetaBackend.
TrainingPlan trace_training(const Config& cfg, PluginManager& plugins,
                            const DeviceProfile& device) {
  const Mesh mesh = planned_mesh(cfg);
  // Rank 0 of FSDP's ranks (the fsdp axis; with a data axis too, each group of them holds a
  // copy: HSDP): its parts of every tensor (shard_range gives later ranks one element more at
  // most), and each layer's whole weights while the layer runs. Tensor rank 0 of its group:
  // its part of the split weights (equal parts). Expert rank 0: its experts (with the tensor
  // axis, 1 / (expert x tensor) of them), and the rows the MoE layers' routing sends it.
  const auto fsdp = static_cast<int>(mesh.fsdp), tensor = static_cast<int>(mesh.tensor);
  ExpertSharding experts{nullptr, 0, static_cast<int>(mesh.expert_group_ranks())};
  if (mesh.expert > 1) experts.tensor_ranks = tensor;
  auto runner = meta_runner(cfg, plugins, device,
                            fsdp > 1 ? ParamSharding{nullptr, 0, fsdp} : ParamSharding{},
                            TensorSharding{nullptr, 0, tensor}, experts);
  Backend& be = runner->backend();
  TrainingPlan t;
  t.weights = in_use(*runner);
  runner->enable_gradients();
  runner->zero_gradients();
  t.gradients = in_use(*runner) - t.weights;
  for (const auto& p : runner->params())
    t.local_elements +=
        static_cast<double>(shape_numel(p.local_shape.empty() ? p.spec.shape : p.local_shape));
  const bool offload = cfg.get_bool("optimizer_memory_host_offload");
  // Rank 0 of the mesh's data-parallel ranks: with shard_optimizer_over_data it holds the
  // largest part of the moments (shard_range gives the later ranks as much or one element more
  // only when the total does not divide; a rounding the plan leaves out).
  OptimizerState opt = make_optimizer_state(
      *runner, cfg, offload ? std::make_unique<MetaBackend>(DeviceProfile{}) : nullptr, 0,
      static_cast<int>(mesh.batch_ranks()));
  t.optimizer = in_use(*runner) - t.weights - t.gradients;
  if (opt.host) t.host_optimizer = opt.host->memory_stats().bytes_in_use;
  const int64_t batch = cfg.get_int("per_device_batch_size");
  const int64_t seq = cfg.get_int("max_target_length");
  // The step holds all its micro-batches from the start (as train() uploads them), and each
  // micro-step after the first repeats the one before it: two are traced, and the others add
  // their batches to the peak (a trace of every one took minutes and gigabytes at 10^5 steps).
  const int64_t accum = cfg.get_int("gradient_accumulation_steps");
  const int64_t traced = std::min<int64_t>(accum, 2);
  std::vector<DeviceBatch> micro;
  const size_t before = in_use(*runner);
  for (int64_t a = 0; a < traced; ++a) micro.push_back(runner->shaped_batch(batch, seq));
  const size_t one_batch = (in_use(*runner) - before) / static_cast<size_t>(traced);
  const size_t untraced = one_batch * static_cast<size_t>(accum - traced);
  t.batches = one_batch * static_cast<size_t>(accum);
  be.reset_peak_memory();
  StepGradients sg = forward_backward(*runner, micro, 0.f);
  // Tensor parallelism's sums and gathers recur in every micro-step, the untraced ones too.
  const double per_traced = static_cast<double>(accum) / static_cast<double>(traced);
  t.tensor_sum_bytes = runner->planned_tensor_sum_bytes() * per_traced;
  t.tensor_gather_bytes = runner->planned_tensor_gather_bytes() * per_traced;
  AdamWParams adam;
  adam.lr = 1e-4f;
  apply_update(*runner, opt, adam, 0.f, sg.layer_stats);
  t.peak = be.memory_stats().peak_bytes_in_use + untraced;
  t.activations = t.peak - (t.weights + t.gradients + t.optimizer + t.batches);
  if (cfg.get_bool("enable_checkpointing") && cfg.get_bool("async_checkpointing")) {
    // Rank 0's snapshot: what it holds of the weights and the moments (sharded runs save each
    // rank's parts, and rank 0, the lowest, writes every part it holds).
    size_t i = 0;
    for (const auto& p : runner->params()) {
      t.checkpoint += p.value.nbytes() + opt.m[i].nbytes() + opt.v[i].nbytes();
      ++i;
    }
  }
  if (device.is_host) t.peak += t.host_optimizer + t.checkpoint;
  return t;
}

// Loading as mt decode does (weights in the compute dtype and projections in int8 with
// quantization=int8 from the start), then caches, a prefill of the longest prompt, one decode step
// of every sequence after it, and a second step with every sequence at the longest length the cache
// holds: an int8 cache's rows are dequantized into compute-dtype temporaries of the longest
// sequence's rows (Graph::cache_values), and the second step (the one a backend records) reads
// every row, so a step's memory grows with the cached length (llama-test with
// quantize_kvcache at 256 tokens, 3 sequences: 0.83 of the measured peak when only the step
// after the prompt was traced).
DecodePlan trace_decode(const Config& cfg_in, PluginManager& plugins, const DeviceProfile& device,
                        int64_t batch) {
  const Config cfg = inference_config(cfg_in);  // as mt decode loads the weights
  auto runner =
      meta_runner(cfg, plugins, device, {}, {}, {}, cfg.get_string("quantization") == "int8");
  Backend& be = runner->backend();
  DecodePlan d;
  d.batch = batch;
  d.max_len = cfg.get_int("max_target_length");
  d.prefill = std::min(cfg.get_int("max_prefill_predict_length"), d.max_len - 1);
  runner->apply_quantization(cfg);
  d.weights = in_use(*runner);
  d.weight_dtype = runner->weight_dtype();
  // Loading (load_hf_weights, load_checkpoint_weights): every weight is allocated from the
  // start, in its final layout, and one parameter at a time passes through temporaries: on the
  // device an f32 copy of one held narrower or as int8 rows; on the host, which is the CPU's
  // memory too, at most two f32 copies of it (the values read and their rows being quantized,
  // or a checkpoint's stored bytes and their conversion), the device's copy included.
  // On the CPU, a decode of one or two sequences then stores the other projections transposed
  // (transpose_projections): two host copies of one and its new tensor beside the old.
  const size_t w_size = dtype_size(runner->weight_dtype());
  size_t transient = 0;
  for (const auto& p : runner->params()) {
    const auto n = static_cast<size_t>(shape_numel(p.spec.shape));
    const bool q8 = p.layout == WeightLayout::q8;
    d.int8_projections = d.int8_projections || q8;
    d.int8_table = d.int8_table || (q8 && p.tied_table());
    const size_t dev = q8 || w_size < 4 ? n * 4 : 0;
    const size_t transposing = p.spec.projection && !q8 ? 3 * n * w_size : 0;
    transient = std::max(
        transient, device.is_host ? std::max(8 * n, transposing) : planned_block_size(device, dev));
  }
  d.loading = d.weights + transient;
  Decoder dec(*runner, batch, d.max_len);
  d.kv_cache = in_use(*runner) - d.weights;
  be.reset_peak_memory();
  if (d.prefill > 0) {
    const std::vector<int32_t> tokens(static_cast<size_t>(batch), 0);
    const std::vector<bool> active(static_cast<size_t>(batch), true);
    dec.prefill(0, std::vector<int32_t>(static_cast<size_t>(d.prefill), 0), /*last_only=*/true);
    dec.step(tokens, active);
    if (d.max_len - 1 > d.prefill + 1) {
      dec.assume_length(d.max_len - 1);
      dec.step(tokens, active);
    }
  }
  d.peak = std::max(be.memory_stats().peak_bytes_in_use, d.weights + d.kv_cache);
  d.activations = d.peak - d.weights - d.kv_cache;
  d.peak = std::max(d.peak, d.loading);
  return d;
}

size_t planned_peak(const Config& cfg, PluginManager& plugins, const DeviceProfile& device,
                    bool train, int64_t decode_batch) {
  return train ? trace_training(cfg, plugins, device).peak
               : trace_decode(cfg, plugins, device, decode_batch).peak;
}

// Training peaks already traced in a search, by the sorted words applied.
using PeakMemo = std::map<std::string, size_t>;

size_t training_peak(const Config& cfg, const std::vector<std::string>& words,
                     PluginManager& plugins, const DeviceProfile& device, PeakMemo& memo) {
  std::vector<std::string> sorted = words;
  std::sort(sorted.begin(), sorted.end());
  const std::string key = fmt::format("{}", fmt::join(sorted, " "));
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  return memo[key] = planned_peak(with_words(cfg, words), plugins, device, true, 1);
}

// The changes a user can make, cheapest first (in the throughput or accuracy they cost), each
// only where it changes something.
std::vector<std::vector<std::string>> training_changes(const Config& cfg,
                                                       const DeviceProfile& device) {
  std::vector<std::vector<std::string>> c;
  const std::string mu = cfg.get_string("mu_dtype");
  const std::string weight = cfg.get_string("weight_dtype");
  if (mu != "bfloat16" && !(mu.empty() && weight == "bfloat16")) c.push_back({"mu_dtype=bfloat16"});
  // The LM head and loss in runs of about 1,024 positions (num_vocab_tiling): one more head
  // product a step, no change of result; only one run's logits at a time.
  const int64_t positions = cfg.get_int("per_device_batch_size") * cfg.get_int("max_target_length");
  if (cfg.get_int("num_vocab_tiling") == 1 && positions >= 2048)
    c.push_back({fmt::format("num_vocab_tiling={}", std::min<int64_t>(positions / 1024, 64))});
  const std::string remat = cfg.get_string("remat_policy");
  if (remat == "none") c.push_back({"remat_policy=minimal"});
  if (remat != "full") c.push_back({"remat_policy=full"});
  // The moments divided among the data-parallel ranks: the same traffic, the same losses.
  // (Not under expert parallelism: ZeRO-1 does not combine with it yet, and FSDP over its
  // ranks is a change of mesh the plan leaves to the user.)
  if (const Mesh mesh = planned_mesh(cfg);
      mesh.batch_ranks() > 1 && mesh.fsdp == 1 && mesh.expert == 1) {
    if (!cfg.get_bool("shard_optimizer_over_data"))
      c.insert(c.begin(), {"shard_optimizer_over_data=true"});
    // FSDP over the same ranks: the weights and gradients divided too, for two more gathers
    // of the weights a step.
    const int64_t ici = cfg.get_int("ici_data_parallelism");
    if (ici > 1 && cfg.get_int("dcn_data_parallelism") == 1)
      c.push_back({fmt::format("ici_fsdp_parallelism={}", ici), "ici_data_parallelism=1"});
  }
  if (cfg.get_string("dtype") == "float32") c.push_back({"dtype=bfloat16"});
  // Smaller micro-batches, the same global batch: the largest that fits is found later.
  if (cfg.get_int("per_device_batch_size") > 1) c.push_back({"<micro-batches>"});
  // The snapshot of asynchronous checkpoints, where it shares the device's memory.
  if (device.is_host && cfg.get_bool("enable_checkpointing") && cfg.get_bool("async_checkpointing"))
    c.insert(c.begin(), {"async_checkpointing=false"});
  // Host memory for the moments: only where the device is not the host.
  if (!device.is_host && !cfg.get_bool("optimizer_memory_host_offload"))
    c.push_back({"optimizer_memory_host_offload=true"});
  if (weight == "float32") c.push_back({"weight_dtype=bfloat16"});
  return c;
}

// Micro-batches: per_device_batch_size / 2^j with gradient_accumulation_steps x 2^j, the largest
// micro-batch whose peak fits (or the smallest, with its peak, when none does).
PlanFix micro_batch_fix(const Config& cfg, const std::vector<std::string>& others,
                        PluginManager& plugins, const DeviceProfile& device, PeakMemo& memo) {
  const int64_t batch = cfg.get_int("per_device_batch_size");
  const int64_t accum = cfg.get_int("gradient_accumulation_steps");
  PlanFix best;
  for (int64_t div = 2; div <= batch; div *= 2) {
    if (batch % div) break;
    PlanFix f;
    f.words = others;
    f.words.push_back(fmt::format("per_device_batch_size={}", batch / div));
    f.words.push_back(fmt::format("gradient_accumulation_steps={}", accum * div));
    f.peak = training_peak(cfg, f.words, plugins, device, memo);
    f.fits = f.peak <= device.bytes;
    best = f;
    if (f.fits) break;
  }
  return best;
}

void find_fixes(Plan& plan, const Config& cfg, PluginManager& plugins, const DeviceProfile& device,
                bool train, int64_t decode_batch) {
  if (device.bytes == 0) return;
  if (train) {
    const auto changes = training_changes(cfg, device);
    PeakMemo memo;
    auto evaluate = [&](std::vector<std::string> words) {
      if (!words.empty() && words.back() == "<micro-batches>") {
        words.pop_back();
        return micro_batch_fix(cfg, words, plugins, device, memo);
      }
      PlanFix f;
      f.words = words;
      f.peak = training_peak(cfg, words, plugins, device, memo);
      f.fits = f.peak <= device.bytes;
      return f;
    };
    // Changes added cheapest first until the peak fits, then each that is not needed dropped
    // again, the costliest first (a batch split goes with its accumulation steps). The last
    // evaluated when nothing fits.
    auto key_of = [](const std::string& w) { return w.substr(0, w.find('=')); };
    auto combine = [&](const std::vector<std::vector<std::string>>& list) {
      std::vector<std::string> acc;
      PlanFix last;
      for (const auto& c : list) {
        // A later change of the same key replaces the earlier one (remat minimal, then full).
        std::vector<std::string> words;
        for (const auto& w : acc)
          if (std::none_of(c.begin(), c.end(),
                           [&](const std::string& n) { return key_of(n) == key_of(w); }))
            words.push_back(w);
        words.insert(words.end(), c.begin(), c.end());
        last = evaluate(words);
        acc = last.words;
        if (!last.fits) continue;
        for (size_t i = acc.size(); i-- > 0;) {
          if (i >= acc.size()) continue;
          const std::string k = key_of(acc[i]);
          if (k == "gradient_accumulation_steps") continue;
          std::vector<std::string> fewer;
          for (const auto& w : acc)
            if (key_of(w) != k &&
                !(k == "per_device_batch_size" && key_of(w) == "gradient_accumulation_steps"))
              fewer.push_back(w);
          PlanFix f;
          f.words = fewer;
          f.peak = training_peak(cfg, fewer, plugins, device, memo);
          f.fits = f.peak <= device.bytes;
          if (f.fits) {
            acc = fewer;
            last = f;
          }
        }
        return last;
      }
      return last;
    };
    // Each change alone; then, if none is enough, a combination.
    for (const auto& c : changes) {
      PlanFix f = evaluate(c);
      if (f.fits) plan.fixes.push_back(f);
    }
    if (!plan.fixes.empty()) {
      if (plan.fixes.size() > 4) plan.fixes.resize(4);
      // Where the only changes that fit alone keep the moments in host memory (each step then
      // waits for the host's update: on an H100, llama2-7b trained at 140 tokens/s against
      // 7,858 with bf16 weights and full remat, 2026-11-26), also the cheapest combination that
      // keeps them on the device.
      const std::string offload = "optimizer_memory_host_offload";
      const auto has_offload = [&](const PlanFix& f) {
        return std::any_of(f.words.begin(), f.words.end(),
                           [&](const std::string& w) { return key_of(w) == offload; });
      };
      if (std::all_of(plan.fixes.begin(), plan.fixes.end(), has_offload)) {
        std::vector<std::vector<std::string>> on_device;
        for (const auto& c : changes)
          if (std::none_of(c.begin(), c.end(),
                           [&](const std::string& w) { return key_of(w) == offload; }))
            on_device.push_back(c);
        const PlanFix f = combine(on_device);
        if (f.fits) plan.fixes.push_back(f);
      }
      return;
    }
    const PlanFix last = combine(changes);
    if (last.fits) {
      plan.fixes.push_back(last);
      return;
    }
    const TrainingPlan& t = *plan.train;
    plan.beyond_fixes =
        fmt::format("Even with {} the peak is {} of the device's {}.",
                    last.words.empty() ? std::string("every change")
                                       : fmt::format("{}", fmt::join(last.words, " ")),
                    human_bytes(static_cast<double>(last.peak)),
                    human_bytes(static_cast<double>(device.bytes)));
    plan.beyond_fixes += fmt::format(
        " As configured, the weights, gradients and optimizer state alone take {}; what stays "
        "on the device with every change above is still more than it has: the model needs more "
        "memory than one device has: a smaller model, or FSDP over several devices "
        "(mpirun -np N mt run ... ici_fsdp_parallelism=N divides the weights, gradients and "
        "moments by N).",
        human_bytes(static_cast<double>(t.weights + t.gradients + t.optimizer)));
    return;
  }
  // Decode: bf16 weights and caches, then a shorter context.
  std::vector<std::vector<std::string>> changes;
  if (cfg.get_string("dtype") == "float32") changes.push_back({"dtype=bfloat16"});
  for (int64_t len = cfg.get_int("max_target_length") / 2;
       len >= std::max<int64_t>(cfg.get_int("max_prefill_predict_length") + 1, 128); len /= 2)
    changes.push_back({fmt::format("max_target_length={}", len)});
  for (const auto& c : changes) {
    PlanFix f;
    f.words = c;
    f.peak = planned_peak(with_words(cfg, c), plugins, device, false, decode_batch);
    f.fits = f.peak <= device.bytes;
    if (f.fits) {
      plan.fixes.push_back(f);
      break;
    }
  }
  if (plan.fixes.empty())
    plan.beyond_fixes = fmt::format(
        "The weights alone take {} in {}: the model needs more memory than one device has.",
        human_bytes(static_cast<double>(plan.decode->weights)), dtype_name(plan.compute));
}

}  // namespace

std::string human_bytes(double b) {
  if (b < 1024) return fmt::format("{:.0f} B", b);
  if (b < 1024.0 * 1024) return fmt::format("{:.1f} KiB", b / 1024);
  if (b < kGiB) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  return fmt::format("{:.2f} GiB", b / kGiB);
}

DeviceProfile plan_target(const Config& cfg, const Backend* real, bool use_plan_device) {
  const std::string name = use_plan_device ? cfg.get_string("plan_device") : std::string();
  if (!name.empty()) {
    std::optional<DeviceProfile> p = named_device(name, tf32_matmuls(cfg));
    if (!p)
      cfg.reject("plan_device", "is not a device mt knows. Known: " + named_devices() +
                                    " (e.g. cpu-24gb for a host with 24 GiB).");
    if (name.rfind("cpu-", 0) == 0) {
      p->f32_working_copies = p->is_host = true;
      p->host_threads = cpu_threads(cfg);
    }
    if (p->peak_bf16 == 0 && real && real->name() == "cpu") {
      p->peak_bf16 = real->peak_flops(DType::bf16);
      p->peak_f32 = real->peak_flops(DType::f32);
    }
    return *p;
  }
  DeviceProfile p;
  if (!real) return p;
  p.name = real->describe();
  p.bytes = real->memory_stats().bytes_limit;
  p.peak_bf16 = real->peak_flops(DType::bf16);
  p.peak_f32 = real->peak_flops(DType::f32);
  p.f32_working_copies = p.is_host = real->name() == "cpu";
  if (p.is_host) p.host_threads = cpu_threads(cfg);
  if (real->name() == "cuda") {
    p.small_granule = 512;
    p.small_limit = size_t{1} << 20;
  }
  return p;
}

Plan make_plan(const Config& cfg, PluginManager& plugins, const DeviceProfile& device, PlanFor what,
               bool with_fixes, int64_t decode_batch) {
  Plan plan;
  plan.device = device;
  plan.assumed_mfu = cfg.get_float("plan_assumed_mfu");
  if (plan.assumed_mfu <= 0)
    cfg.reject("plan_assumed_mfu",
               "must be above 0: the plan divides the step's FLOPs by the peak times this share "
               "(the default is 0.4).");
  ModelDims dims;
  double top = 0, all = 0;     // the parameters outside the layers (embedding, head), and all
  double expert_elements = 0;  // of blocks::moe's expert weights (the expert axis divides them)
  std::set<std::string> moe_layers;
  {
    auto runner = meta_runner(cfg, plugins, device);
    dims = runner->model().dims();
    for (const auto& p : runner->params()) {
      all += static_cast<double>(shape_numel(p.spec.shape));
      if (!p.spec.axes.empty() && p.spec.axes[0] == "experts") {
        expert_elements += static_cast<double>(shape_numel(p.spec.shape));
        moe_layers.insert(p.name.substr(0, p.name.rfind('.')));
      }
      if (p.name.rfind("layers.", 0) != 0 && p.name.rfind("mtp.", 0) != 0)
        top += static_cast<double>(shape_numel(p.spec.shape));
    }
    plan.counts = count_parameters(runner->model());
    plan.compute = runner->compute_dtype();
    plan.weights = runner->weight_dtype();
    plan.flops_per_token = runner->model().flops_per_token(cfg.get_int("max_target_length"));
  }
  plan.tokens_per_step = cfg.get_int("per_device_batch_size") * cfg.get_int("max_target_length") *
                         cfg.get_int("gradient_accumulation_steps");
  // The MoE block sorts a micro-batch's routed slots (tokens x experts per token) with 32-bit
  // indices (before: the trace stopped on that check, "internal error", exit 1).
  if (!moe_layers.empty() && what != PlanFor::decode) {
    const double slots = static_cast<double>(cfg.get_int("per_device_batch_size")) *
                         static_cast<double>(cfg.get_int("max_target_length")) *
                         static_cast<double>(cfg.get_int("num_experts_per_tok"));
    if (slots >= 2147483647.0)
      throw UsageError(fmt::format(
          "per_device_batch_size={} x max_target_length={} x num_experts_per_tok={} makes {:.4g} "
          "routed slots in a micro-batch, and the mixture-of-experts layers sort them with 32-bit "
          "indices (fewer than 2^31). Lower per_device_batch_size (gradient_accumulation_steps "
          "keeps the tokens of a step).",
          cfg.get_int("per_device_batch_size"), cfg.get_int("max_target_length"),
          cfg.get_int("num_experts_per_tok"), slots));
  }
  if (what != PlanFor::decode) plan.train = trace_training(cfg, plugins, device);
  // The mesh's data-parallel ranks (an axis of -1, the rest of the ranks, counts 1 here: the
  // plan knows only the sizes set); the trainer's own checks refuse what it cannot run.
  if (plan.train) {
    const Mesh mesh = planned_mesh(cfg);
    if (mesh.batch_ranks() > 1 || mesh.tensor > 1) {
      CollectivePlan c;
      c.ici = std::max<int64_t>(1, cfg.get_int("ici_data_parallelism")) *
              std::max<int64_t>(1, cfg.get_int("ici_fsdp_parallelism")) *
              std::max<int64_t>(1, cfg.get_int("ici_expert_parallelism"));
      c.dcn = mesh.batch_ranks() / c.ici;
      // A tensor rank's gradients are its parts (FSDP divides those again).
      // Expert parallelism: a rank holds 1/X of the experts (FSDP gathers those and the rest;
      // data parallelism all-reduces the rest over every rank, the experts apart).
      // With the tensor axis too, the experts are divided among the expert x tensor ranks.
      c.expert = mesh.expert;
      c.fsdp = mesh.fsdp > 1;
      const int64_t expert_group = mesh.expert_group_ranks();
      const double expert_local =
          c.expert > 1 ? expert_elements / static_cast<double>(expert_group) : 0.0;
      const double dense_elements =
          static_cast<double>(plan.counts.total) - (c.expert > 1 ? expert_elements : 0.0);
      // What a tensor rank holds of the rest (the tensor parts and the replicated tensors).
      const double dense_local =
          mesh.tensor > 1 ? plan.train->local_elements - expert_local : dense_elements;
      c.gradient_bytes = static_cast<size_t>(dense_local + (c.fsdp ? expert_local : 0.0)) * 4;
      const double held = all - expert_elements + expert_local;
      const double top_share = held > 0 ? top / held : 0;
      c.fsdp_ranks = mesh.fsdp;
      c.copies = c.fsdp ? mesh.data * mesh.expert : 1;  // (the experts: mesh.data)
      c.sharded_optimizer = !c.fsdp && cfg.get_bool("shard_optimizer_over_data");
      c.gathers = cfg.get_string("remat_policy") == "none" ? 1 : 2;
      c.micro_batches = cfg.get_int("gradient_accumulation_steps");
      // A ring's all-reduce moves 2 (n - 1) / n of the buffer through each rank's link in each
      // direction; an all-gather or a reduce-scatter half of that.
      // FSDP: per micro-batch, the layers' weights gathered `gathers` times and the top ones
      // (outside remat) once, and every gradient reduce-scattered once.
      const double rounds =
          c.fsdp ? static_cast<double>(c.micro_batches) *
                       (static_cast<double>(c.gathers + 1) - (c.gathers - 1) * top_share)
                 : 2.0;
      const auto g = static_cast<double>(c.gradient_bytes);
      auto ring = [](double r, int64_t n) {
        return r * static_cast<double>(n - 1) / static_cast<double>(n);
      };
      if (c.fsdp && (mesh.data > 1 || c.expert > 1)) {
        // HSDP: the gathers and reduce-scatters among the fsdp ranks (within the node when
        // ici_fsdp_parallelism holds them all), then each part's gradient all-reduced over the
        // data axis's copies (and the expert axis's, but for the experts).
        const bool fsdp_in_node = cfg.get_int("dcn_fsdp_parallelism") == 1;
        const double fsdp_bytes = ring(rounds, mesh.fsdp) * g;
        const double copies =
            (ring(2.0, mesh.data * c.expert) * dense_local + ring(2.0, mesh.data) * expert_local) *
            4.0 / static_cast<double>(mesh.fsdp);
        const bool data_in_node = cfg.get_int("dcn_data_parallelism") == 1;
        c.ici_bytes = (fsdp_in_node ? fsdp_bytes : 0) + (data_in_node ? copies : 0);
        c.dcn_bytes = (fsdp_in_node ? 0 : fsdp_bytes) + (data_in_node ? 0 : copies);
      } else if (c.dcn > 1 && cfg.get_string("communicator") != "nccl") {
        // One communicator over every rank (the data axis, or FSDP's alone): the mpi
        // communicator's reduce-scatter and all-gather exchange each rank's slice with every
        // other rank directly, so of each phase's (N - 1) / N of the buffer, (ici - 1) / N comes
        // from this node's ranks and (N - ici) / N from the other nodes'.
        const auto n = static_cast<double>(c.ici * c.dcn), ici = static_cast<double>(c.ici);
        c.ici_bytes = rounds * (ici - 1) / n * g;
        c.dcn_bytes = rounds * (n - ici) / n * g;
      } else {
        c.ici_bytes = ring(rounds, c.ici) * g;
        c.dcn_bytes = ring(rounds, c.dcn) * g / static_cast<double>(c.ici);
      }
      if (c.expert > 1) {
        // Each rank's experts' gradients over the data axis's ranks holding the same experts.
        c.moe_layers = static_cast<int64_t>(moe_layers.size());
        c.expert_gradient_bytes = static_cast<size_t>(expert_local) * 4;
        // (FSDP: counted with the copies above.)
        const double sums =
            c.fsdp ? 0.0 : ring(2.0, mesh.data) * static_cast<double>(c.expert_gradient_bytes);
        (cfg.get_int("dcn_data_parallelism") == 1 ? c.ici_bytes : c.dcn_bytes) += sums;
        // Per MoE layer and micro-batch, n tokens of d values, k copies each, spread evenly
        // over the G ranks of the group (X, or X T with the tensor axis, each tensor rank
        // sending n / T of its batch's tokens): each all-to-all brings n k (G - 1) / G rows of
        // d from the other ranks; the forward sums the G x 2E table of counts (f64, a ring's
        // 2 (G - 1) / G of it) and makes two all-to-alls, the backward two. (The tensor
        // group's sums of the shares are in the trace's tensor traffic.)
        const auto n = static_cast<double>(cfg.get_int("per_device_batch_size") *
                                           cfg.get_int("max_target_length")) /
                       static_cast<double>(expert_group / c.expert);
        const auto d = static_cast<double>(dims.d_model);
        const auto k = static_cast<double>(cfg.get_int("num_experts_per_tok"));
        const auto E = static_cast<double>(cfg.get_int("num_experts"));
        const auto X = static_cast<double>(expert_group);
        const double rows = 4.0 * d * n * k * (X - 1) / X;
        const double counts = 8.0 * 2.0 * (X - 1) * 2.0 * E;
        c.expert_bytes = static_cast<double>(c.moe_layers * c.micro_batches) *
                         (static_cast<double>(c.gathers) * (counts + 2 * rows) + 2 * rows);
      }
      // Tensor parallelism: the sums and all-gathers the trace made (TrainingPlan), each
      // activation [B, T, d] in f32.
      c.tensor = mesh.tensor;
      if (c.tensor > 1) {
        // Each block's split projections summed forward (again when remat re-runs it) and
        // their input's gradient backward; with vocab:tensor also the embedding's lookup, the
        // LM head's input gradient and the loss's all-gather (the only all-gather).
        c.vocab = plan.train->tensor_gather_bytes > 0;
        c.tensor_sum_bytes =
            static_cast<size_t>(cfg.get_int("per_device_batch_size") *
                                cfg.get_int("max_target_length") * dims.d_model * 4);
        c.tensor_sums =
            c.tensor_sum_bytes
                ? static_cast<int64_t>(std::llround(plan.train->tensor_sum_bytes /
                                                    static_cast<double>(c.tensor_sum_bytes)))
                : 0;
        const auto t = static_cast<double>(c.tensor);
        c.tensor_bytes = 2.0 * (t - 1) / t * plan.train->tensor_sum_bytes +
                         (t - 1) * plan.train->tensor_gather_bytes;
      }
      plan.collectives = c;
    }
  }
  if (what != PlanFor::train) plan.decode = trace_decode(cfg, plugins, device, decode_batch);
  if (with_fixes && plan.train)
    for (const char* policy : {"none", "minimal", "full"})
      plan.activations_by_remat.emplace_back(
          policy,
          trace_training(with_words(cfg, {std::string("remat_policy=") + policy}), plugins, device)
              .activations);
  const bool train = what != PlanFor::decode;
  const size_t peak = train ? plan.train->peak : plan.decode->peak;
  if (with_fixes && device.bytes && peak > device.bytes)
    find_fixes(plan, cfg, plugins, device, train, decode_batch);
  return plan;
}

std::string format_plan(const Plan& p, const Config& cfg) {
  std::string s;
  const double cap = static_cast<double>(p.device.bytes);
  auto row = [&](const char* what, size_t bytes, const std::string& note) {
    s += fmt::format("  {:<13}{:>12}  {}\n", what, human_bytes(static_cast<double>(bytes)), note);
  };
  s += fmt::format("device: {}{}\n", p.device.name,
                   p.device.bytes ? fmt::format(", {} of memory", human_bytes(cap))
                                  : std::string(", memory unknown"));
  s += fmt::format("parameters: {} total, {} in matmuls, {} active per token{}\n",
                   human_count(static_cast<double>(p.counts.total)),
                   human_count(static_cast<double>(p.counts.matmul)),
                   human_count(p.counts.active_matmul),
                   p.counts.mtp ? fmt::format(" (the total includes {} of multi-token prediction "
                                              "modules, trained only)",
                                              human_count(static_cast<double>(p.counts.mtp)))
                                : std::string());
  auto verdict = [&](size_t peak) {
    if (!p.device.bytes) return std::string();
    if (peak <= p.device.bytes)
      return fmt::format("fits: {:.0f}% of the device", 100.0 * static_cast<double>(peak) / cap);
    return fmt::format("DOES NOT FIT: {} over", human_bytes(static_cast<double>(peak) - cap));
  };
  if (p.train) {
    const TrainingPlan& t = *p.train;
    const std::string mu = cfg.get_string("mu_dtype");
    s += fmt::format(
        "training, per device (per_device_batch_size={} x max_target_length={}, "
        "gradient_accumulation_steps={}, remat_policy={}, dtype={}):\n",
        cfg.get_int("per_device_batch_size"), cfg.get_int("max_target_length"),
        cfg.get_int("gradient_accumulation_steps"), cfg.get_string("remat_policy"),
        cfg.get_string("dtype"));
    const bool fsdp = p.collectives && p.collectives->fsdp;
    const bool tensor = p.collectives && p.collectives->tensor > 1;
    const std::string part =
        fsdp && tensor
            ? fmt::format(", this rank's part (tensor parallelism over {}, then 1/{} by FSDP)",
                          p.collectives->tensor, p.collectives->fsdp_ranks)
        : fsdp ? fmt::format(", this rank's 1/{} (FSDP)", p.collectives->fsdp_ranks)
        : tensor
            ? fmt::format(", this rank's part (tensor parallelism over {})", p.collectives->tensor)
            : std::string();
    row("weights", t.weights, fmt::format("weight_dtype={}{}", dtype_name(p.weights), part));
    row("gradients", t.gradients, "float32" + part);
    if (t.host_optimizer)
      row("optimizer", t.optimizer,
          fmt::format("AdamW: mu {}, nu float32, in host memory ({} there; "
                      "optimizer_memory_host_offload)",
                      mu.empty() ? dtype_name(p.weights) : mu,
                      human_bytes(static_cast<double>(t.host_optimizer))));
    else
      row("optimizer", t.optimizer,
          fmt::format("AdamW: mu {}, nu float32{}", mu.empty() ? dtype_name(p.weights) : mu,
                      p.collectives && p.collectives->sharded_optimizer
                          ? fmt::format(", this rank's 1/{} of them (shard_optimizer_over_data)",
                                        p.collectives->ici * p.collectives->dcn)
                          : part));
    row("batches", t.batches, "token ids of the step's micro-batches");
    row("activations", t.activations,
        fsdp ? "peak above those: saved for the backward, their gradients, temporaries, the "
               "gathered whole weights of the layers in use and their gradients"
             : "peak above those: saved for the backward, their gradients, temporaries");
    if (t.checkpoint)
      row("checkpoint", t.checkpoint,
          p.device.is_host ? "host copy of weights and moments that async_checkpointing keeps"
                           : "in host memory: async_checkpointing's copy of weights and moments");
    row("peak", t.peak, verdict(t.peak));
    if (!p.activations_by_remat.empty()) {
      s += "  activations by remat_policy:";
      for (const auto& [policy, bytes] : p.activations_by_remat)
        s += fmt::format(" {} {}{}", policy, human_bytes(static_cast<double>(bytes)),
                         &policy == &p.activations_by_remat.back().first ? "" : ",");
      s += "\n";
    }
    const double flops = p.flops_per_token * static_cast<double>(p.tokens_per_step);
    const double peak_flops = p.compute == DType::bf16 ? p.device.peak_bf16 : p.device.peak_f32;
    // Tensor ranks share one batch, each doing 1/T of its FLOPs (the other axes give each rank a
    // batch of its own).
    const int64_t group = p.collectives ? std::max<int64_t>(1, p.collectives->tensor) : 1;
    const double device_flops = flops / static_cast<double>(group);
    s += fmt::format("  model FLOPs per step: {:.4g} ({} tokens x {:.4g} per token){}\n", flops,
                     p.tokens_per_step, p.flops_per_token,
                     group > 1 ? fmt::format(", {:.4g} on each of the {} tensor ranks sharing "
                                             "the batch",
                                             device_flops, group)
                               : std::string());
    if (peak_flops > 0)
      s += fmt::format(
          "  step time: {:.3g} s at the device's peak {:.3g} TFLOP/s ({}); {:.3g} s at an assumed "
          "MFU of {:.0f}% (plan_assumed_mfu): {:.4g} tokens/s{}\n",
          device_flops / peak_flops, peak_flops / 1e12, dtype_name(p.compute),
          device_flops / (peak_flops * p.assumed_mfu), 100 * p.assumed_mfu,
          static_cast<double>(p.tokens_per_step) * peak_flops * p.assumed_mfu / device_flops,
          group > 1 ? fmt::format(" for a group of {} tensor ranks", group) : std::string());
    else
      s += "  step time: unknown (the device's peak FLOP/s is not known; set plan_device)\n";
    if (p.collectives) {
      const CollectivePlan& c = *p.collectives;
      auto link = [](double bytes, double bw, const char* where) {
        if (bytes == 0) return fmt::format("none {}", where);
        return fmt::format("{} {}{}", human_bytes(bytes), where,
                           bw > 0 ? fmt::format(" ({:.0f} GB/s: {:.3g} s)", bw / 1e9, bytes / bw)
                                  : std::string(" (bandwidth not known)"));
      };
      const double t = (p.device.ici_bytes_per_s > 0 ? c.ici_bytes / p.device.ici_bytes_per_s : 0) +
                       (p.device.dcn_bytes_per_s > 0 ? c.dcn_bytes / p.device.dcn_bytes_per_s : 0);
      if (c.expert > 1)
        s += fmt::format(
            "  collectives: expert parallelism over {} ranks{}, each holding 1/{} of the experts "
            "of {} MoE layers: every step sends each token copy to its expert's rank and the "
            "output back (per layer and micro-batch, a sum of the expert counts and 2 "
            "all-to-alls in the forward{} and 2 in the backward); with routing spread evenly, "
            "each rank receives {}; the experts' {} of "
            "gradients (a rank's) {}, the other parameters' over every rank (below)\n",
            c.expert,
            c.tensor > 1 ? fmt::format(" and the {} tensor ranks of each (each sending a share of "
                                       "its batch)",
                                       c.tensor)
                         : std::string(),
            c.expert * c.tensor, c.moe_layers, c.gathers == 1 ? "" : ", again in remat's re-run",
            link(c.expert_bytes,
                 cfg.get_int("dcn_expert_parallelism") == 1 ? p.device.ici_bytes_per_s
                                                            : p.device.dcn_bytes_per_s,
                 cfg.get_int("dcn_expert_parallelism") == 1 ? "within the node" : "across nodes"),
            human_bytes(static_cast<double>(c.expert_gradient_bytes)),
            c.ici * c.dcn == c.expert * c.fsdp_ranks
                ? std::string("need no sum (one data-parallel copy)")
                : fmt::format("are summed over the data axis's {} ranks",
                              c.ici * c.dcn / (c.expert * c.fsdp_ranks)));
      if (c.tensor > 1)
        s += fmt::format(
            "  collectives: tensor parallelism over {} ranks per batch (logical_axis_rules), "
            "each holding 1/{} of the split weights: every step sums {} activations of {} over "
            "the group (each split block's output in the forward{}, and its input's gradient "
            "in the backward{}); a ring moves, per rank and direction, {}\n",
            c.tensor, c.tensor, c.tensor_sums, human_bytes(static_cast<double>(c.tensor_sum_bytes)),
            c.gathers == 1 ? "" : " and again when remat re-runs it",
            c.vocab ? "; the split vocabulary's lookup and LM head too, and the loss all-gathers "
                      "8 bytes a token"
                    : "",
            cfg.get_int("dcn_tensor_parallelism") > 1
                ? link(c.tensor_bytes, p.device.dcn_bytes_per_s, "across nodes")
                : link(c.tensor_bytes, p.device.ici_bytes_per_s, "within the node"));
      if (c.ici * c.dcn > 1) {
        const std::string what =
            c.fsdp
                ? fmt::format(
                      "all-gathers {} of float32 weights {} and reduce-scatters their "
                      "gradients once per micro-batch ({} of them){}",
                      human_bytes(static_cast<double>(c.gradient_bytes)),
                      c.gathers == 1 ? "once" : "twice (remat re-runs the layers)", c.micro_batches,
                      c.copies > 1 ? ", then all-reduces each rank's part of them over the copies"
                                   : "")
            : c.sharded_optimizer
                ? fmt::format(
                      "reduce-scatters {} of float32 gradients and all-gathers the "
                      "updated parameters (as float32: the bytes of an all-reduce)",
                      human_bytes(static_cast<double>(c.gradient_bytes)))
                : fmt::format("all-reduces {} of float32 gradients",
                              human_bytes(static_cast<double>(c.gradient_bytes)));
        s += fmt::format(
            "  collectives: {} over {} ranks ({} per node x {} node{}), {}: every "
            "step {}; a ring moves, per rank and direction, {} and {}{}\n",
            c.fsdp ? "FSDP" : "data parallelism", c.ici * c.dcn, c.ici, c.dcn,
            c.dcn == 1 ? "" : "s",
            c.fsdp ? (c.copies > 1 ? fmt::format("each holding 1/{} of the weights, gradients "
                                                 "and moments, in {} copies (HSDP)",
                                                 c.fsdp_ranks, c.copies)
                                   : std::string("each holding 1/N of the weights, gradients "
                                                 "and moments"))
            : c.sharded_optimizer ? "each holding the whole weights and 1/N of the moments"
            : c.expert > 1        ? "each holding the parameters outside the experts whole"
            : c.tensor > 1        ? "each holding its tensor rank's part of the model"
                                  : "each holding the whole model",
            what, link(c.ici_bytes, p.device.ici_bytes_per_s, "within the node"),
            link(c.dcn_bytes, p.device.dcn_bytes_per_s, "across nodes"),
            t > 0 ? fmt::format("; about {:.3g} s a step, beyond the compute where nothing "
                                "overlaps it (data parallelism on the CPU sums each layer "
                                "during the backward)",
                                t)
                  : std::string());
      }
    }
  }
  if (p.decode) {
    const DecodePlan& d = *p.decode;
    s += fmt::format("decode ({} sequence{} of up to {} tokens, prefill of {}, dtype={}):\n",
                     d.batch, d.batch == 1 ? "" : "s", d.max_len, d.prefill,
                     cfg.get_string("dtype"));
    row("weights", d.weights,
        d.int8_projections
            ? fmt::format("projections{} in int8 (quantization=int8), the rest in {}",
                          d.int8_table ? " and the tied embedding" : "", dtype_name(d.weight_dtype))
            : fmt::format("stored in {}", dtype_name(d.weight_dtype)));
    row("KV cache", d.kv_cache,
        fmt::format("{} per token of capacity, as allocated (the allocator's size classes "
                    "included)",
                    human_bytes(static_cast<double>(d.kv_cache) /
                                static_cast<double>(std::max<int64_t>(1, d.batch * d.max_len)))));
    row("activations", d.activations, "peak of the prefill and a decode step above those");
    row("loading", d.loading,
        std::string("the weights and one parameter's temporaries while they load") +
            (p.device.is_host ? " and are laid out for decode (host copies included)" : "") +
            (d.loading > d.weights + d.kv_cache + d.activations ? ": the peak" : ""));
    row("peak", d.peak, verdict(d.peak));
  }
  if (!p.fixes.empty()) {
    s += p.fixes.size() == 1 && p.fixes[0].words.size() > 1
             ? "to fit, add these words to the command:\n"
             : "to fit, add any one of these to the command (cheapest first):\n";
    for (const auto& f : p.fixes)
      s += fmt::format("  {:<60} peak {}\n", fmt::format("{}", fmt::join(f.words, " ")),
                       human_bytes(static_cast<double>(f.peak)));
  }
  if (!p.beyond_fixes.empty()) s += p.beyond_fixes + "\n";
  return s;
}

namespace {
// A positive integer at the start of `s` (moved past it), else 0.
int64_t leading_count(const char*& s) {
  char* end = nullptr;
  const long long n = std::strtoll(s, &end, 10);
  if (end == s || n <= 0) return 0;
  s = end;
  return n;
}

// The job's ranks on this host, as the launcher says: OpenMPI's mpirun (the launcher mt
// documents), MPICH's Hydra, then Slurm's srun (SLURM_STEP_TASKS_PER_NODE, as "8(x2),7": the
// SLURM_NODEID-th node's count); 1 without any.
int64_t ranks_on_this_host() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"}) {
    const char* v = std::getenv(var);
    if (!v || !*v) continue;
    if (const int64_t n = leading_count(v); n > 0 && *v == '\0') return n;
  }
  const char* tasks = std::getenv("SLURM_STEP_TASKS_PER_NODE");
  const char* node = std::getenv("SLURM_NODEID");
  if (!tasks || !node) return 1;
  char* end = nullptr;
  int64_t left = std::strtoll(node, &end, 10);  // the nodes before this one
  if (end == node || *end != '\0' || left < 0) return 1;
  for (const char* p = tasks; *p;) {
    const int64_t n = leading_count(p);
    if (n == 0) return 1;
    int64_t times = 1;
    if (p[0] == '(' && p[1] == 'x') {
      p += 2;
      times = leading_count(p);
      if (times == 0 || *p != ')') return 1;
      ++p;
    }
    if (left < times) return n;
    left -= times;
    if (*p == ',') ++p;
  }
  return 1;
}
}  // namespace

void check_fits(const Config& cfg_in, PluginManager& plugins, Backend& device, PlanFor what,
                const char* command, int ranks, int64_t decode_batch) {
  DeviceProfile target = plan_target(cfg_in, &device, /*use_plan_device=*/false);
  if (target.bytes == 0) return;  // a backend that cannot tell
  // The CPU backend's device is the host's memory, which the job's ranks on this host share:
  // each may plan on its part only (before: each was checked against all of it, so two ranks
  // planned at 60% each passed and then needed 120%).
  std::string held = "a device that holds " + human_bytes(static_cast<double>(target.bytes));
  if (const int64_t local = ranks > 1 && target.is_host ? ranks_on_this_host() : 1; local > 1) {
    held = fmt::format("a host of {} shared by {} ranks of this job, {} each",
                       human_bytes(static_cast<double>(target.bytes)), local,
                       human_bytes(static_cast<double>(target.bytes / local)));
    target.bytes /= static_cast<size_t>(local);
  }
  // The data axis of -1 made explicit: the job's ranks it takes (only one axis may be -1).
  Config cfg = cfg_in;
  const int64_t ici = cfg_in.get_int("ici_data_parallelism");
  const int64_t dcn = cfg_in.get_int("dcn_data_parallelism");
  if (ranks > 1 && (ici == -1 || dcn == -1)) {
    const int64_t data = resolve_mesh(cfg_in, ranks).data;
    const int64_t i = ici == -1 ? data / dcn : ici;
    cfg = with_words(cfg_in, {fmt::format("ici_data_parallelism={}", i),
                              fmt::format("dcn_data_parallelism={}", data / i)});
  }
  const Plan quick = make_plan(cfg, plugins, target, what, /*with_fixes=*/false, decode_batch);
  if (quick.fits()) return;
  const Plan plan = make_plan(cfg, plugins, target, what, /*with_fixes=*/true, decode_batch);
  // Several prompts are decoded at once, each with its cache: fewer at a time need less.
  const std::string batch =
      decode_batch > 1
          ? fmt::format(
                " It decodes its {} prompts at once, each with a KV cache of "
                "max_target_length: fewer prompts a run (a prompt_file split) need less.",
                decode_batch)
          : std::string();
  throw UsageError(fmt::format(
      "The run does not fit: mt {} would need {} on {}, and would fail part-way. Nothing was "
      "allocated.{} The plan (what `mt plan` prints for this config):\n{}",
      command, human_bytes(static_cast<double>(plan.peak())), held, batch, format_plan(plan, cfg)));
}

void check_weights_fit(const Config& cfg, PluginManager& plugins, Backend& device,
                       const char* command) {
  const DeviceProfile target = plan_target(cfg, &device, /*use_plan_device=*/false);
  if (target.bytes == 0) return;  // a backend that cannot tell
  const Plan quick = make_plan(cfg, plugins, target, PlanFor::decode, /*with_fixes=*/false);
  if (quick.decode->loading <= target.bytes) return;
  const Plan plan = make_plan(cfg, plugins, target, PlanFor::decode, /*with_fixes=*/true);
  throw UsageError(fmt::format(
      "The model does not fit: mt {} would need {} to load its weights ({} held, the rest one "
      "parameter's temporaries while loading) on a device that holds {}, and would fail "
      "part-way. Nothing was allocated. mt decode's plan for this config (its weights and "
      "loading rows are what mt {} needs to hold the weights):\n{}",
      command, human_bytes(static_cast<double>(plan.decode->loading)),
      human_bytes(static_cast<double>(plan.decode->weights)),
      human_bytes(static_cast<double>(target.bytes)), command, format_plan(plan, cfg)));
}

}  // namespace mt
