// Incremental prompt lookup for the n-gram drafter (engine/speculator.h has the scheme).
//
// propose_ngram_drafts scans the whole sequence for its suffix: linear in the sequence per call,
// which at a few hundred decoding sequences of a few thousand tokens costs milliseconds a step.
// NgramIndex keeps, for each n in [ngram_min, ngram_max], the latest start of every n-gram of the
// sequence but its final one, so that a call only indexes the tokens appended since the last call
// (O(ngram_max^2) each) and looks the suffixes up (O(ngram_max)). The proposals are exactly
// propose_ngram_drafts's.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace metrale {

class NgramIndex {
 public:
  // Up to `max_drafts` tokens proposed to follow `tokens` (see propose_ngram_drafts). `tokens` only
  // grows between calls (a shorter sequence or other n-gram sizes rebuild the index).
  std::vector<int32_t> propose(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                               int32_t max_drafts);
  // Indexes the tokens appended since the last call (propose does it too).
  void update(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max);
  // Tokens of `tokens` the next update or propose would index (all of them after a reset).
  int64_t pending(std::span<const int32_t> tokens) const {
    const auto size = static_cast<int64_t>(tokens.size());
    return size < indexed_end_ + 1 ? size : size - 1 - indexed_end_;
  }

 private:
  void reset(int32_t ngram_min, int32_t ngram_max);

  int32_t ngram_min_ = 0, ngram_max_ = -1;
  // [n - ngram_min]: hash of an n-gram's tokens -> its latest start.
  std::vector<std::unordered_map<uint64_t, int64_t>> latest_start_;
  // N-grams ending at positions [0, indexed_end_) are indexed. Invariant during propose: indexed_end_
  // = size - 1, so the final n-gram of every length (the suffix itself) is never in the index.
  int64_t indexed_end_ = 0;
};

}  // namespace metrale
