// ConstrainedRows: the token masks of a step's constrained sampling rows (requests with a
// TokenConstraint), computed on a worker thread while the step's forward runs, and the logit
// processing of every sampled row (logit_bias, then the mask).
//
// Per step: begin(plan) before the forward, wait() after it; then either apply_on_device() on the
// device logits before the device sampler runs, or process_row() for each row the host samples;
// and accept() with the tokens each chunk emitted. For a verify chunk the masks follow the protocol
// of engine/token_constraint.h: row i is masked for the state after drafts 0..i-1, the walk stops at
// the first draft the constraint refuses, and the drafts it accepted are rolled back before the
// forward ends.
//
// The masks of a step live in one pinned host block [mask rows, ceil(V / 32)] u32 (the rows of every
// constrained chunk, in plan order), so the device path uploads them with one asynchronous copy. The
// copy is queued on the device's stream before the step's sampled tokens are copied back, which the
// step waits for: when the next begin() lets the worker write the block again, the copy is done.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "engine/request.h"
#include "engine/runner.h"
#include "engine/scheduler.h"
#include "runtime/buffer.h"
#include "runtime/tensor.h"

namespace metrale {

class ConstrainedRows {
 public:
  explicit ConstrainedRows(int64_t vocab_size);
  ~ConstrainedRows();
  ConstrainedRows(const ConstrainedRows&) = delete;
  ConstrainedRows& operator=(const ConstrainedRows&) = delete;

  // Starts the masks of every sampling chunk of `plan` whose request has a constraint; does nothing
  // (and starts no thread) when none has.
  void begin(const SchedulePlan& plan);
  // Waits until the masks of the last begin() are made; rethrows what the worker threw.
  void wait();
  // Waits, discarding any failure (the step failed; its sequences may go away next).
  void abandon() noexcept;

  // Applies `sequence`'s logit_bias and the mask of its chunk's row `row` (0: after the known
  // tokens; i: after drafts 0..i-1) to `logits` [V], in place. A row the constraint left free, or
  // whose mask allows no token, keeps its logits.
  void process_row(const Sequence& sequence, int64_t row, std::span<float> logits) const;
  // Masks the rows of `logits` [R, V] f32 (the step's logits, on any device) that have a mask: the
  // chunk of `uses` whose sequence has a constrained chunk gets its mask rows applied to its
  // sampling rows (the last 1 + drafts rows of the use). One upload of the masks and their row ids
  // (pinned memory, asynchronous, on the device's stream), then kernels::apply_token_bitmask. Does
  // nothing (no copy, no launch) when no row has a mask. Logit bias is not applied here. Returns
  // the number of rows masked.
  int64_t apply_to_logits(const Tensor& logits, std::span<const LogitRowUse> uses);
  // Feeds the tokens a chunk emitted (accepted drafts, then the sampled token) to its constraint.
  static void accept(Sequence& sequence, std::span<const SampledToken> emitted);

  // Whether a row of this request needs processing (a constraint or a logit bias).
  static bool needs_processing(const Sequence& sequence) {
    return sequence.request.constraint != nullptr || !sequence.request.sampling.logit_bias.empty();
  }
  // Whether it needs the host (a logit bias); a constraint alone is applied where the logits are.
  static bool needs_host_processing(const Sequence& sequence) { return !sequence.request.sampling.logit_bias.empty(); }
  int64_t mask_words() const { return words_; }

 private:
  struct ChunkMasks {
    Sequence* sequence = nullptr;
    int64_t num_rows = 0;         // 1 + drafts
    int64_t first_mask_row = 0;   // its rows' index in the mask block
    std::vector<uint8_t> masked;  // [num_rows]: the row has a mask that allows some token
  };
  const ChunkMasks* find(const Sequence& sequence) const;
  std::span<uint32_t> mask_row(int64_t mask_row) const {
    return {static_cast<uint32_t*>(masks_.data()) + mask_row * words_, static_cast<size_t>(words_)};
  }
  void compute() noexcept;
  void run_worker();

  int64_t vocab_ = 0;
  int64_t words_ = 0;
  std::vector<ChunkMasks> chunks_;
  int64_t num_mask_rows_ = 0;
  PinnedBuffer masks_;          // [mask rows, words_] u32, the step's masks (capacity: its size)
  PinnedBuffer mask_row_ids_;   // [mask rows] i32: the logits row of each mask row, -1: none
  OwnedTensor device_masks_;    // [capacity, words_] i32 on the logits' device
  OwnedTensor device_row_ids_;  // [capacity] i32

  std::mutex mutex_;
  std::condition_variable changed_;
  bool pending_ = false;  // a begin() the worker has not finished
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread worker_;
};

}  // namespace metrale
