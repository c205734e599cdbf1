// The tiers below the device: the DiskTier's files and checks on their own, and through the
// CacheManager swapped sequences and prefix blocks (and, with per-slot tensors, their state
// checkpoints) that go from the device to the host tier and on to disk and come back bit for bit;
// entries corrupted, truncated or deleted on disk are dropped, never handed out.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>

#include "cache/cache_manager.h"
#include "cache/disk_tier.h"
#include "cache/host_tier.h"

namespace metrale {
namespace {

constexpr int32_t kBlockSize = 4;
constexpr int64_t kRowFloats = 3;   // per token
constexpr int64_t kSlotFloats = 5;  // per slot

std::filesystem::path scratch_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() / ("metrale_tiers_" + name);
  std::filesystem::remove_all(dir);
  return dir;
}

std::vector<std::byte> bytes_of(size_t count, uint8_t seed) {
  std::vector<std::byte> bytes(count);
  for (size_t i = 0; i < count; ++i) bytes[i] = static_cast<std::byte>((i * 31 + seed) & 0xff);
  return bytes;
}

TEST(DiskTier, ReadsBackWhatItWroteAndReportsEveryKindOfLoss) {
  const auto parent = scratch_dir("disk");
  DiskTier disk(parent, 96, 40, 4, 2);
  EXPECT_TRUE(std::filesystem::is_directory(disk.directory()));
  EXPECT_EQ(disk.directory().parent_path(), parent);
  EXPECT_EQ(disk.capacity_bytes(), 4u * 96 + 2u * 40);
  for (int32_t block = 0; block < 4; ++block) disk.write_block(block, bytes_of(96, static_cast<uint8_t>(block)));
  disk.write_slot(1, bytes_of(40, 9));
  // A read queued behind its write sees it.
  DiskRead read = disk.read_block(2).get();
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(read.bytes, bytes_of(96, 2));
  read = disk.read_slot(1).get();
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(read.bytes, bytes_of(40, 9));
  disk.drain();
  // A byte changed, a file cut short, a file gone, a file replaced by another entry's bytes.
  {
    std::fstream file(disk.block_path(0), std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(50);
    file.put('\x7f');
  }
  std::filesystem::resize_file(disk.block_path(1), 95);
  std::filesystem::remove(disk.block_path(2));
  std::filesystem::copy_file(disk.block_path(0), disk.block_path(3), std::filesystem::copy_options::overwrite_existing);
  for (int32_t block = 0; block < 4; ++block) {
    read = disk.read_block(block).get();
    EXPECT_FALSE(read.ok) << "block " << block;
    EXPECT_TRUE(read.bytes.empty());
    EXPECT_NE(read.error.find(disk.block_path(block).filename().string()), std::string::npos) << read.error;
  }
  // Rewriting an entry makes it good again.
  disk.write_block(2, bytes_of(96, 77));
  read = disk.read_block(2).get();
  ASSERT_TRUE(read.ok) << read.error;
  EXPECT_EQ(read.bytes, bytes_of(96, 77));
  EXPECT_GE(disk.bytes_written(), 5u * 96);
}

// The workers: an entry's writes and reads stay in order however many entries are in flight on the
// others; the read rate is measured once reads have come back.
TEST(DiskTier, EveryEntryKeepsItsOrderAcrossTheWorkers) {
  const auto parent = scratch_dir("workers");
  constexpr int32_t kBlocks = 4 * static_cast<int32_t>(DiskTier::kWorkers) + 3;
  DiskTier disk(parent, 4096, 64, kBlocks, 3);
  EXPECT_EQ(disk.read_bytes_per_second(), 0.0);
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE(round);
    std::vector<std::future<DiskRead>> reads;
    for (int32_t block = 0; block < kBlocks; ++block) {
      disk.write_block(block, bytes_of(4096, static_cast<uint8_t>(block + 31 * round)));
      reads.push_back(disk.read_block(block));
    }
    for (int32_t slot = 0; slot < 3; ++slot) {
      disk.write_slot(slot, bytes_of(64, static_cast<uint8_t>(100 + slot + round)));
      reads.push_back(disk.read_slot(slot));
    }
    for (int32_t block = 0; block < kBlocks; ++block) {
      DiskRead read = reads[static_cast<size_t>(block)].get();
      ASSERT_TRUE(read.ok) << read.error;
      EXPECT_EQ(read.bytes, bytes_of(4096, static_cast<uint8_t>(block + 31 * round))) << "block " << block;
    }
    for (int32_t slot = 0; slot < 3; ++slot) {
      DiskRead read = reads[static_cast<size_t>(kBlocks + slot)].get();
      ASSERT_TRUE(read.ok) << read.error;
      EXPECT_EQ(read.bytes, bytes_of(64, static_cast<uint8_t>(100 + slot + round))) << "slot " << slot;
    }
  }
  disk.drain();
  EXPECT_GT(disk.read_bytes_per_second(), 0.0);
  EXPECT_EQ(disk.bytes_read(), 3u * (kBlocks * 4096u + 3u * 64u));
}

// The host tier's seal: an entry overwritten, partly or whole, or a block's bytes moved into another
// fails verification; the seal samples the start of every 4 KiB and the unit's tail.
TEST(HostTier, VerificationCatchesOverwrittenAndMisplacedEntries) {
  constexpr int64_t kUnitFloats = 5000;  // 20,000 bytes: five 4 KiB pages, a partial last one
  OwnedTensor paged(DType::kF32, {3, kUnitFloats});
  for (int64_t i = 0; i < 3 * kUnitFloats; ++i) paged.tensor.data_as<float>()[i] = static_cast<float>(i);
  HostTier host(Device::cpu(), {kUnitFloats * sizeof(float)}, {}, 2, 0);
  std::vector<int32_t> taken;
  ASSERT_TRUE(host.block_pool().allocate(2, taken, nullptr));
  const std::span<const OwnedTensor> tensors(&paged, 1);
  host.store_block(tensors, 0, taken[0]);
  host.store_block(tensors, 1, taken[1]);
  ASSERT_TRUE(host.verify_block(taken[0]));
  ASSERT_TRUE(host.verify_block(taken[1]));
  const std::span<std::byte> entry = host.block_bytes(0, taken[0]);
  const std::vector<std::byte> kept(entry.begin(), entry.end());
  const auto restore = [&] { std::memcpy(entry.data(), kept.data(), kept.size()); };
  for (const size_t offset : {size_t{0}, size_t{4096 + 5}, entry.size() - 1}) {
    SCOPED_TRACE(offset);
    entry[offset] ^= std::byte{0x40};
    EXPECT_FALSE(host.verify_block(taken[0]));
    restore();
    EXPECT_TRUE(host.verify_block(taken[0]));
  }
  // Block 1's bytes in block 0's place (a copy to the wrong host block).
  const std::span<std::byte> other = host.block_bytes(0, taken[1]);
  std::memcpy(entry.data(), other.data(), other.size());
  EXPECT_FALSE(host.verify_block(taken[0]));
  restore();
  // Half a copy: the second half still the entry that held the block before.
  std::memcpy(entry.data() + entry.size() / 2, other.data() + entry.size() / 2, entry.size() - entry.size() / 2);
  EXPECT_FALSE(host.verify_block(taken[0]));
}

TEST(DiskTier, StartUpErrorsNameThePath) {
  const auto parent = scratch_dir("not_a_dir");
  std::filesystem::create_directories(parent.parent_path());
  { std::ofstream file(parent); }
  try {
    DiskTier disk(parent, 8, 0, 1, 0);
    FAIL() << "a file is not a directory";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(parent.string()), std::string::npos) << error.what();
  }
  std::filesystem::remove(parent);
}

TEST(DiskTier, RemovesItsDirectoryAtShutdown) {
  const auto parent = scratch_dir("shutdown");
  std::filesystem::path dir;
  {
    DiskTier disk(parent, 16, 0, 2, 0);
    dir = disk.directory();
    disk.write_block(0, bytes_of(16, 1));
  }
  EXPECT_FALSE(std::filesystem::exists(dir));
}

// ---- Through the CacheManager: one per-token f32 tensor and (hybrid) one per-slot f32 tensor.

std::vector<CacheSpec> specs_of(bool with_slots) {
  std::vector<CacheSpec> specs = {CacheSpec{{CacheTensorSpec::per_token("k", {kRowFloats}, DType::kF32)}}};
  if (with_slots) specs.push_back(CacheSpec{{CacheTensorSpec::per_slot("s", {kSlotFloats}, DType::kF32)}});
  return specs;
}

CacheConfig tiered(int32_t device_blocks, int32_t host_blocks, int32_t disk_blocks, const std::filesystem::path& dir,
                   bool with_slots) {
  CacheConfig config;
  config.block_size = kBlockSize;
  config.num_blocks = device_blocks;
  config.enable_prefix_caching = true;
  config.state_checkpoint_interval = kBlockSize;
  config.num_state_slots = with_slots ? 2 : 0;
  config.num_checkpoint_slots = with_slots ? 1 : 0;
  config.num_host_blocks = host_blocks;
  config.num_host_slots = with_slots ? 1 : 0;
  config.disk_dir = dir;
  config.num_disk_blocks = disk_blocks;
  config.num_disk_slots = with_slots ? 4 : 0;
  return config;
}

float value_at(const std::vector<int32_t>& tokens, int64_t length, int64_t i) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t p = 0; p < length; ++p)
    h = (h ^ static_cast<uint64_t>(tokens[static_cast<size_t>(p)])) * 1099511628211ull;
  return static_cast<float>((h >> 11) % 100003) + 0.25f * static_cast<float>(i);
}

float* row(const CacheManager& cache, int64_t seq, int64_t position) {
  const int32_t block = cache.block_table(seq)[static_cast<size_t>(position / kBlockSize)];
  return cache.block_caches()[0].tensors[0].select(0, block).select(0, position % kBlockSize).data_as<float>();
}

float* slot(const CacheManager& cache, int32_t slot) {
  return cache.block_caches()[1].tensors[0].select(0, slot).data_as<float>();
}

// "The forward" over [begin, end): rows that depend on the prefix, and the state after `end`.
void compute(CacheManager& cache, int64_t seq, const std::vector<int32_t>& tokens, int64_t begin, int64_t end) {
  ASSERT_TRUE(cache.reserve(seq, end));
  for (int64_t p = begin; p < end; ++p)
    for (int64_t i = 0; i < kRowFloats; ++i) row(cache, seq, p)[i] = value_at(tokens, p + 1, i);
  if (cache.state_slot(seq) >= 0)
    for (int64_t i = 0; i < kSlotFloats; ++i) slot(cache, cache.state_slot(seq))[i] = value_at(tokens, end, 10 + i);
}

// Whether the sequence's rows [0, end) hold what compute wrote, and (with a slot) the state after `state_at`.
bool holds(const CacheManager& cache, int64_t seq, const std::vector<int32_t>& tokens, int64_t end,
           int64_t state_at = -1) {
  for (int64_t p = 0; p < end; ++p)
    for (int64_t i = 0; i < kRowFloats; ++i)
      if (row(cache, seq, p)[i] != value_at(tokens, p + 1, i)) return false;
  if (state_at >= 0)
    for (int64_t i = 0; i < kSlotFloats; ++i)
      if (slot(cache, cache.state_slot(seq))[i] != value_at(tokens, state_at, 10 + i)) return false;
  return true;
}

std::vector<int32_t> tokens_from(int32_t first, size_t count) {
  std::vector<int32_t> tokens(count);
  for (size_t i = 0; i < count; ++i) tokens[i] = first + static_cast<int32_t>(i * 3);
  return tokens;
}

void remove_files(const std::filesystem::path& dir) {
  for (const auto& entry : std::filesystem::directory_iterator(dir)) std::filesystem::remove(entry.path());
}

TEST(CacheTiers, SwappedSequencesMoveToDiskAndComeBackBitForBit) {
  for (const bool with_slots : {false, true}) {
    SCOPED_TRACE(with_slots ? "with state slots" : "paged only");
    const auto dir = scratch_dir("swap");
    CacheManager cache(specs_of(with_slots), tiered(6, 3, 8, dir, with_slots), Device::cpu());
    const auto a = tokens_from(10, 10), b = tokens_from(50, 9);
    compute(cache, 1, a, 0, 10);
    compute(cache, 2, b, 0, 9);
    ASSERT_TRUE(cache.swap_out(1));
    EXPECT_FALSE(cache.is_swapped_to_disk(1));
    // The host tier holds 3 blocks: the second swap moves the first sequence on to disk.
    ASSERT_TRUE(cache.can_swap_out(2));
    ASSERT_TRUE(cache.swap_out(2));
    EXPECT_TRUE(cache.is_swapped_to_disk(1));
    EXPECT_FALSE(cache.is_swapped_to_disk(2));
    EXPECT_EQ(cache.swap_counters().sequences_to_disk, 1);
    EXPECT_EQ(cache.disk_tier()->block_pool().num_used(), 3);
    cache.check_integrity();
    // The device blocks are overwritten meanwhile.
    compute(cache, 3, tokens_from(90, 20), 0, 20);
    cache.free_sequence(3);
    cache.prefetch(1);
    ASSERT_EQ(cache.swap_in(1), SwapIn::kDone);
    EXPECT_TRUE(holds(cache, 1, a, 10, with_slots ? 10 : -1));
    ASSERT_EQ(cache.swap_in(2), SwapIn::kDone);
    EXPECT_TRUE(holds(cache, 2, b, 9, with_slots ? 9 : -1));
    EXPECT_EQ(cache.disk_tier()->block_pool().num_used(), 0);
    EXPECT_EQ(cache.swap_counters().lost_entries, 0);
    cache.check_integrity();
  }
}

TEST(CacheTiers, SwappedSequenceLostOnDiskIsDroppedNotHandedOut) {
  for (const int damage : {0, 1, 2}) {  // deleted, truncated, a byte changed
    SCOPED_TRACE(damage);
    const auto dir = scratch_dir("lost");
    CacheManager cache(specs_of(true), tiered(6, 3, 8, dir, true), Device::cpu());
    const auto a = tokens_from(10, 10), b = tokens_from(50, 9);
    compute(cache, 1, a, 0, 10);
    compute(cache, 2, b, 0, 9);
    ASSERT_TRUE(cache.swap_out(1));
    ASSERT_TRUE(cache.swap_out(2));
    ASSERT_TRUE(cache.is_swapped_to_disk(1));
    cache.disk_tier()->drain();
    if (damage == 0) {
      remove_files(cache.disk_tier()->directory());
    } else if (damage == 1) {
      for (const auto& entry : std::filesystem::directory_iterator(cache.disk_tier()->directory()))
        std::filesystem::resize_file(entry.path(), std::filesystem::file_size(entry.path()) / 2);
    } else {
      for (const auto& entry : std::filesystem::directory_iterator(cache.disk_tier()->directory())) {
        std::fstream bytes(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
        bytes.seekp(1);
        bytes.put('\x55');
      }
    }
    EXPECT_EQ(cache.swap_in(1), SwapIn::kLost);
    EXPECT_FALSE(cache.is_swapped(1));
    EXPECT_FALSE(cache.has_sequence(1));
    EXPECT_EQ(cache.swap_counters().lost_entries, 1);
    cache.check_integrity();
    // The host tier's sequence is untouched, and the lost one can start over.
    ASSERT_EQ(cache.swap_in(2), SwapIn::kDone);
    EXPECT_TRUE(holds(cache, 2, b, 9, 9));
    compute(cache, 1, a, 0, 10);
    EXPECT_TRUE(holds(cache, 1, a, 10, 10));
    cache.check_integrity();
  }
}

// Prefix blocks evicted from the device go to the host tier and from there to disk; a later lookup
// finds them on disk. A deleted file cuts the hit before its block.
TEST(CacheTiers, PrefixBlocksComeBackFromDiskUntilTheirFileIsLost) {
  const auto dir = scratch_dir("prefix");
  CacheManager cache(specs_of(false), tiered(4, 1, 8, dir, false), Device::cpu());
  const auto prompt = tokens_from(7, 13);  // 3 full blocks before the last token
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  compute(cache, 1, prompt, 0, 13);
  cache.cache_full_blocks(1, prompt, 13);
  cache.free_sequence(1);
  // Another sequence takes every device block: the prompt's blocks go to the host (1) and disk (2).
  compute(cache, 2, tokens_from(200, 16), 0, 16);
  cache.free_sequence(2);
  const SwapCounters& counters = cache.swap_counters();
  EXPECT_EQ(counters.prefix_blocks_out, 3);
  EXPECT_EQ(counters.prefix_blocks_to_disk, 2);
  EXPECT_EQ(cache.host_tier().num_cached_blocks(), 1);
  EXPECT_EQ(cache.disk_tier()->block_pool().num_cached(), 2);
  cache.check_integrity();
  {
    const auto match = cache.begin_sequence(3, prompt, true);
    ASSERT_TRUE(match.has_value());
    EXPECT_EQ(match->cached_tokens, 12);
    EXPECT_TRUE(holds(cache, 3, prompt, 12));
    EXPECT_EQ(counters.prefix_blocks_from_disk + counters.prefix_blocks_in, 3);
    cache.check_integrity();
    cache.free_sequence(3);
  }
  // Evict them all again, then lose the disk's files: the hit stops at the first lost block.
  compute(cache, 4, tokens_from(300, 16), 0, 16);
  cache.free_sequence(4);
  cache.disk_tier()->drain();
  remove_files(cache.disk_tier()->directory());
  const int64_t lost_before = counters.lost_entries;
  const auto match = cache.begin_sequence(5, prompt, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_LT(match->cached_tokens, 12);
  EXPECT_TRUE(holds(cache, 5, prompt, match->cached_tokens));
  EXPECT_GT(counters.lost_entries, lost_before);
  cache.check_integrity();
  compute(cache, 5, prompt, match->cached_tokens, 13);
  EXPECT_TRUE(holds(cache, 5, prompt, 13));
  cache.free_sequence(5);
  cache.check_integrity();
}

// With room to keep, the least recently used cached host blocks are written to disk after a step,
// by a worker reading the host memory itself; once written they leave the host (empty), the disk
// serves their hits, and the next eviction into the host tier finds an empty block instead of
// packing one on the engine thread.
TEST(CacheTiers, HostBlocksAreWrittenToDiskAheadOfTheirEviction) {
  const auto dir = scratch_dir("write_ahead");
  CacheConfig config = tiered(4, 4, 16, dir, false);
  config.num_host_write_ahead_blocks = 2;
  CacheManager cache(specs_of(false), config, Device::cpu());
  const auto prompt = tokens_from(7, 13);  // 3 full blocks
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  compute(cache, 1, prompt, 0, 13);
  cache.cache_full_blocks(1, prompt, 13);
  cache.free_sequence(1);
  compute(cache, 2, tokens_from(200, 16), 0, 16);  // every device block: the prompt's 3 go to the host
  cache.free_sequence(2);
  const SwapCounters& counters = cache.swap_counters();
  const BlockPool& host = cache.host_tier().block_pool();
  ASSERT_EQ(host.num_cached(), 3);
  ASSERT_EQ(host.num_empty(), 1);
  EXPECT_EQ(counters.prefix_blocks_to_disk, 0);

  cache.write_back_host_blocks();  // one more empty block wanted: the oldest cached one is written
  EXPECT_EQ(counters.prefix_blocks_written_ahead, 1);
  EXPECT_EQ(counters.prefix_blocks_to_disk, 1);
  EXPECT_EQ(host.num_cached(), 2);
  EXPECT_EQ(host.num_used(), 1);  // held by the write; still a host hit meanwhile
  cache.check_integrity();
  cache.disk_tier()->drain();
  cache.write_back_host_blocks();  // landed: the host copy goes, and two are empty again
  EXPECT_EQ(host.num_empty(), 2);
  EXPECT_EQ(host.num_cached(), 2);
  EXPECT_EQ(counters.prefix_blocks_written_ahead, 1);
  cache.check_integrity();

  // The prompt hits 2 blocks on the host and 1 on disk, bit for bit.
  const auto match = cache.begin_sequence(3, prompt, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 12);
  EXPECT_TRUE(holds(cache, 3, prompt, 12));
  EXPECT_EQ(counters.prefix_blocks_from_disk, 1);
  cache.check_integrity();
  cache.free_sequence(3);
  // Evicting them again takes the empty host blocks: nothing is packed at eviction.
  compute(cache, 4, tokens_from(300, 16), 0, 16);
  cache.free_sequence(4);
  EXPECT_EQ(counters.prefix_blocks_to_disk, 1);
  cache.check_integrity();
}

// A waiting sequence's prefix reads are queued ahead of its admission; begin_sequence takes them
// (no second read), so files lost after they landed cost nothing. A sequence freed unadmitted
// drops its reads, and one whose prefix holds nothing on disk queues none.
TEST(CacheTiers, PrefetchedPrefixReadsAreTakenByTheMatch) {
  const auto dir = scratch_dir("prefetch");
  CacheManager cache(specs_of(false), tiered(4, 1, 8, dir, false), Device::cpu());
  const auto prompt = tokens_from(7, 13);
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  compute(cache, 1, prompt, 0, 13);
  cache.cache_full_blocks(1, prompt, 13);
  cache.free_sequence(1);
  const auto evict = [&](int64_t seq, int32_t first) {
    compute(cache, seq, tokens_from(first, 16), 0, 16);
    cache.free_sequence(seq);
  };
  evict(2, 200);  // the prompt's blocks: 1 on the host, 2 on disk
  const SwapCounters& counters = cache.swap_counters();
  ASSERT_EQ(cache.disk_tier()->block_pool().num_cached(), 2);
  const DiskTier& disk = *cache.disk_tier();

  cache.prefetch_prefix(3, prompt);
  cache.prefetch_prefix(3, prompt);  // once per sequence
  EXPECT_EQ(counters.prefix_prefetches, 1);
  disk.drain();
  EXPECT_FALSE(cache.reads_pending(3));
  const uint64_t read_ahead = disk.bytes_read();
  EXPECT_EQ(read_ahead, 2 * disk.block_bytes());
  remove_files(disk.directory());  // after the reads landed: nothing is lost
  const auto match = cache.begin_sequence(3, prompt, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 12);
  EXPECT_TRUE(holds(cache, 3, prompt, 12));
  EXPECT_EQ(disk.bytes_read(), read_ahead) << "the match read the disk again";
  EXPECT_EQ(counters.lost_entries, 0);
  cache.check_integrity();
  cache.free_sequence(3);

  // Freed before admission: its reads (which landed whole) are dropped, so the next match reads
  // the files again and finds them lost. (A fresh prompt: the first one's disk files are gone.)
  const auto other = tokens_from(500, 13);
  ASSERT_TRUE(cache.begin_sequence(4, other, true).has_value());
  compute(cache, 4, other, 0, 13);
  cache.cache_full_blocks(4, other, 13);
  cache.free_sequence(4);
  evict(5, 300);
  cache.prefetch_prefix(6, other);
  EXPECT_EQ(counters.prefix_prefetches, 2);
  disk.drain();
  cache.free_sequence(6);
  remove_files(disk.directory());
  const auto cold = cache.begin_sequence(6, other, true);
  ASSERT_TRUE(cold.has_value());
  EXPECT_LT(cold->cached_tokens, 12) << "the dropped reads were used";
  EXPECT_GT(counters.lost_entries, 0);
  cache.check_integrity();
  cache.free_sequence(6);

  // Nothing of this prompt is anywhere: no reads, nothing pending.
  cache.prefetch_prefix(7, tokens_from(900, 40));
  EXPECT_EQ(counters.prefix_prefetches, 2);
  EXPECT_FALSE(cache.reads_pending(7));
}

// Disk hits are read while reading a block costs less than recomputing it (the rate measured by the
// reads before); slower, the match stops at the first disk block, but every kDiskProbeInterval-th
// declined match reads anyway to measure again.
TEST(CacheTiers, DiskHitsSlowerThanRecomputeAreDeclinedButProbed) {
  const auto dir = scratch_dir("declined");
  CacheManager cache(specs_of(false), tiered(4, 1, 8, dir, false), Device::cpu());
  const auto prompt = tokens_from(7, 13);
  const auto evict_prompt = [&](int64_t other) {
    compute(cache, other, tokens_from(static_cast<int32_t>(100 * other), 16), 0, 16);
    cache.free_sequence(other);
  };
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  compute(cache, 1, prompt, 0, 13);
  cache.cache_full_blocks(1, prompt, 13);
  cache.free_sequence(1);
  evict_prompt(2);
  const SwapCounters& counters = cache.swap_counters();
  ASSERT_EQ(counters.prefix_blocks_to_disk, 2);
  cache.set_recompute_seconds_per_token(1.0);  // far slower than any disk: read
  auto match = cache.begin_sequence(3, prompt, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 12);
  ASSERT_GT(counters.prefix_blocks_from_disk, 0);  // the disk's read rate is measured now
  EXPECT_EQ(counters.disk_hits_declined, 0);
  cache.free_sequence(3);
  evict_prompt(4);
  ASSERT_GT(cache.disk_tier()->block_pool().num_cached(), 0);
  cache.set_recompute_seconds_per_token(1e-15);  // far faster than any disk: recompute
  const int64_t from_disk = counters.prefix_blocks_from_disk;
  for (int32_t i = 1; i < CacheManager::kDiskProbeInterval; ++i) {
    match = cache.begin_sequence(10 + i, prompt, true);
    ASSERT_TRUE(match.has_value());
    EXPECT_LT(match->cached_tokens, 12);
    cache.free_sequence(10 + i);
  }
  EXPECT_EQ(counters.prefix_blocks_from_disk, from_disk);
  EXPECT_EQ(counters.disk_hits_declined, CacheManager::kDiskProbeInterval - 1);
  match = cache.begin_sequence(5, prompt, true);  // the probe
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 12);
  EXPECT_TRUE(holds(cache, 5, prompt, 12));
  EXPECT_GT(counters.prefix_blocks_from_disk, from_disk);
  cache.free_sequence(5);
  cache.check_integrity();
}

// With per-slot tensors a prefix is usable only with its state checkpoint: the checkpoint leaves the
// device with its block, goes to the host tier and then to disk, and a hit restores both.
TEST(CacheTiers, HybridPrefixHitRestoresBlocksAndStateFromDisk) {
  for (const bool lose_files : {false, true}) {
    SCOPED_TRACE(lose_files ? "disk files deleted" : "disk intact");
    const auto dir = scratch_dir("hybrid");
    CacheManager cache(specs_of(true), tiered(4, 1, 8, dir, true), Device::cpu());
    const auto prompt = tokens_from(7, 9);  // checkpoint at 8 (the last block boundary before the end)
    ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
    compute(cache, 1, prompt, 0, 8);
    cache.cache_full_blocks(1, prompt, 8);
    ASSERT_TRUE(cache.is_checkpoint_position(9, 8));
    cache.checkpoint_state(1, 8);
    EXPECT_EQ(cache.num_checkpoints(), 1);
    compute(cache, 1, prompt, 8, 9);
    cache.free_sequence(1);
    // Two other prompts with their own checkpoints push the first one's block and state off the
    // device, then off the host tier (one block, one slot) onto disk.
    for (int64_t seq = 2; seq <= 3; ++seq) {
      const auto other = tokens_from(static_cast<int32_t>(100 * seq), 16);
      ASSERT_TRUE(cache.begin_sequence(seq, other, true).has_value());
      compute(cache, seq, other, 0, 12);
      cache.cache_full_blocks(seq, other, 12);
      cache.checkpoint_state(seq, 12);
      compute(cache, seq, other, 12, 16);
      cache.free_sequence(seq);
    }
    const SwapCounters& counters = cache.swap_counters();
    EXPECT_GT(counters.checkpoints_out, 0);
    EXPECT_GT(counters.prefix_blocks_to_disk, 0);
    cache.check_integrity();
    if (lose_files) {
      cache.disk_tier()->drain();
      remove_files(cache.disk_tier()->directory());
    }
    const auto match = cache.begin_sequence(4, prompt, true);
    ASSERT_TRUE(match.has_value());
    if (lose_files) {
      EXPECT_EQ(match->cached_tokens, 0);  // no state without its files: a cold start
      EXPECT_FALSE(match->restored_state);
      EXPECT_GT(counters.lost_entries, 0);
    } else {
      EXPECT_EQ(match->cached_tokens, 8);
      EXPECT_TRUE(match->restored_state);
      EXPECT_TRUE(holds(cache, 4, prompt, 8, 8));
      EXPECT_GT(counters.checkpoints_in, 0);
      EXPECT_EQ(counters.lost_entries, 0);
    }
    cache.check_integrity();
    cache.free_sequence(4);
    cache.check_integrity();
  }
}

TEST(CacheTiers, HybridBlocksStayOffTheHostWithoutCheckpointSlots) {
  // With recurrent state, a prefix is reusable only from a checkpoint: with no checkpoint slots an
  // evicted block could never be hit, so it is not copied to the host tier; with one it is.
  for (const int32_t checkpoint_slots : {0, 1}) {
    SCOPED_TRACE(std::to_string(checkpoint_slots) + " checkpoint slots");
    const auto dir = scratch_dir("hybrid_no_checkpoints");
    CacheConfig config = tiered(4, 8, 0, dir, true);
    config.disk_dir.clear();
    config.num_disk_slots = 0;
    config.num_checkpoint_slots = checkpoint_slots;
    CacheManager cache(specs_of(true), config, Device::cpu());
    for (int64_t seq = 1; seq <= 3; ++seq) {
      const auto tokens = tokens_from(static_cast<int32_t>(100 * seq), 12);
      ASSERT_TRUE(cache.begin_sequence(seq, tokens, true).has_value());
      compute(cache, seq, tokens, 0, 12);
      cache.cache_full_blocks(seq, tokens, 12);
      if (checkpoint_slots > 0) cache.checkpoint_state(seq, 12);
      cache.free_sequence(seq);
    }
    cache.check_integrity();
    if (checkpoint_slots == 0) {
      EXPECT_EQ(cache.swap_counters().prefix_blocks_out, 0);
    } else {
      EXPECT_GT(cache.swap_counters().prefix_blocks_out, 0);
    }
  }
}

TEST(CacheTiers, DiskTierNeedsAHostTier) {
  const auto dir = scratch_dir("no_host");
  CacheConfig config = tiered(4, 0, 8, dir, false);
  EXPECT_THROW(CacheManager(specs_of(false), config, Device::cpu()), Error);
}

}  // namespace
}  // namespace metrale
