// The part of cuBLASLt that mt's gemm.cu calls, on the host, so that its matmul (operand
// mapping from row-major mt tensors to column-major cuBLASLt matrices, transposes, leading
// dimensions, batch strides, the shared-b and f32-fallback paths, the plan cache) runs in
// cuda_emulated_ops_test against the CPU backend. Include after cuda_emulation.h.
//
// Semantics as cuBLASLt documents them: matrices are column-major, element (i, j) of a layout at
// i + j * ld (ld >= rows), batch matrix b at b * STRIDED_BATCH_OFFSET elements;
// D = alpha op(A) op(B) + beta C with op(A) m x k, op(B) k x n, C and D m x n; beta = 0 does not
// read C. Each call is checked as the library would refuse it (CUBLAS_STATUS_INVALID_VALUE or
// NOT_SUPPORTED), and cublasLtMatmul also against what the plan's heuristic was promised: the
// operands' alignment and the workspace. Products accumulate in double and round once, inputs
// rounded to TF32 first under CUBLAS_COMPUTE_32F_FAST_TF32.
#pragma once

#ifndef MT_CUDA_EMULATION
#error "include cuda_emulation.h first"
#endif

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

enum cudaDataType_t : int { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum cublasComputeType_t : int { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 };
enum cublasOperation_t : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasLtMatmulDescAttributes_t : int {
  CUBLASLT_MATMUL_DESC_TRANSA = 3,
  CUBLASLT_MATMUL_DESC_TRANSB = 4,
};
enum cublasLtMatrixLayoutAttribute_t : int {
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
};
enum cublasLtMatmulPreferenceAttributes_t : int {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

namespace emu_lt {
// cublasLtMatmul calls that ran (tests check that a path did or did not take cuBLASLt).
inline int64_t matmul_calls = 0;
struct Handle {};
struct Desc {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
};
struct Layout {
  cudaDataType_t type;
  uint64_t rows, cols;
  int64_t ld;
  int32_t batch = 1;
  int64_t stride = 0;
};
struct Preference {
  uint64_t workspace = 0;
  uint32_t align[4] = {256, 256, 256, 256};  // A, B, C, D: cuBLASLt's default assumption
};
// The C API's opaque objects: created on the heap and handed out (release), taken back and
// freed by the matching destroy.
template <class T>
cublasStatus_t create(T** out, T value = {}) {
  *out = std::make_unique<T>(std::move(value)).release();
  return CUBLAS_STATUS_SUCCESS;
}
template <class T>
cublasStatus_t destroy(T* p) {
  std::unique_ptr<T> owned(p);
  return CUBLAS_STATUS_SUCCESS;
}
}  // namespace emu_lt

using cublasLtHandle_t = emu_lt::Handle*;
using cublasLtMatmulDesc_t = emu_lt::Desc*;
using cublasLtMatrixLayout_t = emu_lt::Layout*;
using cublasLtMatmulPreference_t = emu_lt::Preference*;
// What the heuristic promised the plan: the alignments and workspace it was chosen for.
struct cublasLtMatmulAlgo_t {
  uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  return emu_lt::create(h);
}
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  return emu_lt::destroy(h);
}

inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t c,
                                               cudaDataType_t scale) {
  if (c != CUBLAS_COMPUTE_32F && c != CUBLAS_COMPUTE_32F_FAST_TF32)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return emu_lt::create(d, emu_lt::Desc{c, scale});
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  return emu_lt::destroy(d);
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d,
                                                     cublasLtMatmulDescAttributes_t a,
                                                     const void* buf, size_t size) {
  if (size != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
  cublasOperation_t op;
  std::memcpy(&op, buf, size);
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
  if (a == CUBLASLT_MATMUL_DESC_TRANSA)
    d->ta = op;
  else if (a == CUBLASLT_MATMUL_DESC_TRANSB)
    d->tb = op;
  else
    return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t type,
                                                 uint64_t rows, uint64_t cols, int64_t ld) {
  if (ld < static_cast<int64_t>(rows) || ld < 1) return CUBLAS_STATUS_INVALID_VALUE;
  return emu_lt::create(l, emu_lt::Layout{type, rows, cols, ld});
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  return emu_lt::destroy(l);
}
inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l,
                                                       cublasLtMatrixLayoutAttribute_t a,
                                                       const void* buf, size_t size) {
  if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && size == sizeof(int32_t)) {
    std::memcpy(&l->batch, buf, size);
    return l->batch >= 1 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
  }
  if (a == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && size == sizeof(int64_t)) {
    std::memcpy(&l->stride, buf, size);
    return l->stride >= 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_INVALID_VALUE;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  return emu_lt::create(p);
}
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  return emu_lt::destroy(p);
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                           cublasLtMatmulPreferenceAttributes_t a,
                                                           const void* buf, size_t size) {
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && size == sizeof(uint64_t)) {
    std::memcpy(&p->workspace, buf, size);
    return CUBLAS_STATUS_SUCCESS;
  }
  const int i = a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES;
  if (i < 0 || i > 3 || size != sizeof(uint32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&p->align[i], buf, size);
  return CUBLAS_STATUS_SUCCESS;
}

namespace emu_lt {
inline size_t type_size(cudaDataType_t t) {
  return t == CUDA_R_16BF ? 2 : 4;
}
// The problem a descriptor and four layouts describe, or why cuBLASLt would refuse it.
struct Problem {
  uint64_t m, n, k;
  int32_t batch;
};
inline cublasStatus_t problem(const Desc& d, const Layout& a, const Layout& b, const Layout& c,
                              const Layout& dl, Problem& p) {
  if (d.scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  const bool ta = d.ta == CUBLAS_OP_T, tb = d.tb == CUBLAS_OP_T;
  p.m = c.rows;
  p.n = c.cols;
  p.k = ta ? a.rows : a.cols;
  if ((ta ? a.cols : a.rows) != p.m || (tb ? b.cols : b.rows) != p.k ||
      (tb ? b.rows : b.cols) != p.n || dl.rows != c.rows || dl.cols != c.cols || dl.ld != c.ld ||
      dl.type != c.type || dl.stride != c.stride)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (a.batch != c.batch || b.batch != c.batch || dl.batch != c.batch)
    return CUBLAS_STATUS_INVALID_VALUE;
  p.batch = c.batch;
  if (a.type != b.type || (c.type != CUDA_R_32F && c.type != a.type))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a.type != CUDA_R_32F)
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}
inline double load(const void* p, cudaDataType_t t, int64_t i) {
  if (t == CUDA_R_16BF) {
    __nv_bfloat16 v;
    std::memcpy(&v, static_cast<const unsigned char*>(p) + i * 2, 2);
    return __bfloat162float(v);
  }
  float v;
  std::memcpy(&v, static_cast<const unsigned char*>(p) + i * 4, 4);
  return v;
}
inline void store(void* p, cudaDataType_t t, int64_t i, float v) {
  if (t == CUDA_R_16BF) {
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    std::memcpy(static_cast<unsigned char*>(p) + i * 2, &b, 2);
    return;
  }
  std::memcpy(static_cast<unsigned char*>(p) + i * 4, &v, 4);
}
// TF32: 10 explicit mantissa bits, round to nearest (ties away, as the tensor cores' conversion).
inline double tf32(double x) {
  float f = static_cast<float>(x);
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&f, &u, 4);
  return f;
}
// Every matrix of a strided batch starts at a multiple of `align` bytes.
inline bool aligned(const void* p, const Layout& l, uint32_t align) {
  const auto base = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p));
  if (base % align) return false;
  return l.batch == 1 || (static_cast<uint64_t>(l.stride) * type_size(l.type)) % align == 0;
}
}  // namespace emu_lt

inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(
    cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
    cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t pref,
    int requested, cublasLtMatmulHeuristicResult_t* results, int* found) {
  if (!h || !d || !a || !b || !c || !dl || !pref || requested < 1)
    return CUBLAS_STATUS_INVALID_VALUE;
  emu_lt::Problem p{};
  if (const cublasStatus_t s = emu_lt::problem(*d, *a, *b, *c, *dl, p); s != CUBLAS_STATUS_SUCCESS)
    return s;
  cublasLtMatmulHeuristicResult_t r{};
  for (int i = 0; i < 4; ++i) r.algo.data[i] = pref->align[i];
  r.algo.data[4] = pref->workspace;
  r.state = CUBLAS_STATUS_SUCCESS;
  results[0] = r;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void* alpha,
                                     const void* A, cublasLtMatrixLayout_t al, const void* B,
                                     cublasLtMatrixLayout_t bl, const void* beta, const void* C,
                                     cublasLtMatrixLayout_t cl, void* D, cublasLtMatrixLayout_t dl,
                                     const cublasLtMatmulAlgo_t* algo, void* workspace,
                                     size_t workspace_bytes, cudaStream_t) {
  if (!h || !d || !al || !bl || !cl || !dl || !algo) return CUBLAS_STATUS_INVALID_VALUE;
  ++emu_lt::matmul_calls;
  emu_lt::Problem p{};
  if (const cublasStatus_t s = emu_lt::problem(*d, *al, *bl, *cl, *dl, p);
      s != CUBLAS_STATUS_SUCCESS)
    return s;
  // The algorithm runs only on operands it was chosen for.
  const void* ptrs[4] = {A, B, C, D};
  const emu_lt::Layout* ls[4] = {al, bl, cl, dl};
  for (int i = 0; i < 4; ++i)
    if (!emu_lt::aligned(ptrs[i], *ls[i], static_cast<uint32_t>(algo->data[i])))
      return CUBLAS_STATUS_INVALID_VALUE;
  if (algo->data[4] > 0 && (!workspace || workspace_bytes < algo->data[4]))
    return CUBLAS_STATUS_INVALID_VALUE;
  float a_s, b_s;
  std::memcpy(&a_s, alpha, 4);
  std::memcpy(&b_s, beta, 4);
  const bool ta = d->ta == CUBLAS_OP_T, tb = d->tb == CUBLAS_OP_T;
  const bool tf = d->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  const auto m = static_cast<int64_t>(p.m), n = static_cast<int64_t>(p.n),
             k = static_cast<int64_t>(p.k);
  std::vector<float> out(static_cast<size_t>(m * n));
  for (int64_t bi = 0; bi < p.batch; ++bi) {
    const int64_t oa = bi * al->stride, ob = bi * bl->stride, oc = bi * cl->stride;
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        double acc = 0;
        for (int64_t l = 0; l < k; ++l) {
          double x = emu_lt::load(A, al->type, oa + (ta ? l + i * al->ld : i + l * al->ld));
          double y = emu_lt::load(B, bl->type, ob + (tb ? j + l * bl->ld : l + j * bl->ld));
          if (tf) x = emu_lt::tf32(x), y = emu_lt::tf32(y);
          acc += x * y;
        }
        double v = a_s * acc;
        if (b_s != 0.f) v += double(b_s) * emu_lt::load(C, cl->type, oc + i + j * cl->ld);
        out[static_cast<size_t>(i + j * m)] = static_cast<float>(v);
      }
    // D may be C: written after every read of this batch matrix.
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i)
        emu_lt::store(D, dl->type, oc + i + j * dl->ld, out[static_cast<size_t>(i + j * m)]);
  }
  return CUBLAS_STATUS_SUCCESS;
}
