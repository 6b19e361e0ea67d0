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

void fail(const std::string& msg) { throw Error(msg, ErrorKind::runtime); }

}  // namespace mt

#include "mt/checkpointer.h"
#include "mt/data.h"
#include "mt/model.h"
#include "mt/q8.h"
#include "mt/tokenizer.h"

#include "model_info.h"

namespace mt {
DecoderLayer::~DecoderLayer() = default;
Model::~Model() = default;
double Model::flops_per_token(int64_t seq_len) const {
  return default_flops_per_token(*this, seq_len);
}
const DecoderLayer& Model::mtp_layer(int depth) const {
  throw Error("The model family declares no multi-token prediction layer " + std::to_string(depth) +
              ".");
}
Tensor Model::mtp_combine(Graph&, const Params&, const Tensor&, const Tensor&, int depth) const {
  throw Error("The model family declares no multi-token prediction module " +
              std::to_string(depth) + ".");
}

Params::Params(const std::vector<std::string>& names, std::vector<Tensor> values,
               std::vector<WeightLayout> layouts, DType dtype)
    : names_(&names), values_(std::move(values)), layouts_(std::move(layouts)), dtype_(dtype) {
  MT_CHECK(names.size() == values_.size(), "Params: " + std::to_string(names.size()) +
                                               " names for " + std::to_string(values_.size()) +
                                               " tensors");
  MT_CHECK(layouts_.empty() || layouts_.size() == values_.size(),
           "Params: layouts for " + std::to_string(layouts_.size()) + " of " +
               std::to_string(values_.size()) + " tensors");
}

const Tensor* Params::lookup(std::string_view name, size_t* index) const {
  if (!names_) return nullptr;
  for (size_t i = 0; i < values_.size(); ++i)
    if ((*names_)[i] == name) {
      *index = i;
      return &values_[i];
    }
  return nullptr;
}

WeightLayout Params::layout(std::string_view name) const {
  size_t i = 0;
  return lookup(name, &i) && !layouts_.empty() ? layouts_[i] : WeightLayout::dense;
}

const Tensor* Params::find(std::string_view name) const {
  size_t i = 0;
  const Tensor* t = lookup(name, &i);
  if (t && !layouts_.empty() && layouts_[i] != WeightLayout::dense)
    throw Error("The model read the parameter '" + std::string(name) + "' directly, but it is " +
                (layouts_[i] == WeightLayout::q8 ? "stored as int8 rows (quantization=int8)"
                                                 : "stored transposed ([N, K])") +
                " for inference, as its ParamSpec::projection or ParamSpec::table allows: a "
                "projection weight is read only through Graph::project, a table through "
                "Graph::embedding(params, name, ids) and blocks::lm_head. The family's "
                "parameters() and forward() disagree.");
  return t;
}

const Tensor& Params::stored(std::string_view name) const {
  size_t i = 0;
  if (const Tensor* t = lookup(name, &i)) return *t;
  return (*this)[name];  // absent: operator[]'s message
}

Shape Params::shape(std::string_view name) const {
  const Tensor& t = stored(name);
  Shape s = t.shape();
  const size_t r = s.size();  // 2, or 3 for experts' weights (the last two as a projection's)
  switch (layout(name)) {
    case WeightLayout::transposed:
      std::swap(s[r - 2], s[r - 1]);
      break;
    case WeightLayout::q8: {  // [N, K + K / 16] -> [K, N]
      const int64_t n = s[r - 2];
      s[r - 2] = q8_row_values(s[r - 1]);
      s[r - 1] = n;
      break;
    }
    default:
      break;
  }
  return s;
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
