// The CPU backend's kernels as free functions, one area per file. Signatures, shapes and
// semantics are those of the matching mt::Backend method (sdk/include/mt/backend.h); they run
// inside the backend's oneTBB arena, so they may use tbb::parallel_for freely.
#pragma once

#include <string>

#include "mt/backend.h"

namespace mt::cpu {

// elementwise.cpp
void fill(Tensor& x, float value);
void cast(const Tensor& src, Tensor& dst);
void add(const Tensor& a, const Tensor& b, Tensor& out);
void mul(const Tensor& a, const Tensor& b, Tensor& out);
void scale(const Tensor& x, float s, Tensor& out);
void axpy(float alpha, const Tensor& x, Tensor& y);
double sum(const Tensor& x);
double sum_squares(const Tensor& x);

// random.cpp
void fill_random(Tensor& out, const RandomFill& spec);

// columns.cpp
void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate);

// gemm.cpp
// Chooses the GEMM path for this machine and measures the peaks (called by the backend factory,
// before any GEMM; OpenBLAS itself is loaded earlier, by load_blas).
void gemm_setup(int num_threads);
// Loads OpenBLAS (gemm_setup's first part, setting OPENBLAS_CORETYPE around its loading):
// called when the plugin registers, before other threads may read the environment.
void load_blas();
std::string gemm_describe();
// Whether bf16 rows against bf16 [N, K] weights run on the dot-product or AMX "rows" kernel
// (few rows): the arithmetic of up to kFewRows rows as fast as the weights stream.
bool few_rows_bf16dot();  // "OpenBLAS 0.3.21 (SkylakeX kernels), AVX512_BF16"
double cpu_peak_flops(DType dtype, int num_threads);
// Up to this many rows of a against a shared 2-D b (trans_a false), matmul takes the
// matrix-vector kernels (decode's few rows), which read each weight once for all the rows and
// use no shared scratch: calls of that size may run concurrently (the MoE grouped matmul's
// experts do).
constexpr int64_t kFewRows = 8;
void matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha,
            float beta);
// Experts' few-row products in one fork: x [M, K] and out [M, N] (f32 or bf16), w [E, K, N] ([E,
// N, K] if trans_w; f32 or bf16), rows off[e]..off[e + 1] of x through w[e] for each e of
// `experts` (each at most kFewRows rows, K > 0): every expert's output chunks as tasks of one
// fork, each row's outputs what matmul gives the expert's rows alone (the same kernels and
// chunks).
void grouped_matvec(const Tensor& x, const Tensor& w, const std::vector<int32_t>& off,
                    const std::vector<int64_t>& experts, bool trans_w, Tensor& out);
// y = x @ W^T for int8 rows (mt/q8.h): decode's few rows read each row once, dequantizing in
// registers; more rows dequantize W to f32 for a GEMM.
void matmul_q8(const Tensor& x, const Tensor& w, Tensor& y);
// Experts' int8 rows w [E, N, K + K / 16], counts[e] rows of x [M, K] each: matmul_q8 per expert;
// at decode's few rows an expert, every expert's products in one fork.
void grouped_matmul_q8(const Tensor& x, const Tensor& w, const std::vector<int64_t>& counts,
                       Tensor& y);
// One single-threaded f32 GEMM on raw row-major pointers (OpenBLAS, else the portable loop):
// c = alpha * op(a) op(b) + beta * c, m, n, k >= 1. For kernels that tile work over oneTBB
// themselves (the MoE grouped matmul); the result depends only on the operands and shapes.
void sgemm_serial(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                  const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                  int64_t ldc);
// Whether sgemm_serial runs OpenBLAS (false: the slow portable loop).
bool sgemm_fast();

// embedding.cpp
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out);
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable);
void embedding_q8_forward(const Tensor& table, const Tensor& ids, Tensor& out);

// norm.cpp
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out,
                     Tensor& rstd);
void rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd,
                      bool plus_one, Tensor& dx, Tensor& dw);
void layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out,
                       Tensor& mean, Tensor& rstd);
void layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db);

// rope.cpp
void rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec, Tensor& out);
void rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec, Tensor& dx);

// activation.cpp
void activation_forward(Activation act, const Tensor& x, Tensor& out);
void activation_backward(Activation act, const Tensor& dout, const Tensor& x, Tensor& dx);
void gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out);
void gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up,
                    Tensor& dgate, Tensor& dup);
void softcap_forward(const Tensor& x, float cap, Tensor& out);
void softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx);

// loss.cpp
void softmax_forward(const Tensor& x, Tensor& out);
void softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx);
void cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss, Tensor& loss,
                           Tensor& lse);
void cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets,
                            const Tensor& lse, float z_loss, Tensor& dlogits);

// moe.cpp
void topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize, Tensor& weights,
                        Tensor& indices, Tensor& probs);
void topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices,
                         const Tensor& probs, bool sigmoid, bool normalize, Tensor& dlogits);
void gather_rows(const Tensor& x, const Tensor& idx, Tensor& out);
void scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, Tensor& out);
void scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out);
void scatter_rows_q8(const Tensor& src, const Tensor& idx, Tensor& q, Tensor& scales);
void dequantize_rows_q8(const Tensor& q, const Tensor& scales, Tensor& out);
void grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w,
                    Tensor& out);
void grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets,
                                bool trans_w, Tensor& dw);

// optimizer.cpp
void adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p);

}  // namespace mt::cpu
