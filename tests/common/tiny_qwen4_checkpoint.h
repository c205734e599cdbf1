// Tiny random qwen4_exp checkpoints (qwen.md §2.6, §4.6): the sizes, bf16-exact random weights, the
// PLE hash buffers computed independently of the engine (plain trial-division primes, a direct
// splitmix64), config.json (composite or text-only) and the safetensors file, with the PLE table as
// one tensor or as torch.chunk row shards. Shared by the model tests and the CLI test.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/tiny_checkpoint.h"

namespace metrale::testing {

struct Qwen4Spec {
  // The sizes TinySpec already has (vocab, hidden, heads, GDN, experts, ...); model_type "qwen4_exp".
  TinySpec base = default_base();
  std::vector<std::string> layer_types = {"linear_attention", "qwen_sparse_attention", "linear_attention",
                                          "qwen_sparse_attention"};
  std::vector<int64_t> ple_layer_ids = {1, 3};  // 1-based
  int64_t hc_count = 4, hc_lowrank = 6;
  int64_t ple_embed_dim = 16, ngram_size = 3, heads_per_ngram = 2, ple_conv_kernel = 3;
  int64_t ngram_vocab_size_base = 31, pad_multiple = 8, split_ngram_parts = 3;
  int64_t seed = 1234;
  int64_t eos_token_id = 2;
  int64_t indexer_heads = 8, indexer_head_dim = 8, indexer_budget = 4, compress_ratio = 2;
  std::string output_gate_type = "sigmoid";
  bool composite_config = true;

  static TinySpec default_base();
  int64_t ngram_heads() const { return (ngram_size - 1) * heads_per_ngram; }
  bool layer_is_attention(int64_t layer) const;
  // Position of `layer` in the sorted PLE layers, or -1.
  int64_t ple_index(int64_t layer) const;
};

// The PLE constants of PLE layer L (qwen.md §7.2 a, b), computed here without the engine.
std::vector<int64_t> reference_multipliers(int64_t vocab_size, int64_t ngram_size, int64_t layer_index, int64_t seed);
std::vector<int64_t> reference_head_sizes(int64_t base, int64_t heads, int64_t layer_index);
int64_t reference_padded_rows(const std::vector<int64_t>& sizes, int64_t pad_multiple);

// Float weights (keys relative to the text prefix; the PLE table at
// "layers.{i}.ple.ple_embedding.ngram_embedding.weight", unsharded) and the int64 buffers.
struct Qwen4Weights {
  TinyWeights floats;
  std::map<std::string, std::vector<int64_t>> buffers;  // "layers.{i}.ple.ple_embedding.layer_multipliers", ...
};
Qwen4Weights make_qwen4_weights(const Qwen4Spec& spec, uint64_t seed);

nlohmann::json qwen4_config_json(const Qwen4Spec& spec);

struct Qwen4Layout {
  bool shard_table = true;     // split_ngram_parts row shards (else one tensor)
  bool write_buffers = true;   // the three int64 buffers
};
void write_qwen4_checkpoint(const std::filesystem::path& dir, const Qwen4Spec& spec, const Qwen4Weights& weights,
                            const Qwen4Layout& layout = {});
std::unique_ptr<LoadedTinyModel> load_qwen4(const Qwen4Spec& spec, const Qwen4Weights& weights,
                                            const Qwen4Layout& layout = {});

}  // namespace metrale::testing
