#include "engine/ngram_index.h"

#include <algorithm>

namespace metrale {
namespace {

// 64-bit hash of a token run; a collision only costs a fallback scan (lookups are verified).
uint64_t hash_tokens(std::span<const int32_t> run) {
  uint64_t h = 0x9e37'79b9'7f4a'7c15ull ^ run.size();
  for (const int32_t token : run) {
    h ^= static_cast<uint32_t>(token) + 0x9e37'79b9'7f4a'7c15ull + (h << 6) + (h >> 2);
    h *= 0xff51'afd7'ed55'8ccdull;
    h ^= h >> 33;
  }
  return h;
}

// The latest start s <= last_start with tokens[s, s + n) == the suffix of length n (-1: none).
int64_t scan_for_suffix(std::span<const int32_t> tokens, int64_t n, int64_t last_start) {
  const auto suffix = tokens.subspan(tokens.size() - static_cast<size_t>(n));
  for (int64_t start = last_start; start >= 0; --start) {
    if (std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) return start;
  }
  return -1;
}

}  // namespace

void NgramIndex::reset(int32_t ngram_min, int32_t ngram_max) {
  ngram_min_ = ngram_min;
  ngram_max_ = ngram_max;
  latest_start_.assign(static_cast<size_t>(std::max(ngram_max - ngram_min + 1, 0)), {});
  indexed_end_ = 0;
}

void NgramIndex::update(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max) {
  if (ngram_min < 1 || ngram_max < ngram_min) return;
  const auto size = static_cast<int64_t>(tokens.size());
  if (ngram_min != ngram_min_ || ngram_max != ngram_max_ || size < indexed_end_ + 1) reset(ngram_min, ngram_max);
  // Index every n-gram ending before the last token: all earlier occurrences of the suffixes.
  for (; indexed_end_ < size - 1; ++indexed_end_) {
    for (int64_t n = ngram_min; n <= ngram_max && n <= indexed_end_ + 1; ++n) {
      const int64_t start = indexed_end_ - n + 1;
      latest_start_[static_cast<size_t>(n - ngram_min)]
                   [hash_tokens(tokens.subspan(static_cast<size_t>(start), static_cast<size_t>(n)))] = start;
    }
  }
}

std::vector<int32_t> NgramIndex::propose(std::span<const int32_t> tokens, int32_t ngram_min, int32_t ngram_max,
                                         int32_t max_drafts) {
  if (max_drafts <= 0 || ngram_min < 1 || ngram_max < ngram_min) return {};
  const auto size = static_cast<int64_t>(tokens.size());
  update(tokens, ngram_min, ngram_max);
  // The longest suffix that occurred before wins, at its latest earlier occurrence.
  for (int64_t n = std::min<int64_t>(ngram_max, size - 1); n >= ngram_min; --n) {
    const auto suffix = tokens.subspan(static_cast<size_t>(size - n));
    const auto& starts = latest_start_[static_cast<size_t>(n - ngram_min)];
    const auto it = starts.find(hash_tokens(suffix));
    if (it == starts.end()) continue;
    int64_t start = it->second;
    if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start))
      start = scan_for_suffix(tokens, n, size - n - 1);
    if (start < 0) continue;
    const int64_t follow = start + n;
    const int64_t count = std::min<int64_t>(max_drafts, size - follow);
    return {tokens.begin() + follow, tokens.begin() + follow + count};
  }
  return {};
}

}  // namespace metrale
