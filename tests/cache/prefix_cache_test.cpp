// Prefix cache: the hash chain, the index with its collision guard, the pool's LRU of cached
// blocks, and the CacheManager sharing blocks between sequences: a hit reuses whole blocks (never
// the whole prompt), blocks stay cached after their sequences end and are evicted least recently
// used first only when no empty block is left. A randomized scenario checks after every operation
// that reference counts equal the tables holding each block, that free + cached + used = total,
// and that no block is written while another sequence holds it or freed while referenced (every
// computed position's "key" still holds the value of its own prefix).
#include "cache/cache_manager.h"

#include <gtest/gtest.h>

#include <map>
#include <numeric>
#include <random>
#include <set>

#include "common/cache_specs.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

std::vector<int32_t> iota_tokens(int32_t count, int32_t first = 0) {
  std::vector<int32_t> tokens(static_cast<size_t>(count));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

TEST(BlockHash, ChainsOverParentAndTokens) {
  const std::vector<int32_t> a = {1, 2, 3, 4}, b = {1, 2, 3, 5};
  const BlockHash root = hash_block({}, a);
  EXPECT_EQ(root, hash_block({}, a));  // deterministic
  EXPECT_FALSE(root == hash_block({}, b));
  const BlockHash child = hash_block(root, a);
  EXPECT_FALSE(child == root);  // the same tokens after a different prefix
  EXPECT_FALSE(child == hash_block(hash_block({}, b), a));
  EXPECT_FALSE(root.low == 0 && root.high == 0);
  // Token order matters.
  EXPECT_FALSE(hash_block({}, std::vector<int32_t>{4, 3, 2, 1}) == root);
}

TEST(PrefixCache, FindsInsertedBlocksAndGuardsAgainstCollisions) {
  PrefixCache cache(8, 4);
  const std::vector<int32_t> tokens = {7, 8, 9, 10}, other = {7, 8, 9, 11};
  const BlockHash parent = hash_block({}, iota_tokens(4));
  const BlockHash hash = hash_block(parent, tokens);
  EXPECT_EQ(cache.find(hash, parent, tokens), -1);
  ASSERT_TRUE(cache.insert(5, hash, parent, tokens));
  EXPECT_TRUE(cache.holds(5));
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.find(hash, parent, tokens), 5);
  EXPECT_EQ(cache.find(hash), 5);
  EXPECT_EQ(cache.hash_of(5), hash);
  // A lookup whose hash matches but whose tokens or parent differ (a collision) is a miss.
  EXPECT_EQ(cache.find(hash, parent, other), -1);
  EXPECT_EQ(cache.find(hash, BlockHash{}, tokens), -1);
  // A second block with the same prefix is not indexed.
  EXPECT_FALSE(cache.insert(6, hash, parent, tokens));
  EXPECT_FALSE(cache.holds(6));
  // Checkpoints ride with the block and come back on erase.
  EXPECT_EQ(cache.checkpoint(5), -1);
  cache.set_checkpoint(5, 42);
  EXPECT_EQ(cache.checkpoint(5), 42);
  EXPECT_TRUE(throws_error([&] { cache.set_checkpoint(5, 43); }, ErrorCode::kInternal, {"already has checkpoint"}));
  EXPECT_EQ(cache.erase(5), 42);
  EXPECT_FALSE(cache.holds(5));
  EXPECT_EQ(cache.find(hash), -1);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_TRUE(throws_error([&] { cache.erase(5); }, ErrorCode::kInternal));
  EXPECT_TRUE(throws_error([&] { cache.insert(1, hash, parent, std::vector<int32_t>{1, 2}); }, ErrorCode::kInternal));
}

TEST(BlockPool, CachedBlocksAreEvictedLeastRecentlyReleasedFirstAndOnlyWhenNoEmptyBlockIsLeft) {
  BlockPool pool(6);
  std::vector<int32_t> blocks;
  ASSERT_TRUE(pool.allocate(4, blocks));  // 0 1 2 3
  for (const int32_t b : {0, 1, 2}) pool.mark_cached(b);
  EXPECT_EQ(pool.num_cached(), 0) << "used blocks are not counted as cached";
  pool.release(2);
  pool.release(0);
  pool.release(1);
  pool.release(3);  // not cached: back to the empty stack
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{2, 0, 1}));
  EXPECT_EQ(pool.num_cached(), 3);
  EXPECT_EQ(pool.num_empty(), 3);
  EXPECT_EQ(pool.num_free(), 6);
  EXPECT_EQ(pool.num_used(), 0);

  // A hit revives a cached block without evicting it.
  pool.retain(0);
  EXPECT_EQ(pool.ref_count(0), 1);
  EXPECT_TRUE(pool.is_cached(0));
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{2, 1}));
  EXPECT_EQ(pool.num_empty() + pool.num_cached() + pool.num_used(), 6);

  // Empty blocks go first; then the LRU head, reported as evicted.
  std::vector<int32_t> taken, evicted;
  EXPECT_TRUE(throws_error([&] { pool.allocate(4, taken); }, ErrorCode::kInternal, {"evict"}));
  taken.clear();
  ASSERT_TRUE(pool.allocate(4, taken, &evicted));
  EXPECT_EQ(taken, (std::vector<int32_t>{3, 4, 5, 2}));
  EXPECT_EQ(evicted, (std::vector<int32_t>{2}));
  EXPECT_FALSE(pool.is_cached(2));
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{1}));
  EXPECT_FALSE(pool.allocate(2, taken, &evicted));  // one free (cached) block left: nothing changes
  EXPECT_EQ(pool.num_cached(), 1);
  // The revived block released again is the most recent one.
  pool.release(0);
  EXPECT_EQ(pool.lru_order(), (std::vector<int32_t>{1, 0}));
  EXPECT_TRUE(throws_error([&] { pool.mark_cached(1); }, ErrorCode::kInternal, {"used block"}));
}

const std::vector<CacheSpec> kAttention = {testing::keys_and_values(1, 2)};

CacheConfig prefix_config(int32_t block_size, int32_t num_blocks) {
  CacheConfig config;
  config.block_size = block_size;
  config.num_blocks = num_blocks;
  config.enable_prefix_caching = true;
  return config;
}

// Computes a sequence the way the engine does: reserve, (forward), then index the full blocks.
void compute(CacheManager& cache, int64_t seq, const std::vector<int32_t>& tokens, int64_t num_computed) {
  ASSERT_TRUE(cache.reserve(seq, num_computed));
  cache.cache_full_blocks(seq, tokens, num_computed);
}

TEST(CacheManagerPrefix, ReusesTheLongestCachedPrefixButNeverTheWholePrompt) {
  CacheManager cache(kAttention, prefix_config(4, 32), Device::cpu());
  const std::vector<int32_t> first = iota_tokens(22);  // 5 full blocks + 2 tokens
  ASSERT_TRUE(cache.begin_sequence(1, first, true).has_value());
  compute(cache, 1, first, 22);
  const std::vector<int32_t> blocks_of_first(cache.block_table(1).begin(), cache.block_table(1).end());
  EXPECT_EQ(cache.prefix_cache().size(), 5u);

  // Shares the first 13 tokens: three whole blocks (12 tokens) are reused while sequence 1 runs.
  std::vector<int32_t> second = iota_tokens(13);
  second.insert(second.end(), {90, 91, 92, 93, 94});
  const auto match = cache.begin_sequence(2, second, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 12);
  EXPECT_FALSE(match->restored_state);
  ASSERT_EQ(cache.block_table(2).size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(cache.block_table(2)[i], blocks_of_first[i]);
    EXPECT_EQ(cache.pool().ref_count(blocks_of_first[i]), 2);
  }
  compute(cache, 2, second, 18);
  EXPECT_NE(cache.block_table(2)[3], blocks_of_first[3]) << "a partly shared block is never shared";
  cache.check_integrity();

  // The same prompt again: the whole prompt is never reused; at least one token is computed.
  const std::vector<int32_t> exact = iota_tokens(20);  // exactly 5 blocks, all cached
  const auto again = cache.begin_sequence(3, exact, true);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->cached_tokens, 16);
  // Without the prefix cache (scoring), nothing is reused.
  const auto scoring = cache.begin_sequence(4, first, false);
  ASSERT_TRUE(scoring.has_value());
  EXPECT_EQ(scoring->cached_tokens, 0);
  EXPECT_TRUE(cache.block_table(4).empty());
  cache.check_integrity();

  // Everyone leaves: the indexed blocks stay cached, the rest is empty.
  for (const int64_t seq : {1, 2, 3, 4}) cache.free_sequence(seq);
  EXPECT_EQ(cache.pool().num_used(), 0);
  EXPECT_EQ(cache.pool().num_cached(), static_cast<int32_t>(cache.prefix_cache().size()));
  EXPECT_EQ(cache.pool().num_cached(), 5 + 1);  // sequence 2's fourth block is a prefix of its own
  cache.check_integrity();
  // And a cached prefix is still found after its sequences ended.
  const auto later = cache.begin_sequence(5, first, true);
  ASSERT_TRUE(later.has_value());
  EXPECT_EQ(later->cached_tokens, 20);
  EXPECT_EQ(cache.pool().num_cached(), 1);
  cache.free_sequence(5);
  cache.check_integrity();
}

TEST(CacheManagerPrefix, DisabledCacheIndexesNothing) {
  CacheConfig config = prefix_config(4, 16);
  config.enable_prefix_caching = false;
  CacheManager cache(kAttention, config, Device::cpu());
  const std::vector<int32_t> tokens = iota_tokens(17);
  ASSERT_TRUE(cache.begin_sequence(1, tokens, true).has_value());
  compute(cache, 1, tokens, 17);
  EXPECT_EQ(cache.prefix_cache().size(), 0u);
  cache.free_sequence(1);
  EXPECT_EQ(cache.pool().num_cached(), 0);
  EXPECT_EQ(cache.begin_sequence(2, tokens, true)->cached_tokens, 0);
  cache.check_integrity();
}

TEST(CacheManagerPrefix, EvictsLeastRecentlyUsedPrefixesUnderPressure) {
  // 6 blocks of 4 tokens. Three prompts of two full blocks each (+1 token) fill the cache in turn.
  CacheManager cache(kAttention, prefix_config(4, 6), Device::cpu());
  const std::vector<std::vector<int32_t>> prompts = {iota_tokens(9, 100), iota_tokens(9, 200), iota_tokens(9, 300)};
  for (int64_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.begin_sequence(i, prompts[static_cast<size_t>(i)], true).has_value());
    compute(cache, i, prompts[static_cast<size_t>(i)], 9);  // 3 blocks, 2 of them full
    cache.free_sequence(i);
    cache.check_integrity();
  }
  // 2 + 2 + 2 cached blocks: the third sequence had to evict the first prompt's blocks (the first
  // two sequences left 4 cached and 2 empty blocks; the third took the 2 empty and 1 cached).
  EXPECT_EQ(cache.pool().num_cached(), 5);
  EXPECT_EQ(cache.pool().num_empty(), 1);
  // The first prompt lost its second block first (tail first): its first block is still usable.
  EXPECT_EQ(cache.begin_sequence(10, prompts[0], true)->cached_tokens, 4);
  EXPECT_EQ(cache.begin_sequence(11, prompts[2], true)->cached_tokens, 8);
  cache.free_sequence(10);
  cache.free_sequence(11);
  // A sequence that needs every block evicts all cached prefixes, and nothing is left indexed.
  ASSERT_TRUE(cache.begin_sequence(12, iota_tokens(24, 900), true).has_value());
  ASSERT_TRUE(cache.reserve(12, 24));
  EXPECT_EQ(cache.pool().num_cached(), 0);
  EXPECT_EQ(cache.prefix_cache().size(), 0u);
  EXPECT_FALSE(cache.reserve(13, 1));
  cache.check_integrity();
  cache.free_sequence(12);
  for (const auto& prompt : prompts) {
    EXPECT_EQ(cache.begin_sequence(20, prompt, true)->cached_tokens, 0);
    cache.free_sequence(20);
  }
  cache.check_integrity();
}

// A model of what the KV cache holds: the value written at a position is a function of the whole
// prefix up to it, so reading back a shared block checks it holds this sequence's prefix.
float prefix_value(const std::vector<int32_t>& tokens, int64_t position) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t p = 0; p <= position; ++p) h = (h ^ static_cast<uint64_t>(tokens[static_cast<size_t>(p)])) * 1099511628211ull;
  return static_cast<float>(h % 1000003);
}

TEST(CacheManagerPrefix, RandomizedSharingKeepsEveryInvariant) {
  const int32_t block_size = 3, num_blocks = 40;
  CacheManager cache(kAttention, prefix_config(block_size, num_blocks), Device::cpu());
  float* keys = cache.block_caches()[0].tensors[0].data_as<float>();  // [blocks, block_size, 1, 2]
  std::mt19937_64 rng(4242);
  // Prompts are drawn from a few stems so that prefixes are shared often.
  const std::vector<std::vector<int32_t>> stems = {iota_tokens(14, 1), iota_tokens(9, 50), {5, 5, 5, 5, 5, 5, 5}};
  struct Live {
    std::vector<int32_t> tokens;
    int64_t computed = 0;
  };
  std::map<int64_t, Live> live;
  int64_t next_id = 0, hits = 0;
  const auto key_at = [&](int64_t seq, int64_t position) {
    const int32_t block = cache.block_table(seq)[static_cast<size_t>(position / block_size)];
    return keys + (static_cast<int64_t>(block) * block_size + position % block_size) * 2;
  };
  for (int step = 0; step < 3000; ++step) {
    const int action = static_cast<int>(rng() % 10);
    if (action < 3 && live.size() < 8) {  // admit
      Live sequence;
      sequence.tokens = stems[rng() % stems.size()];
      sequence.tokens.resize(sequence.tokens.size() - rng() % 4);
      for (int extra = static_cast<int>(rng() % 6); extra > 0; --extra) sequence.tokens.push_back(static_cast<int32_t>(rng() % 7));
      const int64_t id = next_id++;
      const auto match = cache.begin_sequence(id, sequence.tokens, true);
      ASSERT_TRUE(match.has_value());
      ASSERT_LT(match->cached_tokens, static_cast<int64_t>(sequence.tokens.size()));
      ASSERT_EQ(match->cached_tokens % block_size, 0);
      hits += match->cached_tokens > 0;
      sequence.computed = match->cached_tokens;
      // The reused blocks hold this prefix.
      for (int64_t p = 0; p < sequence.computed; ++p)
        ASSERT_EQ(key_at(id, p)[0], prefix_value(sequence.tokens, p)) << "step " << step << " position " << p;
      live.emplace(id, std::move(sequence));
    } else if (action < 8 && !live.empty()) {  // compute a chunk (or a decode token)
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      Live& sequence = it->second;
      if (sequence.computed == static_cast<int64_t>(sequence.tokens.size())) sequence.tokens.push_back(static_cast<int32_t>(rng() % 7));
      const int64_t end = std::min<int64_t>(static_cast<int64_t>(sequence.tokens.size()), sequence.computed + 1 + static_cast<int64_t>(rng() % 5));
      if (!cache.reserve(it->first, end)) {
        cache.free_sequence(it->first);  // "preempted": its references go, cached blocks stay
        live.erase(it);
      } else {
        for (int64_t p = sequence.computed; p < end; ++p) {
          const int32_t block = cache.block_table(it->first)[static_cast<size_t>(p / block_size)];
          ASSERT_EQ(cache.pool().ref_count(block), 1) << "a write into block " << block << " that another table holds";
          key_at(it->first, p)[0] = prefix_value(sequence.tokens, p);
        }
        sequence.computed = end;
        cache.cache_full_blocks(it->first, sequence.tokens, end);
      }
    } else if (!live.empty()) {  // finish
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      cache.free_sequence(it->first);
      live.erase(it);
    }
    // Independent books: references from the tables, the pool's three states, the index.
    std::vector<int32_t> refs(static_cast<size_t>(num_blocks), 0);
    for (const auto& [id, sequence] : live) {
      for (const int32_t b : cache.block_table(id)) ++refs[static_cast<size_t>(b)];
      for (int64_t p = 0; p < sequence.computed; ++p)
        ASSERT_EQ(key_at(id, p)[0], prefix_value(sequence.tokens, p)) << "sequence " << id << " lost position " << p << " at step " << step;
    }
    int32_t used = 0, cached = 0;
    for (int32_t b = 0; b < num_blocks; ++b) {
      ASSERT_EQ(cache.pool().ref_count(b), refs[static_cast<size_t>(b)]) << "block " << b << " step " << step;
      used += refs[static_cast<size_t>(b)] > 0;
      cached += refs[static_cast<size_t>(b)] == 0 && cache.prefix_cache().holds(b);
    }
    ASSERT_EQ(cache.pool().num_used(), used);
    ASSERT_EQ(cache.pool().num_cached(), cached);
    ASSERT_EQ(cache.pool().num_empty() + cached + used, num_blocks) << "step " << step;
    ASSERT_NO_THROW(cache.check_integrity()) << "step " << step;
  }
  EXPECT_GT(hits, 100) << "the scenario is meant to share prefixes often";
  for (const auto& [id, sequence] : live) cache.free_sequence(id);
  EXPECT_EQ(cache.pool().num_used(), 0);
  cache.check_integrity();
}

}  // namespace
}  // namespace metrale
