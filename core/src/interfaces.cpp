// Out-of-line destructors and small shared helpers of the SDK interfaces (their vtables and
// typeinfo live in libmt_core, once).
#include <cstdint>
#include <string>
#include <vector>

#include "mt/attention.h"
#include "mt/backend.h"
#include "mt/error.h"
#include "mt/registry.h"

namespace mt {

Backend::~Backend() = default;
AttentionKernel::~AttentionKernel() = default;
Registry::~Registry() = default;

Tensor Backend::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  fill(t, 0.f);
  return t;
}

void Backend::scatter_rows(const Tensor& src, const Tensor& idx, Tensor& out) {
  MT_CHECK(src.defined() && out.defined() && idx.defined() && src.ndim() >= 1 && out.ndim() >= 1 &&
               src.dim(-1) == out.dim(-1) && src.numel() == idx.numel() * src.dim(-1),
           "scatter_rows: src " + src.str() + ", idx " + (idx.defined() ? idx.str() : "none") +
               ", out " + (out.defined() ? out.str() : "none") +
               " (want src [M, D], idx [M] i32, out [N, D])");
  const int64_t D = out.dim(-1), M = idx.numel();
  Tensor rows = out.view({D ? out.numel() / D : 0, D});
  Tensor old = empty({M, D}, out.dtype());
  gather_rows(rows, idx, old);
  Tensor minus = empty({M}, DType::f32);
  fill(minus, -1.f);
  scatter_add_rows(old, idx, minus, rows);
  scatter_add_rows(src.view({M, D}), idx, Tensor(), rows);
}

void Backend::copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                           int64_t width, bool accumulate) {
  auto fb = [](const Tensor& t) {
    return t.defined() && t.ndim() >= 1 && (t.dtype() == DType::f32 || t.dtype() == DType::bf16);
  };
  MT_CHECK(fb(src) && fb(dst), "copy_columns: src " +
                                   (src.defined() ? src.str() : std::string("none")) + ", dst " +
                                   (dst.defined() ? dst.str() : std::string("none")) +
                                   " (want f32 or bf16 matrices src [N, Ds] and dst [N, Dd])");
  auto rows = [](const Tensor& t) {
    int64_t r = 1;
    for (int i = 0; i + 1 < t.ndim(); ++i) r *= t.shape()[static_cast<size_t>(i)];
    return r;
  };
  const int64_t ds = src.dim(-1), dd = dst.dim(-1), n = rows(src);
  MT_CHECK(n == rows(dst) && width >= 0 && src_col >= 0 && dst_col >= 0 && src_col + width <= ds &&
               dst_col + width <= dd,
           "copy_columns: columns [" + std::to_string(src_col) + ", " +
               std::to_string(src_col + width) + ") of src " + src.str() + " to columns [" +
               std::to_string(dst_col) + ", " + std::to_string(dst_col + width) + ") of dst " +
               dst.str() + " (want the same rows and columns inside both)");
  if (width == 0 || n == 0) return;
  // The ops-fall-back path of an out-of-tree backend: both matrices through the host, in f32.
  auto to_f32 = [this](const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::f32) {
      copy_to_host(t, v.data());
    } else {
      std::vector<uint16_t> b(v.size());
      copy_to_host(t, b.data());
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(b[i]);
    }
    return v;
  };
  const std::vector<float> s = to_f32(src);
  std::vector<float> d = to_f32(dst);
  for (int64_t r = 0; r < n; ++r) {
    const float* from = s.data() + r * ds + src_col;
    float* to = d.data() + r * dd + dst_col;
    for (int64_t c = 0; c < width; ++c) to[c] = accumulate ? to[c] + from[c] : from[c];
  }
  if (dst.dtype() == DType::f32) {
    copy_from_host(dst, d.data());
  } else {
    std::vector<uint16_t> b(d.size());
    for (size_t i = 0; i < d.size(); ++i) b[i] = f32_to_bf16(d[i]);
    copy_from_host(dst, b.data());
  }
}

void fail(const std::string& msg) { throw Error(msg, ErrorKind::runtime); }

}  // namespace mt

#include "mt/checkpointer.h"
#include "mt/data.h"
#include "mt/model.h"
#include "mt/tokenizer.h"

#include "model_info.h"

namespace mt {
DecoderLayer::~DecoderLayer() = default;
Model::~Model() = default;
double Model::flops_per_token(int64_t seq_len) const {
  return default_flops_per_token(*this, seq_len);
}

Params::Params(const std::vector<std::string>& names, std::vector<Tensor> values)
    : names_(&names), values_(std::move(values)) {
  MT_CHECK(names.size() == values_.size(), "Params: " + std::to_string(names.size()) +
                                               " names for " + std::to_string(values_.size()) +
                                               " tensors");
}

const Tensor* Params::find(std::string_view name) const {
  if (!names_) return nullptr;
  for (size_t i = 0; i < values_.size(); ++i)
    if ((*names_)[i] == name) return &values_[i];
  return nullptr;
}

const Tensor& Params::operator[](std::string_view name) const {
  if (const Tensor* t = find(name)) return *t;
  std::string have;
  if (names_)
    for (const auto& n : *names_) have += (have.empty() ? "" : ", ") + n;
  throw Error(
      "The model asked for a parameter named '" + std::string(name) +
      "', which it did not declare (declared here: " + (have.empty() ? std::string("none") : have) +
      "). The family's parameters() and forward() disagree.");
}

ModelFamily::~ModelFamily() = default;
std::vector<std::string> ModelFamily::from_hf_config(const HfConfig&,
                                                     std::vector<std::string>&) const {
  throw UsageError("The model family '" + name() + "' has no Hugging Face config mapping.");
}
std::map<std::string, std::string> ModelFamily::to_hf_config(const Config&) const {
  throw UsageError("The model family '" + name() + "' has no Hugging Face config mapping.");
}
DatasetSource::~DatasetSource() = default;
Tokenizer::~Tokenizer() = default;
Checkpointer::~Checkpointer() = default;
}  // namespace mt
