// WeightStore over single-file and sharded checkpoints, and Weights (prefix detection, shape and
// dtype checks), with errors that name the file and the tensor.
#include "model/weight_store.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/test_support.h"
#include "kernels/kernel_helpers.h"

namespace metrale {
namespace {

using testing::Random;
using testing::TempDir;
using testing::throws_error;
using testing::write_bytes;

// Random tensors kept alive for writing and for comparing what comes back.
struct TensorSet {
  std::vector<OwnedTensor> owned;
  std::vector<std::pair<std::string, Tensor>> named;
  void add(const std::string& name, DType dtype, Shape shape, Random& rng) {
    owned.push_back(random_tensor(dtype, shape, rng));
    named.emplace_back(name, owned.back().tensor);
  }
};

void write_index(const std::filesystem::path& dir, const nlohmann::json& weight_map) {
  std::ofstream(dir / "model.safetensors.index.json")
      << nlohmann::json{{"metadata", {}}, {"weight_map", weight_map}}.dump();
}

void expect_same_bytes(const Tensor& actual, const Tensor& expected) {
  EXPECT_EQ(actual.dtype(), expected.dtype());
  EXPECT_TRUE(actual.shape() == expected.shape()) << actual.describe() << " vs " << expected.describe();
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), expected.nbytes()), 0);
}

TEST(WeightStore, SingleFileRoundTrip) {
  TempDir dir;
  Random rng(1001);
  TensorSet set;
  set.add("model.embed_tokens.weight", DType::kBF16, {10, 4}, rng);
  set.add("model.norm.weight", DType::kF16, {4}, rng);
  set.add("lm_head.weight", DType::kF32, {10, 4}, rng);
  write_safetensors(dir / "model.safetensors", set.named);
  const WeightStore store(dir.path());
  EXPECT_EQ(store.names(),
            (std::vector<std::string>{"lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"}));
  for (const auto& [name, tensor] : set.named) {
    EXPECT_TRUE(store.has(name));
    expect_same_bytes(store.get(name), tensor);
    EXPECT_EQ(store.file_of(name).path(), dir / "model.safetensors");
  }
  EXPECT_FALSE(store.has("model.layers.0.mlp.gate_proj.weight"));
  EXPECT_TRUE(throws_error([&] { store.get("model.layers.0.mlp.gate_proj.weight"); }, ErrorCode::kNotFound,
                           {dir.path().string(), "'model.layers.0.mlp.gate_proj.weight'"}));
}

TEST(WeightStore, TwoShardsThroughTheIndex) {
  TempDir dir;
  Random rng(1002);
  TensorSet first, second;
  first.add("model.embed_tokens.weight", DType::kBF16, {6, 4}, rng);
  first.add("model.layers.0.input_layernorm.weight", DType::kBF16, {4}, rng);
  second.add("model.norm.weight", DType::kF32, {4}, rng);
  second.add("lm_head.weight", DType::kF16, {6, 4}, rng);
  write_safetensors(dir / "model-00001-of-00002.safetensors", first.named);
  write_safetensors(dir / "model-00002-of-00002.safetensors", second.named);
  nlohmann::json map;
  for (const auto& [name, t] : first.named) map[name] = "model-00001-of-00002.safetensors";
  for (const auto& [name, t] : second.named) map[name] = "model-00002-of-00002.safetensors";
  write_index(dir.path(), map);
  // A stray single-file checkpoint next to the index must not be used.
  write_bytes(dir / "model.safetensors", "garbage");

  const WeightStore store(dir.path());
  EXPECT_EQ(store.names().size(), 4u);
  for (const auto& [name, tensor] : first.named) {
    expect_same_bytes(store.get(name), tensor);
    EXPECT_EQ(store.file_of(name).path().filename(), "model-00001-of-00002.safetensors");
  }
  for (const auto& [name, tensor] : second.named) {
    expect_same_bytes(store.get(name), tensor);
    EXPECT_EQ(store.file_of(name).path().filename(), "model-00002-of-00002.safetensors");
  }
}

TEST(WeightStore, MissingShardIsNotFoundNamingIt) {
  TempDir dir;
  Random rng(1003);
  TensorSet set;
  set.add("model.embed_tokens.weight", DType::kBF16, {6, 4}, rng);
  write_safetensors(dir / "model-00001-of-00002.safetensors", set.named);
  write_index(dir.path(), {{"model.embed_tokens.weight", "model-00001-of-00002.safetensors"},
                           {"model.norm.weight", "model-00002-of-00002.safetensors"}});
  EXPECT_TRUE(throws_error([&] { WeightStore store(dir.path()); }, ErrorCode::kNotFound,
                           {dir.path().string(), "model-00002-of-00002.safetensors"}));
}

TEST(WeightStore, IndexPointingAtAShardThatLacksTheTensor) {
  TempDir dir;
  Random rng(1004);
  TensorSet first, second;
  first.add("model.embed_tokens.weight", DType::kBF16, {6, 4}, rng);
  second.add("model.norm.weight", DType::kBF16, {4}, rng);
  write_safetensors(dir / "a.safetensors", first.named);
  write_safetensors(dir / "b.safetensors", second.named);
  // b.safetensors holds model.norm.weight, but the index says it is in a.safetensors.
  write_index(dir.path(), {{"model.embed_tokens.weight", "a.safetensors"}, {"model.norm.weight", "a.safetensors"}});
  EXPECT_TRUE(throws_error([&] { WeightStore store(dir.path()); }, ErrorCode::kBadFormat,
                           {dir.path().string(), "'model.norm.weight'", "a.safetensors"}));
}

TEST(WeightStore, BadIndexFiles) {
  Random rng(1005);
  const auto make_dir = [&](TempDir& dir, const std::string& index_text) {
    TensorSet set;
    set.add("model.embed_tokens.weight", DType::kBF16, {2, 2}, rng);
    write_safetensors(dir / "a.safetensors", set.named);
    write_bytes(dir / "model.safetensors.index.json", index_text);
  };
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json", "invalid JSON"},
      {R"({"metadata": {}})", "weight_map"},
      {R"({"weight_map": [1]})", "weight_map"},
      {R"({"weight_map": {"model.embed_tokens.weight": 3}})", "model.embed_tokens.weight"},
      {R"({"weight_map": {"model.embed_tokens.weight": "../a.safetensors"}})", "plain file name"},
      {R"({"weight_map": {"model.embed_tokens.weight": "sub/a.safetensors"}})", "plain file name"},
  };
  for (const auto& [text, fragment] : cases) {
    TempDir dir;
    make_dir(dir, text);
    EXPECT_TRUE(throws_error([&] { WeightStore store(dir.path()); }, ErrorCode::kBadFormat,
                             {(dir / "model.safetensors.index.json").string(), fragment}))
        << text;
  }
}

TEST(WeightStore, DirectoryWithoutCheckpoint) {
  TempDir dir;
  EXPECT_TRUE(throws_error([&] { WeightStore store(dir.path()); }, ErrorCode::kNotFound,
                           {dir.path().string(), "model.safetensors"}));
}

TEST(WeightStore, CorruptShardNamesTheShard) {
  TempDir dir;
  write_bytes(dir / "model.safetensors", "xy");
  EXPECT_TRUE(throws_error([&] { WeightStore store(dir.path()); }, ErrorCode::kBadFormat,
                           {(dir / "model.safetensors").string()}));
}

std::shared_ptr<const WeightStore> store_with(const TempDir& dir, TensorSet& set) {
  write_safetensors(dir / "model.safetensors", set.named);
  return std::make_shared<const WeightStore>(dir.path());
}

TEST(Weights, FindsEitherPrefixAndPrefersLanguageModel) {
  Random rng(1006);
  {
    TempDir dir;
    TensorSet set;
    set.add("model.embed_tokens.weight", DType::kBF16, {5, 3}, rng);
    set.add("model.norm.weight", DType::kBF16, {3}, rng);
    Weights weights(store_with(dir, set), Device::cpu());
    EXPECT_EQ(weights.prefix(), "model.");
    EXPECT_TRUE(weights.has("norm.weight"));
    expect_same_bytes(weights.get("norm.weight", {3}), set.named[1].second);
  }
  {
    TempDir dir;
    TensorSet set;
    set.add("model.language_model.embed_tokens.weight", DType::kBF16, {5, 3}, rng);
    set.add("model.language_model.norm.weight", DType::kBF16, {3}, rng);
    set.add("model.visual.patch_embed.weight", DType::kBF16, {2, 2}, rng);
    set.add("lm_head.weight", DType::kBF16, {5, 3}, rng);
    Weights weights(store_with(dir, set), Device::cpu());
    EXPECT_EQ(weights.prefix(), "model.language_model.");
    expect_same_bytes(weights.get("norm.weight", {3}), set.named[1].second);
    EXPECT_TRUE(weights.has_root("lm_head.weight"));
    expect_same_bytes(weights.get_root("lm_head.weight", {5, 3}), set.named[3].second);
  }
  {
    TempDir dir;
    TensorSet set;
    set.add("transformer.wte.weight", DType::kBF16, {5, 3}, rng);
    const auto store = store_with(dir, set);
    EXPECT_TRUE(throws_error([&] { Weights weights(store, Device::cpu()); }, ErrorCode::kNotFound,
                             {dir.path().string(), "model.embed_tokens.weight"}));
    Weights explicit_prefix(store, Device::cpu(), "transformer.");
    EXPECT_TRUE(explicit_prefix.has("wte.weight"));
  }
}

TEST(Weights, ShapeAndDtypeErrorsNameFileAndTensor) {
  TempDir dir;
  Random rng(1007);
  TensorSet set;
  set.add("model.embed_tokens.weight", DType::kBF16, {5, 3}, rng);
  set.add("model.layers.0.self_attn.q_proj.weight", DType::kBF16, {6, 3}, rng);
  std::vector<int32_t> ids = {1, 2, 3};
  set.named.emplace_back("model.ids", Tensor(ids.data(), DType::kI32, {3}));
  std::vector<uint8_t> fp8 = {0x38, 0x40, 0x48};
  set.named.emplace_back("model.fp8.weight", Tensor(fp8.data(), DType::kF8E4M3, {3}));
  Weights weights(store_with(dir, set), Device::cpu());
  const std::string file = (dir / "model.safetensors").string();
  EXPECT_TRUE(throws_error(
      [&] {
        weights.get("layers.0.self_attn.q_proj.weight", {8, 3});
      },
      ErrorCode::kBadFormat, {file, "'model.layers.0.self_attn.q_proj.weight'", "[6, 3]", "[8, 3]"}));
  EXPECT_TRUE(throws_error(
      [&] {
        weights.get("layers.0.self_attn.k_proj.weight", {6, 3});
      },
      ErrorCode::kNotFound, {"'model.layers.0.self_attn.k_proj.weight'"}));
  EXPECT_TRUE(throws_error([&] { weights.get("ids", {3}); }, ErrorCode::kUnsupported, {file, "'model.ids'", "i32"}));
  EXPECT_TRUE(
      throws_error([&] { weights.get("fp8.weight", {3}); }, ErrorCode::kUnsupported, {file, "'model.fp8.weight'"}));
}

TEST(Weights, UnsupportedButKnownDtypeRequestedAsAWeight) {
  TempDir dir;
  const std::string header = R"({"model.embed_tokens.weight":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
                             R"("model.norm.weight":{"dtype":"F64","shape":[2],"data_offsets":[8,24]}})";
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  write_bytes(dir / "model.safetensors", bytes + header + std::string(24, '\x01'));
  Weights weights(std::make_shared<const WeightStore>(dir.path()), Device::cpu());
  EXPECT_TRUE(throws_error([&] { weights.get("norm.weight", {2}); }, ErrorCode::kUnsupported,
                           {(dir / "model.safetensors").string(), "'model.norm.weight'", "F64"}));
}

// The format does not promise aligned data: older writers did not pad the header to 8 bytes, and
// offsets follow the previous tensor's size (a BF16 tensor of odd length leaves the next F32 tensor
// 2 bytes off). The CPU kernels read weights through float* / uint16_t*, so a weight handed to them
// must be aligned to its element size whatever the file's layout.
TEST(Weights, TensorsAreElementAlignedEvenWhenTheFileIsNot) {
  TempDir dir;
  // Header of odd length (data section at an odd address), a 3-element BF16 tensor, then an F32 one.
  std::string header = R"({"model.embed_tokens.weight":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                       R"("model.norm.weight":{"dtype":"F32","shape":[2],"data_offsets":[6,14]}})";
  if (header.size() % 2 == 0) header += " ";
  const std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x4040};  // 1, -2, 3
  const std::vector<float> f32 = {0.25f, -8.5f};
  std::string data(reinterpret_cast<const char*>(bf16.data()), 6);
  data += std::string(reinterpret_cast<const char*>(f32.data()), 8);
  std::string bytes(8, '\0');
  bytes[0] = static_cast<char>(header.size());
  write_bytes(dir / "model.safetensors", bytes + header + data);
  Weights weights(std::make_shared<const WeightStore>(dir.path()), Device::cpu());
  const Tensor embed = weights.get("embed_tokens.weight", {3});
  const Tensor norm = weights.get("norm.weight", {2});
  EXPECT_EQ(reinterpret_cast<uintptr_t>(embed.data()) % 2, 0u) << "bf16 weight at an odd address";
  EXPECT_EQ(reinterpret_cast<uintptr_t>(norm.data()) % 4, 0u) << "f32 weight not 4-byte aligned";
  uint16_t embed_back[3];
  float norm_back[2];
  std::memcpy(embed_back, embed.data(), 6);
  std::memcpy(norm_back, norm.data(), 8);
  EXPECT_EQ(std::vector<uint16_t>(embed_back, embed_back + 3), bf16);
  EXPECT_EQ(std::vector<float>(norm_back, norm_back + 2), f32);
}

}  // namespace
}  // namespace metrale
