// elementwise: fill, cast, add, mul, scale, axpy, sum, sum_squares.
//
// Every op streams over the flat element range in fixed chunks. f32 operands are used in place;
// bf16 operands are converted chunk by chunk into f32 stack buffers, so arithmetic is always f32
// and one set of loops serves every dtype mix. Hot loops are separate functions compiled thrice
// (generic x86-64, x86-64-v3 and x86-64-v4, picked at load time) because the build targets generic
// x86-64.
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/simd.h"
#include "mt/error.h"

namespace mt::cpu {
namespace {

constexpr int64_t kChunk = 2048;        // elements per task and per stack buffer (8 KiB in f32)
constexpr int64_t kSumBlock = 1 << 16;  // elements per partial sum: fixed so sums are reproducible

using In = ChunkIn<kChunk>;
using Out = ChunkOut<kChunk>;

MT_CLONES void add_n(const float* a, const float* b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
}
MT_CLONES void mul_n(const float* a, const float* b, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = a[i] * b[i];
}
MT_CLONES void scale_n(const float* x, float s, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] * s;
}
MT_CLONES void axpy_n(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Sums in double with 8 independent lanes (explicit, so the order is fixed and vectorisable).
MT_CLONES double sum_n(const float* x, int64_t n, bool squares) {
  double acc[8] = {};
  int64_t i = 0;
  if (squares) {
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += double(x[i + j]) * double(x[i + j]);
    for (; i < n; ++i) acc[0] += double(x[i]) * double(x[i]);
  } else {
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) acc[j] += double(x[i + j]);
    for (; i < n; ++i) acc[0] += double(x[i]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Operands are flat, contiguous element ranges here, so equal element counts suffice (a view
// reshaped by the caller, e.g. [B, T, D] against [B * T, D], is accepted).
void check_same(const char* op, const Tensor& a, const Tensor& b) {
  MT_CHECK(a.numel() == b.numel() && is_fb(a.dtype()) && is_fb(b.dtype()),
           std::string("cpu ") + op + ": operands " + a.str() + " and " + b.str() +
               " must have the same element count and be f32 or bf16");
}

double reduce(const Tensor& x, bool squares, const char* op) {
  MT_CHECK(is_fb(x.dtype()), std::string("cpu ") + op + ": unsupported tensor " + x.str());
  const int64_t n = x.numel();
  const int64_t nblocks = (n + kSumBlock - 1) / kSumBlock;
  std::vector<double> partial(static_cast<size_t>(nblocks), 0.0);
  tbb::parallel_for(int64_t(0), nblocks, [&](int64_t blk) {
    const int64_t b0 = blk * kSumBlock, b1 = std::min(n, b0 + kSumBlock);
    double s = 0;
    for (int64_t c = b0; c < b1; c += kChunk) {
      const int64_t len = std::min(kChunk, b1 - c);
      In in(x, c, len);
      s += sum_n(in.get(), len, squares);
    }
    partial[static_cast<size_t>(blk)] = s;
  });
  double total = 0;  // serial, in block order: independent of the schedule
  for (double p : partial) total += p;
  return total;
}

}  // namespace

void fill(Tensor& x, float value) {
  const int64_t n = x.numel();
  switch (x.dtype()) {
    case DType::f32: {
      float* p = x.ptr<float>();
      for_chunks<kChunk>(n, [&](int64_t b, int64_t len) { std::fill_n(p + b, len, value); });
      return;
    }
    case DType::bf16: {
      uint16_t* p = x.ptr<uint16_t>();
      uint16_t v;
      f32_to_bf16_n(&value, &v, 1);
      for_chunks<kChunk>(n, [&](int64_t b, int64_t len) { std::fill_n(p + b, len, v); });
      return;
    }
    case DType::i32: {
      int32_t* p = x.ptr<int32_t>();
      const auto v = static_cast<int32_t>(value);
      for_chunks<kChunk>(n, [&](int64_t b, int64_t len) { std::fill_n(p + b, len, v); });
      return;
    }
    default:
      fail("cpu fill: unsupported tensor " + x.str());
  }
}

void cast(const Tensor& src, Tensor& dst) {
  MT_CHECK(src.numel() == dst.numel(),
           "cpu cast: element counts differ: " + src.str() + " -> " + dst.str());
  const int64_t n = src.numel();
  if (src.dtype() == dst.dtype()) {
    // A plain copy of any dtype (i32 included), in chunks of kChunk elements.
    const size_t es = dtype_size(src.dtype());
    const char* s = static_cast<const char*>(src.data());
    char* d = static_cast<char*>(dst.data());
    if (s == d) return;
    for_chunks<kChunk>(n, [&](int64_t b, int64_t len) {
      std::memcpy(d + b * es, s + b * es, static_cast<size_t>(len) * es);
    });
    return;
  }
  if (src.dtype() == DType::f32 && dst.dtype() == DType::bf16) {
    const float* s = src.ptr<const float>();
    uint16_t* d = dst.ptr<uint16_t>();
    for_chunks<kChunk>(n, [&](int64_t b, int64_t len) { f32_to_bf16_n(s + b, d + b, len); });
    return;
  }
  if (src.dtype() == DType::bf16 && dst.dtype() == DType::f32) {
    const uint16_t* s = src.ptr<const uint16_t>();
    float* d = dst.ptr<float>();
    for_chunks<kChunk>(n, [&](int64_t b, int64_t len) { bf16_to_f32_n(s + b, d + b, len); });
    return;
  }
  fail("cpu cast: unsupported conversion " + src.str() + " -> " + dst.str());
}

void add(const Tensor& a, const Tensor& b, Tensor& out) {
  check_same("add", a, b);
  check_same("add", a, out);
  for_chunks<kChunk>(a.numel(), [&](int64_t c, int64_t len) {
    In ia(a, c, len), ib(b, c, len);
    Out o(out, c, len, false);
    add_n(ia.get(), ib.get(), o.get(), len);
    o.store();
  });
}

void mul(const Tensor& a, const Tensor& b, Tensor& out) {
  check_same("mul", a, b);
  check_same("mul", a, out);
  for_chunks<kChunk>(a.numel(), [&](int64_t c, int64_t len) {
    In ia(a, c, len), ib(b, c, len);
    Out o(out, c, len, false);
    mul_n(ia.get(), ib.get(), o.get(), len);
    o.store();
  });
}

void scale(const Tensor& x, float s, Tensor& out) {
  check_same("scale", x, out);
  for_chunks<kChunk>(x.numel(), [&](int64_t c, int64_t len) {
    In ix(x, c, len);
    Out o(out, c, len, false);
    scale_n(ix.get(), s, o.get(), len);
    o.store();
  });
}

void axpy(float alpha, const Tensor& x, Tensor& y) {
  MT_CHECK(x.numel() == y.numel() && is_fb(x.dtype()) && is_fb(y.dtype()),
           "cpu axpy: operands " + x.str() + " and " + y.str() +
               " must have the same element count and be f32 or bf16");
  for_chunks<kChunk>(x.numel(), [&](int64_t c, int64_t len) {
    In ix(x, c, len);
    Out o(y, c, len, true);
    axpy_n(alpha, ix.get(), o.get(), len);
    o.store();
  });
}

double sum(const Tensor& x) {
  return reduce(x, false, "sum");
}
double sum_squares(const Tensor& x) {
  return reduce(x, true, "sum_squares");
}

}  // namespace mt::cpu
