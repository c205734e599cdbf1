// WeightStore: every tensor of a Hugging Face model directory, from model.safetensors or from the
// shards listed in model.safetensors.index.json, as CPU views into the mapped files.
// Weights: the view an architecture reads its parameters through: keys relative to the text
// model's prefix, shape checks with clear errors, and placement on the model's device.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/startup.h"
#include "kernels/linear_weight.h"
#include "model/fp8_weights.h"
#include "model/kv_cache_options.h"
#include "model/safetensors.h"
#include "model/tensor_parallel.h"

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
  // Each file's mapped tensor data, in the order of the files (for WeightPrefetcher).
  std::vector<std::span<const std::byte>> mapped_ranges() const;

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
  // get_linear() of an FP8 projection (linear_is_fp8) whose source row r lands at row
  // destination_row(r): the stored weight (dequantised when f8e4m3) is permuted on the host in fp32
  // and block-quantised (a permutation need not keep 128-row blocks whole).
  kernels::LinearWeight get_linear_permuted(const std::string& key, const Shape& shape,
                                            const std::function<int64_t(int64_t)>& destination_row);
  // The projections `prefix + keys[i]` (rows[i] x in_features each) stacked by rows into one weight
  // on the GPU, so that one launch runs them all: in the compute dtype when no part is FP8, in FP8
  // when every part is and each part's rows are a multiple of 128 (the parts' scale blocks then stack
  // whole). Empty on the CPU or when neither holds (the block then keeps its parts).
  // With `slices` (one per key), part i is slices[i] of a stored [full_rows[i], in_features] tensor and
  // rows[i] is the slice's row count; an FP8 part then fuses only when its slice is one run of whole
  // 128-row blocks.
  kernels::LinearWeight get_fused_linear(std::span<const std::string> keys, std::span<const int64_t> rows,
                                         int64_t in_features, std::span<const TensorSlice> slices = {},
                                         std::span<const int64_t> full_rows = {});
  // --- Slices: a tensor-parallel rank's part of a weight (tensor_parallel.h) ----------------------
  // `slice` of the tensor `prefix + key`, whose stored shape must be `full`, as get() would place it
  // (contiguous; on the CPU an owned copy). A whole slice is get(key, full).
  Tensor get(const std::string& key, const Shape& full, const TensorSlice& slice);
  Tensor get_root(const std::string& name, const Shape& full, const TensorSlice& slice);  // no prefix
  // get_linear() of `slice` of `prefix + key` [N, K] = `full`: plain, or FP8 (an f8e4m3 tensor whose
  // slice keeps its 128x128 scale blocks whole copies codes and scales; any other slice of it is
  // dequantised, sliced and quantised again; a plain one under WeightQuantization::kFp8 is sliced,
  // then quantised).
  kernels::LinearWeight get_linear(const std::string& key, const Shape& full, const TensorSlice& slice);
  // load_into() of `slice` of `prefix + key` (stored shape `full`); `destination` has the sliced shape.
  void load_into(const std::string& key, const Shape& full, const TensorSlice& slice, const Tensor& destination);
  // The rank this model is built for (every weight whole when size == 1). Copied by with_prefix().
  void set_tensor_parallel(const TensorParallel& tensor_parallel);
  const TensorParallel& tensor_parallel() const { return tensor_parallel_; }

  // get() for a weight that blocks use as plain matrices (e.g. absorbed into attention): an f8e4m3
  // one is dequantised with its scales (f32 on the CPU, bf16 on the GPU).
  Tensor get_dequantized(const std::string& key, const Shape& shape);
  // Whether get_linear() / load_fp8_into() give `prefix + key` in FP8: stored as f8e4m3, or any
  // plain weight under WeightQuantization::kFp8.
  bool linear_is_fp8(const std::string& key) const;
  // Reads a projection weight `prefix + key` as FP8 into `codes` [n, K] f8e4m3 and `scales`
  // [ceil(n/128), ceil(K/128)] f32 (contiguous views on the model's device, e.g. one expert's rows of
  // a fused buffer): its rows [row_begin, row_begin + n), of expert `expert` when the tensor is an
  // expert stack [E, N, K] (expert >= 0). An f8e4m3 tensor copies its codes and `<name>_scale_inv`
  // rows (row_begin a multiple of 128); a plain one is quantised here (WeightQuantization::kFp8 only);
  // random weights fill both directly in FP8. No bf16 copy is made on the device.
  void load_fp8_into(const std::string& key, const Tensor& codes, const Tensor& scales, int64_t expert = -1,
                     int64_t row_begin = 0);
  // FP8 weights: read from the checkpoint (its config.json declares them) and/or quantised at load.
  void set_fp8(bool checkpoint_fp8, WeightQuantization quantization);
  // Whether get_linear() may return FP8 weights.
  bool fp8_linears() const { return checkpoint_fp8_ || quantization_ == WeightQuantization::kFp8; }
  // The dtype the model computes its activations in: f32 on the CPU; on the GPU bf16, or f32 when
  // set_compute_dtype() asks for it (exact comparisons against an fp32 reference).
  DType compute_dtype() const { return device_.is_cpu() ? DType::kF32 : compute_dtype_; }
  // GPU only: bf16 (the default) or f32. Weights placed by get() and the projections blocks fuse on
  // the device then take this dtype (an f32 run converts every weight to f32 at load). Ignored on the
  // CPU, which computes in f32 on weights as stored.
  void set_compute_dtype(DType dtype);
  // The dtype weights have on the model's device when placed by get(): as stored on the CPU, the
  // compute dtype on the GPU.
  DType device_dtype(DType stored) const { return device_.is_cpu() ? stored : compute_dtype_; }

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
  // The checked host views of an f8e4m3 tensor and its `<name>_scale_inv` (both counted as read).
  std::pair<Tensor, Tensor> fp8_views(const std::string& name, const Shape& shape);
  // The stored [N, K] weight `name` in fp32 on the host (f8e4m3 dequantised with its block scales).
  std::vector<float> host_values(const std::string& name, const Shape& shape);
  kernels::LinearWeight quantize(const Tensor& host_weight);
  // Random FP8 weights of the same spread as the plain random ones, generated on the device.
  void fill_random_fp8(const Tensor& codes, const Tensor& scales);
  void check_quantizable(const std::string& name, const Tensor& view) const;
  // A CPU tensor on the model's device: in place on the CPU when aligned for its dtype, else a copy kept here.
  Tensor place(const Tensor& host);
  // A copy of the host tensor on the model's device, kept here: as stored on the CPU, in the compute
  // dtype on the GPU.
  Tensor place_copy(const Tensor& host);
  // The checked host view of a plain (bf16, f16, f32) tensor `name` of shape `full`, counted as read.
  Tensor plain_view(const std::string& name, const Shape& full);
  // `slice` of the plain host tensor `view` as contiguous host bytes of its dtype.
  static std::vector<char> slice_bytes(const Tensor& view, const TensorSlice& slice);
  kernels::LinearWeight random_linear(const Shape& shape);
  // The FP8 slice of an f8e4m3 tensor whose slice keeps its scale blocks whole; nullopt otherwise.
  std::optional<kernels::LinearWeight> exact_fp8_slice(const std::string& name, const Shape& full,
                                                       const TensorSlice& slice);

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
  DType compute_dtype_ = DType::kBF16;  // the GPU's (compute_dtype())
  KvCacheOptions kv_cache_;
  TensorParallel tensor_parallel_;
  std::shared_ptr<KvScaleTally> kv_scale_tally_ = std::make_shared<KvScaleTally>();
};

}  // namespace metrale
