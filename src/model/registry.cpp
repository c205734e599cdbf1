#include "model/registry.h"

#include "core/error.h"
#include "core/log.h"
#include "kernels/linear.h"
#include "model/arch/architectures.h"
#include "model/weight_store.h"

namespace metrale {
namespace {

constexpr ArchEntry kArchitectures[] = {
    {"qwen3", "Qwen3 dense (GQA, q/k norm, SwiGLU)", &arch::build_qwen3},
    {"qwen3_moe", "Qwen3 mixture of experts", &arch::build_qwen3_moe},
    {"qwen3_next", "Qwen3-Next hybrid (Gated DeltaNet + gated attention, MoE with shared expert)",
     &arch::build_qwen3_next},
    {"qwen3_5", "Qwen3.5 text hybrid (Gated DeltaNet + gated attention, dense MLP)", &arch::build_qwen3_5},
    {"qwen3_5_moe", "Qwen3.5-MoE text hybrid (Gated DeltaNet + gated attention, MoE with shared expert)",
     &arch::build_qwen3_5_moe},
};

}  // namespace

std::span<const ArchEntry> registered_architectures() { return kArchitectures; }

const ArchEntry* find_architecture(std::string_view model_type) {
  for (const auto& entry : kArchitectures)
    if (entry.model_type == model_type) return &entry;
  // The text config of a composite model ("qwen3_5_text" inside "qwen3_5") names the same architecture.
  constexpr std::string_view kTextSuffix = "_text";
  if (model_type.size() > kTextSuffix.size() && model_type.ends_with(kTextSuffix)) {
    return find_architecture(model_type.substr(0, model_type.size() - kTextSuffix.size()));
  }
  return nullptr;
}

namespace {

const ArchEntry& require_architecture(const ModelConfig& config) {
  const ArchEntry* entry = find_architecture(config.model_type);
  if (entry == nullptr) entry = find_architecture(config.outer_model_type);
  if (entry == nullptr) {
    std::string supported;
    for (const auto& known : kArchitectures) supported += (supported.empty() ? "" : ", ") + std::string(known.model_type);
    raise(ErrorCode::kUnsupported, "{}: unknown model_type '{}' (supported: {})", config.source.string(),
          config.model_type, supported);
  }
  return *entry;
}

}  // namespace

std::unique_ptr<Model> make_random_model(const ModelConfig& config, Device device, uint64_t seed) {
  const ArchEntry& entry = require_architecture(config);
  if (device.is_cuda()) kernels::linear_prepare(device);
  Weights weights(RandomWeights{seed, 0.02f, config.tie_word_embeddings}, device);
  return entry.build(config, weights);
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir, Device device) {
  const ModelConfig config = load_model_config(dir);
  const ArchEntry* entry = &require_architecture(config);
  // GEMM handles and workspaces exist before any graph capture.
  if (device.is_cuda()) kernels::linear_prepare(device);
  auto store = std::make_shared<const WeightStore>(dir);
  Weights weights(store, device);
  METRALE_LOG_INFO("loading {} from {} (prefix '{}') on {}", entry->model_type, dir.string(), weights.prefix(),
                   device.to_string());
  // Counted as they are read; the count may end below the total (tensors an architecture skips).
  auto progress = std::make_shared<StageProgress>(
      "weights", fmt::format("loading weights of {} from {} on {}", entry->model_type, dir.string(), device.to_string()),
      "loaded weights", "tensors", static_cast<int64_t>(store->names().size()), store->total_bytes());
  weights.set_progress(progress);
  std::unique_ptr<Model> model = entry->build(config, weights);
  progress->finish();
  return model;
}

}  // namespace metrale
