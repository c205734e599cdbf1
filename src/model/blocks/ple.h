// PLE, per-layer hashed n-gram embeddings (qwen4_exp, qwen.md §7.2, §8): a stream block on the
// hyper-connection streams R [T, N*H] of its layer, before the layer's first site:
//   ids  = hashed 2..n_max-grams of the EOS-segmented token history      [T, NH] i64
//   E    = concat_h table[ids[:, h]]                                      [T, NH * d_head]
//   key  = key_proj(E) [T, N*H]; value = value_proj(E) [T, H]
//   G, G^ = ple_gate(key, value, R)                                       [T, N*H] each
//   R    <- D(R + D(G + C)),  C = silu(dilated causal conv of G^)         (dilation n_max, Kp taps)
//
// The table (R_pad rows of d_head = ple_embed_dim / NH values, ~100 GB for the released model) stays
// in host memory, memory-mapped from the checkpoint (one tensor or `split_ngram_parts` row shards,
// never copied). The ids and the row gather run in the prestage hook on the host, from the
// sequence's token history the engine hands it (PrestageRows::history): the rows go up with the
// step in a fixed step-input buffer ("ple_rows", [T, NH * d_head] in the activation dtype), so
// decode stays a graph replay and the table never has to fit in GPU memory. Because the ids are
// computed from the engine's history, they are exact after a rejected draft, a prefix-cache hit or
// a preemption without any per-slot id state.
//
// Cache (per slot): "conv", the last (Kp - 1) * n_max rows of G^ [(Kp-1)*n_max, N*H] in the
// activation dtype. Verify steps read the slot without writing it and keep G^ of every row in the
// verify scratch; commit() replays the conv over the kept rows (as the GDN layers do).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/blocks/layer.h"
#include "model/weight_store.h"

namespace metrale {

struct PleConfig {
  int64_t streams = 4;          // N (hc_count)
  int64_t hidden_size = 0;      // H
  int64_t embed_dim = 0;        // ple_embed_dim (a multiple of NH)
  int64_t ngram_size = 3;       // n_max >= 2
  int64_t heads_per_ngram = 8;  // hpn
  int64_t conv_kernel = 4;      // Kp (ple_conv_kernel_size)
  double rms_norm_eps = 1e-6;
  int64_t eos_token_id = 0;     // the PLE EOS (first eos_token_id)
  int64_t vocab_size = 0;       // Vt
  int64_t layer_index = 0;      // L: position of this layer in the sorted ple_layer_ids
  int64_t seed = 1234;
  int64_t vocab_size_base = 20000000;  // ngram_vocab_size_base
  int64_t pad_multiple = 128;          // make_ngram_vocab_size_divisible_by
  int64_t split_parts = 512;           // split_ngram_parts (on-disk row shards)

  int64_t num_heads() const { return (ngram_size - 1) * heads_per_ngram; }  // NH
  int64_t head_dim() const { return embed_dim / num_heads(); }              // d_head
};

// The concatenated n-gram table in host memory: one tensor or row shards of `chunk_rows` rows each
// (torch.chunk: every shard but the last has exactly chunk_rows rows), views into the mapped files.
class PleTable {
 public:
  PleTable() = default;
  // Reads `<key>weight` or `<key>shard_{s}.weight` (s = 0..) from the checkpoint, [padded_rows, d_head]
  // each; random weights get a synthesized host table.
  PleTable(Weights& weights, const std::string& key, int64_t padded_rows, int64_t head_dim, int64_t split_parts);

  int64_t rows() const { return rows_; }
  int64_t head_dim() const { return head_dim_; }
  size_t num_shards() const { return shards_.size(); }
  // out [T, NH * d_head] host memory (rows may be strided): out[t, h] = row ids[t * NH + h].
  void gather(const std::vector<int64_t>& ids, int64_t heads, const Tensor& out) const;

 private:
  std::vector<Tensor> shards_;  // [rows_s, d_head] host views
  OwnedTensor owned_;           // random weights only
  int64_t rows_ = 0, head_dim_ = 0, chunk_rows_ = 0;
};

class PleBlock : public StreamBlock {
 public:
  // Loads `<prefix>ple_embedding.*`, `key_proj`, `value_proj`, `norm_key`, `norm_query`, `norm_conv`,
  // `conv1d`; checks the stored multipliers, head sizes and offsets against §7.2 (kBadFormat naming
  // the tensor on a mismatch).
  PleBlock(const PleConfig& config, Weights& weights, const std::string& prefix);

  CacheSpec cache_spec() const override;
  BlockCapabilities capabilities() const override { return {true, true, true}; }
  std::vector<StepInputSpec> step_input_specs() const override;
  void prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const override;
  void forward(const StepContext& step, const BlockCache& cache, const Tensor& streams) override;
  size_t verify_scratch_bytes(int64_t num_tokens, int64_t num_seqs, DType activation) const override;
  void commit(const StepContext& step, const BlockCache& cache, const VerifyCommit& kept) override;

  const std::vector<int64_t>& multipliers() const { return multipliers_; }
  const std::vector<int64_t>& head_sizes() const { return head_sizes_; }
  const std::vector<int64_t>& head_offsets() const { return head_offsets_; }
  const PleTable& table() const { return table_; }
  // ids [T * NH] of the rows (host arrays as in PrestageRows).
  std::vector<int64_t> ngram_ids(const PrestageRows& rows) const;

 private:
  static constexpr size_t kConv = 0;  // BlockCache::tensors

  PleConfig config_;
  DType row_dtype_;  // of the "ple_rows" step input: the activation dtype of the model's device
  std::vector<int64_t> multipliers_, head_sizes_, head_offsets_;
  PleTable table_;
  Tensor key_proj_, value_proj_;                      // [N*H, E], [H, E]
  Tensor norm_key_, norm_query_, norm_conv_;          // [N*H] each (grouped zero-centred)
  Tensor conv_weight_;                                // [N*H, Kp] (conv1d.weight [N*H, 1, Kp])
};

}  // namespace metrale
