// Recurrent state in the cache floor: the StatePool's slot ids, the state tensors the CacheManager
// allocates for kRecurrent specs, one slot per sequence (all or nothing with its blocks), and the
// hybrid prefix cache: checkpoints at block-aligned points, restored by copying every state tensor
// into the new sequence's slot, LRU among checkpoint slots, freed with their blocks.
#include "cache/cache_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "common/cache_specs.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

TEST(StatePool, HandsOutEachSlotOnce) {
  StatePool pool(10, 3);
  EXPECT_EQ(pool.num_slots(), 3);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_TRUE(pool.contains(10));
  EXPECT_TRUE(pool.contains(12));
  EXPECT_FALSE(pool.contains(13));
  EXPECT_FALSE(pool.contains(9));
  EXPECT_EQ(pool.allocate(), 10);  // lowest first
  EXPECT_EQ(pool.allocate(), 11);
  EXPECT_EQ(pool.allocate(), 12);
  EXPECT_EQ(pool.allocate(), -1);
  EXPECT_EQ(pool.num_used(), 3);
  pool.free(11);
  EXPECT_FALSE(pool.is_allocated(11));
  EXPECT_EQ(pool.allocate(), 11);
  pool.free(10);
  EXPECT_TRUE(throws_error([&] { pool.free(10); }, ErrorCode::kInternal, {"double free"}));
  EXPECT_TRUE(throws_error([&] { pool.free(3); }, ErrorCode::kInternal));
  EXPECT_EQ(pool.num_free() + pool.num_used(), pool.num_slots());
  EXPECT_TRUE(throws_error([] { StatePool bad(0, -1); }, ErrorCode::kInvalidArgument));
  StatePool none(0, 0);
  EXPECT_EQ(none.allocate(), -1);
}

// Block 0 attention, block 1 recurrent with an fp32 state and one in the activation dtype, block 2
// stateless.
std::vector<CacheSpec> hybrid_specs() {
  std::vector<CacheSpec> specs(3);
  specs[0] = testing::keys_and_values(1, 4);
  specs[1].tensors = {CacheTensorSpec::per_slot("recurrent", {2, 3, 4}, DType::kF32),
                      CacheTensorSpec::per_slot("conv", {3, 5})};
  return specs;
}

CacheConfig hybrid_config(int32_t seq_slots, int32_t checkpoints, DType dtype = DType::kF32) {
  CacheConfig config;
  config.block_size = 4;
  config.num_blocks = 16;
  config.activation_dtype = dtype;
  config.num_state_slots = seq_slots;
  config.num_checkpoint_slots = checkpoints;
  config.enable_prefix_caching = true;
  config.state_checkpoint_interval = 8;
  return config;
}

TEST(CacheManagerState, AllocatesStateTensorsForRecurrentSpecs) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const CacheManager cache(hybrid_specs(), hybrid_config(5, 2, dtype), Device::cpu());
    ASSERT_TRUE(cache.has_recurrent_state());
    const auto blocks = cache.block_caches();
    ASSERT_EQ(blocks.size(), 3u);
    EXPECT_EQ(blocks[0].tensors.size(), 2u);  // k, v
    ASSERT_EQ(blocks[1].tensors.size(), 2u);
    EXPECT_TRUE(blocks[2].tensors.empty());
    // 5 sequence slots + 2 checkpoints + the padding slot.
    EXPECT_TRUE(blocks[1].tensors[0].shape() == (Shape{8, 2, 3, 4}));
    EXPECT_EQ(blocks[1].tensors[0].dtype(), DType::kF32);
    EXPECT_TRUE(blocks[1].tensors[1].shape() == (Shape{8, 3, 5}));
    EXPECT_EQ(blocks[1].tensors[1].dtype(), dtype);
    EXPECT_TRUE(blocks[1].tensors[0].is_contiguous());
    EXPECT_EQ(cache.padding_state_slot(), 7);
    EXPECT_EQ(cache.num_state_slots(), 7);
    const uint64_t per_slot = slot_bytes_per_slot(hybrid_specs(), dtype);
    EXPECT_EQ(per_slot, 24 * 4 + 15 * dtype_size(dtype));
    EXPECT_GE(cache.state_memory_bytes(), 8 * per_slot);
    EXPECT_LT(cache.state_memory_bytes(), 8 * per_slot + 2 * Buffer::kAlignment);
    EXPECT_EQ(cache.memory_bytes(), cache.kv_memory_bytes() + cache.state_memory_bytes());
    // The state starts as zeros (never garbage a stray read could turn into NaN).
    const auto* first = static_cast<const uint8_t*>(blocks[1].tensors[0].data());
    EXPECT_TRUE(std::all_of(first, first + blocks[1].tensors[0].nbytes(), [](uint8_t b) { return b == 0; }));
  }
  // A model without per-slot tensors costs nothing.
  const std::vector<CacheSpec> attention_only = {testing::keys_and_values(1, 4)};
  const CacheManager plain(attention_only, hybrid_config(5, 2), Device::cpu());
  EXPECT_FALSE(plain.has_recurrent_state());
  EXPECT_EQ(plain.state_memory_bytes(), 0u);
  EXPECT_EQ(plain.num_state_slots(), 0);
  EXPECT_EQ(plain.padding_state_slot(), -1);
}

TEST(CacheManagerState, EachSequenceHoldsOneSlotAllOrNothing) {
  CacheManager cache(hybrid_specs(), hybrid_config(2, 0), Device::cpu());
  ASSERT_TRUE(cache.reserve(1, 5));
  ASSERT_TRUE(cache.begin_sequence(2, std::vector<int32_t>{1, 2, 3}, true).has_value());
  EXPECT_NE(cache.state_slot(1), cache.state_slot(2));
  EXPECT_GE(cache.state_slot(1), 0);
  EXPECT_LT(cache.state_slot(2), 2);
  EXPECT_EQ(cache.num_state_slots_used(), 2);
  // No slot left: neither path creates a sequence, and no block is taken.
  const int32_t free_blocks = cache.pool().num_free();
  EXPECT_FALSE(cache.reserve(3, 4));
  EXPECT_FALSE(cache.has_sequence(3));
  EXPECT_FALSE(cache.begin_sequence(3, std::vector<int32_t>{1, 2}, true).has_value());
  EXPECT_FALSE(cache.has_sequence(3));
  EXPECT_EQ(cache.pool().num_free(), free_blocks);
  // Growing an existing sequence needs no new slot.
  EXPECT_TRUE(cache.reserve(1, 9));
  const int32_t freed = cache.state_slot(1);
  cache.free_sequence(1);
  EXPECT_EQ(cache.state_slot(1), -1);
  ASSERT_TRUE(cache.reserve(3, 4));
  EXPECT_EQ(cache.state_slot(3), freed);
  cache.check_integrity();
  // A scratch cache (no sequence slots) gives sequences none.
  CacheManager scratch(hybrid_specs(), hybrid_config(0, 0), Device::cpu());
  ASSERT_TRUE(scratch.reserve(1, 4));
  EXPECT_EQ(scratch.state_slot(1), -1);
  EXPECT_EQ(scratch.padding_state_slot(), 0);
  scratch.check_integrity();
}

TEST(CacheManagerState, CheckpointPositions) {
  const CacheManager cache(hybrid_specs(), hybrid_config(2, 2), Device::cpu());  // block 4, interval 8
  // A 30-token prompt: checkpoints at 8, 16, 24 and at 28, the last block boundary before its end.
  std::vector<int64_t> points;
  for (int64_t p = 0; p <= 40; ++p)
    if (cache.is_checkpoint_position(30, p)) points.push_back(p);
  EXPECT_EQ(points, (std::vector<int64_t>{8, 16, 24, 28}));
  EXPECT_EQ(cache.next_checkpoint_position(30, 0), 8);
  EXPECT_EQ(cache.next_checkpoint_position(30, 8), 16);
  EXPECT_EQ(cache.next_checkpoint_position(30, 13), 16);
  EXPECT_EQ(cache.next_checkpoint_position(30, 24), 28);
  EXPECT_EQ(cache.next_checkpoint_position(30, 28), -1);
  EXPECT_EQ(cache.next_checkpoint_position(30, 29), -1);
  // A prompt of exactly 3 blocks: the last point is 8, so the same prompt again can use it.
  EXPECT_TRUE(cache.is_checkpoint_position(12, 8));
  EXPECT_FALSE(cache.is_checkpoint_position(12, 12));
  EXPECT_EQ(cache.next_checkpoint_position(3, 0), -1);  // shorter than a block: none
  // An interval that is not a multiple of the block size is rounded up to one.
  CacheConfig odd = hybrid_config(2, 2);
  odd.state_checkpoint_interval = 6;
  const CacheManager rounded(hybrid_specs(), odd, Device::cpu());
  EXPECT_EQ(rounded.config().state_checkpoint_interval, 8);
  // Without checkpoint slots, or without recurrent layers, there are no points.
  const CacheManager no_slots(hybrid_specs(), hybrid_config(2, 0), Device::cpu());
  EXPECT_FALSE(no_slots.is_checkpoint_position(30, 8));
  EXPECT_EQ(no_slots.next_checkpoint_position(30, 0), -1);
  const std::vector<CacheSpec> attention_only = {testing::keys_and_values(1, 4)};
  const CacheManager plain(attention_only, hybrid_config(2, 2), Device::cpu());
  EXPECT_EQ(plain.next_checkpoint_position(30, 0), -1);
}

// Writes a recognisable state into a slot: every element of every state tensor depends on the slot
// contents' "version" and the element index.
void write_state(const CacheManager& cache, int32_t slot, float version) {
  for (const Tensor& state : cache.block_caches()[1].tensors) {
    const int64_t per_slot = state.numel() / state.size(0);
    auto* data = state.data_as<float>() + slot * per_slot;
    for (int64_t i = 0; i < per_slot; ++i) data[i] = version * 1000.0f + static_cast<float>(i);
  }
}

bool state_is(const CacheManager& cache, int32_t slot, float version) {
  for (const Tensor& state : cache.block_caches()[1].tensors) {
    const int64_t per_slot = state.numel() / state.size(0);
    const auto* data = state.data_as<const float>() + slot * per_slot;
    for (int64_t i = 0; i < per_slot; ++i)
      if (data[i] != version * 1000.0f + static_cast<float>(i)) return false;
  }
  return true;
}

TEST(CacheManagerState, CheckpointsRestoreTheStateOfTheLongestCheckpointedPrefix) {
  CacheManager cache(hybrid_specs(), hybrid_config(3, 4), Device::cpu());
  std::vector<int32_t> prompt(22);
  std::iota(prompt.begin(), prompt.end(), 1);
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  const int32_t slot = cache.state_slot(1);
  // Prefill in chunks ending at the checkpoint points (8, 16, 20), as the scheduler cuts them.
  for (const int64_t end : {8, 16, 20}) {
    ASSERT_TRUE(cache.reserve(1, end));
    write_state(cache, slot, static_cast<float>(end));  // "the forward"
    cache.cache_full_blocks(1, prompt, end);
    ASSERT_TRUE(cache.is_checkpoint_position(22, end));
    cache.checkpoint_state(1, end);
  }
  EXPECT_EQ(cache.num_checkpoints(), 3);
  write_state(cache, slot, 99.0f);  // the sequence moves on; its checkpoints keep their copies
  cache.check_integrity();

  // The same 22 tokens: blocks up to 20 are cached and 20 has a checkpoint.
  const auto full = cache.begin_sequence(2, prompt, true);
  ASSERT_TRUE(full.has_value());
  EXPECT_EQ(full->cached_tokens, 20);
  EXPECT_TRUE(full->restored_state);
  EXPECT_TRUE(state_is(cache, cache.state_slot(2), 20.0f));
  // Sharing 18 tokens: block 16..19 differs, so the prefix is 16 tokens, with its checkpoint.
  std::vector<int32_t> partial(prompt.begin(), prompt.begin() + 18);
  partial.insert(partial.end(), {70, 71, 72});
  const auto half = cache.begin_sequence(3, partial, true);
  ASSERT_TRUE(half.has_value());
  EXPECT_EQ(half->cached_tokens, 16);
  EXPECT_TRUE(state_is(cache, cache.state_slot(3), 16.0f));
  cache.check_integrity();
  for (const int64_t seq : {1, 2, 3}) cache.free_sequence(seq);

  // Blocks cached without a checkpoint are not usable on a hybrid model: a prefix of 12 cached
  // tokens falls back to the checkpoint at 8.
  std::vector<int32_t> twelve(prompt.begin(), prompt.begin() + 13);
  const auto at_eight = cache.begin_sequence(4, twelve, true);
  ASSERT_TRUE(at_eight.has_value());
  EXPECT_EQ(at_eight->cached_tokens, 8);
  EXPECT_TRUE(state_is(cache, cache.state_slot(4), 8.0f));
  cache.free_sequence(4);
  cache.check_integrity();
}

TEST(CacheManagerState, CheckpointsAreEvictedLeastRecentlyUsedAndWithTheirBlocks) {
  CacheManager cache(hybrid_specs(), hybrid_config(2, 2), Device::cpu());  // 2 checkpoint slots, 16 blocks
  const auto run_prompt = [&](int64_t seq, int32_t first_token, float version) {
    std::vector<int32_t> prompt(9);
    std::iota(prompt.begin(), prompt.end(), first_token);
    EXPECT_TRUE(cache.begin_sequence(seq, prompt, true).has_value());
    EXPECT_TRUE(cache.reserve(seq, 8));
    write_state(cache, cache.state_slot(seq), version);
    cache.cache_full_blocks(seq, prompt, 8);
    cache.checkpoint_state(seq, 8);
    cache.free_sequence(seq);
    return prompt;
  };
  const auto a = run_prompt(1, 100, 1.0f);
  const auto b = run_prompt(2, 200, 2.0f);
  EXPECT_EQ(cache.num_checkpoints(), 2);
  // Using a's checkpoint makes b's the least recently used one; a third checkpoint replaces b's.
  ASSERT_EQ(cache.begin_sequence(3, a, true)->cached_tokens, 8);
  cache.free_sequence(3);
  const auto c = run_prompt(4, 300, 3.0f);
  EXPECT_EQ(cache.num_checkpoints(), 2);
  EXPECT_EQ(cache.begin_sequence(5, b, true)->cached_tokens, 0) << "b's blocks are cached but lost their checkpoint";
  cache.free_sequence(5);
  const auto restored_c = cache.begin_sequence(6, c, true);
  EXPECT_EQ(restored_c->cached_tokens, 8);
  EXPECT_TRUE(state_is(cache, cache.state_slot(6), 3.0f));
  cache.free_sequence(6);
  cache.check_integrity();
  // Filling every block evicts all cached blocks, and their checkpoints with them.
  ASSERT_TRUE(cache.reserve(7, 16 * 4));
  EXPECT_EQ(cache.num_checkpoints(), 0);
  EXPECT_EQ(cache.prefix_cache().size(), 0u);
  cache.check_integrity();
  cache.free_sequence(7);
  EXPECT_EQ(cache.begin_sequence(8, a, true)->cached_tokens, 0);
  cache.free_sequence(8);
  cache.check_integrity();
}

}  // namespace
}  // namespace metrale
