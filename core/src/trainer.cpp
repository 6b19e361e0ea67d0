#include "trainer.h"

#include <fmt/format.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <system_error>
#include <tuple>
#include <utility>
#include <vector>

#include "checkpoint_manager.h"
#include "collective_queue.h"
#include "communicator.h"
#include "config_impl.h"
#include "file_util.h"
#include "fnv1a.h"
#include "hf_interop.h"
#include "json.h"
#include "memory_plan.h"
#include "mesh.h"
#include "model_info.h"
#include "model_runner.h"
#include "mt/data.h"
#include "mt/error.h"
#include "mt/graph.h"
#include "mt/tokenizer.h"
#include "plugin_manager.h"
#include "progress.h"
#include "run_lock.h"
#include "stop_signals.h"
#include "tensorboard.h"
#include "tokenizer_factory.h"

namespace fs = std::filesystem;

namespace mt {

LrSchedule LrSchedule::from_config(const Config& cfg, int64_t steps) {
  LrSchedule s;
  s.peak = cfg.get_float("learning_rate");
  s.final_fraction = cfg.get_float("learning_rate_final_fraction");
  s.schedule_steps = cfg.get_int("learning_rate_schedule_steps");
  if (s.schedule_steps < 0) s.schedule_steps = steps;
  // Python's int() of the same double product: truncation.
  const auto part = [&](const char* key) {
    return static_cast<int64_t>(cfg.get_float(key) * static_cast<double>(s.schedule_steps));
  };
  s.warmup = part("warmup_steps_fraction");
  s.wsd = cfg.get_string("lr_schedule_type") == "wsd";
  s.wsd_cosine = cfg.get_string("wsd_decay_style") == "cosine";
  if (s.wsd) {
    s.decay = part("wsd_decay_steps_fraction");
    if (cfg.get_float("warmup_steps_fraction") + cfg.get_float("wsd_decay_steps_fraction") > 1.0)
      cfg.reject("wsd_decay_steps_fraction",
                 fmt::format("plus warmup_steps_fraction ({}) is more than the whole schedule: "
                             "lr_schedule_type=wsd warms up, holds the peak, then decays, within "
                             "learning_rate_schedule_steps. Make the two fractions sum to 1 or "
                             "less.",
                             cfg.get_float("warmup_steps_fraction")));
  }
  return s;
}

double LrSchedule::at(int64_t step) const {
  const int64_t n = step - 1;  // updates before this one: optax's count
  const double final_lr = peak * final_fraction;
  if (n >= schedule_steps) return 0.0;
  // optax.linear_schedule(0, peak, transition_steps=warmup), as MaxText since 31015aaf5
  // (2026-02-05; before it, for four weeks, warmup - 1 transitions, which mt had followed).
  if (n < warmup) return peak * static_cast<double>(n) / static_cast<double>(warmup);
  // Cosine from peak at i = 0 to final_lr at i = len - 1 (final_lr throughout when len is 1).
  const auto cosine = [&](int64_t i, int64_t len) {
    const double pct = len > 1 ? static_cast<double>(i) / (len - 1.0) : 1.0;
    const double a = 0.5 * (std::cos(M_PI * pct) + 1.0);
    return peak * a + final_lr * (1.0 - a);
  };
  if (!wsd) return cosine(n - warmup, schedule_steps - warmup);
  const int64_t decay_from = schedule_steps - decay;  // warm-up and the stable phase before it
  if (n < decay_from) return peak;
  const int64_t i = n - decay_from;
  if (wsd_cosine) return cosine(i, decay);
  if (decay <= 1) return peak;  // optax's linear schedule of no transition steps
  return peak + (final_lr - peak) * static_cast<double>(i) / (decay - 1.0);
}

std::string precision_hint(DType compute, double peak_f32, double peak_bf16) {
  if (compute != DType::f32 || peak_f32 <= 0 || peak_bf16 < 4 * peak_f32) return {};
  char b[400];
  std::snprintf(b, sizeof b,
                "hint: dtype=float32 computes at up to %.0f TFLOP/s on this device, bfloat16 at "
                "%.0f; dtype=bfloat16 weight_dtype=float32 trains in MaxText's mixed precision "
                "(f32 master weights and optimizer state, bf16 activations and matmuls).",
                peak_f32 / 1e12, peak_bf16 / 1e12);
  return b;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The layers' auxiliary losses as metrics.jsonl fields (", \"moe_lb_loss\": 0.01", ...).
std::string aux_fields(const std::map<std::string, double>& aux) {
  std::string r;
  for (const auto& [name, v] : aux) r += fmt::format(", {}: {:.9g}", json::quote(name), v);
  return r;
}

std::string progress_bar(int64_t step, int64_t steps, double eta_s, double loss, double tps,
                         double mfu) {
  const int width = 30;
  const int fill = static_cast<int>(width * step / std::max<int64_t>(1, steps));
  std::string bar(static_cast<size_t>(fill), '#');
  bar += std::string(static_cast<size_t>(width - fill), '.');
  return fmt::format("\r[{}] {}/{} loss {:.4f} | {:.0f} tok/s | MFU {:.1f}% | ETA {:.0f}s   ", bar,
                     step, steps, loss, tps, 100 * mfu, eta_s);
}

}  // namespace

OptimizerState make_optimizer_state(ModelRunner& runner, const Config& cfg,
                                    std::unique_ptr<Backend> host, int rank, int ranks) {
  DType mu = runner.weight_dtype();
  if (const std::string s = cfg.get_string("mu_dtype"); !s.empty())
    if (!parse_dtype(s, mu) || !(mu == DType::f32 || mu == DType::bf16))
      cfg.reject("mu_dtype", "must be float32, bfloat16, or \"\" (the weight_dtype).");
  OptimizerState opt;
  if (cfg.get_bool("optimizer_memory_host_offload")) {
    MT_CHECK(host != nullptr, "optimizer_memory_host_offload needs a host backend");
    opt.host = std::move(host);
  }
  Backend& be = opt.host ? *opt.host : runner.backend();
  // FSDP: the parameters are this rank's parts already, and so are the moments beside them.
  if (cfg.get_bool("shard_optimizer_over_data") && ranks > 1 && !runner.sharding().on()) {
    int64_t total = 0;
    for (auto& p : runner.params()) total += shape_numel(p.spec.shape);
    const auto [lo, hi] = shard_range(static_cast<size_t>(total), rank, ranks);
    int64_t at = 0;  // the parameter's first element in the flat order
    for (auto& p : runner.params()) {
      const int64_t n = shape_numel(p.spec.shape);
      const int64_t b = std::clamp(static_cast<int64_t>(lo) - at, int64_t{0}, n);
      const int64_t e = std::clamp(static_cast<int64_t>(hi) - at, b, n);
      opt.shard.emplace_back(b, e);
      opt.m.push_back(be.zeros({e - b}, mu));
      opt.v.push_back(be.zeros({e - b}, DType::f32));
      at += n;
    }
    return opt;
  }
  for (auto& p : runner.params()) {
    opt.m.push_back(be.zeros(p.value.shape(), mu));
    opt.v.push_back(be.zeros(p.value.shape(), DType::f32));
  }
  return opt;
}

namespace {

// Whether plain data parallelism overlaps its gradient sums with the backward (each decoder
// layer's final gradients summed on a CollectiveQueue's thread, one host buffer a layer through
// all_reduce_sum as the one bucket without overlap goes: every element the same rank-ordered
// sum, while the training thread runs the backward of the layers below): see
// ModelRunner::overlaps_communication for what it needs.
bool overlap_gradient_sums(ModelRunner& runner, const Communicator& comm,
                           const OptimizerState* opt) {
  return !runner.sharding().on() && !(opt && opt->sharded()) && runner.overlaps_communication(comm);
}

// The gradients not marked `skip`, summed in one bucket over `others` (null: no sum), except
// the experts' under expert parallelism, summed over the ranks holding the same experts
// (ExpertSharding::replicas; null: none to sum with).
void sum_gradients(ModelRunner& runner, const std::vector<bool>& skip, Communicator* others) {
  Backend& be = runner.backend();
  const ExpertSharding& experts = runner.expert_sharding();
  std::vector<Tensor*> grads, expert_grads;
  size_t j = 0;
  for (auto& p : runner.params())
    if (!skip[j++]) (experts.on() && p.by_expert ? expert_grads : grads).push_back(&p.grad);
  if (others && !grads.empty()) others->all_reduce_sum(be, grads);
  if (experts.replicas && !expert_grads.empty()) experts.replicas->all_reduce_sum(be, expert_grads);
}

}  // namespace

StepGradients forward_backward(ModelRunner& runner, std::vector<DeviceBatch>& micro, float z_loss,
                               Communicator* comm, const OptimizerState* opt) {
  Backend& be = runner.backend();
  const bool ranks = comm && comm->size() > 1;
  StepGradients r;
  int64_t valid = 0, sequences = 0;
  // Multi-token prediction's valid targets per depth (fewer than the main loss's: depth k has
  // none in a document's last k positions).
  const size_t depths = micro.empty() ? 0 : micro[0].mtp.size();
  std::vector<double> mtp_valid(depths, 0.0);
  for (const auto& mb : micro) {
    valid += mb.valid_targets;
    sequences += mb.inputs.dim(0);
    for (size_t k = 0; k < depths && k < mb.mtp.size(); ++k)
      mtp_valid[k] += static_cast<double>(mb.mtp[k].valid_targets);
  }
  if (ranks) {  // the weights are shares of the global batch's targets and sequences
    const auto t0 = Clock::now();
    std::vector<double> v = {static_cast<double>(valid), static_cast<double>(sequences)};
    v.insert(v.end(), mtp_valid.begin(), mtp_valid.end());
    comm->all_reduce_sum(v.data(), v.size());
    valid = std::llround(v[0]);
    sequences = std::llround(v[1]);
    std::copy(v.begin() + 2, v.end(), mtp_valid.begin());
    r.communication_s += seconds_since(t0);
  }
  r.valid_targets = valid;
  // (Every rank has the same sum, so every rank refuses alike.)
  if (valid == 0)
    throw Error(
        "The step's batch has no target to learn from: every target of its " +
        std::to_string(sequences) +
        " sequences is -1 (masked), so its loss would read 0 and its update would only decay the "
        "weights. The data source masks every position: check its documents' lengths against "
        "max_target_length, or the data plugin.");
  // Plain data parallelism: the last micro-batch's backward hands each layer's final gradients
  // to the summing thread; `sent` marks them, the rest are summed after the backward.
  std::optional<CollectiveQueue> sums;
  std::vector<bool> sent(runner.params().size(), false);
  struct ClearHook {
    ModelRunner& r;
    ~ClearHook() { r.set_layer_gradients_ready({}); }
  } clear_hook{runner};
  for (size_t m = 0; m < micro.size(); ++m) {
    DeviceBatch& mb = micro[m];
    if (ranks && m + 1 == micro.size() && overlap_gradient_sums(runner, *comm, opt)) {
      sums.emplace();
      runner.set_layer_gradients_ready([&](size_t layer) {
        const auto [b, e] = runner.layer_params(layer);
        std::vector<Tensor*> grads;
        for (size_t j = b; j < e; ++j) {
          Param& p = runner.params()[j];
          if (!p.grad.defined()) continue;
          MT_CHECK(p.grad.dtype() == DType::f32, "gradients are f32");
          Graph::finish_fresh(be, p.value);  // a parameter the pass did not use: zeros
          grads.push_back(&p.grad);
          sent[j] = true;
        }
        if (grads.empty()) return;
        auto host = std::make_shared<std::vector<float>>();
        sums->submit({[host, grads, &be] {
                        size_t n = 0;
                        for (const Tensor* t : grads) n += static_cast<size_t>(t->numel());
                        host->resize(n);
                        size_t at = 0;
                        for (const Tensor* t : grads) {
                          be.copy_to_host(*t, host->data() + at);
                          at += static_cast<size_t>(t->numel());
                        }
                      },
                      [host, comm] { comm->all_reduce_sum(host->data(), host->size()); },
                      [host, grads, &be] {
                        size_t at = 0;
                        for (Tensor* t : grads) {
                          be.copy_from_host(*t, host->data() + at);
                          at += static_cast<size_t>(t->numel());
                        }
                      }});
      });
    }
    Graph g(be);
    const double share =
        valid ? static_cast<double>(mb.valid_targets) / static_cast<double>(valid) : 0;
    // The layers' own losses (means over sequences or tokens): the share of the sequences.
    const double aux_share =
        sequences ? static_cast<double>(mb.inputs.dim(0)) / static_cast<double>(sequences) : 0;
    // Each MTP depth's mean over the step's targets of that depth.
    std::vector<double> mtp_share(depths, 0.0);
    for (size_t k = 0; k < depths && k < mb.mtp.size(); ++k)
      mtp_share[k] =
          mtp_valid[k] > 0 ? static_cast<double>(mb.mtp[k].valid_targets) / mtp_valid[k] : 0.0;
    Tensor l = runner.loss(g, mb, z_loss, share, &r.aux, &r.layer_stats, aux_share,
                           depths ? &mtp_share : nullptr);
    float lv = 0;
    be.copy_to_host(l, &lv);
    r.loss += lv;
    g.backward(l);
  }
  runner.set_layer_gradients_ready({});
  runner.finish_gradients();
  r.communication_s += runner.take_communication_seconds();
  if (ranks) {
    be.synchronize();  // the backward's kernels are compute, not the collectives' time
    const auto t0 = Clock::now();
    // Gradients summed over the ranks (one bucket), then the scalars every rank reports: the
    // loss, the auxiliary losses and the layers' statistics (DeepSeek-V3's expert loads),
    // flattened in the same order on every rank.
    if (runner.sharding().on()) {
      // FSDP: the backward reduce-scattered every gradient into this rank's part already; HSDP
      // adds the parts of the other groups' ranks holding the same part (an expert's: the
      // ranks holding that expert).
      sum_gradients(runner, std::vector<bool>(runner.params().size(), false),
                    runner.sharding().replicas);
    } else if (opt && opt->sharded()) {
      // Every gradient flattened into one host buffer (one collective), reduce-scattered, and
      // this rank's part of each gradient copied back.
      int64_t total = 0;
      for (auto& p : runner.params()) total += p.grad.numel();
      std::vector<float> flat(static_cast<size_t>(total));
      int64_t at = 0;
      for (auto& p : runner.params()) {
        part_to_host(p.grad, 0, p.grad.numel(), flat.data() + at);
        at += p.grad.numel();
      }
      comm->reduce_scatter_sum(flat.data(), flat.size());
      at = 0;
      size_t i = 0;
      for (auto& p : runner.params()) {
        const auto [b, e] = opt->shard[i++];
        part_from_host(p.grad, b, e, flat.data() + at + b);
        at += p.grad.numel();
      }
    } else {
      // The layers' buckets the backward overlapped (only the wait for the last is exposed),
      // then what remains (the top parameters) in one more.
      if (sums) sums->drain();
      // Expert parallelism: an expert's gradient over the ranks holding that expert (none to
      // sum with when the expert axis is the whole job), the rest over all.
      sum_gradients(runner, sent, comm);
    }
    std::vector<double> scalars{r.loss};
    for (const auto& [name, v] : r.aux) scalars.push_back(v);
    for (const auto& layer : r.layer_stats)
      for (const auto& [name, values] : layer)
        scalars.insert(scalars.end(), values.begin(), values.end());
    comm->all_reduce_sum(scalars.data(), scalars.size());
    size_t k = 0;
    r.loss = scalars[k++];
    for (auto& [name, v] : r.aux) v = scalars[k++];
    for (auto& layer : r.layer_stats)
      for (auto& [name, values] : layer)
        for (double& x : values) x = scalars[k++];
    r.communication_s += seconds_since(t0);
  }
  // The expert loads of the step: each MoE layer's "moe_slots<tag>" (an expert's token-slots,
  // summed over the micro-batches and ranks) give moe_load_min/max<tag>, the least and most
  // loaded expert's share, as one rank given the whole batch counts them (the forwards' own
  // shares, averaged, differ from it under data parallelism or gradient accumulation).
  // They are the trainer's: taken out of the statistics handed to DecoderLayer::after_step, which
  // under FSDP gathers the whole parameters of every layer that has any.
  for (auto& layer : r.layer_stats)
    for (auto it = layer.begin(); it != layer.end();) {
      if (it->first.rfind("moe_slots", 0) != 0) {
        ++it;
        continue;
      }
      const std::string tag = it->first.substr(std::strlen("moe_slots"));
      const std::vector<double>& v = it->second;
      double total = 0;
      for (double x : v) total += x;
      if (!v.empty()) {
        const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
        r.aux["moe_load_min" + tag] = total > 0 ? *lo / total : 0.0;
        r.aux["moe_load_max" + tag] = total > 0 ? *hi / total : 0.0;
      }
      it = layer.erase(it);
    }
  // The global gradient norm: every tensor's sum of squares in one call (one device round
  // trip), added in parameter order.
  // Sharded over ranks: this rank's parts, then the ranks' sums added in rank order.
  const bool fsdp = runner.sharding().on();
  const bool parts = ranks && opt && opt->sharded() && !fsdp;
  // Tensor parallelism: the split gradients' parts on every tensor rank, the replicated ones
  // (the same on each) on the first only, then summed over the group.
  // Expert parallelism the same way over the expert group. With both, the expert group holds
  // the tensor group: the experts' parts on every rank of it, the tensor-split ones on expert
  // rank 0's tensor ranks, the replicated ones on its tensor rank 0, summed over it once.
  const TensorSharding& tensor = runner.tensor_sharding();
  const ExpertSharding& experts = runner.expert_sharding();
  const bool spanning = experts.on() && experts.tensor_ranks > 1;
  const int expert_rank = experts.rank / experts.tensor_ranks;
  std::vector<Tensor> views;
  size_t i = 0;
  for (auto& p : runner.params()) {
    const auto [b, e] = parts ? opt->shard[i] : std::pair<int64_t, int64_t>{0, p.grad.numel()};
    const bool counted =
        p.by_expert || (expert_rank == 0 && (p.tensor_dim >= 0 || tensor.rank == 0));
    if (b < e && counted) views.push_back(parts ? flat_part(p.grad, b, e) : p.grad);
    ++i;
  }
  std::vector<const Tensor*> grads;
  for (const Tensor& t : views) grads.push_back(&t);
  std::vector<double> sq;
  be.sum_squares_each(grads, sq);
  double total = 0;
  for (double x : sq) total += x;
  if (parts || (ranks && fsdp)) {
    const auto t0 = Clock::now();
    // FSDP: the parts of one group make every gradient once (HSDP's other groups hold copies).
    (fsdp && runner.sharding().comm ? runner.sharding().comm : comm)->all_reduce_sum(&total, 1);
    r.communication_s += seconds_since(t0);
  }
  for (Communicator* group : {tensor.on() && !spanning ? tensor.group : nullptr,
                              experts.on() ? experts.group : nullptr}) {
    if (!group) continue;
    const auto t0 = Clock::now();
    group->all_reduce_sum(&total, 1);
    r.communication_s += seconds_since(t0);
  }
  r.grad_norm = std::sqrt(total);
  return r;
}

double apply_update(ModelRunner& runner, OptimizerState& opt, AdamWParams adam, float weight_decay,
                    const std::vector<LayerStats>& layer_stats, Communicator* comm) {
  Backend& be = runner.backend();
  size_t i = 0;
  for (auto& p : runner.params()) {
    adam.weight_decay = p.spec.weight_decay ? weight_decay : 0.f;
    Tensor value = p.value, grad = p.grad;  // or this rank's parts of them
    if (opt.sharded()) {
      const auto [b, e] = opt.shard[i];
      if (b == e) {
        ++i;
        continue;
      }
      value = flat_part(p.value, b, e);
      grad = flat_part(p.grad, b, e);
    }
    if (opt.host) {
      // Offloaded: this parameter's moments to the device, the update there, and back. The
      // host tensors' memory is host memory (a CPU backend's), which copies read and write.
      Tensor m = be.empty(opt.m[i].shape(), opt.m[i].dtype());
      Tensor v = be.empty(opt.v[i].shape(), opt.v[i].dtype());
      be.copy_from_host(m, opt.m[i].data());
      be.copy_from_host(v, opt.v[i].data());
      be.adamw_update(value, grad, m, v, adam);
      be.copy_to_host(m, opt.m[i].data());
      be.copy_to_host(v, opt.v[i].data());
    } else {
      be.adamw_update(value, grad, opt.m[i], opt.v[i], adam);
    }
    ++i;
  }
  double communication_s = 0;
  if (opt.sharded() && comm && comm->size() > 1) {
    be.synchronize();
    const auto t0 = Clock::now();
    // Every rank's updated parts to every rank: one host buffer, one collective.
    int64_t total = 0;
    for (auto& p : runner.params()) total += p.value.numel();
    std::vector<float> flat(static_cast<size_t>(total));
    int64_t at = 0;
    i = 0;
    for (auto& p : runner.params()) {
      const auto [b, e] = opt.shard[i++];
      part_to_host(p.value, b, e, flat.data() + at + b);
      at += p.value.numel();
    }
    comm->all_gather(flat.data(), flat.size());
    at = 0;
    for (auto& p : runner.params()) {
      part_from_host(p.value, 0, p.value.numel(), flat.data() + at);
      at += p.value.numel();
    }
    communication_s = seconds_since(t0);
  }
  // Updates outside the gradient (DeepSeek-V3's router_bias), before the step's checkpoint.
  runner.after_step(layer_stats);
  runner.zero_gradients();
  return communication_s;
}

namespace {

// Every rank must train the same config: rank 0's hash of the resolved config against each
// rank's. Every rank learns which ranks differ, so all refuse together (and rank 0 says so).
// The model keys whose value differs from the config a checkpoint was written with, as
// "key: saved -> now": base.yml's model sections and the family's own keys, less those a
// resumed run may change (dtypes, kernels, remat, tiling, the initialisation, the MoE losses'
// weights and router-bias rate). Shapes are checked by the restore; these change the model
// the weights are read into (an activation, rope theta, a soft cap) with nothing to see.
std::vector<std::string> changed_model_keys(const Config& cfg, const std::string& saved_yaml) {
  static const std::set<std::string> kLossWeights = {
      "load_balance_loss_weight", "moe_z_loss_weight", "routed_bias_update_rate"};
  std::vector<std::string> out;
  YAML::Node saved, now;
  try {
    saved = YAML::Load(saved_yaml);
    now = YAML::Load(cfg.to_yaml(false));
  } catch (const YAML::Exception&) {
    return out;  // a checkpoint without a readable config (older or foreign) is not compared
  }
  if (!saved.IsMap() || !now.IsMap()) return out;
  const auto& sections = cfg.impl().sections;
  for (const auto& kv : now) {
    const std::string key = kv.first.Scalar();
    const auto sec = sections.find(key);
    const std::string section = sec == sections.end() ? "" : sec->second;
    if (section != "Model" && section != "Multi-head latent attention (DeepSeek)" &&
        !section.empty())
      continue;
    if (core_model_keys().count(key) || kLossWeights.count(key) || !saved[key]) continue;
    YAML::Emitter a, b;
    a << YAML::Flow << saved[key];
    b << YAML::Flow << kv.second;
    if (std::string(a.c_str()) != b.c_str())
      out.push_back(key + ": " + a.c_str() + " -> " + b.c_str());
  }
  return out;
}

// metrics.jsonl holds the run's history as it stands: the records of the steps this run starts
// at or after (a killed run's steps past its last checkpoint, which the restart runs again; a
// run started over) are moved to metrics.discarded.jsonl, as TensorBoard drops them through
// the START event. Returns how many were moved.
size_t move_undone_metrics(const fs::path& run_dir, int64_t first_step) {
  const fs::path file = run_dir / "metrics.jsonl";
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) return 0;
  std::ifstream in(file);
  std::string kept, undone, line;
  size_t moved = 0;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"step\": ");
    int64_t step = 0;
    const bool has_step =
        at != std::string::npos &&
        std::from_chars(line.data() + at + 8, line.data() + line.size(), step).ec == std::errc();
    if (has_step && step >= first_step) {
      undone += line + "\n";
      ++moved;
    } else {
      kept += line + "\n";
    }
  }
  if (moved == 0) return 0;
  {
    std::ofstream d(run_dir / "metrics.discarded.jsonl", std::ios::app);
    d << undone;
    if (!d) throw Error("Cannot write " + quoted(run_dir / "metrics.discarded.jsonl") + ".");
  }
  const fs::path tmp = run_dir / "metrics.jsonl.tmp";
  {
    std::ofstream o(tmp);
    o << kept;
    o.close();
    if (!o) throw Error("Cannot write " + quoted(tmp) + ".");
  }
  fs::rename(tmp, file, ec);
  if (ec) throw Error("Cannot write " + quoted(file) + ": " + ec.message() + ".");
  return moved;
}

void check_same_config(const Config& cfg, Communicator& comm) {
  if (comm.size() == 1) return;
  const uint64_t mine = fnv1a(cfg.to_yaml(false));
  uint64_t root = mine;
  comm.broadcast(&root, sizeof root, 0);
  std::vector<double> differs(static_cast<size_t>(comm.size()), 0.0);
  differs[static_cast<size_t>(comm.rank())] = root != mine ? 1.0 : 0.0;
  comm.all_reduce_sum(differs.data(), differs.size());
  std::string which;
  for (size_t r = 0; r < differs.size(); ++r)
    if (differs[r] > 0) which += (which.empty() ? "" : ", ") + std::to_string(r);
  if (!which.empty())
    throw UsageError(
        "The ranks were started with different configs: the resolved config of "
        "rank(s) " +
        which +
        " differs from rank 0's (`mt config` with the same "
        "arguments shows it); start every rank with the same arguments and files.");
}

}  // namespace

void warn_changed_model_keys(const Config& cfg, const std::string& key, const std::string& path,
                             const std::string& command) {
  std::string saved;
  try {
    saved = checkpoint_config_yaml(path);
  } catch (const Error&) {
    return;  // loading it says what is wrong with it
  }
  const auto changed = changed_model_keys(cfg, saved);
  if (changed.empty()) return;
  std::string list;
  for (const auto& c : changed) list += (list.empty() ? "" : "; ") + c;
  std::fprintf(stderr,
               "%s: warning: %s=%s was written with other model keys than these (%s). Its weights "
               "are read into the model these keys build, another model than the one trained; if "
               "that is not what you mean, use the checkpoint's values (its config.yml)%s.\n",
               command.c_str(), key.c_str(), path.c_str(), list.c_str(),
               command == "mt run" ? ""
                                   : ", which mt decode, score and convert take by themselves "
                                     "when no model is named");
}

TrainSummary train(const Config& cfg, PluginManager& plugins, bool quiet, Communicator* comm_in) {
  // The job's ranks: data parallelism over all of them, or one rank.
  std::unique_ptr<Communicator> own_comm;
  if (!comm_in) own_comm = make_local_communicator();
  Communicator& comm = comm_in ? *comm_in : *own_comm;
  const int ranks = comm.size();
  const bool lead = comm.rank() == 0;  // prints and writes the run's files
  quiet = quiet || !lead;
  const Mesh mesh = resolve_mesh(cfg, ranks);
  check_same_config(cfg, comm);
  // Tensor parallelism: groups of mesh.tensor consecutive ranks share a batch and divide the
  // split weights; the ranks of one tensor index across the groups are data parallelism's
  // (gradients, losses and the data shard go over them).
  const int tp = static_cast<int>(mesh.tensor);
  const int tp_rank = comm.rank() % tp, batch_index = comm.rank() / tp;
  std::unique_ptr<Communicator> tensor_group, data_group;
  if (tp > 1) {
    tensor_group = comm.split(batch_index, tp_rank);
    data_group = comm.split(tp_rank, batch_index);
  }
  Communicator& dp = data_group ? *data_group : comm;
  // The mesh from the innermost: rank r is tensor rank t = r % T, expert rank x = (r / T) % X,
  // fsdp rank f = (r / (T X)) % F and data index d = r / (T X F).
  const int xp = static_cast<int>(mesh.expert), fp = static_cast<int>(mesh.fsdp);
  const int xp_rank = (comm.rank() / tp) % xp, fsdp_rank = (comm.rank() / (tp * xp)) % fp;
  const int data_index = comm.rank() / (tp * xp * fp);
  // Expert parallelism (beside any of the other axes): the experts are divided within each
  // group of the X ranks that differ in x only, and each rank's experts'
  // gradient (FSDP: its parts) is summed over the ranks holding the same (those differing in d
  // only). For everything else the expert axis is data parallelism: the batch is split over
  // it, and the other parameters' gradients are summed over it too.
  // With the tensor axis the group is the X T ranks that differ in x and t (rank x T + t),
  // among which the experts are divided: the tensor ranks of a batch hold the same tokens, and
  // each sends its share of them.
  std::unique_ptr<Communicator> expert_group, expert_replicas;
  if (xp > 1) {
    expert_group = comm.split(fsdp_rank + fp * data_index, xp_rank * tp + tp_rank);
    if (mesh.data > 1) expert_replicas = comm.split(comm.rank() % (tp * xp * fp), data_index);
  }
  // Outputs: the resolved config beside the metrics, in a directory this run alone writes:
  // locked before anything else is done, so a second run is refused at once.
  if (!cfg.get_string("quantization").empty())
    cfg.reject("quantization",
               "is for inference (mt decode, mt score, mt bench decode): training with int8 "
               "weights (MaxText's AQT) is not implemented. Unset it for mt run.");
  if (cfg.get_bool("quantize_kvcache"))
    cfg.reject("quantize_kvcache",
               "is for inference (mt decode, mt bench decode): training keeps no KV cache. Unset "
               "it for mt run.");
  if (!cfg.get_string("load_full_state_path").empty() &&
      !cfg.get_string("load_parameters_path").empty())
    cfg.reject("load_parameters_path",
               "and load_full_state_path are both set: a run starts from a full state (weights, "
               "optimizer state and step) or from weights alone, not both. Keep one.");
  const std::string run_name = cfg.get_string("run_name");
  if (run_name.empty() || run_name == "." || run_name == ".." ||
      run_name.find('/') != std::string::npos)
    cfg.reject("run_name",
               "must be a plain directory name inside base_output_directory (no '/', not '.' "
               "or '..'); to write elsewhere, set base_output_directory=.");
  const fs::path run_dir = fs::path(cfg.get_string("base_output_directory")) / run_name;
  // The memory plan first: a model that cannot fit is refused with the changes that make it
  // fit, before the run directory is locked or anything is allocated.
  std::unique_ptr<Backend> device = plugins.make_backend(cfg.get_string("backend"), cfg);
  check_fits(cfg, plugins, *device, PlanFor::train, "run", ranks);
  std::optional<RunLock> lock;
  if (lead) lock.emplace(run_dir);
  // FSDP: the parameters divided among the mesh.fsdp ranks of each group (those differing in f
  // only), and with data (or expert) parallelism too (HSDP) each part's gradient summed over
  // the groups holding copies (those differing in d and x); the batch is split over all three.
  ParamSharding sharding;
  std::unique_ptr<Communicator> fsdp_group, replica_group;
  if (fp > 1) {
    if (mesh.data > 1 || tp > 1 || xp > 1)
      fsdp_group = comm.split(tp_rank + tp * (xp_rank + xp * data_index), fsdp_rank);
    if (mesh.data > 1 || xp > 1)
      replica_group = comm.split(tp_rank + tp * fsdp_rank, xp_rank + xp * data_index);
    sharding = {fsdp_group ? fsdp_group.get() : &comm, fsdp_rank, fp, replica_group.get()};
  }
  ExpertSharding experts;
  if (xp > 1) {
    experts = {expert_group.get(), xp_rank * tp + tp_rank,
               static_cast<int>(mesh.expert_group_ranks()), expert_replicas.get()};
    experts.tensor_ranks = tp;
  }
  ModelRunner runner(cfg, plugins, std::move(device), nullptr, sharding,
                     TensorSharding{tensor_group.get(), tp_rank, tp}, experts);
  Backend& be = runner.backend();
  const int64_t steps = cfg.get_int("steps");
  const int64_t accum = cfg.get_int("gradient_accumulation_steps");
  const int64_t batch = cfg.get_int("per_device_batch_size");
  const int64_t seq = cfg.get_int("max_target_length");
  const int64_t log_period = cfg.get_int("log_period");
  const int64_t eval_interval = cfg.get_int("eval_interval");
  const int64_t eval_steps = cfg.get_int("eval_steps");
  const double peak_lr = cfg.get_float("learning_rate");
  const LrSchedule schedule = LrSchedule::from_config(cfg, steps);
  const double clip = cfg.get_float("gradient_clipping_threshold");
  const auto z_loss = static_cast<float>(cfg.get_float("z_loss_multiplier"));
  AdamWParams adam;
  adam.b1 = static_cast<float>(cfg.get_float("adam_b1"));
  adam.b2 = static_cast<float>(cfg.get_float("adam_b2"));
  adam.eps = static_cast<float>(cfg.get_float("adam_eps"));
  // AdamW computes in float32: a value that is 0 or infinite there is one that divides 0 by 0
  // or makes every update 0.
  if (!(adam.eps >= std::numeric_limits<float>::min()) || !std::isfinite(adam.eps))
    cfg.reject("adam_eps", "is " + std::string(adam.eps == 0.f ? "0" : "infinite") +
                               " in float32, in which AdamW computes: choose a value between "
                               "1e-38 and 1e38 (1e-8 is usual).");
  // A decay below 1 that rounds to 1 in float32 (0.99999999) divides the bias correction's
  // 0 by 0: NaN at the first step (before: reported at step 2 with advice about the rate).
  for (const auto& [key, b] : {std::pair{"adam_b1", adam.b1}, std::pair{"adam_b2", adam.b2}})
    if (!(b < 1.f))
      cfg.reject(key,
                 "rounds to 1 in float32, in which AdamW computes (its bias correction "
                 "1 - b^t is then 0): choose at most 0.9999999 (0.9 and 0.999 are usual).");
  const auto weight_decay = static_cast<float>(cfg.get_float("adam_weight_decay"));

  // Data.
  const std::string dataset = cfg.get_string("dataset_type");
  std::unique_ptr<Tokenizer> tokenizer;
  if (!cfg.get_string("tokenizer_path").empty())
    tokenizer = make_tokenizer(cfg.get_string("tokenizer_path"), cfg.get_string("tokenizer_type"));
  std::unique_ptr<DatasetSource> data = plugins.make_dataset(
      dataset, cfg, DataShard{batch_index, static_cast<int>(mesh.batch_ranks())}, tokenizer.get());

  // Model FLOPs and the peak they are measured against.
  const double flops_per_token = runner.model().flops_per_token(seq);
  const ParamCounts counts = count_parameters(runner.model());
  double peak = cfg.get_float("device_peak_tflops") * 1e12;
  const bool peak_set = peak > 0;
  if (!peak_set) peak = be.peak_flops(runner.compute_dtype());
  bool mfu_above_one_said = false;

  {
    // On the backend (fill_random); a phase that lasts shows its progress on a terminal.
    double bytes = 0;
    for (auto& p : runner.params()) bytes += static_cast<double>(p.value.nbytes());
    Progress init("mt run: initialising parameters", bytes, "B", !quiet);
    runner.init_parameters(static_cast<uint64_t>(cfg.get_int("init_weights_seed")), &init);
    be.synchronize();
  }
  runner.enable_gradients();
  runner.zero_gradients();
  OptimizerState opt = make_optimizer_state(
      runner, cfg,
      cfg.get_bool("optimizer_memory_host_offload") ? plugins.make_backend("cpu", cfg) : nullptr,
      batch_index, static_cast<int>(mesh.batch_ranks()));

  // Checkpoints: resume from this run's latest complete step, else start from another run's
  // full state or parameters when asked (MaxText's load_full_state_path / load_parameters_path).
  // One rank, or plain data parallelism: the whole state, saved by rank 0 (format version 1).
  // FSDP, tensor parallelism or sharded moments: every rank saves the parts it holds (version
  // 2; a replicated part by the lowest rank holding it) and restores its parts from a
  // checkpoint of any mesh; no rank ever holds the whole state.
  const bool fsdp = runner.sharding().on();
  const bool parts = fsdp || tp > 1 || xp > 1 || opt.sharded();
  TrainState state;
  ShardedTrainState part_state;
  {
    size_t i = 0;
    for (auto& p : runner.params()) {
      if (!parts) {
        state.params[p.name] = p.value;
        state.opt_m[p.name] = opt.m[i];
        state.opt_v[p.name] = opt.v[i];
        ++i;
        continue;
      }
      TensorPart part{p.spec.shape,  p.tensor_dim, p.split_parts, p.split_part,
                      p.shard_begin, p.shard_end,  p.value};
      part_state.tensors[0][p.name] = part;
      if (opt.sharded()) std::tie(part.begin, part.end) = opt.shard[i];  // ZeRO-1's range
      part.data = opt.m[i];
      part_state.tensors[1][p.name] = part;
      part.data = opt.v[i];
      part_state.tensors[2][p.name] = part;
      ++i;
    }
  }
  // The state strings a restore brings, for either kind of state.
  auto adopt = [&](const ShardedTrainState& from) {
    state.step = from.step;
    state.data_state = from.data_state;
    state.rng_state = from.rng_state;
    state.config_yaml = from.config_yaml;
  };
  const bool checkpointing = cfg.get_bool("enable_checkpointing");
  const int64_t ckpt_period = cfg.get_int("checkpoint_period");
  const bool stop_on_ckpt_error = cfg.get_string("checkpoint_error_policy") == "stop";
  if (checkpointing && lead) {
    // Said now, not at the first save checkpoint_period steps in: refused under
    // checkpoint_error_policy=stop, which would end the run there; a warning under continue.
    std::error_code ec;
    const fs::path saves = run_dir / "checkpoints";
    if (fs::exists(saves, ec) && !fs::is_directory(saves, ec)) {
      const std::string what =
          quoted(saves) + " is a file, where this run keeps its checkpoints, so every save fails";
      if (stop_on_ckpt_error)
        throw UsageError(what +
                         " (checkpoint_error_policy=stop would end the run at the first): move it "
                         "away, or choose another base_output_directory or run_name (or "
                         "enable_checkpointing=false).");
      std::fprintf(stderr, "mt run: warning: %s (checkpoint_error_policy=continue).\n",
                   what.c_str());
    }
  }
  CheckpointManager ckpt(run_dir / "checkpoints", cfg.get_bool("async_checkpointing"),
                         static_cast<int>(cfg.get_int("max_num_checkpoints_to_keep")), be,
                         parts ? &comm : nullptr);
  if (lock) ckpt.claim_directory();  // rank 0 makes and cleans the save directories
  int64_t first_step = 1;
  std::string resumed_from;
  // A newer step that is not complete is passed over, but never silently.
  if (checkpointing && lead)
    for (const auto& why : ckpt.skipped_newer_steps())
      std::fprintf(stderr, "mt run: warning: %s; the run does not resume from it.\n", why.c_str());
  // Rank 0 chooses the step and every rank restores that one.
  int64_t latest = lead ? ckpt.latest_step() : -1;
  comm.broadcast(&latest, sizeof latest, 0);
  if (!checkpointing && latest >= 0)
    cfg.reject("enable_checkpointing",
               fmt::format("would start this run over from step 1 beside its checkpoints (the "
                           "latest is step {} in {}), and append a second series of steps to its "
                           "metrics.jsonl. Set enable_checkpointing=true to resume it, or choose "
                           "another run_name (or base_output_directory) for a new run.",
                           latest, ckpt.directory().string()));
  if (latest >= 0) {
    if (parts) {
      ckpt.restore_parts(latest, part_state);
      adopt(part_state);
    } else {
      ckpt.restore(latest, state);
    }
    data->restore(state.data_state);
    first_step = state.step + 1;
    resumed_from = fmt::format("resumed from step {} in {}", latest, ckpt.directory().string());
    if (lead)
      if (const auto changed = changed_model_keys(cfg, state.config_yaml); !changed.empty()) {
        std::string list;
        for (const auto& c : changed) list += (list.empty() ? "" : "; ") + c;
        std::fprintf(stderr,
                     "mt run: warning: the checkpoint of step %ld was written with other model "
                     "keys than this run's (%s). Its weights are read into the model these keys "
                     "build, so the run goes on as another model; if that is not what you mean, "
                     "stop it and run with the checkpoint's values (its config.yml).\n",
                     static_cast<long>(latest), list.c_str());
      }
  } else if (!cfg.get_string("load_full_state_path").empty()) {
    if (parts) {
      load_full_state_parts(cfg.get_string("load_full_state_path"), part_state);
      adopt(part_state);
    } else {
      load_full_state(cfg.get_string("load_full_state_path"), state);
    }
    data->restore(state.data_state);
    first_step = state.step + 1;
    resumed_from = "full state from " + cfg.get_string("load_full_state_path");
    if (lead)
      warn_changed_model_keys(cfg, "load_full_state_path", cfg.get_string("load_full_state_path"),
                              "mt run");
  } else if (!cfg.get_string("load_parameters_path").empty()) {
    if (parts)
      load_parameter_parts(cfg.get_string("load_parameters_path"), part_state);
    else
      load_parameters(cfg.get_string("load_parameters_path"), state.params);
    resumed_from = "parameters from " + cfg.get_string("load_parameters_path");
    if (lead)
      warn_changed_model_keys(cfg, "load_parameters_path", cfg.get_string("load_parameters_path"),
                              "mt run");
  } else if (!cfg.get_string("hf_path").empty()) {
    load_hf_weights(cfg.get_string("hf_path"), runner);
    resumed_from = "Hugging Face weights from " + cfg.get_string("hf_path");
  }
  // Outputs: the resolved config beside the metrics (rank 0's), once the checkpoint or weights
  // the run starts from are accepted: a run refused before (a checkpoint of another shape) leaves
  // the run directory's config.yml as the run that wrote it had it, and so does a run with
  // nothing to do (its checkpoint at or past steps).
  std::ofstream metrics;
  bool metrics_failed = false;
  if (lead && first_step <= steps) {
    const fs::path tmp = run_dir / "config.yml.tmp";
    {
      std::ofstream c(tmp);
      c << cfg.to_yaml(true);
      c.close();
      if (!c) throw Error("Cannot write " + quoted(tmp) + ".");
    }
    std::error_code ec;
    fs::rename(tmp, run_dir / "config.yml", ec);
    if (ec)
      throw Error("Cannot write " + quoted(run_dir / "config.yml") + ": " + ec.message() + ".");
    if (const size_t moved = move_undone_metrics(run_dir, first_step); moved > 0 && !quiet)
      std::printf(
          "mt run: %zu metrics records of steps from %ld on, which this run runs again, "
          "moved to %s\n",
          moved, static_cast<long>(first_step),
          (run_dir / "metrics.discarded.jsonl").string().c_str());
    metrics.open(run_dir / "metrics.jsonl", std::ios::app);
    if (!metrics)
      throw Error("Cannot write metrics to " + quoted(run_dir / "metrics.jsonl") + ": " +
                  std::strerror(errno) +
                  ". Free the path (or the disk), or choose another base_output_directory or "
                  "run_name.");
  }
  // A failed save never touches earlier checkpoints; checkpoint_error_policy says whether the
  // run stops (the default) or warns and keeps training. Sharded saves fail on every rank
  // alike (rank 0 names the cause), so every rank stops or goes on.
  int64_t failed_saves = 0;
  auto guarded = [&](const std::function<void()>& f) {
    try {
      try {
        f();
      } catch (const std::bad_alloc&) {
        // The host copy an async save takes of every weight and moment (before: "internal
        // error: std::bad_alloc", exit 1, the policy ignored).
        throw Error(std::string("A checkpoint save ran out of host memory") +
                    (cfg.get_bool("async_checkpointing")
                         ? " for its copy of the weights and moments (async_checkpointing=false "
                           "writes without one)."
                         : "."));
      }
    } catch (const Error& e) {
      if (stop_on_ckpt_error)
        throw Error(
            std::string(e.what()) +
            " The run stops (checkpoint_error_policy=stop); earlier checkpoints are intact.");
      ++failed_saves;
      if (lead)
        std::fprintf(stderr,
                     "\nmt run: warning: a checkpoint save failed and training continues "
                     "(checkpoint_error_policy=continue): %s\n",
                     e.what());
    }
  };
  auto save = [&](int64_t step) {
    // The previous (async) save's failure first, on its own: save() would rethrow it and start
    // nothing, so each failure cost the next checkpoint too and only the first was named.
    guarded([&] { ckpt.wait(); });
    if (parts) {
      part_state.step = step;
      part_state.data_state = data->state();
      part_state.rng_state = state.rng_state;
      part_state.config_yaml = cfg.to_yaml(true);
      guarded([&] { ckpt.save_parts(part_state); });
      return;
    }
    if (!lead) return;
    state.step = step;
    state.data_state = data->state();
    state.config_yaml = cfg.to_yaml(true);
    guarded([&] { ckpt.save(state); });
  };

  // TensorBoard events where MaxText writes them (<run>/tensorboard/<run_name>). The START at the
  // first step makes TensorBoard drop what a killed run wrote after its last checkpoint.
  std::unique_ptr<TensorBoardWriter> tb;
  if (lead && cfg.get_bool("enable_tensorboard") && first_step <= steps) {
    tb = std::make_unique<TensorBoardWriter>(run_dir / "tensorboard" / run_name);
    tb->write_session_start(first_step);
  }
  const bool tty = !quiet && isatty(fileno(stdout));
  std::string shard_note;
  if (opt.sharded()) {
    double mine = 0, whole = 0;
    size_t i = 0;
    for (auto& p : runner.params()) {
      mine += static_cast<double>(opt.m[i].nbytes() + opt.v[i].nbytes());
      whole += static_cast<double>(p.value.numel()) *
               static_cast<double>(dtype_size(opt.m[i].dtype()) + dtype_size(opt.v[i].dtype()));
      ++i;
    }
    shard_note = fmt::format(
        "; optimizer state sharded over them (shard_optimizer_over_data): {} of moments on "
        "each rank instead of {}",
        human_bytes(mine), human_bytes(whole));
  }
  if (fsdp) {
    double mine = 0, whole = 0;
    size_t i = 0;
    for (auto& p : runner.params()) {
      const double per =
          static_cast<double>(dtype_size(p.value.dtype()) + 4 + dtype_size(opt.m[i].dtype()) +
                              dtype_size(opt.v[i].dtype()));
      mine += static_cast<double>(p.value.numel()) * per;
      whole += static_cast<double>(shape_numel(p.spec.shape)) * per;
      ++i;
    }
    shard_note = fmt::format(
        "; parameters divided among {1} (ici_fsdp_parallelism x dcn_fsdp_parallelism = "
        "{0}){2}: {3} of weights, gradients and moments on each rank instead of {4}",
        mesh.fsdp,
        mesh.data > 1 || tp > 1 || xp > 1
            ? fmt::format("the {} ranks of each of {} groups", mesh.fsdp, ranks / mesh.fsdp)
            : fmt::format("all {} ranks", ranks),
        mesh.data > 1 || xp > 1 ? ", each group holding a copy (HSDP)" : "", human_bytes(mine),
        human_bytes(whole));
  }
  if (!quiet) {
    std::printf("mt run: %s (%s family), %s parameters (%s in matmuls), %s\n",
                model_label(cfg).c_str(), cfg.get_string("decoder_block").c_str(),
                human_count(static_cast<double>(counts.total)).c_str(),
                human_count(static_cast<double>(counts.matmul)).c_str(), be.describe().c_str());
    const int64_t tiles = cfg.get_int("num_vocab_tiling");
    std::printf(
        "mt run: attention=%s remat_policy=%s%s dtype=%s weight_dtype=%s data=%s "
        "batch=%ldx%ld accumulation=%ld steps=%ld peak=%.1f TFLOP/s\n",
        runner.attention().name().c_str(), cfg.get_string("remat_policy").c_str(),
        tiles > 1 ? fmt::format(" num_vocab_tiling={}", tiles).c_str() : "",
        dtype_name(runner.compute_dtype()), dtype_name(runner.weight_dtype()), dataset.c_str(),
        static_cast<long>(batch), static_cast<long>(seq), static_cast<long>(accum),
        static_cast<long>(steps), peak / 1e12);
    const std::string hint = precision_hint(runner.compute_dtype(), be.peak_flops(DType::f32),
                                            be.peak_flops(DType::bf16));
    if (!hint.empty()) std::printf("mt run: %s\n", hint.c_str());
    std::printf("mt run: metrics -> %s\n", (run_dir / "metrics.jsonl").string().c_str());
    if (tb) std::printf("mt run: tensorboard -> %s\n", tb->path().parent_path().c_str());
    if (!resumed_from.empty()) std::printf("mt run: %s\n", resumed_from.c_str());
    if (tp > 1) {
      int64_t split = 0, whole = 0;
      for (auto& p : runner.params())  // (the experts under expert parallelism: below)
        if (!p.by_expert) (p.tensor_dim >= 0 ? split : whole) += shape_numel(p.spec.shape);
      shard_note = fmt::format(
          "; tensor parallelism over {} ranks per batch (logical_axis_rules): {} parameters "
          "divided among them, {} whole on each{}",
          tp, human_count(static_cast<double>(split)), human_count(static_cast<double>(whole)),
          shard_note);
    }
    if (xp > 1) {
      int64_t split = 0;
      for (auto& p : runner.params())
        if (p.by_expert) split += shape_numel(p.spec.shape);
      shard_note = fmt::format(
          "; expert parallelism over {} ranks (ici_expert_parallelism x dcn_expert_parallelism): "
          "{} expert parameters divided among {}, each MoE layer sending each token to its "
          "experts' ranks{}{}",
          xp, human_count(static_cast<double>(split)),
          tp > 1 ? fmt::format("them and the {} tensor ranks of each ({} ranks)", tp,
                               mesh.expert_group_ranks())
                 : std::string("them"),
          tp > 1 ? " (each tensor rank a share of its batch)" : "", shard_note);
    }
    if (ranks > 1 && overlap_gradient_sums(runner, dp, &opt))
      shard_note += "; each layer's gradient sum overlaps the backward of the layers below it";
    if (fsdp && runner.fsdp_overlaps())
      shard_note +=
          "; each layer's gathers overlap the layer before it, its reduce-scatters the backward";
    if (ranks > 1)
      std::printf("mt run: %s over %d rank%s (communicator %s): global batch %ld sequences%s\n",
                  fsdp ? "FSDP" : "data parallelism", static_cast<int>(mesh.batch_ranks()),
                  mesh.batch_ranks() == 1 ? "" : "s", comm.name().c_str(),
                  static_cast<long>(batch * accum * mesh.batch_ranks()), shard_note.c_str());
    std::fflush(stdout);
  }

  // A batch as the data plugin hands it over, checked against the contract of mt/data.h: the
  // config's shape, targets beside the inputs (a training stream cycles; it never ends).
  auto check_batch = [&](const HostBatch& hb, bool more, bool eval) {
    const std::string who = "The data plugin '" + dataset + "' (dataset_type=" + dataset + ")";
    if (!more && !eval)
      throw Error(who +
                  " ended its training stream (next() returned false): a training stream cycles "
                  "through its epochs and never ends (mt/data.h).");
    if (!more) return;
    if (hb.batch != batch || hb.seq != seq)
      throw Error(fmt::format(
          "{} gave a {} batch of {} x {} tokens where the config asks for per_device_batch_size "
          "x max_target_length = {} x {}: the loss, tokens/s and MFU would all be of the wrong "
          "batch.",
          who, eval ? "eval" : "training", hb.batch, hb.seq, batch, seq));
    const auto n = static_cast<size_t>(batch * seq);
    if (hb.inputs.size() != n || hb.targets.size() != n)
      throw Error(fmt::format(
          "{} gave a {} batch with {} input and {} target ids for its {} x {} "
          "shape: training needs both, one per position (-1: no target).",
          who, eval ? "eval" : "training", hb.inputs.size(), hb.targets.size(), batch, seq));
  };
  auto eval_loss = [&]() -> double {
    double total = 0, count = 0;
    // eval_steps of a step's batches: with gradient accumulation, that many micro-batches
    // each, so that micro-batching (which mt plan proposes to fit) evaluates the same rows.
    const int64_t eval_batches = eval_steps * accum;
    Progress shown("mt run: evaluating", static_cast<double>(eval_batches), "batches", tty);
    for (int64_t i = 0; i < eval_batches; ++i, shown.add(1)) {
      HostBatch hb;
      const bool more = data->next(hb, /*eval=*/true);
      check_batch(hb, more, /*eval=*/true);
      if (expert_group) {
        // The MoE layers exchange over the expert group: its ranks evaluate together, while every
        // one of them has a batch, and a batch without targets runs too.
        double have = more ? 1 : 0;
        expert_group->all_reduce_sum(&have, 1);
        if (have < expert_group->size()) break;
      } else if (!more) {
        break;
      }
      DeviceBatch db = runner.upload(hb);
      // A batch without targets (the eval set's padding rows) is skipped, unless the forward
      // pass meets other ranks in collectives: the expert exchange, or FSDP's gathers of each
      // layer's weights (before: the FSDP ranks with targets waited forever for the one that
      // skipped).
      if (db.valid_targets == 0 && !expert_group && !sharding.on()) continue;
      Graph g(be, /*record=*/false);
      // With the z-loss, as the training loss and MaxText's eval loss (its xent_sum holds
      // z_loss x log^2 Z per token); before, the eval loss left it out.
      Tensor l = runner.loss(g, db, z_loss);
      float lv = 0;
      be.copy_to_host(l, &lv);
      if (db.valid_targets == 0) continue;
      total += lv * static_cast<double>(db.valid_targets);
      count += static_cast<double>(db.valid_targets);
    }
    double tc[2] = {total, count};  // every data rank's share of the eval set
    dp.all_reduce_sum(tc, 2);
    return tc[1] > 0 ? tc[0] / tc[1] : -1;
  };

  TrainSummary sum;
  sum.run_dir = run_dir.string();
  std::vector<double> tps_hist, step_ms_hist, comm_ms_hist, comm_bytes_hist;
  // Bytes this rank received in collectives, over every communicator it uses.
  auto bytes_received = [&] {
    double b = comm.bytes_received();
    for (const auto* c :
         {&tensor_group, &data_group, &fsdp_group, &replica_group, &expert_group, &expert_replicas})
      if (*c) b += (*c)->bytes_received();
    return b;
  };
  // A stop asked for by SIGINT, SIGTERM or SIGHUP while mt run watches them: the ranks agree at the
  // same point of every step (one small sum), so all stop after the same one; SIGTERM (a
  // scheduler's) names the stop when both arrived.
  const bool watch = watching_stop_signals();
  auto agreed_stop = [&]() -> int {
    if (!watch) return 0;
    const int sig = stop_signal();
    double asked[3] = {sig == SIGINT ? 1.0 : 0.0, sig == SIGTERM ? 1.0 : 0.0,
                       sig == SIGHUP ? 1.0 : 0.0};
    if (ranks > 1) comm.all_reduce_sum(asked, 3);
    return asked[1] > 0 ? SIGTERM : asked[2] > 0 ? SIGHUP : asked[0] > 0 ? SIGINT : 0;
  };
  int64_t end_step = steps;
  bool empty_eval_said = false;
  // A signal during the setup (loading weights, restoring a checkpoint) stops before any step:
  // nothing has changed to save.
  if (first_step <= steps && (sum.stopped_by = agreed_stop()) != 0) end_step = first_step - 1;
  const auto run_start = Clock::now();
  double last_loss = 0;
  if (first_step > steps && !quiet)
    std::printf("mt run: the checkpoint is already at step %ld of steps=%ld; nothing to do.\n",
                static_cast<long>(first_step - 1), static_cast<long>(steps));
  // profile=true reports the steady state: setup and the first (warm-up) step are left out.
  const int64_t profile_from = first_step < steps ? first_step + 1 : first_step;
  // A terminal shows that the first step is under way (it warms up the allocator and kernels,
  // and takes longest); the progress line replaces this when it ends.
  if (tty && first_step <= end_step) {
    std::printf("step %ld of %ld: the first step, which warms up the allocator and kernels...",
                static_cast<long>(first_step), static_cast<long>(steps));
    std::fflush(stdout);
  }
  for (int64_t step = first_step; step <= end_step; ++step) {
    if (step == profile_from) runner.reset_profile();
    const auto t0 = Clock::now();
    const double bytes_before = bytes_received();
    double data_wait = 0;
    std::vector<DeviceBatch> micro;
    for (int64_t a = 0; a < accum; ++a) {
      const auto tw = Clock::now();
      HostBatch hb;
      check_batch(hb, data->next(hb, /*eval=*/false), /*eval=*/false);
      data_wait += seconds_since(tw);
      micro.push_back(runner.upload(hb));
    }
    StepGradients sg = forward_backward(runner, micro, z_loss, &dp, &opt);
    const double loss = sg.loss, grad_norm = sg.grad_norm;
    const std::map<std::string, double>& aux = sg.aux;
    if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
      if (tty) std::printf("\n");
      throw Error(fmt::format(
          "Training stopped at step {}: the {} is {} (loss {}, gradient norm {}). Lower "
          "learning_rate (now {}){}; no parameters were updated at this step.",
          step, std::isfinite(loss) ? "gradient norm" : "loss",
          std::isnan(std::isfinite(loss) ? grad_norm : loss) ? "NaN" : "infinite", loss, grad_norm,
          peak_lr,
          runner.weight_dtype() == DType::f32 ? " or check the data"
                                              : ", check the data, or use weight_dtype=float32"));
    }
    const double lr = schedule.at(step);
    adam.lr = static_cast<float>(lr);
    adam.step = step;
    adam.grad_scale = clip > 0 && grad_norm > clip ? static_cast<float>(clip / grad_norm) : 1.f;
    // MaxText's grad_norm is the norm of the gradients the update used (clipped); the norm
    // before clipping is raw_grad_norm.
    const double clipped_norm = grad_norm * adam.grad_scale;
    const double comm_s =
        sg.communication_s + apply_update(runner, opt, adam, weight_decay, sg.layer_stats, &dp);
    // The step's collectives' bytes (not the checkpoint's or the evaluation's, which follow).
    const double comm_bytes = bytes_received() - bytes_before;
    const int stop = agreed_stop();
    double ckpt_s = 0;
    if (checkpointing && (step % ckpt_period == 0 || step == steps || stop)) {
      save(step);
      ckpt_s = ckpt.last_blocking_seconds();
    } else if (checkpointing) {
      guarded([&] { ckpt.poll(); });  // a sharded save in the background published when done
    }
    be.synchronize();
    const double step_s = seconds_since(t0);
    // Every rank's tokens; TFLOP/s and MFU per device (each rank drives one).
    // (Tensor ranks share their group's tokens.)
    const double tokens = static_cast<double>(batch * seq * accum * mesh.batch_ranks());
    const double tps = tokens / step_s;
    const double tflops = tps * flops_per_token / ranks / 1e12;
    const double mfu = tps * flops_per_token / (ranks * peak);
    // A share above 100% means the peak is wrong: said once, naming where the peak came from.
    if (mfu > 1.0 && !mfu_above_one_said && lead && step >= first_step + kUntimedSteps) {
      mfu_above_one_said = true;
      std::fprintf(
          stderr,
          "\nmt run: warning: step %ld ran %.4g TFLOP/s per device, more than the peak of %.4g "
          "TFLOP/s that MFU is measured against (%s), so the MFU figures read above 100%%. %s\n",
          static_cast<long>(step), tflops, peak / 1e12,
          peak_set ? "device_peak_tflops" : "the backend's measured peak",
          peak_set ? "Set device_peak_tflops to the device's real peak, or 0 for the backend's."
                   : "Set device_peak_tflops to the device's real peak.");
    }
    if (step >= first_step + kUntimedSteps) {  // the first steps warm up (kUntimedSteps)
      tps_hist.push_back(tps);
      step_ms_hist.push_back(step_s * 1e3);
      comm_ms_hist.push_back(comm_s * 1e3);
      comm_bytes_hist.push_back(comm_bytes);
      // The run's length on this machine, from its first timed step, when it is a minute or
      // more (a terminal's progress line carries a live ETA instead).
      const double left = step_s * static_cast<double>(steps - step);
      if (step == first_step + kUntimedSteps && left >= 60 && !quiet && !tty) {
        std::printf(
            "mt run: %.3g s a step on this machine: the remaining %ld steps take about %s "
            "(evaluations and checkpoints extra)\n",
            step_s, static_cast<long>(steps - step),
            left < 120 ? fmt::format("{:.0f} s", left).c_str()
                       : fmt::format("{:.0f} min", left / 60).c_str());
      }
    }
    last_loss = loss;
    sum.tokens += static_cast<int64_t>(tokens);
    double ev = -1;
    if (eval_interval > 0 && (step % eval_interval == 0 || step == steps)) ev = eval_loss();
    if (ev >= 0) sum.final_eval_loss = ev;
    // An evaluation of no target (a data plugin with no eval stream) is said once, not left out
    // of the metrics silently.
    if (ev < 0 && eval_interval > 0 && (step % eval_interval == 0 || step == steps) &&
        !empty_eval_said && lead) {
      empty_eval_said = true;
      std::fprintf(stderr,
                   "\nmt run: warning: the evaluation at step %ld found no eval target: the data "
                   "plugin '%s' gives no eval batch with a target, so no eval_loss is logged. "
                   "Give it eval data, or set eval_interval=-1.\n",
                   static_cast<long>(step), dataset.c_str());
    }
    const MemoryStats ms = be.memory_stats();
    if (lead)
      metrics << fmt::format(
          "{{\"step\": {}, \"loss\": {:.9g}, \"learning_rate\": {:.6g}, \"grad_norm\": {:.6g}, "
          "\"raw_grad_norm\": {:.6g}, \"total_weights\": {}, "
          "\"tokens_per_sec\": {:.2f}, \"tflops_per_device\": {:.5f}, \"mfu\": {:.5f}, "
          "\"step_time_ms\": {:.2f}, \"data_wait_ms\": {:.3f}, \"checkpoint_ms\": {:.3f}, "
          "\"peak_memory_mb\": {:.1f}, \"system_allocs\": {}{}{}{}}}\n",
          step, loss, lr, clipped_norm, grad_norm, sg.valid_targets, tps, tflops, mfu, step_s * 1e3,
          data_wait * 1e3, ckpt_s * 1e3, static_cast<double>(ms.peak_bytes_in_use) / 1e6,
          ms.num_system_allocs,
          ranks > 1 ? fmt::format(", \"communication_ms\": {:.3f}, \"communication_bytes\": {:.0f}",
                                  comm_s * 1e3, comm_bytes)
                    : "",
          aux_fields(aux), ev >= 0 ? fmt::format(", \"eval_loss\": {:.6f}", ev) : "");
    // Each record reaches the file at once: a killed run keeps the lines of the steps it
    // checkpointed, so a resumed run leaves no gap. A record that cannot be written (a full
    // disk) is a failed write like a checkpoint's, under checkpoint_error_policy (before: the
    // file ended mid-record and the run said nothing, exit 0).
    metrics.flush();
    if (lead && !metrics && !metrics_failed) {
      metrics_failed = true;
      const std::string why =
          fmt::format("Writing {} failed at step {} ({}): its records from there are lost.",
                      quoted(run_dir / "metrics.jsonl"), step, std::strerror(errno));
      if (stop_on_ckpt_error) throw Error(why + " The run stops (checkpoint_error_policy=stop).");
      std::fprintf(stderr,
                   "\nmt run: warning: %s Training goes on "
                   "(checkpoint_error_policy=continue).\n",
                   why.c_str());
    }
    if (tb) {  // MaxText's tags (perf/mfu: mt's own)
      tensorboard::Scalars sc = {{"learning/loss", loss},
                                 {"learning/current_learning_rate", lr},
                                 {"learning/grad_norm", clipped_norm},
                                 {"learning/raw_grad_norm", grad_norm},
                                 {"learning/total_weights", static_cast<double>(sg.valid_targets)},
                                 {"perf/step_time_seconds", step_s},
                                 {"perf/per_device_tokens_per_sec", tps / ranks},
                                 {"perf/per_device_tflops_per_sec", tflops},
                                 {"perf/mfu", mfu}};
      for (const auto& [name, v] : aux) sc.emplace_back("learning/" + name, v);
      if (ev >= 0) sc.emplace_back("eval/avg_loss", ev);
      tb->write_scalars(step, sc);
    }
    if (!quiet) {
      const double eta =
          seconds_since(run_start) / static_cast<double>(step) * static_cast<double>(steps - step);
      if (tty) {
        std::printf("%s", progress_bar(step, steps, eta, loss, tps, mfu).c_str());
        if (ev >= 0) std::printf("\n  step %ld eval loss %.4f\n", static_cast<long>(step), ev);
      } else if (step % log_period == 0 || step == 1 || step == steps || ev >= 0) {
        std::printf(
            "step %5ld  loss %.4f  lr %.3g  grad_norm %.3f%s  %.0f tok/s  %.4f TFLOP/s  "
            "MFU %.1f%%  %.0f ms%s\n",
            static_cast<long>(step), loss, lr, grad_norm,
            adam.grad_scale < 1.f ? fmt::format(" (clipped to {:.3g})", clipped_norm).c_str() : "",
            tps, tflops, 100 * mfu, step_s * 1e3,
            ev >= 0 ? fmt::format("  eval_loss {:.4f}", ev).c_str() : "");
      }
      std::fflush(stdout);
    }
    if (stop) {
      sum.stopped_by = stop;
      end_step = step;
      break;
    }
  }
  metrics.flush();
  if (checkpointing) guarded([&] { ckpt.wait(); });
  if (sum.stopped_by && checkpointing && lead) sum.last_checkpoint = ckpt.latest_step();
  sum.failed_checkpoints = failed_saves;
  if (tty) std::printf("\n");
  if (runner.profiler() && lead) {
    std::fprintf(quiet ? stderr : stdout, "mt: time per op over steps %ld..%ld%s:\n%s",
                 static_cast<long>(profile_from), static_cast<long>(end_step),
                 profile_from > first_step ? " (setup and the warm-up step left out)" : "",
                 runner.profiler()->report().c_str());
  }
  // Where the run is: the stop's step, the checkpoint's when it was at or past steps already.
  sum.steps = sum.stopped_by ? end_step : std::max(steps, first_step - 1);
  sum.checkpoint_seconds = ckpt.total_blocking_seconds();
  sum.final_loss = last_loss;
  sum.timed_steps = static_cast<int64_t>(tps_hist.size());
  sum.tokens_per_sec = median(tps_hist);
  sum.step_time_ms = median(step_ms_hist);
  sum.communication_ms = median(comm_ms_hist);
  sum.communication_bytes = median(comm_bytes_hist);
  sum.tflops_per_device = sum.tokens_per_sec * flops_per_token / ranks / 1e12;
  sum.mfu = sum.tokens_per_sec * flops_per_token / (ranks * peak);
  return sum;
}

}  // namespace mt
