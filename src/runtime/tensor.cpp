#include "runtime/tensor.h"

#include <algorithm>

#include "core/error.h"
#include "core/strings.h"

namespace metrale {

Shape::Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}

Shape::Shape(std::span<const int64_t> dims) {
  if (dims.size() > static_cast<size_t>(kMaxDims)) raise(ErrorCode::kUnsupported, "tensors have at most {} dims", kMaxDims);
  ndim_ = static_cast<int>(dims.size());
  std::copy(dims.begin(), dims.end(), dims_.begin());
}

int64_t Shape::numel() const {
  int64_t count = 1;
  for (int i = 0; i < ndim_; ++i) count *= dims_[static_cast<size_t>(i)];
  return count;
}

std::string Shape::to_string() const {
  std::string text = "[";
  for (int i = 0; i < ndim_; ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims_[static_cast<size_t>(i)]);
  }
  return text + "]";
}

bool Shape::operator==(const Shape& other) const {
  if (ndim_ != other.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[static_cast<size_t>(i)] != other.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides = shape;
  int64_t stride = 1;
  for (int i = shape.ndim() - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

Tensor::Tensor(void* data, DType dtype, Shape shape, Device device)
    : data_(data), dtype_(dtype), device_(device), shape_(shape), strides_(contiguous_strides(shape)) {}

Tensor::Tensor(void* data, DType dtype, Shape shape, Shape strides, Device device)
    : data_(data), dtype_(dtype), device_(device), shape_(shape), strides_(strides) {
  METRALE_CHECK(shape.ndim() == strides.ndim(), "shape and strides differ in rank");
}

int Tensor::normalize_dim(int dim) const {
  const int normalized = dim < 0 ? dim + ndim() : dim;
  METRALE_CHECK(normalized >= 0 && normalized < ndim(), "dim {} out of range for {}", dim, describe());
  return normalized;
}

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int i = ndim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Tensor Tensor::reshape(Shape shape) const {
  METRALE_CHECK(is_contiguous(), "reshape of a non-contiguous tensor {}", describe());
  METRALE_CHECK(shape.numel() == numel(), "reshape {} to {}", shape_.to_string(), shape.to_string());
  return Tensor(data_, dtype_, shape, device_);
}

Tensor Tensor::slice(int dim, int64_t begin, int64_t end) const {
  const int d = normalize_dim(dim);
  METRALE_CHECK(begin >= 0 && begin <= end && end <= shape_[d], "slice [{}, {}) of dim {} in {}", begin, end, d,
                describe());
  Tensor view = *this;
  view.shape_[d] = end - begin;
  view.data_ = static_cast<char*>(data_) + begin * strides_[d] * static_cast<int64_t>(element_size());
  return view;
}

Tensor Tensor::select(int dim, int64_t index) const {
  const int d = normalize_dim(dim);
  METRALE_CHECK(index >= 0 && index < shape_[d], "index {} of dim {} in {}", index, d, describe());
  std::array<int64_t, Shape::kMaxDims> dims{}, strides{};
  int n = 0;
  for (int i = 0; i < ndim(); ++i) {
    if (i == d) continue;
    dims[static_cast<size_t>(n)] = shape_[i];
    strides[static_cast<size_t>(n)] = strides_[i];
    ++n;
  }
  void* base = static_cast<char*>(data_) + index * strides_[d] * static_cast<int64_t>(element_size());
  return Tensor(base, dtype_, Shape(std::span<const int64_t>(dims.data(), static_cast<size_t>(n))),
                Shape(std::span<const int64_t>(strides.data(), static_cast<size_t>(n))), device_);
}

void* Tensor::element_ptr(std::span<const int64_t> index) const {
  METRALE_CHECK(static_cast<int>(index.size()) == ndim(), "index rank");
  int64_t offset = 0;
  for (int i = 0; i < ndim(); ++i) offset += index[static_cast<size_t>(i)] * strides_[i];
  return static_cast<char*>(data_) + offset * static_cast<int64_t>(element_size());
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_.to_string() + " on " + device_.to_string();
}

OwnedTensor::OwnedTensor(DType dtype, Shape shape, Device device)
    : buffer(device, static_cast<size_t>(shape.numel()) * dtype_size(dtype)),
      tensor(buffer.data(), dtype, shape, device) {}

void copy_tensor(const Tensor& dst, const Tensor& src) {
  METRALE_CHECK(dst.dtype() == src.dtype() && dst.shape() == src.shape(), "copy {} <- {}", dst.describe(),
                src.describe());
  METRALE_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy of non-contiguous tensors");
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), src.nbytes());
}

void check_tensor(const Tensor& tensor, DType dtype, const Shape& shape, const char* what) {
  if (tensor.dtype() != dtype || !(tensor.shape() == shape)) {
    raise(ErrorCode::kInternal, "{}: expected {}{}, got {}", what, dtype_name(dtype), shape.to_string(),
          tensor.describe());
  }
}

}  // namespace metrale
