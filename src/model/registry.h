// The architecture registry: model_type -> builder. Adding an architecture means one file in
// model/arch/ and one entry in registry.cpp.
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <string_view>

#include "model/model.h"

namespace metrale {

class Weights;

using ArchBuilder = std::unique_ptr<Model> (*)(const ModelConfig&, Weights&);

struct ArchEntry {
  std::string_view model_type;
  std::string_view description;
  ArchBuilder build;
};

std::span<const ArchEntry> registered_architectures();
const ArchEntry* find_architecture(std::string_view model_type);

// Reads config.json and the checkpoint of `dir` and builds the model on `device`. Errors name the
// file and the tensor or field at fault.
std::unique_ptr<Model> load_model(const std::filesystem::path& dir, Device device);
// Builds the architecture of `config` with random weights generated on `device` (benchmarks).
std::unique_ptr<Model> make_random_model(const ModelConfig& config, Device device, uint64_t seed = 1);

}  // namespace metrale
