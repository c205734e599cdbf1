#include "model/weight_store.h"

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

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
      if (!file.is_string()) raise(ErrorCode::kBadFormat, "{}: weight_map['{}'] is not a file name", index_path.string(), name);
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
      const auto it = std::find_if(files_.begin(), files_.end(), [&](const auto& f) { return f->path().filename() == shard; });
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
    derived.kv_cache_ = kv_cache_;
    derived.kv_scale_tally_ = kv_scale_tally_;
    return derived;
  }
  RandomWeights random = random_;
  random.seed = random_.seed * 0x9E3779B97F4A7C15ull + 0x6D7470ull;  // "mtp": any fixed mix will do
  Weights derived(random, device_);
  derived.prefix_ = std::move(prefix);
  derived.quantization_ = quantization_;
  derived.kv_cache_ = kv_cache_;
  derived.kv_scale_tally_ = kv_scale_tally_;
  return derived;
}

const WeightStore& Weights::store() const {
  METRALE_CHECK(store_ != nullptr, "random weights have no store");
  return *store_;
}

std::string Weights::source_name() const { return store_ ? store_->dir().string() : std::string("random weights"); }

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
  const DType dtype = device_.is_cpu() ? DType::kF32 : DType::kBF16;
  Buffer buffer(device_, static_cast<size_t>(shape.numel()) * dtype_size(dtype));
  Tensor tensor(buffer.data(), dtype, shape, device_);
  // Vectors are norm weights and gates: near 1 keeps activations in range through deep stacks.
  const bool vector = shape.ndim() == 1;
  kernels::random_fill(tensor, {random_.seed * 1000003u + random_index_++, vector ? 1.0f : 0.0f,
                                vector ? 0.01f : random_.stddev});
  buffers_.push_back(std::move(buffer));
  (void)name;
  return tensor;
}

Tensor Weights::get(const std::string& key, const Shape& shape) { return get_root(prefix_ + key, shape); }

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
    convert_to_f32(view.dtype(), static_cast<const char*>(view.data()) + begin * static_cast<int64_t>(view.element_size()),
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
          "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32 (FP8 is read for the dense attention and "
          "MLP projections only)",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  if (device_.is_cpu()) {
    // Mapped tensors are used in place, unless the file leaves them misaligned for their dtype.
    if (reinterpret_cast<uintptr_t>(view.data()) % view.element_size() == 0) return view;
    Buffer buffer(device_, view.nbytes());
    std::memcpy(buffer.data(), view.data(), view.nbytes());
    Tensor placed(buffer.data(), view.dtype(), view.shape(), device_);
    buffers_.push_back(std::move(buffer));
    return placed;
  }
  // The GPU computes with bf16 weights: other float dtypes are converted on the way up.
  Buffer buffer(device_, static_cast<size_t>(view.numel()) * dtype_size(DType::kBF16));
  if (view.dtype() == DType::kBF16) {
    copy_bytes(buffer.data(), device_, view.data(), Device::cpu(), view.nbytes());
  } else {
    std::vector<uint16_t> converted(static_cast<size_t>(view.numel()));
    std::vector<float> row(static_cast<size_t>(std::min<int64_t>(view.numel(), 1 << 20)));
    for (int64_t begin = 0; begin < view.numel(); begin += static_cast<int64_t>(row.size())) {
      const int64_t count = std::min<int64_t>(static_cast<int64_t>(row.size()), view.numel() - begin);
      convert_to_f32(view.dtype(), static_cast<const char*>(view.data()) + begin * static_cast<int64_t>(view.element_size()),
                     row.data(), static_cast<size_t>(count));
      convert_from_f32(DType::kBF16, row.data(), converted.data() + begin, static_cast<size_t>(count));
    }
    copy_bytes(buffer.data(), device_, converted.data(), Device::cpu(), converted.size() * sizeof(uint16_t));
  }
  Tensor placed(buffer.data(), DType::kBF16, view.shape(), device_);
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

kernels::LinearWeight Weights::read_fp8(const std::string& name, const Shape& shape) {
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
  return kernels::LinearWeight(place(weight), place(scales));
}

kernels::LinearWeight Weights::get_linear(const std::string& key, const Shape& shape) {
  METRALE_CHECK(shape.ndim() == 2, "get_linear {}: a projection weight is [N, K], not {}", key, shape.to_string());
  if (!store_) {
    if (quantization_ != WeightQuantization::kFp8) return synthesize(prefix_ + key, shape);
    // Synthesized on the CPU so the quantiser can read it; the codes go to the model's device.
    Weights host(random_, Device::cpu());
    host.random_index_ = random_index_++;
    return quantize(host.synthesize(prefix_ + key, shape));
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
  if (view.dtype() != DType::kF32 && view.dtype() != DType::kBF16 && view.dtype() != DType::kF16) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (progress_) progress_->advance(1, view.nbytes());
  return quantize(view);
}

}  // namespace metrale
