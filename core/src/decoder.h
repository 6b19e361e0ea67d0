// Autoregressive decoding (MaxText's decode.py): per-layer KV caches preallocated for
// max_target_length, prefill of each prompt, then batched one-token steps with sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model_runner.h"
#include "mt/capture.h"
#include "mt/config.h"

namespace mt {

struct SamplingParams {
  enum class Strategy : uint8_t { greedy, weighted, top_k, nucleus };
  Strategy strategy = Strategy::greedy;
  float temperature = 1.f;
  int64_t top_k = 0;
  float top_p = 1.f;
  uint64_t seed = 0;
};
// From decode_sampling_strategy, decode_sampling_temperature, decode_sampling_top_k,
// decode_sampling_nucleus_p, decode_sampling_seed.
SamplingParams sampling_from_config(const Config& cfg);

// Draws a token from logits [V] (host). Deterministic for a given generator state.
int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p,
                     std::mt19937_64& rng);

// A decode step is many small ops (about a dozen per layer) on a batch of one token per
// sequence: on a GPU, launching them costs more than running them. Where the backend can record
// its work (Backend::extension(kWorkCapture): CUDA graphs), the decoder runs its first step as it
// comes, records the second (every step has the same shapes, and its inputs live in tensors the
// decoder keeps and refills), and replays that recording for every step after. A model whose
// step cannot be recorded (one that reads device data on the host: MoE routing) runs every step
// as it comes; step_recording() says which and why. MT_DECODE_RECORDING=0 turns it off.
// The recording reads the runner's parameters where they were when it was made: the parameters
// must not be replaced (transpose_projections, quantize_projections) while a Decoder lives.
class Decoder {
 public:
  // Caches for `batch` sequences of up to `max_len` tokens each.
  Decoder(ModelRunner& runner, int64_t batch, int64_t max_len);
  ~Decoder();
  Decoder(const Decoder&) = delete;
  Decoder& operator=(const Decoder&) = delete;

  int64_t batch() const { return batch_; }
  int64_t max_len() const { return max_len_; }
  int64_t length(int64_t b) const { return lengths_[static_cast<size_t>(b)]; }
  bool full(int64_t b) const { return length(b) >= max_len_; }
  // For a memory plan's trace on the meta backend: every sequence as if `length` (< max_len)
  // tokens were cached, so that the next step is the one at that length (the rows hold whatever
  // the cache holds). A step's memory can grow with the cached length (an int8 cache's
  // dequantized rows, tables made up to the longest position).
  void assume_length(int64_t length);
  // Cache rows per sequence of layer i (its window for a sliding-window ring buffer, else
  // max_len).
  int64_t cache_rows(int layer) const {
    return groups_[layer_group_[static_cast<size_t>(layer)]].rows;
  }

  // Empties every cache.
  void reset();
  // Runs sequence b's prompt through the model, filling its caches; returns the logits of every
  // prompt position [T * V] (host, f32), or with `last_only` those of the last position [V]
  // (what sampling needs: the LM head then runs on one position instead of T).
  std::vector<float> prefill(int64_t b, const std::vector<int32_t>& prompt, bool last_only = false);
  // One token for every sequence (tokens[b]); sequences marked done in `active` (or full) are
  // not advanced. Returns logits [B * V] (host, f32).
  std::vector<float> step(const std::vector<int32_t>& tokens, const std::vector<bool>& active);

  // Whether steps are recorded and replayed (see above): false turns it off for this decoder
  // (before its second step; tests compare both ways).
  void set_recording(bool on) { record_ = on; }
  // "" before the second step; "recorded" when steps replay a recording; else why not.
  const std::string& step_recording() const { return recording_status_; }

 private:
  // Layers whose caches have the same number of rows share the bookkeeping of a call (which row
  // each new token goes to, how many rows are valid).
  struct Group {
    // Rows per sequence: max_len, or the layer's sliding window when that is shorter (a ring
    // buffer: the token at position p lives in row p % rows).
    int64_t rows = 0;
    bool ring = false;
    int64_t row_of(int64_t pos) const { return ring ? pos % rows : pos; }
  };

  // One step's forward on the inputs below: logits [B, 1, V] f32 on the backend.
  Tensor run_step();
  // Records run_step (the step's work) when the backend can; sets recording_status_.
  void try_recording();

  ModelRunner& runner_;
  int64_t batch_, max_len_, vocab_;
  std::vector<Group> groups_;
  std::vector<size_t> layer_group_;
  std::vector<KVCache> caches_;
  std::vector<int64_t> lengths_;
  // A step's inputs, refilled in place each step (a recording reads them where they are):
  // tokens and positions [B, 1], and per group the cache row each token goes to and the valid
  // rows [B].
  Tensor step_tokens_, step_positions_;
  std::vector<Tensor> step_rows_, step_lengths_;
  bool record_ = true;
  int64_t steps_ = 0;
  std::string recording_status_;
  Tensor recorded_logits_;  // what the recording writes
  std::unique_ptr<CapturedWork> recorded_;
};

struct GenerateResult {
  std::vector<std::vector<int32_t>> tokens;  // generated tokens per prompt (prompt excluded)
  int64_t prefill_tokens = 0, decoded_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Prefills every prompt, then decodes until each sequence emits `eos` (when >= 0) or reaches
// max_len tokens in total. on_token(b, id) is called as each token is chosen (streaming).
GenerateResult generate(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_len, const SamplingParams& sampling, int32_t eos,
                        const std::function<void(int64_t, int32_t)>& on_token = {});
// The same, stopping at any of `stop_ids` (generation_config.json may name several).
GenerateResult generate(ModelRunner& runner, const std::vector<std::vector<int32_t>>& prompts,
                        int64_t max_len, const SamplingParams& sampling,
                        const std::vector<int32_t>& stop_ids,
                        const std::function<void(int64_t, int32_t)>& on_token = {});

}  // namespace mt
