// The architecture registry: model_type -> builder. Adding an architecture means one file in
// model/arch/ and one entry in registry.cpp.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string_view>

#include "model/fp8_weights.h"
#include "model/kv_cache_options.h"
#include "model/model.h"
#include "model/tensor_parallel.h"

namespace metrale {

class Weights;

using ArchBuilder = std::unique_ptr<Model> (*)(const ModelConfig&, Weights&);
// Whether a checkpoint tensor (its full stored name) is one the architecture does not read on purpose.
using IgnoredTensor = bool (*)(const ModelConfig&, std::string_view name);

struct ArchEntry {
  std::string_view model_type;
  std::string_view description;
  ArchBuilder build;
  // Checkpoint tensors the architecture leaves unread on purpose (a vision tower of a composite
  // checkpoint; an MTP head's tensors when the config declares no MTP layers); null: none.
  IgnoredTensor ignores = nullptr;
};

struct LoadOptions {
  // A checkpoint tensor the model does not read, and whose name is not ignored on purpose, is a
  // load error naming it (a key layout the loader does not know would otherwise run with missing
  // weights unnoticed); this turns the error into a warning.
  bool allow_unused_weights = false;
  // kFp8: the plain projection weights that blocks read through Weights::get_linear() (dense
  // attention and MLP) are quantised to FP8 blocks at load. A checkpoint whose config.json declares
  // fp8 quantization is read in FP8 either way.
  WeightQuantization quantization = WeightQuantization::kNone;
  // The dtype of the activations (and of the weights on the GPU): nullopt is the device's default, f32
  // on the CPU and bf16 on the GPU. kF32 on the GPU converts the weights to f32 at load (the mHC maps,
  // bf16 by definition, excepted) and runs the whole forward in f32 (the tight comparison against an
  // fp32 reference; slower, twice the memory). The CPU computes in f32 only: kBF16 there is an error.
  std::optional<DType> compute_dtype = std::nullopt;
  // Threads that bring the checkpoint's pages into memory while the model is built from them
  // (model/weight_prefetch.h); 0: the hardware's concurrency; 1 and up: that many.
  int32_t load_threads = 0;
  // The attention blocks' KV-cache dtype and FP8 scale source (--kv-cache-dtype, --calculate-kv-scales).
  KvCacheOptions kv_cache = {};
  // The tensor-parallel rank this model is built for (model/tensor_parallel.h): its share of every
  // block that splits. The default is one rank, the whole model.
  TensorParallel tensor_parallel = {};
};

std::span<const ArchEntry> registered_architectures();
const ArchEntry* find_architecture(std::string_view model_type);

// Reads config.json and the checkpoint of `dir` and builds the model on `device`. Errors name the
// file and the tensor or field at fault.
// Every tensor of the checkpoint is read by the model or ignored on purpose (see LoadOptions).
std::unique_ptr<Model> load_model(const std::filesystem::path& dir, Device device, const LoadOptions& options = {});
// Builds the architecture of `config` with random weights generated on `device` (benchmarks), as
// load_model would with `options`: computing in options.compute_dtype, with options.kv_cache, and
// with WeightQuantization::kFp8 every projection that a checkpoint could hold in FP8
// (Weights::get_linear, the MoE experts) generated directly in FP8 on the device, so that no bf16
// copy of the model exists at any point (an 80B-parameter preset fits one 141 GB GPU).
std::unique_ptr<Model> make_random_model(const ModelConfig& config, Device device, uint64_t seed = 1,
                                         const LoadOptions& options = {});

}  // namespace metrale
