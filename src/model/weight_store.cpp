#include "model/weight_store.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <utility>

#include "core/error.h"
#include "core/strings.h"
#include "kernels/random_fill.h"

namespace metrale {

WeightStore::WeightStore(const std::filesystem::path& dir) : dir_(dir) {
  const auto index_path = dir / "model.safetensors.index.json";
  const auto single_path = dir / "model.safetensors";
  std::vector<std::string> shard_names;
  nlohmann::json weight_map;
  if (std::filesystem::exists(index_path)) {
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_file(index_path));
    } catch (const nlohmann::json::exception& e) {
      raise(ErrorCode::kBadFormat, "{}: invalid JSON: {}", index_path.string(), e.what());
    }
    if (!index.contains("weight_map") || !index["weight_map"].is_object())
      raise(ErrorCode::kBadFormat, "{}: no weight_map object", index_path.string());
    weight_map = index["weight_map"];
    for (const auto& [name, file] : weight_map.items()) {
      if (!file.is_string())
        raise(ErrorCode::kBadFormat, "{}: weight_map['{}'] is not a file name", index_path.string(), name);
      const std::string shard = file.get<std::string>();
      if (shard.find('/') != std::string::npos || shard == "..")
        raise(ErrorCode::kBadFormat, "{}: shard name '{}' must be a plain file name", index_path.string(), shard);
      if (std::find(shard_names.begin(), shard_names.end(), shard) == shard_names.end()) shard_names.push_back(shard);
    }
  } else if (std::filesystem::exists(single_path)) {
    shard_names.push_back("model.safetensors");
  } else {
    raise(ErrorCode::kNotFound, "{}: no model.safetensors or model.safetensors.index.json", dir.string());
  }
  for (const auto& shard : shard_names) {
    const auto path = dir / shard;
    if (!std::filesystem::exists(path)) raise(ErrorCode::kNotFound, "{}: shard {} is missing", dir.string(), shard);
    files_.push_back(std::make_unique<SafetensorsFile>(path));
  }
  if (weight_map.is_null()) {
    for (const auto& [name, entry] : files_.front()->entries()) index_.emplace(name, files_.front().get());
  } else {
    for (const auto& [name, file] : weight_map.items()) {
      const std::string shard = file.get<std::string>();
      const auto it =
          std::find_if(files_.begin(), files_.end(), [&](const auto& f) { return f->path().filename() == shard; });
      if (!(*it)->contains(name)) {
        raise(ErrorCode::kBadFormat, "{}: the index places tensor '{}' in {}, which does not contain it", dir.string(),
              name, shard);
      }
      index_.emplace(name, it->get());
    }
  }
}

Tensor WeightStore::get(const std::string& name) const {
  Tensor view = file_of(name).view(name);
  std::lock_guard lock(used_mutex_);
  used_.insert(name);
  return view;
}

std::vector<std::string> WeightStore::unused_names() const {
  std::vector<std::string> result;
  {
    std::lock_guard lock(used_mutex_);
    for (const auto& [name, file] : index_)
      if (used_.count(name) == 0) result.push_back(name);
  }
  std::sort(result.begin(), result.end());
  return result;
}

const SafetensorsFile& WeightStore::file_of(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) raise(ErrorCode::kNotFound, "{}: checkpoint has no tensor '{}'", dir_.string(), name);
  return *it->second;
}

std::vector<std::span<const std::byte>> WeightStore::mapped_ranges() const {
  std::vector<std::span<const std::byte>> ranges;
  for (const auto& file : files_) ranges.push_back(file->data_bytes());
  return ranges;
}

uint64_t WeightStore::total_bytes() const {
  uint64_t bytes = 0;
  // Through the files, not get(): sizing the checkpoint reads no tensor.
  for (const auto& [name, file] : index_) bytes += file->view(name).nbytes();
  return bytes;
}

std::vector<std::string> WeightStore::names() const {
  std::vector<std::string> result;
  result.reserve(index_.size());
  for (const auto& [name, file] : index_) result.push_back(name);
  std::sort(result.begin(), result.end());
  return result;
}

Weights::Weights(std::shared_ptr<const WeightStore> store, Device device, std::string prefix)
    : store_(std::move(store)), device_(device), prefix_(std::move(prefix)) {
  if (prefix_.empty()) {
    for (const char* candidate : {"model.language_model.", "model."}) {
      if (store_->has(std::string(candidate) + "embed_tokens.weight")) {
        prefix_ = candidate;
        break;
      }
    }
    if (prefix_.empty()) {
      raise(ErrorCode::kNotFound,
            "{}: checkpoint has neither 'model.embed_tokens.weight' nor 'model.language_model.embed_tokens.weight'",
            store_->dir().string());
    }
  }
}

Weights::Weights(const RandomWeights& random, Device device) : random_(random), device_(device), prefix_("model.") {}

Weights Weights::with_prefix(std::string prefix) const {
  if (store_) {
    Weights derived(store_, device_, std::move(prefix));
    derived.aliases_ = aliases_;
    derived.progress_ = progress_;
    derived.checkpoint_fp8_ = checkpoint_fp8_;
    derived.quantization_ = quantization_;
    derived.compute_dtype_ = compute_dtype_;
    derived.kv_cache_ = kv_cache_;
    derived.kv_scale_tally_ = kv_scale_tally_;
    derived.tensor_parallel_ = tensor_parallel_;
    return derived;
  }
  RandomWeights random = random_;
  random.seed = random_.seed * 0x9E3779B97F4A7C15ull + 0x6D7470ull;  // "mtp": any fixed mix will do
  Weights derived(random, device_);
  derived.prefix_ = std::move(prefix);
  derived.quantization_ = quantization_;
  derived.compute_dtype_ = compute_dtype_;
  derived.kv_cache_ = kv_cache_;
  derived.kv_scale_tally_ = kv_scale_tally_;
  derived.tensor_parallel_ = tensor_parallel_;
  return derived;
}

void Weights::set_compute_dtype(DType dtype) {
  if (dtype != DType::kBF16 && dtype != DType::kF32) {
    raise(ErrorCode::kUnsupported, "compute dtype {}: the GPU computes in bfloat16 or float32", dtype_name(dtype));
  }
  compute_dtype_ = dtype;
}

const WeightStore& Weights::store() const {
  METRALE_CHECK(store_ != nullptr, "random weights have no store");
  return *store_;
}

std::string Weights::source_name() const {
  return store_ ? store_->dir().string() : std::string("random weights");
}

void Weights::add_alias(const std::string& canonical, const std::string& stored) {
  (*aliases_)[canonical] = stored;
}

const std::string& Weights::resolve(const std::string& name) const {
  const auto it = aliases_->find(name);
  return it == aliases_->end() ? name : it->second;
}

bool Weights::has(const std::string& key) const {
  if (store_) return store_->has(resolve(prefix_ + key));
  // Random weights take the fused expert layout rather than per-expert keys.
  return key.find("experts.0.") == std::string::npos;
}

bool Weights::has_root(const std::string& name) const {
  if (store_) return store_->has(resolve(name));
  if (name == "lm_head.weight") return !random_.tie_word_embeddings;
  return true;
}

Tensor Weights::synthesize(const std::string& name, const Shape& shape) {
  const DType dtype = compute_dtype();
  Buffer buffer(device_, static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  Tensor tensor(buffer.data(), dtype, shape, device_);
  // Vectors are norm weights and gates: near 1 keeps activations in range through deep stacks.
  const bool vector = shape.ndim() == 1;
  kernels::random_fill(
      tensor, {random_.seed * 1000003u + random_index_++, vector ? 1.0f : 0.0f, vector ? 0.01f : random_.stddev});
  buffers_.push_back(std::move(buffer));
  (void)name;
  return tensor;
}

Tensor Weights::get(const std::string& key, const Shape& shape) {
  return get_root(prefix_ + key, shape);
}

std::vector<float> Weights::read_host_values(const std::string& key) {
  const std::string name = resolve(prefix_ + key);
  const Tensor view = store().get(name);
  if (!is_floating(view.dtype())) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}, expected a float dtype",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  std::vector<float> values(static_cast<size_t>(view.numel()));
  convert_to_f32(view.dtype(), view.data(), values.data(), values.size());
  return values;
}

void Weights::load_into(const std::string& key, const Tensor& destination) {
  METRALE_CHECK(destination.is_contiguous() && destination.device() == device_, "load_into {}", destination.describe());
  if (!store_) {
    kernels::random_fill(destination, {random_.seed * 1000003u + random_index_++, 0.0f, random_.stddev});
    return;
  }
  const std::string name = resolve(prefix_ + key);
  const Tensor view = store_->get(name);
  if (!(view.shape() == destination.shape())) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", store_->file_of(name).path().string(),
          name, view.shape().to_string(), destination.shape().to_string());
  }
  if (!is_floating(view.dtype()) || view.dtype() == DType::kF8E4M3) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  if (view.dtype() == destination.dtype()) {
    copy_bytes(destination.data(), device_, view.data(), Device::cpu(), view.nbytes());
    return;
  }
  // Convert on the host in slices, then copy each slice up.
  const int64_t total = view.numel();
  const int64_t slice = std::min<int64_t>(total, 1 << 20);
  std::vector<float> values(static_cast<size_t>(slice));
  std::vector<char> converted(static_cast<size_t>(slice) * destination.element_size());
  for (int64_t begin = 0; begin < total; begin += slice) {
    const int64_t count = std::min(slice, total - begin);
    convert_to_f32(view.dtype(),
                   static_cast<const char*>(view.data()) + begin * static_cast<int64_t>(view.element_size()),
                   values.data(), static_cast<size_t>(count));
    convert_from_f32(destination.dtype(), values.data(), converted.data(), static_cast<size_t>(count));
    copy_bytes(static_cast<char*>(destination.data()) + begin * static_cast<int64_t>(destination.element_size()),
               device_, converted.data(), Device::cpu(), static_cast<size_t>(count) * destination.element_size());
  }
}

Tensor Weights::get_root(const std::string& requested, const Shape& shape) {
  if (!store_) return synthesize(requested, shape);
  const std::string name = resolve(requested);
  const Tensor view = store_->get(name);
  if (!(view.shape() == shape)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", store_->file_of(name).path().string(),
          name, view.shape().to_string(), shape.to_string());
  }
  if (!is_floating(view.dtype()) || view.dtype() == DType::kF8E4M3) {
    raise(ErrorCode::kUnsupported,
          "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32 (FP8 is read for projection and expert "
          "weights only, not for embeddings, LM heads, routers, norms or convolutions)",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  // Mapped tensors are used in place on the CPU, unless the file leaves them misaligned for their dtype.
  if (device_.is_cpu() && reinterpret_cast<uintptr_t>(view.data()) % view.element_size() == 0) return view;
  return place_copy(view);
}

Tensor Weights::place_copy(const Tensor& host) {
  if (device_.is_cpu()) {
    Buffer buffer(device_, host.nbytes());
    std::memcpy(buffer.data(), host.data(), host.nbytes());
    Tensor placed(buffer.data(), host.dtype(), host.shape(), device_);
    buffers_.push_back(std::move(buffer));
    return placed;
  }
  // The GPU computes with weights of its compute dtype: other float dtypes are converted on the way up.
  const DType dtype = compute_dtype_;
  Buffer buffer(device_, static_cast<size_t>(host.numel()) * dtype_size(dtype));
  if (host.dtype() == dtype) {
    copy_bytes(buffer.data(), device_, host.data(), Device::cpu(), host.nbytes());
  } else {
    std::vector<char> converted(static_cast<size_t>(host.numel()) * dtype_size(dtype));
    std::vector<float> row(static_cast<size_t>(std::min<int64_t>(host.numel(), 1 << 20)));
    for (int64_t begin = 0; begin < host.numel(); begin += static_cast<int64_t>(row.size())) {
      const int64_t count = std::min<int64_t>(static_cast<int64_t>(row.size()), host.numel() - begin);
      convert_to_f32(host.dtype(),
                     static_cast<const char*>(host.data()) + begin * static_cast<int64_t>(host.element_size()),
                     row.data(), static_cast<size_t>(count));
      convert_from_f32(dtype, row.data(), converted.data() + begin * static_cast<int64_t>(dtype_size(dtype)),
                       static_cast<size_t>(count));
    }
    copy_bytes(buffer.data(), device_, converted.data(), Device::cpu(), converted.size());
  }
  Tensor placed(buffer.data(), dtype, host.shape(), device_);
  buffers_.push_back(std::move(buffer));
  return placed;
}

void Weights::set_fp8(bool checkpoint_fp8, WeightQuantization quantization) {
  checkpoint_fp8_ = checkpoint_fp8;
  quantization_ = quantization;
}

Tensor Weights::place(const Tensor& host) {
  if (device_.is_cpu() && reinterpret_cast<uintptr_t>(host.data()) % host.element_size() == 0) return host;
  Buffer buffer(device_, host.nbytes());
  copy_bytes(buffer.data(), device_, host.data(), Device::cpu(), host.nbytes());
  Tensor placed(buffer.data(), host.dtype(), host.shape(), device_);
  buffers_.push_back(std::move(buffer));
  return placed;
}

kernels::LinearWeight Weights::quantize(const Tensor& host_weight) {
  const Fp8Blocks blocks = quantize_fp8_blocks(host_weight);
  const int64_t n = host_weight.size(0), k = host_weight.size(1);
  const Tensor codes(const_cast<uint8_t*>(blocks.codes.data()), DType::kF8E4M3, {n, k}, Device::cpu());
  const Tensor scales(const_cast<float*>(blocks.scale_inv.data()), DType::kF32,
                      {kernels::fp8_scale_blocks(n), kernels::fp8_scale_blocks(k)}, Device::cpu());
  // Copies: the quantised bytes live in this call's vectors.
  Buffer code_buffer(device_, codes.nbytes()), scale_buffer(device_, scales.nbytes());
  copy_bytes(code_buffer.data(), device_, codes.data(), Device::cpu(), codes.nbytes());
  copy_bytes(scale_buffer.data(), device_, scales.data(), Device::cpu(), scales.nbytes());
  kernels::LinearWeight placed(Tensor(code_buffer.data(), DType::kF8E4M3, codes.shape(), device_),
                               Tensor(scale_buffer.data(), DType::kF32, scales.shape(), device_));
  buffers_.push_back(std::move(code_buffer));
  buffers_.push_back(std::move(scale_buffer));
  return placed;
}

std::pair<Tensor, Tensor> Weights::fp8_views(const std::string& name, const Shape& shape) {
  const std::string file = store_->file_of(name).path().string();
  if (!checkpoint_fp8_) {
    raise(ErrorCode::kBadFormat,
          "{}: tensor '{}' is f8e4m3 but config.json declares no quantization_config {{quant_method: \"fp8\"}}", file,
          name);
  }
  const Tensor weight = store_->get(name);
  if (!(weight.shape() == shape)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", file, name, weight.shape().to_string(),
          shape.to_string());
  }
  const std::string scale_name = name + "_scale_inv";
  if (!store_->has(scale_name)) {
    raise(ErrorCode::kNotFound, "{}: FP8 tensor '{}' has no block scales '{}'", store_->dir().string(), name,
          scale_name);
  }
  const Tensor scales = store_->get(scale_name);
  const Shape scale_shape{kernels::fp8_scale_blocks(shape[0]), kernels::fp8_scale_blocks(shape[1])};
  if (!(scales.shape() == scale_shape) || scales.dtype() != DType::kF32) {
    raise(ErrorCode::kBadFormat, "{}: block scales '{}' are {} {}, expected f32 {} (blocks of {}x{} of {} {})",
          store_->file_of(scale_name).path().string(), scale_name, dtype_name(scales.dtype()),
          scales.shape().to_string(), scale_shape.to_string(), kernels::kFp8Block, kernels::kFp8Block, name,
          shape.to_string());
  }
  if (progress_) progress_->advance(2, weight.nbytes() + scales.nbytes());
  return {weight, scales};
}

kernels::LinearWeight Weights::read_fp8(const std::string& name, const Shape& shape) {
  const auto [weight, scales] = fp8_views(name, shape);
  return kernels::LinearWeight(place(weight), place(scales));
}

std::vector<float> Weights::host_values(const std::string& name, const Shape& shape) {
  const Tensor view = store_->file_of(name).view(name);
  std::vector<float> values(static_cast<size_t>(shape.numel()));
  if (view.dtype() == DType::kF8E4M3) {
    const auto [codes, scales] = fp8_views(name, shape);
    const int64_t rows = shape[0], cols = shape[1], scale_cols = scales.size(1);
    const auto* code = static_cast<const uint8_t*>(codes.data());
    std::vector<float> block_scales(static_cast<size_t>(scales.numel()));
    convert_to_f32(DType::kF32, scales.data(), block_scales.data(), block_scales.size());  // unaligned-safe copy
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        values[static_cast<size_t>(r * cols + c)] =
            f8e4m3_bits_to_f32(code[r * cols + c]) *
            block_scales[static_cast<size_t>((r / kernels::kFp8Block) * scale_cols + c / kernels::kFp8Block)];
      }
    }
    return values;
  }
  const Tensor plain = store_->get(name);
  if (!(plain.shape() == shape)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", store_->file_of(name).path().string(),
          name, plain.shape().to_string(), shape.to_string());
  }
  check_quantizable(name, plain);
  if (progress_) progress_->advance(1, plain.nbytes());
  convert_to_f32(plain.dtype(), plain.data(), values.data(), values.size());
  return values;
}

kernels::LinearWeight Weights::get_linear_permuted(const std::string& key, const Shape& shape,
                                                   const std::function<int64_t(int64_t)>& destination_row) {
  METRALE_CHECK(shape.ndim() == 2 && linear_is_fp8(key), "get_linear_permuted {}: an FP8 projection [N, K], not {}",
                key, shape.to_string());
  if (!store_) return get_linear(key, shape);  // random weights have no row order to keep
  const std::string name = resolve(prefix_ + key);
  const std::vector<float> values = host_values(name, shape);
  const int64_t rows = shape[0], cols = shape[1];
  std::vector<float> permuted(values.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t to = destination_row(r);
    METRALE_CHECK(to >= 0 && to < rows, "row {} of '{}' maps to {}", r, name, to);
    std::copy_n(values.begin() + r * cols, cols, permuted.begin() + to * cols);
  }
  return quantize(Tensor(permuted.data(), DType::kF32, shape, Device::cpu()));
}

Tensor Weights::get_dequantized(const std::string& key, const Shape& shape) {
  if (!store_) return synthesize(prefix_ + key, shape);
  const std::string name = resolve(prefix_ + key);
  if (store_->file_of(name).view(name).dtype() != DType::kF8E4M3) return get(key, shape);
  METRALE_CHECK(shape.ndim() == 2, "get_dequantized {}: an FP8 tensor is [N, K], not {}", key, shape.to_string());
  const std::vector<float> values = host_values(name, shape);
  const DType dtype = compute_dtype();
  Buffer buffer(device_, values.size() * dtype_size(dtype));
  std::vector<char> converted(values.size() * dtype_size(dtype));
  convert_from_f32(dtype, values.data(), converted.data(), values.size());
  copy_bytes(buffer.data(), device_, converted.data(), Device::cpu(), converted.size());
  Tensor placed(buffer.data(), dtype, shape, device_);
  buffers_.push_back(std::move(buffer));
  return placed;
}

kernels::LinearWeight Weights::get_linear(const std::string& key, const Shape& shape) {
  METRALE_CHECK(shape.ndim() == 2, "get_linear {}: a projection weight is [N, K], not {}", key, shape.to_string());
  if (!store_) {
    if (quantization_ != WeightQuantization::kFp8) return synthesize(prefix_ + key, shape);
    return random_linear(shape);
  }
  const std::string name = resolve(prefix_ + key);
  const DType stored = store_->file_of(name).view(name).dtype();
  if (stored == DType::kF8E4M3) return read_fp8(name, shape);
  if (quantization_ != WeightQuantization::kFp8) return get(key, shape);
  const Tensor view = store_->get(name);
  if (!(view.shape() == shape)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", store_->file_of(name).path().string(),
          name, view.shape().to_string(), shape.to_string());
  }
  check_quantizable(name, view);
  if (progress_) progress_->advance(1, view.nbytes());
  return quantize(view);
}

kernels::LinearWeight Weights::random_linear(const Shape& shape) {
  Buffer code_buffer(device_, static_cast<size_t>(shape.numel()));
  Buffer scale_buffer(
      device_,
      static_cast<size_t>(kernels::fp8_scale_blocks(shape[0]) * kernels::fp8_scale_blocks(shape[1])) * sizeof(float));
  kernels::LinearWeight placed(
      Tensor(code_buffer.data(), DType::kF8E4M3, shape, device_),
      Tensor(scale_buffer.data(), DType::kF32,
             {kernels::fp8_scale_blocks(shape[0]), kernels::fp8_scale_blocks(shape[1])}, device_));
  fill_random_fp8(placed.weight, placed.scale_inv);
  buffers_.push_back(std::move(code_buffer));
  buffers_.push_back(std::move(scale_buffer));
  return placed;
}

kernels::LinearWeight Weights::get_fused_linear(std::span<const std::string> keys, std::span<const int64_t> rows,
                                                int64_t in_features, std::span<const TensorSlice> slices,
                                                std::span<const int64_t> full_rows) {
  METRALE_CHECK(!keys.empty() && keys.size() == rows.size(), "get_fused_linear: {} keys for {} row counts", keys.size(),
                rows.size());
  METRALE_CHECK(slices.empty() || (slices.size() == keys.size() && full_rows.size() == keys.size()),
                "get_fused_linear: {} slices and {} full row counts for {} keys", slices.size(), full_rows.size(),
                keys.size());
  if (!device_.is_cuda()) return {};
  const auto sliced = [&](size_t i) { return !slices.empty() && !slices[i].whole(); };
  // The first source row of part i when it is one run of rows starting on a 128-row block (FP8 parts
  // copy whole scale blocks); -1 otherwise.
  const auto fp8_row_begin = [&](size_t i) -> int64_t {
    if (!sliced(i)) return 0;
    const TensorSlice& slice = slices[i];
    if (slice.col_begin != 0 || slice.col_end >= 0 || slice.rows.empty()) return -1;
    for (size_t r = 1; r < slice.rows.size(); ++r)
      if (slice.rows[r] != slice.rows[0] + static_cast<int64_t>(r)) return -1;
    return slice.rows[0] % kernels::kFp8Block == 0 ? slice.rows[0] : -1;
  };
  int64_t total = 0;
  size_t fp8_parts = 0;
  bool whole_blocks = true;
  for (size_t i = 0; i < keys.size(); ++i) {
    total += rows[i];
    if (linear_is_fp8(keys[i])) ++fp8_parts;
    if (rows[i] % kernels::kFp8Block != 0 || fp8_row_begin(i) < 0) whole_blocks = false;
  }
  if (fp8_parts == 0) {
    const DType dtype = compute_dtype();
    Buffer buffer(device_, static_cast<size_t>(total * in_features) * dtype_size(dtype));
    const Tensor fused(buffer.data(), dtype, {total, in_features}, device_);
    for (size_t i = 0, row = 0; i < keys.size(); row += static_cast<size_t>(rows[i]), ++i) {
      const Tensor part = fused.slice(0, static_cast<int64_t>(row), static_cast<int64_t>(row) + rows[i]);
      if (sliced(i)) {
        load_into(keys[i], {full_rows[i], in_features}, slices[i], part);
      } else {
        load_into(keys[i], part);
      }
    }
    buffers_.push_back(std::move(buffer));
    return fused;
  }
  if (fp8_parts != keys.size() || !whole_blocks) return {};
  const int64_t column_blocks = kernels::fp8_scale_blocks(in_features);
  Buffer code_buffer(device_, static_cast<size_t>(total * in_features));
  Buffer scale_buffer(device_, static_cast<size_t>(total / kernels::kFp8Block * column_blocks) * sizeof(float));
  const kernels::LinearWeight fused(
      Tensor(code_buffer.data(), DType::kF8E4M3, {total, in_features}, device_),
      Tensor(scale_buffer.data(), DType::kF32, {total / kernels::kFp8Block, column_blocks}, device_));
  for (size_t i = 0, row = 0; i < keys.size(); row += static_cast<size_t>(rows[i]), ++i) {
    const auto begin = static_cast<int64_t>(row), end = begin + rows[i];
    load_fp8_into(keys[i], fused.weight.slice(0, begin, end),
                  fused.scale_inv.slice(0, begin / kernels::kFp8Block, end / kernels::kFp8Block), -1, fp8_row_begin(i));
  }
  buffers_.push_back(std::move(code_buffer));
  buffers_.push_back(std::move(scale_buffer));
  return fused;
}

bool Weights::linear_is_fp8(const std::string& key) const {
  if (quantization_ == WeightQuantization::kFp8) return true;
  if (!store_) return false;
  const std::string name = resolve(prefix_ + key);
  return store_->has(name) && store_->file_of(name).view(name).dtype() == DType::kF8E4M3;
}

void Weights::fill_random_fp8(const Tensor& codes, const Tensor& scales) {
  // Codes of normal(0, kCodeStddev) times a constant scale stddev / kCodeStddev: weights of normal(0,
  // stddev), as the plain random weights, with codes well inside e4m3's range (|code| <= 448).
  constexpr float kCodeStddev = 16.0f;
  kernels::random_fill(codes, {random_.seed * 1000003u + random_index_++, 0.0f, kCodeStddev});
  kernels::random_fill(scales, {0, random_.stddev / kCodeStddev, 0.0f});
}

void Weights::check_quantizable(const std::string& name, const Tensor& view) const {
  if (view.dtype() != DType::kF32 && view.dtype() != DType::kBF16 && view.dtype() != DType::kF16) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
}

void Weights::load_fp8_into(const std::string& key, const Tensor& codes, const Tensor& scales, int64_t expert,
                            int64_t row_begin) {
  METRALE_CHECK(codes.ndim() == 2 && codes.dtype() == DType::kF8E4M3 && codes.is_contiguous() &&
                    scales.dtype() == DType::kF32 && scales.is_contiguous() &&
                    scales.shape() ==
                        (Shape{kernels::fp8_scale_blocks(codes.size(0)), kernels::fp8_scale_blocks(codes.size(1))}) &&
                    codes.device() == device_ && scales.device() == device_,
                "load_fp8_into {}: codes {} scales {}", key, codes.describe(), scales.describe());
  if (!store_) {
    fill_random_fp8(codes, scales);
    return;
  }
  const std::string name = resolve(prefix_ + key);
  const std::string file = store_->file_of(name).path().string();
  Tensor view = store_->get(name);
  const std::string where = expert >= 0 ? fmt::format("expert {} of '{}'", expert, name) : "'" + name + "'";
  const int64_t rows = codes.size(0), cols = codes.size(1);
  const auto rows_of = [&](const Tensor& full) {
    Tensor matrix = full;
    if (expert >= 0) {
      if (full.ndim() != 3 || expert >= full.size(0)) {
        raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected an expert stack [E, N, K] with E > {}",
              file, name, full.shape().to_string(), expert);
      }
      matrix = full.select(0, expert);
    }
    return matrix;
  };
  const Tensor matrix = rows_of(view);
  if (matrix.ndim() != 2 || matrix.size(1) != cols || row_begin < 0 || row_begin + rows > matrix.size(0)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}; rows [{}, {}) of {} columns expected{}", file, name,
          view.shape().to_string(), row_begin, row_begin + rows, cols,
          expert >= 0 ? fmt::format(" (expert {})", expert) : std::string());
  }
  const Tensor part = matrix.slice(0, row_begin, row_begin + rows);
  if (view.dtype() != DType::kF8E4M3) {
    if (quantization_ != WeightQuantization::kFp8) {
      raise(ErrorCode::kInternal, "load_fp8_into {}: a plain tensor and no --quantization fp8", where);
    }
    check_quantizable(name, view);
    if (progress_ && row_begin == 0 && expert <= 0) progress_->advance(1, view.nbytes());
    const Fp8Blocks blocks = quantize_fp8_blocks(part);
    copy_bytes(codes.data(), device_, blocks.codes.data(), Device::cpu(), blocks.codes.size());
    copy_bytes(scales.data(), device_, blocks.scale_inv.data(), Device::cpu(), blocks.scale_inv.size() * sizeof(float));
    return;
  }
  if (!checkpoint_fp8_) {
    raise(ErrorCode::kBadFormat,
          "{}: tensor '{}' is f8e4m3 but config.json declares no quantization_config {{quant_method: \"fp8\"}}", file,
          name);
  }
  if (row_begin % kernels::kFp8Block != 0) {
    raise(ErrorCode::kUnsupported,
          "{}: {} splits at row {}, inside a {}-row scale block (an FP8 fused gate_up_proj needs "
          "moe_intermediate_size % {} == 0)",
          file, where, row_begin, kernels::kFp8Block, kernels::kFp8Block);
  }
  const std::string scale_name = name + "_scale_inv";
  if (!store_->has(scale_name)) {
    raise(ErrorCode::kNotFound, "{}: FP8 tensor '{}' has no block scales '{}'", store_->dir().string(), name,
          scale_name);
  }
  const Tensor all_scales = store_->get(scale_name);
  Shape expected_scales{kernels::fp8_scale_blocks(matrix.size(0)), kernels::fp8_scale_blocks(cols)};
  if (expert >= 0) expected_scales = Shape{view.size(0), expected_scales[0], expected_scales[1]};
  if (!(all_scales.shape() == expected_scales) || all_scales.dtype() != DType::kF32 || !all_scales.is_contiguous()) {
    raise(ErrorCode::kBadFormat, "{}: block scales '{}' are {} {}, expected f32 {} (blocks of {}x{} of {} {})",
          store_->file_of(scale_name).path().string(), scale_name, dtype_name(all_scales.dtype()),
          all_scales.shape().to_string(), expected_scales.to_string(), kernels::kFp8Block, kernels::kFp8Block, name,
          view.shape().to_string());
  }
  const int64_t block_row = row_begin / kernels::kFp8Block;
  const Tensor part_scales = rows_of(all_scales).slice(0, block_row, block_row + scales.size(0));
  if (progress_ && row_begin == 0 && expert <= 0) progress_->advance(2, view.nbytes() + all_scales.nbytes());
  copy_bytes(codes.data(), device_, part.data(), Device::cpu(), part.nbytes());
  copy_bytes(scales.data(), device_, part_scales.data(), Device::cpu(), part_scales.nbytes());
}

}  // namespace metrale
