#include "model/registry.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/log.h"
#include "kernels/linear.h"
#include "model/arch/architectures.h"
#include "model/weight_prefetch.h"
#include "model/weight_store.h"

namespace metrale {
namespace {

// Qwen3-Next: the MTP head's tensors (read when the config declares MTP layers).
bool ignores_mtp(const ModelConfig&, std::string_view name) {
  return name.starts_with("mtp.");
}
// Qwen3.5 and qwen4_exp: the vision tower of the composite checkpoint and the MTP head's tensors
// (qwen4_exp has no MTP drafter here; its hub files may carry mtp.*).
bool ignores_vision_and_mtp(const ModelConfig&, std::string_view name) {
  return name.starts_with("model.visual.") || name.starts_with("mtp.");
}

constexpr ArchEntry kArchitectures[] = {
    {"qwen3", "Qwen3 dense (GQA, q/k norm, SwiGLU)", &arch::build_qwen3},
    {"qwen3_moe", "Qwen3 mixture of experts", &arch::build_qwen3_moe},
    {"qwen3_next", "Qwen3-Next hybrid (Gated DeltaNet + gated attention, MoE with shared expert)",
     &arch::build_qwen3_next, ignores_mtp},
    {"qwen3_5", "Qwen3.5 text hybrid (Gated DeltaNet + gated attention, dense MLP)", &arch::build_qwen3_5,
     ignores_vision_and_mtp},
    {"qwen3_5_moe", "Qwen3.5-MoE text hybrid (Gated DeltaNet + gated attention, MoE with shared expert)",
     &arch::build_qwen3_5_moe, ignores_vision_and_mtp},
    {"qwen4_exp",
     "Qwen4-Exp / Qwen3.8-Flash-Next (hyper-connection streams, GDN + QSA sparse attention, PLE n-gram embeddings, "
     "MoE)",
     &arch::build_qwen4_exp, ignores_vision_and_mtp},
    {"glm5_next", "GLM-5.3-Flash text (Kimi Delta Attention + DSA sparse MLA, mHC streams, sigmoid-routed MoE, MTP)",
     &arch::build_glm5_next, &arch::glm5_next_ignores},
};

}  // namespace

std::span<const ArchEntry> registered_architectures() {
  return kArchitectures;
}

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
    for (const auto& known : kArchitectures)
      supported += (supported.empty() ? "" : ", ") + std::string(known.model_type);
    raise(ErrorCode::kUnsupported, "{}: unknown model_type '{}' (supported: {})", config.source.string(),
          config.model_type, supported);
  }
  return *entry;
}

// Applies a requested compute dtype (LoadOptions::compute_dtype) to `weights`.
void apply_compute_dtype(Weights& weights, std::optional<DType> compute_dtype) {
  if (!compute_dtype) return;
  if (weights.device().is_cpu()) {
    if (*compute_dtype != DType::kF32) {
      raise(ErrorCode::kUnsupported, "the CPU computes in float32; {} activations need a GPU",
            dtype_name(*compute_dtype));
    }
    return;
  }
  weights.set_compute_dtype(*compute_dtype);
}

// One line on the FP8 KV cache's scales, and a warning for the layers left at 1.0.
void report_kv_scales(const Weights& weights) {
  const KvCacheOptions& options = weights.kv_cache();
  const KvScaleTally& tally = weights.kv_scale_tally();
  if (options.dtype != DType::kF8E4M3) return;
  using Source = KvScaleTally::Source;
  if (tally.total() == 0) {
    METRALE_LOG_WARN(
        "--kv-cache-dtype fp8: this model has no attention layer with an FP8 KV cache (MLA latents, "
        "indexer keys and QSA attention keep the activation dtype)");
    return;
  }
  METRALE_LOG_INFO(
      "FP8 (e4m3) KV cache in {} attention layers: scales from the checkpoint in {}, calibrated on the "
      "first step served in {}",
      tally.total(), tally.count(Source::kCheckpoint), tally.count(Source::kCalibration));
  if (const int unit = tally.count(Source::kUnit); unit > 0) {
    METRALE_LOG_WARN(
        "FP8 KV cache: {} attention layers have no k_scale / v_scale in the checkpoint and "
        "--calculate-kv-scales is off: they use a scale of 1.0 (keys and values beyond +-448 saturate, "
        "small ones lose precision)",
        unit);
  }
}

}  // namespace

std::unique_ptr<Model> make_random_model(const ModelConfig& config, Device device, uint64_t seed,
                                         const LoadOptions& options) {
  const ArchEntry& entry = require_architecture(config);
  if (device.is_cuda()) kernels::linear_prepare(device);
  Weights weights(RandomWeights{seed, 0.02f, config.tie_word_embeddings}, device);
  apply_compute_dtype(weights, options.compute_dtype);
  weights.set_fp8(false, options.quantization);
  weights.set_kv_cache(options.kv_cache);
  weights.set_tensor_parallel(options.tensor_parallel);
  std::unique_ptr<Model> model = entry.build(config, weights);
  report_kv_scales(weights);
  return model;
}

namespace {

// The checkpoint's tensors the built model did not read, less those its architecture ignores on
// purpose (ArchEntry::ignores, and a tied embedding's stored lm_head copy): an error naming them, or a warning.
void check_unused_tensors(const ArchEntry& entry, const ModelConfig& config, const WeightStore& store,
                          const LoadOptions& options) {
  std::vector<std::string> unexpected;
  size_t ignored = 0;
  for (const std::string& name : store.unused_names()) {
    const bool on_purpose = (entry.ignores != nullptr && entry.ignores(config, name)) ||
                            (config.tie_word_embeddings && name == "lm_head.weight");
    if (on_purpose) {
      ++ignored;
    } else {
      unexpected.push_back(name);
    }
  }
  if (ignored > 0)
    METRALE_LOG_INFO("{} checkpoint tensors are not used by {} (ignored on purpose)", ignored, entry.model_type);
  if (unexpected.empty()) return;
  constexpr size_t kNamed = 8;
  std::string names;
  for (size_t i = 0; i < std::min(unexpected.size(), kNamed); ++i) names += (i ? ", " : "") + unexpected[i];
  if (unexpected.size() > kNamed) names += fmt::format(", and {} more", unexpected.size() - kNamed);
  if (!options.allow_unused_weights) {
    raise(ErrorCode::kBadFormat,
          "{}: {} tensor(s) of the checkpoint are not used by the {} model: {} (a key layout this loader does not "
          "know; --allow-unused-weights loads it anyway)",
          store.dir().string(), unexpected.size(), entry.model_type, names);
  }
  METRALE_LOG_WARN("{}: {} tensor(s) of the checkpoint are not used by the {} model (--allow-unused-weights): {}",
                   store.dir().string(), unexpected.size(), entry.model_type, names);
}

}  // namespace

std::unique_ptr<Model> load_model(const std::filesystem::path& dir, Device device, const LoadOptions& options) {
  const ModelConfig config = load_model_config(dir);
  const ArchEntry* entry = &require_architecture(config);
  // GEMM handles and workspaces exist before any graph capture.
  if (device.is_cuda()) kernels::linear_prepare(device);
  auto store = std::make_shared<const WeightStore>(dir);
  Weights weights(store, device);
  const bool checkpoint_fp8 = checkpoint_has_fp8_weights(config);
  weights.set_fp8(checkpoint_fp8, options.quantization);
  weights.set_tensor_parallel(options.tensor_parallel);
  apply_compute_dtype(weights, options.compute_dtype);
  weights.set_kv_cache(options.kv_cache);
  METRALE_LOG_INFO("loading {} from {} (prefix '{}') on {} computing in {}{}", entry->model_type, dir.string(),
                   weights.prefix(), device.to_string(), dtype_name(weights.compute_dtype()),
                   checkpoint_fp8                                     ? " with the checkpoint's FP8 weights"
                   : options.quantization == WeightQuantization::kFp8 ? ", quantising projections to FP8"
                                                                      : "");
  // The pages come in on a pool of threads while the model is built from them.
  WeightPrefetcher prefetcher(store->mapped_ranges(), options.load_threads);
  // Counted as they are read; the count may end below the total (tensors an architecture skips).
  auto progress = std::make_shared<StageProgress>(
      "weights",
      fmt::format("loading weights of {} from {} on {}", entry->model_type, dir.string(), device.to_string()),
      "loaded weights", "tensors", static_cast<int64_t>(store->names().size()), store->total_bytes());
  weights.set_progress(progress);
  const auto start = std::chrono::steady_clock::now();
  std::unique_ptr<Model> model = entry->build(config, weights);
  prefetcher.stop();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  METRALE_LOG_INFO("loaded {} tensors, {:.2f} GB in {:.2f} s ({:.2f} GB/s; {} reader thread{})", progress->items(),
                   static_cast<double>(progress->bytes()) / 1e9, seconds,
                   seconds > 0 ? static_cast<double>(progress->bytes()) / 1e9 / seconds : 0.0, prefetcher.num_threads(),
                   prefetcher.num_threads() == 1 ? "" : "s");
  progress->finish();
  check_unused_tensors(*entry, config, *store, options);
  report_kv_scales(weights);
  return model;
}

}  // namespace metrale
