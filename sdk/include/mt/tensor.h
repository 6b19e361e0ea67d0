// Tensor: a handle to a shaped, typed view of memory owned by a backend.
//
// Row-major contiguous; views (reshape, slices along the first dimension) share storage.
// Copying a Tensor copies the handle, not the data: two copies are the same tensor for
// autograd. The core never dereferences device memory; `data()` is a raw device pointer that
// only the owning backend may read (for the CPU backend it is host memory).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "mt/dtype.h"

namespace mt {

class Backend;
struct GradNode;

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[2, 3, 4]"
// The one place sizes are computed, checked: element count and bytes of a shape. Both throw
// mt::Error naming the shape when a dimension is negative or the result overflows 64 bits (a
// config such as base_emb_dim=9223372036854775807 must be refused, not wrap to a small size).
int64_t shape_numel(const Shape& s);
size_t shape_bytes(const Shape& s, DType t);

// A block of memory from a backend's allocator. Returned to the allocator on destruction, so a
// backend must outlive every Storage it made (backends live for the process, in the registry).
class Storage {
 public:
  Storage(void* data, size_t bytes, Backend* owner) : data_(data), bytes_(bytes), owner_(owner) {}
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Backend* backend() const { return owner_; }

 private:
  void* data_;
  size_t bytes_;
  Backend* owner_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  size_t offset = 0;  // bytes
  Shape shape;
  DType dtype = DType::f32;
  std::shared_ptr<GradNode> grad;  // autograd identity; null when not tracked
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> storage, Shape shape, DType dtype, size_t offset = 0);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl_->shape; }
  int ndim() const { return static_cast<int>(impl_->shape.size()); }
  // Size of dimension i; negative i counts from the end.
  int64_t dim(int i) const;
  int64_t numel() const { return shape_numel(impl_->shape); }
  size_t nbytes() const { return shape_bytes(impl_->shape, impl_->dtype); }
  DType dtype() const { return impl_->dtype; }
  Backend* backend() const { return impl_->storage ? impl_->storage->backend() : nullptr; }

  // Raw pointer to the first element (device memory for device backends).
  void* data() const { return static_cast<char*>(impl_->storage->data()) + impl_->offset; }
  template <class T>
  T* ptr() const {
    return static_cast<T*>(data());
  }

  // Same storage, new shape with the same element count. Not recorded by autograd: use
  // mt::reshape (ops.h) inside a differentiated forward.
  Tensor view(Shape shape) const;
  // Rows [begin, end) of dimension 0, sharing storage.
  Tensor slice0(int64_t begin, int64_t end) const;

  // "f32[2, 3]"
  std::string str() const;

  // Autograd identity (see autograd.h). Null for tensors no tape has seen.
  const std::shared_ptr<GradNode>& grad_node() const { return impl_->grad; }
  void set_grad_node(std::shared_ptr<GradNode> n) { impl_->grad = std::move(n); }
  bool same_as(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

}  // namespace mt
