#include "model/blocks/token_embedding.h"

#include <algorithm>

#include "core/error.h"
#include "kernels/embedding.h"
#include "runtime/buffer.h"
#include "runtime/communicator.h"

namespace metrale {

void TokenEmbedding::lookup(const StepContext& step, const Tensor& ids, const Tensor& out) const {
  if (whole()) {
    kernels::embedding(ids, table, out);
    return;
  }
  METRALE_CHECK(step.communicator != nullptr, "a vocabulary shard of the embedding without its group");
  // The all-reduce needs a contiguous tensor: the streams' input rows may be strided.
  const Tensor sum = out.is_contiguous() ? out : step.workspace.alloc(out.dtype(), out.shape());
  kernels::embedding_shard(ids, table, first_id, sum);
  step.communicator->all_reduce_sum(sum);
  if (sum.data() == out.data()) return;
  const size_t row_bytes = static_cast<size_t>(out.size(1)) * out.element_size();
  for (int64_t t = 0; t < out.size(0); ++t) {
    copy_bytes(static_cast<char*>(out.data()) + static_cast<size_t>(t * out.stride(0)) * out.element_size(),
               out.device(), static_cast<const char*>(sum.data()) + static_cast<size_t>(t) * row_bytes, sum.device(),
               row_bytes);
  }
}

TokenEmbedding load_token_embedding(Weights& weights, const ModelConfig& config) {
  const int64_t vocab = config.vocab_size, hidden = config.hidden_size;
  const TensorParallel& tensor_parallel = weights.tensor_parallel();
  if (!tensor_parallel.active()) return {weights.get("embed_tokens.weight", {vocab, hidden}), 0, vocab};
  const int64_t share = (vocab + tensor_parallel.size - 1) / tensor_parallel.size;
  const int64_t first = std::min<int64_t>(vocab, tensor_parallel.rank * share);
  const int64_t last = std::min<int64_t>(vocab, first + share);
  TensorSlice rows;
  append_rows(rows.rows, {first, last});
  if (rows.rows.empty()) rows.rows.push_back(0);  // a rank past the vocabulary keeps one row it never reads
  const Tensor table = weights.get("embed_tokens.weight", {vocab, hidden}, rows);
  return {table, last > first ? first : vocab, vocab};
}

}  // namespace metrale
