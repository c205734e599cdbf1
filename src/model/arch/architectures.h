// Builders of every architecture, one per file in this folder, listed once in model/registry.cpp.
#pragma once

#include <memory>
#include <vector>

#include "model/blocks/attention.h"
#include "model/config.h"
#include "model/model.h"
#include "model/weight_store.h"

namespace metrale::arch {

std::unique_ptr<Model> build_qwen3(const ModelConfig& config, Weights& weights);
std::unique_ptr<Model> build_qwen3_moe(const ModelConfig& config, Weights& weights);

// Shared by the Qwen3 family files.
AttentionConfig qwen3_attention_config(const ModelConfig& config);
std::vector<int> qwen3_sliding_windows(const ModelConfig& config);

}  // namespace metrale::arch
