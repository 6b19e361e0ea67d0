// Backend: memory and the kernels of mt's op set, one implementation per hardware plugin.
//
// Conventions for every kernel of the op set (mt/ops.def lists them; version MT_OPSET_VERSION):
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

// 3: ops as data (mt/ops.def), Activation::tanh; 4: fill_random (see version.h); 5: matmul_q8;
// 6: scatter_rows_q8 and dequantize_rows_q8 (the int8 KV cache); 7: grouped_matmul_q8 (int8
// experts); 8: split_columns and scatter_rows_each (copies to several tensors in one op);
// 9: embedding_q8_forward (a tied embedding table held as int8 rows); 10: the int8 ops' rows
// hold f16 scales (mt/q8.h)
#define MT_OPSET_VERSION 10

namespace mt {

class Config;

enum class Activation : uint8_t { silu, gelu_tanh, gelu_exact, relu, tanh };
enum class Op : uint16_t;  // mt/ops.h: one value per op of mt/ops.def

struct RopeSpec {
  // linear: every frequency divided by `factor` (Hugging Face's "linear"; Gemma 3's global
  // layers). Appended last: the values of the others are unchanged.
  enum class Type : uint8_t { standard, llama3, yarn, linear };
  Type type = Type::standard;
  float theta = 10000.f;  // rope_max_timescale
  int rotary_dim = 0;     // rotate the first rotary_dim features of each head; 0 = all of head_dim
  // Pairing: false = Hugging Face "rotate_half" (feature i pairs with i + rotary_dim/2);
  // true = interleaved (2i pairs with 2i+1).
  bool interleaved = false;
  // Llama 3.1 frequency scaling (type llama3), YaRN (type yarn) and linear scaling (type
  // linear, which reads only the factor): scaling factor and the original context length the
  // model was trained with.
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

// Backend::fill_random's distribution. normal: N(0, stddev^2). truncated_normal: a standard
// normal truncated at +-2 and rescaled so the variance is stddev^2 (as MaxText's initialisers).
// key: the stream (the parameter's seed); mt/random_fill.h defines every element's value.
struct RandomFill {
  enum class Distribution : uint8_t { normal, truncated_normal };
  uint64_t key = 0;
  Distribution distribution = Distribution::normal;
  float stddev = 1.f;
};

// What a backend's out-of-memory error ends with: the settings a user can change.
inline constexpr const char* kOutOfMemoryAdvice =
    "`mt plan` with the same arguments shows what the run needs and what makes it fit. "
    "Training: lower per_device_batch_size or max_target_length, recompute activations in the "
    "backward pass (remat_policy=full), or split each batch into micro-batches with "
    "gradient_accumulation_steps. Inference: fewer prompts at once or a shorter "
    "max_target_length.";

// No allocation is larger: sizes past it come from overflowing arithmetic or absurd configs,
// and an allocator refuses them before doing anything with them.
inline constexpr size_t kMaxAllocationBytes = size_t{1} << 60;

struct MemoryStats {
  size_t bytes_in_use = 0;  // handed out to live tensors
  size_t peak_bytes_in_use = 0;
  size_t bytes_cached = 0;       // held by the caching allocator, free for reuse
  size_t num_system_allocs = 0;  // calls to the system allocator since start
  // What the device can hold in all (the GPU's memory, the host's RAM or cgroup limit); 0 when
  // the backend cannot tell. `mt plan` and the check before `mt run` / `mt decode` compare the
  // predicted peak with it.
  size_t bytes_limit = 0;
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
  // Gives the allocator's cached free blocks back to the system (torch.cuda.empty_cache's
  // counterpart), for after a one-time change such as mt decode's layout of the weights
  // (transposed, fused, int8), whose replaced tensors' blocks no later step asks for again and
  // would otherwise stay in the process's memory. The default has nothing cached.
  virtual void release_cached_memory() {}

  // ---- the op set (mt/ops.def: each op's shapes and semantics) ----------------------------
  // `required` ops are pure virtual; `composed` ones have a default in the core built from
  // other ops (core/src/op_fallbacks.cpp), which a backend overrides with its own kernel.
#define MT_OP_required(ret, name, params) virtual ret name params = 0;
#define MT_OP_composed(ret, name, params) virtual ret name params;
#define MT_OP(kind, ret, name, params, args) MT_OP_##kind(ret, name, params)
#include "mt/ops.def"
#undef MT_OP
#undef MT_OP_composed
#undef MT_OP_required

  // Whether this backend runs `op` with a kernel of its own (true) or the core's composition
  // (false: correct, slower). The default says true for required ops and false for composed
  // ones; a backend that overrides composed ops says so here (mt plugins lists the rest).
  virtual bool supports(Op op) const;

  // Backend-specific extensions without widening this interface (ggml's get_proc_address).
  virtual void* extension(const char* /*name*/) { return nullptr; }
};

}  // namespace mt
