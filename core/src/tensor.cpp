#include "mt/tensor.h"

#include <string>

#include "mt/backend.h"
#include "mt/error.h"

namespace mt {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::i8: return 1;
    case DType::u8: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
  }
  return "?";
}

bool parse_dtype(std::string_view s, DType& out) {
  struct Name {
    const char* a;
    const char* b;
    DType t;
  };
  static constexpr Name names[] = {
      {"float32", "f32", DType::f32}, {"bfloat16", "bf16", DType::bf16},
      {"float16", "f16", DType::f16}, {"int32", "i32", DType::i32},
      {"int64", "i64", DType::i64},   {"int8", "i8", DType::i8},
      {"uint8", "u8", DType::u8}};
  for (const auto& n : names) {
    if (s == n.a || s == n.b) {
      out = n.t;
      return true;
    }
  }
  return false;
}

std::string shape_str(const Shape& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + "]";
}

int64_t shape_numel(const Shape& s) {
  bool empty = false;
  for (auto d : s) {
    if (d < 0) throw Error("tensor shape " + shape_str(s) + " has a negative dimension");
    empty |= d == 0;
  }
  if (empty) return 0;  // whatever the other dimensions multiply to
  int64_t n = 1;
  for (auto d : s)
    if (__builtin_mul_overflow(n, d, &n))
      throw Error("tensor shape " + shape_str(s) + " has more elements than fit in 64 bits");
  return n;
}

size_t shape_bytes(const Shape& s, DType t) {
  const int64_t n = shape_numel(s);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, static_cast<int64_t>(dtype_size(t)), &bytes))
    throw Error("tensor shape " + shape_str(s) + " of " + dtype_name(t) +
                " has a size in bytes that does not fit in 64 bits");
  return static_cast<size_t>(bytes);
}

Storage::~Storage() {
  if (owner_ && data_) owner_->release(data_, bytes_);
}

Tensor::Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, size_t offset)
    : impl_(std::make_shared<TensorImpl>()) {
  impl_->storage = std::move(storage);
  impl_->shape = std::move(shape);
  impl_->dtype = dtype;
  impl_->offset = offset;
  MT_CHECK(impl_->offset + nbytes() <= (impl_->storage ? impl_->storage->bytes() : 0) ||
               nbytes() == 0,
           "tensor " + str() + " does not fit its storage");
}

int64_t Tensor::dim(int i) const {
  const int n = ndim();
  const int j = i < 0 ? i + n : i;
  MT_CHECK(j >= 0 && j < n, "dimension " + std::to_string(i) + " of tensor " + str());
  return impl_->shape[static_cast<size_t>(j)];
}

Tensor Tensor::view(Shape shape) const {
  MT_CHECK(shape_numel(shape) == numel(),
           "cannot view " + str() + " as " + shape_str(shape) + ": element counts differ");
  return Tensor(impl_->storage, std::move(shape), impl_->dtype, impl_->offset);
}

Tensor Tensor::slice0(int64_t begin, int64_t end) const {
  MT_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= dim(0),
           "slice [" + std::to_string(begin) + ", " + std::to_string(end) + ") of " + str());
  Shape s = impl_->shape;
  const int64_t row = dim(0) ? numel() / dim(0) : 0;
  s[0] = end - begin;
  return Tensor(impl_->storage, std::move(s), impl_->dtype,
                impl_->offset + static_cast<size_t>(begin * row) * dtype_size(impl_->dtype));
}

std::string Tensor::str() const {
  if (!impl_) return "undefined";
  const char* short_names[] = {"f32", "bf16", "f16", "i32", "i64", "i8", "u8"};
  return std::string(short_names[static_cast<int>(impl_->dtype)]) + shape_str(impl_->shape);
}

}  // namespace mt
