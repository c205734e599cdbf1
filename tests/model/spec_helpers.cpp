#include "model/spec_helpers.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "core/error.h"

namespace metrale::testing {

SpecRunner::SpecRunner(Model& model, bool with_mtp, int32_t block_size, int32_t num_blocks, int32_t num_state_slots,
                       uint64_t seed)
    : model_(model), block_size_(block_size), arena_(model.device(), 1 << 20) {
  std::vector<LayerCacheSpec> specs = model.cache_specs();
  if (with_mtp) {
    const std::vector<LayerCacheSpec> mtp = model.mtp_cache_specs();
    specs.insert(specs.end(), mtp.begin(), mtp.end());
  }
  layers_.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind == LayerCacheKind::kRecurrent) {
      for (const StateTensorSpec& state : specs[i].states) {
        std::vector<int64_t> dims{num_state_slots};
        dims.insert(dims.end(), state.per_slot_shape.begin(), state.per_slot_shape.end());
        const Shape shape{std::span<const int64_t>(dims)};
        storage_.emplace_back(DType::kF32, shape, model.device());
        // NaN: a sequence starting at position 0 must not read its slot.
        std::fill_n(storage_.back()->data_as<float>(), shape.numel(), std::nanf(""));
        layers_[i].states.push_back(storage_.back().tensor);
      }
    } else if (specs[i].kind == LayerCacheKind::kPagedKv) {
      const Shape shape{num_blocks, block_size, specs[i].num_kv_heads, specs[i].head_dim};
      for (int kv = 0; kv < 2; ++kv) {
        storage_.emplace_back(DType::kF32, shape, model.device());
        std::fill_n(storage_.back()->data_as<float>(), shape.numel(), std::nanf(""));
      }
      layers_[i].k_cache = storage_[storage_.size() - 2].tensor;
      layers_[i].v_cache = storage_.back().tensor;
    }
  }
  free_blocks_.resize(static_cast<size_t>(num_blocks));
  std::iota(free_blocks_.begin(), free_blocks_.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(free_blocks_.begin(), free_blocks_.end(), rng);
  free_slots_.resize(static_cast<size_t>(num_state_slots));
  std::iota(free_slots_.begin(), free_slots_.end(), 0);
  std::shuffle(free_slots_.begin(), free_slots_.end(), rng);
}

int32_t SpecRunner::state_slot(int64_t seq_id) {
  const auto it = slots_.find(seq_id);
  if (it != slots_.end()) return it->second;
  METRALE_CHECK(!free_slots_.empty(), "test runner has no free state slot");
  slots_[seq_id] = free_slots_.back();
  free_slots_.pop_back();
  return slots_[seq_id];
}

void SpecRunner::build(const std::vector<Chunk>& chunks, std::map<int64_t, int64_t>& lengths, HostBatch& host) {
  host = HostBatch{};
  const auto seqs = static_cast<int64_t>(chunks.size());
  for (const Chunk& chunk : chunks) {
    const int64_t total = lengths[chunk.seq_id] + static_cast<int64_t>(chunk.tokens.size());
    auto& table = tables_[chunk.seq_id];
    while (static_cast<int64_t>(table.size()) * block_size_ < total) {
      METRALE_CHECK(!free_blocks_.empty(), "test cache too small");
      table.push_back(free_blocks_.back());
      free_blocks_.pop_back();
    }
    host.max_blocks = std::max<int64_t>(host.max_blocks, static_cast<int64_t>(table.size()));
  }
  host.block_tables.assign(static_cast<size_t>(seqs * host.max_blocks), 0);
  for (int64_t s = 0; s < seqs; ++s) {
    const Chunk& chunk = chunks[static_cast<size_t>(s)];
    const auto& table = tables_[chunk.seq_id];
    std::copy(table.begin(), table.end(), host.block_tables.begin() + s * host.max_blocks);
    const int64_t begin = lengths[chunk.seq_id];
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      const int64_t position = begin + static_cast<int64_t>(i);
      host.logit_rows.push_back(static_cast<int32_t>(host.token_ids.size()));
      host.token_ids.push_back(chunk.tokens[i]);
      host.positions.push_back(static_cast<int32_t>(position));
      host.slot_mapping.push_back(table[static_cast<size_t>(position / block_size_)] * block_size_ +
                                  static_cast<int32_t>(position % block_size_));
    }
    lengths[chunk.seq_id] = begin + static_cast<int64_t>(chunk.tokens.size());
    host.cu_q.push_back(static_cast<int32_t>(host.token_ids.size()));
    host.kv_lens.push_back(static_cast<int32_t>(lengths[chunk.seq_id]));
    host.state_slots.push_back(state_slot(chunk.seq_id));
    host.seq_index.push_back(static_cast<int32_t>(s));
    host.seq_ids.push_back(chunk.seq_id);
  }
  const auto tokens = static_cast<int64_t>(host.token_ids.size());
  ForwardBatch& batch = host.batch;
  batch.num_tokens = tokens;
  batch.num_seqs = seqs;
  batch.block_size = block_size_;
  for (int64_t s = 0; s < seqs; ++s) {
    batch.max_q_len =
        std::max<int64_t>(batch.max_q_len, host.cu_q[static_cast<size_t>(s) + 1] - host.cu_q[static_cast<size_t>(s)]);
    batch.max_kv_len = std::max<int64_t>(batch.max_kv_len, host.kv_lens[static_cast<size_t>(s)]);
  }
  batch.token_ids = Tensor(host.token_ids.data(), DType::kI32, {tokens});
  batch.positions = Tensor(host.positions.data(), DType::kI32, {tokens});
  batch.cu_q = Tensor(host.cu_q.data(), DType::kI32, {seqs + 1});
  batch.kv_lens = Tensor(host.kv_lens.data(), DType::kI32, {seqs});
  batch.block_tables = Tensor(host.block_tables.data(), DType::kI32, {seqs, host.max_blocks});
  batch.slot_mapping = Tensor(host.slot_mapping.data(), DType::kI32, {tokens});
  batch.logit_rows = Tensor(host.logit_rows.data(), DType::kI32, {tokens});
  batch.state_slots = Tensor(host.state_slots.data(), DType::kI32, {seqs});
  batch.host_cu_q = host.cu_q;
  batch.host_kv_lens = host.kv_lens;
  batch.host_logit_rows = host.logit_rows;
  batch.host_state_slots = host.state_slots;
}

namespace {

std::vector<std::vector<float>> split_rows(const std::vector<float>& values, int64_t rows, int64_t width) {
  std::vector<std::vector<float>> result(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    result[static_cast<size_t>(r)].assign(values.begin() + r * width, values.begin() + (r + 1) * width);
  return result;
}

}  // namespace

SpecRunner::Rows SpecRunner::step(const std::vector<Chunk>& chunks, bool verify) {
  METRALE_CHECK(pending_verify_.seq_ids.empty(), "a verify step waits for its commit");
  HostBatch host;
  build(chunks, cached_, host);
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
    host.batch.verify_seq_index = Tensor(host.seq_index.data(), DType::kI32, {host.batch.num_seqs});
  }
  arena_.reset();
  model_.forward(host.batch, layers_, Tensor(logits.data(), DType::kF32, {tokens, vocab}), arena_);
  host.batch.hidden_out = Tensor();
  if (verify) pending_verify_ = std::move(host);
  // The batch's spans point into the moved vectors' buffers, which moving keeps in place.
  return {split_rows(logits, tokens, vocab), split_rows(hidden_rows, tokens, hidden)};
}

void SpecRunner::commit(const std::vector<int32_t>& kept_rows) {
  METRALE_CHECK(!pending_verify_.seq_ids.empty(), "commit without a verify step");
  arena_.reset();
  model_.commit_verified(pending_verify_.batch, kept_rows, layers_, arena_);
  for (size_t s = 0; s < pending_verify_.seq_ids.size(); ++s) {
    const int32_t q_len = pending_verify_.cu_q[s + 1] - pending_verify_.cu_q[s];
    cached_[pending_verify_.seq_ids[s]] -= q_len - kept_rows[s];
  }
  pending_verify_ = HostBatch{};
}

SpecRunner::Rows SpecRunner::mtp_step(const std::vector<Chunk>& chunks, const std::vector<std::vector<float>>& hidden,
                                      int64_t mtp_layer) {
  HostBatch host;
  build(chunks, mtp_cached_, host);
  const int64_t tokens = host.batch.num_tokens, vocab = model_.config().vocab_size, width = model_.config().hidden_size;
  METRALE_CHECK(static_cast<int64_t>(hidden.size()) == tokens, "{} hidden rows for {} tokens", hidden.size(), tokens);
  std::vector<float> hidden_in;
  for (const auto& row : hidden) hidden_in.insert(hidden_in.end(), row.begin(), row.end());
  std::vector<float> logits(static_cast<size_t>(tokens * vocab), std::nanf(""));
  std::vector<float> out(static_cast<size_t>(tokens * width), std::nanf(""));
  host.batch.hidden_out = Tensor(out.data(), DType::kF32, {tokens, width});
  arena_.reset();
  model_.mtp_forward(host.batch, layers_, Tensor(hidden_in.data(), DType::kF32, {tokens, width}),
                     Tensor(logits.data(), DType::kF32, {tokens, vocab}), arena_, mtp_layer);
  return {split_rows(logits, tokens, vocab), split_rows(out, tokens, width)};
}

std::vector<float> SpecRunner::state(int64_t seq_id, size_t layer, size_t which) {
  const Tensor slot = layers_.at(layer).states.at(which).select(0, state_slot(seq_id));
  const auto* data = slot.data_as<const float>();
  return {data, data + slot.numel()};
}

}  // namespace metrale::testing
