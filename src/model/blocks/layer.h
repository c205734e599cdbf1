// The seams every decoder layer is built from: a mixer (attention, GDN, ...) and a feed-forward
// block (dense MLP, MoE), both run on the step's ragged batch, joined in a pre-norm residual layer.
#pragma once

#include <memory>

#include "core/error.h"
#include "model/blocks/norms.h"
#include "model/cache_spec.h"
#include "model/forward_batch.h"
#include "runtime/arena.h"

namespace metrale {

// What a block needs from the step besides its input: the batch metadata and the scratch arena.
struct StepContext {
  const ForwardBatch& batch;
  Arena& workspace;
  DType activation_dtype;  // f32 on the CPU
  // Scratch shared by the layers of one step (at least the largest Mixer::scratch_bytes); its
  // contents do not survive from one layer to the next.
  Tensor layer_scratch;
  // Verify steps only (ForwardBatch::verify): this layer's region of ForwardBatch::verify_scratch,
  // Mixer::verify_scratch_bytes long; it must hold what Mixer::commit needs until the commit.
  // (Initialised here so that contexts built without it need not name it.)
  Tensor verify_scratch = Tensor();
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual LayerCacheSpec cache_spec() const = 0;
  // Bytes of StepContext::layer_scratch this mixer needs for `batch` (kernels' split buffers).
  virtual size_t scratch_bytes(const ForwardBatch& /*batch*/, Device /*device*/) const { return 0; }
  // x [T, H] (normalised layer input); out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const LayerCache& cache, const Tensor& x, const Tensor& out) = 0;
  // Only what forward() writes to the cache for x's rows (the batch's positions and slot_mapping),
  // without computing the output: the MTP head's keys of positions that draft nothing. Attention
  // mixers only.
  virtual void write_keys(const StepContext& /*step*/, const LayerCache& /*cache*/, const Tensor& /*x*/) {
    raise(ErrorCode::kUnsupported, "only attention layers write their keys without a forward");
  }

  // Speculative verify. Mixers whose cache a verify step can leave exactly right (paged KV: the
  // engine drops the rejected tail by truncating the sequence) need neither hook. A recurrent mixer
  // leaves its state slots untouched in a verify forward, keeps its per-row inputs in
  // StepContext::verify_scratch, and in commit advances each slot over the kept rows only.
  virtual size_t verify_scratch_bytes(int64_t /*num_tokens*/, int64_t /*num_seqs*/, DType /*activation*/) const {
    return 0;
  }
  // `step` carries the verify batch and this layer's verify_scratch, as in the verify forward.
  virtual void commit(const StepContext& /*step*/, const LayerCache& /*cache*/, const VerifyCommit& /*kept*/) {}
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // x [T, H]; out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const Tensor& x, const Tensor& out) = 0;
};

// One pre-norm residual layer: h += mixer(input_norm(h)); h += ffn(post_norm(h)).
struct DecoderLayer {
  RmsNorm input_norm;
  std::unique_ptr<Mixer> mixer;
  RmsNorm post_norm;
  std::unique_ptr<FeedForward> ffn;
};

}  // namespace metrale
