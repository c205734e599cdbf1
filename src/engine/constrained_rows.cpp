#include "engine/constrained_rows.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "kernels/token_bitmask.h"
#include "runtime/stream.h"

namespace metrale {

bool apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> bitmask) {
  const size_t vocab = logits.size();
  METRALE_CHECK(bitmask.size() * 32 >= vocab, "a token bitmask of {} words for {} logits", bitmask.size(), vocab);
  if (!kernels::token_bitmask_allows_any(bitmask, static_cast<int64_t>(vocab))) return false;
  kernels::cpu::apply_token_bitmask_row(logits, bitmask);
  return true;
}

ConstrainedRows::ConstrainedRows(int64_t vocab_size) : vocab_(vocab_size), words_((vocab_size + 31) / 32) {}

ConstrainedRows::~ConstrainedRows() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ConstrainedRows::begin(const SchedulePlan& plan) {
  chunks_.clear();
  int64_t mask_rows = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    Sequence& sequence = *chunk.sequence;
    if (!chunk.samples || sequence.request.max_tokens == 0 || sequence.request.constraint == nullptr) continue;
    ChunkMasks masks;
    masks.sequence = &sequence;
    masks.num_rows = 1 + chunk.num_drafts;
    masks.first_mask_row = mask_rows;
    masks.masked.assign(static_cast<size_t>(masks.num_rows), 0);
    mask_rows += masks.num_rows;
    chunks_.push_back(std::move(masks));
  }
  num_mask_rows_ = mask_rows;
  if (chunks_.empty()) return;
  const size_t bytes = static_cast<size_t>(mask_rows * words_) * sizeof(uint32_t);
  if (masks_.size() < bytes) {
    // Pinned allocations are slow: grow geometrically, and rarely.
    masks_ = PinnedBuffer(std::max(bytes, 2 * masks_.size()));
    mask_row_ids_ = PinnedBuffer(masks_.size() / static_cast<size_t>(words_));
  }
  std::memset(masks_.data(), 0, bytes);
  {
    std::lock_guard lock(mutex_);
    pending_ = true;
    failure_ = nullptr;
  }
  if (!worker_.joinable()) worker_ = std::thread([this] { run_worker(); });
  changed_.notify_all();
}

void ConstrainedRows::wait() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !pending_; });
  if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
}

void ConstrainedRows::abandon() noexcept {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !pending_; });
  failure_ = nullptr;
  chunks_.clear();
}

void ConstrainedRows::run_worker() {
  std::unique_lock lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || pending_; });
    if (stopping_) return;
    lock.unlock();
    compute();
    lock.lock();
    pending_ = false;
    changed_.notify_all();
  }
}

void ConstrainedRows::compute() noexcept {
  try {
    for (ChunkMasks& chunk : chunks_) {
      Sequence& sequence = *chunk.sequence;
      TokenConstraint& constraint = *sequence.request.constraint;
      int32_t walked = 0;
      for (int64_t row = 0; row < chunk.num_rows; ++row) {
        const std::span<uint32_t> mask = mask_row(chunk.first_mask_row + row);
        // A mask that allows nothing is left off (the row samples unmasked), on every path.
        const bool masked = constraint.fill_next_mask(mask) && kernels::token_bitmask_allows_any(mask, vocab_);
        chunk.masked[static_cast<size_t>(row)] = masked ? 1 : 0;
        if (row + 1 == chunk.num_rows) break;
        // A draft the constraint refuses cannot be accepted (its row's mask clears it); the rows
        // after it are never reached.
        if (!constraint.accept(sequence.draft_tokens[static_cast<size_t>(row)])) break;
        ++walked;
      }
      if (walked > 0) constraint.rollback(walked);
    }
  } catch (...) {
    std::lock_guard lock(mutex_);
    failure_ = std::current_exception();
  }
}

const ConstrainedRows::ChunkMasks* ConstrainedRows::find(const Sequence& sequence) const {
  for (const ChunkMasks& chunk : chunks_) {
    if (chunk.sequence == &sequence) return &chunk;
  }
  return nullptr;
}

void ConstrainedRows::process_row(const Sequence& sequence, int64_t row, std::span<float> logits) const {
  for (const auto& [id, bias] : sequence.request.sampling.logit_bias) {
    if (id >= 0 && static_cast<size_t>(id) < logits.size()) logits[static_cast<size_t>(id)] += bias;
  }
  if (sequence.request.constraint == nullptr) return;
  const ChunkMasks* chunk = find(sequence);
  if (chunk == nullptr || row < 0 || row >= chunk->num_rows || chunk->masked[static_cast<size_t>(row)] == 0) return;
  kernels::cpu::apply_token_bitmask_row(logits, mask_row(chunk->first_mask_row + row));
}

int64_t ConstrainedRows::apply_to_logits(const Tensor& logits, std::span<const LogitRowUse> uses) {
  if (chunks_.empty()) return 0;
  METRALE_CHECK(logits.ndim() == 2 && logits.size(1) == vocab_, "masking logits {} of a vocabulary of {}",
                logits.describe(), vocab_);
  auto* row_ids = static_cast<int32_t*>(mask_row_ids_.data());
  std::fill(row_ids, row_ids + num_mask_rows_, -1);
  int64_t masked = 0, used_rows = 0;
  for (const ChunkMasks& chunk : chunks_) {
    const auto use = std::find_if(uses.begin(), uses.end(),
                                  [&](const LogitRowUse& u) { return u.chunk.sequence == chunk.sequence; });
    if (use == uses.end()) continue;
    // The chunk's sampling rows: the row of its last known token, then one per draft.
    const int64_t first = use->first_row + use->num_rows - chunk.num_rows;
    METRALE_CHECK(first >= use->first_row && first + chunk.num_rows <= logits.size(0),
                  "sequence {}: {} mask rows for logits rows [{}, {}) of {}", chunk.sequence->id, chunk.num_rows,
                  use->first_row, use->first_row + use->num_rows, logits.size(0));
    for (int64_t row = 0; row < chunk.num_rows; ++row) {
      if (chunk.masked[static_cast<size_t>(row)] == 0) continue;
      row_ids[chunk.first_mask_row + row] = static_cast<int32_t>(first + row);
      used_rows = std::max(used_rows, chunk.first_mask_row + row + 1);
      ++masked;
    }
  }
  if (masked == 0) return 0;  // inside reasoning blocks, say: nothing to upload
  const Device device = logits.device();
  Tensor masks(masks_.data(), DType::kI32, {used_rows, words_}, Device::cpu());
  Tensor ids(row_ids, DType::kI32, {used_rows}, Device::cpu());
  if (!device.is_cpu()) {
    if (device_row_ids_.tensor.empty() || device_row_ids_.tensor.size(0) < used_rows ||
        device_row_ids_.tensor.device() != device) {
      const int64_t capacity =
          std::max<int64_t>(used_rows, 2 * (device_row_ids_.tensor.empty() ? 0 : device_row_ids_.tensor.size(0)));
      device_masks_ = OwnedTensor(DType::kI32, {capacity, words_}, device);
      device_row_ids_ = OwnedTensor(DType::kI32, {capacity}, device);
    }
    copy_bytes_async(device_masks_.tensor.data(), device, masks.data(), Device::cpu(), masks.nbytes());
    copy_bytes_async(device_row_ids_.tensor.data(), device, ids.data(), Device::cpu(), ids.nbytes());
    masks = device_masks_.tensor.slice(0, 0, used_rows);
    ids = device_row_ids_.tensor.slice(0, 0, used_rows);
  }
  kernels::apply_token_bitmask(logits, masks, ids);
  return masked;
}

void ConstrainedRows::accept(Sequence& sequence, std::span<const SampledToken> emitted) {
  if (sequence.request.constraint == nullptr) return;
  for (const SampledToken& token : emitted) {
    // A refused token can only follow a row whose mask allowed nothing (left unmasked): the
    // constraint stays where it was and the output is no longer guaranteed to match.
    sequence.request.constraint->accept(token.token);
  }
}

}  // namespace metrale
