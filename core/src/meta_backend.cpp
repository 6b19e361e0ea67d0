#include "meta_backend.h"

#include <algorithm>
#include <bit>
#include <charconv>
#include <cstdint>
#include <cstring>

namespace mt {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Where every meta tensor "is": views add offsets below 2^40 to it.
constexpr uintptr_t kNowhere = uintptr_t{1} << 40;

}  // namespace

std::optional<DeviceProfile> named_device(const std::string& name, bool tf32) {
  // Memory: what cudaMemGetInfo leaves free to one process once the CUDA context exists (the
  // devices' totals less about 0.5-1 GiB); FLOP/s: the SXM data sheets' dense figures; links:
  // NVLink per direction (H100/H200 450 GB/s, A100 300 GB/s) and one InfiniBand NIC per GPU as
  // the DGX systems have (NDR 400 Gb/s = 50 GB/s; HDR 200 Gb/s = 25 GB/s for the A100s).
  struct Gpu {
    const char* name;
    double gib, bf16, tf32, f32, ici, dcn;
  };
  static constexpr Gpu kGpus[] = {
      {"h100-80gb", 78.5, 989e12, 494e12, 67e12, 450e9, 50e9},
      {"h200", 139.0, 989e12, 494e12, 67e12, 450e9, 50e9},
      {"a100-40gb", 39.0, 312e12, 156e12, 19.5e12, 300e9, 25e9},
      {"a100-80gb", 78.5, 312e12, 156e12, 19.5e12, 300e9, 25e9},
  };
  for (const auto& g : kGpus)
    if (name == g.name) {
      DeviceProfile p;
      p.name = g.name;
      p.bytes = static_cast<size_t>(g.gib * kGiB);
      p.peak_bf16 = g.bf16;
      p.peak_f32 = tf32 ? g.tf32 : g.f32;
      p.small_granule = 512;
      p.small_limit = size_t{1} << 20;
      p.ici_bytes_per_s = g.ici;
      p.dcn_bytes_per_s = g.dcn;
      return p;
    }
  // cpu-<N>gb: N GiB of host memory; its FLOP/s are the CPU backend's own (filled in by the
  // caller, which may load it).
  if (name.rfind("cpu-", 0) == 0 && name.size() > 6 &&
      name.compare(name.size() - 2, 2, "gb") == 0) {
    const char* b = name.data() + 4;
    const char* e = name.data() + name.size() - 2;
    double gib = 0;
    const auto r = std::from_chars(b, e, gib);
    if (r.ec == std::errc() && r.ptr == e && gib > 0 && gib < 1e6) {
      DeviceProfile p;
      p.name = name;
      p.bytes = static_cast<size_t>(gib * kGiB);
      return p;
    }
  }
  return std::nullopt;
}

std::string named_devices() {
  return "h100-80gb, h200, a100-40gb, a100-80gb, cpu-<N>gb";
}

size_t planned_block_size(const DeviceProfile& p, size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= p.small_limit)
    return (bytes + p.small_granule - 1) / p.small_granule * p.small_granule;
  const size_t step = bytes > (size_t{64} << 20) ? size_t{2} << 20 : std::bit_floor(bytes - 1) / 4;
  if (bytes > SIZE_MAX - step) return SIZE_MAX;
  return (bytes + step - 1) / step * step;
}

Tensor MetaBackend::empty(const Shape& shape, DType dtype) {
  const size_t bytes = planned_block_size(device_, shape_bytes(shape, dtype));
  stats_.bytes_in_use += bytes;
  stats_.peak_bytes_in_use = std::max(stats_.peak_bytes_in_use, stats_.bytes_in_use);
  ++stats_.num_system_allocs;
  // A fixed, aligned, non-null address that nothing reads: offsets of views stay valid
  // arithmetic, and a kernel that did read it would fault at once.
  auto* nowhere = reinterpret_cast<void*>(kNowhere);
  return Tensor(std::make_shared<Storage>(nowhere, bytes, this), shape, dtype);
}

void MetaBackend::release(void*, size_t bytes) {
  stats_.bytes_in_use -= bytes;
}

void MetaBackend::copy_to_host(const Tensor& src, void* dst) {
  // Into another meta tensor (offloaded optimizer state on a meta host): nothing to write.
  const auto d = reinterpret_cast<uintptr_t>(dst);
  if (d >= kNowhere && d < 2 * kNowhere) return;
  if (src.nbytes()) std::memset(dst, 0, src.nbytes());
}

MemoryStats MetaBackend::memory_stats() const {
  MemoryStats s = stats_;
  s.bytes_limit = device_.bytes;
  return s;
}

void MetaBackend::matmul(const Tensor& a, const Tensor& b, Tensor& c, bool trans_a, bool, float,
                         float) {
  if (!device_.f32_working_copies || a.ndim() < 2 || b.ndim() < 2) return;
  // As the CPU's GEMM (without AMX): c computed in f32, a widened, and b widened too except on
  // the matrix-vector paths (one row, or a few rows against shared bf16 weights), which read
  // the weights as they are.
  std::vector<Tensor> held;
  if (c.dtype() != DType::f32) held.push_back(empty(c.shape(), DType::f32));
  const int64_t m = trans_a ? a.dim(-1) : a.dim(-2);
  const bool shared_b = b.ndim() == 2;
  const int64_t rows = shared_b && !trans_a ? a.numel() / a.dim(-1) : m;
  const bool matvec = m == 1 || (shared_b && !trans_a && rows <= 4 && b.dtype() == DType::bf16);
  if (a.dtype() != DType::f32) held.push_back(empty(a.shape(), DType::f32));
  if (b.dtype() != DType::f32 && !matvec) held.push_back(empty(b.shape(), DType::f32));
}

void MetaBackend::matmul_q8(const Tensor& x, const Tensor& w, Tensor& y) {
  if (x.ndim() < 1 || w.ndim() != 2) return;
  const int64_t k = x.dim(-1), rows = k ? x.numel() / k : 0;
  // Both backends take up to 8 rows of x (decode) from the int8 rows in place.
  const bool prefill = rows > 8;
  if (!device_.f32_working_copies) {
    // As the CUDA backend's: a prefill multiplies the weights dequantized into a temporary
    // [N, K] of x's dtype.
    if (prefill) {
      const Tensor wx = empty({w.dim(0), k}, x.dtype());  // held for the call
    }
    return;
  }
  // As the CPU's int8 products: a prefill multiplies the rows dequantized to f32 (CPUs with AMX
  // or AVX512_BF16 pack them as bf16 within the GEMM instead: half that) by x as matmul does;
  // decode's few rows are widened to f32 and the results made in f32.
  if (prefill) {
    const Tensor wf = empty({w.dim(0), k}, DType::f32);
    Tensor y2 = y.view({rows, w.dim(0)});
    matmul(x.view({rows, k}), wf, y2, false, true);
    return;
  }
  std::vector<Tensor> held;
  if (x.dtype() != DType::f32) held.push_back(empty(x.shape(), DType::f32));
  if (y.dtype() != DType::f32) held.push_back(empty(y.shape(), DType::f32));
}

void MetaBackend::grouped_matmul_q8(const Tensor& x, const Tensor& w,
                                    const std::vector<int64_t>& counts, Tensor& y) {
  if (x.ndim() != 2 || w.ndim() != 3 || counts.size() != static_cast<size_t>(w.dim(0))) return;
  const bool few = std::all_of(counts.begin(), counts.end(), [](int64_t c) { return c <= 8; });
  if (device_.f32_working_copies && few) {
    std::vector<Tensor> held;
    if (x.dtype() != DType::f32) held.push_back(empty(x.shape(), DType::f32));
    if (y.dtype() != DType::f32) held.push_back(empty(y.shape(), DType::f32));
    return;
  }
  Backend::grouped_matmul_q8(x, w, counts, y);  // the composition: matmul_q8 (above) per expert
}

std::vector<Tensor> MetaAttention::copies(std::initializer_list<const Tensor*> ts) {
  std::vector<Tensor> r;
  if (!f32_copies_) return r;
  for (const Tensor* t : ts)
    if (t->defined() && t->dtype() != DType::f32) r.push_back(be_.empty(t->shape(), DType::f32));
  return r;
}

// The CPU flash kernels' tiles (plugins/backends/cpu/attention/flash.cpp: kBQ = kBK = 64
// query and key rows, FwdScratch::floats and BwdScratch::floats), one block per thread of the
// backend, taken for each call.
namespace {
constexpr int64_t kFlashRows = 64;
int64_t flash_forward_floats(int64_t d) {
  const int64_t b = kFlashRows;
  return 2 * b * d + d * b + b * b + 2 * b + 2 * b * d;
}
int64_t flash_backward_floats(int64_t d) {
  const int64_t b = kFlashRows;
  return 4 * b * d + b * d + 3 * b * b;
}
}  // namespace

Tensor MetaAttention::thread_scratch(int64_t floats) {
  if (name_ != "flash" || host_threads_ <= 0) return Tensor();
  return be_.empty({host_threads_, floats}, DType::f32);
}

void MetaAttention::forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&,
                            const Tensor&, const AttentionSpec&, Tensor& out, Tensor&) {
  const Tensor scratch = thread_scratch(flash_forward_floats(q.dim(-1)));
  const auto held = copies({&q, &k, &v, &out});
}

void MetaAttention::backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor&, const Tensor&, const Tensor& out, const Tensor& lse,
                             const AttentionSpec&, Tensor& dq, Tensor& dk, Tensor& dv) {
  const Tensor scratch = thread_scratch(flash_backward_floats(q.dim(-1)));
  auto held = copies({&q, &k, &v, &dout, &dq, &dk, &dv});
  if (f32_copies_) {
    held.push_back(be_.empty(lse.shape(), DType::f32));  // dO . O per query row
    const auto o = copies({&out});
  }
}

void MetaAttention::decode(const Tensor& q, const Tensor& k_cache, const Tensor&, const Tensor&,
                           const AttentionSpec&, Tensor& out) {
  // The CPU's kernels read a bf16 cache in place (flash a key block at a time, dot_product a
  // sequence's rows into host vectors); flash works on f32 copies of q and its output.
  if (name_ != "flash") return;
  const auto held = copies({&q, &out});
  const int64_t B = q.dim(0), T = q.dim(1), Hq = q.dim(2), D = q.dim(3), S = k_cache.dim(1);
  if (T != 1) {
    const Tensor scratch = thread_scratch(flash_forward_floats(D));
    return;
  }
  // One new token: chunks of at least kDecodeRows = 32 keys, at most kDecodeChunks = 64 a
  // sequence (flash.cpp's decode_rows), each chunk's partial results [Hq, D + 2], and per thread
  // the scaled query and a chunk's scores; the most chunks a step can take is a full cache's.
  const int64_t span = 32 * 64, rows = 32 * std::max<int64_t>(1, (S + span - 1) / span);
  const Tensor part = be_.empty({B * ((S + rows - 1) / rows) * Hq, D + 2}, DType::f32);
  const Tensor scratch = thread_scratch(Hq * (D + rows));
}

}  // namespace mt
