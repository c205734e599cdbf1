#include "common/step_runner.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "core/error.h"

namespace metrale::testing {

void build_batch(const std::vector<SeqChunk>& chunks, std::map<int64_t, int64_t>& lengths, bool last_rows_only,
                 SequenceCaches& caches, HostBatch& host) {
  host = HostBatch{};
  const auto seqs = static_cast<int64_t>(chunks.size());
  const int32_t block_size = caches.block_size();
  for (const SeqChunk& chunk : chunks) {
    caches.reserve(chunk.seq_id, lengths[chunk.seq_id] + static_cast<int64_t>(chunk.tokens.size()));
    host.max_blocks = std::max<int64_t>(host.max_blocks, static_cast<int64_t>(caches.block_table(chunk.seq_id).size()));
  }
  host.block_tables.assign(static_cast<size_t>(seqs * host.max_blocks), 0);
  for (int64_t s = 0; s < seqs; ++s) {
    const SeqChunk& chunk = chunks[static_cast<size_t>(s)];
    const auto table = caches.block_table(chunk.seq_id);
    std::copy(table.begin(), table.end(), host.block_tables.begin() + s * host.max_blocks);
    const int64_t begin = lengths[chunk.seq_id];
    for (size_t i = 0; i < chunk.tokens.size(); ++i) {
      const int64_t position = begin + static_cast<int64_t>(i);
      if (!last_rows_only || i + 1 == chunk.tokens.size())
        host.logit_rows.push_back(static_cast<int32_t>(host.token_ids.size()));
      host.token_ids.push_back(chunk.tokens[i]);
      host.positions.push_back(static_cast<int32_t>(position));
      host.slot_mapping.push_back(table[static_cast<size_t>(position / block_size)] * block_size +
                                  static_cast<int32_t>(position % block_size));
    }
    lengths[chunk.seq_id] = begin + static_cast<int64_t>(chunk.tokens.size());
    host.cu_q.push_back(static_cast<int32_t>(host.token_ids.size()));
    host.kv_lens.push_back(static_cast<int32_t>(lengths[chunk.seq_id]));
    host.state_slots.push_back(caches.state_slot(chunk.seq_id));
    host.seq_ids.push_back(chunk.seq_id);
  }
  const auto tokens = static_cast<int64_t>(host.token_ids.size());
  const auto rows = static_cast<int64_t>(host.logit_rows.size());
  ForwardBatch& batch = host.batch;
  batch.num_tokens = tokens;
  batch.num_seqs = seqs;
  batch.block_size = block_size;
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
  batch.logit_rows = Tensor(host.logit_rows.data(), DType::kI32, {rows});
  batch.host_cu_q = host.cu_q;
  batch.host_kv_lens = host.kv_lens;
  batch.host_logit_rows = host.logit_rows;
  if (std::all_of(host.state_slots.begin(), host.state_slots.end(), [](int32_t slot) { return slot >= 0; })) {
    batch.state_slots = Tensor(host.state_slots.data(), DType::kI32, {seqs});
    batch.host_state_slots = host.state_slots;
  }
}

// ---------------------------------------------------------------------------------------------
// TestCache

TestCache::TestCache(std::vector<CacheSpec> blocks, std::vector<CacheSpec> mtp, Device device, int32_t block_size,
                     int32_t num_blocks, int32_t num_state_slots, uint64_t seed)
    : block_size_(block_size), num_block_caches_(blocks.size()), specs_(std::move(blocks)) {
  specs_.insert(specs_.end(), mtp.begin(), mtp.end());
  caches_.resize(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    check_cache_spec(specs_[i], block_size, "test cache");
    for (const CacheTensorSpec& tensor : specs_[i].tensors) {
      storage_.emplace_back(tensor.dtype_or(DType::kF32), tensor.storage_shape(num_blocks, block_size, num_state_slots),
                            device);
      // All ones: NaN in every floating dtype, -1 in every integer one.
      std::memset(storage_.back()->data(), 0xff, storage_.back()->nbytes());
      caches_[i].tensors.push_back(storage_.back().tensor);
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

int32_t TestCache::state_slot(int64_t seq_id) {
  const auto it = slots_.find(seq_id);
  if (it != slots_.end()) return it->second;
  if (free_slots_.empty()) raise(ErrorCode::kOutOfMemory, "test runner has no free state slot");
  const int32_t slot = free_slots_.back();
  free_slots_.pop_back();
  slots_[seq_id] = slot;
  return slot;
}

int32_t TestCache::take_block() {
  if (free_blocks_.empty()) raise(ErrorCode::kOutOfMemory, "test cache too small");
  const int32_t block = free_blocks_.back();
  free_blocks_.pop_back();
  return block;
}

void TestCache::reserve(int64_t seq_id, int64_t total_tokens) {
  auto& table = tables_[seq_id];
  while (static_cast<int64_t>(table.size()) * block_size_ < total_tokens) table.push_back(take_block());
}

void TestCache::copy_sequence(int64_t from, int64_t to) {
  const std::vector<int32_t> source = tables_[from];
  auto& table = tables_[to];
  table.clear();
  const int32_t from_slot = state_slot(from), to_slot = state_slot(to);
  for (size_t b = 0; b < source.size(); ++b) table.push_back(take_block());
  for (size_t i = 0; i < specs_.size(); ++i) {
    for (size_t j = 0; j < specs_[i].tensors.size(); ++j) {
      const Tensor& tensor = caches_[i].tensors[j];
      if (!specs_[i].tensors[j].paged()) {
        copy_tensor(tensor.select(0, to_slot), tensor.select(0, from_slot));
        continue;
      }
      for (size_t b = 0; b < source.size(); ++b) copy_tensor(tensor.select(0, table[b]), tensor.select(0, source[b]));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// ForwardRunner

ForwardRunner::ForwardRunner(Model& model, int32_t block_size, int32_t num_blocks, uint64_t seed,
                             int32_t num_state_slots)
    : model_(model),
      own_cache_(std::make_unique<TestCache>(model.cache_specs(), std::vector<CacheSpec>{}, model.device(), block_size,
                                             num_blocks, num_state_slots, seed)),
      caches_(own_cache_.get()),
      arena_(model.device(), 1 << 20) {}

ForwardRunner::ForwardRunner(Model& model, SequenceCaches& caches)
    : model_(model), caches_(&caches), arena_(model.device(), 1 << 20) {}

void ForwardRunner::fork(int64_t from, int64_t to) {
  METRALE_CHECK(own_cache_ != nullptr, "fork needs the runner's own test cache");
  METRALE_CHECK(cached_.count(to) == 0 || cached_[to] == 0, "fork: sequence {} already has tokens", to);
  own_cache_->copy_sequence(from, to);
  cached_[to] = cached_[from];
  history_[to] = history_[from];
}

void ForwardRunner::forget(int64_t seq_id) {
  cached_.erase(seq_id);
  history_.erase(seq_id);
}

std::vector<std::vector<float>> ForwardRunner::step(const std::vector<Chunk>& chunks, bool last_rows_only) {
  HostBatch host;
  build_batch(chunks, cached_, last_rows_only, *caches_, host);
  const int64_t tokens = host.batch.num_tokens;
  // Step inputs: host arrays filled by the model's prestage, which on the CPU are the device arrays.
  const std::vector<StepInputSpec> input_specs = model_.step_input_specs();
  std::vector<std::vector<uint8_t>> input_memory;
  std::vector<Tensor> inputs;
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
  const auto rows = static_cast<int64_t>(host.logit_rows.size());
  const int64_t vocab = model_.config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(rows * vocab), std::nanf(""));  // unwritten rows stay NaN
  arena_.reset();
  model_.forward(host.batch, caches_->caches(), Tensor(logits.data(), DType::kF32, {rows, vocab}), arena_);
  for (const Chunk& chunk : chunks) {
    auto& seen = history_[chunk.seq_id];
    seen.insert(seen.end(), chunk.tokens.begin(), chunk.tokens.end());
  }
  return split_rows(logits, rows, vocab);
}

// ---------------------------------------------------------------------------------------------
// Comparisons

std::vector<std::vector<float>> split_rows(const std::vector<float>& values, int64_t rows, int64_t width) {
  std::vector<std::vector<float>> result(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r)
    result[static_cast<size_t>(r)].assign(values.begin() + r * width, values.begin() + (r + 1) * width);
  return result;
}

namespace {

template <typename Expected>
double relative_l2_of(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<Expected>>& expected) {
  METRALE_CHECK(actual.size() == expected.size(), "{} rows vs {}", actual.size(), expected.size());
  double diff = 0.0, norm = 0.0;
  for (size_t r = 0; r < actual.size(); ++r) {
    METRALE_CHECK(actual[r].size() == expected[r].size());
    for (size_t c = 0; c < actual[r].size(); ++c) {
      if (!std::isfinite(actual[r][c])) return INFINITY;
      const double e = static_cast<double>(expected[r][c]);
      diff += (actual[r][c] - e) * (actual[r][c] - e);
      norm += e * e;
    }
  }
  return std::sqrt(diff / norm);
}

}  // namespace

double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<double>>& expected) {
  return relative_l2_of(actual, expected);
}

double relative_l2(const std::vector<std::vector<float>>& actual, const std::vector<std::vector<float>>& expected) {
  return relative_l2_of(actual, expected);
}

StepLogits run_two_sequence_steps(Model& model, const std::vector<int32_t>& tokens, int64_t block_size,
                                  int64_t num_blocks) {
  ForwardRunner runner(model, block_size, num_blocks, /*seed=*/5, /*num_state_slots=*/8);
  const auto piece = [&](size_t begin, size_t count) {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < count; ++i) ids.push_back(tokens[(begin + i) % tokens.size()]);
    return ids;
  };
  StepLogits steps;
  steps.push_back(runner.step({{0, piece(0, 7)}, {1, piece(20, 5)}}));
  steps.push_back(runner.step({{0, piece(7, 9)}, {1, piece(25, 11)}}));
  for (size_t d = 0; d < 4; ++d) steps.push_back(runner.step({{0, piece(16 + d, 1)}, {1, piece(36 + d, 1)}}));
  return steps;
}

double relative_l2(const StepLogits& actual, const StepLogits& expected) {
  METRALE_CHECK(actual.size() == expected.size(), "{} steps vs {}", actual.size(), expected.size());
  double diff = 0.0, norm = 0.0;
  for (size_t s = 0; s < expected.size(); ++s) {
    METRALE_CHECK(actual[s].size() == expected[s].size(), "step {}: {} rows vs {}", s, actual[s].size(),
                  expected[s].size());
    for (size_t r = 0; r < expected[s].size(); ++r) {
      METRALE_CHECK(actual[s][r].size() == expected[s][r].size());
      for (size_t v = 0; v < expected[s][r].size(); ++v) {
        const double e = expected[s][r][v], a = actual[s][r][v];
        if (!std::isfinite(a)) return INFINITY;
        diff += (a - e) * (a - e);
        norm += e * e;
      }
    }
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

}  // namespace metrale::testing
