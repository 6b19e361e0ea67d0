// Tensor parallelism's split of a tensor into equal parts along one dimension, shared by the
// runner (cutting a rank's part) and the checkpoints (pieces of parts to and from the whole).
// The tensor is seen as a matrix [rows, cols], cols the product of the dimensions from `dim`
// on; part t is the columns [t width, (t + 1) width), width = cols / parts. parts = 1 (or dim
// < 0): the whole tensor, one row.
#pragma once

#include <algorithm>
#include <cstdint>

#include "mt/tensor.h"

namespace mt {

struct Split {
  int64_t rows = 1, cols = 0, width = 0;
};

inline Split split_of(const Shape& shape, int dim, int parts) {
  const int64_t n = shape_numel(shape);
  if (parts <= 1 || dim < 0) return {1, n, n};
  int64_t cols = 1;
  for (size_t i = static_cast<size_t>(dim); i < shape.size(); ++i) cols *= shape[i];
  return {cols ? n / cols : 0, cols, cols / parts};
}

// f(element of the whole tensor, element of the part, count) over the contiguous runs of the
// elements [b, e) of part `part`, flattened.
template <class F>
void for_each_run(const Split& s, int64_t part, int64_t b, int64_t e, F&& f) {
  for (int64_t j = b; j < e;) {
    const int64_t r = j / s.width, c = j % s.width, n = std::min(s.width - c, e - j);
    f(r * s.cols + part * s.width + c, j, n);
    j += n;
  }
}

}  // namespace mt
