// The seams every decoder layer is built from: a mixer (attention, GDN, ...) and a feed-forward
// block (dense MLP, MoE), both run on the step's ragged batch.
#pragma once

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
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual LayerCacheSpec cache_spec() const = 0;
  // Bytes of StepContext::layer_scratch this mixer needs for `batch` (kernels' split buffers).
  virtual size_t scratch_bytes(const ForwardBatch& /*batch*/, Device /*device*/) const { return 0; }
  // x [T, H] (normalised layer input); out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const LayerCache& cache, const Tensor& x, const Tensor& out) = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // x [T, H]; out [T, H] is overwritten.
  virtual void forward(const StepContext& step, const Tensor& x, const Tensor& out) = 0;
};

}  // namespace metrale
