// Tensor: a typed, strided, non-owning view of memory on one device. Ownership lives in Buffer
// (see OwnedTensor below) or in a mapped checkpoint file. Strides are in elements.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "core/dtype.h"
#include "core/error_base.h"
#include "runtime/buffer.h"
#include "runtime/device.h"

namespace metrale {

class Shape {
 public:
  static constexpr int kMaxDims = 6;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  explicit Shape(std::span<const int64_t> dims);

  int ndim() const { return ndim_; }
  int64_t operator[](int i) const { return dims_[static_cast<size_t>(i)]; }
  int64_t& operator[](int i) { return dims_[static_cast<size_t>(i)]; }
  int64_t numel() const;
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(ndim_)}; }
  std::string to_string() const;  // "[2, 3]"
  bool operator==(const Shape& other) const;

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

class Tensor {
 public:
  Tensor() = default;
  // A contiguous (row-major) view.
  Tensor(void* data, DType dtype, Shape shape, Device device = Device::cpu());
  Tensor(void* data, DType dtype, Shape shape, Shape strides, Device device);

  void* data() const { return data_; }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int ndim() const { return shape_.ndim(); }
  int64_t size(int dim) const { return shape_[normalize_dim(dim)]; }
  int64_t stride(int dim) const { return strides_[normalize_dim(dim)]; }
  int64_t numel() const { return shape_.numel(); }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool defined() const { return data_ != nullptr || numel() == 0; }
  bool empty() const { return data_ == nullptr; }
  bool is_contiguous() const;

  // Views. All keep the same memory; none copies.
  Tensor reshape(Shape shape) const;                      // requires a contiguous tensor
  Tensor slice(int dim, int64_t begin, int64_t end) const;
  Tensor select(int dim, int64_t index) const;            // drops `dim`
  Tensor row(int64_t index) const { return select(0, index); }

  // Pointer to element at a multi-index (host tensors and pointer arithmetic on device tensors).
  void* element_ptr(std::span<const int64_t> index) const;

  std::string describe() const;  // "bf16[4, 8] on cpu"

 private:
  int normalize_dim(int dim) const;

  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_;
  Shape shape_;
  Shape strides_;
};

// Contiguous row-major strides for a shape.
Shape contiguous_strides(const Shape& shape);

// A Buffer together with the contiguous tensor view over it.
struct OwnedTensor {
  Buffer buffer;
  Tensor tensor;

  OwnedTensor() = default;
  OwnedTensor(DType dtype, Shape shape, Device device = Device::cpu());
  Tensor& operator*() { return tensor; }
  const Tensor& operator*() const { return tensor; }
  Tensor* operator->() { return &tensor; }
  const Tensor* operator->() const { return &tensor; }
};

// Copies between two tensors of the same dtype and shape (any devices; both contiguous).
void copy_tensor(const Tensor& dst, const Tensor& src);

// Checks a tensor's dtype and shape; throws kInternal with `what` in the message otherwise.
void check_tensor(const Tensor& tensor, DType dtype, const Shape& shape, const char* what);

}  // namespace metrale
