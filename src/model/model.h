// Model: a loaded architecture ready to run ragged batches.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "model/cache_spec.h"
#include "model/config.h"
#include "model/forward_batch.h"
#include "runtime/arena.h"

namespace metrale {

class Model {
 public:
  virtual ~Model() = default;

  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  // One spec per decoder layer, in layer order.
  virtual std::vector<LayerCacheSpec> cache_specs() const = 0;
  // Runs one step: writes this step's keys/values (and states) into `caches` and the logits of the
  // batch's logit rows into `logits` [R, vocab] f32. `workspace` holds the step's temporaries.
  virtual void forward(const ForwardBatch& batch, std::span<const LayerCache> caches, const Tensor& logits,
                       Arena& workspace) = 0;
};

}  // namespace metrale
