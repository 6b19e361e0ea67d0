#include "decoder.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string>

#include "mt/env.h"
#include "mt/error.h"
#include "mt/graph.h"

namespace mt {

SamplingParams sampling_from_config(const Config& cfg) {
  SamplingParams p;
  const std::string s = cfg.get_string("decode_sampling_strategy");
  if (s == "greedy")
    p.strategy = SamplingParams::Strategy::greedy;
  else if (s == "weighted")
    p.strategy = SamplingParams::Strategy::weighted;
  else if (s == "top_k" || s == "topk")
    p.strategy = SamplingParams::Strategy::top_k;  // topk: MaxText
  else if (s == "nucleus")
    p.strategy = SamplingParams::Strategy::nucleus;
  else
    cfg.reject("decode_sampling_strategy", "must be greedy, weighted, top_k or nucleus.");
  p.temperature = static_cast<float>(cfg.get_float("decode_sampling_temperature"));
  p.top_k = cfg.get_int("decode_sampling_top_k");
  p.top_p = static_cast<float>(cfg.get_float("decode_sampling_nucleus_p"));
  p.seed = static_cast<uint64_t>(cfg.get_int("decode_sampling_seed"));
  if (p.strategy != SamplingParams::Strategy::greedy && !(p.temperature > 0))
    cfg.reject("decode_sampling_temperature", "must be greater than 0 for sampling.");
  if (p.strategy == SamplingParams::Strategy::nucleus && !(p.top_p > 0 && p.top_p <= 1))
    cfg.reject("decode_sampling_nucleus_p", "must be in (0, 1].");
  return p;
}

int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p,
                     std::mt19937_64& rng) {
  // NaN or +inf logits have no softmax to choose from (before: greedy took id 0 every step,
  // the samplers a fixed id, exit 0; and a NaN breaks the sort's ordering).
  for (int64_t i = 0; i < vocab; ++i)
    if (!(logits[i] < std::numeric_limits<float>::infinity()))
      throw Error(
          "The model's logits are not finite (NaN or +inf at token id " + std::to_string(i) +
          "), so no next token can be chosen: its weights, or what they compute, hold non-finite "
          "values. mt score on the same checkpoint reports the loss; a checkpoint written by "
          "mt run never holds them (a non-finite step stops the run).");
  if (p.strategy == SamplingParams::Strategy::greedy)
    return static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
  // Candidates in descending logit order (ties: lower id first), cut by top-k.
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  std::iota(idx.begin(), idx.end(), 0);
  int64_t keep = vocab;
  if (p.strategy == SamplingParams::Strategy::top_k && p.top_k > 0) keep = std::min(vocab, p.top_k);
  auto by_logit = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  if (keep < vocab) {
    std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), by_logit);
    idx.resize(static_cast<size_t>(keep));
  } else {
    std::sort(idx.begin(), idx.end(), by_logit);
  }
  std::vector<double> prob(idx.size());
  const double mx = logits[idx[0]];
  double total = 0;
  for (size_t i = 0; i < idx.size(); ++i) {
    prob[i] = std::exp((static_cast<double>(logits[idx[i]]) - mx) / p.temperature);
    total += prob[i];
  }
  size_t n = idx.size();
  if (p.strategy == SamplingParams::Strategy::nucleus) {
    // The smallest prefix whose probability reaches top_p.
    double cum = 0;
    for (size_t i = 0; i < idx.size(); ++i) {
      cum += prob[i] / total;
      if (cum >= p.top_p) {
        n = i + 1;
        break;
      }
    }
    total = std::accumulate(prob.begin(), prob.begin() + static_cast<ptrdiff_t>(n), 0.0);
  }
  // A uniform draw from 53 random bits: the same on every standard library.
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double cum = 0;
  for (size_t i = 0; i < n; ++i) {
    cum += prob[i];
    if (u < cum) return idx[i];
  }
  return idx[n - 1];
}

Decoder::Decoder(ModelRunner& runner, int64_t batch, int64_t max_len)
    : runner_(runner), batch_(batch), max_len_(max_len), vocab_(runner.model().dims().vocab_size) {
  Backend& be = runner.backend();
  // One extra row per sequence: the sink where finished sequences (and prompt tokens a ring
  // overwrites within the same call) write their ignored entries.
  for (const CacheSpec& spec : runner.cache_specs()) {
    Group grp;
    grp.ring = spec.window > 0 && spec.window < max_len;
    grp.rows = grp.ring ? spec.window : max_len;
    size_t gi = 0;
    while (gi < groups_.size() && groups_[gi].rows != grp.rows) ++gi;
    if (gi == groups_.size()) groups_.push_back(grp);
    layer_group_.push_back(gi);
    KVCache c;
    c.window = spec.window;
    c.derived = std::make_shared<std::map<std::string, Tensor>>();
    const KvCacheQuant& kq = runner.kv_cache_quant();
    for (const Shape& entry : spec.entries) {
      Shape shape{batch, grp.rows + 1};
      shape.insert(shape.end(), entry.begin(), entry.end());
      if (!kq.on) {
        c.tensors.push_back(be.empty(shape, runner.compute_dtype()));
        continue;
      }
      // quantize_kvcache: int8 rows, and a scale per head (kv_quant_axis=dkv, an entry of
      // [heads, features]) or per token (heads_and_dkv).
      c.tensors.push_back(be.empty(shape, DType::i8));
      const int64_t groups = kq.per_head && entry.size() >= 2 ? entry[0] : 1;
      c.scales.push_back(be.empty({batch, grp.rows + 1, groups}, DType::f32));
    }
    caches_.push_back(std::move(c));
  }
  lengths_.assign(static_cast<size_t>(batch), 0);
  step_tokens_ = be.empty({batch, 1}, DType::i32);
  step_positions_ = be.empty({batch, 1}, DType::i32);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    step_rows_.push_back(be.empty({batch}, DType::i32));
    step_lengths_.push_back(be.empty({batch}, DType::i32));
  }
  for (size_t i = 0; i < caches_.size(); ++i) {
    caches_[i].lengths = step_lengths_[layer_group_[i]];
    caches_[i].write_rows = step_rows_[layer_group_[i]];
    caches_[i].fresh = false;
  }
  if (!env_switch("MT_DECODE_RECORDING", true,
                  "decode runs every step's ops as they come (0) or records a step once and "
                  "replays it where the backend can (1)"))
    record_ = false;
  reset();
}

// The recording goes first: it holds device memory of the backend's (and reads the caches).
Decoder::~Decoder() {
  recorded_.reset();
}

void Decoder::reset() {
  for (auto& c : caches_)
    for (auto& t : c.scales.empty() ? c.tensors : c.scales) runner_.backend().fill(t, 0.f);
  std::fill(lengths_.begin(), lengths_.end(), 0);
}

std::vector<float> Decoder::prefill(int64_t b, const std::vector<int32_t>& prompt, bool last_only) {
  Backend& be = runner_.backend();
  const auto t = static_cast<int64_t>(prompt.size());
  MT_CHECK(b >= 0 && b < batch_,
           "prefill: sequence " + std::to_string(b) + " of " + std::to_string(batch_));
  if (t == 0) throw UsageError("Cannot decode from an empty prompt: it needs at least one token.");
  if (length(b) + t > max_len_)
    throw UsageError("The prompt has " + std::to_string(t) +
                     " tokens, more than max_target_length=" + std::to_string(max_len_) +
                     " allows; raise max_target_length.");
  for (auto id : prompt)
    if (id < 0 || id >= vocab_)
      throw UsageError("Token id " + std::to_string(id) +
                       " is outside the model's vocabulary [0, " + std::to_string(vocab_) + ").");
  const int64_t start = length(b);
  for (const Group& grp : groups_)
    if (grp.ring && start > 0)
      throw Error("A sliding-window cache is prefilled once per sequence; this one holds " +
                  std::to_string(start) + " tokens already.");
  std::vector<int32_t> pos(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>(start + i);
  Tensor tokens = be.empty({1, t}, DType::i32), positions = be.empty({1, t}, DType::i32);
  be.copy_from_host(tokens, prompt.data());
  be.copy_from_host(positions, pos.data());
  // Each group's rows for the new tokens, within sequence b's view; a ring keeps only the
  // prompt's last `rows` tokens (the others go to the sink row).
  std::vector<Tensor> write_rows, lengths;
  for (const Group& grp : groups_) {
    std::vector<int32_t> rows(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) {
      const bool kept = !grp.ring || i >= t - grp.rows;
      rows[static_cast<size_t>(i)] = static_cast<int32_t>(kept ? grp.row_of(start + i) : grp.rows);
    }
    const auto len = static_cast<int32_t>(std::min(start + t, grp.rows));
    Tensor wr = be.empty({t}, DType::i32), l = be.empty({1}, DType::i32);
    be.copy_from_host(wr, rows.data());
    be.copy_from_host(l, &len);
    write_rows.push_back(wr);
    lengths.push_back(l);
  }
  // Sequence b's rows of every cache, as a batch of one.
  std::vector<KVCache> views;
  for (size_t i = 0; i < caches_.size(); ++i) {
    KVCache v;
    for (const auto& tensor : caches_[i].tensors) v.tensors.push_back(tensor.slice0(b, b + 1));
    for (const auto& tensor : caches_[i].scales) v.scales.push_back(tensor.slice0(b, b + 1));
    v.window = caches_[i].window;
    v.derived = caches_[i].derived;
    v.lengths = lengths[layer_group_[i]];
    v.write_rows = write_rows[layer_group_[i]];
    v.fresh = start == 0;
    views.push_back(std::move(v));
  }
  Graph g(be, /*record=*/false);
  Tensor logits = runner_.forward_cached(g, tokens, positions, views, last_only);
  lengths_[static_cast<size_t>(b)] = start + t;
  std::vector<float> out(static_cast<size_t>(logits.numel()));
  Tensor f = logits;
  if (f.dtype() != DType::f32) {
    f = be.empty(logits.shape(), DType::f32);
    be.cast(logits, f);
  }
  be.copy_to_host(f, out.data());
  return out;
}

void Decoder::assume_length(int64_t length) {
  MT_CHECK(length >= 0 && length < max_len_, "assume_length: " + std::to_string(length) +
                                                 " outside [0, " + std::to_string(max_len_) + ")");
  std::fill(lengths_.begin(), lengths_.end(), length);
}

std::vector<float> Decoder::step(const std::vector<int32_t>& tokens,
                                 const std::vector<bool>& active) {
  Backend& be = runner_.backend();
  MT_CHECK(static_cast<int64_t>(tokens.size()) == batch_, "step: one token per sequence");
  std::vector<int32_t> pos(static_cast<size_t>(batch_)), toks(tokens);
  for (int64_t b = 0; b < batch_; ++b) {
    const auto ub = static_cast<size_t>(b);
    const bool go = active[ub] && !full(b);
    if (toks[ub] < 0 || toks[ub] >= vocab_) toks[ub] = 0;
    pos[ub] = static_cast<int32_t>(go ? lengths_[ub] : std::max<int64_t>(0, lengths_[ub] - 1));
  }
  be.copy_from_host(step_tokens_, toks.data());
  be.copy_from_host(step_positions_, pos.data());
  // A step that is recorded, or replays a recording, reads every cache row (its shapes are
  // fixed); others read up to the longest sequence's rows (an int8 cache widens only those).
  const bool recording_next = !recorded_ && steps_ == 1 && record_ && recording_status_.empty();
  const bool every_row = recorded_ || recording_next;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const Group& grp = groups_[gi];
    std::vector<int32_t> rows(static_cast<size_t>(batch_)), lens(static_cast<size_t>(batch_));
    const int64_t stride = grp.rows + 1;
    for (int64_t b = 0; b < batch_; ++b) {
      const auto ub = static_cast<size_t>(b);
      const bool go = active[ub] && !full(b);
      // The next row, or the sink for a sequence that is not advanced.
      rows[ub] = static_cast<int32_t>(b * stride + (go ? grp.row_of(lengths_[ub]) : grp.rows));
      // Valid rows: in a ring, every row is within the window of the newest token, and softmax
      // does not care about their order.
      lens[ub] = static_cast<int32_t>(std::min(lengths_[ub] + (go ? 1 : 0), grp.rows));
      if (lens[ub] == 0) lens[ub] = 1;  // an empty sequence attends to its (sink-free) first row
    }
    be.copy_from_host(step_rows_[gi], rows.data());
    be.copy_from_host(step_lengths_[gi], lens.data());
    const int64_t longest = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
    for (size_t i = 0; i < caches_.size(); ++i)
      if (layer_group_[i] == gi) caches_[i].read_rows = every_row ? 0 : longest;
  }
  // The first step runs as it comes (it also makes what later steps reuse: GEMM plans, rope
  // tables, derived weights); the second is recorded when the backend can.
  if (!recorded_ && steps_ == 1 && record_ && recording_status_.empty()) try_recording();
  ++steps_;
  Tensor f;
  if (recorded_) {
    recorded_->replay();
    f = recorded_logits_;
  } else {
    f = run_step();
  }
  for (int64_t b = 0; b < batch_; ++b)
    if (active[static_cast<size_t>(b)] && !full(b)) ++lengths_[static_cast<size_t>(b)];
  std::vector<float> out(static_cast<size_t>(batch_ * vocab_));
  be.copy_to_host(f, out.data());
  return out;
}

Tensor Decoder::run_step() {
  Backend& be = runner_.backend();
  Graph g(be, /*record=*/false);
  Tensor logits = runner_.forward_cached(g, step_tokens_, step_positions_, caches_);
  if (logits.dtype() == DType::f32) return logits;
  Tensor f = be.empty(logits.shape(), DType::f32);
  be.cast(logits, f);
  return f;
}

void Decoder::try_recording() {
  if (runner_.profiler()) {  // it times each op, waiting for the device after each
    recording_status_ = "not recorded: profile=true times each op";
    return;
  }
  auto* capture = static_cast<WorkCapture*>(runner_.backend().extension(kWorkCapture));
  if (!capture) {
    recording_status_ = "not recorded: the " + runner_.backend().name() +
                        " backend runs each op as it comes (no mt.work_capture)";
    return;
  }
  try {
    capture->begin();
    Tensor logits = run_step();
    recorded_ = capture->end();
    recorded_logits_ = logits;
    recording_status_ = "recorded";
  } catch (const Error& e) {
    // Nothing ran while recording: this step and the later ones run as they come.
    capture->abandon();
    recorded_.reset();
    recording_status_ = std::string("not recorded: ") + e.what();
  } catch (...) {
    capture->abandon();
    throw;
  }
}

GenerateResult generate(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_len, const SamplingParams& sampling, int32_t eos,
                        const std::function<void(int64_t, int32_t)>& on_token) {
  return generate(runner, prompts, max_len, sampling,
                  eos >= 0 ? std::vector<int32_t>{eos} : std::vector<int32_t>{}, on_token);
}

GenerateResult generate(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_len, const SamplingParams& sampling,
                        const std::vector<int32_t>& stop_ids,
                        const std::function<void(int64_t, int32_t)>& on_token) {
  auto is_stop = [&stop_ids](int32_t id) {
    return std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end();
  };
  using Clock = std::chrono::steady_clock;
  const auto batch = static_cast<int64_t>(prompts.size());
  // max_target_length bounds a prompt and its continuation: a prompt of max_len tokens has no
  // room for one more (before: it got one, max_len + 1 in all).
  for (const auto& p : prompts)
    if (static_cast<int64_t>(p.size()) >= max_len)
      throw UsageError("A prompt has " + std::to_string(p.size()) +
                       " tokens, and max_target_length=" + std::to_string(max_len) +
                       " (the prompt and its continuation) leaves no room for a generated token; "
                       "raise max_target_length above " +
                       std::to_string(p.size()) + ".");
  Decoder dec(runner, batch, max_len);
  const int64_t vocab = runner.model().dims().vocab_size;
  GenerateResult r;
  r.tokens.resize(prompts.size());
  // Row b's generator: the seed itself for row 0 (a one-prompt decode is row 0 of any batch), a
  // hash of (seed, b) for the others (before: seed + b, so seed 0's rows 1-3 were seed 1's rows
  // 0-2, and runs over nearby seeds repeated each other's draws).
  auto row_seed = [&](uint64_t b) {
    if (b == 0) return static_cast<uint64_t>(sampling.seed);
    uint64_t z = static_cast<uint64_t>(sampling.seed) * 0x9E3779B97F4A7C15ull + b;  // splitmix64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  std::vector<std::mt19937_64> rngs;
  for (int64_t b = 0; b < batch; ++b) rngs.emplace_back(row_seed(static_cast<uint64_t>(b)));
  std::vector<int32_t> next(prompts.size());
  std::vector<bool> active(prompts.size(), true);
  auto t0 = Clock::now();
  for (int64_t b = 0; b < batch; ++b) {
    const auto ub = static_cast<size_t>(b);
    std::vector<float> logits = dec.prefill(b, prompts[ub], /*last_only=*/true);
    r.prefill_tokens += static_cast<int64_t>(prompts[ub].size());
    next[ub] = sample_token(logits.data(), vocab, sampling, rngs[ub]);
    r.tokens[ub].push_back(next[ub]);
    if (on_token) on_token(b, next[ub]);
    // A sequence holds at most max_len tokens: its cached ones plus the one just chosen.
    if (is_stop(next[ub]) || dec.length(b) + 1 >= max_len) active[ub] = false;
  }
  r.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  while (std::any_of(active.begin(), active.end(), [](bool a) { return a; })) {
    std::vector<float> logits = dec.step(next, active);
    for (int64_t b = 0; b < batch; ++b) {
      const auto ub = static_cast<size_t>(b);
      if (!active[ub]) continue;
      ++r.decoded_tokens;
      next[ub] = sample_token(logits.data() + b * vocab, vocab, sampling, rngs[ub]);
      r.tokens[ub].push_back(next[ub]);
      if (on_token) on_token(b, next[ub]);
      if (is_stop(next[ub]) || dec.length(b) + 1 >= max_len) active[ub] = false;
    }
  }
  r.decode_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return r;
}

}  // namespace mt
