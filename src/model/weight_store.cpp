#include "model/weight_store.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/strings.h"

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
  return file_of(name).view(name);
}

const SafetensorsFile& WeightStore::file_of(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) raise(ErrorCode::kNotFound, "{}: checkpoint has no tensor '{}'", dir_.string(), name);
  return *it->second;
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

Tensor Weights::get(const std::string& key, const Shape& shape) { return get_root(prefix_ + key, shape); }

Tensor Weights::get_root(const std::string& name, const Shape& shape) {
  const Tensor view = store_->get(name);
  if (!(view.shape() == shape)) {
    raise(ErrorCode::kBadFormat, "{}: tensor '{}' has shape {}, expected {}", store_->file_of(name).path().string(),
          name, view.shape().to_string(), shape.to_string());
  }
  if (!is_floating(view.dtype()) || view.dtype() == DType::kF8E4M3) {
    raise(ErrorCode::kUnsupported, "{}: tensor '{}' has dtype {}; weights must be bf16, f16 or f32",
          store_->file_of(name).path().string(), name, dtype_name(view.dtype()));
  }
  if (device_.is_cpu()) return view;
  Buffer buffer(device_, view.nbytes());
  copy_bytes(buffer.data(), device_, view.data(), Device::cpu(), view.nbytes());
  Tensor placed(buffer.data(), view.dtype(), view.shape(), device_);
  buffers_.push_back(std::move(buffer));
  return placed;
}

}  // namespace metrale
