// The CUDA backend's matmul: operand checks, the f32 fallback for dtype mixes cuBLASLt does not
// take, and the GEMM itself through cuBLASLt with a plan cache (gemm.h). Host code only.
//
// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, so cuBLASLt gets mt's b as
// its A and mt's a as its B; a row-major [R, C] matrix is a column-major C x R matrix with
// leading dimension C.
#include "gemm.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <utility>

#include "device_io.cuh"
#include "kernels.h"
#include "mt/error.h"

namespace mt::cuda {

namespace {

Shape batch_dims(const Tensor& t) {
  return Shape(t.shape().begin(), t.shape().end() - 2);
}
cudaDataType_t cuda_type(DType d) {
  return d == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F;
}
size_t type_size(cudaDataType_t t) {
  return t == CUDA_R_16BF ? 2 : 4;
}

// The alignment in bytes (a power of two, at most 256) that every matrix of a strided batch has:
// what cuBLASLt's heuristic must assume of the pointer.
int64_t alignment(const void* p, int64_t stride, size_t elem, int64_t batch) {
  uint64_t v = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(p)) | 256u;
  if (batch > 1) v |= static_cast<uint64_t>(stride) * elem;
  return static_cast<int64_t>(v & (~v + 1));
}

// Destroys a preference descriptor on every path out of the heuristic query.
struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  ~Preference() {
    if (p) static_cast<void>(cublasLtMatmulPreferenceDestroy(p));
  }
};

}  // namespace

// A matmul descriptor (compute type, transposes) and the layouts of A, B and C (D shares C's),
// with the algorithm the heuristic chose for them.
struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  Plan() = default;
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;
  ~Plan() {
    if (c) static_cast<void>(cublasLtMatrixLayoutDestroy(c));
    if (b) static_cast<void>(cublasLtMatrixLayoutDestroy(b));
    if (a) static_cast<void>(cublasLtMatrixLayoutDestroy(a));
    if (desc) static_cast<void>(cublasLtMatmulDescDestroy(desc));
  }
};

Gemm::Gemm(cudaStream_t stream, MatmulPrecision precision, Tensor workspace)
    : stream_(stream), precision_(precision), workspace_(std::move(workspace)) {
  MT_CHECK(workspace_.defined() && workspace_.nbytes() >= kWorkspaceBytes,
           "cuda gemm: the workspace must hold " + std::to_string(kWorkspaceBytes) + " bytes");
  check(cublasLtCreate(&handle_), "init", "cublasLtCreate");
}

Gemm::~Gemm() {
  plans_.clear();  // descriptors first, then the handle
  if (handle_) static_cast<void>(cublasLtDestroy(handle_));
}

const Gemm::Plan& Gemm::plan(const Key& key, const GemmArgs& g, const std::string& op,
                             const std::function<std::string()>& shapes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;

  auto lt = [&](cublasStatus_t s, const char* what) { check(s, op, what, shapes()); };
  auto p = std::make_unique<Plan>();
  // Scale type f32: alpha and beta are host floats; accumulation is f32 for every compute type
  // used here.
  lt(cublasLtMatmulDescCreate(&p->desc, key.compute, CUDA_R_32F), "cublasLtMatmulDescCreate");
  const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
     "cublasLtMatmulDescSetAttribute(TRANSA)");
  lt(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
     "cublasLtMatmulDescSetAttribute(TRANSB)");
  // (A fused epilogue would be set here: CUBLASLT_MATMUL_DESC_EPILOGUE once per plan, and the
  // bias pointer, which changes per call, just before cublasLtMatmul.)

  auto layout = [&](cublasLtMatrixLayout_t& l, cudaDataType_t type, int64_t rows, int64_t cols,
                    int64_t ld, int64_t stride) {
    lt(cublasLtMatrixLayoutCreate(&l, type, static_cast<uint64_t>(rows),
                                  static_cast<uint64_t>(cols), ld),
       "cublasLtMatrixLayoutCreate");
    if (g.batch == 1) return;
    // Every matrix of a GEMM takes the same batch count; a stride of 0 repeats one matrix.
    const auto count = static_cast<int32_t>(g.batch);
    lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count,
                                        sizeof(count)),
       "cublasLtMatrixLayoutSetAttribute(BATCH_COUNT)");
    lt(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                        sizeof(stride)),
       "cublasLtMatrixLayoutSetAttribute(STRIDED_BATCH_OFFSET)");
  };
  // As stored, before op: op(A) is m x k, op(B) k x n.
  layout(p->a, g.ab_type, g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a);
  layout(p->b, g.ab_type, g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b);
  layout(p->c, g.c_type, g.m, g.n, g.ldc, g.stride_c);

  Preference pref;
  lt(cublasLtMatmulPreferenceCreate(&pref.p), "cublasLtMatmulPreferenceCreate");
  const uint64_t workspace = kWorkspaceBytes;
  lt(cublasLtMatmulPreferenceSetAttribute(pref.p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                          &workspace, sizeof(workspace)),
     "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)");
  // The heuristic assumes 256-byte aligned operands unless told otherwise.
  const auto align_a = static_cast<uint32_t>(key.align_a),
             align_b = static_cast<uint32_t>(key.align_b),
             align_c = static_cast<uint32_t>(key.align_c);
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const uint32_t*> aligns[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_c},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_c}};
  for (const auto& [attr, value] : aligns)
    lt(cublasLtMatmulPreferenceSetAttribute(pref.p, attr, value, sizeof(uint32_t)),
       "cublasLtMatmulPreferenceSetAttribute(MIN_ALIGNMENT)");

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(handle_, p->desc, p->a, p->b, p->c, p->c,
                                                          pref.p, 1, &result, &found);
  if (s == CUBLAS_STATUS_NOT_SUPPORTED ||
      (s == CUBLAS_STATUS_SUCCESS && (found < 1 || result.state != CUBLAS_STATUS_SUCCESS)))
    fail("cuda " + op + ": cuBLASLt found no algorithm for " + shapes() + " (compute type " +
         std::to_string(static_cast<int>(key.compute)) + ", alignments " + std::to_string(align_a) +
         "/" + std::to_string(align_b) + "/" + std::to_string(align_c) +
         " bytes; CUBLASLT_LOG_LEVEL=5 logs cuBLASLt's view of the call)");
  lt(s, "cublasLtMatmulAlgoGetHeuristic");
  p->algo = result.algo;
  return *plans_.emplace(key, std::move(p)).first->second;
}

void Gemm::run(const GemmArgs& g, const std::string& op,
               const std::function<std::string()>& shapes) {
  const cublasComputeType_t compute = g.ab_type == CUDA_R_32F && precision_ == MatmulPrecision::tf32
                                          ? CUBLAS_COMPUTE_32F_FAST_TF32
                                          : CUBLAS_COMPUTE_32F;
  const size_t ab = type_size(g.ab_type), cs = type_size(g.c_type);
  const bool batched = g.batch > 1;  // strides matter only then
  const Key key{.m = g.m,
                .n = g.n,
                .k = g.k,
                .lda = g.lda,
                .ldb = g.ldb,
                .ldc = g.ldc,
                .batch = g.batch,
                .stride_a = batched ? g.stride_a : 0,
                .stride_b = batched ? g.stride_b : 0,
                .stride_c = batched ? g.stride_c : 0,
                .align_a = alignment(g.a, g.stride_a, ab, g.batch),
                .align_b = alignment(g.b, g.stride_b, ab, g.batch),
                .align_c = alignment(g.c, g.stride_c, cs, g.batch),
                .ab_type = g.ab_type,
                .c_type = g.c_type,
                .compute = compute,
                .trans_a = g.trans_a,
                .trans_b = g.trans_b};
  const Plan& p = plan(key, g, op, shapes);
  // C and D are one buffer with one layout (cuBLASLt's in-place form). With beta = 0 cuBLASLt
  // does not read C (gpu_ops_test's Matmul poisons C with NaN to hold it to that).
  const cublasStatus_t s =
      cublasLtMatmul(handle_, p.desc, &g.alpha, g.a, p.a, g.b, p.b, &g.beta, g.c, p.c, g.c, p.c,
                     &p.algo, workspace_.data(), kWorkspaceBytes, stream_);
  if (s != CUBLAS_STATUS_SUCCESS) check(s, op, "cublasLtMatmul", shapes());
}

// ---- the Backend op ---------------------------------------------------------------------------

void matmul(const Ctx& c, const Tensor& a, const Tensor& b, Tensor& o, bool trans_a, bool trans_b,
            float alpha, float beta) {
  auto shapes = [&] {
    return "a " + str(a) + (trans_a ? "^T" : "") + ", b " + str(b) + (trans_b ? "^T" : "") +
           ", c " + str(o);
  };
  if (!is_fb(a) || !is_fb(b) || !is_fb(o) || a.ndim() < 2 || b.ndim() < 2 || o.ndim() < 2)
    fail("cuda matmul: " + shapes() +
         ": operands must be f32 or bf16 tensors of at least 2 dimensions");
  int64_t m = trans_a ? a.dim(-1) : a.dim(-2);
  const int64_t k = trans_a ? a.dim(-2) : a.dim(-1);
  const int64_t kb = trans_b ? b.dim(-1) : b.dim(-2);
  const int64_t n = trans_b ? b.dim(-2) : b.dim(-1);
  const Shape lead = batch_dims(a);
  const bool shared_b = b.ndim() == 2;
  if (k != kb || o.dim(-2) != m || o.dim(-1) != n || batch_dims(o) != lead ||
      (!shared_b && batch_dims(b) != lead))
    fail("cuda matmul: " + shapes() +
         ": shapes do not agree (a [..., M, K], b [..., K, N] or 2-D, c [..., M, N])");
  int64_t batch = shape_numel(lead);
  if (batch == 0 || m == 0 || n == 0) return;

  // cuBLASLt takes A and B of one type, and C f32 or of that type. Other mixes run in f32 on
  // widened copies (exact: bf16 -> f32 loses nothing) and round once at the end.
  const bool native =
      a.dtype() == b.dtype() && (a.dtype() == DType::bf16 || o.dtype() == DType::f32);
  if (!native) {
    auto widen = [&](const Tensor& t, bool copy) {
      if (t.dtype() == DType::f32) return t;
      Tensor w = c.scratch(t.shape(), DType::f32);
      if (copy) cast(c, t, w);
      return w;
    };
    Tensor a32 = widen(a, true), b32 = widen(b, true), c32 = widen(o, beta != 0.f);
    matmul(c, a32, b32, c32, trans_a, trans_b, alpha, beta);
    if (!c32.same_as(o)) cast(c, c32, o);
    return;
  }

  // K = 0: the product is empty and c = beta c (cuBLASLt would refuse the leading dimension 0).
  if (k == 0) {
    if (beta == 0.f)
      fill(c, o, 0.f);
    else
      scale(c, o, beta, o);
    return;
  }
  // Decode's few rows against a weight's [N, K] rows: rows_gemv_kernel where it is chosen
  // (MT_CUDA_ROWS_GEMV=1) and suits the call.
  if (matmul_rows_gemv(c, a, b, o, trans_a, trans_b, alpha, beta)) return;
  // A batch against one shared b with a untransposed is one tall GEMM.
  if (shared_b && !trans_a && batch > 1) {
    m *= batch;
    batch = 1;
  }
  if (std::max({m, n, k, batch}) > INT_MAX)
    fail("cuda matmul: " + shapes() + ": a dimension exceeds 2^31 - 1");

  GemmArgs g{};
  g.a = b.data();  // cuBLASLt's A is mt's b, its B is mt's a (see the top of this file)
  g.b = a.data();
  g.c = o.data();
  g.ab_type = cuda_type(a.dtype());
  g.c_type = cuda_type(o.dtype());
  g.trans_a = trans_b;
  g.trans_b = trans_a;
  g.m = n;
  g.n = m;
  g.k = k;
  g.lda = trans_b ? k : n;
  g.ldb = trans_a ? m : k;
  g.ldc = n;
  g.stride_a = shared_b ? 0 : k * n;
  g.stride_b = m * k;
  g.stride_c = m * n;
  g.batch = batch;
  g.alpha = alpha;
  g.beta = beta;
  // One reference captured: the std::function built from it needs no heap allocation.
  c.gemm->run(g, "matmul", [&shapes] { return shapes(); });
}

}  // namespace mt::cuda
