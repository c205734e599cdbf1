// --kv-cache-dtype and the FP8 KV scales through load_model: the names the flag takes; attention
// layers declare e4m3 K/V cache tensors when asked (the Gated DeltaNet state of a hybrid stays as
// it is); checkpoint k_scale / v_scale tensors (a scalar or one per KV head) are read, so they count
// as used with any cache dtype, and are applied on both the write and the read (a value scale of 4
// that only one side applied would shrink the attention output fourfold); a mis-shaped scale is an
// error naming it.
#include <gtest/gtest.h>

#include "core/test_support.h"
#include "model/kv_cache_options.h"
#include "model/model_helpers.h"
#include "model/registry.h"

namespace metrale {
namespace {

using testing::ForwardRunner;
using testing::random_tokens;
using testing::TempDir;
using testing::throws_error;
using testing::TinySpec;
using testing::TinyWeights;

LoadOptions kv_options(std::optional<DType> dtype) {
  LoadOptions options;
  options.kv_cache.dtype = dtype;
  return options;
}

TEST(KvCacheDtype, ParsesTheFlagsNames) {
  EXPECT_EQ(parse_kv_cache_dtype("auto"), std::nullopt);
  EXPECT_EQ(parse_kv_cache_dtype("bf16"), DType::kBF16);
  EXPECT_EQ(parse_kv_cache_dtype("fp32"), DType::kF32);
  EXPECT_EQ(parse_kv_cache_dtype("fp8"), DType::kF8E4M3);
  EXPECT_EQ(parse_kv_cache_dtype("fp8_e4m3"), DType::kF8E4M3);
  EXPECT_TRUE(throws_error([] { parse_kv_cache_dtype("fp8_e5m2"); }, ErrorCode::kInvalidArgument, {"fp8_e5m2"}));
  EXPECT_EQ(kv_cache_dtype_name(DType::kF8E4M3), "fp8_e4m3");
  EXPECT_EQ(kv_cache_dtype_name(std::nullopt), "auto");
}

// Scales per layer: k a scalar (shape []), v one per KV head.
TinyWeights with_scales(const TinySpec& spec, TinyWeights weights, float k_scale, float v_scale) {
  for (int64_t layer = 0; layer < spec.num_layers; ++layer) {
    const std::string prefix = "layers." + std::to_string(layer) + ".self_attn.";
    weights[prefix + "k_scale"] = {{}, {k_scale}};
    weights[prefix + "v_scale"] = {{spec.num_kv_heads}, std::vector<float>(static_cast<size_t>(spec.num_kv_heads), v_scale)};
  }
  return weights;
}

TEST(KvCacheDtype, Fp8AttentionCachesUseTheCheckpointScales) {
  const TinySpec spec;
  const TinyWeights weights = testing::make_tiny_weights(spec, 51);
  TempDir plain_dir, scaled_dir;
  testing::write_tiny_checkpoint(plain_dir.path(), spec, weights);
  testing::write_tiny_checkpoint(scaled_dir.path(), spec, with_scales(spec, weights, 0.02f, 4.0f));
  // The scale tensors are read whatever the cache dtype: no unused-tensor error.
  const auto reference = load_model(scaled_dir.path(), Device::cpu());
  const auto scaled = load_model(scaled_dir.path(), Device::cpu(), kv_options(DType::kF8E4M3));
  const auto unit = load_model(plain_dir.path(), Device::cpu(), kv_options(DType::kF8E4M3));
  for (const CacheSpec& cache : scaled->cache_specs()) {
    ASSERT_EQ(cache.tensors.size(), 2u);
    for (const CacheTensorSpec& tensor : cache.tensors) EXPECT_EQ(tensor.dtype, DType::kF8E4M3);
  }
  for (const CacheSpec& cache : reference->cache_specs())
    for (const CacheTensorSpec& tensor : cache.tensors) EXPECT_EQ(tensor.dtype, std::nullopt);
  const std::vector<int32_t> tokens = random_tokens(spec, 24, 52);
  ForwardRunner reference_runner(*reference), scaled_runner(*scaled), unit_runner(*unit);
  const auto expected = reference_runner.step({{0, tokens}});
  const auto with_checkpoint_scales = scaled_runner.step({{0, tokens}});
  const auto with_unit_scales = unit_runner.step({{0, tokens}});
  const double scaled_error = testing::relative_l2(with_checkpoint_scales, expected);
  const double unit_error = testing::relative_l2(with_unit_scales, expected);
  RecordProperty("checkpoint_scales_relative_l2", std::to_string(scaled_error));
  RecordProperty("unit_scales_relative_l2", std::to_string(unit_error));
  EXPECT_LT(scaled_error, 0.05);
  EXPECT_LT(unit_error, 0.05);
  EXPECT_GT(scaled_error, 0.0);
  EXPECT_NE(with_checkpoint_scales, with_unit_scales);  // other codes: the scales reached the writes
  // Decode steps read what the prefill wrote.
  const auto decode = scaled_runner.step({{0, {3}}});
  const auto decode_reference = reference_runner.step({{0, {3}}});
  EXPECT_LT(testing::relative_l2(decode, decode_reference), 0.05);
}

TEST(KvCacheDtype, MisShapedScaleIsNamed) {
  const TinySpec spec;
  TinyWeights weights = with_scales(spec, testing::make_tiny_weights(spec, 53), 0.5f, 0.5f);
  weights["layers.1.self_attn.v_scale"] = {{3}, {1.0f, 1.0f, 1.0f}};  // 2 KV heads
  TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(dir.path(), Device::cpu(), kv_options(DType::kF8E4M3)); },
                           ErrorCode::kBadFormat, {"model.layers.1.self_attn.v_scale", "3 values"}));
  weights["layers.1.self_attn.v_scale"] = {{2}, {1.0f, -1.0f}};
  TempDir negative;
  testing::write_tiny_checkpoint(negative.path(), spec, weights);
  EXPECT_TRUE(throws_error([&] { load_model(negative.path(), Device::cpu(), kv_options(DType::kF8E4M3)); },
                           ErrorCode::kBadFormat, {"v_scale", "positive"}));
}

TEST(KvCacheDtype, HybridModelsQuantiseOnlyAttention) {
  TinySpec spec;
  spec.model_type = "qwen3_5";
  spec.num_layers = 4;
  spec.head_dim = 16;  // rotary 4 at the default factor 0.25
  TempDir dir;
  testing::write_tiny_checkpoint(dir.path(), spec, testing::make_hybrid_weights(spec, 54));
  const auto model = load_model(dir.path(), Device::cpu(), kv_options(DType::kF8E4M3));
  int fp8_tensors = 0, other_tensors = 0;
  for (const CacheSpec& cache : model->cache_specs()) {
    for (const CacheTensorSpec& tensor : cache.tensors) {
      const bool attention = tensor.name == "k" || tensor.name == "v";
      EXPECT_EQ(tensor.dtype == DType::kF8E4M3, attention) << tensor.name;
      (attention ? fp8_tensors : other_tensors) += 1;
    }
  }
  EXPECT_EQ(fp8_tensors, 2 * 2);  // two full-attention layers
  EXPECT_GT(other_tensors, 0);
  const std::vector<int32_t> tokens = random_tokens(spec, 9, 55);
  ForwardRunner runner(*model);
  const auto logits = runner.step({{0, tokens}});
  for (const auto& row : logits)
    for (const float value : row) ASSERT_TRUE(std::isfinite(value));
}

}  // namespace
}  // namespace metrale
