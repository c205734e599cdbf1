// LayerStack: decoder layers joined by a residual scheme, the trunk of a DecoderModel or the layers
// of an MTP head. It runs the layers over a step (stream blocks, sites, the scheme's maps between
// them), owns the block -> cache mapping and the commit of verify steps.
//
// Stateful blocks are numbered in forward order: per layer its stream blocks, then its mixer (a mixer
// with nothing to keep has an empty spec). Block b reads caches[b], declared by cache_specs()[b],
// keeps verify region b of ForwardBatch::verify_scratch (verify_scratch_offsets) and reads its step
// inputs at its offset in ForwardBatch::step_inputs (step_input_specs lists every block's in block
// order). A layer may own several stateful blocks (a stream block and a mixer).
#pragma once

#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "model/blocks/layer.h"
#include "model/blocks/residual.h"

namespace metrale {

class LayerStack {
 public:
  // `label` names a layer in error messages ("layer", "MTP layer"). The scheme has two sites per
  // layer and the layers' width.
  LayerStack(std::vector<DecoderLayer> layers, std::unique_ptr<ResidualScheme> residual, std::string label);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  size_t num_blocks() const { return blocks_.size(); }
  const ResidualScheme& residual() const { return *residual_; }
  const StatefulBlock& block(size_t index) const { return *blocks_.at(index); }
  // The first block of `layer` and one past its last ([layer_blocks(l).first, .second)).
  std::pair<size_t, size_t> layer_blocks(int64_t layer) const;

  std::vector<CacheSpec> cache_specs() const;
  // Graph-safe and verify-capable when every block is; needs prestage when any block does.
  BlockCapabilities capabilities() const;
  // Whether any block keeps per-slot state, so that a verify step needs a commit.
  bool needs_commit() const;
  std::vector<StepInputSpec> step_input_specs() const;
  // The layers' FeedForward::routed_weight_bytes for a step of `rows` rows.
  double routed_weight_bytes(int64_t rows) const;
  // host_inputs: one per step_input_specs() entry; each block fills its own.
  void prestage(const PrestageRows& rows, std::span<const Tensor> host_inputs) const;

  // The largest StepContext::layer_scratch the blocks of layers [first, last) need.
  size_t scratch_bytes(const ForwardBatch& batch, Device device, int64_t first, int64_t last) const;
  // Offsets of each block's region in ForwardBatch::verify_scratch and the total ([num_blocks + 1]),
  // each region on a 256-byte boundary.
  std::vector<size_t> verify_scratch_offsets(int64_t num_tokens, int64_t num_seqs, DType activation) const;

  // Runs layers [first, last) over `streams` (begin() already done): site 2 * first's input is read
  // from the streams, and the scheme's finish writes hidden [T, H]. x and out [T, H] are the site
  // input and output buffers. On verify steps `verify_offsets` are verify_scratch_offsets of the batch.
  void forward(const StepContext& step, std::span<const BlockCache> caches, const ResidualStreams& streams,
               int64_t first, int64_t last, const Tensor& x, const Tensor& out, const Tensor& hidden,
               std::span<const size_t> verify_offsets = {});
  // Layer `layer`'s stream blocks, its first site's pre map into x, and its mixer's write_keys.
  void write_keys(const StepContext& step, std::span<const BlockCache> caches, const ResidualStreams& streams,
                  int64_t layer, const Tensor& x);
  // commit() of every block with per-slot state, each with its verify region.
  void commit(const StepContext& step, std::span<const BlockCache> caches, const VerifyCommit& kept,
              std::span<const size_t> verify_offsets);

 private:
  // `step` for block b: its verify region (verify steps) and its step inputs.
  StepContext block_step(const StepContext& step, size_t b, std::span<const size_t> verify_offsets,
                         std::span<const Tensor> step_outputs = {}) const;
  void check_caches(std::span<const BlockCache> caches) const;
  void run_stream_blocks(const StepContext& step, std::span<const BlockCache> caches, const ResidualStreams& streams,
                         int64_t layer, std::span<const size_t> verify_offsets);

  std::vector<DecoderLayer> layers_;
  std::unique_ptr<ResidualScheme> residual_;
  std::string label_;
  std::vector<StatefulBlock*> blocks_;     // in forward order
  std::vector<int64_t> block_layer_;       // per block: its layer
  std::vector<size_t> layer_first_block_;  // [layers + 1]
  std::vector<size_t> block_first_input_;  // [blocks + 1]: offsets into the step inputs
  std::vector<uint8_t> block_has_slots_;   // per block: its cache has per-slot tensors (needs a commit)
};

}  // namespace metrale
