// WeightStore: every tensor of a Hugging Face model directory, from model.safetensors or from the
// shards listed in model.safetensors.index.json, as CPU views into the mapped files.
// Weights: the view an architecture reads its parameters through: keys relative to the text
// model's prefix, shape checks with clear errors, and placement on the model's device.
#pragma once

#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/startup.h"
#include "kernels/linear_weight.h"
#include "model/fp8_weights.h"
#include "model/kv_cache_options.h"
#include "model/safetensors.h"

namespace metrale {

class WeightStore {
 public:
  explicit WeightStore(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  // CPU view of a tensor; throws kNotFound naming the directory and tensor. Marks it used.
  Tensor get(const std::string& name) const;
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  // Tensors no get() has read, sorted: after a model is built, the checkpoint's tensors it ignored.
  std::vector<std::string> unused_names() const;
  // The bytes of all its tensors (what loading reads at most).
  uint64_t total_bytes() const;

 private:
  std::filesystem::path dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const SafetensorsFile*> index_;
  // Reading a tensor is not a change of the checkpoint, so a const store records it.
  mutable std::mutex used_mutex_;
  mutable std::unordered_set<std::string> used_;
};

// Random weights stand in for a checkpoint in benchmarks: every requested tensor is synthesized
// on the device (normal(0, stddev) matrices, norm-like vectors near their neutral value).
struct RandomWeights {
  uint64_t seed = 0;
  float stddev = 0.02f;
  bool tie_word_embeddings = false;
};

class Weights {
 public:
  // prefix: where the text model's modules live ("model." or "model.language_model."); found from
  // the embedding key when empty.
  Weights(std::shared_ptr<const WeightStore> store, Device device, std::string prefix = {});
  // Synthesized weights (no files). Layout questions (has()) answer with the fused layouts.
  Weights(const RandomWeights& random, Device device);

  const std::string& prefix() const { return prefix_; }
  Device device() const { return device_; }
  bool is_random() const { return store_ == nullptr; }
  const WeightStore& store() const;
  // Where the weights come from, for error messages.
  std::string source_name() const;

  bool has(const std::string& key) const;
  bool has_root(const std::string& name) const;
  // The tensor `prefix + key` on the model's device, checked against `shape`. Throws kNotFound when
  // missing and kBadFormat when mis-shaped, naming the file and tensor.
  Tensor get(const std::string& key, const Shape& shape);
  Tensor get_root(const std::string& name, const Shape& shape);  // no prefix (e.g. lm_head.weight)
  // Reads `prefix + key` into `destination` (a view on the model's device, e.g. rows of a fused
  // weight), converting to its dtype; its shape is the expected shape. No other copy is kept.
  void load_into(const std::string& key, const Tensor& destination);
  // A projection weight `prefix + key` of `shape` [N, K] as the blocks run it (kernels::LinearWeight):
  // an f8e4m3 checkpoint tensor with its `<name>_scale_inv` [ceil(N/128), ceil(K/128)] f32 (both read);
  // a plain tensor quantised to FP8 here under WeightQuantization::kFp8; else what get() gives.
  // Errors name the tensor: an FP8 tensor without an fp8 quantization_config, a missing or
  // mis-shaped scale.
  kernels::LinearWeight get_linear(const std::string& key, const Shape& shape);
  // FP8 weights: read from the checkpoint (its config.json declares them) and/or quantised at load.
  void set_fp8(bool checkpoint_fp8, WeightQuantization quantization);
  // Whether get_linear() may return FP8 weights (blocks then keep their projections unfused).
  bool fp8_linears() const { return checkpoint_fp8_ || quantization_ == WeightQuantization::kFp8; }
  // How attention blocks store their keys and values, and the tally of where FP8 layers got their
  // scales (shared with every with_prefix() copy).
  void set_kv_cache(const KvCacheOptions& options) { kv_cache_ = options; }
  const KvCacheOptions& kv_cache() const { return kv_cache_; }
  KvScaleTally& kv_scale_tally() const { return *kv_scale_tally_; }
  // A small checkpoint tensor `prefix + key` (any float dtype, any shape) as fp32 host values; marks
  // it used. Throws kNotFound when missing (random weights have none: check has_stored() first).
  std::vector<float> read_host_values(const std::string& key);
  // Whether the checkpoint stores `prefix + key` (always false for random weights).
  bool has_stored(const std::string& key) const { return store_ != nullptr && has(key); }
  // The dtype weights have on the model's device when placed by get() (bf16 on the GPU).
  DType device_dtype(DType stored) const { return device_.is_cpu() ? stored : DType::kBF16; }

  // The same checkpoint with keys relative to `prefix` instead (e.g. "mtp." for the MTP head, whose
  // keys sit at the root of Qwen3.5 and Qwen3-Next checkpoints). It collects its own device copies.
  // Random weights: an independent stream seeded from this one.
  Weights with_prefix(std::string prefix) const;

  // Checkpoint names under other spellings (a hub layout's renames): a lookup of `canonical` (a full
  // name, prefix included) reads `stored`. Shared with every with_prefix() copy.
  void add_alias(const std::string& canonical, const std::string& stored);
  // The stored name a full name resolves to (itself unless aliased).
  const std::string& resolve(const std::string& name) const;

  // Device copies made so far (empty on the CPU, where weights stay in the mapping).
  std::vector<Buffer> take_device_buffers() { return std::move(buffers_); }
  std::shared_ptr<const WeightStore> store_ptr() const { return store_; }
  // Counts every tensor read from the checkpoint (get, get_root, load_into) into `progress`;
  // with_prefix() views count into it too.
  void set_progress(std::shared_ptr<StageProgress> progress) { progress_ = std::move(progress); }

 private:
  Tensor synthesize(const std::string& name, const Shape& shape);
  kernels::LinearWeight read_fp8(const std::string& name, const Shape& shape);
  kernels::LinearWeight quantize(const Tensor& host_weight);
  // A CPU tensor on the model's device: in place on the CPU when aligned for its dtype, else a copy kept here.
  Tensor place(const Tensor& host);

  std::shared_ptr<const WeightStore> store_;  // null for random weights
  RandomWeights random_;
  uint64_t random_index_ = 0;
  Device device_;
  std::string prefix_;
  std::vector<Buffer> buffers_;
  // Shared by with_prefix() copies: canonical full name -> stored name.
  std::shared_ptr<std::unordered_map<std::string, std::string>> aliases_ =
      std::make_shared<std::unordered_map<std::string, std::string>>();
  std::shared_ptr<StageProgress> progress_;  // null: not counted
  bool checkpoint_fp8_ = false;
  WeightQuantization quantization_ = WeightQuantization::kNone;
  KvCacheOptions kv_cache_;
  std::shared_ptr<KvScaleTally> kv_scale_tally_ = std::make_shared<KvScaleTally>();
};

}  // namespace metrale
