#include "model/registry.h"

#include "core/error.h"
#include "core/log.h"
#include "model/arch/architectures.h"
#include "model/weight_store.h"

namespace metrale {
namespace {

constexpr ArchEntry kArchitectures[] = {
    {"qwen3", "Qwen3 dense (GQA, q/k norm, SwiGLU)", &arch::build_qwen3},
    {"qwen3_moe", "Qwen3 mixture of experts", &arch::build_qwen3_moe},
};

}  // namespace

std::span<const ArchEntry> registered_architectures() { return kArchitectures; }

const ArchEntry* find_architecture(std::string_view model_type) {
  for (const auto& entry : kArchitectures)
    if (entry.model_type == model_type) return &entry;
  return nullptr;
}

std::unique_ptr<Model> load_model(const std::filesystem::path& dir, Device device) {
  const ModelConfig config = load_model_config(dir);
  const ArchEntry* entry = find_architecture(config.model_type);
  if (entry == nullptr) entry = find_architecture(config.outer_model_type);
  if (entry == nullptr) {
    std::string supported;
    for (const auto& known : kArchitectures) supported += (supported.empty() ? "" : ", ") + std::string(known.model_type);
    raise(ErrorCode::kUnsupported, "{}: unknown model_type '{}' (supported: {})", config.source.string(),
          config.model_type, supported);
  }
  auto store = std::make_shared<const WeightStore>(dir);
  Weights weights(store, device);
  METRALE_LOG_INFO("loading {} from {} (prefix '{}') on {}", entry->model_type, dir.string(), weights.prefix(),
                   device.to_string());
  return entry->build(config, weights);
}

}  // namespace metrale
