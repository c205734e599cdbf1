#include "model/spec_helpers.h"

#include <cmath>

#include "core/error.h"

namespace metrale::testing {

SpecRunner::SpecRunner(Model& model, bool with_mtp, int32_t block_size, int32_t num_blocks, int32_t num_state_slots,
                       uint64_t seed)
    : model_(model),
      cache_(model.cache_specs(), with_mtp ? model.mtp_cache_specs() : std::vector<CacheSpec>{}, model.device(),
             block_size, num_blocks, num_state_slots, seed),
      arena_(model.device(), 1 << 20) {}

SpecRunner::Rows SpecRunner::step(const std::vector<Chunk>& chunks, bool verify) {
  METRALE_CHECK(pending_verify_.seq_ids.empty(), "a verify step waits for its commit");
  HostBatch host;
  build_batch(chunks, cached_, /*last_rows_only=*/false, cache_, host);
  const int64_t tokens = host.batch.num_tokens, vocab = model_.config().vocab_size,
                hidden = model_.config().hidden_size;
  std::vector<float> logits(static_cast<size_t>(tokens * vocab), std::nanf(""));
  std::vector<float> hidden_rows(static_cast<size_t>(tokens * hidden), std::nanf(""));
  host.batch.hidden_out = Tensor(hidden_rows.data(), DType::kF32, {tokens, hidden});
  if (verify) {
    host.batch.verify = true;
    verify_scratch_ =
        OwnedTensor(DType::kU8, {static_cast<int64_t>(model_.verify_scratch_bytes(tokens, host.batch.num_seqs)) + 1},
                    model_.device());
    host.batch.verify_scratch = verify_scratch_.tensor;
  }
  // Step inputs: host arrays filled by the model's prestage, which on the CPU are the device arrays.
  std::vector<std::vector<uint8_t>> input_memory;
  std::vector<Tensor> inputs;
  const std::vector<StepInputSpec> input_specs = model_.step_input_specs();
  if (!input_specs.empty()) {
    for (const StepInputSpec& spec : input_specs) {
      input_memory.emplace_back(static_cast<size_t>(tokens * spec.per_row) * dtype_size(spec.dtype), uint8_t{0xff});
      inputs.emplace_back(input_memory.back().data(), spec.dtype, Shape{tokens, spec.per_row});
    }
    std::vector<std::span<const int32_t>> history;
    for (const Chunk& chunk : chunks) history.emplace_back(history_[chunk.seq_id]);
    PrestageRows rows;
    rows.num_tokens = tokens;
    rows.num_seqs = host.batch.num_seqs;
    rows.token_ids = host.token_ids;
    rows.positions = host.positions;
    rows.cu_q = host.cu_q;
    rows.history = history;
    model_.prestage(rows, inputs);
    host.batch.step_inputs = inputs;
  }
  arena_.reset();
  model_.forward(host.batch, cache_.caches(), Tensor(logits.data(), DType::kF32, {tokens, vocab}), arena_);
  host.batch.hidden_out = Tensor();
  host.batch.step_inputs = {};
  for (const Chunk& chunk : chunks) {
    auto& seen = history_[chunk.seq_id];
    seen.insert(seen.end(), chunk.tokens.begin(), chunk.tokens.end());
  }
  if (verify) pending_verify_ = std::move(host);
  // The batch's spans point into the moved vectors' buffers, which moving keeps in place.
  return {split_rows(logits, tokens, vocab), split_rows(hidden_rows, tokens, hidden)};
}

void SpecRunner::commit(const std::vector<int32_t>& kept_rows) {
  METRALE_CHECK(!pending_verify_.seq_ids.empty(), "commit without a verify step");
  arena_.reset();
  model_.commit_verified(pending_verify_.batch, kept_rows, cache_.caches(), arena_);
  for (size_t s = 0; s < pending_verify_.seq_ids.size(); ++s) {
    const int32_t q_len = pending_verify_.cu_q[s + 1] - pending_verify_.cu_q[s];
    cached_[pending_verify_.seq_ids[s]] -= q_len - kept_rows[s];
    auto& seen = history_[pending_verify_.seq_ids[s]];
    seen.resize(seen.size() - static_cast<size_t>(q_len - kept_rows[s]));
  }
  pending_verify_ = HostBatch{};
}

SpecRunner::Rows SpecRunner::mtp_step(const std::vector<Chunk>& chunks, const std::vector<std::vector<float>>& hidden,
                                      int64_t mtp_layer) {
  HostBatch host;
  build_batch(chunks, mtp_cached_, /*last_rows_only=*/false, cache_, host);
  const int64_t tokens = host.batch.num_tokens, vocab = model_.config().vocab_size, width = model_.config().hidden_size;
  METRALE_CHECK(static_cast<int64_t>(hidden.size()) == tokens, "{} hidden rows for {} tokens", hidden.size(), tokens);
  std::vector<float> hidden_in;
  for (const auto& row : hidden) hidden_in.insert(hidden_in.end(), row.begin(), row.end());
  std::vector<float> logits(static_cast<size_t>(tokens * vocab), std::nanf(""));
  std::vector<float> out(static_cast<size_t>(tokens * width), std::nanf(""));
  host.batch.hidden_out = Tensor(out.data(), DType::kF32, {tokens, width});
  arena_.reset();
  model_.mtp_forward(host.batch, cache_.caches(), Tensor(hidden_in.data(), DType::kF32, {tokens, width}),
                     Tensor(logits.data(), DType::kF32, {tokens, vocab}), arena_, mtp_layer);
  return {split_rows(logits, tokens, vocab), split_rows(out, tokens, width)};
}

void SpecRunner::mtp_write_keys(const std::vector<Chunk>& chunks, const std::vector<std::vector<float>>& hidden,
                                int64_t mtp_layer) {
  HostBatch host;
  build_batch(chunks, mtp_cached_, /*last_rows_only=*/false, cache_, host);
  const int64_t tokens = host.batch.num_tokens, width = model_.config().hidden_size;
  METRALE_CHECK(static_cast<int64_t>(hidden.size()) == tokens, "{} hidden rows for {} tokens", hidden.size(), tokens);
  std::vector<float> hidden_in;
  for (const auto& row : hidden) hidden_in.insert(hidden_in.end(), row.begin(), row.end());
  arena_.reset();
  model_.mtp_write_keys(host.batch, cache_.caches(), Tensor(hidden_in.data(), DType::kF32, {tokens, width}), arena_,
                        mtp_layer);
}

std::vector<float> SpecRunner::state(int64_t seq_id, size_t block, size_t which) {
  const Tensor slot = cache_.caches().blocks[block].tensors.at(which).select(0, cache_.state_slot(seq_id));
  METRALE_CHECK(slot.dtype() == DType::kF32, "state {} of block {} is {}", which, block, slot.describe());
  const auto* data = slot.data_as<const float>();
  return {data, data + slot.numel()};
}

}  // namespace metrale::testing
