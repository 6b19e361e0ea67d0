// embedding: row lookup and its scatter-add backward.
//
// The backward groups tokens by id (a stable counting sort) and gives each distinct id to one
// task, which adds that id's rows in token order: no atomics, no races, and the summation order
// is fixed by the ids alone, so results do not depend on the thread count at all.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"
#include "mt/q8.h"

namespace mt::cpu {
namespace {

constexpr int64_t kTokenGrain = 16;  // rows per task

MT_CLONES void add_n(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

// Throws naming the first id outside [0, V).
void check_ids(const char* op, const Tensor& ids, int64_t V) {
  MT_CHECK(ids.dtype() == DType::i32,
           std::string("cpu ") + op + ": ids must be i32, got " + ids.str());
  const int32_t* id = ids.ptr<const int32_t>();
  for (int64_t n = 0; n < ids.numel(); ++n) {
    if (id[n] < 0 || id[n] >= V)
      throw Error(std::string("cpu ") + op + ": token id " + std::to_string(id[n]) +
                  " at position " + std::to_string(n) + " is outside the vocabulary [0, " +
                  std::to_string(V) + ")");
  }
}

}  // namespace

// table [V, D], ids [N] i32, out [N, D]
void embedding_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  MT_CHECK(
      table.ndim() == 2 && is_fb(table.dtype()) && is_fb(out.dtype()) &&
          out.numel() == ids.numel() * table.dim(1),
      "cpu embedding_forward: table " + table.str() + ", ids " + ids.str() + ", out " + out.str());
  const int64_t V = table.dim(0), D = table.dim(1), N = ids.numel();
  check_ids("embedding_forward", ids, V);
  const int32_t* id = ids.ptr<const int32_t>();
  const DType td = table.dtype(), od = out.dtype();
  const size_t es = dtype_size(td);
  const char* tab = static_cast<const char*>(table.data());
  char* o = static_cast<char*>(out.data());
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kTokenGrain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const char* src = tab + static_cast<size_t>(id[n] * D) * es;
                        const size_t dst_off = static_cast<size_t>(n * D);
                        if (td == od) {
                          std::memcpy(o + dst_off * es, src, static_cast<size_t>(D) * es);
                        } else if (td == DType::bf16) {
                          bf16_to_f32_n(reinterpret_cast<const uint16_t*>(src),
                                        reinterpret_cast<float*>(o) + dst_off, D);
                        } else {
                          f32_to_bf16_n(reinterpret_cast<const float*>(src),
                                        reinterpret_cast<uint16_t*>(o) + dst_off, D);
                        }
                      }
                    });
}

// table i8 [V, D + D / 16] (int8 rows, mt/q8.h), ids [N] i32, out [N, D] f32 or bf16
void embedding_q8_forward(const Tensor& table, const Tensor& ids, Tensor& out) {
  const int64_t rb = table.ndim() == 2 ? table.dim(1) : 0, D = q8_row_values(rb);
  MT_CHECK(table.dtype() == DType::i8 && table.ndim() == 2 && D > 0 && q8_row_bytes(D) == rb &&
               is_fb(out.dtype()) && out.numel() == ids.numel() * D,
           "cpu embedding_q8_forward: table " + table.str() + ", ids " + ids.str() + ", out " +
               out.str() + " (want table i8 [V, D + D / 16] with D a multiple of 32, out [N, D])");
  const int64_t V = table.dim(0), N = ids.numel();
  check_ids("embedding_q8_forward", ids, V);
  const int32_t* id = ids.ptr<const int32_t>();
  const int8_t* tab = table.ptr<const int8_t>();
  const bool f32 = out.dtype() == DType::f32;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, N, kTokenGrain),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      std::vector<float> buf(f32 ? 0 : static_cast<size_t>(D));
                      for (int64_t n = r.begin(); n < r.end(); ++n) {
                        const int8_t* src = tab + static_cast<int64_t>(id[n]) * rb;
                        if (f32) {
                          dequantize_q8_row(src, D, out.ptr<float>() + n * D);
                        } else {
                          dequantize_q8_row(src, D, buf.data());
                          f32_to_bf16_n(buf.data(), out.ptr<uint16_t>() + n * D, D);
                        }
                      }
                    });
}

// dout [N, D], ids [N] i32, dtable [V, D]: dtable[ids[n]] += dout[n]
void embedding_backward(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  MT_CHECK(dtable.ndim() == 2 && is_fb(dtable.dtype()) && is_fb(dout.dtype()) &&
               dout.numel() == ids.numel() * dtable.dim(1),
           "cpu embedding_backward: dout " + dout.str() + ", ids " + ids.str() + ", dtable " +
               dtable.str());
  const int64_t V = dtable.dim(0), D = dtable.dim(1), N = ids.numel();
  check_ids("embedding_backward", ids, V);
  if (N == 0 || D == 0) return;
  const int32_t* id = ids.ptr<const int32_t>();

  // Stable counting sort of token positions by id: first[k]..first[k+1] are the tokens of the
  // k-th distinct id, in increasing token order.
  std::vector<int64_t> count(static_cast<size_t>(V) + 1, 0);
  for (int64_t n = 0; n < N; ++n) ++count[static_cast<size_t>(id[n]) + 1];
  for (int64_t v = 0; v < V; ++v) count[v + 1] += count[v];
  std::vector<int64_t> order(static_cast<size_t>(N));
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    for (int64_t n = 0; n < N; ++n) order[static_cast<size_t>(next[id[n]]++)] = n;
  }
  std::vector<int64_t> first;  // start of each distinct id's run in `order`, plus the end
  first.reserve(static_cast<size_t>(N) + 1);
  for (int64_t i = 0; i < N; ++i)
    if (i == 0 || id[order[i]] != id[order[i - 1]]) first.push_back(i);
  first.push_back(N);
  const int64_t runs = static_cast<int64_t>(first.size()) - 1;

  const bool dout_f32 = dout.dtype() == DType::f32, tab_f32 = dtable.dtype() == DType::f32;
  tbb::parallel_for(tbb::blocked_range<int64_t>(0, runs, 4),
                    [&](const tbb::blocked_range<int64_t>& r) {
                      // Row scratch (D floats each), once per task: the id's rows summed first,
                      // then the sum added to its row of dtable once, so a gradient accumulated
                      // over micro-batches is the micro-batches' sums added, as data
                      // parallelism's ranks add them.
                      std::vector<float> sum(static_cast<size_t>(D));
                      std::vector<float> acc(tab_f32 ? 0 : static_cast<size_t>(D));
                      std::vector<float> row(dout_f32 ? 0 : static_cast<size_t>(D));
                      for (int64_t k = r.begin(); k < r.end(); ++k) {
                        const int64_t v = id[order[first[k]]];
                        std::fill(sum.begin(), sum.end(), 0.f);
                        for (int64_t i = first[k]; i < first[k + 1]; ++i) {
                          const int64_t n = order[i];
                          const float* src = row.data();
                          if (dout_f32)
                            src = dout.ptr<const float>() + n * D;
                          else
                            bf16_to_f32_n(dout.ptr<const uint16_t>() + n * D, row.data(), D);
                          add_n(src, sum.data(), D);
                        }
                        float* dst = tab_f32 ? dtable.ptr<float>() + v * D : acc.data();
                        uint16_t* dst16 = tab_f32 ? nullptr : dtable.ptr<uint16_t>() + v * D;
                        if (!tab_f32) bf16_to_f32_n(dst16, dst, D);
                        add_n(sum.data(), dst, D);
                        if (!tab_f32) f32_to_bf16_n(dst, dst16, D);
                      }
                    });
}

}  // namespace mt::cpu
