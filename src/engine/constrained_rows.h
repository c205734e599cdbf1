// ConstrainedRows: the token masks of a step's constrained sampling rows (requests with a
// TokenConstraint), computed on a worker thread while the step's forward runs, and the logit
// processing of every host-sampled row (logit_bias, then the mask).
//
// Per step: begin(plan) before the forward, wait() after it; then process_row() for each row the
// host samples and accept() with the tokens each chunk emitted. For a verify chunk the masks follow
// the protocol of engine/token_constraint.h: row i is masked for the state after drafts 0..i-1,
// the walk stops at the first draft the constraint refuses, and the drafts it accepted are rolled
// back before the forward ends.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "engine/request.h"
#include "engine/scheduler.h"

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
  // Feeds the tokens a chunk emitted (accepted drafts, then the sampled token) to its constraint.
  static void accept(Sequence& sequence, std::span<const SampledToken> emitted);

  // Whether a row of this request needs host processing (a constraint or a logit bias).
  static bool needs_processing(const Sequence& sequence) {
    return sequence.request.constraint != nullptr || !sequence.request.sampling.logit_bias.empty();
  }
  int64_t mask_words() const { return words_; }

 private:
  struct ChunkMasks {
    Sequence* sequence = nullptr;
    int64_t num_rows = 0;          // 1 + drafts
    size_t offset = 0;             // into masks_, in words
    std::vector<uint8_t> masked;   // [num_rows]: the row has a mask
  };
  const ChunkMasks* find(const Sequence& sequence) const;
  void compute() noexcept;
  void run_worker();

  int64_t vocab_ = 0;
  int64_t words_ = 0;
  std::vector<ChunkMasks> chunks_;
  std::vector<uint32_t> masks_;  // [rows of chunks_, words_]

  std::mutex mutex_;
  std::condition_variable changed_;
  bool pending_ = false;   // a begin() the worker has not finished
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::thread worker_;
};

}  // namespace metrale
