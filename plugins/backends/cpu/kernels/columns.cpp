// columns: copy_columns, the kernel of split and concat on the last dimension (a strided copy of
// a block of columns from one matrix into another, or its accumulation in the backward).
#include <fmt/format.h>
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

int64_t lead_rows(const Tensor& t) {
  int64_t n = 1;
  for (int i = 0; i + 1 < t.ndim(); ++i) n *= t.shape()[static_cast<size_t>(i)];
  return n;
}

constexpr int64_t kTaskElems = 1 << 14;    // elements per task (rows are grouped up to this)
constexpr int64_t kSerialElems = 1 << 15;  // below this, one thread

MT_CLONES void add_f32(const float* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] += s[i];
}

}  // namespace

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width,
                  bool accumulate) {
  constexpr const char* op = "copy_columns";
  if (!src.defined() || !dst.defined() || src.ndim() < 1 || dst.ndim() < 1 || !is_fb(src.dtype()) ||
      !is_fb(dst.dtype()))
    fail(fmt::format("{}: src {} and dst {} must be f32 or bf16 matrices [N, Ds] and [N, Dd]", op,
                     src.defined() ? src.str() : "none", dst.defined() ? dst.str() : "none"));
  const int64_t ds = src.dim(-1), dd = dst.dim(-1), N = lead_rows(src);
  if (N != lead_rows(dst) || width < 0 || src_col < 0 || dst_col < 0 || src_col + width > ds ||
      dst_col + width > dd)
    fail(fmt::format(
        "{}: columns [{}, {}) of src {} to columns [{}, {}) of dst {} (want the same rows and "
        "columns inside both)",
        op, src_col, src_col + width, src.str(), dst_col, dst_col + width, dst.str()));
  if (width == 0 || N == 0) return;

  const bool same = src.dtype() == dst.dtype();
  const size_t es = dtype_size(src.dtype());
  auto rows = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t so = r * ds + src_col, dof = r * dd + dst_col;
      if (!accumulate && same) {
        std::memcpy(static_cast<char*>(dst.data()) + static_cast<size_t>(dof) * es,
                    static_cast<const char*>(src.data()) + static_cast<size_t>(so) * es,
                    static_cast<size_t>(width) * es);
        continue;
      }
      // Through f32: slot 0 holds the source row, slot 1 the destination's (bf16 only).
      const float* s = row_in(src, so, width, scratch(0, width));
      float* d = row_out(dst, dof, width, scratch(1, width), accumulate);
      if (accumulate)
        add_f32(s, d, width);
      else if (d != s)
        std::memcpy(d, s, static_cast<size_t>(width) * sizeof(float));
      row_store(dst, dof, width, d);
    }
  };
  if (N * width <= kSerialElems) {
    rows(0, N);
    return;
  }
  const int64_t grain = std::max<int64_t>(1, kTaskElems / width);
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, grain),
                    [&](const auto& r) { rows(r.begin(), r.end()); });
}

}  // namespace mt::cpu
