// Backend: memory and the kernels of mt's op set, one implementation per hardware plugin.
//
// Conventions for every kernel below (the op set, version MT_OPSET_VERSION):
// - Tensors are row-major and contiguous. "[N, D]" means: D is the last dimension and N is the
//   product of all the others, so any leading shape is accepted.
// - Floating tensors may be f32 or bf16, each independently; arithmetic is always in f32
//   (bf16 is storage only). Index tensors are i32. Saved statistics (rstd, lse, ...) are f32.
// - Forward kernels overwrite their outputs. Backward kernels ACCUMULATE (+=) into every gradient
//   they write, so gradient accumulation and residual branches need no extra adds; callers zero
//   gradient buffers first.
// - Results are deterministic for a fixed thread count: no reduction order may depend on
//   scheduling.
// - A kernel handed shapes or dtypes it does not support throws mt::Error naming the op and the
//   shapes; it never reads out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mt/export.h"
#include "mt/tensor.h"

#define MT_OPSET_VERSION 2  // 2: the op set the SDK v2 families need (see version.h)

namespace mt {

class Config;

enum class Activation : uint8_t { silu, gelu_tanh, gelu_exact, relu };

struct RopeSpec {
  enum class Type : uint8_t { standard, llama3, yarn };
  Type type = Type::standard;
  float theta = 10000.f;  // rope_max_timescale
  int rotary_dim = 0;     // rotate the first rotary_dim features of each head; 0 = all of head_dim
  // Pairing: false = Hugging Face "rotate_half" (feature i pairs with i + rotary_dim/2);
  // true = interleaved (2i pairs with 2i+1).
  bool interleaved = false;
  // Llama 3.1 frequency scaling (type llama3) and YaRN (type yarn): scaling factor and the
  // original context length the model was trained with.
  float factor = 1.f;
  int64_t original_max_position = 8192;
  float low_freq_factor = 1.f;   // llama3
  float high_freq_factor = 4.f;  // llama3
  float beta_fast = 32.f;        // yarn
  float beta_slow = 1.f;         // yarn
  float attention_factor = 0.f;  // yarn: multiplies cos and sin; 0 = 0.1 * ln(factor) + 1

  bool operator==(const RopeSpec&) const = default;  // every field (NaN never equal)
};

// The inverse frequencies [rotary_dim / 2] of a rope spec, computed as Hugging Face does (in
// double, stored as f32), and the factor cos and sin are multiplied by (YaRN's attention factor;
// 1 otherwise). Every backend rotates with these, so their results agree.
struct RopeFrequencies {
  std::vector<float> inv_freq;
  double mscale = 1.0;
};
MT_API RopeFrequencies rope_frequencies(const RopeSpec& spec, int64_t rotary_dim);

struct AdamWParams {
  float lr = 0.f;
  float b1 = 0.9f;
  float b2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.f;  // decoupled: p -= lr * wd * p
  int64_t step = 1;          // 1-based, for bias correction
  float grad_scale = 1.f;    // multiplies the gradient first (clipping, 1/accumulation)
};

// What a backend's out-of-memory error ends with: the settings a user can change.
inline constexpr const char* kOutOfMemoryAdvice =
    "Lower per_device_batch_size or max_target_length, recompute activations in the backward "
    "pass (remat_policy=full), or split each batch into micro-batches with "
    "gradient_accumulation_steps.";

// No allocation is larger: sizes past it come from overflowing arithmetic or absurd configs,
// and an allocator refuses them before doing anything with them.
inline constexpr size_t kMaxAllocationBytes = size_t{1} << 60;

struct MemoryStats {
  size_t bytes_in_use = 0;  // handed out to live tensors
  size_t peak_bytes_in_use = 0;
  size_t bytes_cached = 0;       // held by the caching allocator, free for reuse
  size_t num_system_allocs = 0;  // calls to the system allocator since start
};

class MT_API Backend {
 public:
  virtual ~Backend();

  // ---- identity ---------------------------------------------------------------------------
  virtual std::string name() const = 0;  // "cpu", "cuda"
  // One line for `mt plugins` and the run's first lines: ISA, GEMM path, threads, device.
  virtual std::string describe() const = 0;
  // Peak dense FLOP/s of one device for matmuls of this dtype (for MFU).
  virtual double peak_flops(DType dtype) const = 0;

  // ---- memory -----------------------------------------------------------------------------
  // Uninitialised tensor from the caching allocator.
  virtual Tensor empty(const Shape& shape, DType dtype) = 0;
  Tensor zeros(const Shape& shape, DType dtype);
  // Called by Storage's destructor: return a block to the allocator.
  virtual void release(void* data, size_t bytes) = 0;
  virtual void copy_from_host(Tensor& dst, const void* src) = 0;  // dst.nbytes() bytes
  virtual void copy_to_host(const Tensor& src, void* dst) = 0;    // src.nbytes() bytes
  virtual void synchronize() {}
  virtual MemoryStats memory_stats() const = 0;
  virtual void reset_peak_memory() = 0;

  // ---- elementwise ------------------------------------------------------------------------
  virtual void fill(Tensor& x, float value) = 0;
  // dst = src with conversion (f32 <-> bf16, or a plain copy); same element count.
  virtual void cast(const Tensor& src, Tensor& dst) = 0;
  virtual void add(const Tensor& a, const Tensor& b, Tensor& out) = 0;  // same shapes
  virtual void mul(const Tensor& a, const Tensor& b, Tensor& out) = 0;  // same shapes
  virtual void scale(const Tensor& x, float s, Tensor& out) = 0;
  virtual void axpy(float alpha, const Tensor& x, Tensor& y) = 0;  // y += alpha * x
  // Sum of all elements / of squares, accumulated in double.
  virtual double sum(const Tensor& x) = 0;
  virtual double sum_squares(const Tensor& x) = 0;
  // Columns of one matrix into another (split and concat on the last dimension): src [N, Ds],
  // dst [N, Dd] (the same row count N), for every row n and c in [0, width):
  //   dst[n, dst_col + c] = src[n, src_col + c]      (accumulate = false: a copy, converting)
  //   dst[n, dst_col + c] += src[n, src_col + c]     (accumulate = true: a backward)
  // Other columns of dst are left alone. The default goes through the host (copy_to_host and
  // copy_from_host, correct for any backend, slow); backends override it with one pass.
  virtual void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                            int64_t width, bool accumulate);
  // sums[i] = sum_squares(*xs[i]) for every tensor at once (a gradient norm over all
  // parameters): a device backend reads the results back in one round trip instead of one per
  // tensor. The default calls sum_squares in turn; an override must give the same values.
  virtual void sum_squares_each(const std::vector<const Tensor*>& xs, std::vector<double>& sums) {
    sums.resize(xs.size());
    for (size_t i = 0; i < xs.size(); ++i) sums[i] = sum_squares(*xs[i]);
  }

  // ---- matmul -----------------------------------------------------------------------------
  // c[b] = alpha * op(a[b]) @ op(b[b]) + beta * c[b]
  // a: [..., M, K] ([..., K, M] if trans_a); b: [..., K, N] ([..., N, K] if trans_b) or a 2-D
  // matrix shared by every batch; c: [..., M, N]. M = 1 takes the matrix-vector (decode) path.
  virtual void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b,
                      float alpha = 1.f, float beta = 0.f) = 0;

  // ---- embedding --------------------------------------------------------------------------
  // table [V, D], ids [N] (i32, each in [0, V)), out [N, D]
  virtual void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) = 0;
  // dtable[ids[n]] += dout[n]
  virtual void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) = 0;

  // ---- normalisation ----------------------------------------------------------------------
  // x [N, D], w [D], out [N, D], rstd [N] f32. out = x * rstd * (plus_one ? 1 + w : w)
  virtual void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one,
                               Tensor& out, Tensor& rstd) = 0;
  virtual void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w,
                                const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) = 0;
  // x [N, D], w [D], b [D] or undefined, out [N, D], mean [N] f32, rstd [N] f32
  virtual void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                                 Tensor& out, Tensor& mean, Tensor& rstd) = 0;
  // db may be undefined when there is no bias.
  virtual void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w,
                                  const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw,
                                  Tensor& db) = 0;

  // ---- rotary position embedding ----------------------------------------------------------
  // x [B, T, H, D], positions [B, T] i32 (absolute positions), out [B, T, H, D]
  virtual void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                            Tensor& out) = 0;
  // dx += rotate(dout, -angle)
  virtual void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                             Tensor& dx) = 0;

  // ---- activations ------------------------------------------------------------------------
  // x [N], out [N]: out = act(x)
  virtual void activation_forward(Activation act, const Tensor& x, Tensor& out) = 0;
  virtual void activation_backward(Activation act, const Tensor& dout, const Tensor& x,
                                   Tensor& dx) = 0;
  // Gated (swiglu = silu, geglu = gelu): gate [N], up [N], out [N] = act(gate) * up
  virtual void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  virtual void gated_backward(Activation act, const Tensor& dout, const Tensor& gate,
                              const Tensor& up, Tensor& dgate, Tensor& dup) = 0;
  // Logit soft-cap: out = cap * tanh(x / cap)
  virtual void softcap_forward(const Tensor& x, float cap, Tensor& out) = 0;
  virtual void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) = 0;

  // ---- softmax and loss -------------------------------------------------------------------
  // x [N, C], out [N, C]: softmax over the last dimension
  virtual void softmax_forward(const Tensor& x, Tensor& out) = 0;
  virtual void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) = 0;
  // Fused softmax cross-entropy over the vocabulary. logits [N, V], targets [N] i32 (a target
  // < 0 is ignored: loss 0, no gradient), loss [N] f32, lse [N] f32 (logsumexp of each row).
  // loss = lse - logits[target] + z_loss * lse^2. Never holds more than a chunk of rows of
  // probabilities at a time.
  virtual void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss,
                                     Tensor& loss, Tensor& lse) = 0;
  // dlogits [N, V] += dloss[n] * (softmax(logits[n]) * (1 + 2 z_loss lse[n]) - onehot(target))
  virtual void cross_entropy_backward(const Tensor& dloss, const Tensor& logits,
                                      const Tensor& targets, const Tensor& lse, float z_loss,
                                      Tensor& dlogits) = 0;

  // ---- mixture of experts -----------------------------------------------------------------
  // logits [N, E] -> weights [N, k] f32, indices [N, k] i32 (descending score), probs [N, E]
  // f32 saved for the backward. sigmoid=false: softmax scores; true: sigmoid scores.
  // normalize: divide the k weights by their sum.
  virtual void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize,
                                  Tensor& weights, Tensor& indices, Tensor& probs) = 0;
  virtual void topk_route_backward(const Tensor& dweights, const Tensor& weights,
                                   const Tensor& indices, const Tensor& probs, bool sigmoid,
                                   bool normalize, Tensor& dlogits) = 0;
  // x [N, D], idx [M] i32 in [0, N), out [M, D]: out[m] = x[idx[m]]
  virtual void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) = 0;
  // out [N, D] += src [M, D] scattered: out[idx[m]] += w[m] * src[m]; w [M] f32 or undefined (1)
  virtual void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w,
                                Tensor& out) = 0;
  // out [N, D]: out[idx[m]] = src[m] for src [M, D], idx [M] i32 in [0, N) (KV-cache writes);
  // other rows keep their contents, and a row named more than once ends with unspecified
  // contents (the KV cache's sink row, never read). The default is built from gather_rows and
  // scatter_add_rows (subtract the old row, exactly 0 where it is finite, then add the new one);
  // backends override it with one pass that never reads the old rows.
  virtual void scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out);
  // x [M, K] with rows grouped by expert: rows offsets[e]..offsets[e+1] use w[e].
  // w [E, K, N] ([E, N, K] if trans_w), offsets [E + 1] i32, out [M, N] = x_e @ w[e]
  virtual void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                              Tensor& out) = 0;
  // dw[e] += x_e^T @ dout_e   (dw [E, K, N]; [E, N, K] if trans_w)
  virtual void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout,
                                          const Tensor& offsets, bool trans_w, Tensor& dw) = 0;

  // ---- optimizer --------------------------------------------------------------------------
  // param [n] (f32 or bf16), grad [n], m [n] f32, v [n] f32, updated in place.
  virtual void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                            const AdamWParams& p) = 0;

  // Backend-specific extensions without widening this interface (ggml's get_proc_address).
  virtual void* extension(const char* /*name*/) { return nullptr; }
};

}  // namespace mt
