#include "engine/constrained_rows.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <utility>

#include "core/error.h"

namespace metrale {

bool apply_token_bitmask(std::span<float> logits, std::span<const uint32_t> bitmask) {
  const size_t vocab = logits.size();
  METRALE_CHECK(bitmask.size() * 32 >= vocab, "a token bitmask of {} words for {} logits", bitmask.size(), vocab);
  bool any = false;
  for (size_t word = 0; word * 32 < vocab && !any; ++word) {
    const size_t bits = std::min<size_t>(32, vocab - word * 32);
    const uint32_t valid = bits == 32 ? ~0u : ((1u << bits) - 1u);
    any = (bitmask[word] & valid) != 0;
  }
  if (!any) return false;
  constexpr float kMasked = -std::numeric_limits<float>::infinity();
  // A constrained row is mostly masked words (all 32 tokens out), which become plain fills.
  for (size_t word = 0; word * 32 < vocab; ++word) {
    const uint32_t bits = bitmask[word];
    if (bits == ~0u) continue;
    const size_t begin = word * 32;
    const size_t end = std::min(vocab, begin + 32);
    if (bits == 0u) {
      std::fill(logits.begin() + static_cast<std::ptrdiff_t>(begin), logits.begin() + static_cast<std::ptrdiff_t>(end),
                kMasked);
      continue;
    }
    // Branch-free select on the bit patterns, so that the loop vectorises.
    constexpr uint32_t kMaskedBits = std::bit_cast<uint32_t>(kMasked);
    for (size_t t = begin; t < end; ++t) {
      const uint32_t keep = 0u - ((bits >> (t - begin)) & 1u);
      const uint32_t value = std::bit_cast<uint32_t>(logits[t]);
      logits[t] = std::bit_cast<float>((value & keep) | (kMaskedBits & ~keep));
    }
  }
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
  size_t words = 0;
  for (const ScheduledChunk& chunk : plan.chunks) {
    Sequence& sequence = *chunk.sequence;
    if (!chunk.samples || sequence.request.max_tokens == 0 || sequence.request.constraint == nullptr) continue;
    ChunkMasks masks;
    masks.sequence = &sequence;
    masks.num_rows = 1 + chunk.num_drafts;
    masks.offset = words;
    masks.masked.assign(static_cast<size_t>(masks.num_rows), 0);
    words += static_cast<size_t>(masks.num_rows * words_);
    chunks_.push_back(std::move(masks));
  }
  if (chunks_.empty()) return;
  masks_.assign(words, 0u);
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
        const std::span<uint32_t> mask(masks_.data() + chunk.offset + static_cast<size_t>(row * words_),
                                       static_cast<size_t>(words_));
        chunk.masked[static_cast<size_t>(row)] = constraint.fill_next_mask(mask) ? 1 : 0;
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
  const std::span<const uint32_t> mask(masks_.data() + chunk->offset + static_cast<size_t>(row * words_),
                                       static_cast<size_t>(words_));
  apply_token_bitmask(logits, mask);
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
