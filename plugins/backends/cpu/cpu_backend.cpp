// CpuBackend: identity, memory, and forwarding of every kernel into the backend's oneTBB arena.
#include "cpu_backend.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <optional>

#include "kernels/kernels.h"
#include "mt/config.h"
#include "mt/error.h"

namespace mt::cpu {

namespace {
// More threads than CPUs (num_threads above the affinity mask's count): oneTBB's default limit,
// the CPU count, would run only that many and print a warning, so the limit is raised to the
// request, as PyTorch's set_num_threads and llama.cpp's -t run what they are given.
std::optional<tbb::global_control> raise_worker_limit(int num_threads) {
  using gc = tbb::global_control;
  if (static_cast<size_t>(num_threads) <= gc::active_value(gc::max_allowed_parallelism))
    return std::nullopt;
  return std::optional<gc>(std::in_place, gc::max_allowed_parallelism,
                           static_cast<size_t>(num_threads));
}
}  // namespace

CpuBackend::CpuBackend(int num_threads)
    : num_threads_(num_threads),
      cpus_(cpu_threads(Config{})),  // num_threads unset: the affinity mask's CPUs
      workers_(raise_worker_limit(num_threads)),
      arena_(num_threads) {}
CpuBackend::~CpuBackend() = default;

void* CpuBackend::extension(const char* name) {
  const std::string_view n(name);
  if (n == "mt.matvec_rows_layout") return this;
  // grouped_matmul's few rows an expert take the same kernels, so experts' weights stream
  // faster stored [E, N, K] (trans_w) as well.
  if (n == "mt.grouped_rows_layout") return this;
  // bf16 rows against bf16 [N, K] weights on dot products: the [N, K] layout pays for up to 8
  // rows too (ModelRunner::rows_layout_pays).
  if (n == "mt.matvec_rows_bf16dot") return few_rows_bf16dot() ? this : nullptr;
  return nullptr;
}

std::string CpuBackend::describe() const {
  const std::string over =
      num_threads_ > cpus_ ? fmt::format(", more than the {} CPUs it may use", cpus_) : "";
  return fmt::format("cpu: {} thread{} (oneTBB{}), GEMM: {}", num_threads_,
                     num_threads_ == 1 ? "" : "s", over, gemm_describe());
}

namespace {
// The host's RAM, or the cgroup's memory limit when that is lower (a container's).
size_t host_memory_limit_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  size_t limit = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
  for (const char* f :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(f);
    unsigned long long v = 0;
    if (in >> v && v > 0 && (limit == 0 || v < limit)) limit = static_cast<size_t>(v);
  }
  return limit;
}
}  // namespace

size_t CpuBackend::host_memory_limit() const {
  std::call_once(limit_once_, [this] { limit_ = host_memory_limit_bytes(); });
  return limit_;
}

// Threads beyond the CPUs share them: the peak is the CPUs' (MFU would otherwise shrink).
double CpuBackend::peak_flops(DType dtype) const {
  return cpu_peak_flops(dtype, std::min(num_threads_, cpus_));
}

Tensor CpuBackend::empty(const Shape& shape, DType dtype) {
  const size_t bytes = shape_bytes(shape, dtype);  // throws for negative or overflowing shapes
  void* p = alloc_.allocate(bytes);
  return Tensor(std::make_shared<Storage>(p, CachingAllocator::round_size(bytes), this), shape,
                dtype);
}

void CpuBackend::release(void* data, size_t bytes) { alloc_.release(data, bytes); }

void CpuBackend::copy_from_host(Tensor& dst, const void* src) {
  if (dst.nbytes()) std::memcpy(dst.data(), src, dst.nbytes());
}
void CpuBackend::copy_to_host(const Tensor& src, void* dst) {
  if (src.nbytes()) std::memcpy(dst, src.data(), src.nbytes());
}
MemoryStats CpuBackend::memory_stats() const {
  MemoryStats s = alloc_.stats();
  s.bytes_limit = host_memory_limit();
  return s;
}
void CpuBackend::reset_peak_memory() { alloc_.reset_peak(); }
void CpuBackend::release_cached_memory() {
  alloc_.release_cached();
}

void CpuBackend::fill(Tensor& x, float value) {
  run([&] { cpu::fill(x, value); });
}

void CpuBackend::cast(const Tensor& src, Tensor& dst) {
  run([&] { cpu::cast(src, dst); });
}

void CpuBackend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  run([&] { cpu::add(a, b, out); });
}

void CpuBackend::mul(const Tensor& a, const Tensor& b, Tensor& out) {
  run([&] { cpu::mul(a, b, out); });
}

void CpuBackend::scale(const Tensor& x, float s, Tensor& out) {
  run([&] { cpu::scale(x, s, out); });
}

void CpuBackend::axpy(float alpha, const Tensor& x, Tensor& y) {
  run([&] { cpu::axpy(alpha, x, y); });
}

double CpuBackend::sum(const Tensor& x) {
  double r = 0;
  run([&] { r = cpu::sum(x); });
  return r;
}

double CpuBackend::sum_squares(const Tensor& x) {
  double r = 0;
  run([&] { r = cpu::sum_squares(x); });
  return r;
}

void CpuBackend::sum_squares_each(const std::vector<const Tensor*>& xs, std::vector<double>& sums) {
  sums.resize(xs.size());
  run([&] {
    for (size_t i = 0; i < xs.size(); ++i) sums[i] = cpu::sum_squares(*xs[i]);
  });
}

void CpuBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool trans_b, float alpha, float beta) {
  run([&] { cpu::matmul(a, b, c, trans_a, trans_b, alpha, beta); });
}

void CpuBackend::embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  run([&] { cpu::embedding_forward(table, ids, out); });
}

void CpuBackend::embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  run([&] { cpu::embedding_backward(dout, ids, dtable); });
}

void CpuBackend::embedding_q8_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  run([&] { cpu::embedding_q8_forward(table, ids, out); });
}

void CpuBackend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, bool plus_one, Tensor& out, Tensor& rstd) {
  run([&] { cpu::rmsnorm_forward(x, w, eps, plus_one, out, rstd); });
}

void CpuBackend::rmsnorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& rstd, bool plus_one, Tensor& dx, Tensor& dw) {
  run([&] { cpu::rmsnorm_backward(dout, x, w, rstd, plus_one, dx, dw); });
}

void CpuBackend::layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, float eps, Tensor& out, Tensor& mean, Tensor& rstd) {
  run([&] { cpu::layernorm_forward(x, w, b, eps, out, mean, rstd); });
}

void CpuBackend::layernorm_backward(const Tensor& dout, const Tensor& x, const Tensor& w, const Tensor& mean, const Tensor& rstd, Tensor& dx, Tensor& dw, Tensor& db) {
  run([&] { cpu::layernorm_backward(dout, x, w, mean, rstd, dx, dw, db); });
}

void CpuBackend::rope_forward(const Tensor& x, const Tensor& positions, const RopeSpec& spec, Tensor& out) {
  run([&] { cpu::rope_forward(x, positions, spec, out); });
}

void CpuBackend::rope_backward(const Tensor& dout, const Tensor& positions, const RopeSpec& spec, Tensor& dx) {
  run([&] { cpu::rope_backward(dout, positions, spec, dx); });
}

void CpuBackend::activation_forward(Activation act, const Tensor& x, Tensor& out) {
  run([&] { cpu::activation_forward(act, x, out); });
}

void CpuBackend::activation_backward(Activation act, const Tensor& dout, const Tensor& x, Tensor& dx) {
  run([&] { cpu::activation_backward(act, dout, x, dx); });
}

void CpuBackend::gated_forward(Activation act, const Tensor& gate, const Tensor& up, Tensor& out) {
  run([&] { cpu::gated_forward(act, gate, up, out); });
}

void CpuBackend::gated_backward(Activation act, const Tensor& dout, const Tensor& gate, const Tensor& up, Tensor& dgate, Tensor& dup) {
  run([&] { cpu::gated_backward(act, dout, gate, up, dgate, dup); });
}

void CpuBackend::softcap_forward(const Tensor& x, float cap, Tensor& out) {
  run([&] { cpu::softcap_forward(x, cap, out); });
}

void CpuBackend::softcap_backward(const Tensor& dout, const Tensor& out, float cap, Tensor& dx) {
  run([&] { cpu::softcap_backward(dout, out, cap, dx); });
}

void CpuBackend::softmax_forward(const Tensor& x, Tensor& out) {
  run([&] { cpu::softmax_forward(x, out); });
}

void CpuBackend::softmax_backward(const Tensor& dout, const Tensor& out, Tensor& dx) {
  run([&] { cpu::softmax_backward(dout, out, dx); });
}

void CpuBackend::cross_entropy_forward(const Tensor& logits, const Tensor& targets, float z_loss, Tensor& loss, Tensor& lse) {
  run([&] { cpu::cross_entropy_forward(logits, targets, z_loss, loss, lse); });
}

void CpuBackend::cross_entropy_backward(const Tensor& dloss, const Tensor& logits, const Tensor& targets, const Tensor& lse, float z_loss, Tensor& dlogits) {
  run([&] { cpu::cross_entropy_backward(dloss, logits, targets, lse, z_loss, dlogits); });
}

void CpuBackend::topk_route_forward(const Tensor& logits, int k, bool sigmoid, bool normalize, Tensor& weights, Tensor& indices, Tensor& probs) {
  run([&] { cpu::topk_route_forward(logits, k, sigmoid, normalize, weights, indices, probs); });
}

void CpuBackend::topk_route_backward(const Tensor& dweights, const Tensor& weights, const Tensor& indices, const Tensor& probs, bool sigmoid, bool normalize, Tensor& dlogits) {
  run([&] { cpu::topk_route_backward(dweights, weights, indices, probs, sigmoid, normalize, dlogits); });
}

void CpuBackend::matmul_q8(const Tensor& x, const Tensor& w, Tensor& y) {
  run([&] { cpu::matmul_q8(x, w, y); });
}

void CpuBackend::copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                              int64_t width, bool accumulate) {
  run([&] { cpu::copy_columns(src, src_col, dst, dst_col, width, accumulate); });
}

// The core's composition (a copy_columns each, each parallel over rows): on the CPU one pass per
// piece costs what one pass over all would, and there are no launches to save.
void CpuBackend::split_columns(const Tensor& src, std::vector<Tensor>& pieces) {
  Backend::split_columns(src, pieces);
}

// The core's composition (a scatter_rows each), as split_columns above.
void CpuBackend::scatter_rows_each(const std::vector<Tensor>& srcs, const Tensor& idx,
                                   std::vector<Tensor>& outs) {
  Backend::scatter_rows_each(srcs, idx, outs);
}

void CpuBackend::fill_random(Tensor& out, const RandomFill& spec) {
  run([&] { cpu::fill_random(out, spec); });
}

void CpuBackend::gather_rows(const Tensor& x, const Tensor& idx, Tensor& out) {
  run([&] { cpu::gather_rows(x, idx, out); });
}

void CpuBackend::scatter_add_rows(const Tensor& src, const Tensor& idx, const Tensor& w, Tensor& out) {
  run([&] { cpu::scatter_add_rows(src, idx, w, out); });
}
void CpuBackend::scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  run([&] { cpu::scatter_rows(src, idx, out); });
}
void CpuBackend::scatter_rows_q8(const Tensor& src, const Tensor& idx, Tensor& q, Tensor& scales) {
  run([&] { cpu::scatter_rows_q8(src, idx, q, scales); });
}
void CpuBackend::dequantize_rows_q8(const Tensor& q, const Tensor& scales, Tensor& out) {
  run([&] { cpu::dequantize_rows_q8(q, scales, out); });
}

void CpuBackend::grouped_matmul(const Tensor& x, const Tensor& w, const Tensor& offsets, bool trans_w, Tensor& out) {
  run([&] { cpu::grouped_matmul(x, w, offsets, trans_w, out); });
}

void CpuBackend::grouped_matmul_q8(const Tensor& x, const Tensor& w,
                                   const std::vector<int64_t>& counts, Tensor& out) {
  run([&] { cpu::grouped_matmul_q8(x, w, counts, out); });
}

void CpuBackend::grouped_matmul_weight_grad(const Tensor& x, const Tensor& dout, const Tensor& offsets, bool trans_w, Tensor& dw) {
  run([&] { cpu::grouped_matmul_weight_grad(x, dout, offsets, trans_w, dw); });
}

void CpuBackend::adamw_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p) {
  run([&] { cpu::adamw_update(param, grad, m, v, p); });
}

}  // namespace mt::cpu
