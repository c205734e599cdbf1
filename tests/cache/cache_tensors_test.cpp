// Every kind of cache tensor through the CacheManager, with a fake block list that declares them all
// (no model): per-token tensors of a fixed f32 and bf16 dtype, per-group rows (one per 4 tokens) in
// the activation dtype, per-slot i32 counters, an i64 token history and an activation-dtype window.
// Checks the allocation (shapes, dtypes, bytes, the planner's byte functions), the spec validation,
// that per-group rows are shared and evicted with their block, that checkpoints copy and restore
// every per-slot tensor bit for bit (integers included), and a randomized scenario that keeps every
// tensor's contents and the manager's invariants; swapping to the host tier and back keeps every
// tensor's contents too.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <numeric>
#include <random>

#include "cache/cache_manager.h"
#include "core/test_support.h"

namespace metrale {
namespace {

using testing::throws_error;

constexpr int32_t kBlockSize = 8;
constexpr int64_t kGroup = 4;  // per-group rows: 2 per block

// Block 0: paged tensors of every kind; block 1: nothing; block 2: per-slot tensors of every dtype.
enum PagedTensor : size_t { kLatent, kIndexKeys, kPooled };
enum SlotTensor : size_t { kCount, kHistory, kWindow };

CacheSpec paged_spec() {
  return {{CacheTensorSpec::per_token("latent", {3}, DType::kF32),
           CacheTensorSpec::per_token("index_keys", {2, 2}, DType::kBF16),
           CacheTensorSpec::per_group("pooled", kGroup, {5})}};
}

CacheSpec slot_spec() {
  return {{CacheTensorSpec::per_slot("count", {2}, DType::kI32), CacheTensorSpec::per_slot("history", {3}, DType::kI64),
           CacheTensorSpec::per_slot("window", {2, 4})}};
}

std::vector<CacheSpec> every_kind() { return {paged_spec(), CacheSpec{}, slot_spec()}; }

CacheConfig config_of(int32_t num_blocks, int32_t seq_slots, int32_t checkpoints, DType activation = DType::kF32) {
  CacheConfig config;
  config.block_size = kBlockSize;
  config.num_blocks = num_blocks;
  config.activation_dtype = activation;
  config.num_state_slots = seq_slots;
  config.num_checkpoint_slots = checkpoints;
  config.enable_prefix_caching = true;
  config.state_checkpoint_interval = kBlockSize;
  return config;
}

// ---- What a "forward" writes: every value is a function of the sequence's tokens up to it.

uint64_t prefix_hash(const std::vector<int32_t>& tokens, int64_t length) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t p = 0; p < length; ++p) h = (h ^ static_cast<uint64_t>(tokens[static_cast<size_t>(p)])) * 1099511628211ull;
  return h;
}

struct TokenRow {
  float latent[3];
  uint16_t index_keys[4];  // bf16 bits
  bool operator==(const TokenRow& other) const { return std::memcmp(this, &other, sizeof(TokenRow)) == 0; }
};
TokenRow token_row(const std::vector<int32_t>& tokens, int64_t position) {
  const uint64_t h = prefix_hash(tokens, position + 1);
  TokenRow row{};
  row.latent[0] = static_cast<float>(h % 1000003);
  row.latent[1] = static_cast<float>(position);
  row.latent[2] = -1.5f;
  for (int i = 0; i < 4; ++i) row.index_keys[i] = f32_to_bf16_bits(static_cast<float>((h >> (8 * i)) % 251));
  return row;
}

std::array<float, 5> group_row(const std::vector<int32_t>& tokens, int64_t group) {
  const uint64_t h = prefix_hash(tokens, (group + 1) * kGroup);
  return {static_cast<float>(h % 1000003), static_cast<float>(group), 0.25f, static_cast<float>(h % 17), 7.0f};
}

struct SlotState {
  int32_t count[2];
  int64_t history[3];
  float window[8];
  bool operator==(const SlotState& other) const { return std::memcmp(this, &other, sizeof(SlotState)) == 0; }
};
// The state after the first `length` tokens; the i64 entries need all 64 bits.
SlotState slot_state(const std::vector<int32_t>& tokens, int64_t length) {
  const uint64_t h = prefix_hash(tokens, length);
  SlotState state{};
  state.count[0] = static_cast<int32_t>(length);
  state.count[1] = -static_cast<int32_t>(h % 100000);
  state.history[0] = static_cast<int64_t>(h);
  state.history[1] = (int64_t{1} << 40) + length;
  state.history[2] = -static_cast<int64_t>(h >> 3);
  for (int i = 0; i < 8; ++i) state.window[i] = static_cast<float>(h % 1000) + static_cast<float>(i);
  return state;
}

// Views of one sequence's rows in the manager's tensors (CPU memory).
class Rows {
 public:
  explicit Rows(const CacheManager& cache) : cache_(cache) {}

  const BlockCache& paged() const { return cache_.block_caches()[0]; }
  const BlockCache& slots() const { return cache_.block_caches()[2]; }

  int32_t block_of(int64_t seq, int64_t position) const {
    return cache_.block_table(seq)[static_cast<size_t>(position / kBlockSize)];
  }
  void write_token(int64_t seq, int64_t position, const TokenRow& row) const {
    const int32_t block = block_of(seq, position);
    std::memcpy(paged().tensors[kLatent].select(0, block).select(0, position % kBlockSize).data(), row.latent,
                sizeof(row.latent));
    std::memcpy(paged().tensors[kIndexKeys].select(0, block).select(0, position % kBlockSize).data(), row.index_keys,
                sizeof(row.index_keys));
  }
  TokenRow read_token(int64_t seq, int64_t position) const {
    const int32_t block = block_of(seq, position);
    TokenRow row{};
    std::memcpy(row.latent, paged().tensors[kLatent].select(0, block).select(0, position % kBlockSize).data(),
                sizeof(row.latent));
    std::memcpy(row.index_keys, paged().tensors[kIndexKeys].select(0, block).select(0, position % kBlockSize).data(),
                sizeof(row.index_keys));
    return row;
  }
  // Group g sits in the block of its last token, at row g % (block_size / group_size).
  float* group(int64_t seq, int64_t g) const {
    const int32_t block = block_of(seq, (g + 1) * kGroup - 1);
    return paged().tensors[kPooled].select(0, block).select(0, g % (kBlockSize / kGroup)).data_as<float>();
  }
  void write_group(int64_t seq, int64_t g, const std::array<float, 5>& values) const {
    std::memcpy(group(seq, g), values.data(), sizeof(values));
  }
  std::array<float, 5> read_group(int64_t seq, int64_t g) const {
    std::array<float, 5> values{};
    std::memcpy(values.data(), group(seq, g), sizeof(values));
    return values;
  }
  void write_slot(int32_t slot, const SlotState& state) const {
    std::memcpy(slots().tensors[kCount].select(0, slot).data(), state.count, sizeof(state.count));
    std::memcpy(slots().tensors[kHistory].select(0, slot).data(), state.history, sizeof(state.history));
    std::memcpy(slots().tensors[kWindow].select(0, slot).data(), state.window, sizeof(state.window));
  }
  SlotState read_slot(int32_t slot) const {
    SlotState state{};
    std::memcpy(state.count, slots().tensors[kCount].select(0, slot).data(), sizeof(state.count));
    std::memcpy(state.history, slots().tensors[kHistory].select(0, slot).data(), sizeof(state.history));
    std::memcpy(state.window, slots().tensors[kWindow].select(0, slot).data(), sizeof(state.window));
    return state;
  }
  // "The forward" over positions [begin, end) of `tokens`: per-token rows, the rows of the groups
  // that complete, and (with slots) the state after `end`.
  void compute(int64_t seq, const std::vector<int32_t>& tokens, int64_t begin, int64_t end) const {
    for (int64_t p = begin; p < end; ++p) {
      write_token(seq, p, token_row(tokens, p));
      if ((p + 1) % kGroup == 0) write_group(seq, p / kGroup, group_row(tokens, p / kGroup));
    }
    if (cache_.state_slot(seq) >= 0) write_slot(cache_.state_slot(seq), slot_state(tokens, end));
  }

 private:
  const CacheManager& cache_;
};

std::vector<int32_t> iota_tokens(size_t count, int32_t first) {
  std::vector<int32_t> tokens(count);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

TEST(CacheTensors, EveryKindGetsItsShapeDtypeAndBytes) {
  for (const DType activation : {DType::kF32, DType::kBF16}) {
    const size_t act = dtype_size(activation);
    const CacheManager cache(every_kind(), config_of(6, 3, 2, activation), Device::cpu());
    ASSERT_TRUE(cache.has_recurrent_state());
    EXPECT_EQ(cache.num_state_slots(), 5);
    EXPECT_EQ(cache.padding_state_slot(), 5);  // 3 sequences + 2 checkpoints, then the padding slot
    const auto caches = cache.block_caches();
    ASSERT_EQ(caches.size(), 3u);
    ASSERT_EQ(caches[0].tensors.size(), 3u);
    EXPECT_TRUE(caches[1].tensors.empty());
    ASSERT_EQ(caches[2].tensors.size(), 3u);
    const struct {
      const Tensor& tensor;
      Shape shape;
      DType dtype;
    } expected[] = {
        {caches[0].tensors[kLatent], Shape{6, 8, 3}, DType::kF32},
        {caches[0].tensors[kIndexKeys], Shape{6, 8, 2, 2}, DType::kBF16},
        {caches[0].tensors[kPooled], Shape{6, 2, 5}, activation},  // block_size / group_size rows per block
        {caches[2].tensors[kCount], Shape{6, 2}, DType::kI32},
        {caches[2].tensors[kHistory], Shape{6, 3}, DType::kI64},
        {caches[2].tensors[kWindow], Shape{6, 2, 4}, activation},
    };
    for (const auto& e : expected) {
      EXPECT_TRUE(e.tensor.shape() == e.shape) << e.tensor.describe() << " vs " << e.shape.to_string();
      EXPECT_EQ(e.tensor.dtype(), e.dtype) << e.tensor.describe();
      EXPECT_TRUE(e.tensor.is_contiguous());
    }
    // The planner's byte functions and the memory the manager holds agree.
    const uint64_t per_block = 8 * 3 * 4 + 8 * 4 * 2 + 2 * 5 * act;
    const uint64_t per_slot = 2 * 4 + 3 * 8 + 8 * act;
    const std::vector<CacheSpec> specs = every_kind();
    EXPECT_EQ(paged_bytes_per_block(specs, kBlockSize, activation), per_block);
    EXPECT_EQ(slot_bytes_per_slot(specs, activation), per_slot);
    EXPECT_GE(cache.kv_memory_bytes(), 6 * per_block);
    EXPECT_LT(cache.kv_memory_bytes(), 6 * per_block + 3 * Buffer::kAlignment);
    EXPECT_GE(cache.state_memory_bytes(), 6 * per_slot);
    EXPECT_LT(cache.state_memory_bytes(), 6 * per_slot + 3 * Buffer::kAlignment);
    // Every per-slot tensor starts as zeros, integers included.
    for (const Tensor& tensor : caches[2].tensors) {
      const auto* bytes = static_cast<const uint8_t*>(tensor.data());
      EXPECT_TRUE(std::all_of(bytes, bytes + tensor.nbytes(), [](uint8_t b) { return b == 0; })) << tensor.describe();
    }
    EXPECT_NO_THROW(cache.check_integrity());
  }
  // Per-group tensors alone: paged, no slots.
  const CacheManager paged_only(std::vector<CacheSpec>{paged_spec()}, config_of(4, 3, 2), Device::cpu());
  EXPECT_FALSE(paged_only.has_recurrent_state());
  EXPECT_EQ(paged_only.state_memory_bytes(), 0u);
  EXPECT_EQ(paged_only.padding_state_slot(), -1);
}

TEST(CacheTensors, SpecsThatCannotBeAllocatedAreRejectedWithTheirName) {
  const auto rejects = [](CacheTensorSpec tensor, std::vector<std::string> fragments) {
    const std::vector<CacheSpec> specs = {CacheSpec{}, CacheSpec{{CacheTensorSpec::per_token("k", {2}), tensor}}};
    fragments.push_back("cache 1");
    return throws_error([&] { CacheManager cache(specs, config_of(4, 2, 0), Device::cpu()); },
                        ErrorCode::kInvalidArgument, fragments);
  };
  EXPECT_TRUE(rejects(CacheTensorSpec::per_group("pooled", 3, {4}), {"'pooled'", "group size 3", "block size 8"}));
  EXPECT_TRUE(rejects(CacheTensorSpec::per_group("pooled", 0, {4}), {"'pooled'", "group size 0"}));
  EXPECT_TRUE(rejects(CacheTensorSpec::per_slot("conv", {3, 0}), {"'conv'", "dimension 0"}));
  EXPECT_TRUE(rejects(CacheTensorSpec::per_token("k", {2}), {"'k'", "used twice"}));
  EXPECT_TRUE(rejects(CacheTensorSpec::per_token("", {2}), {"no name"}));
  EXPECT_TRUE(rejects(CacheTensorSpec::per_token("deep", {2, 2, 2, 2, 2}), {"'deep'", "5 dims"}));
  CacheTensorSpec grouped_token = CacheTensorSpec::per_token("latent", {2});
  grouped_token.group_size = 4;
  EXPECT_TRUE(rejects(grouped_token, {"'latent'", "not per group"}));
  // Five dims per slot fit (one leading index), five per token do not (two).
  EXPECT_NO_THROW(check_cache_spec({{CacheTensorSpec::per_slot("deep", {2, 2, 2, 2, 2})}}, 8, "ok"));
}

TEST(CacheTensors, PerGroupRowsAreSharedAndCachedWithTheirBlock) {
  CacheManager cache(std::vector<CacheSpec>{paged_spec()}, config_of(8, 2, 0), Device::cpu());
  const Rows rows(cache);
  const std::vector<int32_t> prompt = iota_tokens(20, 3);
  ASSERT_EQ(cache.begin_sequence(1, prompt, true)->cached_tokens, 0);
  ASSERT_TRUE(cache.reserve(1, 20));
  rows.compute(1, prompt, 0, 20);  // groups 0..4 complete
  cache.cache_full_blocks(1, prompt, 20);
  const std::vector<int32_t> first_blocks(cache.block_table(1).begin(), cache.block_table(1).begin() + 2);
  cache.free_sequence(1);
  cache.check_integrity();

  // The same first 17 tokens: the two full blocks are reused, and with them groups 0..3.
  std::vector<int32_t> other(prompt.begin(), prompt.begin() + 17);
  other.insert(other.end(), {90, 91, 92, 93, 94});
  const auto match = cache.begin_sequence(2, other, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 16);
  EXPECT_FALSE(match->restored_state);  // nothing per slot to restore
  EXPECT_EQ(std::vector<int32_t>(cache.block_table(2).begin(), cache.block_table(2).end()), first_blocks);
  for (int64_t p = 0; p < 16; ++p) EXPECT_EQ(rows.read_token(2, p), token_row(prompt, p)) << "position " << p;
  for (int64_t g = 0; g < 4; ++g) EXPECT_EQ(rows.read_group(2, g), group_row(prompt, g)) << "group " << g;
  // Its own groups land in its own block; the shared ones stay as they are.
  ASSERT_TRUE(cache.reserve(2, 22));
  rows.compute(2, other, 16, 22);
  EXPECT_NE(rows.block_of(2, 16), first_blocks[0]);
  EXPECT_NE(rows.block_of(2, 16), first_blocks[1]);
  EXPECT_EQ(rows.read_group(2, 4), group_row(other, 4));
  EXPECT_NE(group_row(other, 4), group_row(prompt, 4));
  for (int64_t g = 0; g < 4; ++g) EXPECT_EQ(rows.read_group(2, g), group_row(prompt, g));
  // A prompt that differs in its first token shares nothing.
  std::vector<int32_t> fresh = prompt;
  fresh[0] = 77;
  EXPECT_EQ(cache.begin_sequence(3, fresh, true)->cached_tokens, 0);
  cache.check_integrity();
}

TEST(CacheTensors, CheckpointsCopyAndRestoreEveryPerSlotTensorBitForBit) {
  CacheManager cache(every_kind(), config_of(16, 4, 3), Device::cpu());
  const Rows rows(cache);
  const std::vector<int32_t> prompt = iota_tokens(21, 40);
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  for (const int64_t end : {8, 16}) {  // chunks ending at checkpoint points
    const int64_t begin = end - 8;
    ASSERT_TRUE(cache.reserve(1, end));
    rows.compute(1, prompt, begin, end);
    cache.cache_full_blocks(1, prompt, end);
    cache.checkpoint_state(1, end);
  }
  EXPECT_EQ(cache.num_checkpoints(), 2);
  ASSERT_TRUE(cache.reserve(1, 21));
  rows.compute(1, prompt, 16, 21);  // the sequence moves on; the checkpoints keep their copies
  EXPECT_EQ(rows.read_slot(cache.state_slot(1)), slot_state(prompt, 21));

  // The whole prompt again: 16 tokens with the state after them.
  const auto whole = cache.begin_sequence(2, prompt, true);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->cached_tokens, 16);
  EXPECT_TRUE(whole->restored_state);
  EXPECT_EQ(rows.read_slot(cache.state_slot(2)), slot_state(prompt, 16));
  // Its first block only: the state after 8 tokens.
  std::vector<int32_t> eight(prompt.begin(), prompt.begin() + 12);
  const auto part = cache.begin_sequence(3, eight, true);
  ASSERT_TRUE(part.has_value());
  EXPECT_EQ(part->cached_tokens, 8);
  EXPECT_EQ(rows.read_slot(cache.state_slot(3)), slot_state(prompt, 8));
  // A direct slot copy moves every per-slot tensor, whatever its dtype.
  cache.copy_state_slot(cache.state_slot(3), cache.state_slot(1));
  EXPECT_EQ(rows.read_slot(cache.state_slot(3)), slot_state(prompt, 21));
  EXPECT_EQ(rows.read_slot(cache.state_slot(2)), slot_state(prompt, 16));
  cache.check_integrity();
  // Freeing returns the slots; a new sequence reuses one and starts from a checkpoint again.
  for (const int64_t seq : {1, 2, 3}) cache.free_sequence(seq);
  EXPECT_EQ(cache.num_state_slots_used(), 2);  // the checkpoints
  ASSERT_EQ(cache.begin_sequence(4, prompt, true)->cached_tokens, 16);
  EXPECT_EQ(rows.read_slot(cache.state_slot(4)), slot_state(prompt, 16));
  cache.check_integrity();
}

TEST(CacheTensors, EvictionTakesPerGroupRowsAndCheckpointsWithTheBlock) {
  CacheManager cache(every_kind(), config_of(4, 2, 2), Device::cpu());  // 4 blocks of 8 tokens
  const Rows rows(cache);
  const std::vector<int32_t> prompt = iota_tokens(17, 1);
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  ASSERT_TRUE(cache.reserve(1, 16));
  rows.compute(1, prompt, 0, 16);
  cache.cache_full_blocks(1, prompt, 16);
  cache.checkpoint_state(1, 8);
  cache.checkpoint_state(1, 16);
  cache.free_sequence(1);
  EXPECT_EQ(cache.pool().num_cached(), 2);
  EXPECT_EQ(cache.num_checkpoints(), 2);

  // A 32-token sequence needs every block: the two cached ones are evicted with their checkpoints,
  // and their per-group rows become the new sequence's.
  const std::vector<int32_t> other = iota_tokens(33, 200);
  ASSERT_EQ(cache.begin_sequence(2, other, true)->cached_tokens, 0);
  ASSERT_TRUE(cache.reserve(2, 32));
  EXPECT_EQ(cache.pool().num_cached(), 0);
  EXPECT_EQ(cache.num_checkpoints(), 0);
  EXPECT_EQ(cache.prefix_cache().size(), 0u);
  rows.compute(2, other, 0, 32);
  for (int64_t g = 0; g < 8; ++g) EXPECT_EQ(rows.read_group(2, g), group_row(other, g));
  cache.check_integrity();
  cache.free_sequence(2);
  // The first prompt finds nothing any more.
  const auto again = cache.begin_sequence(3, prompt, true);
  EXPECT_EQ(again->cached_tokens, 0);
  EXPECT_FALSE(again->restored_state);
  cache.check_integrity();
}

// Sequences admitted from shared stems compute chunks, get preempted and finish at random, with
// checkpoints at block boundaries and too few checkpoint slots for all of them: after every action
// each live sequence's per-token rows, per-group rows and slot hold exactly what its own tokens
// wrote (shared blocks included), a prefix hit restores exactly the state of its length, and the
// manager's invariants hold.
TEST(CacheTensors, RandomizedScenarioKeepsEveryTensorsContents) {
  const int32_t num_blocks = 20, seq_slots = 5;
  CacheManager cache(every_kind(), config_of(num_blocks, seq_slots, 3), Device::cpu());
  const Rows rows(cache);
  std::mt19937_64 rng(9119);
  const std::vector<std::vector<int32_t>> stems = {iota_tokens(26, 1), iota_tokens(17, 60), std::vector<int32_t>(12, 5)};
  struct Live {
    std::vector<int32_t> tokens;
    int64_t computed = 0;
  };
  std::map<int64_t, Live> live;
  int64_t next_id = 0, hits = 0, restores_checked = 0;
  for (int step = 0; step < 2500; ++step) {
    const int action = static_cast<int>(rng() % 10);
    if (action < 3 && static_cast<int32_t>(live.size()) < seq_slots) {  // admit
      Live sequence;
      sequence.tokens = stems[rng() % stems.size()];
      sequence.tokens.resize(sequence.tokens.size() - rng() % 6);
      for (int extra = static_cast<int>(rng() % 6); extra > 0; --extra) sequence.tokens.push_back(static_cast<int32_t>(rng() % 7));
      const int64_t id = next_id++;
      const auto match = cache.begin_sequence(id, sequence.tokens, true);
      ASSERT_TRUE(match.has_value());
      ASSERT_EQ(match->cached_tokens % kBlockSize, 0);
      // With per-slot state a prefix counts only with the state after it.
      ASSERT_EQ(match->restored_state, match->cached_tokens > 0);
      sequence.computed = match->cached_tokens;
      if (match->restored_state) {
        ++hits;
        ASSERT_EQ(rows.read_slot(cache.state_slot(id)), slot_state(sequence.tokens, sequence.computed))
            << "step " << step << ": restored state of " << sequence.computed << " tokens";
        ++restores_checked;
      }
      live.emplace(id, std::move(sequence));
    } else if (action < 8 && !live.empty()) {  // compute a chunk, ending on a block boundary half the time
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      Live& sequence = it->second;
      if (sequence.computed == static_cast<int64_t>(sequence.tokens.size())) sequence.tokens.push_back(static_cast<int32_t>(rng() % 7));
      int64_t end = sequence.computed + 1 + static_cast<int64_t>(rng() % 9);
      if (rng() % 2 == 0) end = (sequence.computed / kBlockSize + 1) * kBlockSize;
      end = std::min<int64_t>(end, static_cast<int64_t>(sequence.tokens.size()));
      if (!cache.reserve(it->first, end)) {
        cache.free_sequence(it->first);  // preempted: its references go, cached blocks stay
        live.erase(it);
      } else {
        for (int64_t p = sequence.computed; p < end; ++p)
          ASSERT_EQ(cache.pool().ref_count(rows.block_of(it->first, p)), 1) << "a write into a shared block";
        rows.compute(it->first, sequence.tokens, sequence.computed, end);
        sequence.computed = end;
        cache.cache_full_blocks(it->first, sequence.tokens, end);
        if (end % kBlockSize == 0) cache.checkpoint_state(it->first, end);
      }
    } else if (!live.empty()) {  // finish
      auto it = live.begin();
      std::advance(it, static_cast<long>(rng() % live.size()));
      cache.free_sequence(it->first);
      live.erase(it);
    }
    for (const auto& [id, sequence] : live) {
      for (int64_t p = 0; p < sequence.computed; ++p)
        ASSERT_EQ(rows.read_token(id, p), token_row(sequence.tokens, p)) << "sequence " << id << " position " << p;
      for (int64_t g = 0; (g + 1) * kGroup <= sequence.computed; ++g)
        ASSERT_EQ(rows.read_group(id, g), group_row(sequence.tokens, g)) << "sequence " << id << " group " << g;
      if (sequence.computed > 0) {
        ASSERT_EQ(rows.read_slot(cache.state_slot(id)), slot_state(sequence.tokens, sequence.computed))
            << "sequence " << id << " at step " << step;
      }
    }
    ASSERT_NO_THROW(cache.check_integrity()) << "step " << step;
  }
  EXPECT_GT(hits, 50) << "the scenario is meant to restore checkpoints often";
  EXPECT_EQ(restores_checked, hits);
  for (const auto& [id, sequence] : live) cache.free_sequence(id);
  EXPECT_EQ(cache.pool().num_used(), 0);
  cache.check_integrity();
}

// The host tier: a swapped-out sequence comes back in other device blocks and another slot with
// every paged tensor's rows (per token and per group, f32 and bf16) and every per-slot tensor's
// entry (i32, i64, activation dtype) exactly as they were, though its old blocks were overwritten.
TEST(CacheTensors, SwapOutAndInKeepsEveryTensorsContents) {
  CacheConfig config = config_of(6, 3, 0);
  config.num_host_blocks = 4;
  config.num_host_slots = 1;
  CacheManager cache(every_kind(), config, Device::cpu());
  const Rows rows(cache);
  const std::vector<int32_t> first = iota_tokens(21, 40), second = iota_tokens(10, 90);
  ASSERT_TRUE(cache.begin_sequence(1, first, false).has_value());
  ASSERT_TRUE(cache.reserve(1, 21));
  rows.compute(1, first, 0, 21);
  cache.cache_full_blocks(1, first, 21);
  ASSERT_TRUE(cache.begin_sequence(2, second, false).has_value());
  ASSERT_TRUE(cache.reserve(2, 10));
  rows.compute(2, second, 0, 10);
  const std::vector<int32_t> old_table(cache.block_table(1).begin(), cache.block_table(1).end());
  const int32_t old_slot = cache.state_slot(1);

  ASSERT_TRUE(cache.swap_out(1));
  EXPECT_FALSE(cache.has_sequence(1));
  EXPECT_TRUE(cache.is_swapped(1));
  EXPECT_EQ(cache.swapped_blocks(1), 3);
  EXPECT_EQ(cache.host_tier().num_used_blocks(), 3);
  EXPECT_EQ(cache.host_tier().num_used_slots(), 1);
  EXPECT_EQ(cache.pool().num_used(), 2);    // the second sequence's
  EXPECT_EQ(cache.pool().num_cached(), 2);  // the first one's full blocks stay cached
  EXPECT_EQ(cache.num_state_slots_used(), 1);
  cache.check_integrity();
  // The tier is full: the second sequence stays resident, unchanged.
  EXPECT_FALSE(cache.can_swap_out(2));
  EXPECT_FALSE(cache.swap_out(2));
  EXPECT_TRUE(cache.has_sequence(2));
  EXPECT_EQ(cache.host_tier().num_used_blocks(), 3);

  // Another sequence takes every free block (evicting the cached ones) and the old slot, and writes them.
  const std::vector<int32_t> other = iota_tokens(32, 7);
  ASSERT_TRUE(cache.begin_sequence(3, other, false).has_value());
  EXPECT_EQ(cache.state_slot(3), old_slot);
  ASSERT_TRUE(cache.reserve(3, 32));
  rows.compute(3, other, 0, 32);
  for (const int32_t block : old_table)
    EXPECT_NE(std::find(cache.block_table(3).begin(), cache.block_table(3).end(), block), cache.block_table(3).end());
  // No room to come back while it holds them.
  EXPECT_FALSE(cache.can_swap_in(1, 22));
  EXPECT_EQ(cache.swap_in(1), SwapIn::kNoRoom);
  EXPECT_TRUE(cache.is_swapped(1));
  cache.free_sequence(3);

  ASSERT_TRUE(cache.can_swap_in(1, 22));
  ASSERT_EQ(cache.swap_in(1), SwapIn::kDone);
  EXPECT_TRUE(cache.has_sequence(1));
  EXPECT_FALSE(cache.is_swapped(1));
  EXPECT_EQ(cache.host_tier().num_used_blocks(), 0);
  EXPECT_EQ(cache.host_tier().num_used_slots(), 0);
  for (int64_t p = 0; p < 21; ++p) EXPECT_EQ(rows.read_token(1, p), token_row(first, p)) << "position " << p;
  for (int64_t g = 0; g < 21 / kGroup; ++g) EXPECT_EQ(rows.read_group(1, g), group_row(first, g)) << "group " << g;
  EXPECT_EQ(rows.read_slot(cache.state_slot(1)), slot_state(first, 21));
  for (int64_t p = 0; p < 10; ++p) EXPECT_EQ(rows.read_token(2, p), token_row(second, p));
  cache.check_integrity();
  // It goes on as if it had never left; its full blocks are indexed again.
  std::vector<int32_t> longer = first;
  for (int32_t t = 0; t < 9; ++t) longer.push_back(200 + t);
  ASSERT_TRUE(cache.reserve(1, 30));
  rows.compute(1, longer, 21, 30);
  cache.cache_full_blocks(1, longer, 30);
  for (int64_t p = 0; p < 30; ++p) EXPECT_EQ(rows.read_token(1, p), token_row(longer, p));
  cache.check_integrity();

  // A swapped sequence that is freed (finished, aborted) gives its host blocks and slot back.
  ASSERT_TRUE(cache.swap_out(2));
  cache.free_sequence(2);
  EXPECT_FALSE(cache.is_swapped(2));
  EXPECT_EQ(cache.host_tier().num_used_blocks(), 0);
  EXPECT_EQ(cache.host_tier().num_used_slots(), 0);
  const SwapCounters& counters = cache.swap_counters();
  EXPECT_EQ(counters.sequences_out, 2);
  EXPECT_EQ(counters.sequences_in, 1);
  EXPECT_EQ(counters.blocks_out, 3 + 2);  // 21 tokens, then 10
  EXPECT_EQ(counters.blocks_in, 3);
  EXPECT_EQ(counters.slots_out, 2);
  EXPECT_EQ(counters.slots_in, 1);
  cache.free_sequence(1);
  EXPECT_EQ(cache.pool().num_used(), 0);
  cache.check_integrity();
}

TEST(CacheTensors, SwapNeedsTheTierAndAFreeSlot) {
  CacheManager untiered(every_kind(), config_of(6, 2, 0), Device::cpu());
  ASSERT_TRUE(untiered.reserve(1, 8));
  EXPECT_FALSE(untiered.can_swap_out(1));
  EXPECT_FALSE(untiered.swap_out(1));
  EXPECT_TRUE(untiered.has_sequence(1));

  CacheConfig config = config_of(6, 2, 0);
  config.num_host_blocks = 4;
  config.num_host_slots = 2;
  CacheManager cache(every_kind(), config, Device::cpu());
  const Rows rows(cache);
  const std::vector<int32_t> tokens = iota_tokens(8, 3);
  ASSERT_TRUE(cache.reserve(1, 8));
  rows.compute(1, tokens, 0, 8);
  ASSERT_TRUE(cache.swap_out(1));
  // Both sequence slots taken: it cannot come back, though blocks are free.
  ASSERT_TRUE(cache.reserve(2, 1));
  ASSERT_TRUE(cache.reserve(3, 1));
  EXPECT_FALSE(cache.can_swap_in(1, 8));
  EXPECT_EQ(cache.swap_in(1), SwapIn::kNoRoom);
  EXPECT_THROW(cache.reserve(1, 8), Error);  // a swapped sequence cannot grow in place
  cache.free_sequence(3);
  ASSERT_EQ(cache.swap_in(1), SwapIn::kDone);
  EXPECT_EQ(rows.read_slot(cache.state_slot(1)), slot_state(tokens, 8));
  for (int64_t p = 0; p < 8; ++p) EXPECT_EQ(rows.read_token(1, p), token_row(tokens, p));
  cache.check_integrity();
}

// Prefix blocks evicted from the device go to the host tier (every paged tensor's rows), and a
// lookup that misses on the device but hits there brings them back into fresh device blocks.
TEST(CacheTensors, EvictedPrefixBlocksComeBackFromTheHostTier) {
  const std::vector<CacheSpec> specs = {paged_spec(), CacheSpec{}};
  CacheConfig config = config_of(4, 0, 0);
  config.num_host_blocks = 3;
  CacheManager cache(specs, config, Device::cpu());
  const Rows rows(cache);
  const std::vector<int32_t> prompt = iota_tokens(17, 40), other = iota_tokens(32, 100);
  ASSERT_TRUE(cache.begin_sequence(1, prompt, true).has_value());
  ASSERT_TRUE(cache.reserve(1, 17));
  rows.compute(1, prompt, 0, 17);
  cache.cache_full_blocks(1, prompt, 17);
  cache.free_sequence(1);
  EXPECT_EQ(cache.pool().num_cached(), 2);
  // Another sequence takes every block: the two cached ones are evicted, into the host tier.
  ASSERT_TRUE(cache.begin_sequence(2, other, true).has_value());
  ASSERT_TRUE(cache.reserve(2, 32));
  rows.compute(2, other, 0, 32);
  EXPECT_EQ(cache.pool().num_cached(), 0);
  EXPECT_EQ(cache.host_tier().num_cached_blocks(), 2);
  EXPECT_EQ(cache.swap_counters().prefix_blocks_out, 2);
  cache.check_integrity();
  // No device block free: the lookup finds them on the host but cannot bring them back.
  ASSERT_EQ(cache.begin_sequence(3, prompt, true)->cached_tokens, 0);
  cache.free_sequence(3);
  cache.free_sequence(2);  // its blocks were never indexed: empty
  // Now they come back, with every row as it was computed.
  const auto match = cache.begin_sequence(4, prompt, true);
  ASSERT_TRUE(match.has_value());
  EXPECT_EQ(match->cached_tokens, 16);
  EXPECT_EQ(cache.swap_counters().prefix_blocks_in, 2);
  for (int64_t p = 0; p < 16; ++p) EXPECT_EQ(rows.read_token(4, p), token_row(prompt, p)) << "position " << p;
  for (int64_t g = 0; g < 4; ++g) EXPECT_EQ(rows.read_group(4, g), group_row(prompt, g)) << "group " << g;
  EXPECT_EQ(cache.prefix_cache().size(), 2u);  // indexed on the device again
  cache.check_integrity();
  // A swap needs host blocks: it evicts the host's cached prefix blocks, least recently used first.
  ASSERT_TRUE(cache.reserve(4, 17));
  rows.compute(4, prompt, 16, 17);
  ASSERT_TRUE(cache.swap_out(4));
  EXPECT_EQ(cache.host_tier().num_used_blocks(), 3);
  EXPECT_EQ(cache.host_tier().num_cached_blocks(), 0);
  EXPECT_EQ(cache.host_prefix_cache().size(), 0u);
  cache.check_integrity();
  ASSERT_EQ(cache.swap_in(4), SwapIn::kDone);
  for (int64_t p = 0; p < 17; ++p) EXPECT_EQ(rows.read_token(4, p), token_row(prompt, p));
  cache.free_sequence(4);
  cache.check_integrity();
}

}  // namespace
}  // namespace metrale
