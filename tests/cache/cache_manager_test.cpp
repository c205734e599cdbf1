// CacheManager: storage shapes per block spec, paged_bytes_per_block, block accounting (reserve grows
// tables all or nothing, blocks_needed, free_sequence), a randomized multi-sequence scenario, and
// the storage and tables it hands out used by the attention kernels as a model would use them.
// (cache_tensors_test.cpp covers every kind of cache tensor.)
#include "cache/cache_manager.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <optional>
#include <random>
#include <set>

#include "common/cache_specs.h"
#include "core/test_support.h"
#include "kernels/attention.h"

namespace metrale {
namespace {

using testing::keys_and_values;
using testing::throws_error;

const std::vector<CacheSpec> kSpecs = {keys_and_values(2, 8), CacheSpec{}, keys_and_values(1, 16)};

TEST(CacheManager, StorageFollowsTheBlockSpecs) {
  for (const DType dtype : {DType::kF32, DType::kBF16}) {
    const CacheConfig config{4, 10, dtype};
    const CacheManager cache(kSpecs, config, Device::cpu());
    const auto blocks = cache.block_caches();
    ASSERT_EQ(blocks.size(), 3u);
    ASSERT_EQ(blocks[0].tensors.size(), 2u);
    ASSERT_EQ(blocks[2].tensors.size(), 2u);
    EXPECT_TRUE(blocks[0].tensors[0].shape() == (Shape{10, 4, 2, 8}));
    EXPECT_TRUE(blocks[0].tensors[1].shape() == (Shape{10, 4, 2, 8}));
    EXPECT_TRUE(blocks[2].tensors[0].shape() == (Shape{10, 4, 1, 16}));
    EXPECT_TRUE(blocks[1].tensors.empty());  // stateless block
    for (const size_t i : {0u, 2u}) {
      for (const Tensor& tensor : blocks[i].tensors) {
        EXPECT_EQ(tensor.dtype(), dtype);
        EXPECT_TRUE(tensor.is_contiguous());
        // The whole tensor is usable memory (ASan would flag an undersized allocation).
        std::memset(tensor.data(), 0x3c, tensor.nbytes());
      }
      EXPECT_NE(blocks[i].tensors[0].data(), blocks[i].tensors[1].data());
    }
    const uint64_t expected_bytes = 2ull * 10 * 4 * (2 * 8 + 1 * 16) * dtype_size(dtype);
    EXPECT_EQ(cache.memory_bytes(), expected_bytes);
    EXPECT_EQ(paged_bytes_per_block(kSpecs, 4, dtype), expected_bytes / 10);
    EXPECT_FALSE(cache.has_recurrent_state());
    EXPECT_NO_THROW(cache.check_integrity());
    EXPECT_EQ(cache.pool().num_blocks(), 10);
    EXPECT_EQ(cache.block_size(), 4);
  }
}

TEST(CacheManager, PagedBytesPerBlock) {
  EXPECT_EQ(paged_bytes_per_block(kSpecs, 16, DType::kBF16), 2u * 16 * (16 + 16) * 2);
  EXPECT_EQ(paged_bytes_per_block({}, 16, DType::kBF16), 0u);
  const std::vector<CacheSpec> big = {keys_and_values(8, 128)};
  EXPECT_EQ(paged_bytes_per_block(big, 256, DType::kF32), 2ull * 256 * 8 * 128 * 4);
  EXPECT_EQ(slot_bytes_per_slot(big, DType::kF32), 0u);
}

TEST(CacheManager, InvalidConfigurations) {
  EXPECT_TRUE(throws_error(
      [] {
        CacheManager cache(kSpecs, {0, 4, DType::kF32}, Device::cpu());
      },
      ErrorCode::kInvalidArgument, {"block size"}));
  EXPECT_TRUE(throws_error(
      [] {
        CacheManager cache(kSpecs, {4, -1, DType::kF32}, Device::cpu());
      },
      ErrorCode::kInvalidArgument));
}

TEST(CacheManager, ReserveGrowsTablesAllOrNothing) {
  CacheManager cache(kSpecs, {4, 5, DType::kF32}, Device::cpu());
  EXPECT_EQ(cache.blocks_for(0), 0);
  EXPECT_EQ(cache.blocks_for(1), 1);
  EXPECT_EQ(cache.blocks_for(4), 1);
  EXPECT_EQ(cache.blocks_for(5), 2);
  EXPECT_EQ(cache.blocks_needed(7, 9), 3);  // unknown sequence: everything is needed
  ASSERT_TRUE(cache.reserve(7, 5));
  EXPECT_EQ(cache.block_table(7).size(), 2u);
  EXPECT_EQ(cache.blocks_needed(7, 8), 0);  // already covered
  EXPECT_EQ(cache.blocks_needed(7, 9), 1);
  EXPECT_EQ(cache.blocks_needed(7, 3), 0);  // never negative
  ASSERT_TRUE(cache.reserve(7, 8));
  EXPECT_EQ(cache.block_table(7).size(), 2u);
  const std::vector<int32_t> before(cache.block_table(7).begin(), cache.block_table(7).end());
  ASSERT_TRUE(cache.reserve(7, 9));
  const auto grown = cache.block_table(7);
  ASSERT_EQ(grown.size(), 3u);
  EXPECT_TRUE(std::equal(before.begin(), before.end(), grown.begin())) << "growing keeps the existing blocks in order";
  EXPECT_EQ(cache.pool().num_free(), 2);

  // Sequence 8 needs 3 blocks but only 2 are free: nothing changes.
  EXPECT_FALSE(cache.reserve(8, 12));
  EXPECT_FALSE(cache.has_sequence(8));
  EXPECT_EQ(cache.pool().num_free(), 2);
  // Growing 7 past the pool fails the same way and keeps its table.
  EXPECT_FALSE(cache.reserve(7, 21));
  EXPECT_EQ(cache.block_table(7).size(), 3u);
  EXPECT_EQ(cache.pool().num_free(), 2);
  ASSERT_TRUE(cache.reserve(8, 8));
  EXPECT_EQ(cache.pool().num_free(), 0);
  EXPECT_EQ(cache.num_sequences(), 2u);
}

TEST(CacheManager, FreeSequenceReturnsEveryBlock) {
  CacheManager cache(kSpecs, {2, 12, DType::kF32}, Device::cpu());
  ASSERT_TRUE(cache.reserve(1, 7));  // 4 blocks
  ASSERT_TRUE(cache.reserve(2, 3));  // 2 blocks
  EXPECT_EQ(cache.pool().num_used(), 6);
  const std::vector<int32_t> first(cache.block_table(1).begin(), cache.block_table(1).end());
  cache.free_sequence(1);
  EXPECT_FALSE(cache.has_sequence(1));
  EXPECT_TRUE(cache.block_table(1).empty());
  EXPECT_EQ(cache.pool().num_used(), 2);
  for (const int32_t b : first) EXPECT_EQ(cache.pool().ref_count(b), 0);
  cache.free_sequence(1);   // freeing twice is harmless
  cache.free_sequence(42);  // so is freeing an unknown sequence
  EXPECT_EQ(cache.pool().num_used(), 2);
  // The freed sequence's first block is the first one reused.
  ASSERT_TRUE(cache.reserve(3, 1));
  EXPECT_EQ(cache.block_table(3)[0], first[0]);
}

TEST(CacheManager, RandomizedSequencesNeverShareBlocks) {
  const int32_t num_blocks = 48, block_size = 3;
  CacheManager cache(kSpecs, {block_size, num_blocks, DType::kF32}, Device::cpu());
  std::mt19937_64 rng(1301);
  std::map<int64_t, int64_t> lengths;  // the test's record of each live sequence's reserved tokens
  for (int step = 0; step < 3000; ++step) {
    const int action = static_cast<int>(rng() % 10);
    const int64_t seq = static_cast<int64_t>(rng() % 12);
    if (action < 7) {
      const int64_t current = lengths.count(seq) ? lengths[seq] : 0;
      const int64_t wanted = current + static_cast<int64_t>(rng() % 8);
      const int32_t needed = cache.blocks_needed(seq, wanted);
      const int32_t expected_needed =
          std::max<int32_t>(0, cache.blocks_for(wanted) - static_cast<int32_t>(cache.block_table(seq).size()));
      ASSERT_EQ(needed, expected_needed);
      const int32_t free_before = cache.pool().num_free();
      const size_t table_before = cache.block_table(seq).size();
      const bool ok = cache.reserve(seq, wanted);
      ASSERT_EQ(ok, needed <= free_before) << "step " << step;
      if (ok) {
        lengths[seq] = std::max(current, wanted);
        ASSERT_GE(static_cast<int64_t>(cache.block_table(seq).size()) * block_size, wanted);
        ASSERT_EQ(cache.pool().num_free(), free_before - needed);
      } else {
        ASSERT_EQ(cache.block_table(seq).size(), table_before) << "a failed reserve changed the table";
        ASSERT_EQ(cache.pool().num_free(), free_before);
      }
    } else {
      cache.free_sequence(seq);
      lengths.erase(seq);
    }
    // Invariants: no block in two tables, every owned block has one reference, the pool agrees.
    std::set<int32_t> owned;
    size_t total = 0;
    for (int64_t s = 0; s < 12; ++s) {
      for (const int32_t b : cache.block_table(s)) {
        ASSERT_TRUE(owned.insert(b).second) << "block " << b << " owned twice at step " << step;
        ASSERT_EQ(cache.pool().ref_count(b), 1);
      }
      total += cache.block_table(s).size();
    }
    ASSERT_EQ(static_cast<int32_t>(total), cache.pool().num_used()) << "step " << step;
    ASSERT_EQ(cache.pool().num_used() + cache.pool().num_free(), num_blocks);
  }
  for (int64_t s = 0; s < 12; ++s) cache.free_sequence(s);
  EXPECT_EQ(cache.pool().num_free(), num_blocks);
  EXPECT_EQ(cache.num_sequences(), 0u);
}

// The manager's storage and block tables drive kv_cache_write + paged_attention the way a model
// layer does; the result must equal single-head attention computed directly from the keys/values.
TEST(CacheManager, StorageAndTablesServeTheAttentionKernels) {
  const int64_t head_dim = 8;
  const std::vector<CacheSpec> specs = {keys_and_values(1, head_dim)};
  CacheManager cache(specs, {2, 16, DType::kF32}, Device::cpu());
  std::mt19937_64 rng(1401);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  // Interleave reservations so that the two sequences' blocks alternate in the pool.
  const int64_t len_a = 7, len_b = 5;
  for (int64_t n = 1; n <= std::max(len_a, len_b); ++n) {
    if (n <= len_a) {
      ASSERT_TRUE(cache.reserve(10, n));
    }
    if (n <= len_b) {
      ASSERT_TRUE(cache.reserve(20, n));
    }
  }
  const int64_t tokens = len_a + len_b;
  std::vector<float> k(static_cast<size_t>(tokens * head_dim)), v(k.size()), q(k.size()), out(k.size(), std::nanf(""));
  for (auto* values : {&k, &v, &q}) {
    for (auto& x : *values) x = dist(rng);
  }
  std::vector<int32_t> slots, cu_q = {0, static_cast<int32_t>(len_a), static_cast<int32_t>(tokens)};
  std::vector<int32_t> kv_lens = {static_cast<int32_t>(len_a), static_cast<int32_t>(len_b)};
  const int64_t max_blocks = std::max(cache.block_table(10).size(), cache.block_table(20).size());
  std::vector<int32_t> tables(static_cast<size_t>(2 * max_blocks), 0);
  for (int s = 0; s < 2; ++s) {
    const auto table = cache.block_table(s == 0 ? 10 : 20);
    std::copy(table.begin(), table.end(), tables.begin() + s * max_blocks);
    for (int64_t p = 0; p < kv_lens[static_cast<size_t>(s)]; ++p)
      slots.push_back(table[static_cast<size_t>(p / 2)] * 2 + static_cast<int32_t>(p % 2));
  }
  const Tensor& keys = cache.block_caches()[0].tensors[0];
  const Tensor& values = cache.block_caches()[0].tensors[1];
  kernels::AttentionParams params;
  params.scale = 0.5f;
  kernels::kv_cache_write(Tensor(k.data(), DType::kF32, {tokens, 1, head_dim}),
                          Tensor(v.data(), DType::kF32, {tokens, 1, head_dim}),
                          Tensor(slots.data(), DType::kI32, {tokens}), keys, values);
  kernels::paged_attention(Tensor(q.data(), DType::kF32, {tokens, 1, head_dim}), keys, values,
                           Tensor(cu_q.data(), DType::kI32, {3}), Tensor(kv_lens.data(), DType::kI32, {2}),
                           Tensor(tables.data(), DType::kI32, {2, max_blocks}),
                           Tensor(out.data(), DType::kF32, {tokens, 1, head_dim}), params);
  double diff = 0.0, norm = 0.0;
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t first = t < len_a ? 0 : len_a;  // the sequence's first row
    std::vector<double> weights;
    double denom = 0.0;
    for (int64_t j = first; j <= t; ++j) {
      double dot = 0.0;
      for (int64_t d = 0; d < head_dim; ++d)
        dot += static_cast<double>(q[static_cast<size_t>(t * head_dim + d)]) * k[static_cast<size_t>(j * head_dim + d)];
      weights.push_back(std::exp(0.5 * dot));
      denom += weights.back();
    }
    for (int64_t d = 0; d < head_dim; ++d) {
      double expected = 0.0;
      for (int64_t j = first; j <= t; ++j)
        expected += weights[static_cast<size_t>(j - first)] / denom * v[static_cast<size_t>(j * head_dim + d)];
      const double actual = out[static_cast<size_t>(t * head_dim + d)];
      ASSERT_TRUE(std::isfinite(actual)) << "row " << t;
      diff += (actual - expected) * (actual - expected);
      norm += expected * expected;
    }
  }
  EXPECT_LE(std::sqrt(diff / norm), 1e-6);
}

// FP8 attention caches (--kv-cache-dtype fp8) next to a tensor that stays in the activation dtype
// (an MLA latent): the planner's bytes per block halve for the K/V rows, and the host tier sizes
// its blocks from each tensor's dtype and brings the codes back byte for byte.
std::vector<CacheSpec> fp8_kv_specs(std::optional<DType> kv_dtype) {
  return {{{CacheTensorSpec::per_token("k", {2, 8}, kv_dtype), CacheTensorSpec::per_token("v", {2, 8}, kv_dtype)}},
          {{CacheTensorSpec::per_token("latent", {4})}}};
}

TEST(CacheManager, Fp8KeysAndValuesHalveTheirBlockBytes) {
  const uint64_t bf16 = paged_bytes_per_block(fp8_kv_specs(DType::kBF16), 16, DType::kBF16);
  const uint64_t fp8 = paged_bytes_per_block(fp8_kv_specs(DType::kF8E4M3), 16, DType::kBF16);
  EXPECT_EQ(bf16, 16u * (2 * 2 * 8 * 2 + 4 * 2));
  EXPECT_EQ(fp8, 16u * (2 * 2 * 8 * 1 + 4 * 2));
  // Attention alone: exactly twice the blocks for the same bytes.
  const std::vector<CacheSpec> attention_bf16 = {keys_and_values(8, 128)};
  const std::vector<CacheSpec> attention_fp8 = {
      {{CacheTensorSpec::per_token("k", {8, 128}, DType::kF8E4M3), CacheTensorSpec::per_token("v", {8, 128}, DType::kF8E4M3)}}};
  EXPECT_EQ(paged_bytes_per_block(attention_bf16, 16, DType::kBF16),
            2 * paged_bytes_per_block(attention_fp8, 16, DType::kBF16));
}

TEST(CacheManager, HostTierSwapsFp8BlocksByteForByte) {
  CacheConfig config{4, 6, DType::kBF16};
  config.num_host_blocks = 3;
  CacheManager cache(fp8_kv_specs(DType::kF8E4M3), config, Device::cpu());
  const Tensor& keys = cache.block_caches()[0].tensors[0];
  const Tensor& latent = cache.block_caches()[1].tensors[0];
  ASSERT_EQ(keys.dtype(), DType::kF8E4M3);
  ASSERT_EQ(latent.dtype(), DType::kBF16);
  EXPECT_EQ(cache.kv_memory_bytes(), 6u * 4 * (2 * 2 * 8 + 4 * 2));
  EXPECT_EQ(cache.host_tier().memory_bytes(), 3u * 4 * (2 * 2 * 8 + 4 * 2));
  ASSERT_TRUE(cache.reserve(1, 10));  // 3 blocks
  std::mt19937_64 rng(1402);
  const auto fill_blocks = [&](int64_t seq) {
    for (const int32_t block : cache.block_table(seq)) {
      for (const BlockCache& block_cache : cache.block_caches()) {
        for (const Tensor& tensor : block_cache.tensors) {
          auto* bytes = static_cast<uint8_t*>(tensor.select(0, block).data());
          for (size_t i = 0; i < tensor.nbytes() / static_cast<size_t>(tensor.size(0)); ++i)
            bytes[i] = static_cast<uint8_t>(rng());
        }
      }
    }
  };
  const auto block_bytes = [&](int64_t seq) {
    std::vector<uint8_t> all;
    for (const int32_t block : cache.block_table(seq)) {
      for (const BlockCache& block_cache : cache.block_caches()) {
        for (const Tensor& tensor : block_cache.tensors) {
          const auto* bytes = static_cast<const uint8_t*>(tensor.select(0, block).data());
          all.insert(all.end(), bytes, bytes + tensor.nbytes() / static_cast<size_t>(tensor.size(0)));
        }
      }
    }
    return all;
  };
  fill_blocks(1);
  const std::vector<uint8_t> before = block_bytes(1);
  ASSERT_TRUE(cache.swap_out(1));
  ASSERT_TRUE(cache.reserve(2, 24));  // every device block, overwritten
  fill_blocks(2);
  cache.free_sequence(2);
  ASSERT_EQ(cache.swap_in(1), SwapIn::kDone);
  EXPECT_EQ(block_bytes(1), before);
  cache.check_integrity();
}

}  // namespace
}  // namespace metrale
