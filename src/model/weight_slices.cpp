// Weights: the sliced reads a tensor-parallel rank builds its blocks from (tensor_parallel.h).
#include <algorithm>

#include "core/error.h"
#include "model/weight_store.h"

namespace metrale {

void Weights::set_tensor_parallel(const TensorParallel& tensor_parallel) {
  tensor_parallel.check();
  tensor_parallel_ = tensor_parallel;
}

Tensor Weights::plain_view(const std::string& name, const Shape& full) {
  const Tensor view = store_->get(name);
  const std::string file = store_->file_of(name).path().string();
  if (!(view.shape() == full)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", file, name, view.shape().to_string(),
          full.to_string());
  }
  if (!is_floating(view.dtype()) || view.dtype() == DType::kF8E4M3) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32", file, name,
          dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  return view;
}

std::vector<char> Weights::slice_bytes(const Tensor& view, const TensorSlice& slice) {
  std::vector<char> bytes(static_cast<size_t>(slice.shape_of(view.shape()).numel()) * view.element_size());
  copy_slice(view, slice, bytes.data());
  return bytes;
}

Tensor Weights::get(const std::string& key, const Shape& full, const TensorSlice& slice) {
  return get_root(prefix_ + key, full, slice);
}

Tensor Weights::get_root(const std::string& name, const Shape& full, const TensorSlice& slice) {
  if (slice.whole()) return get_root(name, full);
  const Shape shape = slice.shape_of(full);
  if (!store_) return synthesize(name, shape);
  const Tensor view = plain_view(resolve(name), full);
  std::vector<char> bytes = slice_bytes(view, slice);
  return place_copy(Tensor(bytes.data(), view.dtype(), shape, Device::cpu()));
}

void Weights::load_into(const std::string& key, const Shape& full, const TensorSlice& slice,
                        const Tensor& destination) {
  const Shape shape = slice.shape_of(full);
  METRALE_CHECK(destination.is_contiguous() && destination.device() == device_ && destination.shape() == shape,
                "load_into {} (slice {} of {}): {}", key, shape.to_string(), full.to_string(), destination.describe());
  if (!store_ || slice.whole()) {
    load_into(key, destination);  // random weights are filled directly; a whole tensor converts in pieces
    return;
  }
  const Tensor view = plain_view(resolve(prefix_ + key), full);
  std::vector<char> bytes = slice_bytes(view, slice);
  if (view.dtype() == destination.dtype()) {
    copy_bytes(destination.data(), device_, bytes.data(), Device::cpu(), bytes.size());
    return;
  }
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  convert_to_f32(view.dtype(), bytes.data(), values.data(), values.size());
  std::vector<char> converted(values.size() * destination.element_size());
  convert_from_f32(destination.dtype(), values.data(), converted.data(), values.size());
  copy_bytes(destination.data(), device_, converted.data(), Device::cpu(), converted.size());
}

std::optional<kernels::LinearWeight> Weights::exact_fp8_slice(const std::string& name, const Shape& full,
                                                              const TensorSlice& slice) {
  constexpr int64_t kBlock = kernels::kFp8Block;
  const Shape shape = slice.shape_of(full);
  const int64_t rows = shape[0], columns = full[1];
  const int64_t col_end = slice.col_end < 0 ? columns : slice.col_end;
  if (slice.col_begin % kBlock != 0 || (col_end % kBlock != 0 && col_end != columns)) return std::nullopt;
  // Every destination block of 128 rows is one aligned source block, whole (or the source's last).
  std::vector<int64_t> block_rows;
  for (int64_t b = 0; b * kBlock < rows; ++b) {
    const int64_t first = slice.source_row(b * kBlock), count = std::min(kBlock, rows - b * kBlock);
    if (first % kBlock != 0 || (count != kBlock && first + count != full[0])) return std::nullopt;
    for (int64_t r = 1; r < count; ++r)
      if (slice.source_row(b * kBlock + r) != first + r) return std::nullopt;
    block_rows.push_back(first / kBlock);
  }
  const auto [codes, scales] = fp8_views(name, full);
  TensorSlice scale_slice = TensorSlice::of_rows(std::move(block_rows));
  scale_slice.col_begin = slice.col_begin / kBlock;
  scale_slice.col_end = kernels::fp8_scale_blocks(col_end);
  std::vector<char> code_bytes = slice_bytes(codes, slice);
  std::vector<char> scale_bytes = slice_bytes(scales, scale_slice);
  const Shape scale_shape = scale_slice.shape_of(scales.shape());
  return kernels::LinearWeight(place_copy(Tensor(code_bytes.data(), DType::kF8E4M3, shape, Device::cpu())),
                               place_copy(Tensor(scale_bytes.data(), DType::kF32, scale_shape, Device::cpu())));
}

kernels::LinearWeight Weights::get_linear(const std::string& key, const Shape& full, const TensorSlice& slice) {
  METRALE_CHECK(full.ndim() == 2, "get_linear {}: a projection weight is [N, K], not {}", key, full.to_string());
  if (slice.whole()) return get_linear(key, full);
  const Shape shape = slice.shape_of(full);
  if (!store_)
    return quantization_ == WeightQuantization::kFp8 ? random_linear(shape) : synthesize(prefix_ + key, shape);
  const std::string name = resolve(prefix_ + key);
  if (store_->file_of(name).view(name).dtype() == DType::kF8E4M3) {
    if (std::optional<kernels::LinearWeight> exact = exact_fp8_slice(name, full, slice)) return *exact;
    std::vector<float> values = host_values(name, full);
    std::vector<float> part(static_cast<size_t>(shape.numel()));
    copy_slice(Tensor(values.data(), DType::kF32, full, Device::cpu()), slice, part.data());
    return quantize(Tensor(part.data(), DType::kF32, shape, Device::cpu()));
  }
  if (quantization_ != WeightQuantization::kFp8) return get(key, full, slice);
  const Tensor view = plain_view(name, full);
  check_quantizable(name, view);
  std::vector<char> bytes = slice_bytes(view, slice);
  return quantize(Tensor(bytes.data(), view.dtype(), shape, Device::cpu()));
}

}  // namespace metrale
