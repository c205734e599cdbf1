// The token embedding of a decoder: the whole table, or under tensor parallelism a rank's rows of
// the vocabulary (rank r of N holds ids [r * ceil(V / N), (r + 1) * ceil(V / N)) clipped to V); a
// rank looks up its rows, zeros for the other ids, and the group's all-reduce sums the lookups.
#pragma once

#include <cstdint>

#include "model/blocks/layer.h"
#include "model/config.h"
#include "model/weight_store.h"

namespace metrale {

struct TokenEmbedding {
  Tensor table;  // [V, H], or [rows, H] of ids [first_id, first_id + rows)
  int64_t first_id = 0;
  int64_t vocab_size = 0;

  bool whole() const { return first_id == 0 && table.size(0) == vocab_size; }
  // out [T, H] (activation dtype, rows may be strided) = the embeddings of ids [T] i32; a shard sums
  // over step.communicator.
  void lookup(const StepContext& step, const Tensor& ids, const Tensor& out) const;
};

// Loads `embed_tokens.weight` [V, H]: this rank's rows under tensor parallelism, else all of it.
TokenEmbedding load_token_embedding(Weights& weights, const ModelConfig& config);

}  // namespace metrale
