// The mini-runner's SequenceCaches (step_runner.h) over a CacheManager, as the engine's runner uses
// it: reserve grows the sequence's blocks (all or nothing), its state slot is the manager's. For the
// suites that link floor 5 (tests/cache and up); header-only so that the model tests need no cache.
#pragma once

#include "cache/cache_manager.h"
#include "common/step_runner.h"
#include "core/error.h"

namespace metrale::testing {

class CacheManagerCaches : public SequenceCaches {
 public:
  // `num_block_caches`: the manager's first caches are ModelCaches::blocks, the rest ModelCaches::mtp.
  CacheManagerCaches(CacheManager& cache, size_t num_block_caches) : cache_(cache), num_block_caches_(num_block_caches) {}

  int32_t block_size() const override { return cache_.block_size(); }
  void reserve(int64_t seq_id, int64_t total_tokens) override {
    if (!cache_.reserve(seq_id, total_tokens)) {
      raise(ErrorCode::kOutOfMemory, "cache too small for sequence {} at {} tokens", seq_id, total_tokens);
    }
  }
  std::span<const int32_t> block_table(int64_t seq_id) override { return cache_.block_table(seq_id); }
  int32_t state_slot(int64_t seq_id) override { return cache_.state_slot(seq_id); }
  ModelCaches caches() override { return split_model_caches(cache_.block_caches(), num_block_caches_); }

 private:
  CacheManager& cache_;
  size_t num_block_caches_;
};

}  // namespace metrale::testing
