// The CUDA backend's kernels as host launchers, one per mt::Backend op, defined in one .cu file
// per op family (elementwise.cu, norm.cu, rope.cu, softmax.cu, rows.cu, moe.cu, adamw.cu,
// attention.cu; gemm.cu for the matmul; common.cu for check() and DeviceChecks, common.cuh for
// the helpers the kernels share). Shapes and semantics are those of the matching Backend method
// (sdk/include/mt/backend.h); every launcher checks its operands, enqueues on ctx.stream and
// checks the launch, throwing mt::Error that names the op and the shapes.
#pragma once

#ifndef MT_CUDA_EMULATION  // tests/support/cuda_emulation.h stands in for the runtime
#include <cublasLt.h>
#include <cuda_runtime.h>
#endif

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"

namespace mt::cuda {

class Gemm;  // gemm.h

// Rope frequency tables by spec and rotary width: every layer of a model rotates with the same
// table, computed on the host (rope_frequencies) and uploaded once instead of at every call. One
// entry per distinct rope spec in use (a few hundred bytes each), never dropped: a recorded CUDA
// graph replays with the device address of the table it was recorded with (dropping tables past
// eight, as before, left such a graph reading freed memory).
struct RopeTables {
  struct Entry {
    RopeSpec spec;
    int64_t rotary_dim;
    std::vector<float> inv_freq;  // the host copy (the upload's source, so kept)
    double mscale;
    Tensor dev;  // inv_freq on the device
  };
  std::vector<Entry> entries;
};

// Input checks made on the device, so that no host thread waits for the data (reading ids back
// to check them is a stream synchronisation per call). A kernel that finds a bad index or length
// records it in its launch's slot and reads nothing out of bounds with it; its outputs are then
// undefined. The backend throws the failure as an mt::Error at its next synchronize() or
// copy_to_host(), naming the op and the lowest bad position with its value.
class DeviceChecks {
 public:
  // The message for a failure at `position` (an element index of the checked tensor).
  using Message = std::function<std::string(int64_t position, int64_t value)>;
  static constexpr size_t kSlots = 256;
  static constexpr unsigned long long kClear = ~0ull;  // a slot with no failure
  // words: kSlots * 8 bytes of device memory; stream: where every checking kernel runs.
  DeviceChecks(Tensor words, cudaStream_t stream);
  // A slot for one launch. When all are taken, the stream is synchronised and the pending ones
  // reported first.
  unsigned long long* slot(Message message);
  // With the stream synchronised: throws the first failure in launch order; every slot is free
  // again either way. The slots of recorded work replayed since the last report are read too.
  void report();

  // Recorded work (WorkCapture, a CUDA graph) keeps the slots its launches were recorded with:
  // from begin_recording() (before the stream starts recording) to end_recording(), slots come
  // from `words` (kSlots * 8 bytes, cleared here); a recording needing more throws.
  struct Recorded {
    Tensor words;
    std::vector<Message> messages;
  };
  void begin_recording(Tensor words);
  std::shared_ptr<Recorded> end_recording();
  // After each replay of recorded work: its slots are read at the next report(), then cleared.
  void replayed(const std::shared_ptr<Recorded>& r);

 private:
  Tensor words_;
  cudaStream_t stream_;
  std::vector<Message> pending_;
  std::shared_ptr<Recorded> recording_;  // while recording: the eager slots wait in pending_
  std::vector<std::shared_ptr<Recorded>> replays_;
};

struct Ctx {
  cudaStream_t stream = nullptr;
  // The backend these launchers serve (CudaOps). A launcher that takes only some cases of a
  // composed op (split_columns, scatter_rows_each) hands the others to the op's composition in
  // mt::Backend, which calls back into the launchers one tensor at a time.
  Backend* self = nullptr;
  // cuBLASLt GEMMs: handle, workspace and plan cache (gemm.h), shared by copies of this Ctx.
  std::shared_ptr<Gemm> gemm;
  // Device temporaries from the backend's caching allocator. A temporary may die while kernels
  // that use it are still queued: safe with one stream (see allocator.h).
  std::function<Tensor(const Shape&, DType)> scratch;
  // Rope tables on the device.
  std::shared_ptr<RopeTables> rope;
  // Where checking kernels record bad inputs.
  std::shared_ptr<DeviceChecks> checks;
  // The device's compute capability (major), asked once: 8+ takes mma.sync.
  int sm_major = 0;
  // The dynamic shared memory a block may opt in to (227 KiB on sm_90, 99 KiB on sm_86/89/120),
  // asked once: flash's tensor-core kernels run where theirs fits.
  size_t smem_per_block = 0;
  // Slices per streamed query tile in flash's dk/dv kernel (flash_kernels.cuh): 1 or 2, 0 = the
  // default per head_dim. From MT_CUDA_FLASH_DKV_PARTS, for measuring one against the other.
  int flash_dkv_parts = 0;
  // Warps per block of flash's tensor-core forward and dq kernels (16 query rows each): 4 or 8,
  // 0 = the default (4). From MT_CUDA_FLASH_WARPS, for measuring one against the other.
  int flash_warps = 0;
  // The same for the dk/dv kernel (16 key rows a warp): 4 or 8, 0 = the default (4). From
  // MT_CUDA_FLASH_DKV_WARPS.
  int flash_dkv_warps = 0;
  // matmul_q8 dequantizes the weights and calls cuBLASLt for every x, including decode's up to 8
  // rows that q8_gemv_kernel takes otherwise. From MT_CUDA_Q8_GEMV=0, for measuring one against
  // the other.
  bool q8_dequant_always = false;
  // matmul hands decode's products (up to 8 rows of x against a weight's [N, K] rows, b
  // transposed, beta 0) to rows_gemv_kernel (rows.cu) instead of cuBLASLt. From
  // MT_CUDA_ROWS_GEMV=1; off until measured against cuBLASLt on a device (bench/gpu/probe.sh's
  // gemv step).
  bool rows_gemv = false;
  // Kernels launch with programmatic dependent launch (device_io.cuh's MT_LAUNCH and
  // MT_KERNEL_PROLOGUE): each kernel's blocks may start while the one before it finishes, and
  // wait for it before touching memory. From MT_CUDA_PDL=1 on a Hopper or later; off until
  // measured (bench/gpu/probe.sh's gemv step).
  bool pdl = false;
  // Copies to several tensors in one launch each: split_columns writes up to 8 pieces (SplitF,
  // rows.cu) and scatter_rows_each up to 4 pairs (ScatterEachF) instead of one launch a tensor.
  // A batch-8 decode step's splits of the fused q/k/v and gate/up outputs, five launches a
  // layer, become two, and every step's k and v cache writes one. From MT_CUDA_JOINT_COPIES=1;
  // off until measured (bench/gpu/probe.sh's gemv step).
  bool joint_copies = false;
};

// Throws "cuda <op>: <what> failed: <error> (<shapes>)" unless e is cudaSuccess.
void check(cudaError_t e, const std::string& op, const std::string& what,
           const std::string& shapes = {});
void check(cublasStatus_t s, const std::string& op, const std::string& what,
           const std::string& shapes = {});
// Checks the launch just made; `shapes` (a callable returning std::string) is only called to
// build the message when the launch failed.
template <class S>
void launched(const std::string& op, const S& shapes) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) check(e, op, "kernel launch", shapes());
}

// elementwise
void fill(const Ctx& c, Tensor& x, float value);
void cast(const Ctx& c, const Tensor& src, Tensor& dst);
void add(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& out);
void mul(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& out);
void scale(const Ctx& c, const Tensor& x, float s, Tensor& out);
void axpy(const Ctx& c, float alpha, const Tensor& x, Tensor& y);
double sum(const Ctx& c, const Tensor& x, bool squares);
// result[i] = sum (of squares) of *xs[i], read back in one copy.
void sums(const Ctx& c, const std::vector<const Tensor*>& xs, bool squares,
          std::vector<double>& result);
// The op set's names for the three (CudaOps forwards each op to the launcher of its name).
inline double sum(const Ctx& c, const Tensor& x) {
  return sum(c, x, false);
}
inline double sum_squares(const Ctx& c, const Tensor& x) {
  return sum(c, x, true);
}
inline void sum_squares_each(const Ctx& c, const std::vector<const Tensor*>& xs,
                             std::vector<double>& out) {
  sums(c, xs, true, out);
}

// split and concat on the last dimension
void copy_columns(const Ctx& c, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                  int64_t width, bool accumulate);
// every piece of src's columns (split's forward): one launch for up to 8 pieces when
// c.joint_copies is set, else one copy_columns each (rows.cu)
void split_columns(const Ctx& c, const Tensor& src, std::vector<Tensor>& pieces);
// parameter initialisation: mt/random_fill.h's values, the same bits as the CPU's (elementwise.cu)
void fill_random(const Ctx& c, Tensor& out, const RandomFill& spec);

// matmul (cuBLASLt through c.gemm, f32 accumulation; gemm.cu)
void matmul(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& out, bool trans_a, bool trans_b,
            float alpha, float beta);
// matmul's call y = alpha x w^T (x [..., rows, K] untransposed, w [N, K] of x's dtype, beta 0)
// through rows_gemv_kernel, when c.rows_gemv is set and the call suits it (at most 8 rows, K a
// multiple of 8, 16-byte aligned operands); false, with nothing done, otherwise. matmul has
// checked the shapes and that the product is not empty (rows.cu)
bool matmul_rows_gemv(const Ctx& c, const Tensor& x, const Tensor& w, Tensor& y, bool trans_x,
                      bool trans_w, float alpha, float beta);
// int8 rows (mt/q8.h) dequantized on the device, then matmul (rows.cu)
void matmul_q8(const Ctx& c, const Tensor& x, const Tensor& w, Tensor& y);
// int8 experts: matmul_q8 per expert with rows, on slices (rows.cu)
void grouped_matmul_q8(const Ctx& c, const Tensor& x, const Tensor& w,
                       const std::vector<int64_t>& counts, Tensor& y);

// embedding
void embedding_forward(const Ctx& c, const Tensor& table, const Tensor& ids, Tensor& out);
void embedding_q8_forward(const Ctx& c, const Tensor& table, const Tensor& ids, Tensor& out);
void embedding_backward(const Ctx& c, const Tensor& dout, const Tensor& ids, Tensor& dtable);

// MoE
void topk_route_forward(const Ctx& c, const Tensor& logits, int k, bool sigmoid, bool normalize,
                        Tensor& weights, Tensor& indices, Tensor& probs);
void topk_route_backward(const Ctx& c, const Tensor& dweights, const Tensor& weights,
                         const Tensor& indices, const Tensor& probs, bool sigmoid, bool normalize,
                         Tensor& dlogits);
void gather_rows(const Ctx& c, const Tensor& x, const Tensor& idx, Tensor& out);
void scatter_add_rows(const Ctx& c, const Tensor& src, const Tensor& idx, const Tensor& w,
                      Tensor& out);
void scatter_rows(const Ctx& c, const Tensor& src, const Tensor& idx, Tensor& out);
// scatter_rows for each (srcs[i], outs[i]) with one idx: one launch for up to 4 pairs whose
// outs have one row count when c.joint_copies is set, else one scatter_rows each (rows.cu)
void scatter_rows_each(const Ctx& c, const std::vector<Tensor>& srcs, const Tensor& idx,
                       std::vector<Tensor>& outs);
// The int8 KV cache (rows.cu): quantized rows written by index, and rows widened back.
void scatter_rows_q8(const Ctx& c, const Tensor& src, const Tensor& idx, Tensor& q, Tensor& s);
void dequantize_rows_q8(const Ctx& c, const Tensor& q, const Tensor& s, Tensor& out);

void grouped_matmul(const Ctx& c, const Tensor& x, const Tensor& w, const Tensor& offsets,
                    bool trans_w, Tensor& out);
void grouped_matmul_weight_grad(const Ctx& c, const Tensor& x, const Tensor& dout,
                                const Tensor& offsets, bool trans_w, Tensor& dw);

// rmsnorm
void rmsnorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, float eps, bool plus_one,
                     Tensor& out, Tensor& rstd);
void rmsnorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw);

// layernorm (b and db may be undefined)
void layernorm_forward(const Ctx& c, const Tensor& x, const Tensor& w, const Tensor& b, float eps,
                       Tensor& out, Tensor& mean, Tensor& rstd);
void layernorm_backward(const Ctx& c, const Tensor& dout, const Tensor& x, const Tensor& w,
                        const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);

// rope
void rope_forward(const Ctx& c, const Tensor& x, const Tensor& positions, const RopeSpec& spec,
                  Tensor& out);
void rope_backward(const Ctx& c, const Tensor& dout, const Tensor& positions, const RopeSpec& spec,
                   Tensor& dx);

// activations
void activation_forward(const Ctx& c, Activation act, const Tensor& x, Tensor& out);
void activation_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& x,
                         Tensor& dx);
void gated_forward(const Ctx& c, Activation act, const Tensor& gate, const Tensor& up, Tensor& out);
void gated_backward(const Ctx& c, Activation act, const Tensor& dout, const Tensor& gate,
                    const Tensor& up, Tensor& dgate, Tensor& dup);
void softcap_forward(const Ctx& c, const Tensor& x, float cap, Tensor& out);
void softcap_backward(const Ctx& c, const Tensor& dout, const Tensor& out, float cap, Tensor& dx);

// softmax and loss
void softmax_forward(const Ctx& c, const Tensor& x, Tensor& out);
void softmax_backward(const Ctx& c, const Tensor& dout, const Tensor& out, Tensor& dx);
void cross_entropy_forward(const Ctx& c, const Tensor& logits, const Tensor& targets, float z_loss,
                           Tensor& loss, Tensor& lse);
void cross_entropy_backward(const Ctx& c, const Tensor& dloss, const Tensor& logits,
                            const Tensor& targets, const Tensor& lse, float z_loss,
                            Tensor& dlogits);

// optimizer
void adamw_update(const Ctx& c, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                  const AdamWParams& p);

// dot_product attention (attention.h): the reference kernel, materialising each query row's
// scores. decode: lengths [B] i32 (device), q rows sit at lengths[b] - T + i.
void attention_forward(const Ctx& c, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& q_segment, const Tensor& kv_segment, const AttentionSpec& spec,
                       Tensor& out, Tensor& lse);
void attention_backward(const Ctx& c, const Tensor& dout, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& q_segment, const Tensor& kv_segment,
                        const Tensor& out, const Tensor& lse, const AttentionSpec& spec, Tensor& dq,
                        Tensor& dk, Tensor& dv);
void attention_decode(const Ctx& c, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                      const Tensor& lengths, const AttentionSpec& spec, Tensor& out);

}  // namespace mt::cuda
