// The seams every decoder layer is built from: stateful blocks (mixers such as attention and GDN,
// and stream blocks that act on the residual streams themselves), feed-forward blocks (dense MLP,
// MoE), all run on the step's ragged batch and joined by the model's residual scheme (residual.h).
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "core/error.h"
#include "model/cache_spec.h"
#include "model/forward_batch.h"
#include "runtime/arena.h"

namespace metrale {

class Communicator;

// What a block needs from the step besides its input: the batch metadata and the scratch arena.
struct StepContext {
  const ForwardBatch& batch;
  Arena& workspace;
  DType activation_dtype;  // f32 on the CPU
  // Scratch shared by the blocks of one step (at least the largest scratch_bytes); its contents do
  // not survive from one block to the next.
  Tensor layer_scratch;
  // Verify steps only (ForwardBatch::verify): this block's region of ForwardBatch::verify_scratch,
  // StatefulBlock::verify_scratch_bytes long; it must hold what commit() needs until the commit.
  // (Initialised here so that contexts built without it need not name it.)
  Tensor verify_scratch = Tensor();
  // This block's entries of ForwardBatch::step_inputs, one per StatefulBlock::step_input_specs entry.
  std::span<const Tensor> step_inputs = {};
  // This block's StatefulBlock::step_output_bytes region: carved from the workspace before the first
  // layer of the forward, so it outlives the per-layer temporaries and later blocks of the same
  // forward can read it; its address is the same for every step of one batch shape (graph replays).
  Tensor step_output = Tensor();
  // The tensor-parallel group that partial block outputs are summed over (null: one rank).
  Communicator* communicator = nullptr;
};

// What a stateful block lets the engine do; the model reports the conjunction (disjunction for
// needs_prestage) over its blocks as ModelCapabilities.
struct BlockCapabilities {
  bool graph_safe = true;       // its forward and commit may be captured in a CUDA graph and replayed
  bool needs_prestage = false;  // it reads step inputs its prestage() fills on the host
  bool supports_verify = true;  // a verify forward followed by commit() leaves its cache exactly right
};

// A block carves its StepContext::verify_scratch into tensors that each start on a 256-byte
// boundary: verify_scratch_bytes sums the sizes rounded up by this, and the carving advances by it.
inline size_t verify_scratch_aligned(size_t bytes) {
  constexpr size_t kAlignment = 256;
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Any block that keeps state between steps. Its cache is what cache_spec() declares; the model hands
// its forward and commit the matching BlockCache. Paged tensors of a verify step's rejected rows are
// dropped by the engine truncating the sequence; per-slot tensors are the block's to get right: a
// block with per-slot state either implements the verify protocol (leave the slots untouched in a
// verify forward, keep what it needs in StepContext::verify_scratch, advance the slots over the kept
// rows in commit) or declares supports_verify = false.
class StatefulBlock {
 public:
  virtual ~StatefulBlock() = default;
  virtual CacheSpec cache_spec() const = 0;
  virtual BlockCapabilities capabilities() const { return {}; }
  // Bytes of StepContext::step_output this block publishes to later blocks of the same forward for
  // `num_tokens` rows (a DSA layer's selection that the shared layer after it reuses).
  virtual size_t step_output_bytes(int64_t /*num_tokens*/) const { return 0; }
  // Bytes of StepContext::verify_scratch a verify step of `num_tokens` rows over `num_seqs` sequences
  // needs.
  virtual size_t verify_scratch_bytes(int64_t /*num_tokens*/, int64_t /*num_seqs*/, DType /*activation*/) const {
    return 0;
  }
  // After a verify forward (Model::commit_kept_rows), for blocks whose cache has per-slot tensors:
  // `step` carries the verify batch and this block's verify_scratch, as in the verify forward.
  virtual void commit(const StepContext& /*step*/, const BlockCache& /*cache*/, const VerifyCommit& /*kept*/) {}

  // Per-row step inputs this block reads (StepContext::step_inputs), filled on the host by prestage()
  // before every upload. A block that declares any must say needs_prestage in its capabilities.
  virtual std::vector<StepInputSpec> step_input_specs() const { return {}; }
  // host_inputs[i]: [T, per_row] host memory of step_input_specs()[i], to fill for `rows`.
  virtual void prestage(const PrestageRows& /*rows*/, std::span<const Tensor> /*host_inputs*/) const {}
};

// A sequence mixer: reads the normalised site input, writes the site output.
class Mixer : public StatefulBlock {
 public:
  // Bytes of StepContext::layer_scratch this mixer needs for `batch` (kernels' split buffers).
  virtual size_t scratch_bytes(const ForwardBatch& /*batch*/, Device /*device*/) const { return 0; }
  // x [T, H] (the site input); out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const BlockCache& cache, const Tensor& x, const Tensor& out) = 0;
  // Whether `out` is this tensor-parallel rank's partial sum of the output (model/tensor_parallel.h):
  // the layer stack all-reduces it over the group before the residual scheme takes it.
  virtual bool output_is_partial() const { return false; }
  // Only what forward() writes to the cache for x's rows (the batch's positions and slot_mapping),
  // without computing the output: the MTP head's keys of positions that draft nothing. Attention
  // mixers only.
  virtual void write_keys(const StepContext& /*step*/, const BlockCache& /*cache*/, const Tensor& /*x*/) {
    raise(ErrorCode::kUnsupported, "only attention layers write their keys without a forward");
  }
};

// A block that acts on the residual streams themselves, between two sites of the residual scheme
// (per-layer embeddings such as PLE: R <- R + f(R, token ids)). It runs before its layer's first site.
class StreamBlock : public StatefulBlock {
 public:
  virtual size_t scratch_bytes(const ForwardBatch& /*batch*/, Device /*device*/) const { return 0; }
  // streams [T, W] (ResidualScheme::stream_width), updated in place.
  virtual void forward(const StepContext& step, const BlockCache& cache, const Tensor& streams) = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // x [T, H]; out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const Tensor& x, const Tensor& out) = 0;
  // As Mixer::output_is_partial.
  virtual bool output_is_partial() const { return false; }
  // Expected bytes of weights that a step of `rows` rows reads only because some row selected them
  // (weights every step reads do not count): the cost feature of blocks whose weight traffic grows
  // with the rows, such as routed experts. 0 for a block that reads all its weights for any row.
  virtual double routed_weight_bytes(int64_t /*rows*/) const { return 0.0; }
};

// One decoder layer: its stream blocks (in order, on the streams), then two sites of the residual
// scheme: the mixer's (site 2i of layer i) and the feed-forward's (site 2i + 1). The scheme owns
// everything between sites (norms, residual adds, stream maps).
struct DecoderLayer {
  std::unique_ptr<Mixer> mixer;
  std::unique_ptr<FeedForward> ffn;
  std::vector<std::unique_ptr<StreamBlock>> stream_blocks = {};
};

}  // namespace metrale
